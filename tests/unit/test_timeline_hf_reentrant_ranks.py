"""torch's reentrant checkpoint (``timeline/reentrant.py``) under the real ``transformers.Trainer`` over two ranks:
DDP on two gloo ranks (tests/accuracy/hf_ddp_steps.py) and FSDP2 on rank 0 of two under the fake process group
(tests/accuracy/hf_fsdp_steps.py), ``gradient_checkpointing_kwargs={"use_reentrant": True}``; rank 0's peak of live
storages over three optimizer steps equal to the run's (``hf_predict``, the plan's ``use_reentrant``).

What the cases show (docs/cost-model.md, "torch's reentrant checkpoint over more than one rank"):

- DDP: the reducer's hooks fire inside each checkpoint's nested backward as the gradients are made, in the order
  they are made without it; the Trainer leaves ``find_unused_parameters`` off for a checkpointed ``PreTrainedModel``.
  Over a PEFT model (no ``PreTrainedModel``) it turns it on, and the first backward fails ("Expected to mark a
  variable ready only once": the prepare-time search finds no adapter in the no-grad forward's graph and marks them
  all ready, then their hooks fire in the re-runs): the run that trains sets ``ddp_find_unused_parameters=False``,
  which the run follows (no ``local_used_map``, no ``_DDPSink`` clones, the buckets rebuilt in ready order).
- FSDP2: transformers checkpoints the layer's ``forward`` (``GradientCheckpointingLayer``), so ``fully_shard``'s
  hooks stay around the checkpoint, as around the non-reentrant one: what differs is the checkpoint's own tensors.

The shapes are layer-dominated (a 512 or 256 vocabulary), where the reentrant checkpoint's peak differs from the
non-reentrant one's (``test_the_cases_tell_the_checkpoints_apart``). The DDP cases take 40-75 s (two processes, on two
busy cores), the FSDP2 ones 2-8 s: one FSDP2 case runs by default, the rest under ``-m slow``.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

import hf_ddp_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_fsdp_steps  # noqa: E402
import hf_steps  # noqa: E402
import test_timeline_hf_loop_families as LOOP  # noqa: E402
from hf_predict import case_model, case_workload, hf_predict  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402
from test_timeline_hf_families import LAYERS  # noqa: E402
from test_timeline_hf_families import _case as _family  # noqa: E402
from test_timeline_hf_loop_families import _case as _loop_family  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402

DP = 2
KWARGS = {"use_reentrant": True}
# TrainingArguments(gradient_checkpointing_kwargs=...): 5.23's alias of activation_checkpointing_kwargs, read by train()
REENTRANT = {"gradient_checkpointing_kwargs": dict(KWARGS), "activation_checkpointing_kwargs": dict(KWARGS)}
# what a PEFT model over DDP needs under the reentrant checkpoint (the module docstring)
NO_UNUSED = {**REENTRANT, "ddp_find_unused_parameters": False}


def _full(name: str, **fields) -> hf_steps.Case:
    fields = {**hf_steps.BASE_SMALL, "vocab": 512, **fields}
    return hf_steps.Case(f"reentrant-ranks-{name}", loop="trainer", checkpointing=True, **fields)


def _lora(name: str, **fields) -> PeftCase:
    return PeftCase(f"reentrant-ranks-{name}", **{**TINY, "checkpointing": True, **fields})


def plan(case, zero: int, reentrant: bool = True) -> Plan:
    """The case's plan on rank 0 of two: DDP (``zero`` 0) or FSDP2 (3: ``full_shard``, 2: ``shard_grad_op``)."""
    update = {"dp": DP, "zero": zero, "use_reentrant": reentrant}
    if isinstance(case, PeftCase):
        return plan_of(case, "hf").model_copy(update=update)
    return Plan(precision=case.precision, autocast=case.plan_autocast, recompute="full", **update)


def predict(case, zero: int, ga: int = 1, reentrant: bool = True) -> int:
    """The run's peak on CPU's kernels, ``ga`` micro-batches a step, the plan followed (``hf_supported``)."""
    p = plan(case, zero, reentrant)
    model = case_model(case)
    assert hf_supported(model, p, case_workload(case), device="cpu") is None, case.name
    # subclass_like: the tracker is a dispatch mode (hf_moe_ops.zeros_then_put)
    return hf_predict(case, p, ga=ga, subclass_like=model.moe is not None).peak()[0]


def measure(case, zero: int, ga: int = 1) -> int:
    if zero == 0:
        return hf_ddp_steps.measure(case, ga, args_update=NO_UNUSED if isinstance(case, PeftCase) else REENTRANT)
    return hf_fsdp_steps.measure(case, ga, reshard=zero == 3, args_update=REENTRANT)


