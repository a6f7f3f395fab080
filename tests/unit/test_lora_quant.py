"""LoRA / QLoRA formulas (memplan.costmodel.lora, .quant) against PEFT's and bitsandbytes' own
counts and storage, the plan checks, and the estimate's finetune wiring."""

from __future__ import annotations

import pytest

from memplan.costmodel import lora as L
from memplan.costmodel import quant as Q
from memplan.errors import MemplanError
from memplan.specs.job import check_compatible
from memplan.specs.loader import load_model
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

TINY = ModelSpec(
    name="tiny", hidden_size=64, num_layers=2, num_attention_heads=2, num_kv_heads=1, ffn_size=160, vocab_size=256
)
SHAPES = [(128, 128), (344, 128), (100, 70), (4096, 4096)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("quant", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_4bit_bytes_match_bitsandbytes_storage(out_features, in_features, quant, double_quant):
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    param = bnb.nn.Params4bit(
        torch.randn(out_features, in_features), requires_grad=False, quant_type=quant, compress_statistics=double_quant
    )._quantize("cpu")
    qs = param.quant_state
    tensors = [param, qs.absmax, qs.code]
    if qs.nested:
        tensors += [qs.state2.absmax, qs.state2.code, qs.offset]
    stored = sum(t.untyped_storage().nbytes() for t in tensors)
    assert stored == Q.weight_4bit_bytes(out_features, in_features, double_quant)
    assert param.untyped_storage().nbytes() == Q.packed_4bit_bytes(out_features * in_features)


def test_int8_bytes_formula():
    assert Q.weight_int8_bytes(4096, 1024) == 4096 * 1024 + 4 * 4096


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_int8_bytes_match_bitsandbytes_storage(out_features, in_features):
    """``Int8Params`` quantized on CPU: the int8 data (``CB`` is the same storage) and the fp32
    row scales ``SCB``; no fp16 / fp32 copy of the weight is kept."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False, threshold=6.0)
    layer.weight = bnb.nn.Int8Params(torch.randn(out_features, in_features), requires_grad=False)
    layer = layer.to("cpu")
    param = layer.weight
    assert param.dtype == torch.int8 and param.CB is not None
    assert param.CB.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    stored = param.untyped_storage().nbytes() + param.SCB.untyped_storage().nbytes()
    assert stored == Q.quantized_weight_bytes(out_features, in_features, "int8")
    assert Q.quantized_weight_bytes(8, 8, "nf4") == 32 + 4 + 64


@pytest.mark.parametrize(
    "targets",
    [
        ("q_proj", "v_proj"),
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        ("gate_proj", "up_proj", "down_proj"),
        ("all-linear",),
    ],
)
@pytest.mark.parametrize("modules_to_save", [(), ("lm_head",)])
def test_adapter_params_match_peft(targets, modules_to_save):
    pytest.importorskip("peft")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "accuracy"))
    from peft_steps import PeftCase, build

    case = PeftCase(
        "count",
        vocab=256,
        hidden=64,
        heads=2,
        kv_heads=1,
        ffn=160,
        rank=4,
        targets=targets,
        modules_to_save=modules_to_save,
    )
    model = build(case)
    trainable, _ = model.get_nb_trainable_parameters()
    spec = ModelSpec(
        name="c", hidden_size=64, num_layers=2, num_attention_heads=2, num_kv_heads=1, ffn_size=160, vocab_size=256
    )
    ours = spec.num_layers * L.layer_adapter_params(spec, targets, 4)
    ours += sum(L.saved_module_params(spec, modules_to_save).values())
    assert trainable == ours


def test_all_linear_is_every_decoder_linear():
    assert L.resolve_targets(("all-linear",)) == L.LINEARS
    assert L.layer_adapter_params(TINY, ("q_proj",), 8) == 8 * (64 + 64)


def _estimate(plan: Plan, runtime: str = "hf"):
    from memplan.costmodel.memory import estimate_training

    return estimate_training(TINY, TrainingWorkload(seq_len=64, micro_batch=2), plan, runtime=runtime, device="cpu")


@pytest.mark.parametrize("runtime", ["hf", "memplan", "megatron"])
def test_lora_states_are_smaller_than_full(runtime):
    full = _estimate(Plan(precision="fp32"), runtime)
    lora = _estimate(Plan(precision="fp32", finetune="lora", lora_rank=4), runtime)
    adapters = TINY.num_layers * L.layer_adapter_params(TINY, ("q_proj", "v_proj"), 4)
    assert lora.model_states.gradients == 4 * adapters
    assert lora.model_states.optimizer_states == 8 * adapters
    assert lora.model_states.parameters == full.model_states.parameters + 4 * adapters
    assert lora.peak.allocated < full.peak.allocated


def test_qlora_quantizes_the_layer_linears():
    plan = Plan(precision="bf16", finetune="qlora", lora_rank=4)
    assert plan.quant == "nf4" and plan.double_quant
    report = _estimate(plan)
    linears = L.layer_linears(TINY).values()
    quantized = sum(Q.weight_4bit_bytes(o, i, True) for i, o in linears) * TINY.num_layers
    others = 2 * 256 * 64 + (2 * TINY.num_layers + 1) * 64  # embedding, head, norms: fp32
    adapters = 4 * TINY.num_layers * L.layer_adapter_params(TINY, ("q_proj", "v_proj"), 4)
    assert report.model_states.parameters == quantized + 4 * others + adapters


def test_check_compatible_rejects_unknown_targets():
    workload = TrainingWorkload(seq_len=64, micro_batch=1)
    with pytest.raises(MemplanError) as err:
        check_compatible(TINY, workload, Plan(finetune="lora", lora_targets=("c_attn",)))
    assert err.value.field == "plan.lora_targets" and "q_proj" in str(err.value)
    with pytest.raises(MemplanError) as err:
        check_compatible(TINY, workload, Plan(finetune="lora", modules_to_save=("score",)))
    assert err.value.field == "plan.modules_to_save" and "lm_head" in str(err.value)
    check_compatible(TINY, workload, Plan(finetune="lora", lora_targets=("all-linear",), modules_to_save=("lm_head",)))


def test_check_compatible_rejects_unmodelled_architectures():
    gpt = TINY.model_copy(update={"architecture": "gpt2", "mlp": "plain"})
    with pytest.raises(MemplanError) as err:
        check_compatible(gpt, TrainingWorkload(seq_len=64, micro_batch=1), Plan(finetune="lora"))
    assert err.value.field == "plan.finetune"


def test_llama3_8b_qlora_is_far_below_full():
    model = load_model("llama3-8b")
    from memplan.costmodel.memory import estimate_training

    workload = TrainingWorkload(seq_len=2048, micro_batch=1)
    full = estimate_training(model, workload, Plan(precision="bf16"), runtime="hf")
    qlora = estimate_training(model, workload, Plan(precision="bf16", finetune="qlora"), runtime="hf")
    # 4-bit layer linears, but prepare_model_for_kbit_training keeps the embedding and LM head in fp32
    assert qlora.model_states.parameters < 0.5 * full.model_states.parameters
    assert qlora.model_states.optimizer_states < 0.01 * full.model_states.optimizer_states
