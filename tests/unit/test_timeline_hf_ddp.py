"""The op-level run of ``transformers.Trainer`` under DDP (``timeline/hf_ddp.py``) against the real Trainer on
two gloo ranks on CPU (tests/accuracy/hf_ddp_steps.py): rank 0's peak of live storages over three optimizer
steps, equal to the byte.

What the cases cover: full fine-tuning with ``find_unused_parameters`` (the Trainer's default without
checkpointing: the first buckets 1 MiB then 25 MiB, never rebuilt, ``_DDPSink``'s clones of the loss and
the logits) and without it (checkpointing: one bucket, rebuilt in gradient-ready order at the second
forward), ``bf16=True``, bf16, tied embeddings, Qwen2's biases, gradient accumulation under ``no_sync()``;
PEFT LoRA (always ``find_unused_parameters``: a ``PeftModel`` is no ``PreTrainedModel``) with checkpointing,
``modules_to_save`` (a bf16 head copy beside fp32 adapters: a bucket per dtype), autocast, accumulation;
bitsandbytes nf4 / fp4 bases (their CPU backend; the quantization state handed to the tracker).
The run is compared as in test_timeline_hf.py (``inplace_accumulate=False``: the tracker holds each
storage's Python object). The two-process cases take 10-40 s each: one small case runs by default.
"""

from __future__ import annotations

import sys

import pytest
from estimate_json import estimate_memory as _estimate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_ddp_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
from hf_predict import hf_predict  # noqa: E402
from peft_steps import TINY, PeftCase  # noqa: E402
from test_timeline_hf import LLAMA1B  # noqa: E402
from test_timeline_hf import predict as predict_full  # noqa: E402
from test_timeline_hf_families import CASES as FAMILY_CASES  # noqa: E402
from test_timeline_hf_families import predict as predict_family  # noqa: E402
from test_timeline_hf_peft import predict as predict_peft  # noqa: E402

from memplan.costmodel.timeline.events import ALLOC  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402

DP = hf_ddp_steps.WORLD
SMALL = dict(hf_steps.BASE_SMALL)


def _full(name: str, **fields) -> hf_steps.Case:
    return hf_steps.Case(f"hfddp-{name}", loop="trainer", **fields)


def _peft(name: str, **fields) -> PeftCase:
    return PeftCase(f"hfddp-{name}", **{**TINY, **fields})


FAST = _full("small-fp32", **SMALL)
FULL = [
    (_full("fp32"), 1),
    (_full("fp32-ckpt", checkpointing=True), 1),
    (_full("fp32-ga2"), 2),
    (_full("fp32-ckpt-ga2", checkpointing=True), 2),
    (_full("autocast", **SMALL, autocast=True), 1),
    (_full("bf16-ckpt", **SMALL, dtype="bfloat16", checkpointing=True), 1),
    (_full("tied", **SMALL, tied=True), 1),
    (_full("qwen2-gqa", **{**SMALL, "kv_heads": 1}, arch="qwen2"), 1),
]
# families of hf_families.py, each with its own parameters and buffers (Gemma's rotary tables per layer type)
FAMILY_NAMES = ("hffam-qwen3-fp32", "hffam-gemma3-fp32", "hffam-gemma2-bf16-ckpt", "hffam-phi3-bf16")
PEFT = [
    (_peft("lora-qv"), 1),
    (_peft("lora-ckpt", checkpointing=True), 1),
    (_peft("lora-save-head", modules_to_save=("lm_head",)), 1),
    (_peft("lora-bf16-save-head", dtype="bfloat16", modules_to_save=("lm_head",)), 1),
    (_peft("lora-tied-save-head", tied=True, modules_to_save=("lm_head",)), 1),
    (_peft("lora-autocast-all-linear-ga2", autocast=True, targets=("all-linear",)), 2),
    # bitsandbytes 4-bit bases (CPU backend): the packed weights broadcast as a uint8 bucket
    (_peft("qlora-nf4-dq", quant="nf4", double_quant=True), 1),
    (_peft("qlora-recipe", quant="nf4", double_quant=True, dtype="bfloat16", autocast=True, checkpointing=True), 1),
    (_peft("qlora-fp4-all-linear-ga2", quant="fp4", targets=("all-linear",)), 2),
]


FAMILIES = [c for c in FAMILY_CASES if c.name in FAMILY_NAMES]


