"""The predicted run as a PyTorch memory snapshot: read by torch's own tools, consistent with
itself, and read back by ``memplan explain`` (categories from its frames)."""

from __future__ import annotations

import pickle

import pytest

from memplan.costmodel.allocator.trace import replay_trace
from memplan.explain.report import explain
from memplan.specs.resolve import resolve_job
from memplan.viz.predicted import predicted_track
from memplan.viz.snapshot import to_snapshot, write_snapshot

PLANS = {
    "fsdp2": ("llama3-8b", dict(dp=8, zero=3, precision="bf16-mixed", seq_len=2048, micro_batch=1), False),
    "expandable": ("llama3-8b", dict(dp=1, precision="bf16-mixed", seq_len=1024, allocator="expandable"), False),
    "pipeline": ("llama3-8b", dict(gpus=8, pp=4, dp=2, micro_batch=1, global_batch=16), False),
    "inference": ("llama3-8b", dict(batch=4, context=2048), True),
}


@pytest.fixture(scope="module", params=list(PLANS))
def written(request, tmp_path_factory):
    model, flags, inference = PLANS[request.param]
    job = resolve_job(model, None, flags, inference=inference)
    track, _ = predicted_track(job)
    path = tmp_path_factory.mktemp("snap") / f"{request.param}.pickle"
    write_snapshot(track, path)
    with path.open("rb") as f:
        return job, track, pickle.load(f), path


def test_torch_memory_viz_reads_it(written):
    """``python -m torch.cuda._memory_viz``'s functions, on the loaded dict, without CUDA."""
    mv = pytest.importorskip("torch.cuda._memory_viz")
    _, track, snapshot, _ = written
    stats = mv.segsum(snapshot)  # asserts that every segment's blocks add up
    assert f"segments: {len(snapshot['segments'])}" in stats
    text = mv.trace(snapshot)
    assert f"{len(snapshot['device_traces'][0])} entries" in text
    for page in (mv.trace_plot(snapshot), mv.segment_plot(snapshot)):
        assert "add_local_files" in page
    flame = mv.memory(snapshot, format_flamegraph=lambda lines: lines)
    live = track.live_at(len(track) - 1)
    assert not live or f"{track.category[live[0]]}:0:{track.label[live[0]]}" in flame  # file:line:name frames


def test_events_pair_up_and_name_layer_tensor_and_category(written):
    _, track, snapshot, _ = written
    events = snapshot["device_traces"][0]
    allocs = [e for e in events if e["action"] == "alloc"]
    assert len(allocs) == sum(1 for op in track.op if op > 0)
    requested = [e["addr"] for e in events if e["action"] == "free_requested"]
    completed = [e["addr"] for e in events if e["action"] == "free_completed"]
    assert requested == completed
    first = allocs[0]
    assert first["frames"][0]["name"] == track.label[0] and first["category"] in ("unknown", track.category[0])
    assert any(e.get("category") == "unknown" for e in events)  # the memory_viz page needs it among them
    assert all(isinstance(f["line"], int) for e in allocs for f in e["frames"])


def test_segments_at_the_end_hold_what_is_reserved_there(written):
    _, track, snapshot, _ = written
    assert sum(s["total_size"] for s in snapshot["segments"]) == track.reserved[-1]
    live = sum(track.size[i] for i in track.live_at(len(track) - 1))
    assert sum(s["allocated_size"] for s in snapshot["segments"]) == live


def test_memplans_trace_reader_replays_it_to_the_same_peaks(written):
    job, track, snapshot, _ = written
    result = replay_trace(snapshot)
    assert result.max_allocated == track.peak()[0]  # blocks, as the allocator model hands them out
    assert result.trace_max_reserved == max(track.reserved)
    assert result.placed_as_traced == result.allocs


def test_explain_reads_it_back_with_categories_from_its_frames(written):
    _, track, _, path = written
    result = explain(path).result
    peak, where = track.peak()
    assert result.peak_allocated == peak and result.peak_reserved == max(track.reserved)
    assert result.attribution == "frames"
    expected: dict[str, int] = {}
    for i in track.live_at(where):
        expected[track.category[i]] = expected.get(track.category[i], 0) + track.requested[i]
    assert {k: v for k, v in result.categories.items() if k != "allocator_rounding"} == expected
    assert sum(result.categories.values()) == peak


def test_an_empty_run_is_still_a_snapshot():
    from memplan.viz.track import Track

    snapshot = to_snapshot(Track())
    assert snapshot["segments"] == [] and snapshot["device_traces"] == [[]]


def _page_replay(snapshot: dict) -> None:
    """What the memory_viz page's "Allocator State History" does (torch/utils/viz/MemoryViz.js:
    ``annotate_snapshot`` gives each block the address its segment's earlier blocks leave, and
    ``simulate_memory`` replays the trace backwards from ``segments``): every segment event must
    find its segment, and every block drawn must lie inside one, at every step."""
    segments: list[list[int]] = []  # [addr, size, stream]
    blocks: dict[int, int] = {}  # addr -> size
    for seg in snapshot["segments"]:
        segments.append([seg["address"], seg["total_size"], seg["stream"]])
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                blocks[addr] = b["size"]
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]

    def inside(addr: int, size: int) -> bool:
        return any(s <= addr and addr + size <= s + n for s, n, _ in segments)

    assert all(inside(a, n) for a, n in blocks.items())
    for e in reversed(snapshot["device_traces"][0]):
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            blocks.pop(addr, None)
        elif action == "free_completed":
            blocks[addr] = size
            assert inside(addr, size), f"a block at {addr:#x} outside every segment"
        elif action in ("segment_alloc", "segment_map"):
            if action == "segment_alloc":
                match = [s for s in segments if s[0] == addr]
                assert match, f"no segment at {addr:#x}"
                segments.remove(match[0])
            else:  # unmap the pages from the segment holding them
                holder = next(s for s in segments if s[0] <= addr and addr + size <= s[0] + s[1])
                segments.remove(holder)
                if holder[0] < addr:
                    segments.append([holder[0], addr - holder[0], holder[2]])
                if addr + size < holder[0] + holder[1]:
                    segments.append([addr + size, holder[0] + holder[1] - addr - size, holder[2]])
            assert not any(addr <= a < addr + size for a in blocks), "a live block in a segment being removed"
        elif action in ("segment_free", "segment_unmap"):
            segments.append([addr, size, e["stream"]])
    assert segments == [] and blocks == {}


def test_the_memory_viz_pages_backward_replay_holds(written):
    _, _, snapshot, _ = written
    _page_replay(snapshot)


# the opcodes the memory_viz page's JavaScript unpickler handles (torch/utils/viz/MemoryViz.js, unpickle)
PAGE_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "EMPTY_DICT",
    "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE",
}  # fmt: skip


def test_the_pickle_uses_only_opcodes_the_memory_viz_page_reads(written):
    import pickletools

    *_, path = written
    used = {op.name for op, _, _ in pickletools.genops(path.read_bytes())}
    assert used <= PAGE_OPCODES, used - PAGE_OPCODES
