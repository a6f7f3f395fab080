"""The hand-written loop (``--runtime hf-loop``, ``costmodel/timeline/hf_loop.py``) over what the Trainer's run
follows beyond Llama's layout: PEFT LoRA / QLoRA over Qwen3, Phi-3, OLMo 2, Gemma 2 and Gemma 3, sliding windows
the sequence reaches (Gemma 3, Phi-3, Mistral, Qwen2), and ``save_on_cpu`` activation offload over those families.
Each against the real loop on CPU, the peak of live storages over three steps (``StorageTracker``) equal to the byte.

The loop composes the Trainer's modules (``hf_lora.py``, ``hf_bnb.py``, ``hf_families.py``, ``hf_gemma.py``,
``hf_sliding.py``, ``act_offload.py``) under its own step; what it adds is the ``DynamicCache`` kept with ``out``
to the next forward. Over a reached window each sliding cache layer is a ``DynamicSlidingWindowLayer``
(transformers 5.23 cache_utils.py: ``get_layer_types_and_kwargs`` makes one where the config's layer is sliding,
Mistral's and Phi-3's every layer when they have a window and no ``layer_types``): its ``update`` concatenates
the whole sequence, keeps ``full[:, :, -window + 1:, :]`` (a view: the whole copy's storage stays with ``out``) and
hands attention the whole copy, so the loop's cache holds what a ``DynamicLayer`` holds, plus the layer's int64
``_sliding_window_tensor`` made with the cache; the mask and SDPA are the Trainer's (``hf_sliding.py``).

The cases are test_timeline_hf_peft_families.py's and test_timeline_hf_sliding.py's, run through the hand loop
(peft_steps' loop: AdamW over the adapters; hf_steps.measure_hand) and offload_steps' ``save_on_cpu`` emulation.
The plan of a case: ``peft_steps.plan_of(case, "hf")`` (a bf16 or 4-bit base under autocast is ``bf16`` with the
plan's ``autocast``, as the loop runs it: tests/unit/test_plan_autocast.py). Checkpointing is transformers'
``gradient_checkpointing_enable()`` (non-reentrant); PEFT's ``prepare_model_for_kbit_training`` enables reentrant
checkpointing unless told otherwise (``reentrant.py``: one case below). A few cases run by default (seconds); the
rest under ``-m slow``.
"""

from __future__ import annotations

import dataclasses

import pytest
from estimate_json import estimate_memory as _estimate

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
from storage_tracker import StorageTracker  # noqa: E402
from test_timeline_hf_loop_families import _run  # noqa: E402
from test_timeline_hf_peft_families import CASES as TRAINER_LORA  # noqa: E402
from test_timeline_hf_peft_families import QLORA_RECIPE  # noqa: E402
from test_timeline_hf_peft_families import _case as _lora  # noqa: E402
from test_timeline_hf_sliding import CASES as TRAINER_WINDOWS  # noqa: E402
from test_timeline_hf_sliding import LORA as TRAINER_WINDOW_LORA  # noqa: E402
from test_timeline_hf_sliding import _plan, spec  # noqa: E402

from memplan.costmodel.timeline.hf_bnb import Bnb4bit  # noqa: E402
from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_loop import hf_loop_run  # noqa: E402
from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3


def _loop(case, name: str | None = None):  # noqa: ANN001, ANN202
    """A Trainer suite's case renamed for the loop (``loop="hand"`` where the case has one)."""
    fields = {"name": name or case.name.replace("hfpeftfam", "looppeft").replace("hfwin", "loopwin")}
    return dataclasses.replace(case, **fields, **({"loop": "hand"} if hasattr(case, "loop") else {}))


