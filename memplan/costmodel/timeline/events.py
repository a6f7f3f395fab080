"""A step as a sequence of tensor allocations and frees, with named moments.

Categories are the breakdown keys memplan reports (``parameters``, ``activations``, ...),
close to PyTorch MemTracker's ``Parameter`` / ``Gradient`` / ``Activation`` / ``Temp`` /
``Optstate``. Moments name the points of the step that the phase model evaluates
(DESIGN.md, "Phases"); a mark records them in the sequence.
"""

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import field
from enum import StrEnum
from functools import cached_property
from typing import NamedTuple

from memplan.records import record


class Category(StrEnum):
    PARAMETERS = "parameters"
    GATHERED = "gathered_params"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer_states"
    OPTIMIZER_TEMP = "optimizer_temp"
    ACTIVATIONS = "activations"
    LOGITS = "logits_and_loss"
    AUTOCAST = "autocast_weights"
    FP8 = "fp8_weights"  # Transformer Engine's cached fp8 weights and scaling state
    COMM = "comm_buffers"
    RETAINED = "retained_outputs"
    KV_CACHE = "kv_cache"


class Moment(StrEnum):
    """Where the phase model evaluates a step; ``backward`` is the larger of its candidates."""

    FORWARD = "forward"
    BACKWARD_START = "backward_start"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Stream(StrEnum):
    """The CUDA streams a step allocates on: compute, and FSDP2's collectives' own."""

    COMPUTE = "compute"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"


def root_stream(kind: Stream, root: int) -> Stream | str:
    """FSDP2's collective stream ``kind`` of a rank's ``root``-th ``fully_shard`` root, counted from 0.
    Each root makes its own streams (torch ``_fsdp_state.py``: ``self._comm_ctx = FSDPCommContext()``
    per state, ``FSDPCommContext.lazy_init`` creating ``all_gather_stream``, ``reduce_scatter_stream``;
    only the states under a root share its context), so a pipeline rank with two chunks, each its own
    root, has two of each: the H200 snapshot of an interleaved plan showed two all-gather and two
    reduce-scatter streams (docs/cost-model.md). The caching allocator keeps each stream's blocks
    apart, so what one root's stream cached the other cannot reuse."""
    return kind if root == 0 else f"{kind.value}.{root}"


ALLOC, FREE, MARK = 0, 1, 2


class Event(NamedTuple):
    """One allocation, free or mark. ``tensor`` ids an allocation; a free names the same id.
    A run records its events as plain tuples of these six fields (:attr:`Timeline.raw`: building a
    named tuple costs ~1,200 instructions more than a plain one, callgrind, and a run has tens of
    thousands); :attr:`Timeline.events` gives them as named tuples to the readers of fields."""

    op: int
    tensor: int
    size: int
    category: Category | None
    stream: Stream
    tag: str


STEADY = "step0"  # the warm-up step's end mark: the meter measures the steps after it (timeline.phases)
FORWARD_MARK = "phase:forward"  # a forward starts (timeline.phases)
SNAPSHOT_MARKS = frozenset({"phase:backward", "phase:optimizer"})  # the live set kept at these, once steady


class Snapshot(NamedTuple):
    """The tensors live at a steady step's mark in :data:`SNAPSHOT_MARKS` (``timeline.phases``
    reads the saved activations and the model states there without walking the events again).
    ``since``: the first tensor id of the forward that the last ``phase:forward`` mark began
    (ids only grow, so a tensor with an id at least ``since`` was allocated since that mark).
    ``live``: their allocations, as plain tuples (:class:`Event`'s fields)."""

    index: int  # the mark's position in the events
    tag: str
    since: int
    live: tuple[tuple, ...]


