"""Read a PyTorch memory snapshot and replay its trace through :class:`CachingAllocator`.

A snapshot (``torch.cuda.memory._snapshot()``, ``_dump_snapshot``) is a pickled dict, often
gzip'd, of plain types: ``segments`` (held at the time of the snapshot), ``device_traces`` (per
device, the allocator's events in order: ``alloc``, ``free_requested``, ``free_completed``,
``segment_alloc``/``segment_free``, ``segment_map``/``segment_unmap``, ``oom``, ...) and
``allocator_settings``. Replaying feeds the ``alloc`` and free events, matched by address (a live
allocation's address is unique), through the model configured from those settings, and sets the
model's segments beside the trace's own.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path

from memplan.costmodel.allocator.caching import CachingAllocator
from memplan.costmodel.allocator.config import AllocatorConfig
from memplan.costmodel.allocator.pool import Block
from memplan.costmodel.allocator.sizing import round_size
from memplan.errors import MemplanError

_GZIP_MAGIC = b"\x1f\x8b"
_SEGMENT_GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_OTHER_STREAM = -1  # stands for the streams a record_stream'd block waits on: the trace does not name them


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots hold dicts, lists, strings and numbers only: refuse every class a pickle names."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refuses to load {module}.{name}: a snapshot holds plain types only")


def load_snapshot(path: str | Path) -> dict:
    """The snapshot dict in ``path`` (a pickle, gzip'd or not), or :class:`MemplanError` with one reason."""
    source = str(path)
    path = Path(path)
    if not path.exists():
        raise MemplanError("no such file", source=source)
    if not path.is_file():
        raise MemplanError("not a file", source=source)
    data = path.read_bytes()
    if not data:
        raise MemplanError("empty file, not a memory snapshot", source=source)
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise MemplanError(f"a gzip file that does not decompress ({exc})", source=source) from exc
    try:
        snapshot = _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise MemplanError(f"not a memory snapshot pickle: {exc}", source=source) from exc
    except Exception as exc:  # a truncated or foreign byte stream fails in many ways
        raise MemplanError("neither a pickle nor a gzip'd pickle: not a memory snapshot", source=source) from exc
    check_snapshot(snapshot, source)
    return snapshot


def check_snapshot(snapshot: object, source: str) -> None:
    """The shape ``torch.cuda._memory_viz`` needs: a dict with ``segments`` and ``device_traces`` lists."""
    if not isinstance(snapshot, dict):
        raise MemplanError(f"a pickle of {type(snapshot).__name__}, not a memory snapshot dict", source=source)
    missing = [key for key in ("segments", "device_traces") if key not in snapshot]
    if missing:
        raise MemplanError(f"no {' or '.join(map(repr, missing))} key: not a memory snapshot", source=source)
    traces = snapshot["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise MemplanError("'device_traces' is not a list of per-device event lists", source=source)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """The model's figures after replaying one device's trace, beside the trace's own (bytes).

    ``trace_max_reserved`` and ``trace_segment_events`` come from the trace's segment events;
    ``trace_max_allocated`` from its alloc/free_requested events with sizes rounded by
    ``round_size`` (the trace holds requested sizes, not block sizes, so blocks handed out unsplit
    count at their request). Segment events are ``segment_alloc`` (default) or ``segment_map``
    (expandable segments).
    """

    device: int
    expandable_segments: bool
    allocs: int
    placed_as_traced: int  # allocations the model put where the device did (see replay_trace)
    max_reserved: int
    max_allocated: int
    segment_events: int
    reserved_by_stream: dict[int, int]
    trace_max_reserved: int
    trace_max_allocated: int
    trace_segment_events: int
    trace_reserved_by_stream: dict[int, int]

    @property
    def reserved_error(self) -> float:
        """Replayed over traced max reserved, minus 1."""
        return self.max_reserved / self.trace_max_reserved - 1 if self.trace_max_reserved else 0.0

    @property
    def segment_error(self) -> float:
        """Replayed over traced segment events, minus 1."""
        return self.segment_events / self.trace_segment_events - 1 if self.trace_segment_events else 0.0


def _trace_figures(events: list[dict], config: AllocatorConfig) -> tuple[int, int, int, dict[int, int]]:
    """The trace's own max reserved, max allocated (rounded requests), segment event count, reserved by stream."""
    reserved = max_reserved = allocated = max_allocated = segment_events = 0
    by_stream: dict[int, int] = {}
    live: dict[int, int] = {}
    for event in events:
        action = event["action"]
        if action in _SEGMENT_GROW:
            grow = _SEGMENT_GROW[action]
            size = grow * event["size"]
            reserved += size
            by_stream[event["stream"]] = by_stream.get(event["stream"], 0) + size
            max_reserved = max(max_reserved, reserved)
            segment_events += grow > 0
        elif action == "alloc":
            live[event["addr"]] = size = round_size(event["size"], config)
            allocated += size
            max_allocated = max(max_allocated, allocated)
        elif action == "free_requested":
            allocated -= live.pop(event["addr"], 0)
    return max_reserved, max_allocated, segment_events, {s: b for s, b in by_stream.items() if b}


class _TraceAddresses:
    """The addresses cudaMalloc gave the trace's segments, handed to the model while its segments
    match the trace's one for one (same size, same stream, same order); made-up ones after."""

    def __init__(self, events: list[dict]):
        self._segments = [(e["size"], e["stream"], e["addr"]) for e in events if e["action"] == "segment_alloc"]
        self._next = 0

    def __call__(self, size: int, stream: int) -> int | None:
        if self._next < len(self._segments) and self._segments[self._next][:2] == (size, stream):
            self._next += 1
            return self._segments[self._next - 1][2]
        self._next = len(self._segments)  # diverged: the rest would not line up
        return None


def _placed_as_traced(
    history: list[tuple[str, int, int, int, int]], events: list[dict], placements: list[tuple[int, int, int]]
) -> int:
    """How many allocations sit at the same offset from the start of their segment as in the trace.

    The model's segment-growing events (``segment_alloc``, ``segment_map``) are paired with the
    trace's in order, as long as size and stream agree; a segment's first event gives its start in
    both (an expandable segment's first map is at the start of its range).
    """
    grown = ("segment_alloc", "segment_map")
    model = [(seg, addr, size, stream) for action, seg, addr, size, stream in history if action in grown]
    traced = [(e["addr"], e["size"], e["stream"]) for e in events if e["action"] in grown]
    starts: dict[int, tuple[int, int]] = {}  # model segment id -> (model start, trace start)
    for (segment, addr, size, stream), (trace_addr, trace_size, trace_stream) in zip(model, traced, strict=False):
        if (size, stream) != (trace_size, trace_stream):
            break
        starts.setdefault(segment, (addr, trace_addr))
    placed = 0
    for addr, segment, trace_addr in placements:
        start = starts.get(segment)
        placed += start is not None and addr - start[0] == trace_addr - start[1]
    return placed


def replay_trace(
    snapshot: dict,
    device: int = 0,
    capacity_bytes: int | None = None,
    trace_addresses: bool = True,
    source: str = "snapshot",
) -> ReplayResult:
    """Replay device ``device``'s ``alloc``/``free_requested``/``free_completed`` events through a
    :class:`CachingAllocator` set up from the snapshot's ``allocator_settings``.

    ``free_requested`` ends the allocation (allocated bytes drop, as in PyTorch); the block goes
    back to its pool at ``free_completed``, which follows at once unless the block was used on
    another stream. Frees of blocks allocated before the trace began are skipped. With
    ``trace_addresses`` the model's segments take the trace's addresses while they line up, so that
    ties between equal free blocks break as they did on the device (the lowest address wins).
    ``placed_as_traced`` counts the allocations the model placed at the same offset of the same
    segment as the device did: all of them when the model follows the allocator exactly.
    """
    check_snapshot(snapshot, source)
    traces = snapshot["device_traces"]
    if not 0 <= device < len(traces):
        raise MemplanError(f"no trace for device {device}: the snapshot has {len(traces)}", source=source)
    settings = snapshot.get("allocator_settings") or {}
    config = AllocatorConfig.from_snapshot_settings(settings, source=source) if settings else AllocatorConfig()
    addresses = _TraceAddresses(traces[device]) if trace_addresses else None
    allocator = CachingAllocator(config, capacity_bytes=capacity_bytes, segment_address=addresses, record_history=True)
    placements: list[tuple[int, int, int]] = []  # (model address, model segment, trace address)
    live: dict[int, Block] = {}
    freeing: dict[int, Block] = {}
    malloc, free, complete = allocator.malloc, allocator.free, allocator.complete_free
    for event in traces[device]:
        action = event["action"]
        if action == "alloc":
            addr = event["addr"]
            if addr in live:
                raise MemplanError(f"alloc at {addr:#x}, which is already allocated", source=source)
            live[addr] = block = malloc(event["size"], event["stream"])
            placements.append((block.addr, block.segment, addr))
        elif action == "free_requested":
            block = live.pop(event["addr"], None)
            if block is not None:
                free(block, pending_streams=(_OTHER_STREAM,))
                freeing[event["addr"]] = block
        elif action == "free_completed":
            block = freeing.pop(event["addr"], None)
            if block is not None:
                complete(block)
    trace_reserved, trace_allocated, trace_segments, trace_by_stream = _trace_figures(traces[device], config)
    stats = allocator.stats()
    return ReplayResult(
        device=device,
        expandable_segments=config.expandable_segments,
        allocs=len(placements),
        placed_as_traced=_placed_as_traced(allocator.history or [], traces[device], placements),
        max_reserved=stats.max_reserved,
        max_allocated=stats.max_allocated,
        segment_events=stats.segment_events,
        reserved_by_stream=dict(stats.reserved_by_stream),
        trace_max_reserved=trace_reserved,
        trace_max_allocated=trace_allocated,
        trace_segment_events=trace_segments,
        trace_reserved_by_stream=trace_by_stream,
    )
