"""Reserved memory and "fits": one rank's run replayed through the caching allocator model.

The one entry point for ``peak.reserved`` (estimate, advice, search, check, validate). The
run (``timeline.step.build_run``: build, a first step, steady steps) is fed to
``allocator.CachingAllocator`` allocation by allocation, on the streams the tensors use. The
allocator's ``max_reserved`` is the prediction of ``torch.cuda.max_memory_reserved``; the
plan fits when every request is served within the capacity PyTorch sees less the memory
outside the allocator (CUDA context, NCCL, workspaces: ``overhead.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from memplan.costmodel.allocator import AllocatorConfig, CachingAllocator
from memplan.costmodel.allocator.run import run_events
from memplan.costmodel.quant import CudaArch, cuda_arch
from memplan.costmodel.timeline.events import STEADY, Stream, Timeline, collection_paused
from memplan.costmodel.timeline.phases import PHASE_MARKS, SETUP
from memplan.costmodel.timeline.support import supported
from memplan.errors import MemplanError
from memplan.records import record
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

if TYPE_CHECKING:
    from memplan.specs.hardware import GPUSpec


class _StreamIds(dict):
    """The allocator's number of each stream; a stream first seen (a further FSDP2 root's,
    ``events.root_stream``) gets the next number."""

    def __missing__(self, stream: str) -> int:
        self[stream] = n = len(self)
        return n


STREAM_IDS = _StreamIds({Stream.COMPUTE: 0, Stream.ALL_GATHER: 1, Stream.REDUCE_SCATTER: 2})
GiB = 2**30


@record(slots=True)
class Failure:
    """The request the allocator could not serve: its tensor and the allocator's state then."""

    size: int
    category: str
    tag: str
    stream: str
    reserved: int
    allocated: int
    cached_free: int


@record(slots=True)
class Replay:
    """The allocator after (or at the failure of) a run. ``segments``, ``reserved_by_stream``
    and the cached figures are taken at the allocated peak: what was cached but free there is
    the fragmentation the peak paid for."""

    max_reserved: int
    max_allocated: int
    segments: int
    cached_free: int
    largest_free: int
    reserved_by_stream: dict[str, int]
    failure: Failure | None
    peak_event: int = -1  # index of the allocation that reached max_allocated
    # each phase's peak allocated over the steady steps, where the run names its phases
    # (``timeline.phases``: the meter's figures, the counter reset at each phase's start)
    phase_peaks: dict[str, int] | None = None
    # the phase in force at ``peak_event`` where the run names its phases: "setup" before the
    # first step's first mark (the model's build: a QLoRA base quantized on the device), None
    # between a step's end and the next one's first mark, or in a run without marks
    peak_phase: str | None = None


def replay(timeline: Timeline, config: AllocatorConfig, capacity_bytes: int | None = None) -> Replay:
    """Every allocation and free of ``timeline`` through the allocator; stops at an OOM."""
    with collection_paused():  # blocks by the ten thousand, no cycle among them
        return _replay(timeline, config, capacity_bytes)


def _replay(timeline: Timeline, config: AllocatorConfig, capacity_bytes: int | None) -> Replay:
    alloc = CachingAllocator(config, capacity_bytes=capacity_bytes)
    peaks: dict[str, int] = {}
    phases: list[tuple[int, str | None]] = [(-1, SETUP)]  # (mark index, phase from there)
    steady, highest = False, 0

    def mark(i: int, event: tuple) -> None:
        nonlocal steady, highest
        tag = event[5]
        if tag in PHASE_MARKS:  # torch.cuda.reset_peak_memory_stats at the meter's phase change
            phase = phases[-1][1]
            if steady and phase is not None:
                peaks[phase] = max(peaks.get(phase, 0), alloc.max_allocated)
            highest = max(highest, alloc.max_allocated)
            alloc.max_allocated = alloc.allocated
            phases.append((i, PHASE_MARKS[tag]))
        elif tag == STEADY:
            steady = True

    peak = run_events(alloc, timeline.raw, STREAM_IDS, mark)
    failure = None
    if peak.error is not None:
        op, tensor, size, category, stream, tag = timeline.raw[peak.oom]
        oom = peak.error
        failure = Failure(size, str(category), tag, str(stream), oom.reserved, oom.allocated, oom.cached_free)
    peak_phase = next((phase for i, phase in reversed(phases) if i < peak.event), None)
    at_peak, final = peak.stats, alloc.stats()
    names = {v: str(k) for k, v in STREAM_IDS.items()}
    return Replay(
        max_reserved=final.max_reserved,
        max_allocated=max(highest, final.max_allocated),
        segments=at_peak.segments,
        cached_free=at_peak.cached_free,
        largest_free=at_peak.largest_free,
        reserved_by_stream={names.get(s, str(s)): b for s, b in at_peak.reserved_by_stream},
        failure=failure,
        peak_event=peak.event,
        phase_peaks=peaks or None,
        peak_phase=peak_phase if peaks else None,
    )


