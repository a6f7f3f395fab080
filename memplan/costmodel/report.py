"""Results of the memory model: frozen pydantic models, rendered by the CLI."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Phase = Literal["forward", "backward", "optimizer", "prefill", "decode"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelStates(_Frozen):
    """Per-rank bytes of the model states (on the GPU)."""

    parameters: int
    gradients: int
    optimizer_states: int


class Activations(_Frozen):
    """``per_layer``: one transformer layer, one micro-batch, on the peak rank, under the
    plan's recomputation; ``total``: everything saved for backward at the end of the forward."""

    per_layer: int
    total: int


class Peak(_Frozen):
    """The highest point of a steady-state step on the most-loaded rank.

    ``allocated`` compares with ``torch.cuda.max_memory_allocated``; ``reserved`` adds the
    caching allocator's slack and the fixed overhead (CUDA context, NCCL, workspaces).
    ``breakdown`` sums to ``allocated``.
    """

    allocated: int
    reserved: int
    phase: Phase
    rank: int
    stage: int
    rank_role: str
    breakdown: dict[str, int]


class Offload(_Frozen):
    cpu: int
    nvme: int


class MemoryReport(_Frozen):
    model_states: ModelStates
    activations: Activations
    kv_cache: int
    peak: Peak
    offload: Offload
    phases: dict[str, int]  # allocated peak of each phase on the most-loaded rank
    stage_peaks: dict[int, int]  # allocated peak of each pipeline stage examined
    overhead: int  # fixed bytes outside the allocator (context, NCCL, workspaces)
    gradient_accumulation: int
