"""One plan's predicted memory and speed, and how plans compare under each objective.

A plan fits when its peak reserved memory (``estimate_memory``, the most-loaded rank) stays
under the card's capacity less a safety margin; its speed is ``estimate_time``'s step of the
slowest pipeline stage. A calibration (measured / predicted, from ``memplan tune
--validate``) scales the step time through ``Efficiency.calibration`` and the allocated peak
by its own ratio (the reserved peak keeps the allocator's slack and fixed overhead on top).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from memplan.costmodel import overhead as O
from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.memory import MemoryMemo, TrainingPeak, training_peak
from memplan.costmodel.time import Efficiency, TimeMemo, step_speed
from memplan.search.space import Candidate
from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.model import ModelSpec
from memplan.specs.plan import TRANSFORMERS_RUNTIMES, Plan, PlanFields
from memplan.specs.workload import TrainingWorkload

if TYPE_CHECKING:
    from memplan.costmodel.fast_run import RunPeak

Objective = Literal["throughput", "memory", "pareto"]
M = TypeVar("M", bound=BaseModel)
GiB = 2**30


@dataclass(frozen=True)
class Context:
    """What every evaluation of one search shares."""

    model: ModelSpec
    gpu: GPUSpec
    cluster: ClusterSpec
    runtime: str = "memplan"
    margin_bytes: int = 0
    efficiency: Efficiency | None = None  # None: the GPU profile's (Efficiency.for_gpu)
    peak_ratio: float = 1.0  # measured / predicted allocated peak (calibration)
    allocator: AllocatorConfig = AllocatorConfig()  # the caching allocator the plans run under
    device: str = "cuda"  # where the plans run: which attention kernel (memory.sdpa_kind)
    allow_tight: bool = False  # a replayed plan that fits within the tight band still counts as fitting
    # Set once from the fields above (``__post_init__``), plain attributes: read on every plan (``evaluate``),
    # where a ``cached_property`` (a non-data descriptor) takes CPython's unspecialized attribute lookup.
    # every plan's peak asked of the op-level run (``from_run``), full training too: transformers' loops on
    # CUDA (``fast_run._hf_full``)
    every_plan_from_run: bool = field(init=False, repr=False, compare=False)
    time_efficiency: Efficiency = field(init=False, repr=False, compare=False)  # as given, else the GPU profile's
    memory_memo: MemoryMemo = field(init=False, repr=False, compare=False)  # what the plans share in training_peak
    time_memo: TimeMemo = field(init=False, repr=False, compare=False)  # what they share in time.step_speed
    # the most a plan's reserved peak and the memory outside the allocator may reach: the capacity PyTorch
    # sees less the margin
    limit_bytes: int = field(init=False, repr=False, compare=False)
    capacity_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = {
            "every_plan_from_run": self.runtime in TRANSFORMERS_RUNTIMES and self.device == "cuda",
            "time_efficiency": self.efficiency or Efficiency.for_gpu(self.gpu),
            "memory_memo": MemoryMemo(),
            "time_memo": TimeMemo(),
            "limit_bytes": self.gpu.capacity_bytes - self.margin_bytes,
            "capacity_bytes": self.gpu.capacity_bytes,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @cached_property
    def run_peaks(self) -> dict[Candidate, RunPeak | None]:
        """The op-level run's peak of each plan ``fast_run`` answers, once per plan (``fast_peak``)."""
        return {}


class Evaluation(BaseModel):
    """A plan's prediction. ``headroom_bytes`` is the capacity PyTorch sees less the memory
    outside the allocator and the peak reserved; ``fits`` also keeps the margin free."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: Plan
    workload: TrainingWorkload
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_phase: str
    peak_rank: int
    capacity_bytes: int
    limit_bytes: int
    overhead_bytes: int = 0  # outside the allocator (CUDA context, NCCL, workspaces)
    fits: bool
    headroom_bytes: int
    gradient_accumulation: int
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    # the replay's verdict against the model's measured error (costmodel/margin.py): fits, but within the
    # band; the fast form does not know it (False, 0)
    tight: bool = False
    band_bytes: int = 0

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.plan, self.workload)

    @property
    def constraint(self) -> float:
        """Optuna's feasibility value (<= 0 feasible): GiB over the limit."""
        return (self.peak_reserved_bytes + self.overhead_bytes - self.limit_bytes) / GiB


def peak_bytes(peak: TrainingPeak, peak_ratio: float) -> tuple[int, int]:
    """(allocated, reserved) peak, the allocated one scaled by a calibration ratio."""
    if peak_ratio == 1.0:
        return peak.allocated, peak.reserved
    allocated = round(peak.allocated * peak_ratio)
    return allocated, O.fast_reserved_bytes(allocated)


