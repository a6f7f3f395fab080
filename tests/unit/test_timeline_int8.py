"""An LLM.int8 base under LoRA in the op-level runs (``timeline/int8.py``; ``hf_bnb.Bnb8bit``).

No GPU trace ran an 8-bit base. The bundled trainer's run with CPU's kernels (``trainer_run(...,
cuda=False)``: bitsandbytes' ``MatMul8bitFp``) is held against the bundled trainer itself on CPU,
as tests/unit/test_timeline_lora_variants.py does; the ``hf`` run against the real
``transformers.Trainer`` over a PEFT LoRA on an 8-bit base (a random Llama saved and loaded back with
``BitsAndBytesConfig(load_in_8bit=True)``, tests/accuracy/hf_peft_steps.py), as
tests/unit/test_timeline_hf_peft.py does; CUDA's ``MatMul8bitLt`` is checked against what
bitsandbytes 0.50.2's source allocates, tensor by tensor. Measured 2026-11-27 (torch 2.13.0+cpu,
bitsandbytes 0.50.2, transformers 5.23.0, peft 0.21.2): the bundled trainer's cases 224 B under its
peak (112 B on the small model; 0.001%), the step's and the forward's and backward's, as the other
LoRA cases; the Trainer's equal to the byte (fp32 stream, checkpointing, ``bf16=True``, a bf16-loaded
base, all linears with dropout, the recipe of all three, accumulation, a trained lm_head copy, Qwen2's
frozen q/k/v biases). The real run's outlier columns (the inputs' |x| >= 6.0, which CUDA's kernel
keeps apart) are counted in the bundled trainer's run: none on these small models, as
``int8_outliers.RandomInit`` counts them (the 1B model's are tests/unit/test_timeline_int8_cuda.py's).
"""

from __future__ import annotations

import pytest
from timeline_peaks import steady_peaks

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline.autograd import Tape
from memplan.costmodel.timeline.events import ALLOC, FREE, Builder
from memplan.costmodel.timeline.int8 import OUTLIER_COLUMNS, THRESHOLD, Int8, outlier_bytes
from memplan.costmodel.timeline.int8_outliers import RandomInit
from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

CPU_BOUND = 0.0001  # 0.01% of the trainer's peak, as test_timeline_lora_variants.py
SEQ = 128
TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
# the default suite's case: smaller, so that the trainer's CPU run takes about 4 s
SMALL = ModelSpec(
    name="small-gqa",
    hidden_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_size=344,
    vocab_size=1000,
)
INT8 = dict(finetune="qlora", quant="int8", lora_rank=8, lora_targets=("all-linear",))

# name: (plan, (micro_batch, global_batch)); TINY but the first
CPU_CASES = {
    "small-bf16-full": (dict(precision="bf16", recompute="full"), (1, None)),
    "bf16-full": (dict(precision="bf16", recompute="full"), (1, None)),
    "bf16": (dict(precision="bf16"), (1, None)),
    "fp32": (dict(precision="fp32"), (1, None)),
    "bf16-master": (dict(precision="bf16-master"), (1, None)),
    "selective-mb2": (dict(precision="bf16", recompute="selective"), (2, None)),
    "accum2": (dict(precision="bf16"), (1, 2)),
    "dropout": (dict(precision="bf16", lora_dropout=0.1), (1, None)),
    "fp32-full-accum2": (dict(precision="fp32", recompute="full"), (1, 2)),
    "ddp-dp2": (dict(precision="bf16", dp=2), (1, None)),
}
DEFAULT = {"small-bf16-full"}  # the default suite's time: the checkpointed layers' held inputs, the rest -m slow


