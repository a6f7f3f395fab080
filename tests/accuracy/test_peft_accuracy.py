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

from peft_steps import CASES, TINY, PeftCase, measure, measure_live, measure_peak, predict_peak  # noqa: E402

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


def test_storage_tracker_counts_as_memtracker():
    """The instrument: where MemTracker's hooks keep nothing extra, the two count the same bytes."""
    case = next(c for c in CASES if c.name == "qlora-nf4-dq-bf16")  # quantization state handed to both
    assert measure_live(case) == measure(case)["Total"]


def test_memtracker_keeps_the_checkpointed_input_leaf():
    """Why the suite does not take MemTracker's own total: under checkpointing with a frozen embedding
    (``enable_input_require_grads``) its module hooks keep each step's embedding output, a leaf that
    requires grad, and that leaf's gradient, so its peak grows by ``2 b s h`` fp32 per step; the same
    steps counted without the hooks do not grow."""
    case = PeftCase("probe-ckpt", **TINY, checkpointing=True)
    pair = 2 * case.batch * case.seq * case.hidden * 4
    assert measure(case, steps=3)["Total"] - measure(case, steps=2)["Total"] == pair
    assert measure_live(case, steps=3) == measure_live(case, steps=2)


@pytest.mark.slow
def test_adapters_change_the_measurement():
    """The harness itself: all-linear adapters must measure more than q/v adapters."""
    small = measure_peak(CASES[0])
    large = measure_peak(next(c for c in CASES if c.name == "lora-fp32-all-linear"))
    assert large > small
