"""The library entry point of ``memplan estimate``: a resolved job in, a frozen result out."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.advice import suggest
from memplan.costmodel.memory import estimate_memory
from memplan.costmodel.params import active_params, total_params
from memplan.costmodel.report import MemoryReport
from memplan.costmodel.time import Efficiency, TimeReport, estimate_time
from memplan.specs.resolve import Job
from memplan.specs.workload import TrainingWorkload


class SuggestionOut(BaseModel):
    model_config = ConfigDict(frozen=True)
    change: str
    reserved_bytes: int
    saved_bytes: int
    fits: bool


class EstimateResult(BaseModel):
    """What ``memplan estimate --format json`` prints (keys are a contract: add, never rename)."""

    model_config = ConfigDict(frozen=True)

    model: dict[str, Any]
    plan: dict[str, Any]
    gpu: dict[str, Any]
    memory: MemoryReport
    fits: bool
    headroom_bytes: int
    suggestions: list[SuggestionOut]
    time: TimeReport | None = None  # training only: the step-time model (docs/cost-model.md)


def resolved_plan(job: Job, accumulation: int) -> dict[str, Any]:
    """Every plan field, resolved, with the workload, runtime and derived degrees beside it."""
    plan = job.plan.model_dump()
    plan.update(job.workload.model_dump())
    plan.update(
        runtime=job.runtime,
        world_size=job.plan.world_size,
        gpus_per_node=job.cluster.gpus_per_node,
        nodes=job.cluster.nodes,
    )
    if isinstance(job.workload, TrainingWorkload):
        plan["gradient_accumulation"] = accumulation
        plan["global_batch"] = job.workload.global_batch or job.workload.micro_batch * job.plan.dp
    return plan


def estimate(job: Job, with_suggestions: bool = True, efficiency: Efficiency | None = None) -> EstimateResult:
    """Estimate one job; when it does not fit, rank single changes that would help."""
    report = estimate_memory(job.model, job.workload, job.plan, job.runtime)
    time = None
    if isinstance(job.workload, TrainingWorkload):
        time = estimate_time(job.model, job.workload, job.plan, job.gpu, job.cluster, job.runtime, efficiency)
    capacity = job.gpu.memory_bytes
    fits = report.peak.reserved <= capacity
    suggestions = []
    if with_suggestions and not fits:
        found = suggest(job.model, job.workload, job.plan, job.runtime, capacity, report.peak.reserved)
        suggestions = [
            SuggestionOut(change=s.change, reserved_bytes=s.reserved, saved_bytes=s.saved, fits=s.fits) for s in found
        ]
    return EstimateResult(
        model={
            "name": job.model.name,
            "parameters": total_params(job.model),
            "active_parameters": active_params(job.model),
            "architecture": job.model.architecture,
        },
        plan=resolved_plan(job, report.gradient_accumulation),
        gpu={"name": job.gpu.name, "memory_bytes": capacity, "display_name": job.gpu.display_name},
        memory=report,
        fits=fits,
        headroom_bytes=capacity - report.peak.reserved,
        suggestions=suggestions,
        time=time,
    )
