"""Golden exports of bundled profiles, byte for byte, through ``memplan export``.

``tests/golden/exports/plans/<plan>.yaml`` are plan files; ``<plan>-<target>.<ext>`` what
``memplan export <plan>.yaml --to <target>`` writes. A change to an exporter shows here as a
diff to review. This test only compares and never writes a golden file; after reviewing a
change, regenerate them by hand with

    python tests/golden/regenerate_golden.py
"""

from __future__ import annotations

import pytest
from regenerate_golden import GOLDEN, HERE, export


@pytest.mark.parametrize(("plan", "target", "extra", "name"), GOLDEN)
def test_export_matches_golden(tmp_path, capsys, plan, target, extra, name):
    out = tmp_path / name
    code = export(plan, target, extra, out)
    err = capsys.readouterr().err
    assert code == 0, err
    golden = HERE / name
    assert golden.exists(), f"{golden} missing: run python tests/golden/regenerate_golden.py"
    assert out.read_bytes() == golden.read_bytes(), f"{name} differs from its golden file"


def test_every_golden_file_is_checked():
    files = {p.name for p in HERE.iterdir() if p.is_file()}
    assert files == {g[3] for g in GOLDEN}
