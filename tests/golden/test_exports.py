"""Golden exports of bundled profiles, byte for byte, through ``memplan export``.

``tests/golden/exports/plans/<plan>.yaml`` are plan files; ``<plan>-<target>.<ext>`` what
``memplan export <plan>.yaml --to <target>`` writes. A change to an exporter shows here as a
diff to review; after reviewing it, regenerate with

    MEMPLAN_UPDATE_GOLDEN=1 python -m pytest tests/golden/test_exports.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memplan.cli.app import run

HERE = Path(__file__).parent / "exports"
GOLDEN = [
    # plan, target, extra arguments, file
    ("llama3-8b-fsdp", "deepspeed", [], "llama3-8b-fsdp-deepspeed.json"),
    ("llama3-8b-fsdp", "accelerate", [], "llama3-8b-fsdp-accelerate.yaml"),
    ("llama3-8b-fsdp", "torchtitan", [], "llama3-8b-fsdp-torchtitan.py"),
    ("llama3-8b-fsdp", "torchtitan", ["--torchtitan-form", "toml"], "llama3-8b-fsdp-torchtitan.toml"),
    ("llama3-8b-fsdp", "fsdp2", [], "llama3-8b-fsdp-fsdp2.py"),
    ("llama3-70b-3d", "megatron", [], "llama3-70b-3d-megatron.sh"),
    ("llama3-70b-tp-pp-fsdp", "torchtitan", [], "llama3-70b-tp-pp-fsdp-torchtitan.py"),
    ("llama3-70b-tp-pp-fsdp", "torchtitan", ["--torchtitan-form", "toml"], "llama3-70b-tp-pp-fsdp-torchtitan.toml"),
]


@pytest.mark.parametrize(("plan", "target", "extra", "name"), GOLDEN)
def test_export_matches_golden(tmp_path, capsys, plan, target, extra, name):
    out = tmp_path / name
    code = run(["export", str(HERE / "plans" / f"{plan}.yaml"), "--to", target, *extra, "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    golden = HERE / name
    if os.environ.get("MEMPLAN_UPDATE_GOLDEN") == "1":
        golden.write_bytes(out.read_bytes())
    assert golden.exists(), f"{golden} missing: run with MEMPLAN_UPDATE_GOLDEN=1"
    assert out.read_bytes() == golden.read_bytes(), f"{name} differs from its golden file"


def test_every_golden_file_is_checked():
    files = {p.name for p in HERE.iterdir() if p.is_file()}
    assert files == {g[3] for g in GOLDEN}