@record(slots=True)
class StageLoad:
    """One pipeline stage's replayed run (``stages.stage_verdict``): its verdict's reserved, its
    allocated peak, and its steady steps' highest phase peak (``MemoryReport.stage_peaks``)."""

    reserved: int
    allocated: int
    steady: int


@record(slots=True)
class Verdict:
    """Whether the allocator serves a run within ``limit_bytes``, and what it reserves."""

    reserved: int  # the replay's peak reserved (without a limit when the limited one failed)
    fits: bool
    reason: str
    replay: Replay  # the replay without a limit: what the run reserves when nothing stops it
    failure: Failure | None  # the request that failed within the limit
    expandable_fits: bool | None  # default allocator failed: does expandable_segments fit?
    expandable_reserved: int | None = None  # default allocator failed: what expandable segments reserve
    timeline: str = "phases"  # which run was replayed (plan_run)
    run: Timeline | None = None  # that run
    # a pipelined op-level run: every stage's figures, by stage (``stages.stage_verdict``: ``run`` is the
    # most loaded one's)
    stage_loads: dict[int, StageLoad] | None = None


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def verdict(timeline: Timeline, config: AllocatorConfig, limit_bytes: int) -> Verdict:
    """Replay ``timeline`` without a limit (what it reserves) and within ``limit_bytes`` (the
    capacity PyTorch sees less what lives outside the allocator): it fits when the allocator
    serves every request. A default-allocator failure is replayed with expandable segments
    to tell fragmentation from a plan that is too large."""
    free = replay(timeline, config)
    if free.max_reserved <= limit_bytes:
        reason = f"fits: the allocator's replay reserves {_gib(free.max_reserved)} of {_gib(limit_bytes)} available"
        return Verdict(free.max_reserved, True, reason, free, None, None)
    bounded = replay(timeline, config, capacity_bytes=limit_bytes)
    if bounded.failure is None:
        reason = (
            f"fits: the allocator frees cached blocks to stay within {_gib(limit_bytes)} "
            f"(unbounded it would reserve {_gib(free.max_reserved)})"
        )
        return Verdict(bounded.max_reserved, True, reason, free, None, None)
    fail = bounded.failure
    what = f"the {_gib(fail.size)} {fail.category} allocation ({fail.tag})"
    if free.max_allocated > limit_bytes:
        reason = f"does not fit: {_gib(free.max_allocated)} allocated at the peak, {_gib(limit_bytes)} available"
        return Verdict(free.max_reserved, False, reason, free, fail, None)
    expandable = expandable_reserved = None
    if not config.expandable_segments:
        other = replace(config, expandable_segments=True)
        expandable = replay(timeline, other, limit_bytes).failure is None
        expandable_reserved = replay(timeline, other).max_reserved
    if expandable:
        reason = (
            f"fits with expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); with the default "
            f"allocator {what} fails, {_gib(fail.cached_free)} reserved but free (fragmentation)"
        )
    else:
        reason = (
            f"does not fit: {what} fails with {_gib(fail.reserved)} reserved, "
            f"{_gib(fail.cached_free)} of it free but fragmented"
        )
    return Verdict(free.max_reserved, False, reason, free, fail, expandable, expandable_reserved)


def plan_verdict(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    runtime: str,
    config: AllocatorConfig,
    limit_bytes: int,
    device: str = "cuda",
    gpu: GPUSpec | None = None,
) -> Verdict:
    """The most-loaded stage's run (build, first step, steady steps) replayed: see :func:`verdict`.
    On CPU an op-level run's live bytes decide (``cpu_reserve.cpu_verdict``: no caching allocator).
    The bundled trainer's pipelined plan, where its op-level run models it: every stage's run
    replayed, the one that runs out of memory first followed (``stages.stage_verdict``)."""
    if runtime == "memplan" and plan.pp > 1 and supported(model, workload, plan, cuda_arch(gpu)) is None:
        from memplan.costmodel.stages import stage_verdict

        return stage_verdict(model, workload, plan, config, limit_bytes, device, gpu)
    run, which = plan_run(model, workload, plan, runtime, device, gpu)
    cpu = device == "cpu" and not which.startswith("phases")
    return replace(device_verdict(run, config, limit_bytes, cpu), timeline=which, run=run)


def device_verdict(run: Timeline, config: AllocatorConfig, limit_bytes: int, cpu: bool) -> Verdict:
    """A run's verdict: replayed through the caching allocator (:func:`verdict`), or, for an op-level
    run on CPU (``cpu``), its live bytes (``cpu_reserve.cpu_verdict``: no caching allocator)."""
    if cpu:
        from memplan.costmodel.cpu_reserve import cpu_verdict

        return cpu_verdict(run, limit_bytes)
    return verdict(run, config, limit_bytes)


