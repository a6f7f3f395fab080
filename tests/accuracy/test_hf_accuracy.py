"""Accuracy: ``--runtime hf`` and ``--runtime hf-loop`` predictions against real transformers
training steps on CPU.

Each case trains a tiny Llama / Mistral / Qwen2 for three steps under MemTracker, through
``transformers.Trainer`` (``loop="trainer"``, predicted with ``hf``) or the hand-written loop
that keeps ``out`` (``loop="hand"``, predicted with ``hf-loop``), and checks the predicted
``peak.allocated`` within 3% of the measured steady-state peak. The heavy bf16 cases run under
``-m slow``; each has a smaller twin in the default suite (hf_steps.py).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_steps import CASES, Case, measure_peak, predict_peak, predict_report  # noqa: E402

pytestmark = pytest.mark.accuracy


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]
)
def test_hf_peak_within_3_percent(case: Case):
    predicted, phase = predict_peak(case)
    measured = measure_peak(case)
    error = (predicted - measured) / measured
    assert abs(error) <= 0.03, (
        f"{case.name} ({case.loop} loop, --runtime {case.runtime}): predicted {predicted:,} measured {measured:,} "
        f"({100 * error:+.2f}%, {phase})"
    )


SHAPE = ("hidden", "heads", "kv_heads", "ffn", "vocab", "batch", "seq")


@pytest.mark.parametrize("case", [c for c in CASES if c.slow], ids=lambda c: c.name)
def test_each_slow_case_has_a_smaller_default_twin(case: Case):
    """A case behind ``-m slow`` keeps a default twin that differs only in its shape: the same
    architecture, precision, attention, checkpointing, tying, layers and heads per KV head, a
    smaller step, and the same peak phase and largest category of the predicted peak."""
    twin = next(c for c in CASES if c.name == f"{case.name}-small")
    assert not twin.slow
    same = {f.name for f in dataclasses.fields(Case)} - set(SHAPE) - {"name", "slow"}
    assert {k: getattr(twin, k) for k in same} == {k: getattr(case, k) for k in same}
    assert twin.heads // twin.kv_heads == case.heads // case.kv_heads
    assert twin.batch * twin.seq * twin.hidden < case.batch * case.seq * case.hidden
    ours, theirs = predict_report(twin).peak, predict_report(case).peak
    assert ours.phase == theirs.phase
    assert max(ours.breakdown, key=ours.breakdown.get) == max(theirs.breakdown, key=theirs.breakdown.get)


@pytest.mark.parametrize("loop", ["hand", "trainer"])
def test_measurement_sees_what_it_should(loop: str):
    """The harness itself: a bigger batch must measure more, so the comparison is not vacuous."""
    small = measure_peak(Case("probe-small", vocab=32000, hidden=128, ffn=344, batch=1, seq=256, loop=loop))
    large = measure_peak(Case("probe-large", vocab=32000, hidden=128, ffn=344, batch=4, seq=256, loop=loop))
    assert large > small * 1.5


def test_every_case_runs_in_both_loops():
    """Each hand-loop case (hf-loop) has its Trainer variant (hf), slow where it is slow."""
    hand = {c.name: c for c in CASES if c.loop == "hand"}
    trainer = {c.name: c for c in CASES if c.loop == "trainer"}
    assert len(hand) == len(trainer) == len(CASES) // 2
    for name, case in hand.items():
        assert case.runtime == "hf-loop"
        twin = trainer[f"trainer-{name}"]
        assert twin.runtime == "hf"
        assert dataclasses.replace(twin, name=name, loop="hand") == case


def test_trainer_loop_keeps_less_than_the_hand_loop():
    """The Trainer lets the outputs (logits) go before the backward and steps a fused AdamW: the
    same case measures less through it, by about the b x s x V logits and foreach's temporary."""
    case = next(c for c in CASES if c.name == "llama-fp32-mha")
    trainer = dataclasses.replace(case, name="trainer-llama-fp32-mha", loop="trainer")
    assert measure_peak(trainer) < measure_peak(case) - case.batch * case.seq * case.vocab * 4