def predict(case, model=None, plan=None) -> int:  # noqa: ANN001
    """The loop's run for the case's config.json (the spec's sliding layers, the family), on CPU's kernels."""
    model = model or spec(case)
    if plan is None:
        plan = peft_steps.plan_of(case, "hf") if isinstance(case, peft_steps.PeftCase) else _plan(case)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    quant = Bnb4bit.of(plan)
    if quant is not None:  # loaded in the case's dtype, as test_timeline_hf_peft_families.predict
        storage = {"uint8": 1, "bfloat16": 2, "float32": 4}[case.quant_storage]
        quant = dataclasses.replace(quant, stored=4 if case.dtype == "float32" else 2, storage=storage)
    lora = HfLoraConfig.of(plan, model.architecture) if plan.finetune != "full" else None
    return _run(model, plan, workload, lora, quant=quant)  # test_timeline_hf_loop_families.py's composition


def _peft_model(case: peft_steps.PeftCase, reentrant: bool = False):  # noqa: ANN202
    """The case's PEFT model for the loop. A 4-bit base checkpointed as transformers does by default
    (``gradient_checkpointing_enable()``: non-reentrant) after ``prepare_model_for_kbit_training`` without it;
    ``reentrant``: PEFT's own (``prepare_model_for_kbit_training(use_gradient_checkpointing=True)`` passes no
    ``use_reentrant``, so torch's checkpoint takes True)."""
    import peft

    if case.quant == "none" or not case.checkpointing or reentrant:
        return peft_steps.build(case)
    model = peft_steps._quantized_base(case)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model.gradient_checkpointing_enable()
    model = peft.get_peft_model(model, case.lora_config())
    model.train()
    return model


def measure_peft(case: peft_steps.PeftCase, reentrant: bool = False) -> int:
    """peft_steps' loop (``out`` kept to the next forward, AdamW(foreach=True) over the adapters) for three steps."""
    model, opt, ids = peft_steps._setup(case, _peft_model(case, reentrant))
    tracker = StorageTracker()
    tracker.track_module(model)
    tracker.track(ids, *peft_steps.quant_state_tensors(model))
    with tracker:
        peft_steps._steps(case, model, opt, ids, STEPS)
    return tracker.peak


# LoRA / QLoRA over the families: every case of the Trainer's suite, Phi-3's fused adapters by default
DEFAULT_LORA = ("hfpeftfam-phi3-fp32-qkv",)
LORA = [dataclasses.replace(_loop(c), slow=c.name not in DEFAULT_LORA) for c in TRAINER_LORA]


def _params(cases: list) -> list:
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


@pytest.mark.parametrize("case", _params(LORA))
def test_lora_peak_equals_the_loops(case: peft_steps.PeftCase) -> None:
    measured, predicted = measure_peft(case), predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


REENTRANT = _lora("qwen3", "qlora-recipe-peft-reentrant", **QLORA_RECIPE)


@pytest.mark.slow
def test_qlora_under_peft_s_reentrant_checkpointing() -> None:
    """``prepare_model_for_kbit_training(model)`` checkpoints with ``use_reentrant`` unset (torch: True): the run with
    torch's reentrant checkpoint (``reentrant.py``; before, the non-reentrant one: -32,768 B, the recomputed layer
    output ``CheckpointFunction.backward`` holds through its inner backward)."""
    model, plan = spec(REENTRANT), peft_steps.plan_of(REENTRANT, "hf")
    workload = TrainingWorkload(seq_len=REENTRANT.seq, micro_batch=REENTRANT.batch)
    quant = Bnb4bit.of(plan)
    storage = {"uint8": 1, "bfloat16": 2, "float32": 4}[REENTRANT.quant_storage]
    quant = dataclasses.replace(quant, stored=4 if REENTRANT.dtype == "float32" else 2, storage=storage)
    lora = HfLoraConfig.of(plan, model.architecture)
    measured = measure_peft(REENTRANT, reentrant=True)
    predicted = _run(model, plan, workload, lora, quant=quant, reentrant=True)
    assert predicted == measured, f"{predicted:,} B predicted, {measured:,} B measured"


