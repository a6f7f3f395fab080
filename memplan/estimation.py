"""The library entry point of ``memplan estimate``: a resolved job in, a frozen result out."""

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.host import HostMemory, host_memory
from memplan.costmodel.margin import band as margin_band
from memplan.costmodel.margin import state as margin_state
from memplan.costmodel.overhead import communicators, fixed_overhead_bytes
from memplan.costmodel.params import active_params, total_params
from memplan.costmodel.precision import POLICIES
from memplan.costmodel.rank import sdpa_kind
from memplan.costmodel.report import MemoryReport, ReservedDetail
from memplan.costmodel.reserve import Verdict, plan_verdict, serving_verdict
from memplan.costmodel.time import Efficiency, TimeReport, estimate_time
from memplan.costmodel.timeline.events import Timeline
from memplan.specs.hardware import GPUSpec
from memplan.specs.plan import TRANSFORMERS_RUNTIMES, changed_plan, checkpoint_reentrant, trainer_autocast
from memplan.specs.resolve import TRAINING_PLAN_FIELDS, Job
from memplan.specs.workload import TrainingWorkload

if TYPE_CHECKING:  # the advice is imported when a plan does not fit (memplan estimate's cold start)
    from memplan.costmodel.advice import Suggestion

Device = Literal["cuda", "cpu"]


class SuggestionOut(BaseModel):
    model_config = ConfigDict(frozen=True)
    change: str
    reserved_bytes: int
    saved_bytes: int
    fits: bool
    step_time_s: float | None = None  # predicted step time with the change (training changes that fit)
    # the figures come from the full estimate of the changed plan (the allocator replay memplan estimate
    # runs), not from the fast form the changes are screened with
    verified: bool = False


class EstimateResult(BaseModel):
    """What ``memplan estimate --format json`` prints (keys are a contract: add, never rename)."""

    model_config = ConfigDict(frozen=True)

    model: dict[str, Any]
    plan: dict[str, Any]
    gpu: dict[str, Any]
    memory: MemoryReport
    fits: bool
    fits_reason: str = ""  # why (the allocator's verdict; fragmentation named as such)
    headroom_bytes: int
    suggestions: list[SuggestionOut]
    time: TimeReport | None = None  # training only: the step-time model (docs/cost-model.md)
    warnings: list[str] = []  # legal but suspicious inputs (a sequence beyond the model's positions)
    host: HostMemory | None = None  # training: each node's host memory against what the plan keeps there
    # "fits" against the model's measured error (costmodel/margin.py): state ("ample", "tight", "does not
    # fit"), headroom_bytes, band_bytes, error (the fraction measured for this kind of plan), model (which
    # answered), basis (the runs), outside_spread_bytes, capacity_spread_bytes. A dict, as model/plan/gpu:
    # a pydantic class costs the cold start ~4 M instructions to build
    fits_margin: dict[str, Any] | None = None

    @property
    def tight(self) -> bool:
        """Fits, but with less headroom than the tight band (``fits_margin``)."""
        return self.fits_margin is not None and self.fits_margin["state"] == "tight"


def resolved_plan(job: Job, accumulation: int) -> dict[str, Any]:
    """Every plan field, resolved, with the workload, runtime and derived degrees beside it."""
    plan = job.plan.model_dump()
    if job.runtime in TRANSFORMERS_RUNTIMES and isinstance(job.workload, TrainingWorkload):
        plan["autocast"] = trainer_autocast(job.plan, job.runtime)  # the recipe's, where the plan leaves it
        if job.plan.recompute == "full":  # the checkpoint the loop runs (the runtime's, where the plan leaves it)
            plan["use_reentrant"] = checkpoint_reentrant(job.plan, job.runtime)
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


def _with_attention_kernel(plan: dict[str, Any], job: Job, device: Device) -> dict[str, Any]:
    """The resolved plan with ``attention_kernel``: what a training step's attention runs on
    ``device`` (``eager``, or the kernel SDPA picks: ``memory.sdpa_kind``)."""
    if isinstance(job.workload, TrainingWorkload):
        policy = POLICIES[job.plan.precision]
        capability = job.gpu.compute_capability
        kernel = (
            "eager" if job.plan.attention == "eager" else sdpa_kind(job.model, job.plan, policy, device, capability)
        )
        plan["attention_kernel"] = "triton" if job.plan.attention == "triton" else kernel
    return plan


# plan_run's op-level runs: the bundled trainer's, transformers' Trainer's, the hand-written transformers loop's
OP_LEVEL_RUNS = ("trainer", "hf", "hf-loop")


