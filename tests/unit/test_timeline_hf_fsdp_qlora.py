"""QLoRA under the Trainer's FSDP2 (``timeline/hf_fsdp_qlora.py``) against the real Trainer on CPU: rank 0 of two
under torch's fake process group (tests/accuracy/hf_fsdp_steps.py), a 4-bit base loaded through bitsandbytes
0.50 (which runs 4-bit on CPU) with ``bnb_4bit_quant_storage`` the FSDP recipe's float dtype, its peak of live
storages over three optimizer steps from ``trainer.train()`` on (the sharding included), equal to the byte.
Two cases by default (about 3 s), the variants under ``-m slow``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("bitsandbytes")

import hf_fsdp_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import peft_steps  # noqa: E402
from hf_predict import hf_predict  # noqa: E402

from memplan.costmodel.timeline.events import ALLOC  # noqa: E402
from memplan.costmodel.timeline.hf_bnb import Bnb4bit  # noqa: E402
from memplan.costmodel.timeline.hf_fsdp_qlora import packed_state_bytes  # noqa: E402

STEPS = 3


def _qlora(name: str, **fields) -> peft_steps.PeftCase:
    fields = {"quant": "nf4", "quant_storage": "bfloat16", **fields}
    return peft_steps.PeftCase(f"hffsdp-qlora-{name}", **{**peft_steps.TINY, **fields})


def _timeline(case: peft_steps.PeftCase, zero: int = 3, ga: int = 1, dp: int = hf_fsdp_steps.WORLD):  # noqa: ANN202
    plan = peft_steps.plan_of(case).model_copy(update=dict(dp=dp, zero=zero))
    assert Bnb4bit.of(plan) is not None
    # loaded in the case's dtype, stored as its quant_storage (the plan assumes the recipe: both its compute dtype)
    return hf_predict(case, plan, ga=ga)


def predict(case: peft_steps.PeftCase, zero: int = 3, ga: int = 1) -> int:
    return _timeline(case, zero, ga).peak()[0]


FAST = [
    # q/v nf4 under full_shard: the packed bf16 weights sharded on dim 0 beside the fp32 adapters and norms (uint8
    # all-gathers), the quantization states whole (the run had sharded and gathered the weights at their fp32
    # size: 1,682,660 B against 1,481,444 B measured)
    _qlora("qv"),
    # the usual recipe: a bf16 base, nf4 with double quantization, bf16=True, checkpointing
    _qlora("recipe", dtype="bfloat16", double_quant=True, autocast=True, checkpointing=True),
]


@pytest.mark.parametrize("case", FAST, ids=lambda c: c.name)
def test_qlora_equals_rank_0s_peak(case: peft_steps.PeftCase) -> None:
    measured = hf_fsdp_steps.measure(case)
    assert predict(case) == measured, f"{case.name}: {predict(case):,} B predicted, {measured:,} B measured"


def test_the_packed_weights_shard_in_their_storage_dtype() -> None:
    """A q_proj of 64 x 64 nf4 codes packed as bf16 is a (1024, 1) parameter: 512 rows a rank, 1,024 B; the
    state dict's packed JSON of its quantization state is 77 B (``{"quant_type": "nf4", "blocksize": 64,
    "dtype": "float32", "shape": [64, 64]}``)."""
    events = [e for e in _timeline(_qlora("shards")).events if e.op == ALLOC]
    shard = next(e for e in events if e.tag == "model.layers.0.self_attn.q_proj.weight.shard")
    assert shard.size == 64 * 64 // 2 // 2
    packed = [e for e in events if e.tag.endswith("q_proj.weight.quant_state.packed")]
    assert [e.size for e in packed] == [77, 77]
    assert packed_state_bytes(Bnb4bit(False, 2, stored=4), 64, 64) == 77


SLOW = [
    (_qlora("shard-grad-op"), 2, 1),
    (_qlora("ckpt", checkpointing=True), 3, 1),  # the fp32 embedding's prefetched all-gather in fp32
    (_qlora("ckpt-shard-grad-op-ga2", checkpointing=True), 2, 2),
    (_qlora("ga2"), 3, 2),
    (_qlora("all-linear-dropout", targets=("all-linear",), dropout=0.1), 3, 1),
    (_qlora("fp4"), 3, 1),
    (_qlora("double-quant"), 3, 1),
    (_qlora("bf16-model", dtype="bfloat16"), 3, 1),
    (_qlora("fp32-compute-fp32-storage", compute_dtype="float32", quant_storage="float32"), 3, 1),
    (_qlora("lm-head", modules_to_save=("lm_head",)), 3, 1),
    (_qlora("tied", tied=True), 3, 1),
    (_qlora("embed", modules_to_save=("embed_tokens",)), 3, 1),
    # bf16=True: the policy gathers the adapters in bf16 and PEFT's lora.Linear4bit runs them so
    (_qlora("bf16-true", autocast=True), 3, 1),
    (_qlora("bf16-true-shard-grad-op-ga2", autocast=True), 2, 2),
    (_qlora("bf16-true-lm-head", autocast=True, modules_to_save=("lm_head",)), 3, 1),
    (_qlora("bf16-true-tied-dq-shard-grad-op", autocast=True, tied=True, double_quant=True), 2, 1),
    (
        _qlora("recipe-lm-head-ga2", dtype="bfloat16", autocast=True, checkpointing=True, modules_to_save=("lm_head",)),
        3,
        2,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "zero", "ga"), SLOW, ids=lambda c: getattr(c, "name", str(c)))
def test_qlora_variants_equal_rank_0s_peak(case: peft_steps.PeftCase, zero: int, ga: int) -> None:
    measured = hf_fsdp_steps.measure(case, ga, STEPS, reshard=zero >= 3)
    predicted = predict(case, zero, ga)
    assert predicted == measured, f"{case.name} zero {zero}: {predicted:,} B predicted, {measured:,} B measured"


def test_estimate_answers_an_hf_fsdp_qlora_plan_op_level(capsys) -> None:
    """``--finetune qlora`` under ``--zero 3``: op-level (the exporters' recipe: the 4-bit weights stored as
    bf16 and sharded), each rank's parameters about half the one-rank run's (the quantization states whole),
    the adapters' optimizer states half."""
    from test_timeline_hf import LLAMA1B
    from test_timeline_hf_fsdp import _estimate

    args = [LLAMA1B, "--runtime", "hf", "--precision", "bf16", "--finetune", "qlora"]
    one = _estimate(capsys, args)
    two = _estimate(capsys, [*args, "--dp", "2", "--zero", "3"])
    assert two["model"] == "op-level" and two["model_reason"] is None
    assert (
        abs(2 * two["model_states"]["parameters"] - one["model_states"]["parameters"])
        <= one["model_states"]["parameters"] // 50
    )
    assert abs(2 * two["model_states"]["optimizer_states"] - one["model_states"]["optimizer_states"]) <= 1024
    assert two["peak"]["allocated"] < one["peak"]["allocated"]
