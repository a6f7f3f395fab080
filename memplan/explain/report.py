"""What ``memplan explain`` reports: measured peaks, what was live at the peak by category,
reserved-but-free memory per stream, and (with a model and plan) measured against predicted."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.allocator.trace import load_snapshot
from memplan.costmodel.reserve import STREAM_IDS
from memplan.explain.align import align
from memplan.explain.read import UNKNOWN, max_reserved, read_trace, reserved_before, stream_memory
from memplan.specs.resolve import Job
from memplan.viz.series import Tensor
from memplan.viz.track import Track

ROUNDING = "allocator_rounding"  # block bytes beyond the requests: 512 B rounding, unsplit blocks
LARGEST = 8
DIFFERENCES = 3
NEGLIGIBLE = 2**20  # a difference under 1 MiB is not named


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StreamMemory(_Frozen):
    """One CUDA stream's segments: reserved, allocated, and reserved but free (fragmentation)."""

    stream: int
    name: str  # "default", or the predicted stream its allocations matched (all_gather, ...)
    reserved: int
    allocated: int
    cached_free: int


class CategoryRow(_Frozen):
    category: str
    measured: int
    predicted: int
    difference: int  # measured - predicted


class Comparison(_Frozen):
    """The estimate of the plan the snapshot ran, against it."""

    model: str
    run: str  # the predicted run: trainer, phases (why), serving
    predicted_allocated: int
    predicted_reserved: int
    allocated_error_pct: float
    reserved_error_pct: float
    categories: list[CategoryRow]  # largest difference first
    largest_differences: list[str]


class OutOfMemory(_Frozen):
    """The first request the device could not serve, and the allocator's state then."""

    event: int  # the allocations and frees before it
    requested: int
    device_free: int  # what CUDA still had outside the allocator
    allocated: int
    reserved: int


class ExplainResult(_Frozen):
    """What ``memplan explain --format json`` prints (keys are a contract: add, never rename).

    ``categories`` sum to ``peak_allocated``: requests per category plus ``allocator_rounding``."""

    source: str
    device: int
    allocator: Literal["default", "expandable"]
    allocations: int
    frees: int
    segment_events: int
    peak_allocated: int
    peak_reserved: int
    peak_event: int
    peak_phase: str
    categories: dict[str, int]
    attribution: Literal["frames", "prediction", "frames and prediction", "none"]
    attribution_note: str
    largest: list[Tensor]
    streams_at_peak: list[StreamMemory]
    streams_at_end: list[StreamMemory]
    comparison: Comparison | None = None
    oom: OutOfMemory | None = None


@dataclass(frozen=True)
class Explained:
    """The result, and the runs it was computed from (for ``--timeline``)."""

    result: ExplainResult
    measured: Track
    predicted: Track | None
    predicted_run: str = ""
    overhead: int = 0  # the estimate's memory outside the allocator (for the limit a picture draws)


def _streams(track: Track, index: int, names: dict[int, str]) -> list[StreamMemory]:
    out = []
    for stream, (reserved, allocated) in stream_memory(track, index).items():
        name = "default" if stream == 0 else names.get(stream, "")
        out.append(StreamMemory(stream=stream, name=name, reserved=reserved, allocated=allocated,
                                cached_free=reserved - allocated))  # fmt: skip
    return out


def live_categories(track: Track, index: int) -> tuple[dict[str, int], list[int]]:
    """Requests per category live after ``index``, plus the blocks' rounding; and the live events."""
    live = track.live_at(index)
    out: dict[str, int] = {}
    rounding = 0
    for i in live:
        out[track.category[i]] = out.get(track.category[i], 0) + track.requested[i]
        rounding += track.size[i] - track.requested[i]
    if rounding:
        out[ROUNDING] = rounding
    return dict(sorted(out.items(), key=lambda kv: -kv[1])), live


def _attribution(track: Track, own: int, alignment) -> tuple[str, str]:
    allocs = sum(1 for op in track.op if op > 0)
    if alignment is None:
        if own:
            return "frames", f"{own} of {allocs} allocations name their category (event category or frames)"
        return "none", "no frames in the snapshot and no model given: give MODEL and plan flags to attribute"
    kind = "frames and prediction" if own else "prediction"
    note = alignment.note(allocs) + (f"; {own} named their own category" if own else "")
    return kind, note


