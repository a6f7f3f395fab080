"""Accuracy: the families of docs/models.md (Qwen3, OLMo 2, Phi-3, Gemma 2 / 3, DeepSeek-V2 / V3,
Llama 4) against real transformers training steps on CPU, measured with MemTracker (hf_steps.py):
both loops (``hf-loop`` by hand, ``hf`` the Trainer), fp32 and bf16, with and without gradient
checkpointing, each predicted ``peak.allocated`` within 3% of the steady-state peak."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_steps import CASES  # noqa: E402
from hf_steps import Case, measure_peak, predict_peak  # noqa: E402

pytestmark = pytest.mark.accuracy


# the Trainer's variant of a family the Trainer's op-level run answers is held to the byte against the
# real Trainer by tests/unit/test_timeline_hf_families.py: under -m slow here (the default suite's time)
OP_LEVEL = ("trainer-qwen3", "trainer-olmo2", "trainer-phi3", "trainer-gemma2", "trainer-gemma3")
OP_LEVEL += ("trainer-deepseek-v3",)  # tests/unit/test_timeline_hf_mla.py: test_the_family_cases_equal_the_trainers


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow or c.name.startswith(OP_LEVEL) else [])
        for c in CASES
    ],
)
def test_family_peak_within_3_percent(case: Case):
    predicted, phase = predict_peak(case)
    measured = measure_peak(case)
    error = (predicted - measured) / measured
    assert abs(error) <= 0.03, (
        f"{case.name}: predicted {predicted:,} measured {measured:,} ({100 * error:+.2f}%, {phase})"
    )
