"""Pipeline parallelism in the op-level run (``costmodel/timeline/pipeline.py``): one pipeline rank of
the bundled trainer, ``StageReplay`` over GPipe, 1F1B and the interleaved schedule.

Held against the bundled trainer itself, run on CPU under rank simulation and measured the way
tests/validate measures it (MemTracker, the steady peak over the measured steps), as
tests/unit/test_timeline_recompute.py does; cuBLAS's two workspaces are CUDA's alone and left out.
Measured 2026-11-27 (torch 2.13.0+cpu): every case below within 76 B of the trainer's peak, for the
step and for the forward and backward alone (at most 0.0006%; those bytes are not traced to a tensor).

The pipelined GPU trace, h200_b_pp4 (llama3-8b, dp 2, pp 4, FSDP2 ZeRO-2, bf16-mixed, rank 6: the
last stage), was re-recorded on an H200 on 2026-11-28 with the current StageReplay (the first
recording ran the StageReplay before its fix, which kept less); the run replays it: allocated
4,096 B under the measured 35,337,867,776 B, reserved exact (46,414,168,064 B).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from timeline_peaks import steady_peaks

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.memory import training_peak
from memplan.costmodel.reserve import plan_run, replay
from memplan.costmodel.timeline.support import PIPELINE_LAYER_PASSES
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
    return steady_peaks(trainer_run(model, workload, plan, stage=stage))


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
    "1f1b-pp2-last-zero2-dp2-bf16": (TINY, dict(precision="bf16", pp=2, dp=2, zero=2), 8, 1),
    "1f1b-pp2-last-zero2-dp2-bf16-mixed": (TINY, dict(precision="bf16-mixed", pp=2, dp=2, zero=2), 8, 1),
    "1f1b-pp2-first-zero2-full-recompute": (
        TINY,
        dict(precision="bf16-mixed", pp=2, dp=2, zero=2, recompute="full"),
        8,
        0,
    ),
    "1f1b-pp2-first-zero3-dp2": (TINY, dict(precision="bf16-mixed", pp=2, dp=2, zero=3), 8, 0),
    "gpipe-pp4-middle-zero3-dp2": (TINY, dict(precision="bf16-mixed", pp=4, dp=2, zero=3, pp_schedule="gpipe"), 8, 2),
    "1f1b-pp4-zero2-dp4-selective-op": (
        TINY,
        dict(precision="bf16", pp=4, dp=4, zero=2, recompute="selective-op"),
        16,
        1,
    ),
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
    rank = stage * plan.dp  # RunSpec.stage_of
    record = run(RunSpec(model=model, workload=workload, plan=plan, rank=rank, steps=2))
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


def test_pipelines_past_the_layer_budget_stay_on_the_phase_model():
    """The schedule runs every micro-batch: past ``PIPELINE_LAYER_PASSES`` layer forwards a step
    the phase model answers (llama3-8b, pp 4: 8 layers a rank, so 128 micro-batches and no more)."""
    assert PIPELINE_LAYER_PASSES == 1024
    for m, ok in ((128, True), (136, False)):
        job = resolve_job("llama3-8b", None, dict(pp=4, precision="bf16", global_batch=m), inference=False)
        assert (supported(job.model, job.workload, job.plan) is None) == ok, m


def test_pipelines_it_cannot_follow_stay_on_the_phase_model():
    for changes in (
        dict(dp=2, zero=2, pp_schedule="interleaved", virtual_stages=2, global_batch=512),  # past the layer budget
        dict(dp=2, zero=3, offload_params="cpu", offload_optimizer="cpu"),
        dict(dp=2, zero=0),
        dict(dp=2, zero=1),
    ):
        plan = dict(dict(pp=4, precision="bf16-mixed", global_batch=16), **changes)
        job = resolve_job("llama3-8b", None, plan, inference=False)
        assert "pipeline" in supported(job.model, job.workload, job.plan)
        assert trainer_run(job.model, job.workload, job.plan) is None


def _pp4_job():
    args = H200["h200_b_pp4"]["args"]
    assert args[:1] == ["llama3-8b"] and " ".join(args[1:9]) == "--dp 2 --pp 4 --zero 2 --precision bf16-mixed"
    plan = dict(
        dp=2, pp=4, zero=2, precision="bf16-mixed", recompute="full", seq_len=4096, micro_batch=1, global_batch=16
    )
    return resolve_job("llama3-8b", None, plan, inference=False)


def _replays_the_pp4_trace(timeline) -> None:  # noqa: ANN001
    run = H200["h200_b_pp4"]
    result = replay(timeline, AllocatorConfig())
    assert result.failure is None
    allocated, reserved = run["measured_allocated"], run["measured_reserved"]
    assert abs(result.max_allocated / allocated - 1) <= ALLOCATED_BOUND, (result.max_allocated, allocated)
    assert abs(result.max_reserved / reserved - 1) <= RESERVED_BOUND, (result.max_reserved, reserved)


def test_the_h200_pp4_trace():
    job = _pp4_job()
    timeline, which = plan_run(job.model, job.workload, job.plan, "memplan")
    assert which == "trainer", which
    _replays_the_pp4_trace(timeline)
