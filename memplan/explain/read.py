"""A snapshot's device trace as a :class:`Track`.

The trace records requests; ``torch.cuda.max_memory_allocated`` counts blocks (a request
rounded to 512 B, or a whole cached block the allocator would not split). The block of each
request comes from replaying the trace through memplan's allocator model, configured from
the snapshot's ``allocator_settings`` (the model follows the six H100 traces allocation for
allocation: ``tests/unit/test_trace_replay.py``); where the model cannot follow a trace,
requests rounded to 512 B stand in. Reserved bytes are the trace's own segment events, and
the categories come from each event's ``category`` or frames when it has them.
"""

from __future__ import annotations

from memplan.costmodel.allocator import AllocatorConfig, CachingAllocator
from memplan.costmodel.allocator.sizing import round_size
from memplan.errors import MemplanError
from memplan.viz.track import SEGMENT_GROW, Track

UNKNOWN = "unknown"
ACTIONS = {"alloc", "free_requested", "free_completed", "oom", "snapshot", *SEGMENT_GROW}
_OTHER_STREAM = -1  # a record_stream'd block waits on streams the trace does not name
FRAME_CATEGORY_PREFIX = "memplan/predicted/"  # frames memplan's own snapshots write (viz.snapshot)
# where a frame points when PyTorch code allocates: a substring of its file or function -> category
FRAME_RULES = (
    ("torch/optim/", "optimizer_states"),
    ("cross_entropy", "logits_and_loss"),
    ("log_softmax", "logits_and_loss"),
    ("all_gather", "comm_buffers"),
    ("reduce_scatter", "comm_buffers"),
    ("all_reduce", "comm_buffers"),
    ("AccumulateGrad", "gradients"),
    ("to_empty", "parameters"),
    ("reset_parameters", "parameters"),
)


def check_events(snapshot: dict, device: int, source: str) -> list[dict]:
    """Device ``device``'s events, or one error for a snapshot of a form this reader does not know."""
    traces = snapshot["device_traces"]
    if not 0 <= device < len(traces):
        raise MemplanError(f"no trace for device {device}: the snapshot has {len(traces)}", source=source)
    events = traces[device]
    for n, e in enumerate(events):
        # an "oom" event carries the request and ``device_free``, no address (CUDACachingAllocator.cpp,
        # TraceEntry::OOM: the out-of-memory trace of h200_c_sel8b_s8k_m2 in tests/data/gpu-traces)
        needed = {"action", "size"} if isinstance(e, dict) and e.get("action") == "oom" else {"action", "addr", "size"}
        if not isinstance(e, dict) or not needed <= e.keys():
            raise MemplanError(f"event {n} has no action, addr or size: an unknown snapshot format version",
                               source=source)  # fmt: skip
        if e["action"] not in ACTIONS:
            raise MemplanError(f"event {n} has action {e['action']!r}: an unknown snapshot format version",
                               source=source)  # fmt: skip
    if not any(e["action"] == "alloc" for e in events):
        what = "no events" if not events else "no allocations"
        others = [i for i, t in enumerate(traces) if i != device and any(e.get("action") == "alloc" for e in t)]
        hint = (
            f" (allocations are on device {', '.join(map(str, others))}: give --trace-device)"
            if others
            else ": record with torch.cuda.memory._record_memory_history() before the run"
        )
        raise MemplanError(f"device {device}'s trace has {what}{hint}", source=source)
    return events


def frame_category(event: dict) -> str | None:
    """The category an event names itself (``category``) or its frames point to, if any."""
    category = event.get("category")
    if category and category != UNKNOWN:
        return str(category)
    for frame in event.get("frames") or ():
        filename, name = str(frame.get("filename", "")), str(frame.get("name", ""))
        if filename.startswith(FRAME_CATEGORY_PREFIX):
            return filename.removeprefix(FRAME_CATEGORY_PREFIX)
        for needle, cat in FRAME_RULES:
            if needle in filename or needle in name:
                return cat
    return None


def _label(event: dict) -> str:
    frames = event.get("frames") or ()
    if frames and frames[0].get("name"):
        return str(frames[0]["name"])
    return f"stream {event['stream']} (no frames)"


