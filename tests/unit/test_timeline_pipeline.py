"""Pipeline parallelism in the op-level run (``costmodel/timeline/pipeline.py``): one pipeline rank of
the bundled trainer, ``StageReplay`` over GPipe, 1F1B and the interleaved schedule.

On one data rank it is held against the bundled trainer itself, run on CPU under rank simulation and
measured the way tests/validate measures it (MemTracker, the steady peak over the measured steps), as
tests/unit/test_timeline_recompute.py does; cuBLAS's two workspaces are CUDA's alone and left out.
Measured 2026-11-27 (torch 2.13.0+cpu): every case below within 76 B of the trainer's peak, for the
step and for the forward and backward alone (at most 0.0006%; those bytes are not traced to a tensor).

The one pipelined GPU trace, h200_b_pp4 (FSDP2 ZeRO-2 over dp 2), is not modelled: FSDP2 under
pipelining stays on the phase model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.memory import training_peak
from memplan.costmodel.reserve import plan_run, replay
from memplan.costmodel.timeline.events import ALLOC, FREE, MARK, Category
from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
H200 = json.loads((TRACES / "h200.json").read_text())["runs"]
ALLOCATED_BOUND, RESERVED_BOUND = 0.005, 0.01  # issue 27: allocated within 0.5%, reserved within 1%
CPU_BOUND = 0.0001  # 0.01% of the trainer's peak

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
TIED = TINY.model_copy(update=dict(name="tiny-tied", tied_embeddings=True))


def _steady_peaks(model: ModelSpec, workload: TrainingWorkload, plan: Plan, stage: int) -> tuple[int, int]:
    """The run's highest live bytes over the steady steps, and outside the optimizer step, without
    cuBLAS's workspaces."""
    timeline = trainer_run(model, workload, plan, stage=stage)
    assert timeline is not None
    live = best = passes = 0
    steady = False
    for e in timeline:
        if e.op == MARK:
            steady = steady or e.tag == "step0"
        elif e.tag.startswith("cublas_workspace"):
            continue
        elif e.op == ALLOC:
            live += e.size
            best = max(best, live) if steady else best
            if steady and e.category != Category.OPTIMIZER_TEMP:
                passes = max(passes, live)
        elif e.op == FREE:
            live -= e.size
    return best, passes


# name: (model, plan, global batch, pipeline rank); micro-batches of 1 x 128 tokens
CPU_CASES = {
    "1f1b-pp2-first-bf16": (TINY, dict(precision="bf16", pp=2), 4, 0),
    "1f1b-pp2-last-bf16-mixed": (TINY, dict(precision="bf16-mixed", pp=2), 4, 1),
    "1f1b-pp2-first-full-recompute-m6": (TINY, dict(precision="bf16-mixed", pp=2, recompute="full"), 6, 0),
    "1f1b-pp4-middle-tied": (TIED, dict(precision="bf16", pp=4), 8, 1),
    "1f1b-pp4-last-tied-selective": (TIED, dict(precision="bf16", pp=4, recompute="selective"), 8, 3),
    "1f1b-pp4-m2-partial-recompute": (TINY, dict(precision="bf16", pp=4, recompute="full", recompute_layers=1), 2, 0),
    "gpipe-pp2-last": (TINY, dict(precision="bf16", pp=2, pp_schedule="gpipe"), 4, 1),
    "interleaved-pp2-v2-first": (TINY, dict(precision="bf16", pp=2, pp_schedule="interleaved", virtual_stages=2), 4, 0),
    "interleaved-pp2-v2-last-selective-op": (
        TINY,
        dict(precision="bf16-mixed", pp=2, pp_schedule="interleaved", virtual_stages=2, recompute="selective-op"),
        4,
        1,
    ),
}


@pytest.mark.parametrize("name", CPU_CASES)
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    pytest.importorskip("torch")
    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    model, changes, global_batch, stage = CPU_CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=128, micro_batch=1, global_batch=global_batch)
    assert supported(model, workload, plan) is None
    peak, passes = _steady_peaks(model, workload, plan, stage)
    record = run(RunSpec(model=model, workload=workload, plan=plan, rank=stage, steps=2))
    assert record.status == "ok", record.reason
    measured = (record.peak_allocated, max(record.phases[p].allocated for p in ("forward", "backward")))
    for what, predicted, got in zip(("step", "forward and backward"), (peak, passes), measured, strict=True):
        assert abs(predicted / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {predicted:,}, measured {got:,}"


def test_the_estimate_answers_pipelines_on_one_data_rank_with_the_op_level_run():
    for changes in (
        dict(pp=4),
        dict(pp=2, pp_schedule="gpipe", recompute="selective-op"),
        dict(pp=2, pp_schedule="interleaved", virtual_stages=2, precision="bf16"),
    ):
        plan = dict(dict(precision="bf16-mixed", recompute="full", seq_len=4096, global_batch=8), **changes)
        job = resolve_job("llama3-8b", None, plan, inference=False)
        assert supported(job.model, job.workload, job.plan) is None
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", which


def test_the_default_rank_is_the_phase_models_most_loaded_one():
    """``memplan validate`` runs the phase model's most-loaded rank: the run follows the same one."""
    job = resolve_job("llama3-8b", None, dict(pp=4, precision="bf16", seq_len=2048, global_batch=8), False)
    stage = training_peak(job.model, job.workload, job.plan).stage
    default = trainer_run(job.model, job.workload, job.plan)
    chosen = trainer_run(job.model, job.workload, job.plan, stage=stage)
    assert [(e.op, e.size, e.tag) for e in default] == [(e.op, e.size, e.tag) for e in chosen]


def test_pipelines_it_cannot_follow_stay_on_the_phase_model():
    for changes in (dict(dp=2, zero=2), dict(precision="fp32"), dict(dp=2, zero=0)):
        plan = dict(dict(pp=4, precision="bf16-mixed", global_batch=16), **changes)
        job = resolve_job("llama3-8b", None, plan, inference=False)
        assert "pipeline" in supported(job.model, job.workload, job.plan)
        assert trainer_run(job.model, job.workload, job.plan) is None


@pytest.mark.xfail(
    strict=True,
    reason="FSDP2 under pipelining (ZeRO-2, dp 2) is not in the op-level run: the phase model's run replays to "
    "34,462,686,208 B allocated (-0.07%) and 38,377,881,600 B reserved (-15.6%) against the trace recorded "
    "before StageReplay's fix (commit 4e861b9)",
)
def test_the_h200_pp4_trace():
    run = H200["h200_b_pp4"]
    plan = dict(
        dp=2, pp=4, zero=2, precision="bf16-mixed", recompute="full", seq_len=4096, micro_batch=1, global_batch=16
    )
    job = resolve_job("llama3-8b", None, plan, inference=False)
    timeline, _ = plan_run(job.model, job.workload, job.plan, "memplan")
    result = replay(timeline, AllocatorConfig())
    assert abs(result.max_allocated / run["measured_allocated"] - 1) <= ALLOCATED_BOUND
    assert abs(result.max_reserved / run["measured_reserved"] - 1) <= RESERVED_BOUND
