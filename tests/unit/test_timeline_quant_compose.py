"""Quantized bases composed with the mechanisms the op-level run already follows: an LLM.int8 base
(``timeline/int8.py``) under selective-op or partial recompute, with a trained LM head copy, under
ZeRO-1; Qwen2's q, k, v biases (``qkv_bias.py``) over a 4-bit or int8 base; eager attention
(``eager.py``) and fp32 SDPA's memory-efficient kernel (``mem_efficient.py``) over either base.

No GPU ran these plans (tests/data/gpu-traces holds no int8 base and no quantized base beside
another of these mechanisms). Each case is held against the bundled trainer itself, run on CPU and
measured as tests/validate measures it, as tests/unit/test_timeline_quant_variants.py does, what a
CPU count cannot see set apart by name, each from its source: CUDA's temporaries
(``timeline_peaks.steady_peaks``: cuBLAS's workspaces, the 4-bit fallback's dequantized weight,
the softmax backward's and the memory-efficient kernel's temporaries), bitsandbytes' dynamic map
(a module-level cache the CPU meter does not track) and AdamW's host ``step`` scalars (4 B a
trained parameter, counted by the CPU meter, not on a GPU). What was missing before, found by
running these cases (2026-11-27, torch 2.13.0+cpu, bitsandbytes 0.50.2):

- ``quant.is_linear`` took q, k, v biases for linears: the run quantized them. Now a bias is copied
  after its weight is quantized (``quantize_linear``: ``nn.Parameter(linear.bias.detach().clone())``),
  freed with the replaced linear, cast to fp32 with the other 16-bit parameters, and on a 4-bit
  base's first forward turned into the compute dtype for good (``Linear4bit.forward``:
  ``bias.data = bias.data.to(x.dtype)``); its add is in the matmul's output. Before: +5,816 B over
  the trainer on a 2-layer Qwen2 shape (0.002%), the biases' packed codes and quantization state;
- a selective-op checkpoint counts CPU's ``MatMul8bitFp`` ``F.linear`` as an ``mm`` (Python ops under
  its dispatch mode); the run did not, and kept the wrong half of the layer's matmuls: 1,074,032 B
  (19%) under the trainer. CUDA's ``int8_scaled_mm`` is a custom op, no matmul to the policy;
- ``prepare_model_for_kbit_training`` casts a trained head copy and its frozen original to fp32 over
  an int8 base as over a 4-bit one (``quant.cast_to_fp32``, shared): the run kept them 16-bit,
  833,652 B (10%) under;
- DDP's broadcast of the parameters (``_sync_module_states``, at the build: no steady peak sees it)
  over an int8 base flattened the linears as 16-bit and the rest in the base's dtype; the real
  ``DistributedDataParallel`` flattens the fp32 ones (embedding, norms, biases, adapters, head),
  then the int8 ``CB`` (``lora.Lora._states``; 329,984 B and 73,728 B on the Qwen2 shape below,
  the run said 279,680 B and 65,536 B).

With those, every case below equals the trainer's peak to the byte, the step's and the forward's and
backward's, the three set-apart items aside; the eager, memory-efficient and partial-recompute and
ZeRO-1 int8 compositions did so before this change (the run composed them; only ``support.py``
declined them).
"""

from __future__ import annotations

import pytest
from timeline_peaks import ddp_broadcast_flats, steady_peaks

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline import ops, zero1
from memplan.costmodel.timeline.autograd import Tape
from memplan.costmodel.timeline.events import ALLOC, FREE, Builder, Category
from memplan.costmodel.timeline.int8 import Int8
from memplan.costmodel.timeline.lora import Lora, config
from memplan.costmodel.timeline.recompute import op_policy
from memplan.costmodel.timeline.support import sdpa_kernel
from memplan.costmodel.timeline.trainer import dims, supported, trainer_run
from memplan.costmodel.timeline.trainer_model import param_shapes
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

SMALL = ModelSpec(
    name="small-gqa", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_size=128, vocab_size=512
)
QWEN = SMALL.model_copy(update=dict(name="small-qwen2", qkv_bias=True))
MHA = SMALL.model_copy(update=dict(name="small-mha", num_kv_heads=4))  # fp32 SDPA: the memory-efficient kernel
QWEN_MHA = MHA.model_copy(update=dict(name="small-qwen2-mha", qkv_bias=True))
MODELS = {m.name: m for m in (SMALL, QWEN, MHA, QWEN_MHA)}
LORA = dict(finetune="qlora", lora_rank=8, lora_targets=("all-linear",))
INT8, NF4 = dict(LORA, quant="int8"), dict(LORA, quant="nf4")
HEAD = dict(modules_to_save=("lm_head",))
BROADCAST = ("ddp.broadcast_flat", "reducer.bucket")  # DDP's flattened buckets (ddp.py)
STEP_BYTES = 4  # AdamW's step: a host fp32 scalar per parameter (not on the GPU)

