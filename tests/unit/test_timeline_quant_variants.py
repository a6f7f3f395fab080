"""Every 4-bit base the bundled trainer builds, in the op-level run (``timeline/quant.py``): fp4 as well
as nf4, single as well as double quantization, computing in bf16 (bf16, bf16-master) or fp32, over
any number of tokens where CUDA's ``gemm_4bit`` takes one path on every GPU
(``costmodel.quant.gemm_4bit_kernel``), and QLoRA with dropout, gradient accumulation, a trained LM
head copy (fp32 after ``prepare_model_for_kbit_training``), under DDP and ZeRO-1.

No GPU ran these plans (the one QLoRA trace, h200_a_qlora8b, is nf4 with double quantization:
tests/unit/test_timeline_qlora.py replays it). Each is held against the bundled trainer itself, run
on CPU and measured as tests/validate measures it (MemTracker, the steady peak over the measured
steps), as tests/unit/test_timeline_lora_variants.py does. What the trainer's CPU count cannot see,
or sees that a GPU does not hold, is set apart by name, each from its source:

- CUDA's alone (``timeline_peaks.steady_peaks``): cuBLAS's workspaces, the embedding backward's
  scratch, and ``_dequant_linear_fallback``'s forward temporaries, which run inside bitsandbytes'
  ``gemm_4bit`` custom op (``quant.CUDA_FALLBACK``; on CPU ``_gemm_4bit_default_impl``, whose
  internals a dispatch-level count does not see either);
- bitsandbytes' dynamic map (``functional.name2qmap["dynamic"]``, 1 KiB, made by the first double
  quantization): a module-level cache, neither a parameter nor a quantization state, so the CPU
  meter (which tracks ``quant.state_tensors``) misses it; the GPU holds it;
- AdamW's per-parameter ``step`` (``torch/optim/adam.py`` ``_init_group``: ``torch.tensor(0.0,
  dtype=_get_scalar_dtype(), device="cpu")`` unless capturable or fused; ``MasterAdamW``:
  ``torch.tensor(0.0)``): host tensors on a GPU, counted by the CPU meter (4 B each).

Measured 2026-11-27 (torch 2.13.0+cpu, bitsandbytes 0.50.2): with those three set apart, every case
below equal to the trainer's peak to the byte, for the step and for the forward and backward alone.
"""

from __future__ import annotations

import pytest
from timeline_peaks import ddp_broadcast_flats, steady_peaks

from memplan.costmodel.lora import ADAPTER_BYTES, HF_NAMES
from memplan.costmodel.quant import DEQUANTIZE, FUSED, absmax_4bit_bytes, gemm_4bit_kernel, packed_4bit_bytes
from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline import zero1
from memplan.costmodel.timeline.autograd import Tape
from memplan.costmodel.timeline.events import ALLOC, FREE, MARK, Builder, Category
from memplan.costmodel.timeline.lora import Lora, config
from memplan.costmodel.timeline.quant import CUDA_FALLBACK
from memplan.costmodel.timeline.trainer import dims, supported, trainer_run
from memplan.costmodel.timeline.trainer_model import param_shapes
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

SMALL = ModelSpec(
    name="small-gqa", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_size=128, vocab_size=512
)
QLORA = dict(finetune="qlora", quant="nf4", lora_rank=8, lora_targets=("all-linear",))
STEP_BYTES = 4  # AdamW's step: a host fp32 scalar per parameter (not on the GPU)
CPU_BOUND = 0.0001  # 0.01% of the trainer's peak, as test_timeline_lora_variants.py

