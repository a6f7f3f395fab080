"""``memplan explain`` of every trace in tests/data/gpu-traces with its plan: the measured
allocations matched to the predicted run, category by category (issue 27, "What it must show").

The bounds are the issue's: at least 90% of the allocations matched to the predicted run in
order and size, allocated within 0.5% and reserved within 1% of the measured peaks, and each
category within 2% of its measured bytes at the peak (a category under 1% of the peak: within
2% of 1% of the peak, so that a few KiB of rounding are not a miss). The six H100 traces are
what the op-level run was transcribed from (a regression of that transcription); the ten H200
ones were not used to build it. Every trace's plan is answered by the op-level run (h200_b_pp4
re-recorded on 2026-11-28 with the current StageReplay).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from memplan.cli.app import run

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
LLAMA1B = str(TRACES / "llama1b.config.json")


def _plans() -> dict[str, list[str]]:
    h100 = {
        "t1b_none": [LLAMA1B, "--dp", "1", "--precision", "bf16-mixed", "--seq-len", "4096", "--micro-batch", "2",
                     "--global-batch", "2", "--allocator", "default"],
        "t1b_full_x": [LLAMA1B, "--dp", "1", "--precision", "bf16-mixed", "--recompute", "full", "--seq-len", "8192",
                       "--micro-batch", "4", "--global-batch", "4", "--allocator", "expandable"],
        "t8_z3_bf16": ["llama3-8b", "--dp", "8", "--zero", "3", "--precision", "bf16", "--recompute", "full",
                       "--seq-len", "4096", "--micro-batch", "2", "--global-batch", "16", "--allocator", "default"],
        "t8_tp2_x": ["llama3-8b", "--dp", "4", "--tp", "2", "--sequence-parallel", "--zero", "3", "--precision",
                     "bf16-mixed", "--recompute", "full", "--seq-len", "8192", "--micro-batch", "1",
                     "--global-batch", "4", "--allocator", "expandable"],
        "t70_z3": ["llama3-70b", "--dp", "64", "--zero", "3", "--precision", "bf16-mixed", "--recompute", "full",
                   "--seq-len", "4096", "--micro-batch", "1", "--global-batch", "64", "--allocator", "default"],
        "t8_sel": ["llama3-8b", "--dp", "8", "--zero", "3", "--precision", "bf16-mixed", "--recompute", "selective",
                   "--seq-len", "4096", "--micro-batch", "1", "--global-batch", "8", "--allocator", "default"],
    }  # fmt: skip
    h200 = json.loads((TRACES / "h200.json").read_text())["runs"]
    for name, r in h200.items():
        h100[name] = [str(TRACES / a) if a.endswith(".json") else a for a in r["args"]] + ["--gpu", "h200"]
    return h100


PLANS = _plans()
OOM = "h200_c_sel8b_s8k_m2"


def explain(capsys, name: str) -> dict:
    code = run(["explain", str(TRACES / f"{name}.pkl.gz"), *PLANS[name], "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def matched(d: dict) -> float:
    found = re.match(r"(\d+) of (\d+) allocations matched the predicted run in order and size", d["attribution_note"])
    assert found, d["attribution_note"]
    return int(found[1]) / int(found[2])


def _cases():
    for name in PLANS:
        if name == OOM:
            continue
        yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", list(_cases()))
def test_explain_matches_the_trace_to_the_predicted_run(capsys, name):
    d = explain(capsys, name)
    c = d["comparison"]
    assert c["run"] == "trainer", c["run"]
    assert matched(d) >= 0.90, d["attribution_note"]
    assert abs(c["allocated_error_pct"]) <= 0.5, c["allocated_error_pct"]
    assert abs(c["reserved_error_pct"]) <= 1.0, c["reserved_error_pct"]
    floor = 0.01 * d["peak_allocated"]
    for row in c["categories"]:
        assert abs(row["difference"]) <= 0.02 * max(row["measured"], floor), row


def test_the_out_of_memory_trace_fails_where_the_prediction_fails(capsys):
    """h200_c ran out of memory in its warm-up step's forward: the snapshot's out-of-memory event
    asks for what the estimate names as the request that cannot be served, and the allocations
    before it match the predicted run in order and size."""
    d = explain(capsys, OOM)
    assert d["comparison"]["run"] == "trainer" and matched(d) >= 0.90, d["attribution_note"]
    assert run(["estimate", *PLANS[OOM], "--format", "json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert not estimate["fits"]
    requested = d["oom"]["requested"]  # rounded up to the allocator's block size
    failed = estimate["memory"]["peak"]["reserved_detail"]["failed_request"]
    assert failed <= requested < failed + 2 * 2**20, (failed, requested)