def reserved_before(snapshot: dict, events: list[dict], device: int) -> int:
    """Segments held before the trace began: those held at the snapshot less what the trace grew."""
    held = sum(s.get("total_size", 0) for s in snapshot["segments"] if s.get("device", device) == device)
    grown = sum(SEGMENT_GROW[e["action"]] * e["size"] for e in events if e["action"] in SEGMENT_GROW)
    return max(held - grown, 0)


def read_trace(snapshot: dict, device: int = 0, source: str = "snapshot") -> Track:
    """The measured run: allocations (block sizes), frees, reserved after each, categories
    named by the events themselves (``unknown`` otherwise, for :mod:`attribute` to fill in)."""
    events = check_events(snapshot, device, source)
    settings = snapshot.get("allocator_settings") or {}
    config = AllocatorConfig.from_snapshot_settings(settings, source=source) if settings else AllocatorConfig()
    model: CachingAllocator | None = CachingAllocator(config)
    track = Track(expandable=config.expandable_segments)
    live: dict[int, tuple[int, object]] = {}  # addr -> (track index, model block)
    freeing: dict[int, object] = {}
    for e in events:
        action = e["action"]
        if action in SEGMENT_GROW:
            track.segment_events.append((len(track), action, e["addr"], e["size"], e["stream"]))
            continue
        if action == "oom":  # the request the device could not serve (the run raised OutOfMemoryError)
            track.ooms.append((len(track), e["size"], int(e.get("device_free") or 0)))
            continue
        if action == "alloc":
            block, model = _malloc(model, e, config)
            size = block.size if block is not None else round_size(e["size"], config)
            live[e["addr"]] = (len(track), block)
            track.append(1, len(track), size, e["size"], frame_category(e) or UNKNOWN, _label(e), e["stream"],
                         e["addr"], 0)  # fmt: skip
        elif action == "free_requested" and e["addr"] in live:
            index, block = live.pop(e["addr"])
            if model is not None and block is not None:
                model.free(block, pending_streams=(_OTHER_STREAM,))
                freeing[e["addr"]] = block
            track.append(-1, index, track.size[index], track.requested[index], track.category[index],
                         track.label[index], track.stream[index], e["addr"], 0)  # fmt: skip
        elif action == "free_completed":
            block = freeing.pop(e["addr"], None)
            if model is not None and block is not None:
                model.complete_free(block)
    _settle_reserved(track, reserved_before(snapshot, events, device))
    return track


def _malloc(model: CachingAllocator | None, event: dict, config: AllocatorConfig):
    """The model's block for a traced request; on the first request it cannot serve the model is
    dropped (returned None) and requests rounded to 512 B stand in for the rest."""
    if model is None:
        return None, None
    try:
        return model.malloc(event["size"], event["stream"]), model
    except Exception:  # a trace the model cannot follow (another allocator version, a capacity it hit)
        return None, None


def _settle_reserved(track: Track, base: int) -> None:
    """Reserved after each event from the segment events: a segment grown for an allocation is
    traced just before it, so each event's reserved counts every segment event before the next one."""
    reserved, k = base, 0
    segs = track.segment_events
    for i in range(len(track)):
        while k < len(segs) and segs[k][0] <= i:
            reserved += SEGMENT_GROW[segs[k][1]] * segs[k][3]
            k += 1
        track.reserved[i] = reserved


def stream_memory(track: Track, index: int) -> dict[int, tuple[int, int]]:
    """Per stream, (reserved, allocated) just after event ``index``."""
    reserved: dict[int, int] = {}
    for at, action, _addr, size, stream in track.segment_events:
        if at > index:
            break
        reserved[stream] = reserved.get(stream, 0) + SEGMENT_GROW[action] * size
    allocated: dict[int, int] = {}
    for i in range(index + 1):
        s = track.stream[i]
        allocated[s] = allocated.get(s, 0) + track.op[i] * track.size[i]
    streams = sorted(set(reserved) | set(allocated))
    return {s: (reserved.get(s, 0), allocated.get(s, 0)) for s in streams}


def max_reserved(track: Track, base: int = 0) -> int:
    """The highest reserved total over the trace's segment events (``max_memory_reserved``)."""
    reserved = best = base
    for _, action, _addr, size, _stream in track.segment_events:
        reserved += SEGMENT_GROW[action] * size
        best = max(best, reserved)
    return best
