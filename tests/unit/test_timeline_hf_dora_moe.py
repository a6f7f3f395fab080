"""PEFT DoRA (``LoraConfig(use_dora=True)``) over MoE and MLA models in the op-level run (``timeline/hf_dora.py``
composed with ``hf_moe.py``, ``hf_mla.py``) against the real ``transformers.Trainer`` on CPU: the peak of live
storages over three optimizer steps (``StorageTracker``, tests/accuracy/hf_peft_steps.py), equal to the byte.

PEFT 0.21.2 gives DoRA to ``nn.Linear`` targets alone (``lora.Linear``): the attention linears of Mixtral,
Qwen3-MoE and Qwen2-MoE, every linear of Qwen2-MoE under all-linear (its shared expert, the shared expert's
gate, the dense layers' MLP), MLA's linears of DeepSeek-V2 / V3. Where it wraps a parameter (Mixtral's and
Qwen3-MoE's 3-D experts and routers: ``lora.ParamWrapper``) it raises, and memplan refuses the plan with PEFT's
reason. Over an LLM.int8 base PEFT's own run fails on CPU (``hf_support.DORA_INT8``): refused too. Cases: fp32,
bf16 and the Trainer's ``bf16=True`` over fp32, with and without gradient checkpointing, with dropout (the base run
again on the dropped-out input). Two Trainer cases run by default (seconds each) with the refusals; the grid under
``-m slow``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
from hf_predict import case_model, case_workload, hf_predict  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402
from test_timeline_hf_loop_families import MLA, ROUTER, V2  # noqa: E402
from test_timeline_hf_mla import _bias_cast_bytes  # noqa: E402

from memplan.costmodel.timeline.hf_support import DORA_INT8, DORA_PARAM_WRAPPER, hf_supported  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402

STEPS = 3
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = ("all-linear",)
V3_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
V2_LINEARS = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MIXTRAL = (("num_local_experts", 4), ("num_experts_per_tok", 2))
QWEN3 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64), ("norm_topk_prob", True))
QWEN2 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))
QWEN2 += (("shared_expert_intermediate_size", 96),)
EXTRA = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3, "qwen2_moe": QWEN2, "deepseek_v3": MLA + ROUTER, "deepseek_v2": V2}


def _case(arch: str, tag: str, slow: bool = True, **fields) -> PeftCase:
    mla = {"kv_heads": 2} if arch.startswith("deepseek") else {}  # test_timeline_hf_loop_families' MLA shape
    base = {**TINY, "arch": arch, "extra": EXTRA[arch], **mla, "dora": True, "slow": slow}
    return PeftCase(f"hfdora-moe-{arch}-{tag}", **{**base, **fields})


CASES = [
    # Qwen2-MoE's all-linear: DoRA on the attention, the shared expert, its one-output gate; the experts frozen
    _case("qwen2_moe", "fp32-all-linear", slow=False, targets=ALL),
    _case("deepseek_v2", "fp32-q-kv-b-o", slow=False, targets=("q_proj", "kv_b_proj", "o_proj")),
    _case("mixtral", "fp32-qv"),
    _case("mixtral", "fp32-attn-ckpt", targets=ATTN, checkpointing=True),
    _case("mixtral", "autocast-attn", targets=ATTN, autocast=True),
    _case("mixtral", "bf16-attn-ckpt", targets=ATTN, dtype="bfloat16", checkpointing=True),
    _case("qwen3_moe", "bf16-attn", targets=ATTN, dtype="bfloat16"),
    _case("qwen3_moe", "autocast-attn-ckpt", targets=ATTN, autocast=True, checkpointing=True),
    _case("qwen3_moe", "fp32-attn-dropout", targets=ATTN, dropout=0.1),
    _case("qwen2_moe", "fp32-attn", targets=ATTN),
    _case("qwen2_moe", "bf16-all-linear-ckpt", targets=ALL, dtype="bfloat16", checkpointing=True),
    _case("qwen2_moe", "autocast-all-linear-dropout", targets=ALL, autocast=True, dropout=0.1),
    _case("deepseek_v3", "fp32-all", targets=V3_LINEARS),
    _case("deepseek_v3", "bf16-kv-b-o", targets=("kv_b_proj", "o_proj"), dtype="bfloat16"),
    _case("deepseek_v3", "autocast-all-ckpt", targets=V3_LINEARS, autocast=True, checkpointing=True),
    _case("deepseek_v2", "autocast-q-kv-b-o-dropout", targets=("q_proj", "kv_b_proj", "o_proj"), autocast=True,
          dropout=0.1),
    _case("deepseek_v2", "bf16-all-ckpt", targets=V2_LINEARS, dtype="bfloat16", checkpointing=True),
]  # fmt: skip


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]
)
def test_peak_equals_the_trainers(case: PeftCase) -> None:
    """Equal to the byte; over DeepSeek-V3 in bf16 but for the routers' fp32 score bias the harness casts
    (test_timeline_hf_mla._bias_cast_bytes: the run keeps it fp32, as ``from_pretrained`` does)."""
    plan = plan_of(case)
    assert hf_supported(case_model(case), plan, case_workload(case), device="cpu") is None, case.name
    predicted = hf_predict(case, plan, subclass_like=True).peak()[0]
    measured = hf_peft_steps.measure(case, steps=STEPS)
    expected = measured + (_bias_cast_bytes(case) if case.arch == "deepseek_v3" else 0)
    assert predicted == expected, f"{case.name}: {predicted:,} B predicted, {expected:,} B measured"


# QDoRA over a 4-bit MoE / MLA base on CPU (bitsandbytes replaces the nn.Linear alone; hf_support._quant_moe_ok):
# the packed weight dequantized in each forward for the norm, as over a dense base (hf_dora._dequantize)
QDORA = [
    _case("mixtral", "qdora-nf4-qv", quant="nf4"),
    _case("deepseek_v3", "qdora-nf4-q-a-kv-a", quant="nf4", targets=("q_a_proj", "kv_a_proj_with_mqa")),
    _case("qwen2_moe", "qdora-nf4-dq-autocast-all-linear-ckpt", quant="nf4", double_quant=True, targets=ALL,
          autocast=True, checkpointing=True),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", QDORA, ids=lambda c: c.name)
def test_qdora_over_a_4bit_moe_base_equals_the_trainers(case: PeftCase) -> None:
    from test_timeline_hf_quant_moe import predict

    assert predict(case) == hf_peft_steps.measure(case, steps=STEPS), case.name


# more than one rank: the Trainer's DDP over two gloo ranks (hf_ddp_steps) and its FSDP2 under torch's fake process
# group (hf_fsdp_steps), rank 0's peak; ``zero`` 0: DDP, 2: shard_grad_op, 3: full_shard
RANKS = [
    (_case("mixtral", "ddp-qv"), 0),
    (_case("qwen2_moe", "ddp-all-linear", targets=ALL), 0),
    (_case("qwen2_moe", "ddp-qdora-nf4-all-linear", quant="nf4", targets=ALL), 0),
    (_case("mixtral", "fsdp-qv"), 3),
    (_case("qwen2_moe", "fsdp-autocast-all-linear", targets=ALL, autocast=True), 2),
    (_case("deepseek_v2", "fsdp-q-o", targets=("q_proj", "o_proj")), 3),
    (_case("qwen3_moe", "fsdp-bf16-attn-ckpt", targets=ATTN, dtype="bfloat16", checkpointing=True), 3),
    # the FSDP QLoRA recipe: the packed weights stored as bf16 and sharded (hf_fsdp_qlora.py)
    (_case("mixtral", "fsdp-qdora-recipe", quant="nf4", quant_storage="bfloat16", dtype="bfloat16", double_quant=True,
           autocast=True, checkpointing=True), 3),
    (_case("deepseek_v2", "fsdp-qdora-nf4", quant="nf4", quant_storage="bfloat16",
           targets=("q_proj", "kv_b_proj", "o_proj")), 2),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("case", "zero"), RANKS, ids=lambda c: getattr(c, "name", str(c)))
def test_peak_on_rank_0_equals_the_trainers(case: PeftCase, zero: int) -> None:
    import hf_ddp_steps
    import hf_fsdp_steps
    from test_timeline_hf_quant_moe_ranks import predict

    if zero == 0:
        measured = hf_ddp_steps.measure(case, 1)
    else:
        measured = hf_fsdp_steps.measure(case, 1, STEPS, reshard=zero >= 3, world=2)
    predicted = predict(case, 2, zero)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


LOOP = [
    _case("mixtral", "loop-qv"),
    _case("qwen2_moe", "loop-bf16-all-linear-ckpt", targets=ALL, dtype="bfloat16", checkpointing=True),
    _case("deepseek_v2", "loop-autocast-q-kv-b-o-dropout", targets=("q_proj", "kv_b_proj", "o_proj"), autocast=True,
          dropout=0.1),
    _case("deepseek_v3", "loop-qdora-nf4", quant="nf4", targets=("q_a_proj", "kv_a_proj_with_mqa")),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", LOOP, ids=lambda c: c.name)
def test_peak_equals_the_hand_loops(case: PeftCase) -> None:
    """``--runtime hf-loop``: peft_steps' loop (AdamW over the adapters and magnitudes; ``peft_steps.build`` turns
    the checkpoint on), the model, its quantization state and the batch under ``StorageTracker``."""
    from test_timeline_hf_loop import measure_peft
    from test_timeline_hf_quant_moe import predict

    measured, predicted = measure_peft(case), predict(case, "hf-loop")
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_cases_cover_each_family_precision_and_checkpointing() -> None:
    archs = {c.arch for c in CASES}
    assert archs == set(EXTRA)
    for arch in archs:
        mine = [c for c in CASES if c.arch == arch]
        assert any(c.checkpointing for c in mine) or arch == "deepseek_v2" and any(c.dropout for c in mine)
    assert {(c.dtype, c.autocast) for c in CASES} == {("float32", False), ("bfloat16", False), ("float32", True)}


def _tiny_mixtral():
    cfg = transformers.MixtralConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=64, max_position_embeddings=64, num_local_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def test_peft_refuses_dora_on_the_experts_and_so_does_memplan() -> None:
    """PEFT 0.21.2 raises on DoRA where it wraps a parameter (all-linear over Mixtral: the experts and the router in
    ``lora.ParamWrapper``); memplan refuses the plan in one line with PEFT's words, naming ``plan.lora_dora``."""
    from memplan.api import estimate

    config = peft.LoraConfig(r=4, target_modules="all-linear", use_dora=True, task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=DORA_PARAM_WRAPPER):
        peft.get_peft_model(_tiny_mixtral(), config)
    for model, targets in [("mixtral-8x7b", ("all-linear",)), ("qwen3-30b-a3b", ("gate_proj", "up_proj"))]:
        plan = {"finetune": "lora", "lora_targets": targets, "lora_dora": True}
        with pytest.raises(MemplanError) as err:
            estimate(model, plan, {"seq_len": 512}, runtime="hf", device="cpu")
        assert err.value.field == "plan.lora_dora" and DORA_PARAM_WRAPPER in str(err.value), model
        assert "\n" not in str(err.value)


def test_dora_over_an_int8_base_is_refused_as_peft_fails_on_cpu() -> None:
    """Over an LLM.int8 base PEFT's DoRA re-wraps the weight in each forward (``dequantize_module_weight``:
    ``module.weight = module.weight.to('cpu')``), a new ``Int8Params`` without its ``SCB``; the layer's next
    forward fails inside bitsandbytes. The plan is refused in one line saying so (should PEFT mend it, this test
    fails and the refusal is to be lifted after measuring)."""
    from memplan.api import estimate

    case = PeftCase("hfdora-int8", **{**TINY, "quant": "int8", "dora": True, "layers": 1})
    model = hf_peft_steps.build(case)
    ids = torch.randint(0, case.vocab, (1, 8))
    model(input_ids=ids)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'unsqueeze'"):
        model(input_ids=ids)
    plan = {"finetune": "lora", "quant": "int8", "lora_dora": True}
    with pytest.raises(MemplanError) as err:
        estimate("mixtral-8x7b", plan, {"seq_len": 512}, runtime="hf", device="cpu")
    assert err.value.field in ("plan.lora_dora", "plan.finetune") and DORA_INT8 in str(err.value)
    assert "\n" not in str(err.value)