def fast_peak(candidate: Candidate, ctx: Context) -> TrainingPeak:
    """The search's fast form of a plan's peak: ``memory.training_peak``, its allocated peak and
    phase taken from the op-level run for the plans ``from_run`` answers: fine-tuning and fp32, and under
    transformers' loops full training too (``Context.every_plan_from_run``)."""
    plan = PlanFields(candidate.plan)  # read field by field: plain attributes (PlanFields)
    peak = training_peak(ctx.model, candidate.workload, plan, ctx.runtime, ctx.device, ctx.memory_memo)  # type: ignore[arg-type]
    if plan.finetune != "full" or plan.precision == "fp32" or ctx.every_plan_from_run:
        return from_run(peak, candidate, ctx)
    return peak


def from_run(peak: TrainingPeak, candidate: Candidate, ctx: Context) -> TrainingPeak:
    """``peak`` with the op-level run's allocated peak and phase (``costmodel/fast_run.py``: the
    run cut to two depths, each span's peak extrapolated) where that module answers the plan: the
    fine-tuning and fp32 plans of one rank, where the phase model's sums are off by up to 61%
    (docs/cost-model.md, "The search's fast form against the run"). Once per plan; the module
    (and the run's, the allocator's) is imported only when a search meets such a plan."""
    from memplan.costmodel import fast_run as FR

    plan = candidate.plan
    if not FR.applies(ctx.model, plan, ctx.runtime, ctx.device):
        return peak
    runs = ctx.run_peaks
    if candidate not in runs:
        runs[candidate] = FR.run_peak(ctx.model, candidate.workload, plan, ctx.runtime, ctx.device, ctx.gpu)
    found = runs[candidate]
    return peak if found is None else peak._replace(allocated=found.allocated, phase=found.phase)


def peak_reserved(candidate: Candidate, ctx: Context) -> int:
    """The reserved peak alone (no step time): scans for what comes closest to fitting."""
    return peak_bytes(fast_peak(candidate, ctx), ctx.peak_ratio)[1]


def whole_run(candidate: Candidate, ctx: Context) -> bool:
    """Whether the plan's peak (``fast_peak``) costs a whole op-level run not yet made in this search
    (``fast_run.whole_hf_run``: transformers' Trainer under FSDP2, or over a model whose layers do not
    repeat), which :func:`reserved_bound` bounds for a fraction of it."""
    from memplan.costmodel import fast_run as FR

    plan = candidate.plan
    return (
        ctx.every_plan_from_run
        and candidate not in ctx.run_peaks
        and FR.applies(ctx.model, plan, ctx.runtime, ctx.device)
        and FR.whole_hf_run(ctx.model, plan, ctx.runtime, ctx.device)
    )


def reserved_bound(candidate: Candidate, ctx: Context) -> int | None:
    """A lower bound on ``peak_reserved`` of a :func:`whole_run` plan: ``fast_run.run_peak_bound`` (the run's
    peak up to its first step's end) through the same ``peak_bytes`` (non-decreasing in the allocated
    peak: ``overhead.fast_reserved_bytes``, the calibration's ratio); None where the run does not model the
    plan."""
    from memplan.costmodel import fast_run as FR

    bound = FR.run_peak_bound(ctx.model, candidate.workload, candidate.plan, ctx.device, ctx.gpu)
    if bound is None:
        return None
    plan = PlanFields(candidate.plan)
    peak = training_peak(ctx.model, candidate.workload, plan, ctx.runtime, ctx.device, ctx.memory_memo)  # type: ignore[arg-type]
    return peak_bytes(peak._replace(allocated=bound), ctx.peak_ratio)[1]


def evaluate(candidate: Candidate, ctx: Context) -> Evaluation:
    """Predicted peak memory, fit and speed of one plan: ``memory.training_peak`` and
    ``time.step_speed``, the figures of ``estimate_memory`` and ``estimate_time`` without
    their reports (tests/search/test_fast_form.py holds them equal), the peak ``fast_peak``'s
    (tests/search/test_fast_form_finetune.py holds it to the op-level run's)."""
    workload = candidate.workload
    plan = PlanFields(candidate.plan)  # read field by field: plain attributes (PlanFields)
    peak = training_peak(ctx.model, workload, plan, ctx.runtime, ctx.device, ctx.memory_memo)  # type: ignore[arg-type]
    if plan.finetune != "full" or plan.precision == "fp32" or ctx.every_plan_from_run:  # fast_peak, inline
        peak = from_run(peak, candidate, ctx)
    allocated, reserved = peak_bytes(peak, ctx.peak_ratio)
    speed = step_speed(ctx.model, workload, plan, ctx.gpu, ctx.cluster, ctx.runtime, ctx.time_efficiency, ctx.time_memo)  # type: ignore[arg-type]
    capacity, limit, overhead = ctx.capacity_bytes, ctx.limit_bytes, peak.overhead
    return constructed(
        Evaluation,
        {
            "plan": candidate.plan,
            "workload": workload,
            "peak_allocated_bytes": allocated,
            "peak_reserved_bytes": reserved,
            "peak_phase": peak.phase,
            "peak_rank": peak.rank,
            "capacity_bytes": capacity,
            "limit_bytes": limit,
            "overhead_bytes": overhead,
            "fits": reserved + overhead <= limit,
            "headroom_bytes": capacity - overhead - reserved,
            "gradient_accumulation": peak.gradient_accumulation,
            "step_time_s": speed.step_time_s,
            "tokens_per_s": speed.tokens_per_s,
            "tokens_per_s_per_gpu": speed.tokens_per_s_per_gpu,
            "mfu": speed.mfu,
            "tight": False,
            "band_bytes": 0,
        },
    )


