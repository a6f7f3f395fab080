"""Sliding-window layers whose window the sequence reaches (``costmodel/timeline/hf_sliding.py``) in the op-level
run of ``transformers.Trainer``, against the real Trainer on CPU: the sequence (128) past the window (64, or 128
itself), so transformers builds the sliding mask and SDPA runs with it (``repeat_kv``'s copies, the float mask
each layer's flash kernel saves). Gemma 3 with one layer type (two sliding layers) and with two (five sliding, one
full), Phi-3, Mistral and Qwen2 (``use_sliding_window`` from ``max_window_layers`` on); full fine-tuning in fp32,
bf16 and ``bf16=True`` over fp32, with and without gradient checkpointing, GQA, one KV head and none; PEFT LoRA over
Mistral and Qwen2, QLoRA (nf4, double quantization) over Mistral; the Trainer's FSDP2 and DDP on rank 0 of two.
The peak of live storages over three steps (``StorageTracker``) equal to the byte on every case, compared as
tests/unit/test_timeline_hf_families.py does (``inplace_accumulate=False``). Two Trainer cases run by default,
the rest under ``-m slow``.
"""

from __future__ import annotations

import dataclasses

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import family_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
BASE = {c.name: c for c in family_steps.BASE}
WINDOW = {"sliding_window": 64}  # reached by the 128-token sequence (Gemma 3's base already has it)
QWEN2 = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}  # layer 1 sliding
LAYERS = dict(vocab=256, layers=4)  # the layers, not the logits, dominate the peak
BF16 = dict(dtype="bfloat16")


def _case(family: str, tag: str, slow: bool = True, config: dict | None = None, **fields) -> hf_steps.Case:
    base = BASE.get(family) or hf_steps.Case(family, arch=family, **family_steps.TINY)
    extra = tuple({**dict(base.extra), **(config or {})}.items())
    return dataclasses.replace(base, name=f"hfwin-{family}-{tag}", loop="trainer", slow=slow, extra=extra, **fields)


CASES = [
    _case("gemma3", "layers6-fp32-ckpt", slow=False, layers=6, checkpointing=True),  # two layer types
    _case("mistral", "autocast", slow=False, autocast=True, config=WINDOW),  # GQA: repeat_kv's copies, bf16 mask
    _case("gemma3", "fp32"),  # one layer type: two sliding layers
    _case("gemma3", "bf16-ckpt", **BF16, checkpointing=True),
    _case("gemma3", "autocast", autocast=True),
    _case("gemma3", "mha-autocast-ckpt", kv_heads=4, autocast=True, checkpointing=True),  # no repeat_kv
    _case("gemma3", "layers6-bf16", layers=6, **BF16),
    _case("gemma3", "layers-bf16-softcap", **LAYERS, **BF16, config={"final_logit_softcapping": 30.0}),
    _case("phi3", "fp32", config=WINDOW),
    _case("phi3", "bf16-ckpt", **BF16, checkpointing=True, config=WINDOW),
    _case("phi3", "autocast", autocast=True, config=WINDOW),
    _case("phi3", "fp32-ckpt", checkpointing=True, config=WINDOW),
    _case("phi3", "mha-layers-bf16", **LAYERS, **BF16, kv_heads=4, config=WINDOW),
    _case("mistral", "fp32", config=WINDOW),
    _case("mistral", "fp32-ckpt", checkpointing=True, config=WINDOW),
    _case("mistral", "bf16-window-128", **BF16, config={"sliding_window": 128}),  # the window equal to the keys
    _case("mistral", "mqa-layers-bf16-ckpt", **LAYERS, **BF16, kv_heads=1, checkpointing=True, config=WINDOW),
    _case("qwen2", "fp32", config=QWEN2),
    _case("qwen2", "bf16-ckpt", **BF16, checkpointing=True, config=QWEN2),
    _case("qwen2", "autocast-all-sliding", autocast=True, config={**QWEN2, "max_window_layers": 0}),
]


def spec(case):  # noqa: ANN001, ANN201
    """The case's ModelSpec from its config.json (Mistral's window read as MistralConfig reads it)."""
    return model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)


def _plan(case, dp: int = 1, zero: int = 0) -> Plan:
    recompute = "full" if case.checkpointing else "none"
    return Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, dp=dp, zero=zero)