# name: (plan, (seq_len, micro_batch, global_batch)). bf16 over 4 tokens: CUDA's fused kernel on every
# GPU; over 1792 the fallback; fp32 from 8 tokens on: the fallback (gemm_4bit_kernel).
HEAD = dict(modules_to_save=("lm_head",))
CPU_CASES = {
    "ddp2-bf16-master-single-dropout-accum2-head-copy-fused": (
        dict(precision="bf16-master", dp=2, double_quant=False, lora_dropout=0.1, **HEAD),
        (4, 1, 4),
    ),
    "zero1-dp2-fp32-fp4-head-copy-full": (
        dict(precision="fp32", dp=2, zero=1, quant="fp4", recompute="full", **HEAD),
        (16, 1, None),
    ),
    "bf16-single-dropout-accum2-fused": (dict(precision="bf16", double_quant=False, lora_dropout=0.1), (4, 1, 2)),
    "fp32-fp4-head-copy-full": (dict(precision="fp32", quant="fp4", recompute="full", **HEAD), (32, 1, None)),
    "ddp2-bf16-master-head-copy-fused": (dict(precision="bf16-master", dp=2, **HEAD), (4, 1, None)),
    "zero1-dp2-fp32-single-head-copy": (
        dict(precision="fp32", dp=2, zero=1, double_quant=False, **HEAD),
        (16, 1, None),
    ),
    "bf16-1792": (dict(precision="bf16"), (256, 7, None)),
    "bf16-single-1792": (dict(precision="bf16", double_quant=False), (256, 7, None)),
    "bf16-fp4-dropout-selective-1792": (
        dict(precision="bf16", quant="fp4", lora_dropout=0.1, recompute="selective"),
        (256, 7, None),
    ),
    "bf16-accum2-1792": (dict(precision="bf16"), (256, 7, 14)),
    "bf16-head-copy-1792": (dict(precision="bf16", **HEAD), (256, 7, None)),
    "bf16-master-selective-1792": (dict(precision="bf16-master", recompute="selective"), (256, 7, None)),
    "ddp2-bf16-1792": (dict(precision="bf16", dp=2), (256, 7, None)),
    "fp32-dropout": (dict(precision="fp32", lora_dropout=0.1), (64, 1, None)),
    "fp32-head-copy-dropout-full": (dict(precision="fp32", recompute="full", lora_dropout=0.1, **HEAD), (64, 2, None)),
    "ddp2-fp32-head-copy-accum2": (dict(precision="fp32", dp=2, **HEAD), (64, 1, 4)),
    "zero1-dp2-fp32": (dict(precision="fp32", dp=2, zero=1), (64, 1, None)),
}
# in the default run two cases that hold every mechanism once between them (single and double
# quantization, nf4 and fp4, bf16-master and fp32, the fused kernel's shapes and the fallback's,
# dropout, accumulation, the head copy, DDP, ZeRO-1, full recompute); the rest under -m slow
DEFAULT = {"ddp2-bf16-master-single-dropout-accum2-head-copy-fused", "zero1-dp2-fp32-fp4-head-copy-full"}


def _case(name: str) -> tuple[Plan, TrainingWorkload]:
    changes, (seq, micro_batch, global_batch) = CPU_CASES[name]
    return Plan(**dict(QLORA, **changes)), TrainingWorkload(
        seq_len=seq, micro_batch=micro_batch, global_batch=global_batch
    )


def _trained(workload: TrainingWorkload, plan: Plan) -> list[tuple[str, int]]:
    """The trainable parameters (adapters, a head copy) in ``model.parameters()`` order."""
    lora, scratch = Lora(Tape(Builder()), config(plan), dims(SMALL, workload, plan).tokens), Tape(Builder())
    for name, (rows, cols) in param_shapes(dims(SMALL, workload, plan), SMALL.tied_embeddings).items():
        lora.build(scratch.new(rows * cols, 2, name), name, rows, cols)
    return lora.params()


def _rank(workload: TrainingWorkload, plan: Plan) -> int:
    """The data rank the run follows: under ZeRO-1 the most-loaded partition of the trainable ones."""
    return zero1.most_loaded(_trained(workload, plan), plan.dp) if plan.zero == 1 and plan.dp > 1 else 0


