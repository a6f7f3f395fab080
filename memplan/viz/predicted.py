"""The predicted run of an estimate as a :class:`Track`: the run the allocator verdict replays
(``costmodel.reserve``: the bundled trainer's op by op where it models the plan, else the phase
model's moments cut into tensors; a serving run for inference), replayed once more with every
block and segment event kept."""

from __future__ import annotations

from memplan.costmodel.memory import serving_run
from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline.events import Timeline
from memplan.specs.resolve import Job
from memplan.specs.workload import TrainingWorkload
from memplan.units import format_bytes
from memplan.viz.series import Panel, panel
from memplan.viz.track import Track, replay_timeline


def predicted_run(job: Job, device: str = "cuda") -> tuple[Timeline, str]:
    """The most-loaded rank's run and which model made it (``trainer``, ``phases (...)``, ``serving``).
    The bundled trainer's pipeline: the stage the estimate follows within the job's allocator and
    capacity (``estimation.memory_verdict``: every stage's run replayed, ``costmodel.stages``)."""
    if isinstance(job.workload, TrainingWorkload) and job.plan.pp > 1 and job.runtime == "memplan":
        from memplan.estimation import memory_verdict

        _, v, _ = memory_verdict(job, device)  # type: ignore[arg-type]
        assert v.run is not None
        return v.run, v.timeline
    if isinstance(job.workload, TrainingWorkload):
        return plan_run(job.model, job.workload, job.plan, job.runtime, device, job.gpu)
    return serving_run(job.model, job.workload, job.plan), "serving"


def predicted_track(job: Job, device: str = "cuda") -> tuple[Track, str]:
    run, which = predicted_run(job, device)
    return replay_timeline(run, job.allocator), which


def predicted_panel(track: Track, job: Job, which: str, overhead: int, title: str | None = None) -> Panel:
    """``track`` ready to draw, with the limit the allocator may use (capacity less ``overhead``)."""
    limit = job.gpu.capacity_bytes - overhead
    label = f"{job.gpu.name}: {format_bytes(limit, 'GiB')} the allocator may use"
    allocator = "expandable segments" if job.allocator.expandable_segments else "default allocator"
    name = title or f"predicted: {job.model.name}, {which.split(' ')[0]} run, {allocator}"
    return panel(track, name, limit=limit, limit_label=label)
