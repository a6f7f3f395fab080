"""``memplan estimate`` applies the GPU profile's stored step-time calibration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.search.calibration import Calibration, ProfileCalibration, save_calibration

ARGS = ["estimate", "llama3-8b", "--dp", "8", "--zero", "3", "--format", "json"]


def _estimate(home: Path, *extra: str) -> dict:
    env = {"MEMPLAN_HOME": str(home), "PATH": ""}
    r = subprocess.run([sys.executable, "-m", "memplan.cli", *ARGS, *extra], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["time"]


def test_stored_ratio_scales_the_step_time(tmp_path: Path):
    plain = _estimate(tmp_path / "empty")
    assert plain["calibration"] == 1.0
    cal = Calibration(profiles={"h100-sxm": ProfileCalibration(step_time_ratios=(1.1, 1.3, 1.2))})
    save_calibration(cal, tmp_path / "home" / "calibration.json")
    calibrated = _estimate(tmp_path / "home")
    assert calibrated["calibration"] == 1.2  # the median of the stored runs
    assert calibrated["step_time_s"] == pytest.approx(plain["step_time_s"] * 1.2)
    assert _estimate(tmp_path / "home", "--no-calibration")["step_time_s"] == plain["step_time_s"]
    # another GPU profile has no calibration of its own
    assert _estimate(tmp_path / "home", "--gpu", "a100-80gb")["calibration"] == 1.0
