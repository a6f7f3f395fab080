"""``memplan explain`` on the six H100 traces (tests/data/gpu-traces/README.md: plans and measured
figures), on snapshots that are not ones, and on a large one.

The comparisons with ``--runtime memplan`` hold the traces against the op-level run that was
transcribed from them (``costmodel/timeline/trainer.py``, ``fsdp.py``, ``tensor_parallel.py``):
they are regression tests of that transcription, not held-out predictions (those are the H200
runs of tests/data/gpu-traces/h200.json, tests/unit/test_capacity_margin.py)."""

from __future__ import annotations

import gzip
import json
import pickle
import time
from pathlib import Path

import pytest

from memplan.cli.app import run
from memplan.explain.report import explain

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
LLAMA1B = str(TRACES / "llama1b.config.json")
# name: (model and plan flags of the run, measured max_memory_allocated, max_memory_reserved)
RUNS = {
    "t1b_none": ([LLAMA1B, "--dp", "1", "--precision", "bf16-mixed", "--seq-len", "4096", "--micro-batch", "2",
                  "--global-batch", "2"], 47_075_763_200, 47_752_151_040),
    "t1b_full_x": ([LLAMA1B, "--dp", "1", "--precision", "bf16-mixed", "--recompute", "full", "--seq-len", "8192",
                    "--micro-batch", "4", "--global-batch", "4"], 70_825_436_160, 81_499_521_024),
    "t8_z3_bf16": (["llama3-8b", "--dp", "8", "--zero", "3", "--precision", "bf16", "--recompute", "full",
                    "--seq-len", "4096", "--micro-batch", "2", "--global-batch", "16"], 22_169_104_384, 31_224_496_128),
    "t8_tp2_x": (["llama3-8b", "--dp", "4", "--tp", "2", "--sequence-parallel", "--zero", "3", "--precision",
                  "bf16-mixed", "--recompute", "full", "--seq-len", "8192", "--micro-batch", "1",
                  "--global-batch", "4"], 22_289_758_208, 28_775_022_592),
    "t70_z3": (["llama3-70b", "--dp", "64", "--zero", "3", "--precision", "bf16-mixed", "--recompute", "full",
                "--seq-len", "4096", "--micro-batch", "1", "--global-batch", "64"], 29_060_026_368, 41_334_865_920),
    "t8_sel": (["llama3-8b", "--dp", "8", "--zero", "3", "--precision", "bf16-mixed", "--recompute", "selective",
                "--seq-len", "4096", "--micro-batch", "1", "--global-batch", "8"], 45_911_342_080, 57_688_457_216),
}  # fmt: skip


