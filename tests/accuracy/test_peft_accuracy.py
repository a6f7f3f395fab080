"""Accuracy: LoRA / QLoRA predictions against real PEFT training steps on CPU.

Each case trains a tiny Llama / Mistral / Qwen2 with PEFT adapters (over a bitsandbytes 4-bit
base for QLoRA) for three steps under MemTracker and checks the predicted ``peak.allocated``
within 3% of the measured steady-state peak (peft_steps.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft_steps import CASES, GAPS, KNOWN_GAPS, PeftCase, measure_peak, predict_peak  # noqa: E402

pytestmark = pytest.mark.accuracy


def _params(cases):
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


def _check(case: PeftCase) -> tuple[int, int, float, str]:
    if case.quant != "none":
        pytest.importorskip("bitsandbytes")
    predicted, phase = predict_peak(case)
    measured = measure_peak(case)
    error = (predicted - measured) / measured
    print(f"{case.name}: predicted {predicted:,} measured {measured:,} ({100 * error:+.2f}%, {phase})")
    return predicted, measured, error, phase


@pytest.mark.parametrize("case", _params(CASES))
def test_peft_peak_within_3_percent(case: PeftCase):
    predicted, measured, error, phase = _check(case)
    assert abs(error) <= 0.03, (
        f"{case.name}: predicted {predicted:,} measured {measured:,} ({100 * error:+.2f}%, {phase})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", _params(GAPS))
def test_known_gaps(case: PeftCase):
    """Cases measured outside 3%, kept visible: xfail until modelled."""
    predicted, measured, error, phase = _check(case)
    if abs(error) > 0.03:
        pytest.xfail(f"{KNOWN_GAPS[case.name]} ({100 * error:+.2f}%)")


@pytest.mark.slow
def test_adapters_change_the_measurement():
    """The harness itself: all-linear adapters must measure more than q/v adapters."""
    small = measure_peak(CASES[0])
    large = measure_peak(next(c for c in CASES if c.name == "lora-fp32-all-linear"))
    assert large > small