def explain(
    path: str | Path, job: Job | None = None, device: str = "cuda", trace_device: int = 0, snapshot: dict | None = None
) -> Explained:
    """Read the snapshot at ``path`` (or ``snapshot``, already loaded from it); with ``job``,
    attribute it and compare it with the estimate."""
    from memplan.estimation import estimate
    from memplan.viz.predicted import predicted_track

    source = str(path)
    if snapshot is None:
        snapshot = load_snapshot(path)
    measured = read_trace(snapshot, trace_device, source)
    own = sum(1 for op, c in zip(measured.op, measured.category, strict=True) if op > 0 and c != UNKNOWN)
    predicted, which, alignment, comparison = None, "", None, None
    if job is not None:
        predicted, which = predicted_track(job, device)
        alignment = align(measured, predicted, {v: str(k) for k, v in STREAM_IDS.items()})
    names = alignment.stream_names if alignment else {}
    peak, where = measured.peak()
    categories, live = live_categories(measured, where)
    base = reserved_before(snapshot, snapshot["device_traces"][trace_device], trace_device)
    peak_reserved = max_reserved(measured, base)
    overhead = 0
    if job is not None:
        estimated = estimate(job, with_suggestions=False, device=device)
        overhead = estimated.memory.overhead
        comparison = _compare(estimated, categories, peak, peak_reserved, which)
    kind, note = _attribution(measured, own, alignment)
    largest = sorted(live, key=lambda i: -measured.size[i])[:LARGEST]
    phases = measured.phase if len(measured.phase) == len(measured) else [""] * len(measured)
    result = ExplainResult(
        source=source,
        device=trace_device,
        allocator="expandable" if measured.expandable else "default",
        allocations=sum(1 for op in measured.op if op > 0),
        frees=sum(1 for op in measured.op if op < 0),
        segment_events=len(measured.segment_events),
        peak_allocated=peak,
        peak_reserved=peak_reserved,
        peak_event=where,
        peak_phase=phases[where] if where >= 0 else "",
        categories=categories,
        attribution=kind,
        attribution_note=note,
        largest=[
            Tensor(label=measured.label[i], category=measured.category[i], size=measured.size[i]) for i in largest
        ],
        streams_at_peak=_streams(measured, where, names),
        streams_at_end=_streams(measured, len(measured) - 1, names),
        comparison=comparison,
        oom=_oom(measured),
    )
    return Explained(result, measured, predicted, which, overhead)


def _oom(track: Track) -> OutOfMemory | None:
    if not track.ooms:
        return None
    at, requested, device_free = track.ooms[0]
    allocated = track.allocated()[at - 1] if at else 0
    reserved = track.reserved[at - 1] if at else 0
    return OutOfMemory(event=at, requested=requested, device_free=device_free, allocated=allocated, reserved=reserved)


def _compare(estimated, measured: dict[str, int], peak: int, reserved: int, which: str) -> Comparison:
    p = estimated.memory.peak
    names = sorted(set(measured) | set(p.breakdown))
    rows = [CategoryRow(category=c, measured=measured.get(c, 0), predicted=p.breakdown.get(c, 0),
                        difference=measured.get(c, 0) - p.breakdown.get(c, 0)) for c in names]  # fmt: skip
    rows.sort(key=lambda r: -abs(r.difference))
    top = [
        f"{r.category}: {'+' if r.difference >= 0 else '-'}{abs(r.difference) / 2**30:.2f} GiB measured vs predicted"
        for r in rows[:DIFFERENCES]
        if abs(r.difference) >= NEGLIGIBLE
    ]
    return Comparison(
        model=estimated.model["name"],
        run=which,
        predicted_allocated=p.allocated,
        predicted_reserved=p.reserved,
        allocated_error_pct=100 * (p.allocated / peak - 1) if peak else 0.0,
        reserved_error_pct=100 * (p.reserved / reserved - 1) if reserved else 0.0,
        categories=rows,
        largest_differences=top,
    )