# sliding windows the sequence reaches: the Trainer's suite (full fine-tuning, LoRA, QLoRA), through the loop
WINDOWS = [_loop(c) for c in TRAINER_WINDOWS]
WINDOW_LORA = [dataclasses.replace(_loop(c), slow=c.name != "hfwin-lora-mistral-mqa") for c in TRAINER_WINDOW_LORA]


@pytest.mark.slow
@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: c.name)
def test_reached_window_peak_equals_the_loops(case) -> None:  # noqa: ANN001
    import hf_steps

    model = spec(case)
    assert model.sliding_window is not None and case.seq >= model.sliding_window, case.name  # reached
    measured, predicted = hf_steps.measure_hand(case, STEPS), predict(case, model)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.parametrize("case", _params(WINDOW_LORA))
def test_reached_window_lora_peak_equals_the_loops(case: peft_steps.PeftCase) -> None:
    """Mistral's window (64) reached by 128 tokens: every layer a ``DynamicSlidingWindowLayer`` (no
    ``layer_types`` in Mistral's config), the window's mask in SDPA; one KV head by default."""
    measured, predicted = measure_peft(case), predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_sliding_cache_layer_keeps_the_whole_sequence() -> None:
    """transformers' own ``DynamicSlidingWindowLayer`` past its window: what it keeps is a view of the whole
    concatenated copy (its storage the sequence's), and the window tensor, one int64."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer = DynamicSlidingWindowLayer(sliding_window=4)
    keys, values = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    full_keys, _ = layer.update(keys, values)
    assert full_keys.shape[-2] == 10 and layer.keys.shape[-2] == 3  # window - 1 visible
    assert layer.keys.untyped_storage().nbytes() == keys.numel() * 4  # the whole copy held
    assert layer._sliding_window_tensor.dtype == torch.int64 and layer._sliding_window_tensor.numel() == 1


# save_on_cpu around the loop's forward and backward over the families (offload_steps' emulation: host copies
# outside the tracker, brought back as new tensors), answered as ``memplan estimate --device cpu`` answers it
def _offload_cases() -> list:
    import family_steps
    from offload_steps import OffloadCase

    base = {c.name: c for c in family_steps.BASE}
    out = []
    for fam in ("qwen3", "phi3", "olmo2", "gemma2", "gemma3"):  # Gemma 3's window (64) reached by 128 tokens
        full = dataclasses.replace(base[fam], name=fam)
        out += [
            OffloadCase(f"save_on_cpu-lora-{fam}-fp32", _lora(fam, "offload"), "save_on_cpu", slow=fam != "phi3"),
            OffloadCase(f"save_on_cpu-full-{fam}-fp32", full, "save_on_cpu", slow=True),
            OffloadCase(
                f"save_on_cpu-lora-{fam}-bf16-ckpt",
                _lora(fam, "offload-ckpt", dtype="bfloat16", checkpointing=True),
                "save_on_cpu",
                slow=True,
            ),
            OffloadCase(
                f"save_on_cpu-full-{fam}-autocast-ckpt",
                dataclasses.replace(full, autocast=True, checkpointing=True),
                "save_on_cpu",
                slow=True,
            ),
        ]
    return out


OFFLOAD = _offload_cases()


@pytest.mark.parametrize("case", _params(OFFLOAD))
def test_save_on_cpu_peak_and_host_copies_equal_the_loops(case) -> None:  # noqa: ANN001
    from offload_steps import measure, predict_report

    peak, host = measure(case)
    report = predict_report(case)
    assert report.model == "op-level", report.model_reason
    assert (report.peak.allocated, report.offload.cpu) == (peak, host), case.name


# save_on_cpu over the MoE families (test_timeline_hf_loop_families.py's shapes): the run as that file composes it,
# ``subclass_like`` for the tracker's dispatch mode over the experts (``hf_moe_ops.zeros_then_put``). grouped_mm's
# save of the 3-D expert weights, a parameter, is packed (copied to the host) as save_on_cpu packs every save
def _moe_offload_cases() -> list:
    import test_timeline_hf_loop_families as F

    return [
        F._case("mixtral-offload-fp32", "mixtral", F.MIXTRAL, F.MOE),
        F._case("mixtral-offload-ckpt", "mixtral", F.MIXTRAL, F.MOE, checkpointing=True),
        F._case("mixtral-offload-autocast", "mixtral", F.MIXTRAL, F.MOE, autocast=True, layers=2),
        F._case("qwen3-moe-offload-fp32", "qwen3_moe", F.QWEN3, F.MOE),
        F._case("qwen3-moe-offload-bf16-ckpt", "qwen3_moe", F.QWEN3, F.MOE, dtype="bfloat16", checkpointing=True),
        F._case("qwen2-moe-offload-fp32", "qwen2_moe", F.QWEN2, F.MOE),
        F._case("deepseek-v2-offload-fp32", "deepseek_v2", F.V2, F.MLA_SHAPE),
        F._case("deepseek-v3-offload-fp32", "deepseek_v3", F.MLA + F.ROUTER, F.MLA_SHAPE),
        F._case("qwen2-moe-offload-ckpt", "qwen2_moe", F.QWEN2, F.MOE, checkpointing=True),
        F._case("deepseek-v3-offload-ckpt", "deepseek_v3", F.MLA + F.ROUTER, F.MLA_SHAPE, checkpointing=True),
        F._case("deepseek-v3-offload-autocast", "deepseek_v3", F.MLA + F.ROUTER, F.MLA_SHAPE, autocast=True),
    ]


MOE_OFFLOAD = _moe_offload_cases()


DEFAULT_MOE_OFFLOAD = ("loop-deepseek-v3-offload-fp32",)  # the router's double save and its unpacked saves (~1 s)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=() if c.name in DEFAULT_MOE_OFFLOAD else pytest.mark.slow) for c in MOE_OFFLOAD],
    ids=lambda c: c.name,
)
def test_save_on_cpu_over_moe_equals_the_loops(case) -> None:  # noqa: ANN001
    from offload_steps import OffloadCase, measure

    from memplan.specs.plan import Plan

    peak, host = measure(OffloadCase(case.name, case, "save_on_cpu"))
    model = spec(case)
    recompute = "full" if case.checkpointing else "none"
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, offload_activations="cpu")
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, runtime="hf-loop", device="cpu") is None, case.name
    timeline = hf_loop_run(
        hf_dims(model, workload, plan, "hf-loop"),
        model.tied_embeddings,
        "cpu_flash",
        steps=STEPS,
        qkv_bias=model.qkv_bias,  # Qwen2-MoE's q/k/v biases, as hf_loop_plan_run passes them
        arch=model.architecture,
        extra=family_config(model),
        offload=True,
        inplace_accumulate=False,
        subclass_like=True,
    )
    assert (timeline.peak()[0], timeline.host_peak) == (peak, host), case.name


def test_a_save_on_cpu_host_copy_goes_with_its_saved_variable() -> None:
    """The emulation's host count drops a copy at its unpack, or when its node dies unpacked (a top-k whose
    values feed nothing that reaches the loss: DeepSeek-V3's router), as ``save_on_cpu``'s pinned copy goes."""
    from offload_steps import EmulatedOffload

    x = torch.randn(8, 8, requires_grad=True)
    offload = EmulatedOffload("save_on_cpu")
    with offload:
        kept = x.sigmoid()  # SigmoidBackward0 saves its result: 8 x 8 fp32
        dropped = x.topk(2, dim=-1)[0].sum()  # TopkBackward0 saves its indices: 8 x 2 int64
    assert offload.host_bytes == 256 + 128
    del dropped
    assert offload.host_bytes == 256
    kept.sum().backward()
    assert offload.host_bytes == 0


def test_the_cases_span_the_families() -> None:
    """Every dense family beyond Llama's layout has LoRA, QLoRA and offload cases; the windows Gemma 3, Phi-3,
    Mistral and Qwen2; the default run one LoRA case (fused projections), one past a window, one offloaded."""
    families = {"qwen3", "phi3", "olmo2", "gemma2", "gemma3"}
    assert {c.arch for c in LORA if c.quant == "none"} == families == {c.arch for c in LORA if c.quant != "none"}
    assert {c.base.arch for c in OFFLOAD} == families
    assert {c.arch for c in WINDOWS} == {"gemma3", "phi3", "mistral", "qwen2"}
    assert [c.arch for c in LORA if not c.slow] == ["phi3"]
    assert [c.arch for c in WINDOW_LORA if not c.slow] == ["mistral"]
    assert [c.base.arch for c in OFFLOAD if not c.slow] == ["phi3"]


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("olmo2-7b", ["--finetune", "lora", "--seq-len", "1024"]),
        (
            "phi3-mini",
            ["--finetune", "qlora", "--lora-targets", "qkv_proj", "--precision", "bf16-mixed", "--seq-len", "1024"],
        ),
        ("qwen3-8b", ["--offload-activations", "cpu", "--seq-len", "1024"]),
        ("mixtral-8x7b", ["--offload-activations", "cpu", "--seq-len", "512"]),
        ("deepseek-v3", ["--offload-activations", "cpu", "--seq-len", "512"]),
        # past Gemma 3's 1024-token window on CPU (the loop's sliding cache layers)
        ("gemma3-12b", ["--finetune", "lora", "--seq-len", "2048", "--device", "cpu"]),
        pytest.param("gemma2-9b", ["--finetune", "lora", "--seq-len", "8192"], marks=pytest.mark.slow),
    ],
)
def test_estimate_answers_the_loop_op_level(capsys, name: str, args: list[str]) -> None:
    memory = _estimate(capsys, [name, "--runtime", "hf-loop", *args])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf-loop"


def test_a_reached_window_on_cuda_says_which_kernel(capsys) -> None:
    """On CUDA the loop's masked SDPA is the Trainer's: on cuDNN (Phi-3's 96-wide heads in bf16 on the default H100)
    not followed, the phase model, its reason the kernel (the memory-efficient kernel is followed:
    test_timeline_hf_loop_sliding_cuda.py)."""
    memory = _estimate(capsys, ["phi3-mini", "--runtime", "hf-loop", "--precision", "bf16", "--seq-len", "4096"])
    assert memory["model"] == "phase"
    assert "on CUDA SDPA takes the mask to its cudnn kernel" in memory["model_reason"]
    assert "under the hand-written loop on CPU" in memory["model_reason"]


def test_a_4bit_base_s_fp32_stream_on_the_memory_efficient_kernel_is_followed(capsys) -> None:
    """Without autocast a 4-bit base hands SDPA fp32 inputs; over heads without GQA (Llama 2 7B, Phi-3-mini) CUDA
    runs the memory-efficient kernel (``hf_trainer.hf_kernel``: ``efficient``, ``mem_efficient.py``), followed on
    compute capability 8.0 / 9.0 (the default H100): the loop's plan and the Trainer's (autocast, flash) op-level;
    on an L40S (8.9) the loop's is declined with that reason."""
    reason = (
        "fp32 SDPA on the memory-efficient kernel outside compute capability 8.0 / 9.0 (its backward's blocks by the "
        "GPU's shared memory) (a quantized base's fp32 stream without autocast, no GQA)"
    )
    loop = ["llama2-7b", "--runtime", "hf-loop", "--finetune", "qlora", "--seq-len", "1024"]
    memory = _estimate(capsys, loop)
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    memory = _estimate(capsys, [*loop, "--gpu", "l40s"])
    assert memory["model"] == "phase" and memory["model_reason"] == reason
    memory = _estimate(capsys, ["llama2-7b", "--runtime", "hf", "--finetune", "qlora", "--seq-len", "1024"])
    assert memory["model"] == "op-level"
