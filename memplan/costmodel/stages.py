"""The pipeline rank an op-level estimate follows: every stage's run, replayed, and the one that
runs out of memory first.

Pipeline ranks differ (the first stage holds the embedding and the most micro-batches in flight,
the last the head, the loss and its logits), and which one peaks depends on the schedule, the
micro-batches, recomputation, the precision and the device's kernels. The phase model's sums used
to name the rank (``memory.training_peak(...).stage``) and were wrong where its bytes were
(pp4-fp32-4-microbatches on CPU; llama3-8b pp 4 m 4 moved between interleaved releases), so the
estimate then reported a rank that is not the most loaded, and its "fits" was another rank's.

A stage's run builds only its own chunks (``L / pp`` layers, every micro-batch of the schedule:
``trainer.trainer_run``), so running every stage costs about one full-depth run. Each is replayed
through the caching allocator within the limit (``reserve.device_verdict``: on CPU its live bytes,
``cpu_reserve.cpu_verdict``) and the followed stage is the one the user's verdict needs
(:func:`load_key`): a stage the allocator cannot serve before one it can (the job dies on the
first rank that runs out of memory), then the highest reserved peak (the least headroom against
the same capacity: every rank of the plan has the same GPU and the same memory outside the
allocator, ``overhead.communicators``), then the highest allocated, then the lowest stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from memplan.costmodel.reserve import StageLoad, Verdict, device_verdict, plan_run

if TYPE_CHECKING:
    from memplan.costmodel.allocator import AllocatorConfig
    from memplan.specs.hardware import GPUSpec
    from memplan.specs.model import ModelSpec
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload


NO_LIMIT = 1 << 62  # bytes: no capacity binds (every stage fits, ordered by its reserved)


@dataclass(frozen=True, slots=True)
class _Stage:
    stage: int
    v: Verdict


def load_key(stage: int, v: Verdict) -> tuple[bool, int, int, int]:
    """The order of the stages, most loaded first: one that does not fit within the limit before
    one that does, then the higher reserved peak (``Verdict.reserved``: unbounded where it does not
    fit, what the allocator holds within the limit where it does), the higher allocated peak, the
    lower stage."""
    return (v.fits, -v.reserved, -v.replay.max_allocated, stage)


def stage_verdict(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    config: AllocatorConfig,
    limit_bytes: int,
    device: str = "cuda",
    gpu: GPUSpec | None = None,
) -> Verdict:
    """The bundled trainer's pipelined plan: each stage's run (``reserve.plan_run`` on that stage)
    replayed within ``limit_bytes``; the verdict of the most loaded one (:func:`load_key`), with
    every stage's figures (``Verdict.stage_loads``). Only the followed stage's run is kept."""
    best: _Stage | None = None
    loads: dict[int, StageLoad] = {}
    for stage in range(plan.pp):
        run, which = plan_run(model, workload, plan, "memplan", device, gpu, stage=stage)
        assert which == "trainer", f"stage {stage}: {which}"  # supported() is the same for every stage
        v = device_verdict(run, config, limit_bytes, device == "cpu")
        phases = v.replay.phase_peaks or {}
        loads[stage] = StageLoad(v.reserved, v.replay.max_allocated, max(phases.values(), default=0))
        if best is None or load_key(stage, v) < load_key(best.stage, best.v):
            best = _Stage(stage, replace(v, timeline=which, run=run))
    assert best is not None
    return replace(best.v, stage_loads=loads)


def run_stage(model: ModelSpec, workload: TrainingWorkload, plan: Plan, device: str = "cuda") -> int:
    """The most loaded stage by the runs (:func:`stage_verdict`) where no limit binds: the highest
    reserved peak under the default allocator (on CPU the highest live bytes)."""
    from memplan.costmodel.allocator import AllocatorConfig

    run = stage_verdict(model, workload, plan, AllocatorConfig(), NO_LIMIT, device).run
    assert run is not None
    return run.stage