def predict(case: hf_steps.Case, dp: int = 1, zero: int = 0) -> int:
    """The run's peak for the case's config.json on CPU's kernels, on rank 0 of ``dp`` (FSDP2 at ``zero``)."""
    model = spec(case)
    plan = _plan(case, dp, zero)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert model.sliding_window is not None and case.seq >= model.sliding_window, case.name  # reached
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    return hf_predict(case, plan).peak()[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    measured = hf_steps.measure_peak(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


FSDP = [
    _case("gemma3", "fsdp-fp32"),
    _case("gemma3", "fsdp-autocast-ckpt", autocast=True, checkpointing=True),
    _case("mistral", "fsdp-bf16", **BF16, config=WINDOW),
    _case("phi3", "fsdp-autocast", autocast=True, config=WINDOW),
    _case("qwen2", "fsdp-fp32-ckpt", checkpointing=True, config=QWEN2),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", FSDP, ids=lambda c: c.name)
def test_fsdp_rank_0s_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    """The Trainer's FSDP2 (``full_shard``; Mistral ``shard_grad_op``) on rank 0 of two, the fake process group."""
    import hf_fsdp_steps

    zero = 2 if case.arch == "mistral" else 3
    measured = hf_fsdp_steps.measure(case, 1, STEPS, reshard=zero >= 3, world=2)
    predicted = predict(case, dp=2, zero=zero)
    assert predicted == measured, f"{case.name} zero {zero}: {predicted:,} B predicted, {measured:,} B measured"


DDP = [
    _case("gemma3", "ddp-fp32"),
    _case("mistral", "ddp-autocast-ckpt", autocast=True, checkpointing=True, config=WINDOW),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", DDP, ids=lambda c: c.name)
def test_ddp_rank_0s_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    """The Trainer under DDP (two gloo ranks, rank 0 measured: tests/accuracy/hf_ddp_steps.py)."""
    import hf_ddp_steps

    measured = hf_ddp_steps.measure(case)
    predicted = predict(case, dp=hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def _lora(tag: str, arch: str, config: dict, **fields):
    from peft_steps import TINY, PeftCase

    return PeftCase(f"hfwin-lora-{tag}", arch=arch, **{**TINY, "seq": 128, **fields}, extra=tuple(config.items()))


LORA = [
    _lora("mistral-mqa", "mistral", WINDOW),  # one KV head: repeat_kv's stride-0 view, no copy
    _lora("mistral-gqa-save-head", "mistral", WINDOW, heads=4, kv_heads=2, modules_to_save=("lm_head",)),
    _lora(
        "mistral-all-linear-autocast-ckpt",
        "mistral",
        WINDOW,
        targets=("all-linear",),
        autocast=True,
        checkpointing=True,
    ),
    _lora("qwen2-bf16", "qwen2", QWEN2, dtype="bfloat16"),
    _lora("mistral-qlora-nf4-dq", "mistral", WINDOW, quant="nf4", double_quant=True, heads=4, kv_heads=2),
    _lora(
        "mistral-qlora-recipe",
        "mistral",
        WINDOW,
        quant="nf4",
        double_quant=True,
        **BF16,
        autocast=True,
        checkpointing=True,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", LORA, ids=lambda c: c.name)
def test_lora_peak_equals_the_trainers(case) -> None:  # noqa: ANN001
    import hf_peft_steps
    from peft_steps import plan_of

    model = spec(case)
    plan = plan_of(case)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    predicted = hf_predict(case, plan)  # a 4-bit base loaded in the case's dtype, as test_timeline_hf_peft.predict
    measured = hf_peft_steps.measure(case)
    assert predicted.peak()[0] == measured, f"{case.name}: {predicted.peak()[0]:,} B predicted, {measured:,} B measured"


def test_the_cases_cover_each_family_both_dtypes_and_checkpointing() -> None:
    for family in ("gemma3", "phi3", "mistral", "qwen2"):
        mine = [c for c in CASES if c.arch == family]
        assert {c.precision for c in mine} >= {"fp32", "bf16", "bf16-mixed"}, family
        assert any(c.checkpointing for c in mine) and any(not c.checkpointing for c in mine), family
    assert {c.layers for c in CASES if c.arch == "gemma3"} >= {2, 6}  # one layer type, two
    assert len({dataclasses.astuple(c)[1:] for c in CASES}) == len(CASES)


def test_the_float_masks_are_what_checkpointing_drops() -> None:
    """Each sliding layer's flash node saves its own (b, 1, s, s) float mask; checkpointing leaves one bool grid
    (s, s) held to the backward, and the forward's float masks are remade one layer at a time. Without a mask
    the same shapes run is_causal: the difference at the peak is the saved float masks, at most."""
    case = _case("mistral", "probe", layers=4, config=WINDOW)
    unreached = dataclasses.replace(case, extra=tuple({**dict(case.extra), "sliding_window": 256}.items()))

    def peak(c, ckpt: bool) -> int:
        return hf_predict(c, Plan(precision="fp32", recompute="full" if ckpt else "none")).peak()[0]

    masks = case.layers * case.batch * case.seq * case.seq * 4  # every layer's fp32 float mask
    repeats = 2 * case.layers * case.batch * case.seq * case.hidden * 4 // 2  # k and v repeated: half new each
    grown = peak(case, False) - peak(unreached, False)
    assert masks <= grown <= masks + repeats + case.seq * case.seq + 64 * 1024
    assert peak(case, True) - peak(unreached, True) < grown // 2


@pytest.mark.parametrize(("name", "kernel"), [("phi3-mini", "cudnn")])
def test_estimate_follows_a_reached_window_on_cpu_and_says_why_not_on_cuda(capsys, name: str, kernel: str) -> None:
    """Phi-3-mini's 2047-token window at 4096 tokens: op-level with ``--device cpu``; on the default GPU (an H100:
    compute capability 9.0) the phase model, its reason naming the kernel CUDA's SDPA takes the mask to (Gemma 3's
    256-wide heads, past cuDNN's 128, take the memory-efficient kernel the run follows on CUDA:
    tests/unit/test_timeline_hf_sliding_cuda.py)."""
    args = [name, "--runtime", "hf", "--precision", "bf16", "--seq-len", "4096"]
    cpu = _estimate(capsys, [*args, "--device", "cpu"])
    assert cpu["model"] == "op-level" and cpu["model_reason"] is None
    gpu = _estimate(capsys, args)
    assert gpu["model"] == "phase" and "a window the sequence reaches" in gpu["model_reason"]
    assert f"on CUDA SDPA takes the mask to its {kernel} kernel" in gpu["model_reason"]


@pytest.mark.parametrize(
    ("head_dim", "half", "capability", "kernel"),
    [
        (256, True, (9, 0), "efficient"),  # cuDNN: heads of 128 at most; flash: no mask
        (128, True, (9, 0), "cudnn"),  # cuDNN first on sm90 from torch 2.11 (bundled cuDNN > 9.15), a mask taken
        (128, True, (8, 0), "efficient"),  # the A100: never cuDNN-first
        (96, False, (9, 0), "efficient"),  # fp32: flash and cuDNN take 16 bits only
    ],
)
def test_cuda_takes_a_masked_call_to_cudnn_or_the_memory_efficient_kernel(head_dim, half, capability, kernel) -> None:
    """From source (torch 2.11 ``sdp_utils.cpp``: ``attention.sdpa_backend``), not run on a GPU."""
    from memplan.costmodel.timeline.hf_sliding import cuda_masked_kernel

    assert cuda_masked_kernel(head_dim, 16, half, capability) == kernel


def test_the_memory_efficient_kernels_saved_bias_is_padded_to_eight_columns() -> None:
    """``preprocess_mask``: an aligned (b, 1, s, s) bias kept as is; else ``pad_bias``'s copy to the next multiple
    of 8 columns (from source, not run on a GPU)."""
    from memplan.costmodel.timeline.hf_sliding import cuda_saved_mask_bytes

    assert cuda_saved_mask_bytes(2, 4096, 2) == 2 * 4096 * 4096 * 2
    assert cuda_saved_mask_bytes(1, 2047, 4) == 2047 * 2048 * 4
    assert cuda_saved_mask_bytes(1, 100, 2) == 100 * 104 * 2


def test_the_hand_loop_follows_a_reached_window_on_cpu_alone() -> None:
    """The loop's run with the window's mask (its sliding cache layers: test_timeline_hf_loop_peft_families.py) on
    CPU, as the Trainer's; on CUDA where SDPA takes the mask to cuDNN (bf16 on the default H100) neither, the reason
    naming the loop (the memory-efficient kernel: test_timeline_hf_loop_sliding_cuda.py)."""
    model = spec(_case("mistral", "loop", config=WINDOW))
    workload = TrainingWorkload(seq_len=128, micro_batch=2)
    for runtime in ("hf", "hf-loop"):
        assert hf_supported(model, Plan(precision="fp32"), workload, runtime=runtime, device="cpu") is None
    reason = hf_supported(model, Plan(precision="bf16"), workload, runtime="hf-loop", device="cuda")
    assert reason is not None and "a window the sequence reaches" in reason
    assert "under the hand-written loop on CPU" in reason


def test_a_window_of_a_family_the_run_does_not_mask_says_which() -> None:
    """Qwen3's sliding layers past the window: not followed on CPU either, the reason naming the family."""
    from memplan.specs.loader import load_model

    qwen3 = load_model("qwen3-8b").model_copy(update=dict(attention_pattern=("full", "sliding"), sliding_window=512))
    reason = hf_supported(qwen3, Plan(precision="bf16"), TrainingWorkload(seq_len=1024, micro_batch=1), device="cpu")
    assert reason == "sliding or chunked attention (a window the sequence reaches, in the qwen3 family)"


@pytest.mark.parametrize(
    ("config", "pattern", "window"),
    [
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, ("full", "sliding"), 64),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, ("sliding", "sliding"), 64),
        ({"sliding_window": 64}, ("full", "full"), None),  # without use_sliding_window: none
    ],
)
def test_qwen2_reads_its_window(config: dict, pattern: tuple, window: int | None) -> None:
    """config.json's window as Qwen2Config reads it: only with ``use_sliding_window``, from ``max_window_layers``
    on (the reader Qwen3's config already had: ``specs.hf._qwen_sliding``)."""
    dims = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    data = {"model_type": "qwen2", **dims, "intermediate_size": 344, "vocab_size": 2000, **config}
    model = model_from_data(data, "w/config.json", "w")
    assert model.sliding_window == window and model.layer_attention_kinds == pattern


@pytest.mark.parametrize(
    ("config", "pattern", "window"),
    [
        ({"sliding_window": 64}, ("sliding", "sliding"), 64),
        ({}, ("sliding", "sliding"), 4096),  # MistralConfig's default where the key is absent
        ({"sliding_window": None}, ("full", "full"), None),  # null: no window, create_causal_mask
    ],
)
def test_mistral_reads_its_window(config: dict, pattern: tuple, window: int | None) -> None:
    """config.json's window as MistralConfig reads it, on every layer (one mask for all of them)."""
    dims = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    data = {"model_type": "mistral", **dims, "intermediate_size": 344, "vocab_size": 2000, **config}
    model = model_from_data(data, "w/config.json", "w")
    assert model.sliding_window == window and model.layer_attention_kinds == pattern


def test_estimate_of_a_mistral_config_json_follows_its_window(capsys, tmp_path) -> None:
    """``memplan estimate config.json`` of a Mistral whose window the sequence reaches: the run with the mask (each
    layer's float mask and repeated k / v) on CPU, above the same file without a window by at least those masks;
    on CUDA in fp32 the memory-efficient kernel's run, in bf16 on an H100 the phase model (cuDNN takes the mask)."""
    import json

    dims = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    base = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **dims, "intermediate_size": 344}
    peaks = {}
    for window in (64, None):
        path = tmp_path / f"w{window}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**base, "vocab_size": 2000, "sliding_window": window}))
        args = [str(path), "--runtime", "hf", "--seq-len", "128", "--micro-batch", "2", "--precision", "fp32"]
        cpu = _estimate(capsys, [*args, "--device", "cpu"])
        assert cpu["model"] == "op-level", cpu["model_reason"]
        peaks[window] = cpu["peak"]["allocated"]
        if window is not None:
            assert _estimate(capsys, args)["model"] == "op-level"
            bf16 = _estimate(capsys, [*args[:-1], "bf16"])
            assert bf16["model"] == "phase" and "takes the mask to its cudnn kernel" in bf16["model_reason"]
    assert peaks[64] - peaks[None] >= 2 * 2 * 128 * 128 * 4  # two layers' (b, 1, s, s) fp32 masks at least
