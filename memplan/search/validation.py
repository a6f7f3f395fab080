"""Validation runs of the best plans (``memplan tune --validate K``), as ``memplan validate``
runs them: the bundled trainer for a few steps, its peak memory and step time measured.

Where: on CUDA when NVML (or torch) sees GPUs, else on the CPU. Every rank runs under
torchrun when the GPUs here are at least the plan's world size; otherwise the most-loaded
rank runs alone under PyTorch's fake process group (rank simulation: memory real, step time
not the job's). A run that runs out of memory, crashes or hangs is an outcome with its
reason, never an exception: the search goes on.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.flops import rank_flops_per_step
from memplan.search.evaluate import Evaluation
from memplan.specs.hardware import GPUSpec
from memplan.specs.model import ModelSpec
from memplan.validate.launch import launch, pick_record
from memplan.validate.spec import RunSpec
from memplan.validate.support import TrainerUnsupported, check_model, check_plan, check_workload


@dataclass(frozen=True)
class ValidationSettings:
    steps: int = 2
    timeout_s: float = 600
    device: Literal["auto", "cpu", "cuda"] = "auto"
    memory_limit: int | None = None  # simulated device capacity on CPU
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF the runs set (the allocator the plans were judged under)


class Outcome(BaseModel):
    """One validation run of a plan: what was measured, and against what prediction
    (uncalibrated, so that the ratios calibrate the model itself)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: str  # ok, oom, unsupported, error, timeout (memplan.validate.record.Status)
    reason: str | None
    device: str
    device_name: str
    simulated: bool
    predicted_peak_bytes: int
    predicted_step_time_s: float
    measured_peak_bytes: int | None = None
    measured_step_time_s: float | None = None
    measured_tokens_per_s: float | None = None  # the whole job's, from a real (not simulated) CUDA run
    peak_ratio: float | None = None
    step_time_ratio: float | None = None

    @property
    def failed(self) -> bool:
        return self.status != "ok"


def detect_gpus() -> int:
    """CUDA devices visible here: NVML's count, else torch's, else 0."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library, no driver, no GPU: ask torch
        pass
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_spec(model: ModelSpec, predicted: Evaluation, gpu: GPUSpec, settings: ValidationSettings, gpus: int) -> RunSpec:
    """What to run: on CUDA with every rank when there are enough GPUs, else one simulated rank."""
    device = settings.device if settings.device != "auto" else ("cuda" if gpus else "cpu")
    plan, workload = predicted.plan, predicted.workload
    tokens = workload.micro_batch * workload.seq_len * predicted.gradient_accumulation
    return RunSpec(
        model=model,
        workload=workload,
        plan=plan,
        steps=settings.steps,
        device=device,
        simulate=not (device == "cuda" and gpus >= plan.world_size),
        rank=predicted.peak_rank,
        memory_limit=settings.memory_limit if device == "cpu" else None,
        peak_flops=gpu.peak_flops.get("fp32" if plan.precision == "fp32" else "bf16") if device == "cuda" else None,
        flops_per_step=rank_flops_per_step(model, workload.seq_len, tokens, plan),
        alloc_conf=settings.alloc_conf,
    )


def validate_plan(
    spec: RunSpec, predicted: Evaluation, timeout_s: float, progress: Callable[[int, int], None] | None = None
) -> Outcome:
    """Run one plan and compare with its (uncalibrated) prediction."""
    base = dict(
        device=spec.device,
        simulated=spec.simulate and spec.plan.world_size > 1,
        predicted_peak_bytes=predicted.peak_allocated_bytes,
        predicted_step_time_s=predicted.step_time_s,
    )
    try:
        check_model(spec.model)
        check_plan(spec.plan)
        check_workload(spec)
    except TrainerUnsupported as err:
        return Outcome(status="unsupported", reason=str(err), device_name=spec.device, **base)
    with tempfile.TemporaryDirectory(prefix="memplan-tune-") as tmp:
        record = pick_record(spec, launch(spec, Path(tmp), timeout_s, progress=progress))
    base["simulated"] = record.simulated
    if record.status != "ok":
        return Outcome(status=record.status, reason=record.reason, device_name=record.device_name, **base)
    peak, step = record.peak_allocated, record.step_time_s
    real_time = record.device == "cuda" and not record.simulated and step
    workload = predicted.workload
    job_tokens = (workload.global_batch or workload.micro_batch * predicted.plan.dp) * workload.seq_len
    return Outcome(
        status="ok",
        reason=None,
        device_name=record.device_name,
        measured_peak_bytes=peak,
        measured_step_time_s=step,
        measured_tokens_per_s=job_tokens / step if real_time else None,
        peak_ratio=peak / predicted.peak_allocated_bytes if peak else None,
        step_time_ratio=step / predicted.step_time_s if real_time else None,
        **base,
    )