# name: (model, plan, (seq_len, micro_batch, global_batch)). A 4-bit base in bf16 at 4 tokens takes
# CUDA's fused kernel, over 1536 the fallback, in fp32 from 8 tokens the fallback (gemm_4bit_kernel).
CPU_CASES = {
    "int8-qwen2-selective-op-head-copy": (
        QWEN, dict(INT8, precision="bf16", recompute="selective-op", **HEAD), (64, 1, None)
    ),
    "int8-eager-zero1-dp2-partial-accum2": (
        SMALL, dict(INT8, precision="bf16", attention="eager", dp=2, zero=1, recompute="full", recompute_layers=1),
        (64, 1, 4),
    ),
    "nf4-qwen2-mha-fp32-efficient-selective-op-head-copy": (
        QWEN_MHA, dict(NF4, precision="fp32", recompute="selective-op", **HEAD), (32, 1, None)
    ),
    "nf4-qwen2-eager-fused-single": (
        QWEN, dict(NF4, precision="bf16", attention="eager", double_quant=False), (4, 1, None)
    ),
    "int8-selective-op": (SMALL, dict(INT8, precision="bf16", recompute="selective-op"), (64, 2, None)),
    "int8-fp32-selective-op-dropout-accum2": (
        SMALL, dict(INT8, precision="fp32", recompute="selective-op", lora_dropout=0.1), (64, 1, 2)
    ),
    "int8-head-copy": (SMALL, dict(INT8, precision="bf16", **HEAD), (64, 1, None)),
    "int8-bf16-master-head-copy-ddp2": (SMALL, dict(INT8, precision="bf16-master", dp=2, **HEAD), (64, 1, None)),
    "int8-zero1-dp2-head-copy": (SMALL, dict(INT8, precision="bf16", dp=2, zero=1, **HEAD), (64, 1, None)),
    "int8-partial-recompute": (
        SMALL, dict(INT8, precision="bf16", recompute="full", recompute_layers=1), (64, 1, None)
    ),
    "int8-qwen2-zero1-dp2": (QWEN, dict(INT8, precision="bf16", dp=2, zero=1), (64, 1, None)),
    "int8-ddp2-dropout-accum2": (SMALL, dict(INT8, precision="bf16", dp=2, lora_dropout=0.1), (64, 1, 4)),
    "int8-mha-efficient-selective-op": (MHA, dict(INT8, precision="bf16", recompute="selective-op"), (64, 1, None)),
    "int8-eager-selective": (
        SMALL, dict(INT8, precision="bf16", attention="eager", recompute="selective"), (64, 1, None)
    ),
    "nf4-qwen2-1792": (QWEN, dict(NF4, precision="bf16"), (256, 7, None)),
    "nf4-qwen2-ddp2-head-copy-fp32": (QWEN, dict(NF4, precision="fp32", dp=2, **HEAD), (32, 1, None)),
    "nf4-eager-selective-op-1792": (
        SMALL, dict(NF4, precision="bf16", attention="eager", recompute="selective-op"), (256, 7, None)
    ),
    "fp4-eager-fp32-full": (
        SMALL, dict(NF4, quant="fp4", precision="fp32", attention="eager", recompute="full"), (32, 1, None)
    ),
    "nf4-mha-efficient-1792": (MHA, dict(NF4, precision="bf16-master"), (256, 7, None)),
    "nf4-mha-efficient-fp32-zero1-dp2": (MHA, dict(NF4, precision="fp32", dp=2, zero=1, **HEAD), (32, 1, None)),
}  # fmt: skip
# in the default run four small cases that hold every composition once between them (int8 under
# selective-op, partial recompute, ZeRO-1, with a head copy, eager; biases over either base; the
# memory-efficient kernel and eager over a 4-bit base, fused and fallback); the rest under -m slow
DEFAULT = {
    "int8-qwen2-selective-op-head-copy",
    "int8-eager-zero1-dp2-partial-accum2",
    "nf4-qwen2-mha-fp32-efficient-selective-op-head-copy",
    "nf4-qwen2-eager-fused-single",
}


