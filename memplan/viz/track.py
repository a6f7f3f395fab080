"""One run's allocations in order, with what the caching allocator reserves after each.

A :class:`Track` is the common form of a predicted run (a :class:`Timeline` replayed through
the allocator model) and of a measured one (a snapshot's device trace): each entry is an
allocation (+1) or a free (-1) of a block, with the block's size as the allocator
hands it out (a request rounded to 512 B, or a whole block it would not split), its request,
category, label and stream. Reserved bytes follow the allocator's segment events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.costmodel.allocator import AllocatorConfig, CachingAllocator
from memplan.costmodel.reserve import STREAM_IDS  # the streams' numbers, as the verdict's replay uses them
from memplan.costmodel.timeline.events import ALLOC, MARK, Category, Moment, Stream, Timeline
from memplan.costmodel.timeline.phases import PHASE_MARKS

SEGMENT_GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass
class Track:
    """Parallel lists, one entry per event. ``tensor`` ids an allocation; its free names the same id."""

    op: list[int] = field(default_factory=list)  # +1 alloc, -1 free (marks are in ``marks``)
    tensor: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)  # block bytes
    requested: list[int] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    label: list[str] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)
    addr: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # after the event
    # (event index before which they happened, action, addr, size, stream): the allocator's segment events
    segment_events: list[tuple[int, str, int, int, int]] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (event index, name)
    phase: list[str] = field(default_factory=list)  # per event: build, forward, backward, optimizer, prefill
    ooms: list[tuple[int, int, int]] = field(
        default_factory=list
    )  # measured: (event index before, requested, device free)
    expandable: bool = False

    def __len__(self) -> int:
        return len(self.op)

    def append(self, op: int, tensor: int, size: int, requested: int, category: str, label: str, stream: int,
               addr: int, reserved: int) -> None:  # fmt: skip
        self.op.append(op)
        self.tensor.append(tensor)
        self.size.append(size)
        self.requested.append(requested)
        self.category.append(category)
        self.label.append(label)
        self.stream.append(stream)
        self.addr.append(addr)
        self.reserved.append(reserved)

    def allocated(self) -> list[int]:
        """Allocated bytes after each event."""
        out, live = [], 0
        for op, size in zip(self.op, self.size, strict=True):
            live += op * size
            out.append(live)
        return out

    def peak(self) -> tuple[int, int]:
        """(peak allocated bytes, index of the event that first reaches it); (0, -1) for an empty track."""
        best, where = 0, -1
        for i, value in enumerate(self.allocated()):
            if value > best:
                best, where = value, i
        return best, where

    def live_at(self, index: int) -> list[int]:
        """Event indices of the allocations live just after event ``index``, in allocation order."""
        live: dict[int, int] = {}
        for i in range(index + 1):
            op = self.op[i]
            if op > 0:
                live[self.tensor[i]] = i
            elif op < 0:
                live.pop(self.tensor[i], None)
        return list(live.values())


def replay_timeline(timeline: Timeline, config: AllocatorConfig) -> Track:
    """``timeline`` through the allocator model (no capacity: what the run reserves when nothing
    stops it), with the block and the reserved bytes of every event, its phase and the segment events."""
    alloc = CachingAllocator(config, record_history=True)
    history = alloc.history
    assert history is not None
    track = Track(expandable=config.expandable_segments)
    t = track
    ops, tensors, sizes, requests, cats, labels = t.op, t.tensor, t.size, t.requested, t.category, t.label
    streams, addrs, reserved, phases = t.stream, t.addr, t.reserved, t.phase
    malloc, free = alloc.malloc, alloc.free
    blocks = {}  # tensor -> Block
    seen, compute = 0, Stream.COMPUTE
    for (op, tensor, request, category, on, tag), phase in zip(timeline.events, timeline_phases(timeline), strict=True):
        if op == MARK:
            track.marks.append((len(ops), tag))
            continue
        stream = 0 if on is compute else STREAM_IDS[on]
        if op == ALLOC:
            block = blocks[tensor] = malloc(request, stream)
            ops.append(1)
            sizes.append(block.size)
            addrs.append(block.addr)
        else:
            block = blocks.pop(tensor)
            ops.append(-1)
            sizes.append(block.size)  # read before the pool may reuse the object
            addrs.append(block.addr)
            free(block)
        if len(history) > seen:
            for action, _segment, seg_addr, seg_size, seg_stream in history[seen:]:
                track.segment_events.append((len(ops) - 1, action, seg_addr, seg_size, seg_stream))
            seen = len(history)
        tensors.append(tensor)
        requests.append(request)
        cats.append(category._value_ if category is not None else "")  # the plain str, as a snapshot holds it
        labels.append(tag)
        streams.append(stream)
        reserved.append(alloc.reserved)
        phases.append(phase)
    return track


# the phase that follows each mark: a mark closes the moment it names (``step.py``'s ``reach``)
_AFTER_MARK = {
    "build": "forward",
    Moment.FORWARD.value: "backward",
    Moment.BACKWARD_START.value: "backward",
    Moment.BACKWARD.value: "backward",  # the backward's peak: the rest of it, then the optimizer step
    Moment.OPTIMIZER.value: "forward",
}
_OPTIMIZER = (Category.OPTIMIZER_STATES, Category.OPTIMIZER_TEMP)


def timeline_phases(timeline: Timeline) -> list[str]:
    """The phase of each event of ``timeline``: ``build``, ``forward``, ``backward``,
    ``optimizer`` (training) or ``prefill`` (serving).

    The phase model's runs mark their moments: a mark closes the moment it names (the backward
    mark is the backward's peak; the rest of the backward follows it). The op-level runs name
    the meter's phases (``timeline.phases``: before each micro-batch, pipeline action and optimizer
    step); within a micro-batch the backward starts at the loss's gradient seed. In both, the optimizer
    step starts at the first optimizer state or temporary allocated in the backward. A serving
    run (no gradients, no optimizer) prefills after its build."""
    events = timeline.events
    serving = not any(e.category in (Category.GRADIENTS, *_OPTIMIZER) for e in events)
    out, phase = [], "build"
    for e in events:
        if e.op == MARK:
            out.append(phase)
            if serving:
                phase = "prefill"
            elif e.tag in PHASE_MARKS:  # the op-level runs name the meter's phases
                phase = PHASE_MARKS[e.tag] or phase
            elif e.tag.startswith("step"):
                phase = "forward"
            elif e.tag in _AFTER_MARK:
                phase = _AFTER_MARK[e.tag]
            continue
        if not serving and e.op == ALLOC:
            if phase == "forward" and e.tag.endswith("grad_seed"):
                phase = "backward"
            elif phase == "backward" and e.category in _OPTIMIZER:
                phase = "optimizer"
        out.append(phase)
    return out