def constructed(cls: type[M], values: dict[str, Any]) -> M:
    """``cls.model_construct(**values)`` where ``values`` holds every field of ``cls`` in
    declaration order, already valid (a plan and workload that were validated, the models'
    figures): the instance pydantic's ``model_construct`` builds, without its walk over the
    fields for aliases and defaults, four times the cost on every plan the search evaluates
    (tests/search/test_fast_form.py compares the two)."""
    m = cls.__new__(cls)
    object.__setattr__(m, "__dict__", values)
    object.__setattr__(m, "__pydantic_fields_set__", set(values))
    object.__setattr__(m, "__pydantic_extra__", None)
    object.__setattr__(m, "__pydantic_private__", None)
    return m


def replayed(ev: Evaluation, ctx: Context) -> Evaluation:
    """``ev`` with the allocator's verdict: its run replayed through the caching allocator
    model (``reserve.plan_verdict``) instead of the search's fast form. For the plans a search
    reports; a plan the replay cannot serve within the limit no longer fits."""
    from memplan.costmodel.margin import band
    from memplan.costmodel.reserve import plan_verdict

    limit = ctx.limit_bytes - ev.overhead_bytes
    v = plan_verdict(ctx.model, ev.workload, ev.plan, ctx.runtime, ctx.allocator, limit, ctx.device, ctx.gpu)
    headroom = ctx.gpu.capacity_bytes - ev.overhead_bytes - v.reserved
    spread = O.outside_memory(0).spread
    capacity_spread = ctx.gpu.capacity_spread_bytes
    b = band(v.timeline, ev.plan, ctx.runtime, v.reserved, spread, capacity_spread)
    tight = v.fits and headroom < b.bytes
    update = {
        "peak_reserved_bytes": v.reserved,
        "fits": v.fits and (ctx.allow_tight or not tight),
        "headroom_bytes": headroom,
        "tight": tight,
        "band_bytes": b.bytes,
    }
    if v.timeline == "trainer":  # the rank the replayed run followed, which ``tune --validate`` runs
        from memplan.costmodel.timeline.trainer import followed_rank

        plan = ev.plan
        update["peak_rank"] = followed_rank(ctx.model, ev.workload, plan, ev.peak_rank // (plan.dp * plan.tp * plan.cp))
    return ev.model_copy(update=update)


def evaluate_all(
    candidates: Iterable[Candidate], ctx: Context, progress: Callable[[int], None] | None = None
) -> list[Evaluation]:
    """Every candidate evaluated (the exhaustive search); ``progress(n)`` every 256 plans."""
    out = []
    for i, candidate in enumerate(candidates, 1):
        out.append(evaluate(candidate, ctx))
        if progress is not None and i % 256 == 0:
            progress(i)
    if progress is not None:
        progress(len(out))
    return out


def score(ev: Evaluation, objective: Objective) -> tuple:
    """Sort key, best first: fitting plans before the others; among fitting ones the fastest
    (throughput, pareto) or the smallest (memory), ties to the other figure; among the rest the
    closest to fitting."""
    if not ev.fits:
        return (1, ev.peak_reserved_bytes, -ev.tokens_per_s)
    if objective == "memory":
        return (0, ev.peak_reserved_bytes, -ev.tokens_per_s)
    return (0, -ev.tokens_per_s, ev.peak_reserved_bytes)


def rank(evaluations: Iterable[Evaluation], objective: Objective) -> list[Evaluation]:
    return sorted(evaluations, key=lambda ev: score(ev, objective))


def pareto_front(evaluations: Iterable[Evaluation]) -> list[Evaluation]:
    """Fitting plans that no other fitting plan beats on both tokens/s and peak reserved,
    fastest first."""
    front: list[Evaluation] = []
    for ev in sorted((e for e in evaluations if e.fits), key=lambda e: (-e.tokens_per_s, e.peak_reserved_bytes)):
        if not front or ev.peak_reserved_bytes < front[-1].peak_reserved_bytes:
            front.append(ev)
    return front


def closest(evaluations: Iterable[Evaluation]) -> Evaluation | None:
    """The plan with the lowest peak reserved memory (what comes nearest to fitting)."""
    return min(evaluations, key=lambda ev: (ev.peak_reserved_bytes, -ev.tokens_per_s), default=None)