def memory_verdict(job: Job, device: Device, limit: int | None = None) -> tuple[MemoryReport, Verdict, int]:
    """The memory report of ``job`` on ``device``, the allocator's verdict on its run within
    ``limit`` (by default the capacity less the memory outside the allocator), and that limit.

    The run (training: build, a first step, steady steps; serving: weights, KV cache, prefills)
    replayed through the caching allocator model decides reserved and fits (on CPU, an op-level
    run's live bytes: ``cpu_reserve``, no caching allocator). Where the run is op-level
    (``OP_LEVEL_RUNS``, on CUDA or on CPU with CPU's kernels) the report is built from it alone
    (``costmodel.run_report``) and the phase model is not computed; else the phase model's report
    (``memory.estimate_memory``) with the replay's reserved, fits and detail."""
    training = isinstance(job.workload, TrainingWorkload)
    if training:
        if limit is None:
            plan = job.plan
            limit = job.gpu.capacity_bytes - fixed_overhead_bytes(
                communicators(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep)
            )
        v = plan_verdict(job.model, job.workload, job.plan, job.runtime, job.allocator, limit, device, job.gpu)
        if v.timeline in OP_LEVEL_RUNS:
            from memplan.costmodel.run_report import run_report

            report = run_report(job.model, job.workload, job.plan, job.runtime, v, _detail(job, v, limit))
            return report, v, limit
        from memplan.costmodel.memory import estimate_memory  # the phase model: only where the run does not answer

        report = estimate_memory(job.model, job.workload, job.plan, job.runtime, device)
    else:
        from memplan.costmodel.memory import estimate_memory

        report = estimate_memory(job.model, job.workload, job.plan, job.runtime, device)
        limit = job.gpu.capacity_bytes - report.overhead if limit is None else limit
        v = serving_verdict(job.model, job.workload, job.plan, job.allocator, limit)
    update: dict[str, Any] = {"reserved": v.reserved, "reserved_detail": _detail(job, v, limit)}
    peak = report.peak.model_copy(update=update)
    model, reason = _which_model(v.timeline)
    return report.model_copy(update={"peak": peak, "model": model, "model_reason": reason}), v, limit


def _detail(job: Job, v: Verdict, limit: int) -> ReservedDetail:
    """The allocator's state at the allocated peak of its replay of the run (``ReservedDetail``)."""
    return ReservedDetail(
        allocator="expandable" if job.allocator.expandable_segments else "default",
        segments=v.replay.segments,
        cached_free=v.replay.cached_free,
        largest_free=v.replay.largest_free,
        reserved_by_stream=v.replay.reserved_by_stream,
        limit=limit,
        failed_request=v.failure.size if v.failure else None,
        failed_tensor=f"{v.failure.category} ({v.failure.tag})" if v.failure else None,
        fits_with_expandable_segments=v.expandable_fits,
        expandable_reserved=v.expandable_reserved,
        timeline=v.timeline,
        timeline_allocated=v.replay.max_allocated,
    )


def _which_model(timeline: str) -> tuple[str, str | None]:
    """``memory.model`` of a report the op-level run does not build (``memory_verdict``), and why
    not: inference, or the reason ``reserve.plan_run`` gave for the phase model's run."""
    if timeline == "serving":
        return "phase", "inference (the op-level run follows training steps)"
    return "phase", timeline.removeprefix("phases (").removesuffix(")")


VERIFIED = 4  # changes that fit by the fast form, estimated again in full (one allocator replay each)


def _verified(
    job: Job, found: "list[Suggestion]", current: int, limit: int, device: Device
) -> "list[tuple[Suggestion, bool]]":
    """The first ``VERIFIED`` changes that fit by the fast form, estimated as ``memplan estimate`` would
    estimate the changed plan (the allocator replay of its run decides reserved and fits), so a change
    advised to fit is one the estimate of it says fits; the others keep their screening figures."""
    out: list[tuple[Suggestion, bool]] = []
    budget = VERIFIED
    for s in found:
        if not s.fits or budget == 0 or not (s.plan_update or s.workload_update):
            out.append((s, False))
            continue
        budget -= 1
        plan = changed_plan(job.plan, dict(s.plan_update), job.runtime, job.model)
        workload = job.workload.model_copy(update=dict(s.workload_update))
        changed = replace(job, plan=plan, workload=workload)
        full, v, _ = memory_verdict(changed, device, limit)
        reserved = full.peak.reserved
        out.append((replace(s, reserved=reserved, saved=current - reserved, fits=v.fits), True))
    return out


