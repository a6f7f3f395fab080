"""``memplan estimate --timeline``: each format for an FSDP2 plan, a pipeline plan and an
inference estimate, through the command as a user runs it, and what the pictures hold."""

from __future__ import annotations

import io
import json
import pickle
import struct
import xml.etree.ElementTree as ET

import pytest

from memplan.cli.app import run
from memplan.specs.resolve import resolve_job
from memplan.viz.predicted import predicted_panel, predicted_track
from memplan.viz.snapshot import to_snapshot
from memplan.viz.style import COLORS

PLANS = {
    # FSDP2 (ZeRO-3 over 8 ranks): the bundled trainer's run, collectives on their own streams
    "fsdp2": [
        "llama3-8b",
        "--dp",
        "8",
        "--zero",
        "3",
        "--precision",
        "bf16-mixed",
        "--seq-len",
        "4096",
        "--micro-batch",
        "1",
    ],
    # 4 pipeline stages: the phase model's moments cut into tensors
    "pipeline": ["llama3-8b", "--gpus", "8", "--pp", "4", "--dp", "2", "--micro-batch", "1", "--global-batch", "16"],
    "inference": ["llama3-8b", "--inference", "--batch", "8", "--context", "4096"],
}
FORMATS = ("html", "svg", "png", "pickle")


def _estimate(capsys, args: list[str]) -> dict:
    code = run(["estimate", *args, "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def tracks():
    out = {}
    for name, args in PLANS.items():
        job = _job(args)
        out[name] = (job, *predicted_track(job))
    return out


def _job(args: list[str]):
    inference = "--inference" in args
    rest = [a for a in args[1:] if a != "--inference"]
    flags = {k.removeprefix("--").replace("-", "_"): v if k == "--precision" else int(v)
             for k, v in zip(rest[::2], rest[1::2], strict=True)}  # fmt: skip
    return resolve_job(args[0], None, flags, inference=inference)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("plan", PLANS)
def test_each_format_is_written(capsys, tmp_path, plan, kind):
    path = tmp_path / f"{plan}.{kind}"
    result = _estimate(capsys, [*PLANS[plan], "--timeline", str(path)])
    assert result["memory"]["peak"]["allocated"] > 0  # the estimate itself is still printed
    data = path.read_bytes()
    if kind == "html":
        page = data.decode()
        assert page.startswith("<!DOCTYPE html>") and 'id="peak-label0"' in page and "peak " in page
        assert "<script src" not in page and "http://" not in page.replace("http://www.w3.org", "")
        assert "https://" not in page  # opens with no network
    elif kind == "svg":
        root = ET.fromstring(data)
        assert root.tag.endswith("svg")
        texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
        assert any(t.startswith("peak ") for t in texts)  # the peak's tag and label, as text
        assert "cached but free" in texts and "reserved" in texts  # the legend
        assert any(t.startswith("predicted: ") for t in texts)  # the title
    elif kind == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 800 and height > 300
        from PIL import Image

        pixels = Image.open(io.BytesIO(data)).convert("RGB")
        colours = {rgb for _, rgb in pixels.getcolors(maxcolors=width * height)}
        # the stacks are drawn in the page's colours (the parameters at the bottom of each)
        wanted = COLORS["parameters"].lstrip("#")
        assert tuple(int(wanted[i : i + 2], 16) for i in (0, 2, 4)) in colours
    else:
        snapshot = pickle.loads(data)
        assert set(snapshot) >= {"segments", "device_traces"}
        assert data[:2] == b"\x80\x04"  # protocol 4: the memory_viz page reads 2-4


@pytest.mark.parametrize("plan", PLANS)
def test_the_panel_marks_the_peak_with_phase_and_largest_tensors(tracks, plan):
    job, track, which = tracks[plan]
    panel = predicted_panel(track, job, which, overhead=0)
    peak, where = track.peak()
    assert panel.peak.allocated == peak and panel.peak.event == where
    assert panel.peak.phase in ({"prefill"} if plan == "inference" else {"forward", "backward", "optimizer"})
    assert panel.peak.largest and panel.peak.largest[0].size == max(t.size for t in panel.peak.largest)
    # the sampled points keep the peak, and the stacks there sum to it
    k = panel.x.index(where)
    assert sum(panel.stacks[c][k] for c in panel.categories) == peak
    tops = [sum(panel.stacks[c][i] for c in panel.categories) for i in range(len(panel.x))]
    assert all(r >= a for r, a in zip(panel.reserved, tops, strict=True))
    assert panel.limit == job.gpu.capacity_bytes
    assert len(panel.x) <= 1500


def test_the_predicted_phases_follow_the_step(tracks):
    _, track, which = tracks["fsdp2"]
    assert which == "trainer"
    names = [name for i, name in enumerate(track.phase) if i == 0 or track.phase[i - 1] != name]
    assert names[:4] == ["build", "forward", "backward", "optimizer"]
    _, track, which = tracks["pipeline"]
    assert which.startswith("phases")
    assert {"forward", "backward", "optimizer"} <= set(track.phase)


def test_fsdp2_collectives_are_on_their_own_streams(tracks):
    _, track, _ = tracks["fsdp2"]
    snapshot = to_snapshot(track)
    streams = {e["stream"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"}
    assert streams == {0, 1, 2}
    assert {s["stream"] for s in snapshot["segments"]} == {0, 1, 2}


def test_without_pillow_png_names_the_extra(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a))
    path = tmp_path / "t.png"
    assert run(["estimate", "llama3-8b", "--timeline", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memplan[viz]" in err and "Pillow" in err and str(path) in err
    assert not path.exists()
    # html, svg and pickle need nothing more
    for kind in ("html", "svg", "pickle"):
        assert run(["estimate", "llama3-8b", "--timeline", str(tmp_path / f"t.{kind}")]) == 0