QWEN3 = _family("qwen3", "reentrant-ranks-layers-fp32", **LAYERS, checkpointing=True)
GEMMA3 = _family("gemma3", "reentrant-ranks-layers-fp32", **LAYERS, checkpointing=True)
# test_timeline_hf_loop_families.py's Mixtral: the router and the experts re-run in the nested backward
MIXTRAL = dataclasses.replace(
    _loop_family("reentrant-ranks-mixtral", "mixtral", LOOP.MIXTRAL, LOOP.MOE), loop="trainer", checkpointing=True
)
FAST = [(_full("llama-fp32"), 3, 1)]
SLOW = [
    # DDP: two gloo ranks
    (_full("llama-fp32"), 0, 1),
    (QWEN3, 0, 1),
    (GEMMA3, 0, 1),
    (MIXTRAL, 0, 1),
    (_lora("lora-fp32"), 0, 1),
    (_lora("lora-int8", quant="int8"), 0, 1),  # LLM.int8 (CPU's MatMul8bitFp): ctx.A only in the re-runs
    (_full("llama-fp32-ga2"), 0, 2),  # no_sync() on the first micro-batch
    (_lora("qlora-recipe", quant="nf4", double_quant=True, dtype="bfloat16", autocast=True), 0, 1),
    # FSDP2: full_shard and shard_grad_op
    (_full("llama-fp32"), 2, 1),
    (_full("llama-fp32-ga2"), 3, 2),  # set_requires_gradient_sync(False) on the first micro-batch
    (_lora("lora-fp32-ga2"), 2, 2),
    (_full("llama-bf16-true", autocast=True), 3, 1),
    (QWEN3, 3, 1),
    (GEMMA3, 2, 1),
    (_lora("lora-fp32"), 3, 1),
    (_lora("lora-fp32"), 2, 1),
    (_lora("lora-autocast", autocast=True), 3, 1),
    # the QLoRA recipe under FSDP2: its packed weights in bnb_4bit_quant_storage (hf_fsdp_qlora.py)
    (
        _lora(
            "qlora-recipe-fsdp",
            quant="nf4",
            quant_storage="bfloat16",
            double_quant=True,
            dtype="bfloat16",
            autocast=True,
        ),
        3,
        1,
    ),
]


def _ids(cases: list[tuple]) -> list[str]:
    return [f"{c.name}-{ {0: 'ddp', 2: 'shard-grad-op', 3: 'full-shard'}[z] }" for c, z, _ in cases]


@pytest.mark.parametrize(("case", "zero", "ga"), FAST, ids=_ids(FAST))
def test_fsdp2_equals_rank_0s_peak(case, zero: int, ga: int) -> None:  # noqa: ANN001
    measured, predicted = measure(case, zero, ga), predict(case, zero, ga)
    assert predicted == measured, f"{case.name} zero {zero}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "zero", "ga"), SLOW, ids=_ids(SLOW))
def test_ddp_and_fsdp2_equal_rank_0s_peak(case, zero: int, ga: int) -> None:  # noqa: ANN001
    measured, predicted = measure(case, zero, ga), predict(case, zero, ga)
    assert predicted == measured, f"{case.name} zero {zero}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.parametrize(("case", "zero", "ga"), FAST + SLOW, ids=_ids(FAST + SLOW))
def test_the_cases_tell_the_checkpoints_apart(case, zero: int, ga: int) -> None:  # noqa: ANN001
    """Each case's peak under the reentrant checkpoint differs from the non-reentrant one's (else a case could not
    tell them apart)."""
    assert predict(case, zero, ga) != predict(case, zero, ga, reentrant=False), case.name


def test_the_cases_span_ranks_families_and_bases() -> None:
    cases = FAST + SLOW
    assert {z for _, z, _ in cases} == {0, 2, 3}
    for zero in (0, 3):
        kinds = {(isinstance(c, PeftCase), getattr(c, "quant", "none")) for c, z, _ in cases if z == zero}
        assert {(False, "none"), (True, "none")} <= kinds
    assert {c.arch for c, _, _ in cases} >= {"llama", "qwen3", "gemma3", "mixtral"}
    assert {z for c, z, _ in cases if getattr(c, "quant", "none") == "nf4"} == {0, 3}
    assert {z for _, z, ga in cases if ga > 1} == {0, 2, 3}


@pytest.mark.slow
def test_a_peft_model_over_ddp_fails_with_the_trainers_default() -> None:
    """The Trainer's ``find_unused_parameters=True`` over a PEFT model under the reentrant checkpoint: the first
    backward raises in the reducer (why the run assumes ``ddp_find_unused_parameters=False``)."""
    with pytest.raises(Exception, match="mark a variable ready only once"):
        hf_ddp_steps.measure(_lora("lora-default-find-unused"), args_update=REENTRANT)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_activation_offload_is_followed(zero: int) -> None:
    """Under TRL's activation offload the re-runs' saves are packed in the backward and their copies released by
    graph task (``hf_offload.TrlOffload``): followed, rank 0's peak measured in
    tests/unit/test_timeline_hf_reentrant_offload.py (before 2026-11-29: declined in one line)."""
    case = _full("offload")
    p = plan(case, zero).model_copy(update={"offload_activations": "cpu"})
    assert hf_supported(case_model(case), p, case_workload(case), device="cpu") is None


def test_one_rank_cases_still_follow() -> None:
    """The one-rank plan is followed as before (tests/unit/test_timeline_reentrant.py)."""
    case = _full("one-rank")
    p = plan(case, 0).model_copy(update={"dp": 1})
    assert hf_supported(case_model(case), p, case_workload(case), device="cpu") is None
