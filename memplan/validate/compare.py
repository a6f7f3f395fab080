"""Predicted against measured: the result ``memplan validate`` prints (pure, no torch)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.report import MemoryReport
from memplan.validate.record import RunRecord

# MemTracker's categories (plain and FSDP) grouped into memplan's model-state components
_COMPONENTS = {
    "parameters": ("Parameter", "Sharded Param"),
    "gradients": ("Gradient", "Sharded Grad"),
    "optimizer_states_and_step": ("Optstate", "OptState"),
}


class Row(BaseModel):
    model_config = ConfigDict(frozen=True)

    predicted_bytes: int
    measured_bytes: int | None
    error_pct: float | None


class Validation(BaseModel):
    """``memplan validate --format json`` (keys are a contract: add, never rename)."""

    model_config = ConfigDict(frozen=True)

    status: str
    reason: str | None
    predicted_bytes: int
    measured_bytes: int | None
    error_pct: float | None
    predicted_phase: str
    measured_phase: str | None
    predicted_reserved_bytes: int
    measured_reserved_bytes: int | None
    reserved_error_pct: float | None
    phases: dict[str, Row]
    components: dict[str, Row]
    step_time_s: float | None
    predicted_step_time_s: float | None = None
    tokens_per_s: float | None
    mfu: float | None
    simulated: bool
    rank: int
    stage: int
    world_size: int
    device: str
    device_name: str
    gpu_auto: str | None = None  # --gpu auto or --gpus not given: what NVML detected and what was used
    versions: dict[str, str]
    record_path: str | None
    record: dict[str, Any]
    # --snapshot: the memory snapshot of the reported rank (``{rank}`` left in for real ranks: one file each)
    snapshot_path: str | None = None
    # offload_activations cpu on CPU: the activations' host copies, predicted (offload.cpu) and measured
    offload_host: Row | None = None
    # --real-ranks: the measured peak of every rank that reported (the reported rank's is measured_bytes);
    # None under rank simulation, which runs one rank
    measured_bytes_by_rank: dict[int, int] | None = None


def error_pct(predicted: int, measured: int | None) -> float | None:
    """Signed error of the prediction, percent of the measurement."""
    if not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def _row(predicted: int, measured: int | None) -> Row:
    return Row(predicted_bytes=predicted, measured_bytes=measured, error_pct=error_pct(predicted, measured))


def steady_peak(report: MemoryReport) -> tuple[int, str]:
    """The predicted figure the meter's is held against, and its phase. The meter measures the
    steps after the warm-up one (``train/runner.py``: the highest phase's peak); where the op-level
    run answers, so do its ``phases`` (``reserve.Replay.phase_peaks``), while ``peak.allocated`` is
    the whole run's, build and warm-up step included, which can be higher: a QLoRA base quantized
    on the device peaks in the build on short sequences (``peak.phase == "setup"``)."""
    if report.model == "op-level" and report.phases:
        phase = max(report.phases, key=report.phases.__getitem__)
        return report.phases[phase], phase
    return report.peak.allocated, report.peak.phase


def compare(
    report: MemoryReport, record: RunRecord, record_path: str | None, predicted_step_time_s: float | None = None
) -> Validation:
    measured = record.peak_allocated
    phases = {name: _row(report.phases.get(name, 0), rec.allocated) for name, rec in record.phases.items()}
    components: dict[str, Row] = {}
    opt = record.phases.get("optimizer")
    if opt is not None:  # model states are cleanly separated at the optimizer step
        states = report.model_states
        opt_phase = report.phases.get("optimizer", 0)
        predicted = {
            "parameters": states.parameters,
            "gradients": states.gradients,
            # states and the step's temporaries (MemTracker files both under OptState)
            "optimizer_states_and_step": opt_phase - states.parameters - states.gradients,
        }
        for name, cats in _COMPONENTS.items():
            components[name] = _row(predicted[name], sum(opt.categories.get(c, 0) for c in cats))
    reserved_err = error_pct(report.peak.reserved, record.peak_reserved) if record.peak_reserved else None
    host = _row(report.offload.cpu, record.offload_host_bytes) if record.offload_host_bytes is not None else None
    predicted, predicted_phase = steady_peak(report)
    return Validation(
        status=record.status,
        reason=record.reason,
        predicted_bytes=predicted,
        measured_bytes=measured,
        error_pct=error_pct(predicted, measured),
        predicted_phase=predicted_phase,
        measured_phase=record.peak_phase,
        predicted_reserved_bytes=report.peak.reserved,
        measured_reserved_bytes=record.peak_reserved,
        reserved_error_pct=reserved_err,
        phases=phases,
        components=components,
        step_time_s=record.step_time_s,
        predicted_step_time_s=predicted_step_time_s,
        tokens_per_s=record.tokens_per_s,
        mfu=record.mfu,
        simulated=record.simulated,
        rank=record.rank,
        stage=record.stage,
        world_size=record.world_size,
        device=record.device,
        device_name=record.device_name,
        versions=record.versions,
        record_path=record_path,
        record=record.model_dump(mode="json"),
        offload_host=host,
    )
