"""The code stays ruff-clean (lint and format), as the house style asks."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(), reason="ruff not installed"
)
def test_ruff_check_and_format():
    ruff = str(Path(sys.executable).parent / "ruff") if (Path(sys.executable).parent / "ruff").exists() else "ruff"
    paths = ["memplan", "kernels", "tests", "benchmarks", "profiles"]
    check = subprocess.run([ruff, "check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    fmt = subprocess.run([ruff, "format", "--check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout
