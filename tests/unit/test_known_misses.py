"""Known misses stay visible: every ``xfail`` in the suite is strict (an xfail that starts to pass
fails, so a mended miss must leave the list), and each is listed with its figure in
docs/accuracy.md ("Known misses")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "accuracy.md"


def _xfail_calls() -> list[tuple[Path, ast.Call]]:
    """Every ``xfail(...)`` call under tests/ (a decorator, or a parameter's marks)."""
    out = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "xfail":
                out.append((path, node))
    return out


def test_no_xfail_is_lenient():
    lenient = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path, call in _xfail_calls()
        for kw in call.keywords
        if kw.arg == "strict" and not (isinstance(kw.value, ast.Constant) and kw.value.value is True)
    ]
    assert not lenient, lenient


def test_the_suite_defaults_to_strict_xfails():
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["xfail_strict"] is True


def test_every_file_with_an_xfail_is_in_the_known_misses_list():
    text = DOC.read_text()
    section = text[text.index("## Known misses") :]
    here = Path(__file__).resolve()
    files = {str(path.relative_to(ROOT)) for path, _ in _xfail_calls() if path != here}
    assert files and all(f"`{f}" in section for f in files), sorted(f for f in files if f"`{f}" not in section)
