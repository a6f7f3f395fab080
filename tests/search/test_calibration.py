"""The calibration file: where it lives, round trips, a median of the last runs per profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.search.calibration import (
    KEEP,
    Calibration,
    calibration_path,
    load_calibration,
    save_calibration,
    with_runs,
)


def test_path(tmp_path: Path):
    assert calibration_path({"MEMPLAN_HOME": str(tmp_path)}) == tmp_path / "calibration.json"
    assert calibration_path({}) == Path.home() / ".cache" / "memplan" / "calibration.json"


def test_round_trip_and_medians(tmp_path: Path):
    path = tmp_path / "sub" / "calibration.json"
    assert load_calibration(path) == Calibration()  # none yet
    cal = with_runs(Calibration(), "h100-sxm", [1.10, 1.30], [0.98], now="t1")
    cal = with_runs(cal, "h100-sxm", [1.20], [1.02, 1.00], now="t2")
    cal = with_runs(cal, "a100-80gb", [], [0.95], now="t3")
    save_calibration(cal, path)
    loaded = load_calibration(path)
    assert loaded == cal
    h100 = loaded.profiles["h100-sxm"]
    assert h100.step_time_ratio == pytest.approx(1.20) and h100.peak_ratio == pytest.approx(1.00)
    assert h100.updated == "t2"
    assert loaded.profiles["a100-80gb"].step_time_ratio is None
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left


def test_only_the_last_runs_count():
    cal = with_runs(Calibration(), "h100-sxm", [2.0] * KEEP, [], now="t1")
    cal = with_runs(cal, "h100-sxm", [1.0] * (KEEP // 2 + 1), [], now="t2")
    profile = cal.profiles["h100-sxm"]
    assert len(profile.step_time_ratios) == KEEP and profile.step_time_ratio == 1.0


@pytest.mark.parametrize("text", ["{not json", '{"version": 2}', '{"profiles": {"h100": {"peak_ratios": "x"}}}'])
def test_malformed_file_is_one_error(tmp_path: Path, text: str):
    path = tmp_path / "calibration.json"
    path.write_text(text)
    with pytest.raises(MemplanError) as err:
        load_calibration(path)
    assert err.value.source == str(path) and "\n" not in str(err.value)
