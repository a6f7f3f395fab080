"""ZeRO-1 (``timeline/zero1.py``), DDP under gradient accumulation (``no_sync``, ``timeline/ddp.py``),
fp32 over dp > 1 (``ddp.py``; ``fsdp.py`` without a mixed-precision policy), and accumulation,
selective-op and partial recompute with DDP, fp32 and bf16-master in the op-level run.

No GPU ran these plans: each is held against the bundled trainer itself, run on CPU under rank
simulation (the fake process group) and measured the way tests/validate measures it (MemTracker,
the steady peak over the measured steps), as tests/unit/test_timeline_recompute.py does. What the
op-level run allocates that only CUDA does is left out of the comparison: cuBLAS's workspaces
(``timeline_peaks.steady_peaks``), and the CUDA kernels' scratch (``embedding_dense_backward_cuda``'s
sort and segment buffers, the sum-to-weight staging buffer: ``ops.embedding``, ``Tape._validate``;
on CPU the embedding's backward allocates the weight gradient alone; ``softmax_backward_cuda_out``'s
``grad * output`` temporary in the math attention's backward, ``precision._safe_softmax``, which
the CPU kernel does without). Under fp32 with recompute and FSDP2 the last is where the run's
peak falls: counted, the run is 147,556 B (+0.51%) above the CPU trainer at ZeRO-3 dp 2 full
recompute, the CPU's peak being the MLP's backward, matched to 156 B. In fp32 the trainer runs
under SDPA's math backend, the kernel CUDA takes for fp32 with GQA (``support.sdpa_kernel``; on
CPU fp32 would take the CPU flash kernel). Under ZeRO-1 the trainer runs the rank the estimate
follows (``zero1.most_loaded``). Measured 2026-11-27 (torch 2.13.0+cpu): every case below
within 156 B of the trainer's peak, for the step and for the forward and backward alone (at most
0.001%; those few bytes are not traced to a tensor, as in test_timeline_recompute.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from timeline_peaks import measured_peaks, steady_peaks, trainer_record

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.reserve import plan_run, replay
from memplan.costmodel.timeline import zero1
from memplan.costmodel.timeline.events import ALLOC, Category
from memplan.costmodel.timeline.trainer import dims, supported, trainer_run
from memplan.costmodel.timeline.trainer_model import param_shapes
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
H200 = json.loads((TRACES / "h200.json").read_text())["runs"]
CPU_BOUND = 0.0001  # 0.01% of the trainer's peak, as test_timeline_recompute.py

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
TIED = TINY.model_copy(update=dict(name="tiny-tied", tied_embeddings=True))
# the CUDA kernels' scratch (module docstring): tags' last component
CUDA_ONLY = {
    "sorted_ids", "sort_order", "iota", "radix_sort_scratch", "segment_offsets", "num_segments", "segment_tmp",
    "scan_scratch", "partials_per_segment", "partial_offsets", "num_partials", "partial_segment_offsets",
    "grad_weight_per_segment", "reduce_workspace", "reduce_semaphores", "grad_times_output",
}  # fmt: skip

# name: (model, plan, (micro_batch, global_batch)); sequences of 128 tokens
CPU_CASES = {
    "zero1-dp2-bf16": (TINY, dict(precision="bf16", dp=2, zero=1), (1, None)),
    "zero1-dp4-tied-bf16": (TIED, dict(precision="bf16", dp=4, zero=1), (1, None)),
    "zero1-dp2-bf16-master": (TINY, dict(precision="bf16-master", dp=2, zero=1), (1, None)),
    "zero1-dp3-bf16-mixed-full": (TINY, dict(precision="bf16-mixed", dp=3, zero=1, recompute="full"), (1, None)),
    "zero1-dp2-bf16-master-full-1-layer-accum2": (
        TINY, dict(precision="bf16-master", dp=2, zero=1, recompute="full", recompute_layers=1), (2, 8)
    ),
    "zero1-dp2-fp32-full": (TINY, dict(precision="fp32", dp=2, zero=1, recompute="full"), (1, None)),
    "ddp-dp2-bf16-accum2": (TINY, dict(precision="bf16", dp=2), (1, 4)),
    "ddp-dp2-bf16-mixed-accum3": (TINY, dict(precision="bf16-mixed", dp=2), (1, 6)),
    "ddp-dp2-tied-selective-op-accum2-bf16": (TIED, dict(precision="bf16", dp=2, recompute="selective-op"), (1, 4)),
    "ddp-dp2-full-2-layers-bf16-mixed": (
        TINY, dict(precision="bf16-mixed", dp=2, recompute="full", recompute_layers=2), (1, None)
    ),
    "ddp-dp2-bf16-master-accum2": (TINY, dict(precision="bf16-master", dp=2), (1, 4)),
    "ddp-dp2-fp32": (TINY, dict(precision="fp32", dp=2), (1, None)),
    "ddp-dp2-fp32-full-2-layers-accum2": (
        TINY, dict(precision="fp32", dp=2, recompute="full", recompute_layers=2), (1, 4)
    ),
    "bf16-master-selective-op-accum2": (TINY, dict(precision="bf16-master", recompute="selective-op"), (1, 2)),
    "fp32-selective-op-accum2": (TINY, dict(precision="fp32", recompute="selective-op"), (1, 2)),
    "zero3-dp2-bf16-master-selective-op-accum2": (
        TINY, dict(precision="bf16-master", dp=2, zero=3, recompute="selective-op"), (1, 4)
    ),
    "zero2-dp4-bf16-master-full-2-layers-accum2": (
        TINY, dict(precision="bf16-master", dp=4, zero=2, recompute="full", recompute_layers=2), (1, 8)
    ),
    "zero3-dp2-fp32": (TINY, dict(precision="fp32", dp=2, zero=3), (1, None)),
    "zero2-dp2-fp32": (TINY, dict(precision="fp32", dp=2, zero=2), (1, None)),
    "zero3-dp4-fp32-accum2": (TINY, dict(precision="fp32", dp=4, zero=3), (1, 8)),
    "zero3-dp2-fp32-full": (TINY, dict(precision="fp32", dp=2, zero=3, recompute="full"), (1, None)),
    "zero3-dp4-fp32-selective-op-accum2": (
        TINY, dict(precision="fp32", dp=4, zero=3, recompute="selective-op"), (1, 8)
    ),
    "zero2-dp2-fp32-full-2-layers": (
        TINY, dict(precision="fp32", dp=2, zero=2, recompute="full", recompute_layers=2), (1, None)
    ),
    "tp2-sp-dp2-zero3-fp32": (TINY, dict(precision="fp32", tp=2, sequence_parallel=True, dp=2, zero=3), (1, None)),
    "tp2-sp-dp2-zero3-fp32-selective": (
        TINY, dict(precision="fp32", tp=2, sequence_parallel=True, dp=2, zero=3, recompute="selective"), (2, None)
    ),
}  # fmt: skip


def _cpu_peaks(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    """The steady peaks of the run the estimate replays, what only CUDA allocates left out."""
    run = trainer_run(model, workload, plan)
    assert run is not None
    return steady_peaks([e for e in run if e.tag.rsplit(".", 1)[-1] not in CUDA_ONLY])


def _rank(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> int:
    """The data rank the run follows: under ZeRO-1 the most-loaded partition's, else 0."""
    if plan.zero != 1 or plan.dp == 1:
        return 0
    shapes = param_shapes(dims(model, workload, plan), model.tied_embeddings)
    return zero1.most_loaded([(name, rows * cols) for name, (rows, cols) in shapes.items()], plan.dp)


