"""memplan.testing: ``limit_memory`` (context manager and fixture) and the ``memplan_limit`` marker,
run by pytest itself on a test file, as a user's suite would (CPU: MemTracker)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

SUITE = textwrap.dedent(
    """
    import pytest
    import torch

    from memplan.testing import MemoryLimitExceeded, limit_memory as limit


    def step(model, optimizer):
        loss = model(torch.randn(64, 1024)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


    def test_fixture_within_limit(limit_memory):
        with limit_memory("8MiB") as usage:
            x = torch.zeros(2**20, dtype=torch.uint8)  # 1 MiB
            del x
        assert 2**20 <= usage.peak_bytes < 8 * 2**20


    def test_fixture_over_limit(limit_memory):
        with limit_memory("1MiB"):
            x = torch.zeros(4 * 2**20, dtype=torch.uint8)  # 4 MiB
            del x


    def test_tracked_training_step():
        model = torch.nn.Linear(1024, 1024)  # 4 MiB of parameters, 4 MiB of gradients
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)  # 8 MiB of states
        with pytest.raises(MemoryLimitExceeded) as err:
            with limit("12MiB", track=(model, optimizer)):
                step(model, optimizer)
        assert "over the limit of 12.00 MiB" in str(err.value)
        with limit("40MiB", track=(model, optimizer)) as usage:
            step(model, optimizer)
        assert 16 * 2**20 < usage.peak_bytes < 40 * 2**20


    def test_an_exception_inside_is_not_masked(limit_memory):
        with pytest.raises(KeyError):
            with limit_memory("1MiB"):
                x = torch.zeros(4 * 2**20, dtype=torch.uint8)
                raise KeyError("inside")


    def test_bad_limit(limit_memory):
        with pytest.raises(ValueError, match="80GiB = 80 x 2"):
            with limit_memory("2G"):
                pass


    @pytest.mark.memplan_limit("2MiB")
    def test_marker_over_limit():
        x = torch.zeros(8 * 2**20, dtype=torch.uint8)
        del x


    @pytest.mark.memplan_limit("64MiB")
    def test_marker_within_limit():
        x = torch.zeros(8 * 2**20, dtype=torch.uint8)
        del x
    """
)


def test_plugin_in_a_pytest_run(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "test_budget.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["COLUMNS"] = "250"
    # -p no:memplan: the entry point may be installed; load the module explicitly either way
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:memplan", "-p", "memplan.testing"]
    proc = subprocess.run(
        [*cmd, "-rf", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    out = proc.stdout
    assert "2 failed, 5 passed" in out, out[-3000:]
    failed = {line.split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {"FAILED test_budget.py::test_fixture_over_limit", "FAILED test_budget.py::test_marker_over_limit"}
    assert "MemoryLimitExceeded: peak allocated memory on cpu" in out
    assert "over the limit of 2.00 MiB" in out


def test_the_plugin_is_registered_as_a_pytest_entry_point():
    """A missing entry point is the failure this test exists to catch, so it fails, never skips
    (an install without pyproject.toml's current metadata: ``pip install -e .`` registers it)."""
    points = importlib.metadata.entry_points(group="pytest11")
    assert {p.name for p in points if p.value == "memplan.testing"} == {"memplan"}, (
        "memplan.testing is not registered as a pytest11 entry point named memplan "
        "(pyproject.toml [project.entry-points.pytest11]; reinstall with pip install -e .)"
    )
