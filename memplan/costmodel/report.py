"""Results of the memory model: frozen pydantic models, rendered by the CLI."""

from typing import Literal

from pydantic import BaseModel, ConfigDict

# "setup": the model's build, before the first step (a base quantized on the device can peak there)
Phase = Literal["forward", "backward", "optimizer", "prefill", "decode", "setup"]


# each model's own config, not a shared base class: a pydantic base costs its own schema and each
# subclass the base's walk (~0.3-0.7 M instructions each at import, callgrind, 2026-11-29)
_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ModelStates(BaseModel):
    """Per-rank bytes of the model states (on the GPU)."""

    model_config = _FROZEN

    parameters: int
    gradients: int
    optimizer_states: int


class Activations(BaseModel):
    """``per_layer``: one transformer layer, one micro-batch, on the peak rank, under the
    plan's recomputation; ``total``: everything saved for backward at the end of the forward.
    Serving: both are the prefill forward's working set at its peak (``MemoryReport.prefill``)."""

    model_config = _FROZEN

    per_layer: int
    total: int


class Prefill(BaseModel):
    """Serving: the prefill forward whose working set is ``MemoryReport.activations`` (the tensors
    of one layer at its highest ``moment`` and those kept for the whole forward, beyond weights and
    KV cache: ``costmodel/inference.py``). ``tokens`` per forward: batch x prompt, or the chunk
    (``prefill_chunk``: chunked when fewer than batch x prompt); ``queries`` per sequence attend to
    ``keys`` cached tokens."""

    model_config = _FROZEN

    tokens: int
    rows: int
    queries: int
    keys: int
    moment: Literal["mlp", "attention", "cache growth", "logits"]


class ReservedDetail(BaseModel):
    """The caching allocator's state at the allocated peak of its replay of the run (what was
    cached but free there is the fragmentation the peak paid for). ``timeline_allocated`` is
    that run's own allocated peak: ``peak.allocated`` itself where the run is op-level on CUDA
    (``MemoryReport.model``); on CPU the bundled trainer's run (``timeline == "trainer"``) holds
    CUDA kernels' workspaces and transients that ``peak.allocated`` (the phase model, exact on
    CPU) does not.

    ``limit`` is what the allocator may use: the capacity PyTorch sees less the memory outside
    it (``MemoryReport.overhead``). ``failed_request`` is the allocation that could not be
    served within it (None when every one was)."""

    model_config = _FROZEN

    allocator: Literal["default", "expandable"]
    segments: int
    cached_free: int  # reserved, in no allocated block
    largest_free: int
    reserved_by_stream: dict[str, int]
    limit: int
    failed_request: int | None = None
    failed_tensor: str | None = None
    fits_with_expandable_segments: bool | None = None
    expandable_reserved: int | None = None  # the default allocator failed: the same run with expandable segments
    # the run replayed: "trainer" (the bundled trainer op by op) or "phases (why not the trainer's)"
    timeline: str = "phases"
    timeline_allocated: int = 0  # the replayed run's allocated peak, counted as the allocator does


class Peak(BaseModel):
    """The highest point of a steady-state step on the most-loaded rank.

    ``allocated`` compares with ``torch.cuda.max_memory_allocated``; ``reserved`` with
    ``torch.cuda.max_memory_reserved``: the caching allocator's segments (replayed, with
    ``reserved_detail``, or the search's fast form). The fixed overhead outside the allocator
    (CUDA context, NCCL, workspaces) is ``MemoryReport.overhead``.
    ``breakdown`` sums to ``allocated``.
    """

    model_config = _FROZEN

    allocated: int
    reserved: int
    phase: Phase
    rank: int
    stage: int
    rank_role: str
    breakdown: dict[str, int]
    reserved_detail: ReservedDetail | None = None  # full replay (estimate); None: the search's fast form


class Offload(BaseModel):
    model_config = _FROZEN
    cpu: int
    nvme: int


class MemoryReport(BaseModel):
    model_config = _FROZEN
    model_states: ModelStates
    activations: Activations
    kv_cache: int
    peak: Peak
    offload: Offload
    phases: dict[str, int]  # allocated peak of each phase on the most-loaded rank
    stage_peaks: dict[int, int]  # allocated peak of each pipeline stage examined
    overhead: int  # bytes outside the allocator (CUDA context and modules, NCCL): ``outside``
    gradient_accumulation: int
    # bitsandbytes' paged optimizer states (CUDA managed memory, outside the caching allocator: in
    # neither peak.allocated nor peak.reserved); resident on the device while it has room, paged to
    # the host under pressure (docs/cost-model.md, "Paged optimizers")
    paged_optimizer_states: int = 0
    # what ``overhead`` is made of (``overhead.outside_memory``): cuda_context, nccl, communicators,
    # torch_version, spread, source; a dict, not a model: a pydantic class costs the cold start ~4 M
    # instructions to build (benchmarks/bench_estimate.py --instructions)
    outside: dict[str, int | str] | None = None
    prefill: Prefill | None = None  # serving only: the prefill forward the activations are of
    # which model answered: "op-level" (the bundled trainer's, transformers' Trainer's or loop's
    # run op by op: every figure of the step is the run's, ``costmodel.run_report``) or "phase"
    # (the phase model's moments; ``model_reason`` says what keeps the op-level run off this plan)
    model: Literal["op-level", "phase"] = "phase"
    model_reason: str | None = None
    # the bundled trainer's pipeline answered op by op: each stage's replayed reserved peak (every
    # stage's run is built; ``peak.stage`` is the one that runs out of memory first: ``costmodel.stages``)
    stage_reserved: dict[int, int] | None = None
