"""What a picture of a run draws: a :class:`Track` sampled into at most a few thousand points.

Each point is the state just after one event: bytes live per category (block sizes, so the
stack's top is what ``torch.cuda.memory_allocated`` reads) and the allocator's reserved bytes.
Points are taken per bucket of events at the bucket's highest allocated total, so the peak
is always drawn; the peak itself, with its phase and largest live tensors, is computed on
every event.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.viz.track import Track

MAX_POINTS = 1500
LARGEST = 5
# stacking order, bottom to top: what lives longest first (names: timeline.events.Category)
ORDER = (
    "parameters",
    "optimizer_states",
    "gradients",
    "gathered_params",
    "autocast_weights",
    "fp8_weights",
    "kv_cache",
    "activations",
    "retained_outputs",
    "logits_and_loss",
    "optimizer_temp",
    "comm_buffers",
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Tensor(_Frozen):
    """One allocation: its label (layer and tensor), category and block size."""

    label: str
    category: str
    size: int


class PhaseSpan(_Frozen):
    """Events [start, end) of one phase (``build``, ``forward``, ``backward``, ``optimizer``, ``prefill``)."""

    name: str
    start: int
    end: int


class PeakMark(_Frozen):
    event: int
    allocated: int
    reserved: int
    phase: str
    largest: list[Tensor]


class Panel(_Frozen):
    """One run, ready to draw. ``x`` are event indices; ``stacks[c][i]`` the bytes of category
    ``c`` live after event ``x[i]``; ``labels[i]`` the tensor that event allocated or freed."""

    title: str
    events: int
    x: list[int]
    categories: list[str]
    stacks: dict[str, list[int]]
    reserved: list[int]
    labels: list[str]
    phases: list[PhaseSpan]
    peak: PeakMark
    limit: int | None = None  # what the allocator may use (capacity less what lives outside it)
    limit_label: str = ""


def _picks(allocated: list[int], max_points: int) -> list[int]:
    """One event per bucket, the one with the highest allocated total (the first on ties)."""
    n = len(allocated)
    if n <= max_points:
        return list(range(n))
    picks = []
    for b in range(max_points):
        lo, hi = b * n // max_points, (b + 1) * n // max_points
        if hi > lo:
            picks.append(max(range(lo, hi), key=allocated.__getitem__))
    return picks


def phase_spans(phases: list[str]) -> list[PhaseSpan]:
    spans: list[PhaseSpan] = []
    start = 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            if phases[start]:
                spans.append(PhaseSpan(name=phases[start], start=start, end=i))
            start = i
    return spans


def panel(track: Track, title: str, limit: int | None = None, limit_label: str = "",
          max_points: int = MAX_POINTS) -> Panel:  # fmt: skip
    """``track`` sampled for drawing, with its peak, phases and the allocator's limit."""
    allocated = track.allocated()
    picks = _picks(allocated, max_points)
    cats = sorted(set(track.category), key=lambda c: (ORDER.index(c) if c in ORDER else len(ORDER), c))
    stacks: dict[str, list[int]] = {c: [] for c in cats}
    live = dict.fromkeys(cats, 0)
    want = iter(picks)
    nxt = next(want, -1)
    for i, (op, size, cat) in enumerate(zip(track.op, track.size, track.category, strict=True)):
        live[cat] += op * size
        if i == nxt:
            for c in cats:
                stacks[c].append(live[c])
            nxt = next(want, -1)
    peak, where = track.peak()
    phases = track.phase if len(track.phase) == len(track) else [""] * len(track)
    largest = sorted(track.live_at(where), key=lambda i: -track.size[i])[:LARGEST] if where >= 0 else []
    mark = PeakMark(
        event=where,
        allocated=peak,
        reserved=track.reserved[where] if where >= 0 else 0,
        phase=phases[where] if where >= 0 else "",
        largest=[Tensor(label=track.label[i], category=track.category[i], size=track.size[i]) for i in largest],
    )
    labels = [f"{'+' if track.op[i] > 0 else '-'} {track.label[i]} ({track.category[i]})" for i in picks]
    return Panel(
        title=title,
        events=len(track),
        x=picks,
        categories=[c for c in cats if any(stacks[c])],
        stacks={c: v for c, v in stacks.items() if any(v)},
        reserved=[track.reserved[i] for i in picks],
        labels=labels,
        phases=phase_spans(phases),
        peak=mark,
        limit=limit,
        limit_label=limit_label,
    )
