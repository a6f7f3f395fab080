"""The record of one validation run (pure pydantic: readable without torch).

Written as JSON by the rank that measured it as soon as its run ends, whatever the outcome:
``status`` says whether the steps completed (``ok``), ran out of memory (``oom``, with the
phase, the bytes requested and the peak so far), could not be applied (``unsupported``),
failed (``error``) or were ended by the launcher (``timeout``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "oom", "unsupported", "error", "timeout"]


class PhaseRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    allocated: int = Field(description="Peak bytes allocated in this phase (max_memory_allocated / MemTracker).")
    reserved: int | None = Field(None, description="Peak bytes reserved by the caching allocator (CUDA only).")
    categories: dict[str, int] = Field(default_factory=dict, description="MemTracker's bytes per category at the peak.")


class OutOfMemory(BaseModel):
    model_config = ConfigDict(frozen=True)

    phase: str  # forward, backward, optimizer; setup: before the first step (building the model, sharding)
    step: int | None = None  # the step it happened in, from 1, warm-up steps included (None: setup)
    warmup: bool | None = None  # whether that step was a warm-up step (not measured)
    requested_bytes: int | None
    peak_bytes: int
    message: str


class RunRecord(BaseModel):
    """One rank's measurement of a plan (``memplan validate --out``)."""

    model_config = ConfigDict(frozen=True)

    status: Status
    reason: str | None = None
    model: dict[str, Any]
    workload: dict[str, Any]
    plan: dict[str, Any]
    device: str = Field(description="cpu or cuda")
    device_name: str
    versions: dict[str, str]
    simulated: bool = Field(description="One rank run alone under the fake process group: memory real, time not.")
    world_size: int
    rank: int
    stage: int
    steps: int
    warmup: int
    phases: dict[str, PhaseRecord] = Field(default_factory=dict)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    peak_phase: str | None = None
    nvml_used_bytes: int | None = Field(None, description="Device memory in use by this process per NVML.")
    offload_host_bytes: int | None = Field(
        None,
        description="Peak bytes of the saved activations' host copies (offload_activations: cpu, measured on CPU).",
    )
    step_times_s: list[float] = Field(default_factory=list)
    step_time_s: float | None = Field(None, description="Median of the measured steps (after warm-up).")
    tokens_per_s: float | None = None
    mfu: float | None = None
    oom: OutOfMemory | None = None
    started: str
    finished: str