def plan_run(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    runtime: str,
    device: str = "cuda",
    gpu: GPUSpec | None = None,
    stage: int | None = None,
) -> tuple[Timeline, str]:
    """The run to replay, and which: the bundled trainer's op by op (``timeline.trainer``,
    exact on the six H100 traces) where it models the plan; for ``--runtime hf``
    transformers' Trainer op by op (``timeline.hf_trainer``, exact on CPU) where
    ``hf_support.hf_supported`` accepts the plan, for ``--runtime hf-loop`` the hand-written loop
    (``timeline.hf_loop``, exact on CPU) likewise; else the phase model's moments cut into tensors
    (``timeline.step``). The second item names it: ``trainer``, ``hf``, ``hf-loop`` or ``phases``
    (with the reason the op-level run does not apply). ``gpu``: the GPU's profile, whose SMs and
    compute capability pick bitsandbytes' 4-bit kernel (``quant.cuda_arch``). On ``device`` cpu
    the op-level runs take CPU's kernels (SDPA's CPU flash kernel in every dtype, LoRA's dropout,
    bitsandbytes' CPU paths) and come as the CPU's view of them (``timeline.cpu.cpu_view``: the
    tensors only CUDA's kernels make left out). ``stage``: the bundled trainer's pipeline rank to
    follow (by default ``trainer.most_loaded_stage``'s)."""
    with collection_paused():  # tens of thousands of events, tensors and graph nodes
        return _plan_run(model, workload, plan, runtime, device, cuda_arch(gpu), stage)


def _plan_run(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    runtime: str,
    device: str,
    gpu_arch: CudaArch | None,
    stage: int | None = None,
) -> tuple[Timeline, str]:
    if runtime == "memplan":
        why = supported(model, workload, plan, gpu_arch)
        if why is None:
            from memplan.costmodel.timeline.trainer import trainer_run  # its op-by-op model: only when it applies

            cuda = device == "cuda"
            run = trainer_run(model, workload, plan, stage=stage, cuda=cuda, gpu_arch=gpu_arch, cpu_sdpa=not cuda)
            if run is not None:
                return _on(run, device), "trainer"
    elif runtime in ("hf", "hf-loop"):
        from memplan.costmodel.timeline.hf_support import hf_supported

        why = hf_supported(model, plan, workload, runtime, gpu_arch, device)
        if why is None and runtime == "hf-loop":
            from memplan.costmodel.timeline.hf_loop import hf_loop_plan_run  # the hand-written loop op by op

            return _on(hf_loop_plan_run(model, workload, plan, gpu_arch, device), device), "hf-loop"
        if why is None:
            from memplan.costmodel.timeline.hf_trainer import hf_plan_run  # transformers' Trainer op by op

            return _on(hf_plan_run(model, workload, plan, gpu_arch, device), device), "hf"
        if run_only(model, plan):
            what = "an MoE model" if model.moe is not None else f"{model.name} ({model.architecture})"
            runs = "transformers' Trainer" if runtime == "hf" else "the hand-written transformers loop"
            raise MemplanError(
                f"{plan.finetune} over {what} is modelled by the op-level run of {runs} alone, "
                f"which does not follow {why}",
                field="plan.finetune",
            )
    else:
        why = f"the {runtime} runtime"
    from memplan.costmodel.memory import stage_moments  # the phase model: only where the op-level run does not apply
    from memplan.costmodel.timeline.step import build_run

    sm = stage_moments(model, workload, plan, runtime, device=device)
    return build_run(sm.moments, sm.granularity, sm.build_grads), f"phases ({why})"


def run_only(model: ModelSpec, plan: Plan) -> bool:
    """Plans the phase model does not answer, which the op-level run alone estimates (or refuses,
    never handing them to the phases): LoRA over an MoE model (``specs.job.check_moe_lora``: the phase
    model's LoRA layer, ``lora.hf_layer``, counts a dense MLP of ``ffn_size`` where the experts are), and
    over Phi-3, OLMo 2, Gemma 2 or Gemma 3 (``specs.job.check_run_lora``: that layer is Llama's), and DoRA
    (``lora_dora``: the phase model has none, ``specs.job.check_dora``)."""
    from memplan.costmodel.lora import RUN_FAMILIES

    run = model.moe is not None or model.architecture in RUN_FAMILIES or plan.lora_dora
    return plan.finetune != "full" and run


def _on(run: Timeline, device: str) -> Timeline:
    """The op-level run as ``device`` allocates it: on CPU without CUDA's own tensors."""
    if device == "cuda":
        return run
    from memplan.costmodel.timeline.cpu import cpu_view

    return cpu_view(run)


def serving_verdict(
    model: ModelSpec, workload: InferenceWorkload, plan: Plan, config: AllocatorConfig, limit_bytes: int
) -> Verdict:
    """The most-loaded stage's serving run (weights, KV cache, prefills) replayed: see :func:`verdict`."""
    from memplan.costmodel.memory import serving_run

    run = serving_run(model, workload, plan)
    return replace(verdict(run, config, limit_bytes), timeline="serving", run=run)


def peak_breakdown(v: Verdict) -> dict[str, int]:
    """Bytes per category live at the replayed run's allocated peak, with what the allocator's
    rounding of each request (512 B, or a whole block it would not split) adds as
    ``allocator_rounding``: it sums to ``v.replay.max_allocated``."""
    assert v.run is not None
    live = v.run.live_by_category(v.replay.peak_event)
    rounding = v.replay.max_allocated - sum(live.values())
    return {**live, "allocator_rounding": rounding} if rounding > 0 else live
