# ruff: noqa: E501 (one case per line: a table)
"""QLoRA and LLM.int8 bases in the bundled trainer (memplan.train.quant over memplan.train.lora):
each phase's measured peak (MemTracker, steady state) against ``--runtime memplan`` within 3%,
and the base built as bitsandbytes / transformers / PEFT build it.

The default cases run a smaller Llama (h 128, 2 layers, f 256, V 2048) at 2 x 64 tokens, under
1 s each on 2 idle cores (5 to 10 s with the cores shared); the shape of
tests/validate/test_lora_trainer.py (TINY, 2 x 160 fp32, 1 x 128 bf16) runs under ``-m slow``
(1 to 6 s each idle, 15 to 80 s shared). Measured 2026-11-26 on CPU
(torch 2.13.0+cpu, bitsandbytes 0.50.2): every phase within 0.1% (docs/cost-model.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")

from trainer_cases import TINY, measured_against_predicted, validate_tiny_on_cpu  # noqa: E402

from memplan.costmodel import lora as L  # noqa: E402
from memplan.costmodel.quant import quantized_weight_bytes  # noqa: E402
from memplan.specs.model import ModelSpec  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402
from memplan.train import quant as Q  # noqa: E402
from memplan.train.lora import LoraLinear, apply_lora, init_adapters, trainable  # noqa: E402
from memplan.train.model import Transformer  # noqa: E402
from memplan.train.runner import run  # noqa: E402
from memplan.validate.spec import RunSpec  # noqa: E402

TOLERANCE_PCT = 3.0
QV, ALL = ("q_proj", "v_proj"), ("all-linear",)
SMALL = ModelSpec(
    name="tiny-qlora",
    hidden_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_size=256,
    vocab_size=2048,
)
SMALL_WORKLOAD = TrainingWorkload(seq_len=64, micro_batch=2)

CASES = {  # name: (plan, slow: at TINY's shape under -m slow)
    "qlora-nf4-dq-fp32": (dict(precision="fp32"), False),
    "qlora-nf4-bf16": (dict(precision="bf16", double_quant=False), False),
    "qlora-fp4-dq-fp32": (dict(precision="fp32", quant="fp4"), False),
    "qlora-int8-fp32": (dict(precision="fp32", quant="int8"), False),
    "qlora-nf4-dq-fp32-recompute-full": (dict(precision="fp32", recompute="full"), False),
    "qlora-int8-fp32-recompute-full": (dict(precision="fp32", quant="int8", recompute="full"), False),
    "qlora-nf4-dq-fp32-ddp2": (dict(precision="fp32", dp=2), False),
    "qlora-int8-fp32-zero1-dp2": (dict(precision="fp32", quant="int8", dp=2, zero=1), False),
    "qlora-nf4-bf16-all-linear": (dict(precision="bf16", double_quant=False, lora_targets=ALL), False),
    "qlora-fp4-dq-fp32-all-linear": (dict(precision="fp32", quant="fp4", lora_targets=ALL), False),
    "qlora-nf4-fp32": (dict(precision="fp32", double_quant=False), True),
    "qlora-nf4-dq-bf16": (dict(precision="bf16"), True),
    "qlora-nf4-dq-bf16-master-all-linear": (dict(precision="bf16-master", lora_targets=ALL), True),
    "qlora-int8-bf16-all-linear-recompute-full": (dict(precision="bf16", quant="int8", lora_targets=ALL, recompute="full"), True),
    "qlora-nf4-dq-fp32-lm-head-dropout": (dict(precision="fp32", modules_to_save=("lm_head",), lora_dropout=0.1), True),
}  # fmt: skip


def _case(name: str) -> tuple[ModelSpec, TrainingWorkload, Plan]:
    fields, slow = CASES[name]
    plan = Plan(**{"finetune": "qlora", "lora_targets": QV, **fields})
    if not slow:
        return SMALL, SMALL_WORKLOAD, plan
    fp32 = plan.precision == "fp32"
    return TINY, TrainingWorkload(seq_len=160 if fp32 else 128, micro_batch=2 if fp32 else 1), plan


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if slow else []) for n, (_, slow) in CASES.items()]
)
def test_each_phase_within_3pct_of_the_memplan_runtime(name: str):
    model, workload, plan = _case(name)
    measured_against_predicted(name, model, workload, plan, steps=2, tolerance_pct=TOLERANCE_PCT)


def _quantized(plan: Plan, model: ModelSpec = SMALL) -> Transformer:
    net = Transformer(model).to(torch.bfloat16 if plan.precision != "fp32" else torch.float32)
    apply_lora(net, plan)
    net.init_weights(0)
    init_adapters(net)
    return net


@pytest.mark.parametrize(
    ("fields", "layer", "compute"),
    [
        (dict(precision="fp32"), "Linear4bit", torch.float32),
        (dict(precision="bf16", quant="fp4", double_quant=False), "Linear4bit", torch.bfloat16),
        (dict(precision="fp32", quant="int8"), "Linear8bitLt", None),
    ],
)
def test_the_base_is_built_as_bitsandbytes_and_peft_build_it(fields: dict, layer: str, compute: torch.dtype | None):
    """Every decoder linear quantized (targeted or not), in the plan's quant type, double quant and
    compute dtype; the embedding, norms and LM head left unquantized in fp32
    (prepare_model_for_kbit_training); only the fp32 adapters train; and the stored bytes are the
    cost model's (quant.quantized_weight_bytes), packed weight and quantization state together."""
    plan = Plan(**{"finetune": "qlora", "lora_targets": QV, **fields})
    net = _quantized(plan)
    stored = 0
    for block in net.layers.values():
        for attr in sorted(Q.LINEARS):
            owner = block.attention if attr in ("wq", "wk", "wv", "wo") else block.feed_forward
            module = getattr(owner, attr)
            adapted = isinstance(module, LoraLinear)
            base = module.base if adapted else module
            assert type(base).__name__ == layer, attr
            assert not base.weight.requires_grad
            if layer == "Linear4bit":
                state = base.weight.quant_state
                assert (state.quant_type, state.nested) == (plan.quant, plan.double_quant)
                assert base.compute_dtype == compute
            if adapted:  # PEFT's lora.Linear4bit clones the base output, lora.Linear8bitLt does not
                assert module.clone_base is (layer == "Linear4bit")
            stored += base.weight.untyped_storage().nbytes()
    state_bytes = sum(t.untyped_storage().nbytes() for t in Q.state_tensors(net))
    linears = L.layer_linears(SMALL).values()
    expected = SMALL.num_layers * sum(quantized_weight_bytes(o, i, plan.quant, plan.double_quant) for i, o in linears)
    assert stored + state_bytes == expected
    for name, p in net.named_parameters():
        if p.dtype not in (torch.uint8, torch.int8):
            assert p.dtype == torch.float32, name
    assert type(net.output) is torch.nn.Linear and type(net.tok_embeddings) is torch.nn.Embedding
    params = trainable(list(net.parameters()))
    assert sum(p.numel() for p in params) == L.trainable_params(SMALL, QV, plan.lora_rank, ())


