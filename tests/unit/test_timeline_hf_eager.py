"""Eager attention (``attn_implementation="eager"``, ``costmodel/timeline/hf_eager.py``) in the op-level run of
``transformers.Trainer`` (``--runtime hf``) and of the hand-written loop (``--runtime hf-loop``), against the real
ones on CPU: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2 and Gemma 3 loaded with ``attn_implementation="eager"``
(``eager_attention_forward``: ``repeat_kv``, the (b, heads, s, s) scores, the 4-D float masks ``masking_utils``
builds for eager attention, the fp32 softmax, the probabilities each layer keeps to its return), full
fine-tuning and PEFT LoRA, in fp32, bf16 and ``bf16=True`` over fp32, with and without gradient checkpointing,
GQA, one KV head and none, sliding windows reached and not (the mask carries the window). Layer-dominated
shapes (a 256-token vocabulary): the scores, not the logits, decide the peak. The peak of live storages over
three steps (``StorageTracker``: tests/accuracy/hf_steps.py, peft_steps.py, hf_peft_steps.py) equal to the
byte on every case, compared as tests/unit/test_timeline_hf_families.py does (``inplace_accumulate=False``).
A few cases run by default (about 75 s on two shared cores under load), the rest under ``-m slow`` (all 73
tests: 11 min).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import case_quant, hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import family_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
from peft_steps import PeftCase, plan_of  # noqa: E402

from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.loader import load_model, model_from_data  # noqa: E402
from memplan.specs.plan import Plan, checkpoint_reentrant  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
BASE = {c.name: c for c in family_steps.BASE}
LAYERS = dict(vocab=256, layers=4)  # the scores, not the logits, dominate the peak
BF16 = dict(dtype="bfloat16")
WINDOW = {"sliding_window": 64}  # reached by the 128-token sequence
NO_WINDOW = {"sliding_window": None}  # Mistral's and Phi-3's causal mask (Mistral's default window: 4096)
QWEN2 = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}  # layer 1 of 2 sliding


def _case(family: str, tag: str, slow: bool = True, loop: str = "trainer", config: dict | None = None, **fields):
    """family_steps' case of ``family`` (Llama / Mistral / Qwen2: its tiny shape) under eager attention."""
    base = BASE.get(family) or hf_steps.Case(family, arch=family, **family_steps.TINY)
    extra = tuple({**dict(base.extra), **(config or {})}.items())
    prefix = "hfeager" if loop == "trainer" else "loopeager"
    name = f"{prefix}-{family}-{tag}"
    return dataclasses.replace(base, name=name, loop=loop, slow=slow, attention="eager", extra=extra, **fields)


# tests/unit/test_timeline_hf_moe.py's experts at four heads over two KV heads and 128 tokens
MOE_SHAPE = dict(hidden=64, layers=3, heads=4, kv_heads=2, ffn=128, vocab=64, batch=2, seq=128)
MIXTRAL = (("num_local_experts", 4), ("num_experts_per_tok", 2))
QWEN3_MOE = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64), ("norm_topk_prob", True))
QWEN2_MOE = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))
QWEN2_MOE += (("shared_expert_intermediate_size", 96),)


def _moe(arch: str, tag: str, extra: tuple, slow: bool = True, loop: str = "trainer", **fields) -> hf_steps.Case:
    prefix = "hfeager" if loop == "trainer" else "loopeager"
    fields = {**MOE_SHAPE, **fields}
    return hf_steps.Case(
        f"{prefix}-{arch}-{tag}", arch=arch, loop=loop, extra=extra, slow=slow, attention="eager", **fields
    )


