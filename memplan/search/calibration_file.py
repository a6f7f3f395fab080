"""Where the calibration lives (``calibration.py`` reads and writes it): apart from its models, so
that ``memplan estimate`` sees that a user has none (most have none) without building them."""

import os
from collections.abc import Mapping
from pathlib import Path


def calibration_path(env: Mapping[str, str] = os.environ) -> Path:
    """``$MEMPLAN_HOME/calibration.json``, else ``~/.cache/memplan/calibration.json``."""
    home = env.get("MEMPLAN_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "memplan"
    return base / "calibration.json"
