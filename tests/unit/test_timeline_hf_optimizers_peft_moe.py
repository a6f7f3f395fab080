"""The Trainer's optimizers other than fused AdamW over PEFT LoRA on MoE and MLA models, against the real
``transformers.Trainer`` on CPU (transformers 5.23, peft 0.21.2, bitsandbytes 0.50.2).

SGD, transformers' Adafactor and bitsandbytes' 8-bit, 32-bit and paged AdamW and Lion (``hf_optimizers.py``,
``hf_bnb_optim.py``) over the adapters PEFT builds on Mixtral, Qwen3-MoE, Qwen2-MoE (``hf_moe_lora.py``: the
``ParamWrapper`` adapters of the 3-D experts and of the router are 2-D, ``lora_A`` r x in, ``lora_B`` out x r,
per expert stack) and DeepSeek-V3 / V2's MLA linears: rank 0's peak of live storages over three steps
(tests/accuracy/hf_peft_steps.py's harness) equal to the byte. One case of each kind of step runs by default
(a Trainer run each, 3-10 s on two busy cores); the rest under ``-m slow``.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
from hf_predict import STEPS, case_model, case_workload, hf_predict  # noqa: E402
from optim_steps import trained_with  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402
from test_timeline_hf_mla import MLA_LINEARS, SHAPE, V3, _bias_cast_bytes  # noqa: E402
from test_timeline_hf_mla_v2 import LITE  # noqa: E402
from test_timeline_hf_moe import MIXTRAL, QWEN2_DENSE, QWEN3_DENSE  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _case(tag: str, arch: str, extra: tuple, **fields) -> PeftCase:
    base = {**TINY, "rank": 8} if not arch.startswith("deepseek") else {**TINY, **SHAPE, "rank": 8}
    return PeftCase(f"hfoptmoe-{arch}-{tag}", **{**base, "arch": arch, "extra": extra, **fields})


def measure(case: PeftCase, optimizer: str, ranks=None) -> int:  # noqa: ANN001 - a harness's measure
    """Rank 0's peak of ``Trainer.train()`` over the PEFT model with ``optim`` set (``optim_steps.trained_with``);
    ``ranks``: a multi-rank harness's ``measure(case)`` (hf_fsdp_steps), else one rank."""
    training_args = hf_steps.training_args

    def with_optim(*args, **kwargs):
        out = training_args(*args, **kwargs)
        stack.enter_context(trained_with(out, optimizer))
        return out

    with contextlib.ExitStack() as stack, mock.patch.object(hf_steps, "training_args", with_optim):
        if ranks is not None:
            return ranks(case)
        return hf_peft_steps.measure(case, steps=STEPS, tracker=hf_peft_steps.StorageTracker())


def predict(case: PeftCase, optimizer: str, dp: int = 1, zero: int = 0) -> int:
    """The run's peak on rank 0 of ``dp`` (DDP, or FSDP2 at ``zero`` 2 or 3)."""
    plan = plan_of(case).model_copy(update={"optimizer": optimizer, "dp": dp, "zero": zero})
    assert hf_supported(case_model(case), plan, case_workload(case), device="cpu") is None, case.name
    return hf_predict(case, plan, subclass_like=True).peak()[0]


def _slow(case: PeftCase, optimizer: str):
    return pytest.param(case, optimizer, marks=pytest.mark.slow, id=f"{case.name}-{optimizer}")


def _fast(case: PeftCase, optimizer: str):
    return pytest.param(case, optimizer, id=f"{case.name}-{optimizer}")