def _measure(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    """The bundled trainer on CPU: the steady peak, and the forward's and backward's."""
    pytest.importorskip("torch")
    rank = _rank(model, workload, plan)
    return measured_peaks(trainer_record(model, workload, plan, rank, math=plan.precision == "fp32"))


def _check(name: str, model: ModelSpec, changes: dict, batch: tuple[int, int | None]) -> None:
    plan = Plan(**changes)
    workload = TrainingWorkload(seq_len=128, micro_batch=batch[0], global_batch=batch[1])
    predicted, measured = _cpu_peaks(model, workload, plan), _measure(model, workload, plan)
    for what, p, got in zip(("step", "forward and backward"), predicted, measured, strict=True):
        assert abs(p / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {p:,}, measured {got:,}"


# in the default run: each mechanism once (ZeRO-1 alone and tied; DDP's no_sync; fp32 over FSDP2 and TP); the
# others under -m slow (the default suite's time)
DEFAULT = {"zero1-dp2-bf16", "zero1-dp4-tied-bf16", "ddp-dp2-bf16-accum2", "zero3-dp2-fp32", "tp2-sp-dp2-zero3-fp32"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CPU_CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    model, changes, (micro_batch, global_batch) = CPU_CASES[name]
    workload = TrainingWorkload(seq_len=128, micro_batch=micro_batch, global_batch=global_batch)
    assert supported(model, workload, Plan(**changes)) is None  # the estimate follows it op by op
    _check(name, *CPU_CASES[name])


def test_zero1_partitions_whole_parameters_largest_first_onto_the_lightest_rank():
    """``_partition_parameters``: a stable sort by size, each to the first rank of fewest elements."""
    params = [("a", 3), ("b", 5), ("c", 3), ("d", 1), ("e", 2)]
    assert zero1.partition(params, 2) == [[("b", 5), ("e", 2)], [("a", 3), ("c", 3), ("d", 1)]]
    assert zero1.most_loaded(params, 2) == 0
    assert zero1.shard(params, 2, rank=1) == [("a", 3), ("c", 3), ("d", 1)]
    assert zero1.partition([("a", 4), ("b", 4)], 3) == [[("a", 4)], [("b", 4)], []]


def _ddp1b(**changes):
    model, *rest = H200["h200_a_ddp1b"]["args"]
    flags = {rest[i].removeprefix("--").replace("-", "_"): rest[i + 1] for i in range(0, len(rest), 2)}
    flags.pop("allocator")
    plan = {k: int(v) if v.isdigit() else v for k, v in flags.items()}
    return resolve_job(str(TRACES / model), None, dict(plan, **changes), inference=False)


def _allocated(timeline, category: Category) -> list[tuple[str, int]]:
    return [(e.tag, e.size) for e in timeline if e.op == ALLOC and e.category == category]


def test_zero1_is_ddp_with_the_optimizer_of_its_partition_alone():
    """h200_a_ddp1b's plan at ZeRO-1: DDP's buckets as at ZeRO-0, AdamW's two fp32 moments over
    the most-loaded rank's parameters only, in its optimizer's order (largest first)."""
    ddp, z1 = _ddp1b(), _ddp1b(zero=1)
    a, b = trainer_run(ddp.model, ddp.workload, ddp.plan), trainer_run(z1.model, z1.workload, z1.plan)
    assert _allocated(a, Category.GRADIENTS) == _allocated(b, Category.GRADIENTS)
    shapes = param_shapes(dims(z1.model, z1.workload, z1.plan), z1.model.tied_embeddings)
    params = [(name, rows * cols) for name, (rows, cols) in shapes.items()]
    mine = zero1.shard(params, z1.plan.dp)
    states = _allocated(b, Category.OPTIMIZER_STATES)
    assert states == [(f"{n}.{s}", numel * 4) for n, numel in mine for s in ("exp_avg", "exp_avg_sq")]
    assert sum(size for _, size in states) < sum(size for _, size in _allocated(a, Category.OPTIMIZER_STATES))


@pytest.mark.parametrize(
    "changes",
    [
        dict(dp=2, precision="bf16-mixed", recompute="full"),
        dict(dp=4, zero=1, precision="bf16", recompute="selective-op"),
    ],
    ids=["ddp-full", "zero1-selective-op"],
)
def test_ddp_micro_batches_past_the_second_change_no_peak(changes):
    """Under ``no_sync`` the micro-batches between the first and the last hold every gradient
    and add into it as the second does before its sync: following all six of a six-micro-batch
    step gives the same allocated and reserved peaks as following two, both allocators."""
    job = resolve_job(
        str(TRACES / "llama1b.config.json"), None, dict(changes, seq_len=4096, global_batch=6 * changes["dp"]), False
    )
    short = trainer_run(job.model, job.workload, job.plan)
    full = trainer_run(job.model, job.workload, job.plan, max_micro_batches=6)
    assert len(full.events) > len(short.events)
    for expandable in (False, True):
        config = AllocatorConfig(expandable_segments=expandable)
        a, b = replay(short, config), replay(full, config)
        assert (a.max_allocated, a.max_reserved) == (b.max_allocated, b.max_reserved)


def test_ddp_accumulation_holds_the_gradients_until_the_synced_micro_batch():
    """``no_sync``: the first micro-batch's gradients stay (each parameter's, the tied pair's
    once) until the last micro-batch copies them into the buckets; without accumulation each
    goes as soon as it is copied in. On h200_a_ddp1b's plan the peak rises by exactly the fp32
    gradients (4,943,257,600 B)."""
    one, two = _ddp1b(), _ddp1b(global_batch=2 * _ddp1b().workload.micro_batch * 2)
    peak_one = steady_peaks(trainer_run(one.model, one.workload, one.plan))[0]
    peak_two = steady_peaks(trainer_run(two.model, two.workload, two.plan))[0]
    params = sum(r * c for r, c in param_shapes(dims(one.model, one.workload, one.plan), True).values())
    assert peak_two - peak_one == params * 4  # every fp32 gradient held at the peak


def test_the_estimate_answers_these_plans_with_the_op_level_run():
    llama1b = str(TRACES / "llama1b.config.json")
    for model, changes in (
        (llama1b, dict(dp=8, zero=1, precision="bf16-master")),
        (llama1b, dict(dp=4, zero=0, precision="bf16-mixed", recompute="selective-op", global_batch=16)),
        (llama1b, dict(dp=2, zero=1, precision="fp32", recompute="full", recompute_layers=4, global_batch=8)),
        ("llama3-8b", dict(dp=8, zero=3, precision="fp32")),
        ("llama3-8b", dict(dp=4, tp=2, sequence_parallel=True, zero=3, precision="fp32", recompute="full")),
        ("llama3-8b", dict(dp=8, zero=2, precision="bf16-master", recompute="selective-op", global_batch=32)),
    ):
        job = resolve_job(model, None, dict(seq_len=4096, micro_batch=2, **changes), False)
        assert supported(job.model, job.workload, job.plan) is None
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", which


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (
            dict(dp=2, zero=0, offload_activations="cpu", global_batch=4),
            "activation offload with accumulation over data parallel",
        ),
        (dict(dp=2, zero=1, offload_optimizer="cpu"), "offload"),
    ],
    ids=["act-offload-ddp-accum2", "zero1-offload"],
)
def test_what_is_not_checked_stays_on_the_phase_model(changes, reason):
    job = resolve_job("llama3-8b", None, dict(seq_len=4096, micro_batch=1, **changes), False)
    assert reason in (supported(job.model, job.workload, job.plan) or "")
    assert trainer_run(job.model, job.workload, job.plan) is None
