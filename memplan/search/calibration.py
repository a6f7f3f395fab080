"""Measured / predicted ratios per GPU profile, from validation runs (``memplan tune --validate``).

One JSON file per user: ``$MEMPLAN_HOME/calibration.json``, else
``~/.cache/memplan/calibration.json``::

    {"version": 1, "profiles": {"h100-sxm": {"step_time_ratios": [1.07, 1.12],
                                              "peak_ratios": [0.99, 1.01], "updated": "..."}}}

A profile's ratio is the median of its last :data:`KEEP` runs, so one odd run does not move
it far. Step-time ratios come only from real runs on CUDA (a simulated rank's time is not the
job's); peak ratios from every completed run (a simulated rank's memory is real).
``estimate_time`` takes the step-time ratio as ``Efficiency(calibration=...)``; the search
scales the predicted allocated peak by the peak ratio.
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memplan.errors import MemplanError
from memplan.search.calibration_file import calibration_path  # noqa: F401 - where it was

KEEP = 20  # runs kept per profile and kind


# defer_build: ``memplan estimate`` reads the calibration on every run and most users have none;
# the validators are built when a file is read or written, not when this module is imported
class ProfileCalibration(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    step_time_ratios: tuple[float, ...] = Field((), description="Measured / predicted step time, oldest first.")
    peak_ratios: tuple[float, ...] = Field((), description="Measured / predicted peak allocated, oldest first.")
    updated: str | None = None

    @property
    def step_time_ratio(self) -> float | None:
        return _median(self.step_time_ratios)

    @property
    def peak_ratio(self) -> float | None:
        return _median(self.peak_ratios)


def _median(ratios: Sequence[float]) -> float | None:
    import statistics  # not at import: the estimate path reads a calibration, most often none

    return statistics.median(ratios) if ratios else None


class Calibration(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    version: Literal[1] = 1
    profiles: dict[str, ProfileCalibration] = Field(default_factory=dict)


def load_calibration(path: Path) -> Calibration:
    """The calibration in ``path``; none yet when the file does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Calibration.model_construct()  # the empty calibration (its defaults: nothing to validate)
    except OSError as err:
        raise MemplanError(f"cannot read calibration ({err.__class__.__name__})", source=str(path)) from None
    try:
        return Calibration.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as err:
        reason = str(err).splitlines()[0]
        raise MemplanError(
            f"malformed calibration file ({reason}); delete it to start over", source=str(path)
        ) from None


def with_runs(
    cal: Calibration, gpu: str, step_time_ratios: Sequence[float], peak_ratios: Sequence[float], now: str
) -> Calibration:
    """The calibration with new runs' ratios added to ``gpu``'s profile (the last KEEP kept)."""
    old = cal.profiles.get(gpu, ProfileCalibration())
    new = ProfileCalibration(
        step_time_ratios=(*old.step_time_ratios, *step_time_ratios)[-KEEP:],
        peak_ratios=(*old.peak_ratios, *peak_ratios)[-KEEP:],
        updated=now,
    )
    return cal.model_copy(update={"profiles": {**cal.profiles, gpu: new}})


def save_calibration(cal: Calibration, path: Path) -> None:
    """Write atomically (a temporary file renamed over the old one)."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".calibration-", delete=False) as tmp:
        tmp.write(cal.model_dump_json(indent=2))
    os.replace(tmp.name, path)