def _allocator_suggestion(report: MemoryReport) -> "list[Suggestion]":
    """PyTorch's expandable segments, when the default allocator's replay failed: what the same
    run reserves with them (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``)."""
    from memplan.costmodel.advice import Suggestion

    detail = report.peak.reserved_detail
    if detail is None or detail.expandable_reserved is None:
        return []
    saved = report.peak.reserved - detail.expandable_reserved
    if saved <= 0:
        return []
    change = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    return [Suggestion(change, detail.expandable_reserved, saved, bool(detail.fits_with_expandable_segments))]


def estimate(
    job: Job,
    with_suggestions: bool = True,
    efficiency: Efficiency | None = None,
    device: Device = "cuda",
    host_memory_bytes: int | None = None,
    host_source: str = "",
) -> EstimateResult:
    """Estimate one job for ``device`` (a GPU profile's CUDA, or a CPU run of the trainer);
    when it does not fit, rank single changes that would help. With ``host_memory_bytes`` (per
    node; ``host_source`` says where it comes from) a training plan whose offloaded bytes exceed
    it does not fit either (``costmodel.host``)."""
    return estimate_with_run(job, with_suggestions, efficiency, device, host_memory_bytes, host_source)[0]


def estimate_with_run(
    job: Job,
    with_suggestions: bool = True,
    efficiency: Efficiency | None = None,
    device: Device = "cuda",
    host_memory_bytes: int | None = None,
    host_source: str = "",
) -> tuple[EstimateResult, Timeline, str]:
    """:func:`estimate`, with the run its allocator verdict replayed (the most-loaded rank's) and
    which model made it (``trainer``, ``phases (...)`` or ``serving``): what ``--timeline`` draws,
    so that the run is built once."""
    time = None
    if isinstance(job.workload, TrainingWorkload):
        time = estimate_time(job.model, job.workload, job.plan, job.gpu, job.cluster, job.runtime, efficiency)
    capacity = job.gpu.capacity_bytes
    report, v, limit = memory_verdict(job, device)
    fits, reason = v.fits, v.reason
    host = None
    if isinstance(job.workload, TrainingWorkload):
        ranks = min(job.cluster.gpus_per_node, job.plan.world_size)
        host = host_memory(report, ranks, limit - report.peak.reserved, host_memory_bytes, host_source)
    host_short = fits and host is not None and not host.fits
    if host_short:  # the device fits and the host does not
        fits, reason = False, host.reason()
    margin = fits_margin(job, report, v.timeline, fits, limit - report.peak.reserved)
    suggestions = []
    if host_short:
        # what moves the host's share to NVMe or back to the GPU
        if with_suggestions:
            from memplan.costmodel.advice import host_suggestions

            found = host_suggestions(
                job.model, job.workload, job.plan, job.runtime, limit, report.peak.reserved, ranks,
                host.available_bytes or 0, device,
            )  # fmt: skip
            suggestions = [
                SuggestionOut(change=s.change, reserved_bytes=s.reserved, saved_bytes=s.saved, fits=s.fits)
                for s in found
            ]
    elif with_suggestions and (not fits or margin["state"] == "tight"):
        from memplan.costmodel.advice import suggest
        from memplan.costmodel.overhead import fast_reserved_bytes

        # a tight fit: what fits with the band free (buys the headroom the model's error asks for)
        target = limit if not fits else limit - margin["band_bytes"]
        # single changes are screened with the fast form, compared with the same form of this plan
        current = fast_reserved_bytes(report.peak.allocated)
        found = suggest(
            job.model, job.workload, job.plan, job.runtime, target, current, device, gpu=job.gpu, cluster=job.cluster
        )
        # ranked as the table's title says: those that fit first, then by bytes saved (the JSON
        # carries each fitting change's step time, its cost)
        checked = _verified(job, found, report.peak.reserved, target, device)
        if any(s.fits for s in found) and not any(s.fits for s, verified in checked if verified):
            # the screen (the phase model's sums) said a single change fits and its estimate says it does not
            # (under transformers' FSDP2 the sums are up to 74% below the run: docs/accuracy.md): the
            # combinations the screen skipped, verified in turn
            singles = {s.change for s in found}
            combined = suggest(
                job.model, job.workload, job.plan, job.runtime, target, current, device, job.gpu, job.cluster, True
            )
            combined = [s for s in combined if s.change not in singles]
            checked += _verified(job, combined, report.peak.reserved, target, device)
        expandable = [(s, False) for s in _allocator_suggestion(report)]
        ranked = sorted([*expandable, *checked], key=lambda sv: (not sv[0].fits, -sv[0].saved))
        suggestions = [
            SuggestionOut(
                change=s.change,
                reserved_bytes=s.reserved,
                saved_bytes=s.saved,
                fits=s.fits,
                step_time_s=s.step_time_s,
                verified=verified,
            )
            for s, verified in ranked
        ]
    assert v.run is not None  # both verdicts keep the run they replayed
    result = EstimateResult(
        model={
            "name": job.model.name,
            "parameters": total_params(job.model),
            "active_parameters": active_params(job.model),
            "architecture": job.model.architecture,
        },
        plan=_with_attention_kernel(resolved_plan(job, report.gradient_accumulation), job, device),
        gpu={
            "name": job.gpu.name,
            "memory_bytes": job.gpu.memory_bytes,
            "capacity_bytes": capacity,
            "capacity_basis": job.gpu.capacity_basis,
            "capacity_spread_bytes": job.gpu.capacity_spread_bytes,
            "capacity_source": job.gpu.capacity_note,
            "display_name": job.gpu.display_name,
            "device": device,
        },
        memory=report,
        fits=fits,
        fits_reason=reason,
        headroom_bytes=limit - report.peak.reserved,
        suggestions=suggestions,
        time=time,
        warnings=list(job.warnings),
        host=host,
        fits_margin=margin,
    )
    return result, v.run, v.timeline