def _predicted(workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    """The run's steady peaks as the CPU meter counts them: without the dynamic map, with AdamW's
    host ``step`` scalars (those of the rank's partition under ZeRO-1)."""
    run = trainer_run(SMALL, workload, plan, cuda=False)
    assert run is not None
    step, passes = steady_peaks([e for e in run if not e.tag.endswith("dynamic_map")])
    params = _trained(workload, plan)
    local = zero1.shard(params, plan.dp) if plan.zero == 1 and plan.dp > 1 else params
    return step + STEP_BYTES * len(local), passes + STEP_BYTES * len(local)


def _measured(workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    """The bundled trainer on CPU on SDPA's math backend: over a 4-bit base the stream is fp32
    (``prepare_model_for_kbit_training``), and CUDA takes the math kernel for fp32 with GQA where
    CPU would take its flash kernel (``support.sdpa_kernel``)."""
    pytest.importorskip("bitsandbytes")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    with sdpa_kernel(SDPBackend.MATH):
        record = run(RunSpec(model=SMALL, workload=workload, plan=plan, rank=_rank(workload, plan), steps=2))
    assert record.status == "ok", record.reason
    return record.peak_allocated, max(record.phases[p].allocated for p in ("forward", "backward"))


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CPU_CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    plan, workload = _case(name)
    assert supported(SMALL, workload, plan) is None  # the estimate follows it op by op
    predicted, measured = _predicted(workload, plan), _measured(workload, plan)
    for what, p, got in zip(("step", "forward and backward"), predicted, measured, strict=True):
        assert abs(p / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {p:,}, measured {got:,}"


def test_ddp_broadcasts_the_packed_weights_apart_after_the_fp32_group():
    """``_sync_module_states`` over a 4-bit base: ``broadcast_coalesced`` flattens each dtype's
    parameters into one bucket, the fp32 one (embedding, norms, adapters, head and its copy) first,
    as it holds the first parameter, then the uint8 one (the packed weights); then the reducer's one
    bucket of the fp32 trainable parameters. Seen in the real ``DistributedDataParallel`` built on
    CPU by the trainer's own steps (fake process group), at the dispatcher."""
    pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    plan, workload = _case("ddp2-bf16-master-head-copy-fused")
    run = trainer_run(SMALL, workload, plan)
    flats = [e.size for e in run if e.op == ALLOC and e.tag in ("ddp.broadcast_flat", "reducer.bucket")]
    seen = ddp_broadcast_flats(SMALL, plan)
    assert [size for _, size in seen] == flats
    assert [dtype for dtype, _ in seen] == ["torch.float32", "torch.uint8", "torch.float32"]


H200_PLAN = dict(QLORA, lora_rank=16, precision="bf16", recompute="full", seq_len=4096, micro_batch=4, global_batch=4)


def _job(**changes):
    return resolve_job("llama3-8b", None, dict(H200_PLAN, **changes), inference=False)


def _sizes(run) -> list[tuple[str, int, int]]:  # noqa: ANN001
    return [(e.op, e.size, e.stream) for e in run if e.op != MARK]


@pytest.mark.parametrize("name", ["bf16-1792", "zero1-dp2-fp32-single-head-copy"])
def test_fp4_allocates_as_nf4(name):
    """``get_4bit_type("fp4")`` is a 16-entry fp32 table as nf4's is, and the same kernels run
    (``quant_type`` picks the table): a plan in fp4 makes the same requests, in order, as in nf4."""
    plan, workload = _case(name)
    fp4 = plan.model_copy(update={"quant": "fp4"})
    assert _sizes(trainer_run(SMALL, workload, plan)) == _sizes(trainer_run(SMALL, workload, fp4))


def _live(run, upto_mark: str) -> int:  # noqa: ANN001
    live = 0
    for e in run:
        if e.op == MARK and e.tag == upto_mark:
            return live
        if e.op in (ALLOC, FREE) and e.category == Category.PARAMETERS:
            live += e.size if e.op == ALLOC else -e.size
    raise AssertionError(upto_mark)


def _small(tokens: int = 4, **changes) -> tuple[Plan, TrainingWorkload]:
    return Plan(**dict(QLORA, **changes)), TrainingWorkload(seq_len=tokens, micro_batch=1)


def _shapes(m: ModelSpec) -> list[tuple[int, int]]:
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_size
    return [(q, h), (kv, h), (kv, h), (h, q), (f, h), (h, f), (f, h)]


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_built_base_holds_each_linear_packed_with_its_state(double_quant, precision):
    """After the build: each decoder linear's packed codes and quantization state, single (an
    fp32 absmax per 64) or double (``costmodel.quant``, measured on bitsandbytes' CPU storage,
    tests/unit/test_lora_quant.py), the dynamic map once under double quantization, the rest fp32
    (cast from bf16, or fp32 already), the fp32 adapters and head copy."""
    m, r = SMALL, QLORA["lora_rank"]
    plan, workload = _small(4, precision=precision, double_quant=double_quant, **HEAD)
    linears = m.num_layers * sum(
        packed_4bit_bytes(o * i) + absmax_4bit_bytes(o * i, double_quant) for o, i in _shapes(m)
    )
    rest = (3 * m.vocab_size * m.hidden_size + (2 * m.num_layers + 1) * m.hidden_size) * 4  # with the head copy
    adapters = m.num_layers * sum(r * (o + i) for o, i in _shapes(m)) * ADAPTER_BYTES
    dynamic = 1024 if double_quant else 0
    assert _live(trainer_run(m, workload, plan), "build") == linears + dynamic + rest + adapters


def test_fp32_casts_nothing_and_dequantizes_to_fp32():
    """Under ``precision: fp32`` the weights are quantized from fp32 and computed in fp32: no
    parameter is cast at the build (only the linears' fp32 weights go), the casts around
    ``MatMul4Bit`` are the input itself, each dequantized weight is 4 B an element."""
    plan, workload = _small(16, precision="fp32")
    run = trainer_run(SMALL, workload, plan)
    build = []
    for e in run:
        if e.op == MARK and e.tag == "build":
            break
        build.append(e)
    assert sum(e.op == FREE and e.category == Category.PARAMETERS for e in build) == 7 * SMALL.num_layers
    assert not [e for e in run if e.op == ALLOC and e.tag.endswith(("input_cast", "output_cast"))]
    weights = {e.size for e in run if e.op == ALLOC and e.tag.endswith("weight_dq")}
    assert weights == {o * i * 4 for o, i in _shapes(SMALL)}


def test_the_fused_kernel_allocates_its_output_alone():
    """At most 4 tokens every CUDA GPU runs bitsandbytes' fused ``gemm_4bit`` kernel: no
    dequantized weight nor absmax in the forward; the backward still dequantizes each weight
    (``MatMul4Bit.backward``) but layer 0's wq, wk and wv, whose input (the frozen embedding's,
    normed) needs no gradient: ``matmul_4bit`` calls ``gemm_4bit`` without ``MatMul4Bit`` there.
    Over 1536 tokens the fallback's three temporaries in every forward."""
    plan, workload = _small(4, precision="bf16")
    run = trainer_run(SMALL, workload, plan)
    assert not [e for e in run if e.op == ALLOC and e.tag.rpartition(".")[2] in CUDA_FALLBACK]
    backward = sum(e.op == ALLOC and e.tag.endswith(".weight_dq") for e in run)
    assert backward == 3 * (7 * SMALL.num_layers - 3)  # three steps
    plan, workload = _small(1537, precision="bf16")
    run = trainer_run(SMALL, workload, plan)
    fallback = [e for e in run if e.op == ALLOC and e.tag.rpartition(".")[2] in CUDA_FALLBACK]
    assert len(fallback) == 3 * 3 * 7 * SMALL.num_layers


@pytest.mark.parametrize(
    ("tokens", "n", "k", "compute", "path"),
    [
        (1537, 1024, 4096, 2, DEQUANTIZE),  # over _gemm_4bit_custom_max_m
        (1024, 1024, 4096, 2, DEQUANTIZE),  # N x K = 4 Mi: not the small-weight path, over 512 rows
        (512, 1024, 4096, 2, None),  # sm90: fallback at >= 1 wave; sm89: custom to 128 rows; ...
        (1024, 1024, 1024, 2, None),  # a small weight: the per-architecture tiers up to 1536 rows
        (4, 14336, 4096, 2, FUSED),  # _GEMM_4BIT_CUSTOM_FLOOR_M
        (7, 512, 128, 4, FUSED),  # fp32: the SIMT kernel under 8 rows
        (8, 512, 128, 4, DEQUANTIZE),
        (100, 512, 200, 2, DEQUANTIZE),  # K not a multiple of the blocksize
    ],
)
def test_gemm_4bit_takes_the_path_every_gpu_takes_or_none(tokens, n, k, compute, path):
    assert gemm_4bit_kernel(tokens, n, k, compute) == path


@pytest.mark.parametrize(
    "changes",
    [
        dict(quant="fp4", double_quant=False, lora_dropout=0.1, global_batch=8),
        dict(precision="fp32", dp=2, zero=1, seq_len=1024, micro_batch=1, **HEAD),
        dict(precision="bf16-master", dp=4, seq_len=1024, micro_batch=1, **HEAD),
    ],
    ids=["fp4-single-dropout-accum", "zero1-fp32-head-copy", "ddp-bf16-master-head-copy"],
)
def test_the_estimate_answers_these_plans_with_the_op_level_run(changes):
    job = _job(**changes)
    assert supported(job.model, job.workload, job.plan) is None


def test_the_estimate_replays_the_op_level_run():
    plan, workload = _case("ddp2-bf16-master-single-dropout-accum2-head-copy-fused")
    assert plan_run(SMALL, workload, plan, "memplan")[1] == "trainer"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (dict(seq_len=256, micro_batch=2, global_batch=2), "kernel the GPU picks"),
        (dict(precision="bf16-mixed"), "under autocast"),
    ],
    ids=["512-tokens", "autocast"],
)
def test_4bit_plans_it_does_not_follow_stay_on_the_phase_model(changes, reason):
    """Between 5 and 512 rows (and for small weights up to 1536) ``_gemm_4bit_use_custom_cuda``
    picks the kernel by the GPU's architecture and SM count, which the run does not know; the
    bundled trainer refuses autocast over a quantized base (``validate.support``)."""
    job = _job(**changes)
    assert reason in (supported(job.model, job.workload, job.plan) or "")
    assert trainer_run(job.model, job.workload, job.plan) is None


def test_every_decoder_linear_is_4bit_whatever_the_targets():
    """``quantize_base`` quantizes every decoder linear, targeted or not (``train.quant.LINEARS``)."""
    plan, workload = _small(4, lora_targets=("q_proj",))
    packed = [e for e in trainer_run(SMALL, workload, plan) if e.op == ALLOC and e.tag.endswith("weight_4bit")]
    assert len(packed) == len(HF_NAMES) * SMALL.num_layers