ALL = ("all-linear",)
BF16 = dict(dtype="bfloat16")
# one of each kind by default: Adafactor's factored states of the experts' 2-D ParamWrapper adapters (they were
# taken as 3-D stacks: 14,592 B over), bitsandbytes' 8-bit states over Qwen3-MoE's expert adapters in bf16, Adafactor
# over MLA's adapters; the rest under -m slow
CASES = [
    _fast(_case("all-linear-fp32", "mixtral", MIXTRAL, targets=ALL), "adafactor"),
    _fast(_case("experts-bf16", "qwen3_moe", QWEN3_DENSE, targets=MLP, **BF16), "adamw-8bit"),
    _fast(_case("mla-fp32", "deepseek_v3", V3, targets=MLA_LINEARS), "adafactor"),
    _slow(_case("attn-fp32", "mixtral", MIXTRAL, targets=ATTN), "adafactor"),
    _slow(_case("all-linear-fp32", "mixtral", MIXTRAL, targets=ALL), "paged-adamw-8bit"),
    _slow(_case("all-linear-bf16-ckpt", "mixtral", MIXTRAL, targets=ALL, **BF16, checkpointing=True), "sgd"),
    _slow(_case("all-linear-autocast", "mixtral", MIXTRAL, targets=ALL, autocast=True), "paged-lion-32bit"),
    _slow(_case("experts-fp32", "qwen3_moe", QWEN3_DENSE, targets=MLP), "adafactor"),
    _slow(_case("experts-save-head", "qwen3_moe", QWEN3_DENSE, targets=MLP, modules_to_save=("lm_head",)), "adafactor"),
    _slow(_case("experts-bf16", "qwen3_moe", QWEN3_DENSE, targets=MLP, **BF16), "paged-adamw-32bit"),
    _slow(_case("all-linear-fp32", "qwen2_moe", QWEN2_DENSE, targets=ALL, layers=4), "sgd"),
    _slow(_case("all-linear-bf16", "qwen2_moe", QWEN2_DENSE, targets=ALL, layers=4, **BF16), "adafactor"),
    _slow(_case("mla-fp32", "deepseek_v3", V3, targets=MLA_LINEARS), "paged-lion-8bit"),
    _slow(_case("mla-bf16", "deepseek_v3", V3, targets=MLA_LINEARS, **BF16), "adafactor"),
    _slow(_case("q-o-fp32", "deepseek_v2", LITE, targets=("q_proj", "o_proj")), "adafactor"),
    _slow(
        _case(
            "q-o-autocast-ckpt", "deepseek_v2", LITE, targets=("q_proj", "o_proj"), autocast=True, checkpointing=True
        ),
        "adamw-8bit",
    ),
]


@pytest.mark.parametrize(("case", "optimizer"), CASES)
def test_lora_over_moe_and_mla_equals_the_trainers(case: PeftCase, optimizer: str) -> None:
    """Equal to the byte; over DeepSeek-V3 in bf16 the harness's ``.to(bfloat16)`` casts the routers' fp32 score
    bias, which ``from_pretrained`` (and the run) keep fp32 (test_timeline_hf_mla._bias_cast_bytes)."""
    measured = measure(case, optimizer) + (_bias_cast_bytes(case) if case.arch == "deepseek_v3" else 0)
    predicted = predict(case, optimizer)
    assert predicted == measured, f"{case.name} {optimizer}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_estimate_answers_lora_over_moe_and_mla_with_the_trainers_optimizers(capsys, tmp_path) -> None:
    """LoRA over Mixtral with Adafactor or a paged 8-bit AdamW, and over a DeepSeek-V3 config.json on CPU with SGD:
    the op-level run answers (was refused in one line: LoRA over an MoE model has no phase model)."""
    import json

    from estimate_json import estimate_memory

    base = ["mixtral-8x7b", "--runtime", "hf", "--finetune", "lora", "--precision", "bf16", "--seq-len", "512"]
    for optimizer in ("adafactor", "paged-adamw-8bit"):
        memory = estimate_memory(capsys, [*base, "--optimizer", optimizer])
        assert memory["model"] == "op-level" and memory["model_reason"] is None, optimizer
    path = tmp_path / "config.json"
    case = _case("cli", "deepseek_v3", V3)
    path.write_text(json.dumps(case.hf_config()))
    args = [str(path), "--runtime", "hf", "--finetune", "lora", "--lora-targets", "kv_b_proj,o_proj", "--seq-len", "64"]
    memory = estimate_memory(capsys, [*args, "--device", "cpu", "--optimizer", "sgd"])
    assert memory["model"] == "op-level"


@pytest.mark.slow
def test_lora_over_mixtral_under_ddp_with_adafactor_equals_rank_0s_peak() -> None:
    """Rank 0 of two gloo ranks (tests/accuracy/hf_ddp_steps.py, ``optim`` set in each rank)."""
    import hf_ddp_steps

    case = _case("ddp-all-linear-fp32", "mixtral", MIXTRAL, targets=ALL)
    measured, predicted = hf_ddp_steps.measure(case, optim="adafactor"), predict(case, "adafactor", dp=2)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize("zero", [3, 2])
def test_lora_over_moe_under_fsdp2_with_sgd_equals_rank_0s_peak(zero: int) -> None:
    """Rank 0 of two under the fake process group (tests/accuracy/hf_fsdp_steps.py): SGD steps the DTensor
    adapters, PEFT's ParamWrapper ones of the experts and the router too."""
    import hf_fsdp_steps

    case = _case(f"fsdp-all-linear-zero{zero}", "mixtral", MIXTRAL, targets=ALL)
    measured = measure(case, "sgd", lambda c: hf_fsdp_steps.measure(c, reshard=zero >= 3))
    predicted = predict(case, "sgd", dp=hf_fsdp_steps.WORLD, zero=zero)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