def test_the_small_case_equals_rank_0s_peak() -> None:
    """The default suite's two-process case: full fine-tuning with ``find_unused_parameters``."""
    measured = hf_ddp_steps.measure(FAST)
    predicted = predict_full(FAST, dp=DP)
    assert predicted == measured, f"{FAST.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ga"), FULL, ids=lambda c: getattr(c, "name", str(c)))
def test_full_fine_tuning_equals_rank_0s_peak(case: hf_steps.Case, ga: int) -> None:
    measured = hf_ddp_steps.measure(case, ga)
    predicted = predict_full(case, ga=ga, dp=DP)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILIES, ids=lambda c: c.name)
def test_families_equal_rank_0s_peak(case: hf_steps.Case) -> None:
    measured = hf_ddp_steps.measure(case)
    predicted = predict_family(case, dp=DP)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_case_lists_hold_what_they_name() -> None:
    assert len(FAMILIES) == len(FAMILY_NAMES)
    assert {c.quant for c, _ in PEFT} == {"none", "nf4", "fp4"}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ga"), PEFT, ids=lambda c: getattr(c, "name", str(c)))
def test_lora_equals_rank_0s_peak(case: PeftCase, ga: int) -> None:
    measured = hf_ddp_steps.measure(case, ga)
    predicted = predict_peft(case, ga=ga, dp=DP)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def _bucket_sizes(case: hf_steps.Case, checkpointing: bool) -> list[int]:
    """The run's reducer buckets, in allocation order."""
    plan = Plan(precision="fp32", recompute="full" if checkpointing else "none", dp=DP)
    events = hf_predict(case, plan, steps=2).events
    return [e.size for e in events if e.op == ALLOC and "reducer.bucket" in e.tag]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_first_buckets_are_ddps_own_assignment(checkpointing: bool) -> None:
    """The run's first buckets equal what ``DistributedDataParallel`` assigns over the real model's
    parameters (``_compute_bucket_assignment_by_size`` with the limits it picks: 1 MiB then 25 MiB
    under ``find_unused_parameters``, one bucket without), reversed as it hands them to the reducer."""
    import torch.distributed as dist

    case = _full("buckets", hidden=512, heads=8, kv_heads=8, ffn=2048, layers=4, vocab=16000)
    config_cls, model_cls = hf_steps._CLASSES[case.arch]
    with torch.device("meta"):
        model = model_cls(config_cls(**{k: v for k, v in case.hf_config().items() if k != "architectures"}))
    params = [p for p in model.parameters() if p.requires_grad]
    limits = [sys.maxsize] if checkpointing else [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]
    buckets, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    expected = [sum(params[i].numel() * params[i].element_size() for i in b) for b in reversed(buckets)]
    assert len(expected) == (1 if checkpointing else 4)
    assert _bucket_sizes(case, checkpointing)[: len(expected)] == expected


def test_checkpointing_rebuilds_the_buckets_in_ready_order() -> None:
    """Without ``find_unused_parameters`` the one bucket is rebuilt at the second forward: the LM
    head's gradient, ready first, alone in the 1 MiB bucket, the rest in 25 MiB ones."""
    case = _full("rebuild")
    sizes = _bucket_sizes(case, checkpointing=True)
    grads = sum(sizes[:1])
    head = case.vocab * case.hidden * 4
    assert sizes[1:] == [head, grads - head]


@pytest.mark.parametrize("extra", [[], ["--finetune", "lora", "--recompute", "full"]])
def test_estimate_answers_an_hf_ddp_plan_op_level(capsys, extra: list[str]) -> None:
    """``memplan estimate --runtime hf --dp 2`` replays the Trainer's rank; it holds the reducer's
    buckets beside the gradients, so more than the one-rank run by at least the trained bytes (the
    one-rank run's gradients; the DDP rank's model states count the buckets among its gradients, as
    the run files them: ``ddp.Reducer._bucket``)."""
    args = [LLAMA1B, "--runtime", "hf", "--precision", "bf16", *extra]
    one = _estimate(capsys, args)
    two = _estimate(capsys, [*args, "--dp", "2"])
    assert two["model"] == "op-level" and two["model_reason"] is None
    assert two["peak"]["reserved_detail"]["timeline"] == "hf"
    trained = one["model_states"]["gradients"]
    assert two["peak"]["allocated"] - one["peak"]["allocated"] >= trained
    assert two["model_states"]["gradients"] == 2 * trained  # each gradient and its bucket copy
