"""Selective-op recompute, partial recompute (``recompute_layers``) and gradient accumulation in the
op-level run (``costmodel/timeline/recompute.py``, ``trainer.py``, ``fsdp.py``).

Selective-op is held against its H200 run (tests/data/gpu-traces/h200.json: h200_a_selop1b). No GPU
ran partial recompute, accumulation or selective-op under TP: those are held against the bundled
trainer itself, run on CPU under rank simulation and measured the way tests/validate measures it
(MemTracker, the steady peak over the measured steps). The CPU run differs from the CUDA one in its
kernels only; of what the op-level run allocates, cuBLAS's two 32 MiB workspaces are CUDA's alone,
so they are left out of the comparison. The run compared is the one the estimate replays (at most
``MICRO_BATCHES_MODELLED`` micro-batches a step), against a trainer that runs them all. Measured
2026-11-27 (torch 2.13.0+cpu): every case below within 156 B of the trainer's peak, for the step
and for the forward and backward alone (at most 0.001%; those few bytes are not traced to a
tensor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from timeline_peaks import steady_peaks

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.reserve import plan_run, replay
from memplan.costmodel.timeline.trainer import MICRO_BATCHES_MODELLED, supported, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
H200 = json.loads((TRACES / "h200.json").read_text())["runs"]
ALLOCATED_BOUND, RESERVED_BOUND = 0.005, 0.01  # issue 27: allocated within 0.5%, reserved within 1%
CPU_BOUND = 0.0001  # 0.01% of the trainer's peak: a layer's smallest activation is 0.5% of it here

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
TIED = TINY.model_copy(update=dict(name="tiny-tied", tied_embeddings=True))


def _selop_job():
    args = H200["h200_a_selop1b"]["args"]
    assert args[:1] == ["llama1b.config.json"] and "selective-op" in args
    plan = dict(dp=1, precision="bf16-mixed", recompute="selective-op", seq_len=4096, micro_batch=2)
    return resolve_job(str(TRACES / "llama1b.config.json"), None, plan, inference=False)


def test_selective_op_replays_the_h200_run():
    run = H200["h200_a_selop1b"]
    job = _selop_job()
    timeline = trainer_run(job.model, job.workload, job.plan)
    result = replay(timeline, AllocatorConfig(expandable_segments=True))
    assert result.failure is None
    allocated, reserved = run["measured_allocated"], run["measured_reserved"]
    assert abs(result.max_allocated / allocated - 1) <= ALLOCATED_BOUND, (result.max_allocated, allocated)
    assert abs(result.max_reserved / reserved - 1) <= RESERVED_BOUND, (result.max_reserved, reserved)


def test_the_estimate_answers_these_plans_with_the_op_level_run():
    llama1b = str(TRACES / "llama1b.config.json")
    for model, changes in (
        (llama1b, dict(recompute="selective-op")),
        (llama1b, dict(recompute="full", recompute_layers=5)),
        (llama1b, dict(global_batch=8)),
        ("llama3-8b", dict(dp=8, zero=3, recompute="selective-op", global_batch=32)),
    ):
        job = resolve_job(model, None, dict(precision="bf16-mixed", seq_len=4096, micro_batch=2, **changes), False)
        assert supported(job.model, job.workload, job.plan) is None
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", which


def _steady_peaks(model: ModelSpec, workload: TrainingWorkload, plan: Plan, micro_batches: int) -> tuple[int, int]:
    """The run's highest live bytes over the steady steps, and outside the optimizer step (the
    forward's and backward's: the live bytes when an optimizer temporary is allocated do not
    count), cuBLAS's workspaces (CUDA's) left out."""
    return steady_peaks(trainer_run(model, workload, plan, max_micro_batches=micro_batches))


def test_more_micro_batches_than_two_add_nothing():
    """From the second micro-batch on, every gradient is held and each new one is added in place
    (AccumulateGrad; FSDP2's ``sharded_param.grad += ``): a fourth micro-batch peaks as the second."""
    for model, plan in ((TINY, Plan(precision="bf16")), (TINY, Plan(precision="bf16-mixed", dp=4, zero=3))):
        peaks = [
            _steady_peaks(model, TrainingWorkload(seq_len=160, micro_batch=2, global_batch=2 * plan.dp * m), plan, m)[1]
            for m in (1, 2, 4)
        ]
        assert peaks[0] < peaks[1] == peaks[2], peaks


@pytest.mark.parametrize(
    ("model", "plan"),
    [
        ("llama1b", dict(precision="bf16-mixed", recompute="selective-op", micro_batch=2)),
        ("llama3-8b", dict(dp=4, tp=2, sequence_parallel=True, zero=3, precision="bf16", recompute="selective-op")),
    ],
    ids=["1b-selective-op", "8b-tp2-sp-zero3-selective-op"],
)
def test_micro_batches_past_the_second_change_no_peak(model, plan):
    """The run follows at most ``MICRO_BATCHES_MODELLED`` micro-batches of a step: following all
    six of a six-micro-batch step gives the same allocated and reserved peaks, both allocators."""
    model = str(TRACES / "llama1b.config.json") if model == "llama1b" else model
    micro_batch = plan.get("micro_batch", 1)
    dp = plan.get("dp", 1)
    job = resolve_job(model, None, dict(plan, seq_len=4096, global_batch=6 * micro_batch * dp), inference=False)
    short = trainer_run(job.model, job.workload, job.plan)
    full = trainer_run(job.model, job.workload, job.plan, max_micro_batches=6)
    assert len(full.events) > len(short.events)
    for expandable in (False, True):
        config = AllocatorConfig(expandable_segments=expandable)
        a, b = replay(short, config), replay(full, config)
        assert (a.max_allocated, a.max_reserved) == (b.max_allocated, b.max_reserved)


# name: (model, plan, (micro_batch, global_batch)): each mechanism alone, on one rank, under FSDP2
# ZeRO-3 and under TP + SP, and together; sequences of 128 tokens
CPU_CASES = {
    "selective-op-bf16-mixed-accum2": (TINY, dict(precision="bf16-mixed", recompute="selective-op"), (1, 2)),
    "full-2-of-4-layers-bf16": (TINY, dict(precision="bf16", recompute="full", recompute_layers=2), (1, None)),
    "tied-accum2-bf16": (TIED, dict(precision="bf16"), (1, 2)),
    "zero3-dp4-selective-op-bf16-mixed": (
        TINY, dict(precision="bf16-mixed", dp=4, zero=3, recompute="selective-op"), (1, None)
    ),
    "zero3-dp4-full-2-layers-accum3-bf16": (
        TINY, dict(precision="bf16", dp=4, zero=3, recompute="full", recompute_layers=2), (1, 12)
    ),
    "tp2-sp-dp2-zero3-selective-op-bf16-mixed": (
        TINY, dict(precision="bf16-mixed", tp=2, sequence_parallel=True, dp=2, zero=3, recompute="selective-op"),
        (2, None),
    ),
    # the shape that missed by 315,036 B until the meter stopped holding the embedding's unsharded
    # gradient over the reduce-scatter (memplan/train/fsdp_meter.py; docs/cost-model.md)
    "tp2-sp-dp2-zero3-selective-op-bf16-mixed-1x128": (
        TINY, dict(precision="bf16-mixed", tp=2, sequence_parallel=True, dp=2, zero=3, recompute="selective-op"),
        (1, None),
    ),
}  # fmt: skip


SLOW_CPU_CASES = {"tp2-sp-dp2-zero3-selective-op-bf16-mixed-1x128"}  # 5 s; its 2 x 128 sibling stays default


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_CPU_CASES else []) for n in CPU_CASES]
)
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    pytest.importorskip("torch")
    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    model, changes, (micro_batch, global_batch) = CPU_CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=128, micro_batch=micro_batch, global_batch=global_batch)
    peak, passes = _steady_peaks(model, workload, plan, MICRO_BATCHES_MODELLED)  # the run the estimate replays
    record = run(RunSpec(model=model, workload=workload, plan=plan, rank=0, steps=2))
    assert record.status == "ok", record.reason
    measured = (record.peak_allocated, max(record.phases[p].allocated for p in ("forward", "backward")))
    for what, predicted, got in zip(("step", "forward and backward"), (peak, passes), measured, strict=True):
        assert abs(predicted / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {predicted:,}, measured {got:,}"