CASES = [
    # the default run (fp32: bf16 matmuls are slow on CPUs without AMX): GQA's repeat_kv copies and the scores
    # deciding the peak; a window in the mask under checkpointing (the hand-written loop: LoRA's default case)
    _case("llama", "layers-fp32", slow=False, **LAYERS),
    _case("mistral", "window-layers-fp32-ckpt", slow=False, **LAYERS, checkpointing=True, config=WINDOW),
    _case("qwen3", "layers-fp32", loop="hand", **LAYERS),
    # -m slow: every family, dtype, checkpointing, KV layout and window, under both loops
    _case("llama", "fp32"),
    _case("llama", "layers-bf16-ckpt", **LAYERS, **BF16, checkpointing=True),
    _case("llama", "layers-autocast", **LAYERS, autocast=True),
    _case("llama", "mha-layers-fp32-ckpt", **LAYERS, kv_heads=4, checkpointing=True),  # repeat_kv returns k, v
    _case("llama", "mqa-layers-bf16", **LAYERS, **BF16, kv_heads=1),  # one KV head: repeat_kv's view
    _case("mistral", "layers-fp32", **LAYERS),  # the default 4096 window: the sliding mask, not reached
    _case("mistral", "no-window-bf16", **LAYERS, **BF16, config=NO_WINDOW),  # the causal mask
    _case("qwen2", "layers-fp32-ckpt", **LAYERS, checkpointing=True),
    _case("qwen2", "sliding-layers-autocast", **LAYERS, autocast=True, config=QWEN2),  # both masks
    _case("qwen3", "layers-fp32", **LAYERS),
    _case("qwen3", "layers-autocast-ckpt", **LAYERS, autocast=True, checkpointing=True),
    _case("phi3", "layers-fp32", **LAYERS),
    _case("phi3", "window-layers-bf16-ckpt", **LAYERS, **BF16, checkpointing=True, config=WINDOW),
    _case("phi3", "mha-layers-autocast", **LAYERS, kv_heads=4, autocast=True),
    _case("olmo2", "layers-fp32", **LAYERS),
    _case("olmo2", "layers-bf16-ckpt", **LAYERS, **BF16, checkpointing=True),
    _case("olmo2", "layers-autocast", **LAYERS, autocast=True),
    _case("gemma3", "layers-fp32", **LAYERS),  # its base's 64-token window, reached
    _case("gemma3", "layers6-bf16-ckpt", vocab=256, layers=6, **BF16, checkpointing=True),  # both masks read
    _case("gemma3", "layers-autocast", **LAYERS, autocast=True),
    # the MoE families (hf_eager_moe.py): the experts' tensors beside the scores
    _moe("mixtral", "fp32", MIXTRAL),
    _moe("mixtral", "bf16-ckpt", MIXTRAL, **BF16, checkpointing=True),
    _moe("qwen3_moe", "autocast", QWEN3_MOE, autocast=True),
    _moe("qwen3_moe", "fp32-ckpt", QWEN3_MOE, checkpointing=True),
    _moe("qwen2_moe", "fp32-ckpt", QWEN2_MOE, checkpointing=True),  # both masks, the window 0
    _moe("qwen2_moe", "bf16", QWEN2_MOE, **BF16),
    _moe("mixtral", "fp32-ckpt", MIXTRAL, loop="hand", checkpointing=True),
    _moe("qwen2_moe", "autocast", QWEN2_MOE, loop="hand", autocast=True),
    # the hand-written loop (its DynamicCache's copies of k and v feed the eager core)
    _case("llama", "layers-fp32", loop="hand", **LAYERS),
    _case("llama", "layers-autocast-ckpt", loop="hand", **LAYERS, autocast=True, checkpointing=True),
    _case("mistral", "window-layers-bf16", loop="hand", **LAYERS, **BF16, config=WINDOW),
    _case("mistral", "window-layers-autocast-ckpt", **LAYERS, autocast=True, checkpointing=True, config=WINDOW),
    _case("qwen3", "layers-bf16", loop="hand", **LAYERS, **BF16),
    _case("qwen2", "sliding-layers-fp32", loop="hand", **LAYERS, config=QWEN2),
    _case("phi3", "layers-autocast", loop="hand", **LAYERS, autocast=True),
    _case("olmo2", "layers-fp32-ckpt", loop="hand", **LAYERS, checkpointing=True),
    _case("gemma3", "layers-bf16", loop="hand", **LAYERS, **BF16),
]


