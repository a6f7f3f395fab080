"""The bundled trainer's measured peak against ``--runtime memplan``: within 2% per plan."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from trainer_cases import CASES, Case  # noqa: E402

from memplan.train.runner import run  # noqa: E402

TOLERANCE_PCT = 2.0


def test_suite_covers_the_issue():
    assert len(CASES) >= 20
    plans = [c.plan for c in CASES]
    assert {p.get("zero", 0) for p in plans} == {0, 1, 2, 3}
    assert {p.get("precision") for p in plans} >= {"fp32", "bf16-mixed", "bf16-master", "bf16"}
    assert {p.get("recompute", "none") for p in plans} == {"none", "selective", "selective-op", "full"}
    assert {p.get("pp_schedule", "1f1b") for p in plans if p.get("pp", 1) > 1} >= {"1f1b", "interleaved"}
    assert max(Case(c.name, c.plan, c.model).spec()[0].plan.world_size for c in CASES) == 64


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_memplan_runtime_within_2pct(case: Case):
    spec, predicted = case.spec()
    record = run(spec)
    assert record.status == "ok", record.reason
    measured = record.peak_allocated
    error = 100 * (predicted - measured) / measured
    assert abs(error) <= TOLERANCE_PCT, f"{case.name}: predicted {predicted:,} measured {measured:,} ({error:+.2f}%)"