def test_the_quantized_model_computes_its_dequantized_base_and_trains_its_adapters():
    """With lora_B at zero the nf4 model's logits are those of the same model holding each
    weight dequantized (bitsandbytes' own ``dequantize_4bit``; 4-bit codes put ~20% error on
    these logits, so the unquantized model is no reference); a step moves only the adapters."""
    plan = Plan(finetune="qlora", lora_targets=QV, precision="fp32")
    net = _quantized(plan)
    ref = Transformer(SMALL)
    ref.init_weights(0)
    with torch.no_grad():
        for name, module in net.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                target = ref.get_submodule(name.removesuffix(".base"))
                target.weight.copy_(bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state))
    ids = torch.randint(0, SMALL.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), ref(ids), rtol=1e-4, atol=1e-5)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = torch.optim.AdamW(trainable(list(net.parameters())), lr=1e-2)
    net(ids).logsumexp(-1).mean().backward()
    opt.step()
    moved = {n for n, p in net.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)


def test_autocast_over_a_quantized_base_is_refused_in_one_line():
    plan = Plan(finetune="qlora", precision="bf16-mixed")
    record = run(RunSpec(model=SMALL, workload=TrainingWorkload(seq_len=32, micro_batch=1), plan=plan))
    assert record.status == "unsupported"
    assert record.reason.startswith("precision: ") and "\n" not in record.reason


@pytest.mark.slow  # a launched run imports torch and bitsandbytes again (~19 s on 2 busy cores)
def test_validate_cli_runs_qlora_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    result = validate_tiny_on_cpu(
        tmp_path, monkeypatch, capsys, "--finetune", "qlora", "--quant", "int8", "--lora-rank", "4"
    )
    assert result["status"] == "ok"
    assert abs(result["error_pct"]) <= TOLERANCE_PCT
