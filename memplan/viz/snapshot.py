"""A predicted run in the form ``torch.cuda.memory._dump_snapshot`` writes, so that PyTorch's own
tools (the memory_viz page, ``python -m torch.cuda._memory_viz``) open a prediction as they open
a measurement (format: ../shared/reference/allocator-and-snapshot.md).

``device_traces[0]`` holds, in order, the allocator model's ``segment_alloc`` / ``segment_free``
(or ``segment_map`` / ``segment_unmap``) events and every ``alloc``, ``free_requested`` and
``free_completed`` at the model's addresses, each with frames that name the phase, the layer and
tensor (the timeline's label) and the category, and the category itself. ``segments`` is the
allocator's state at the end of the run (what the page replays backwards from).
"""

from __future__ import annotations

import pickle
from pathlib import Path

from memplan.viz.track import SEGMENT_GROW, Track

PROTOCOL = 4  # the memory_viz page's unpickler reads protocols 2-4
FILENAME = "memplan/predicted"


def _frames(track: Track, i: int, cache: dict | None = None) -> list[dict]:
    """The event's frames: its tensor (file: its category, function: its layer and tensor), then
    its phase. Equal frames are one object, which pickle writes once."""
    phase = track.phase[i] if i < len(track.phase) else ""
    key = (track.category[i], track.label[i], phase)
    if cache is not None and key in cache:
        return cache[key]
    frames = [
        {"filename": f"{FILENAME}/{track.category[i]}", "line": 0, "name": track.label[i]},
        {"filename": FILENAME, "line": 0, "name": phase or "run"},
    ]
    if cache is not None:
        cache[key] = frames
    return frames


def _segments_at_end(track: Track) -> list[dict]:
    """Segments held at the end: each cudaMalloc'd one (or each mapped run of an expandable
    segment's pages), cut into the blocks live there and inactive gaps."""
    held: dict[int, tuple[int, int]] = {}  # address -> (size, stream), per mapped or malloc'd range
    for _, action, addr, size, stream in track.segment_events:
        if SEGMENT_GROW[action] > 0:
            held[addr] = (size, stream)
        else:
            held.pop(addr, None)
    ranges = sorted((addr, size, stream) for addr, (size, stream) in held.items())
    if track.expandable:  # adjacent mapped pages of one stream are one segment
        merged: list[tuple[int, int, int]] = []
        for addr, size, stream in ranges:
            if merged and merged[-1][0] + merged[-1][1] == addr and merged[-1][2] == stream:
                merged[-1] = (merged[-1][0], merged[-1][1] + size, stream)
            else:
                merged.append((addr, size, stream))
        ranges = merged
    live = sorted((track.addr[i], i) for i in track.live_at(len(track) - 1))
    out, k = [], 0
    for addr, size, stream in ranges:
        blocks, at = [], addr
        while k < len(live) and live[k][0] < addr + size:
            b_addr, i = live[k]
            if b_addr > at:
                blocks.append(_block(at, b_addr - at, 0, "inactive", []))
            blocks.append(_block(b_addr, track.size[i], track.requested[i], "active_allocated", _frames(track, i)))
            at = b_addr + track.size[i]
            k += 1
        if at < addr + size:
            blocks.append(_block(at, addr + size - at, 0, "inactive", []))
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        out.append({
            "device": 0, "address": addr, "total_size": size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": sum(b["requested_size"] for b in blocks),
            "stream": stream, "segment_type": "small" if size <= 2**21 and not track.expandable else "large",
            "is_expandable": track.expandable, "frames": [], "blocks": blocks,
        })  # fmt: skip
    return out


def _block(addr: int, size: int, requested: int, state: str, frames: list[dict]) -> dict:
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": frames}


def to_snapshot(track: Track) -> dict:
    """The snapshot dict of ``track`` (plain types only)."""
    events: list[dict] = []
    add = events.append
    cache: dict = {}
    pending = {at: [] for at, *_ in track.segment_events}
    for at, action, addr, size, stream in track.segment_events:
        pending[at].append({"action": action, "addr": addr, "size": size, "stream": stream, "frames": []})
    for i, (op, addr, requested, stream, cat) in enumerate(
        zip(track.op, track.addr, track.requested, track.stream, track.category, strict=True)
    ):
        if i in pending:
            events.extend(pending.pop(i))
        # a trace records requests, as PyTorch's does; the blocks' sizes are in ``segments``
        frames = _frames(track, i, cache)
        if op > 0:
            add(
                {
                    "action": "alloc",
                    "addr": addr,
                    "size": requested,
                    "stream": stream,
                    "frames": frames,
                    "category": cat,
                }
            )
        else:
            for action in ("free_requested", "free_completed"):
                add({"action": action, "addr": addr, "size": requested, "stream": stream, "frames": frames,
                     "category": cat})  # fmt: skip
    for rest in pending.values():
        events.extend(rest)
    if events:  # the page's annotation code needs the category "unknown" among those it sees
        events[0]["category"] = "unknown"
    return {
        "segments": _segments_at_end(track),
        "device_traces": [events],
        "allocator_settings": {"expandable_segments": track.expandable},
    }


def write_snapshot(track: Track, path: Path) -> None:
    with path.open("wb") as f:
        pickle.dump(to_snapshot(track), f, protocol=PROTOCOL)