def spec(case):  # noqa: ANN001, ANN201
    return model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)


def _plan(case) -> Plan:  # noqa: ANN001
    recompute = "full" if case.checkpointing else "none"
    return Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, attention="eager")


def _loop_peak(model, plan: Plan, workload: TrainingWorkload, lora: HfLoraConfig | None = None, quant=None) -> int:  # noqa: ANN001
    """The hand-written loop's run as ``hf_loop_plan_run`` composes it, on CPU (``quant``: the case's 4-bit base,
    ``hf_predict.case_quant``; PEFT's kbit preparation: the reentrant checkpoint)."""
    from test_timeline_hf_loop_families import _run

    return _run(model, plan, workload, lora, quant=quant, reentrant=checkpoint_reentrant(plan, "hf-loop"))


def predict(case) -> int:  # noqa: ANN001
    """The run's peak for the case's config.json under eager attention, with its loop's runtime, on CPU."""
    model, plan = spec(case), _plan(case)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, runtime=case.runtime, device="cpu") is None, case.name
    if case.loop == "trainer":
        return hf_predict(case, plan, subclass_like=model.moe is not None).peak()[0]
    return _loop_peak(model, plan, workload)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_real_loops(case) -> None:  # noqa: ANN001
    measured = hf_steps.measure_peak(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@dataclasses.dataclass(frozen=True)
class EagerPeftCase(PeftCase):
    """peft_steps' LoRA case over a base loaded with ``attn_implementation="eager"``."""

    @property
    def attention(self) -> str:
        return "eager"


QLORA = dict(quant="nf4", double_quant=True, dtype="bfloat16", autocast=True, checkpointing=True)
PEFT_TINY = dict(vocab=256, hidden=64, heads=4, kv_heads=2, ffn=160, batch=2, seq=128, rank=4, layers=2)
ALL = ("all-linear",)


def _lora(tag: str, arch: str = "llama", slow: bool = True, **fields) -> EagerPeftCase:
    return EagerPeftCase(f"hfeager-lora-{arch}-{tag}", **{**PEFT_TINY, "arch": arch, "slow": slow, **fields})


PEFT = [
    _lora("fp32-qv", slow=False),
    _lora("autocast-ckpt", autocast=True, checkpointing=True),
    _lora("bf16-all-linear", "qwen2", **BF16, targets=ALL),
    _lora("fp32-ckpt-dropout", "mistral", checkpointing=True, dropout=0.1),
    _lora("qlora-recipe", **QLORA),  # nf4, double quantization, a bf16 base, bf16=True, checkpointing
]


def _peft_plan(case: PeftCase, runtime: str) -> Plan:
    return plan_of(case, runtime).model_copy(update={"attention": "eager"})


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in PEFT], ids=lambda c: c.name
)
def test_lora_under_the_trainer_equals_its_peak(case: PeftCase) -> None:
    import hf_peft_steps

    model, plan = spec(case), _peft_plan(case, "hf")
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    measured = hf_peft_steps.measure(case, steps=STEPS)
    predicted = hf_predict(case, plan).peak()[0]
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in PEFT],
    ids=lambda c: c.name.replace("hfeager", "loopeager"),
)
def test_lora_under_the_hand_written_loop_equals_its_peak(case: PeftCase) -> None:
    """peft_steps' loop (AdamW(foreach=True) over the adapters, ``out`` kept to the next forward) under the tracker,
    the token ids counted (as tests/unit/test_timeline_hf_loop_peft_families.py measures it)."""
    import peft_steps
    from storage_tracker import StorageTracker

    model, plan = spec(case), _peft_plan(case, "hf-loop")
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, runtime="hf-loop", device="cpu") is None, case.name
    peft_model, opt, ids = peft_steps._setup(case)
    tracker = StorageTracker()
    tracker.track_module(peft_model)
    tracker.track(ids, *peft_steps.quant_state_tensors(peft_model))
    with tracker:
        peft_steps._steps(case, peft_model, opt, ids, STEPS)
    measured = tracker.peak
    lora = HfLoraConfig.of(plan, model.architecture, 0)
    predicted = _loop_peak(model, plan, workload, lora, case_quant(case, plan))
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


