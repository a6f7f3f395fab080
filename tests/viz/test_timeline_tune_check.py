"""``tune --timeline`` draws the recommended plan, ``check --timeline`` the failing entry (else the one
nearest its budget): the same predicted run ``estimate --timeline`` writes for that plan."""

from __future__ import annotations

import io
import pickle
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from memplan.cli.app import run
from memplan.viz.output import write_job_timeline

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMPLAN_HOME", str(tmp_path / "home"))


def memplan(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run([*args])
    return code, out.getvalue(), err.getvalue()


def _events(path: Path) -> list:
    with path.open("rb") as f:
        snapshot = pickle.load(f)
    return [e for trace in snapshot["device_traces"] for e in trace]


def test_tune_draws_the_recommended_plan(tmp_path):
    code, _, err = memplan("tune", "llama3-8b", "--gpus", "8", "--out", "p.yaml", "--timeline", "t.pickle")
    assert code == 0, err
    assert "timeline: t.pickle (the recommended plan's predicted run)" in err
    # the same run as estimate --timeline of the plan YAML it wrote
    code, _, err = memplan("estimate", "llama3-8b", "--plan", "p.yaml", "--timeline", "e.pickle")
    assert code == 0, err
    assert _events(Path("t.pickle")) == _events(Path("e.pickle"))


def test_tune_with_nothing_fitting_writes_no_timeline():
    code, _, err = memplan("tune", "llama3-70b", "--gpus", "1", "--gpu", "rtx-4090", "--timeline", "t.html")
    assert code == 1
    assert "no plan fits: no timeline written to t.html" in err and not Path("t.html").exists()


def test_check_draws_the_entry_nearest_its_budget(tmp_path):
    code, _, err = memplan("check", str(EXAMPLES / "budgets.yaml"), "--timeline", "c.html")
    assert code == 0, err
    assert "closest to its budget" in err and Path("c.html").read_text().startswith("<!DOCTYPE html>")


def test_check_draws_the_failing_entry(tmp_path):
    budgets = tmp_path / "b.yaml"
    budgets.write_text(
        "entries:\n"
        "  - {name: small, model: llama3-8b, gpus: 8, plan: {zero: 3}, budget: 80GiB}\n"
        "  - {name: tight, model: llama3-8b, gpus: 8, plan: {zero: 1}, budget: 1GiB}\n"
    )
    code, _, err = memplan("check", str(budgets), "--timeline", "c.pickle")
    assert code == 1
    assert "timeline: c.pickle (entry tight, failing)" in err
    from memplan.specs.resolve import resolve_job

    job = resolve_job("llama3-8b", None, {"gpus": 8, "zero": 1})
    write_job_timeline(job, tmp_path / "direct.pickle", "pickle")
    assert _events(Path("c.pickle")) == _events(tmp_path / "direct.pickle")


def test_a_bad_timeline_path_is_refused_before_the_search():
    code, _, err = memplan("tune", "llama3-8b", "--gpus", "8", "--timeline", "nowhere/t.html")
    assert code == 2 and "--timeline" in err and "does not exist" in err
    code, _, err = memplan("check", str(EXAMPLES / "budgets.yaml"), "--timeline", "c.txt")
    assert code == 2 and "unknown suffix" in err