def _case(name: str) -> tuple[ModelSpec, Plan, TrainingWorkload]:
    model, changes, (seq, micro_batch, global_batch) = CPU_CASES[name]
    return model, Plan(**changes), TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=global_batch)


def _trained(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> list[tuple[str, int]]:
    """The trainable parameters (adapters, a head copy) in ``model.parameters()`` order."""
    d = dims(model, workload, plan)
    lora, scratch = Lora(Tape(Builder()), config(plan), d.tokens), Tape(Builder())
    for name, (rows, cols) in param_shapes(d, model.tied_embeddings).items():
        lora.build(scratch.new(rows * cols, 2, name), name, rows, cols)
    return lora.params()


def _zero1(plan: Plan) -> bool:
    return plan.zero == 1 and plan.dp > 1


def _predicted(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    """The run's steady peaks on CPU's kernels as the CPU meter counts them: without the dynamic
    map, with AdamW's host ``step`` scalars (those of the rank's partition under ZeRO-1)."""
    run = trainer_run(model, workload, plan, cuda=False)
    assert run is not None
    step, passes = steady_peaks([e for e in run if not e.tag.endswith("dynamic_map")])
    params = _trained(model, workload, plan)
    local = zero1.shard(params, plan.dp) if _zero1(plan) else params
    return step + STEP_BYTES * len(local), passes + STEP_BYTES * len(local)


def _measured(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    """The bundled trainer on CPU, the data rank the run follows (under ZeRO-1 the most-loaded),
    on SDPA's math backend where CUDA takes it (fp32 with GQA: ``support.sdpa_kernel``)."""
    pytest.importorskip("bitsandbytes")
    import contextlib

    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as backend

    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    rank = zero1.most_loaded(_trained(model, workload, plan), plan.dp) if _zero1(plan) else 0
    math = plan.attention != "eager" and sdpa_kernel(model, plan) == "math"
    with backend(SDPBackend.MATH) if math else contextlib.nullcontext():
        record = run(RunSpec(model=model, workload=workload, plan=plan, rank=rank, steps=2))
    assert record.status == "ok", record.reason
    return record.peak_allocated, max(record.phases[p].allocated for p in ("forward", "backward"))


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CPU_CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    model, plan, workload = _case(name)
    assert supported(model, workload, plan) is None  # the estimate follows it op by op
    predicted, measured = _predicted(model, workload, plan), _measured(model, workload, plan)
    for what, p, got in zip(("step", "forward and backward"), predicted, measured, strict=True):
        assert p == got, f"{name} {what}: predicted {p:,}, measured {got:,}"


def _live(run, tag: str) -> list[int]:  # noqa: ANN001 - a Timeline
    """The sizes of the allocations tagged ``tag`` still live at the run's end."""
    live: dict[int, int] = {}
    for e in run:
        if e.op == ALLOC and e.tag == tag:
            live[e.tensor] = e.size
        elif e.op == FREE:
            live.pop(e.tensor, None)
    return sorted(live.values())


@pytest.mark.parametrize(("precision", "tokens", "itemsize"), [("bf16", 4, 2), ("fp32", 32, 4)])
def test_a_4bit_base_keeps_its_biases_in_the_compute_dtype(precision, tokens, itemsize):
    """Over a 4-bit base the q, k, v biases are not quantized: after the build each is fp32
    (``prepare_model_for_kbit_training``), and ``Linear4bit.forward`` turns it into the compute
    dtype for good at the first forward (bf16 compute; fp32 compute: as it is)."""
    plan, workload = Plan(**dict(NF4, precision=precision)), TrainingWorkload(seq_len=tokens, micro_batch=1)
    run = list(trainer_run(QWEN, workload, plan, steady_steps=0))
    assert not [e for e in run if e.op == ALLOC and ".bias" in e.tag and "4bit" in e.tag]
    q, kv = QWEN.q_size, QWEN.kv_size
    for layer in range(QWEN.num_layers):
        sizes = [q * itemsize, kv * itemsize, kv * itemsize]
        got = [s for attr in ("wq", "wk", "wv") for s in _live(run, f"layers.{layer}.attention.{attr}.bias")]
        assert got == sizes
    biases = [e for e in run if e.op == ALLOC and e.tag.endswith(".bias")]
    assert {e.category for e in biases} == {Category.PARAMETERS}


def test_int8_selective_op_counts_cpus_base_matmul_but_not_cudas():
    """Under a selective-op checkpoint (``recompute.op_policy``) CPU's ``MatMul8bitFp`` runs an
    ``mm`` the policy counts (the first of a layer: kept), CUDA's ``MatMul8bitLt`` none."""
    name = "layers.0.feed_forward.w1.weight"

    def kept(cuda: bool) -> int:
        t = Tape(Builder())
        int8 = Int8(t, cuda)
        int8.build({name: t.managed(256 * 64, 2, name, Category.PARAMETERS)}, {name: (256, 64)})
        x = t.new(32 * 64, 4, "x")
        x.fn = ops.leaf({}, "x")
        seen = []

        def forward() -> None:
            int8.linear(x, name, 256, "w1")
            seen.append(len(t.region.kept.get("mm", [])))

        t.checkpoint(forward, [x], policy=op_policy())
        return seen[0]

    assert (kept(cuda=False), kept(cuda=True)) == (1, 0)


@pytest.mark.parametrize(
    "changes",
    [
        dict(INT8, recompute="selective-op"),
        dict(INT8, recompute="full", recompute_layers=8, **HEAD),
        dict(INT8, dp=2, zero=1, **HEAD),
        dict(NF4, attention="eager", recompute="full"),
        dict(INT8, attention="eager"),
    ],
    ids=["int8-selective-op", "int8-partial-head-copy", "int8-zero1-head-copy", "nf4-eager", "int8-eager"],
)
def test_the_estimate_answers_these_plans_with_the_op_level_run(changes):
    job = resolve_job("llama3-8b", None, dict(changes, precision="bf16", seq_len=2048, micro_batch=1), inference=False)
    assert supported(job.model, job.workload, job.plan) is None
    assert plan_run(job.model, job.workload, job.plan, "memplan")[1] == "trainer"


@pytest.mark.parametrize(
    ("hf", "changes"),
    [
        ("qwen2.5-7b", dict(NF4, precision="bf16")),
        ("qwen2.5-7b", dict(INT8, precision="bf16", recompute="selective-op")),
        ("llama3-8b", dict(NF4, precision="fp32", num_kv_heads=None)),
    ],
    ids=["qwen2-nf4", "qwen2-int8", "mha-fp32-nf4"],
)
def test_biased_and_memory_efficient_quantized_plans_are_answered_by_the_run(hf, changes):
    changes = {k: v for k, v in changes.items() if k != "num_kv_heads"}
    job = resolve_job(hf, None, dict(changes, seq_len=2048, micro_batch=1), inference=False)
    model = job.model
    if hf == "llama3-8b":  # without GQA: fp32 SDPA takes the memory-efficient kernel
        model = model.model_copy(update=dict(num_kv_heads=model.num_attention_heads))
        assert sdpa_kernel(model, job.plan) == "efficient"
    assert supported(model, job.workload, job.plan) is None
    assert plan_run(model, job.workload, job.plan, "memplan")[1] == "trainer"


def test_int8_under_autocast_stays_on_the_phase_model():
    """The bundled trainer refuses autocast over a quantized base (``validate.support``)."""
    plan = Plan(**dict(INT8, precision="bf16-mixed"))
    assert "LLM.int8" in (supported(SMALL, TrainingWorkload(seq_len=64), plan) or "")
    assert trainer_run(SMALL, TrainingWorkload(seq_len=64), plan) is None


@pytest.mark.parametrize(
    "changes",
    [dict(INT8, precision="bf16"), dict(NF4, precision="bf16-master", double_quant=False)],
    ids=["int8", "nf4"],
)
def test_ddp_broadcasts_a_biased_quantized_base_by_dtype(changes):
    """``_sync_module_states`` over a quantized Qwen2 base: ``broadcast_coalesced`` flattens each
    dtype's parameters into one bucket, the fp32 one (embedding, norms, the q, k, v biases,
    adapters, head) first, then the 1-byte one (int8 ``CB`` or packed 4-bit codes); then the
    reducer's bucket of the adapters. Seen in the real ``DistributedDataParallel`` built on CPU by
    the trainer's own steps (fake process group), at the dispatcher."""
    pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    plan, workload = Plan(**dict(changes, dp=2)), TrainingWorkload(seq_len=4, micro_batch=1)
    flats = [e.size for e in trainer_run(QWEN, workload, plan) if e.op == ALLOC and e.tag in BROADCAST]
    seen = ddp_broadcast_flats(QWEN, plan)
    assert [size for _, size in seen] == flats
    assert [dtype for dtype, _ in seen][:1] == ["torch.float32"]