RANKS = [
    (_case("llama", "fsdp-layers-autocast-ckpt", **LAYERS, autocast=True, checkpointing=True), 3),
    (_case("qwen2", "ddp-layers-fp32", **LAYERS), 0),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "zero"), RANKS, ids=lambda c: getattr(c, "name", str(c)))
def test_rank_0s_peak_equals_the_trainers(case, zero: int) -> None:  # noqa: ANN001
    """The Trainer's FSDP2 (``full_shard``, the fake process group) and DDP (two gloo ranks) on rank 0 of two."""
    import hf_ddp_steps
    import hf_fsdp_steps

    if zero:
        measured = hf_fsdp_steps.measure(case, 1, STEPS, reshard=True, world=2)
    else:
        measured = hf_ddp_steps.measure(case)
    plan = _plan(case).model_copy(update={"dp": 2, "zero": zero})
    assert hf_supported(spec(case), plan, TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)) is None
    predicted = hf_predict(case, plan).peak()[0]
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.parametrize("runtime", ["hf", "hf-loop"])
@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("llama3-8b", ["--precision", "bf16"]),
        ("mistral-7b", ["--precision", "bf16-mixed", "--recompute", "full"]),
        ("qwen2.5-7b", ["--precision", "bf16", "--finetune", "lora"]),
        ("phi3-mini", ["--precision", "bf16", "--device", "cpu"]),  # its 2047-token window, reached: in the mask
    ],
)
def test_an_eager_plan_is_answered_by_the_op_level_run(capsys, name: str, args: list[str], runtime: str) -> None:
    """``--attention eager`` under either runtime: ``memory.model`` is ``op-level`` (it was the phase model, ``{}
    attention``), on CUDA (the same ops: no kernel to pick) and on CPU."""
    memory = _estimate(capsys, [name, "--runtime", runtime, "--attention", "eager", "--seq-len", "4096", *args])
    assert memory["model"] == "op-level" and memory["model_reason"] is None, memory["model_reason"]


def test_eager_attention_keeps_the_scores_sdpa_does_not() -> None:
    """The same plan under SDPA and under eager attention: eager's peak is higher by at least one layer's
    (b, heads, s, s) fp32 softmax output (its probabilities, saved for the backward) and no more than every
    layer's scores, probabilities and mask several times over; the run cannot be SDPA's in disguise."""
    from memplan.costmodel.timeline.hf_trainer import hf_plan_run

    model, workload = load_model("llama3-8b"), TrainingWorkload(seq_len=2048, micro_batch=1)
    sdpa = hf_plan_run(model, workload, Plan(precision="bf16")).peak()[0]
    eager = hf_plan_run(model, workload, Plan(precision="bf16", attention="eager")).peak()[0]
    scores = workload.micro_batch * model.num_attention_heads * workload.seq_len**2
    assert 4 * scores <= eager - sdpa <= model.num_layers * 16 * scores, (eager - sdpa) / scores


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "gemma2-9b", "gemma3-12b", "olmo2-7b"])
def test_eager_over_the_moe_and_dense_families_is_the_runs(name: str) -> None:
    plan, workload = Plan(precision="bf16", attention="eager"), TrainingWorkload(seq_len=8192, micro_batch=1)
    assert hf_supported(load_model(name), plan, workload) is None
    assert hf_supported(load_model(name), plan, workload, runtime="hf-loop", device="cpu") is None


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("deepseek-v2-lite", "eager attention"),  # MLA's eager path: its own function, not followed
        ("deepseek-v3", "eager attention"),
    ],
)
def test_eager_over_mla_stays_on_the_phase_model(name: str, reason: str) -> None:
    plan, workload = Plan(precision="bf16", attention="eager"), TrainingWorkload(seq_len=1024, micro_batch=1)
    assert hf_supported(load_model(name), plan, workload) == reason