def _measured(model: ModelSpec, workload: TrainingWorkload, plan: Plan, monkeypatch) -> tuple[int, int, int]:
    """The bundled trainer on CPU (SDPA's math backend, CUDA's for the fp32 stream with GQA): its
    peaks, and the most outlier columns one ``Linear8bitLt`` call saw."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    seen = [0]
    forward = bnb.nn.Linear8bitLt.forward

    def counting(self, x):  # noqa: ANN001, ANN202
        # outside the meter's dispatch mode: the count's own tensors stay out of the measured peak
        with torch.no_grad(), torch.utils._python_dispatch._disable_current_modes():
            columns = (x.detach().abs() >= THRESHOLD).reshape(-1, x.shape[-1]).any(dim=0).sum()
        seen[0] = max(seen[0], int(columns))
        return forward(self, x)

    monkeypatch.setattr(bnb.nn.Linear8bitLt, "forward", counting)
    with sdpa_kernel(SDPBackend.MATH):  # the fp32 stream
        record = run(RunSpec(model=model, workload=workload, plan=plan, rank=0, steps=2))
    assert record.status == "ok", record.reason
    return record.peak_allocated, max(record.phases[p].allocated for p in ("forward", "backward")), seen[0]


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CPU_CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name, monkeypatch):
    changes, (micro_batch, global_batch) = CPU_CASES[name]
    plan = Plan(**dict(INT8, **changes))
    workload = TrainingWorkload(seq_len=SEQ, micro_batch=micro_batch, global_batch=global_batch)
    model = SMALL if name.startswith("small") else TINY
    assert supported(model, workload, plan) is None  # the estimate follows it op by op
    predicted = steady_peaks(trainer_run(model, workload, plan, cuda=False))
    step, passes, outliers = _measured(model, workload, plan, monkeypatch)
    # random weights, synthetic tokens: as many as the run counts for the widest call (int8_outliers)
    tokens = SEQ * micro_batch
    assert outliers == RandomInit(model.hidden_size).columns("w2", tokens, model.ffn_size) == OUTLIER_COLUMNS
    for what, p, got in zip(("step", "forward and backward"), predicted, (step, passes), strict=True):
        assert abs(p / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {p:,}, measured {got:,}"


def test_a_checkpointed_layers_int8_inputs_outlive_its_backward():
    """``ctx.A`` is no saved tensor: under full recompute the forward's int8 linears keep their
    inputs (the norms' outputs among them, memory.checkpointed_int8_inputs) past the backward,
    until ``del loss`` frees the graph; the re-run's go with the re-run."""
    plan, workload = Plan(**dict(INT8, precision="bf16", recompute="full")), TrainingWorkload(seq_len=SEQ)
    events = list(trainer_run(TINY, workload, plan, cuda=False))
    step = [e.tag for e in events].index("step0")  # the steady steps
    optimizer = [i for i, e in enumerate(events) if e.tag == "phase:optimizer" and i > step][0]
    backward = [i for i, e in enumerate(events) if e.tag == "phase:backward" and i > step][0]
    norms = [i for i, e in enumerate(events[:backward]) if i > step and e.op == ALLOC and e.tag.endswith("_norm.out")]
    assert len(norms) == 2 * TINY.num_layers  # the forward's: attention_norm and ffn_norm per layer
    last_dx = max(i for i, e in enumerate(events[:optimizer]) if e.op == ALLOC and e.tag.endswith("dX"))
    for i in norms:
        free = next(
            j for j in range(i + 1, len(events)) if events[j].op == FREE and events[j].tensor == events[i].tensor
        )
        assert last_dx < free < optimizer, events[i].tag


def _one_linear(cuda: bool, outliers: int = 0, itemsize: int = 4):
    """One int8 linear (out 256 x in 64) over 32 tokens requiring grad, its forward and backward."""
    from memplan.costmodel.timeline import ops

    b = Builder()
    t = Tape(b)
    int8 = Int8(t, cuda, outliers)
    w = t.managed(256 * 64, 2, "layers.0.feed_forward.w1.weight", 0)
    weights = {"layers.0.feed_forward.w1.weight": w}
    int8.build(weights, {"layers.0.feed_forward.w1.weight": (256, 64)})
    x = t.new(32 * 64, itemsize, "x")
    x.fn = ops.leaf({}, "x")
    b.mark("forward")
    y = int8.linear(x, "layers.0.feed_forward.w1.weight", 256, "w1")
    b.mark("backward")
    t.backward(y, t.new(y.numel, y.itemsize, "seed"))
    return [(e.op, e.tag.rsplit(".", 1)[-1], e.size) for e in b.build() if e.op in (ALLOC, FREE)], int8


def test_cuda_forward_allocates_what_matmul8bitlt_does():
    """``MatMul8bitLt.forward`` (fast path, threshold 6.0, no outliers), in order: ``A.to(float16)``,
    ``row_stats``, ``out_row``, ``abs``, the mask, ``any()``; then ``int8_linear_matmul``'s int32,
    ``int8_mm_dequant``'s fp16 and its ``.to(float32)``: 32 tokens x 64 in -> 256 out."""
    events, _ = _one_linear(cuda=True)
    allocs = [(tag, size) for op, tag, size in events if op == ALLOC]
    forward = allocs[allocs.index(("input_fp16", 32 * 64 * 2)) :]
    assert forward[:9] == [
        ("input_fp16", 4096), ("row_stats", 128), ("int8_input", 2048), ("abs", 4096), ("outlier_mask", 2048),
        ("any", 1), ("int32_out", 32768), ("fp16_out", 16384), ("w1", 32768),
    ]  # fmt: skip
    # the backward: the weight dequantized to A's dtype, the row scales, grad_A
    assert forward[10:13] == [("weight_dq", 256 * 64 * 4), ("weight_dq_scale", 256 * 4), ("dX", 32 * 64 * 4)]


def test_cuda_build_keeps_cb_and_scb_and_frees_the_fp16_copy():
    events, int8 = _one_linear(cuda=True)
    build = events[: events.index((ALLOC, "x", 32 * 64 * 4))]
    assert build[1:4] == [(ALLOC, "weight_fp16", 256 * 64 * 2), (ALLOC, "SCB", 256 * 4), (ALLOC, "CB", 256 * 64)]
    assert (FREE, "weight_fp16", 256 * 64 * 2) in build and (FREE, "weight", 256 * 64 * 2) in build


def test_outlier_columns_add_their_bytes_on_cuda():
    """k outlier columns: ``subA`` (tokens x k, kept with ``ctx.tensors``), ``state.idx`` (k int64),
    ``CB[:, cols]`` and its dequantization's two fp32 products, and the ``addmm``'s second output
    (tokens x out)."""
    k = 3
    events, _ = _one_linear(cuda=True, outliers=k)
    sizes = {tag: size for op, tag, size in events if op == ALLOC}
    kept, transient = outlier_bytes(32, 256, 4)
    assert sizes["subA"] + sizes["outlier_cols"] == k * kept
    assert sizes["CB_cols"] + sizes["subB_scaled"] + sizes["subB"] == k * transient
    outputs = [size for op, tag, size in events if op == ALLOC and tag == "w1"]
    assert outputs == [32 * 256 * 4, 32 * 256 * 4]


def test_cpu_forward_dequantizes_the_weight():
    """``MatMul8bitFp.forward``: ``CB.to(A.dtype).mul_(SCB / 127)``, ``F.linear``, the weight freed."""
    events, _ = _one_linear(cuda=False)
    allocs = [(tag, size) for op, tag, size in events if op == ALLOC]
    i = allocs.index(("x", 32 * 64 * 4))
    assert allocs[i + 1 : i + 4] == [("weight_dq", 65536), ("weight_dq_scale", 1024), ("w1", 32768)]


@pytest.mark.parametrize(("runtime", "which"), [("memplan", "trainer"), ("hf", "hf")])
def test_the_estimate_answers_int8_with_the_op_level_run(runtime, which):
    job = resolve_job("llama3-8b", None, dict(INT8, precision="bf16", seq_len=1024, micro_batch=1), inference=False)
    _, answered = plan_run(job.model, job.workload, job.plan, runtime)
    assert answered == which


# the Trainer over PEFT on an 8-bit base (peft_steps.TINY: Llama h 64, 2 layers, 2 x 64 tokens)
HF_CASES = {
    "int8-recipe": dict(dtype="bfloat16", autocast=True, checkpointing=True),
    "int8": {},
    "int8-ckpt": dict(checkpointing=True),
    "int8-autocast": dict(autocast=True),
    "int8-bf16-base": dict(dtype="bfloat16"),
    "int8-all-linear-dropout": dict(targets=("all-linear",), dropout=0.1),
    "int8-ckpt-save-head": dict(checkpointing=True, modules_to_save=("lm_head",)),
    "int8-qwen2-attention": dict(arch="qwen2", targets=("q_proj", "k_proj", "v_proj", "o_proj")),
}
HF_DEFAULT = {"int8-recipe"}  # bf16 base, bf16=True, checkpointing: the usual recipe over an 8-bit base


def _hf_predict(case, ga: int = 1) -> int:
    """The ``hf`` run's peak on CPU's kernels, as test_timeline_hf_peft.predict."""
    from hf_predict import hf_predict
    from peft_steps import plan_of

    return hf_predict(case, plan_of(case), ga=ga).peak()[0]


@pytest.mark.parametrize(
    ("name", "ga"),
    [(n, 1) if n in HF_DEFAULT else pytest.param(n, 1, marks=pytest.mark.slow) for n in HF_CASES]
    + [pytest.param("int8-ckpt", 2, marks=pytest.mark.slow)],
)
def test_the_trainer_over_an_8bit_base_peaks_where_the_hf_run_does(name, ga):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    import hf_peft_steps  # tests/accuracy, on sys.path by tests/conftest.py
    from peft_steps import TINY as PEFT_TINY
    from peft_steps import PeftCase

    case = PeftCase(f"hf-{name}", **{**PEFT_TINY, **HF_CASES[name]}, quant="int8")
    measured = hf_peft_steps.measure(case, ga=ga, steps=3)
    assert _hf_predict(case, ga) == measured


@pytest.mark.parametrize("changes", [dict(precision="bf16-mixed")], ids=["autocast"])
def test_int8_plans_it_does_not_follow(changes):
    """Autocast over an int8 base: the bundled trainer refuses it. Selective-op and partial
    recompute, a head copy and ZeRO-1 are followed (tests/unit/test_timeline_quant_compose.py)."""
    plan = Plan(**dict(INT8, **changes))
    assert "LLM.int8" in supported(TINY, TrainingWorkload(seq_len=SEQ), plan)