def fits_margin(job: Job, report: MemoryReport, which: str, fits: bool, headroom: int) -> dict[str, Any]:
    """The verdict against the tight band of the model that answered (``costmodel.margin``)."""
    training = isinstance(job.workload, TrainingWorkload)
    outside_spread = int(report.outside["spread"]) if report.outside is not None else 0
    capacity_spread = job.gpu.capacity_spread_bytes
    b = margin_band(
        which, job.plan if training else None, job.runtime, report.peak.reserved, outside_spread, capacity_spread
    )
    return {
        "state": margin_state(fits, headroom, b.bytes),
        "headroom_bytes": headroom,
        "band_bytes": b.bytes,
        "error": b.error,
        "model": b.model,
        "basis": b.basis,
        "outside_spread_bytes": outside_spread,
        "capacity_spread_bytes": capacity_spread,
    }


def serving_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """An inference report's plan: the degrees, the workload and the weights' element type
    (``weights_dtype``, what ``precision`` means when serving: the compute dtype the weights are
    held in), without the training settings serving memory does not depend on (ZeRO, the
    optimizer, recomputation, fine-tuning, the runtime profile)."""
    kept = {k: v for k, v in plan.items() if k not in TRAINING_PLAN_FIELDS and k != "runtime"}
    return {**kept, "weights_dtype": weights_dtype(plan["precision"])}


def weights_dtype(precision: str) -> str:
    """The element type serving holds the weights in under ``precision`` (``estimate_inference``:
    fp8 matmuls keep fp8 weights, else the compute dtype)."""
    policy = POLICIES[precision]
    if policy.fp8_matmuls:
        return "fp8"
    if policy.compute_bytes == 4:
        return "fp32"
    return "fp16" if precision.startswith("fp16") else "bf16"


def calibrated_efficiency(gpu: GPUSpec) -> Efficiency | None:
    """The GPU profile's efficiencies scaled by its stored calibration, if any. Without a
    calibration file (most users have none) the calibration's models are not imported (~3 M
    instructions of a cold estimate)."""
    from memplan.search.calibration_file import calibration_path

    path = calibration_path()
    try:
        path.stat()
    except FileNotFoundError:  # what load_calibration reads as no calibration
        return None
    from memplan.search.calibration import load_calibration

    profile = load_calibration(path).profiles.get(gpu.name)
    ratio = profile.step_time_ratio if profile is not None else None
    return Efficiency.for_gpu(gpu, calibration=ratio) if ratio else None


def report_job(
    job: Job,
    calibration: bool = True,
    device: Device = "cuda",
    host_memory_bytes: int | None = None,
    host_source: str = "",
) -> tuple[EstimateResult, Timeline, str]:
    """What ``memplan estimate`` reports for a resolved job (and :func:`memplan.estimate` returns):
    :func:`estimate_with_run` with the GPU profile's calibration (``calibration``), a serving
    estimate's plan as :func:`serving_plan` gives it, and ``gpu.auto`` when the GPU was detected."""
    result, run, which = estimate_with_run(
        job,
        efficiency=calibrated_efficiency(job.gpu) if calibration else None,
        device=device,
        host_memory_bytes=host_memory_bytes,
        host_source=host_source,
    )
    if job.workload.kind == "inference":
        result = result.model_copy(update={"plan": serving_plan(result.plan)})
    if job.gpu_note:  # --gpu auto: which GPU and why, in the header and the JSON (gpu.auto)
        result = result.model_copy(update={"gpu": {**result.gpu, "auto": job.gpu_note}})
    return result, run, which