def test_the_callback_reads_eager_attention_and_the_run_predicts_it() -> None:
    """``MemplanCallback`` over a tiny Llama loaded with ``attn_implementation="eager"`` (its scores deciding
    the peak): the plan it reads says ``eager`` (``config._attn_implementation``), the estimate is the Trainer's
    op-level run, and the measured steps are within the issue's 2% (above them by what its meter leaves out, the
    batches fetched before each step begins: tests/integrations/test_transformers_callback.py)."""
    import tempfile

    from memplan.integrations.transformers import MemplanCallback

    case = _case("llama", "callback", **LAYERS)
    model = hf_steps._model(case)
    callback = MemplanCallback(seq_len=case.seq)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    rows = [{"input_ids": r, "labels": r} for r in ids] * 4
    with tempfile.TemporaryDirectory() as out:
        args = hf_steps.training_args(out, case, STEPS)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
        trainer.train()
    result, comparison = callback.result, callback.comparison
    assert result is not None and comparison is not None
    assert result.plan["attention"] == "eager"
    assert result.memory.model == "op-level" and result.memory.model_reason is None
    assert 0 <= comparison.allocated_error <= 0.002, comparison


def test_on_cuda_the_softmax_backward_takes_its_temporary() -> None:
    """On CUDA each layer's softmax backward allocates ``grad * output`` (an fp32 scores-sized temporary, from
    source: the bundled trainer's ``eager.SOFTMAX_TMP``); the CPU run, checked above, has none."""
    from memplan.costmodel.timeline.eager import SOFTMAX_TMP
    from memplan.costmodel.timeline.events import ALLOC
    from memplan.costmodel.timeline.hf_trainer import hf_plan_run

    model, workload = load_model("llama3-8b"), TrainingWorkload(seq_len=512, micro_batch=1)
    plan = Plan(precision="bf16", attention="eager")
    scores = model.num_attention_heads * workload.seq_len**2 * 4
    for device, per_step in (("cuda", model.num_layers), ("cpu", 0)):
        events = hf_plan_run(model, workload, plan, device=device).events
        temps = [e.size for e in events if e.op == ALLOC and e.tag.endswith(SOFTMAX_TMP)]
        assert temps == [scores] * (3 * per_step), device


LLAMA1B = Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json"
FAST = [
    (dict(precision="bf16", recompute="full"), "hf", 1024, 1),
    (dict(precision="bf16-mixed", recompute="none"), "hf-loop", 1024, 2),
    (dict(dp=8, zero=3, precision="bf16", recompute="full"), "hf", 1024, 1),
]


@pytest.mark.parametrize(("fields", "runtime", "seq", "micro_batch"), FAST)
def test_the_search_s_fast_form_is_the_eager_run(fields: dict, runtime: str, seq: int, micro_batch: int) -> None:
    """The search's fast form (``fast_run``: cut runs, or the whole run) gives an eager plan's peak within the
    issue's 0.1% of the whole run on an H200 (Llama-3.2-1B's shape, as tests/search/test_fast_form_hf.py)."""
    from memplan.costmodel import fast_run
    from memplan.costmodel.allocator import AllocatorConfig
    from memplan.costmodel.reserve import plan_run, replay
    from memplan.search.evaluate import Context, fast_peak
    from memplan.search.space import Candidate
    from memplan.specs.hardware import ClusterSpec
    from memplan.specs.loader import load_gpu

    model, plan = load_model(str(LLAMA1B)), Plan(**fields, attention="eager")
    wl = TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=micro_batch * plan.dp)
    assert fast_run.applies(model, plan, runtime, "cuda")
    ctx = Context(model, load_gpu("h200"), ClusterSpec(gpus_per_node=8, nodes=1), runtime=runtime)
    fast = fast_peak(Candidate(plan, wl), ctx).allocated
    run, which = plan_run(model, wl, plan, runtime, "cuda")
    assert which == runtime
    whole = replay(run, AllocatorConfig()).max_allocated
    assert abs(fast - whole) <= 0.001 * whole, f"{fast - whole:+,} B"
