"""Replaying the CUDA caching allocator's own traces (tests/data/gpu-traces, H100 80GB HBM3,
torch 2.11.0+cu130) through the model, and reading snapshots that are not."""

from __future__ import annotations

import gzip
import pickle
import time
from pathlib import Path

import pytest

from memplan.costmodel.allocator import load_snapshot, replay_trace
from memplan.errors import MemplanError

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"

# (trace, expandable segments, measured max_memory_reserved, segment events in the trace):
# tests/data/gpu-traces/README.md
MEASURED = [
    ("t1b_none", False, 47_752_151_040, 395),
    ("t1b_full_x", True, 81_499_521_024, 110),
    ("t8_z3_bf16", False, 31_224_496_128, 297),
    ("t8_tp2_x", True, 28_775_022_592, 224),
    ("t70_z3", False, 41_334_865_920, 557),
    ("t8_sel", False, 57_688_457_216, 556),
]
RESERVED_TOLERANCE = 0.01  # the bar: max reserved within 1% of the measured value
SEGMENT_TOLERANCE = 0.05  # and segment counts within 5%


@pytest.fixture(scope="module")
def snapshots() -> dict[str, dict]:
    return {name: load_snapshot(TRACES / f"{name}.pkl.gz") for name, *_ in MEASURED}


@pytest.mark.parametrize("trace_addresses", [True, False], ids=["trace-addresses", "made-up-addresses"])
@pytest.mark.parametrize(
    ("name", "expandable", "measured_reserved", "segments"), MEASURED, ids=[m[0] for m in MEASURED]
)
def test_replay_reaches_the_bar(snapshots, name, expandable, measured_reserved, segments, trace_addresses):
    result = replay_trace(snapshots[name], trace_addresses=trace_addresses)
    assert result.expandable_segments is expandable
    assert result.trace_max_reserved == measured_reserved  # the trace's segment events add up to the measurement
    assert result.trace_segment_events == segments
    assert abs(result.max_reserved / measured_reserved - 1) <= RESERVED_TOLERANCE
    assert abs(result.segment_events / segments - 1) <= SEGMENT_TOLERANCE


@pytest.mark.parametrize(
    ("name", "expandable", "measured_reserved", "segments"), MEASURED, ids=[m[0] for m in MEASURED]
)
def test_replay_places_every_block_where_the_device_did(snapshots, name, expandable, measured_reserved, segments):
    """Given cudaMalloc's addresses, every allocation lands at the traced offset of the traced segment."""
    result = replay_trace(snapshots[name])
    assert result.placed_as_traced == result.allocs
    assert (result.max_reserved, result.segment_events) == (measured_reserved, segments)
    assert result.reserved_by_stream == result.trace_reserved_by_stream


def test_replay_of_the_largest_trace_is_fast(snapshots):
    start = time.perf_counter()
    result = replay_trace(snapshots["t70_z3"])
    elapsed = time.perf_counter() - start
    assert result.allocs == 47_325
    assert elapsed < 5.0, f"replaying {result.allocs} allocations took {elapsed:.2f} s"


def test_replay_rejects_a_missing_device(snapshots):
    with pytest.raises(MemplanError, match="no trace for device 1"):
        replay_trace(snapshots["t1b_none"], device=1, source="t1b_none")


# --- files that are not snapshots --------------------------------------------------------------


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


class _Payload:
    """A class a pickle names: snapshots never do."""


# mtime=0: the gzip header, part of the test id, is the same in every pytest-xdist worker
@pytest.mark.parametrize(
    ("name", "data", "reason"),
    [
        ("notes.txt", b"memplan is not a snapshot\n", "not a memory snapshot"),
        ("empty.pkl", b"", "empty file"),
        ("garbage.pkl.gz", gzip.compress(b"\x00\x01garbage that is not a pickle", mtime=0), "not a memory snapshot"),
        ("truncated.pkl.gz", gzip.compress(pickle.dumps({"segments": []}), mtime=0)[:20], "does not decompress"),
        ("list.pkl", pickle.dumps([1, 2, 3], protocol=4), "a pickle of list"),
        ("keys.pkl", pickle.dumps({"segments": []}, protocol=4), "'device_traces'"),
        ("traces.pkl", pickle.dumps({"segments": [], "device_traces": {}}, protocol=4), "list of per-device"),
        ("object.pkl", pickle.dumps(_Payload(), protocol=4), "refuses to load"),
    ],
)
def test_load_snapshot_rejects(tmp_path, name, data, reason):
    path = _write(tmp_path / name, data)
    with pytest.raises(MemplanError, match=reason) as caught:
        load_snapshot(path)
    assert caught.value.source == str(path)


def test_load_snapshot_of_a_missing_file(tmp_path):
    path = tmp_path / "absent.pkl.gz"
    with pytest.raises(MemplanError, match="no such file") as caught:
        load_snapshot(path)
    assert caught.value.source == str(path)


def test_load_snapshot_reads_plain_and_gzipped_pickles(tmp_path):
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 4096, "size": 100, "stream": 0}]]}
    plain = _write(tmp_path / "s.pickle", pickle.dumps(snapshot, protocol=4))
    zipped = _write(tmp_path / "s.pickle.gz", gzip.compress(pickle.dumps(snapshot, protocol=4)))
    assert load_snapshot(plain) == load_snapshot(zipped) == snapshot
    result = replay_trace(load_snapshot(plain))
    assert (result.allocs, result.max_allocated, result.max_reserved) == (1, 512, 2 * 2**20)