@record()
class Timeline:
    """The events of one rank, in order, and the live sets at its steady marks. Build with
    :class:`Builder`. ``raw``: the events as plain tuples, what the allocator's replay and the
    estimate read by position; :attr:`events`: the same as :class:`Event` named tuples, made on
    first use (tests, ``--timeline``, the phase model's readers of fields)."""

    raw: tuple[tuple, ...]
    snapshots: tuple[Snapshot, ...] = ()
    host_peak: int = 0  # activation offload's pinned host copies at most (``act_offload.SaveOnCpu``)
    stage: int = 0  # the pipeline rank the run follows
    # bytes the run holds in CUDA managed memory, outside the caching allocator (bitsandbytes' paged
    # optimizer states, ``hf_bnb_optim.py``): in no event
    managed: int = 0

    def __init__(
        self,
        raw: "tuple[tuple, ...]",
        snapshots: "tuple[Snapshot, ...]" = (),
        host_peak: int = 0,
        stage: int = 0,
        managed: int = 0,
    ) -> None:  # written out: memplan.records (annotations quoted: not evaluated at import)
        _set = object.__setattr__
        _set(self, "raw", raw)
        _set(self, "snapshots", snapshots)
        _set(self, "host_peak", host_peak)
        _set(self, "stage", stage)
        _set(self, "managed", managed)

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """The events as named tuples (:attr:`raw`'s, in order)."""
        return tuple(map(Event._make, self.raw))

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def peak(self) -> tuple[int, int]:
        """(peak live bytes, index of the event that reaches it first)."""
        live = best = where = 0
        for i, (op, _, size, _, _, _) in enumerate(self.raw):
            if op == ALLOC:
                live += size
                if live > best:
                    best, where = live, i
            elif op == FREE:
                live -= size
        return best, where

    def live_by_category(self, upto: int) -> dict[str, int]:
        """Bytes live per category just after event ``upto`` (zero categories left out), in the
        order the events first name them. Counted from the last snapshot at or before ``upto`` (its
        live set, then the events after it: a tenth of a run's events, not all up to the peak)."""
        out: dict[str, int] = {}
        get, start = out.get, 0
        for snap in self.snapshots:
            if snap.index <= upto:
                start, live = snap.index, snap.live
        if start:
            for _, _, size, category, _, _ in live:
                out[category] = get(category, 0) + size
        for op, _, size, category, _, _ in self.raw[start : upto + 1]:
            if op == ALLOC:
                out[category] = get(category, 0) + size
            elif op == FREE:
                out[category] = get(category, 0) - size
        assert None not in out  # every allocation has a category
        found = {k: v for k, v in out.items() if v}
        return {k: found[k] for k in self._first_named(found.keys())}

    def _first_named(self, categories) -> list[str]:  # noqa: ANN001 (a dict's keys)
        """``categories`` in the order the events first name them."""
        order, wanted = [], set(categories)
        for e in self.raw:
            if e[3] in wanted:
                order.append(e[3])
                wanted.discard(e[3])
                if not wanted:
                    break
        return order

    def largest_live(self, upto: int, n: int = 5) -> list[Event]:
        """The ``n`` largest tensors live just after event ``upto``."""
        live: dict[int, tuple] = {}
        for e in self.raw[: upto + 1]:
            if e[0] == ALLOC:
                live[e[1]] = e
            elif e[0] == FREE:
                live.pop(e[1], None)
        return [Event._make(e) for e in sorted(live.values(), key=lambda e: -e[2])[:n]]

    def marks(self) -> dict[str, int]:
        """Index of each moment's (last) mark."""
        return {e[5]: i for i, e in enumerate(self.raw) if e[0] == MARK}


@record(frozen=False)
class Builder:
    """Appends events (plain tuples of :class:`Event`'s fields); tracks what is live per category
    so callers free by category."""

    events: list[tuple] = field(default_factory=list)
    live: dict[int, tuple] = field(default_factory=dict)
    snapshots: list[Snapshot] = field(default_factory=list)
    _next: int = 0
    _since: int = 0  # ``_next`` at the last phase:forward mark
    _steady: bool = False  # past the warm-up step's end mark
    mark_ids: list[int] = field(default_factory=list)  # ``_next`` at each mark (``repeat.py``)

    def __init__(
        self,
        events: "list[tuple] | None" = None,
        live: "dict[int, tuple] | None" = None,
        snapshots: "list[Snapshot] | None" = None,
        _next: int = 0,
        _since: int = 0,
        _steady: bool = False,
        mark_ids: "list[int] | None" = None,
    ) -> None:  # written out: memplan.records (annotations quoted: not evaluated at import)
        self.events = [] if events is None else events
        self.live = {} if live is None else live
        self.snapshots = [] if snapshots is None else snapshots
        self._next = _next
        self._since = _since
        self._steady = _steady
        self.mark_ids = [] if mark_ids is None else mark_ids

    def alloc(self, size: int, category: Category, tag: str, stream: Stream = Stream.COMPUTE) -> int:
        """A new tensor of ``size`` bytes (nothing is recorded for an empty one); its id."""
        tensor = self._next
        self._next = tensor + 1
        if size > 0:
            event = (ALLOC, tensor, size, category, stream, tag)
            self.events.append(event)
            self.live[tensor] = event
        return tensor

    def free(self, tensor: int) -> None:
        event = self.live.pop(tensor, None)
        if event is not None:
            _, _, size, category, stream, tag = event
            self.events.append((FREE, tensor, size, category, stream, tag))

    def mark(self, moment: str) -> None:
        self.mark_ids.append(self._next)
        if moment == FORWARD_MARK:
            self._since = self._next
        elif moment == STEADY:
            self._steady = True
        elif self._steady and moment in SNAPSHOT_MARKS:
            self.snapshots.append(Snapshot(len(self.events), moment, self._since, tuple(self.live.values())))
        self.events.append((MARK, -1, 0, None, Stream.COMPUTE, moment))

    def position(self) -> tuple[int, int, int]:
        """(events, tensor ids, marks) so far: where a block of the run starts or ends (``repeat.py``)."""
        return len(self.events), self._next, len(self.mark_ids)

    def live_bytes(self, category: Category) -> int:
        return sum(e[2] for e in self.live.values() if e[3] == category)

    def build(self, host_peak: int = 0, stage: int = 0, managed: int = 0) -> Timeline:
        return Timeline(tuple(self.events), tuple(self.snapshots), host_peak, stage, managed)


@contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a run is built or replayed: a run makes tens of
    thousands of long-lived, acyclic records (events, tensors, blocks), and each generation-2
    collection they trigger walks all of them again (~4% of a cold ``memplan estimate``'s
    instructions, callgrind). What becomes cyclic garbage meanwhile is collected afterwards."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