def _explain(capsys, *args: str) -> dict:
    code = run(["explain", *args, "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name", RUNS)
def test_measured_peaks_are_the_runs_and_categories_sum_to_them(capsys, name):
    """The measured side is the trace's; the comparison with the estimate is against the op-level
    run written from this very trace (module docstring): a regression bound, not a prediction."""
    plan, allocated, reserved = RUNS[name]
    d = _explain(capsys, str(TRACES / f"{name}.pkl.gz"), *plan, "--runtime", "memplan")
    assert d["peak_allocated"] == allocated and d["peak_reserved"] == reserved
    assert sum(d["categories"].values()) == allocated
    assert "unknown" not in d["categories"]  # every allocation matched the predicted run
    assert d["attribution"] == "prediction" and d["peak_phase"] == "backward"
    c = d["comparison"]
    assert abs(c["allocated_error_pct"]) <= 2 and abs(c["reserved_error_pct"]) <= 5
    rows = {r["category"]: r for r in c["categories"]}
    assert sum(r["measured"] for r in rows.values()) == allocated
    assert sum(r["predicted"] for r in rows.values()) == c["predicted_allocated"]
    streams = {s["stream"]: s for s in d["streams_at_peak"]}
    assert sum(s["reserved"] for s in streams.values()) <= reserved
    assert all(s["cached_free"] == s["reserved"] - s["allocated"] for s in streams.values())
    if "z3" in name or "sel" in name or "tp2" in name:  # FSDP2's collectives hold segments of their own
        assert {s["name"] for s in streams.values()} == {"default", "all_gather", "reduce_scatter"}


def test_fragmentation_at_exit_on_the_collectives_streams(capsys):
    """The README's figures: at exit, the FSDP2 collectives' streams hold 4.3 GiB (t8_z3_bf16) and
    6.3 GiB (t8_sel), none of it allocated."""
    for name, gib in (("t8_z3_bf16", 4.3), ("t8_sel", 6.3)):
        d = _explain(capsys, str(TRACES / f"{name}.pkl.gz"))
        other = [s for s in d["streams_at_end"] if s["stream"] != 0]
        assert round(sum(s["cached_free"] for s in other) / 2**30, 1) == gib
        assert sum(s["allocated"] for s in other) == 0


def test_without_a_model_the_peaks_are_read_and_nothing_is_attributed(capsys):
    d = _explain(capsys, str(TRACES / "t1b_none.pkl.gz"))
    assert d["peak_allocated"] == 47_075_763_200 and d["comparison"] is None
    assert d["attribution"] == "none" and set(d["categories"]) <= {"unknown", "allocator_rounding"}
    assert sum(d["categories"].values()) == d["peak_allocated"]


def test_the_largest_differences_are_named(capsys):
    """t8_sel ran selective recomputation; against the estimate of full recomputation the
    activations differ most, and the table says so."""
    plan, *_ = RUNS["t8_sel"]
    plan = [("full" if a == "selective" else a) for a in plan]
    d = _explain(capsys, str(TRACES / "t8_sel.pkl.gz"), *plan, "--runtime", "memplan")
    c = d["comparison"]
    assert c["largest_differences"][0].startswith("activations: +")
    assert c["categories"][0]["category"] == "activations" and c["categories"][0]["difference"] > 10 * 2**30
    code = run(["explain", str(TRACES / "t8_sel.pkl.gz"), *plan, "--runtime", "memplan"])
    out = capsys.readouterr().out
    assert code == 0 and "largest differences: activations" in " ".join(out.split())


def test_table_and_timeline(capsys, tmp_path):
    plan, *_ = RUNS["t1b_none"]
    path = tmp_path / "t1b.html"
    code = run(["explain", str(TRACES / "t1b_none.pkl.gz"), *plan, "--runtime", "memplan", "--timeline", str(path)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "peak allocated" in out and "Reserved but free, per stream" in out and "43.84 GiB" in out
    page = path.read_text()
    assert page.count('<svg id="chart') == 2  # measured and predicted, one under the other
    assert "measured: " in page and "predicted: " in page


def test_plan_flags_need_a_model(capsys):
    assert run(["explain", str(TRACES / "t1b_none.pkl.gz"), "--dp", "2"]) == 2
    assert "give the model" in capsys.readouterr().err


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _snapshot(events: list[dict]) -> dict:
    return {"segments": [], "device_traces": [events], "allocator_settings": {}}


@pytest.mark.parametrize(
    ("name", "make", "reason"),
    [
        ("text.pickle", lambda: b"not a snapshot at all\n", "not a memory snapshot"),
        ("truncated.pkl.gz", lambda: gzip.compress(pickle.dumps(_snapshot([]), protocol=4))[:40], "gzip"),
        ("truncated.pickle", lambda: pickle.dumps(_snapshot([{"action": "alloc", "addr": 1, "size": 512,
                                                              "stream": 0}]), protocol=4)[:-9], "pickle"),
        ("old.pickle", lambda: pickle.dumps([{"address": 0, "total_size": 2**21, "blocks": []}]), "list"),
        ("future.pickle", lambda: pickle.dumps(_snapshot([{"action": "alloc_v9", "addr": 1, "size": 512,
                                                           "stream": 0}])), "unknown snapshot format version"),
        ("fields.pickle", lambda: pickle.dumps(_snapshot([{"kind": "alloc"}])), "unknown snapshot format version"),
        ("empty.pickle", lambda: pickle.dumps(_snapshot([])), "_record_memory_history"),
        ("empty.bin", lambda: b"", "empty"),
    ],
    ids=["not-a-pickle", "truncated-gzip", "truncated-pickle", "segments-only", "unknown-action", "no-fields",
         "no-events", "empty-file"],
)  # fmt: skip
def test_bad_snapshots_are_one_line_and_exit_2(capsys, tmp_path, name, make, reason):
    path = _write(tmp_path, name, make())
    assert run(["explain", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"memplan: error: {path}: ")
    assert reason in err, err


def test_a_50000_event_snapshot_is_read_within_5_s(tmp_path):
    events: list[dict] = [{"action": "segment_alloc", "addr": 0, "size": 2**30, "stream": 0}]
    live: list[int] = []
    for i in range(16_500):  # allocations and frees in a sliding window: about 16,500 x 3 events
        events.append({"action": "alloc", "addr": (i % 1024) * 2**20, "size": 2**20 - 512 * (i % 7), "stream": 0})
        live.append(events[-1]["addr"])
        if len(live) > 512:
            addr = live.pop(0)
            events.append({"action": "free_requested", "addr": addr, "size": 0, "stream": 0})
            events.append({"action": "free_completed", "addr": addr, "size": 0, "stream": 0})
    events += [{"action": "segment_alloc", "addr": 2**40 + i * 2**21, "size": 2**21, "stream": 0} for i in range(2000)]
    assert len(events) >= 50_000
    path = _write(tmp_path, "big.pkl.gz", gzip.compress(pickle.dumps(_snapshot(events), protocol=4)))
    start = time.perf_counter()
    result = explain(path).result
    elapsed = time.perf_counter() - start
    assert result.allocations == 16_500 and result.peak_reserved == 2**30 + 2000 * 2**21
    assert elapsed < 5.0, f"explain read {len(events)} events in {elapsed:.2f} s"


@pytest.mark.parametrize(
    ("event", "category"),
    [
        ({"category": "activations"}, "activations"),
        ({"frames": [{"filename": "memplan/predicted/gradients", "line": 0, "name": "layers.0.wq.weight"}]},
         "gradients"),
        ({"frames": [{"filename": "/usr/lib/python3/torch/optim/adam.py", "line": 512, "name": "_multi_tensor_adam"}]},
         "optimizer_states"),
        ({"frames": [{"filename": "torch/nn/functional.py", "line": 3400, "name": "cross_entropy"}]},
         "logits_and_loss"),
        ({"frames": [{"filename": "fsdp/_fsdp_collectives.py", "line": 80, "name": "foreach_all_gather"}]},
         "comm_buffers"),
        ({"frames": [{"filename": "train.py", "line": 10, "name": "forward"}]}, None),
        ({"category": "unknown", "frames": []}, None),
    ],
)  # fmt: skip
def test_categories_from_an_events_own_category_or_frames(event, category):
    from memplan.explain.read import frame_category

    assert frame_category(event) == category


def test_a_device_without_allocations_names_the_ones_with(capsys, tmp_path):
    alloc = {"action": "alloc", "addr": 0, "size": 512, "stream": 0}
    path = _write(tmp_path, "two.pickle", pickle.dumps({"segments": [], "device_traces": [[], [alloc]]}, protocol=4))
    assert run(["explain", str(path)]) == 2
    assert "allocations are on device 1: give --trace-device" in capsys.readouterr().err
    assert _explain(capsys, str(path), "--trace-device", "1")["peak_allocated"] == 512


def test_an_out_of_memory_event_is_reported(capsys, tmp_path):
    """A snapshot dumped after an OutOfMemoryError ends with the ``oom`` event: the request, and the
    allocator's state then (reserved but free is the fragmentation the run could not use)."""
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 40 * 2**20, "stream": 0},
        {"action": "alloc", "addr": 0, "size": 20 * 2**20, "stream": 0},
        {"action": "alloc", "addr": 30 * 2**20, "size": 10 * 2**20, "stream": 0},
        {"action": "oom", "addr": 0, "size": 64 * 2**20, "stream": 0, "device_free": 2**20},
    ]
    path = _write(tmp_path, "oom.pickle", pickle.dumps(_snapshot(events), protocol=4))
    oom = _explain(capsys, str(path))["oom"]
    assert oom == {"event": 2, "requested": 64 * 2**20, "device_free": 2**20, "allocated": 30 * 2**20,
                   "reserved": 40 * 2**20}  # fmt: skip
    assert run(["explain", str(path)]) == 0
    assert "out of memory after event 2: 0.06 GiB requested" in " ".join(capsys.readouterr().out.split())
