"""Accuracy: ``--runtime hf`` predictions against real transformers training steps on CPU.

Each case trains a tiny Llama / Mistral / Qwen2 for three steps under MemTracker and checks
the predicted ``peak.allocated`` within 3% of the measured steady-state peak.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_steps import CASES, Case, measure_peak, predict_peak  # noqa: E402

pytestmark = pytest.mark.accuracy


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hf_peak_within_3_percent(case: Case):
    predicted, phase = predict_peak(case)
    measured = measure_peak(case)
    error = (predicted - measured) / measured
    assert abs(error) <= 0.03, (
        f"{case.name}: predicted {predicted:,} measured {measured:,} ({100 * error:+.2f}%, {phase})"
    )


def test_measurement_sees_what_it_should():
    """The harness itself: a bigger batch must measure more, so the comparison is not vacuous."""
    small = measure_peak(Case("probe-small", vocab=32000, hidden=128, ffn=344, batch=1, seq=256))
    large = measure_peak(Case("probe-large", vocab=32000, hidden=128, ffn=344, batch=4, seq=256))
    assert large > small * 1.5
