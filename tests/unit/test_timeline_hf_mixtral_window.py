"""Mixtral's sliding window (``config.json`` ``sliding_window``), read as Mistral's and followed by the op-level run
as Mistral's (``hf_sliding.SlidingWindow`` over ``hf_moe.HfMixtral``), against the real ``transformers.Trainer`` on CPU.

``MixtralConfig.sliding_window`` is ``int | None`` (None by default: null in Mixtral-8x7B's config.json, set in
others); ``MixtralModel.forward`` builds one mask with ``create_sliding_window_causal_mask`` when it is set
(modeling_mixtral.py:443) and ``MixtralAttention`` hands it to the kernel, so a sequence that reaches the window
runs SDPA with the (s, s) mask in every layer, as Mistral's (``hf_sliding.py``). Before, the reader dropped the
key: a tiny Mixtral with a 64-token window trained on 128 tokens peaked 393,216 B (3.6%; three layers, two
sequences) above the run's answer.
Cases: a window of 64 (and of 128, equal to the keys) on a 128-token sequence, and one of 256 that it does not
reach; fp32, bf16 and ``bf16=True`` with checkpointing; the Trainer, the hand-written loop (its sliding cache
layers), eager attention, the Trainer's FSDP2 and DDP on rank 0 of two; the peak of live storages over three steps
equal to the byte. One Trainer case runs by default (seconds), the rest under ``-m slow``.
"""

from __future__ import annotations

import dataclasses

import pytest
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import test_timeline_hf_eager as eager  # noqa: E402
import test_timeline_hf_loop_families as loop  # noqa: E402
from test_timeline_hf_moe import MIXTRAL  # noqa: E402
from test_timeline_hf_moe import _case as _moe_case  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.loader import load_model, model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
WINDOW = (*MIXTRAL, ("sliding_window", 64))  # reached by the 128-token sequence
SEQ = dict(seq=128)


def _case(tag: str, extra: tuple = WINDOW, **fields) -> hf_steps.Case:
    return _moe_case("mixtral", f"window-{tag}", extra, **{**SEQ, **fields})


def spec(case: hf_steps.Case):  # noqa: ANN201
    return model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)


def _plan(case: hf_steps.Case, **fields) -> Plan:
    recompute = "full" if case.checkpointing else "none"
    return Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, **fields)


def predict(case: hf_steps.Case, dp: int = 1, zero: int = 0) -> int:
    """The Trainer's run for the case's config.json (its window read from it) on CPU, rank 0 of ``dp``."""
    model, plan = spec(case), _plan(case, dp=dp, zero=zero)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    return hf_predict(case, plan, subclass_like=True).peak()[0]  # subclass_like: test_timeline_hf_moe.py's


def test_the_reader_takes_mixtrals_window_as_mistrals() -> None:
    """Null (Mixtral-8x7B's) or absent (``MixtralConfig``'s default, not Mistral's 4096): no window; set: every layer
    sliding."""
    assert load_model("mixtral-8x7b").attention_pattern == ()
    config = _case("reader").hf_config()
    assert spec(_case("reader")).layer_attention_kinds == ("sliding",) * 3
    assert spec(_case("reader")).sliding_window == 64
    absent = {k: v for k, v in config.items() if k != "sliding_window"}
    assert model_from_data(absent, "config.json", "m").sliding_window is None


def test_a_reached_window_equals_the_trainers_peak() -> None:
    """fp32, two layers, one sequence: the window reached, the mask's grid, each layer's float mask and ``repeat_kv``
    copies counted (the run without the window, what the reader gave before, is 131,072 B under: 2.5%)."""
    case = _case("fp32", layers=2, batch=1)
    measured, predicted = hf_steps.measure_peak(case, steps=STEPS), predict(case)
    assert predicted == measured, f"{predicted:,} B predicted, {measured:,} B measured"
    plain = hf_predict(dataclasses.replace(case, extra=MIXTRAL), _plan(case), subclass_like=True).peak()[0]
    assert measured - plain == 131_072


TRAINER = [
    _case("bf16", dtype="bfloat16"),
    _case("bf16-window-128", (*MIXTRAL, ("sliding_window", 128)), dtype="bfloat16"),  # the window equal to the keys
    _case("autocast-ckpt", autocast=True, checkpointing=True, layers=2),
    _case("fp32-not-reached", (*MIXTRAL, ("sliding_window", 256))),  # no mask: is_causal, as without a window
]


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAINER, ids=lambda c: c.name)
def test_window_variants_equal_the_trainers_peak(case: hf_steps.Case) -> None:
    measured, predicted = hf_steps.measure_peak(case, steps=STEPS), predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


LOOP = [
    loop._case("mixtral-window-fp32", "mixtral", WINDOW, loop.MOE, loop="hand", **SEQ),
    loop._case("mixtral-window-autocast-ckpt", "mixtral", WINDOW, loop.MOE, loop="hand", autocast=True,
               checkpointing=True, layers=2, **SEQ),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", LOOP, ids=lambda c: c.name)
def test_the_hand_loops_window_equals_its_peak(case: hf_steps.Case) -> None:
    """``--runtime hf-loop``: ``DynamicCache(config=...)``'s sliding layers (``hf_loop.py``) and the masked SDPA."""
    measured, predicted = hf_steps.measure_hand(case, STEPS), loop.predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
def test_eager_attention_with_the_window_equals_the_trainers_peak() -> None:
    """``attn_implementation="eager"``: the window in the one 4-D float mask (``hf_families.eager_masks``)."""
    case = eager._moe("mixtral", "window-fp32", WINDOW, **SEQ)
    measured, predicted = hf_steps.measure_peak(case, steps=STEPS), eager.predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "zero"),
    [(_case("fsdp-fp32"), 3), (_case("fsdp-autocast-ckpt", autocast=True, checkpointing=True), 2)],
    ids=lambda c: getattr(c, "name", str(c)),
)
def test_fsdp_rank_0s_peak_with_the_window(case: hf_steps.Case, zero: int) -> None:
    import hf_fsdp_steps

    measured = hf_fsdp_steps.measure(case, 1, STEPS, reshard=zero >= 3, world=2)
    predicted = predict(case, dp=2, zero=zero)
    assert predicted == measured, f"{case.name} zero {zero}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
def test_ddp_rank_0s_peak_with_the_window() -> None:
    import hf_ddp_steps

    case = _case("ddp-fp32")
    measured, predicted = hf_ddp_steps.measure(case), predict(case, dp=hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
