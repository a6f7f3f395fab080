"""The op-level run of ``transformers.Trainer`` over a PEFT LoRA model (``timeline/hf_lora.py``) against
the real Trainer on CPU: the peak of live storages over three optimizer steps, counted by
``StorageTracker`` (tests/accuracy/hf_peft_steps.py), equal to the byte on every case.

Cases: adapters on q/v, attention, MLP, one linear or all linears, rank 4 and 16, dropout 0 and 0.1,
``modules_to_save`` (lm_head, tied or not; embed_tokens), fp32 and bf16 bases, the Trainer's
``bf16=True`` over an fp32 base and over a bf16 one (PEFT's fp32 adapters run in bf16), the Trainer's
gradient checkpointing (with ``enable_input_require_grads``), Mistral and Qwen2 (q/k/v biases,
frozen), and gradient accumulation. As in test_timeline_hf.py the run is compared with
``inplace_accumulate=False`` (the tracker holds each storage's Python object).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
from hf_predict import hf_predict  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402

from memplan.costmodel.timeline.events import ALLOC  # noqa: E402

STEPS = 3
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# layer-dominated: the decoder layers' saved tensors outweigh the logits
LAYERS = dict(TINY, layers=6, vocab=256, seq=128, batch=4, hidden=96, heads=3, kv_heads=1, ffn=256)


def _case(name: str, **fields) -> PeftCase:
    return PeftCase(f"hfpeft-{name}", **{**TINY, **fields})


CASES = [
    _case("fp32-qv"),
    _case("fp32-all-linear", targets=("all-linear",)),
    _case("fp32-mlp-r16", targets=MLP, rank=16),
    _case("fp32-o", targets=("o_proj",)),
    _case("fp32-qv-dropout", dropout=0.1),
    _case("fp32-save-head", modules_to_save=("lm_head",)),
    _case("fp32-tied-save-head", tied=True, modules_to_save=("lm_head",)),
    _case("fp32-save-embed", modules_to_save=("embed_tokens",)),
    _case("fp32-ckpt", checkpointing=True),
    _case("fp32-ckpt-all-linear-dropout", checkpointing=True, targets=("all-linear",), dropout=0.1),
    _case("bf16-qv", dtype="bfloat16"),
    _case("bf16-all-linear-dropout", dtype="bfloat16", targets=("all-linear",), dropout=0.1),
    _case("bf16-ckpt-save-head", dtype="bfloat16", checkpointing=True, modules_to_save=("lm_head",)),
    # the Trainer's bf16=True: autocast over an fp32 base, and over a bf16 base with fp32 adapters
    _case("autocast-qv", autocast=True),
    _case("autocast-ckpt", autocast=True, checkpointing=True),
    _case("autocast-bf16-base-qv", autocast=True, dtype="bfloat16"),
    _case(
        "autocast-bf16-base-ckpt-save-head",
        autocast=True,
        dtype="bfloat16",
        checkpointing=True,
        modules_to_save=("lm_head",),
    ),
    _case("mistral-fp32-qv", arch="mistral"),
    _case("qwen2-fp32-tied-ckpt-dropout", arch="qwen2", tied=True, checkpointing=True, dropout=0.1),
    _case("qwen2-bf16-attn", arch="qwen2", dtype="bfloat16", targets=ATTN),
    _case("qwen2-autocast-attn", arch="qwen2", dtype="bfloat16", targets=ATTN, autocast=True),
    PeftCase("hfpeft-layers-fp32-all-linear", **{**LAYERS, "targets": ("all-linear",)}),
    PeftCase("hfpeft-layers-fp32-all-linear-ckpt", **{**LAYERS, "targets": ("all-linear",)}, checkpointing=True),
    PeftCase("hfpeft-layers-autocast-dropout", **{**LAYERS, "layers": 4, "batch": 2}, autocast=True, dropout=0.1),
    # bitsandbytes 4-bit bases through prepare_model_for_kbit_training (loaded in fp32 or bf16; compute
    # dtype bnb_4bit_compute_dtype), CPU backend
    _case("qlora-nf4-fp32", quant="nf4", compute_dtype="float32"),
    _case("qlora-nf4-dq-bf16", quant="nf4", double_quant=True),
    _case("qlora-fp4-bf16-all-linear-dropout", quant="fp4", targets=("all-linear",), dropout=0.1),
    _case(
        "qlora-nf4-dq-ckpt-save-head", quant="nf4", double_quant=True, checkpointing=True, modules_to_save=("lm_head",)
    ),
    _case("qlora-nf4-dq-bf16-base", quant="nf4", double_quant=True, dtype="bfloat16"),
    # the usual recipe: bf16 base, nf4 with double quantization, bf16 compute, bf16=True, checkpointing
    _case("qlora-recipe", quant="nf4", double_quant=True, dtype="bfloat16", autocast=True, checkpointing=True),
    _case("qlora-fp4-autocast-all-linear-dropout", quant="fp4", autocast=True, targets=("all-linear",), dropout=0.1),
    PeftCase(
        "hfpeft-layers-qlora-nf4-dq-all-linear",
        **{**LAYERS, "targets": ("all-linear",)},
        quant="nf4",
        double_quant=True,
    ),
]


def predict(case: PeftCase, ga: int = 1, dp: int = 1) -> int:
    """The run's peak for the case, on CPU's kernels, ``ga`` micro-batches per optimizer step, on one
    of ``dp`` ranks (DDP)."""
    plan = plan_of(case).model_copy(update={"dp": dp})
    return hf_predict(case, plan, ga=ga).peak()[0]  # a 4-bit base loaded in the case's dtype


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_peak_equals_the_trainers(case: PeftCase) -> None:
    measured = hf_peft_steps.measure(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


GA_CASES = [
    (_case("ga2-fp32-qv"), 2),
    (_case("ga3-bf16-ckpt", dtype="bfloat16", checkpointing=True), 3),
    (_case("ga2-autocast-save-head", autocast=True, modules_to_save=("lm_head",)), 2),
    (_case("ga2-qlora-recipe", quant="nf4", double_quant=True, dtype="bfloat16", autocast=True, checkpointing=True), 2),
]


@pytest.mark.parametrize(("case", "ga"), GA_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_peak_with_gradient_accumulation(case: PeftCase, ga: int) -> None:
    measured = hf_peft_steps.measure(case, ga=ga, steps=STEPS)
    predicted = predict(case, ga=ga)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_each_case_differs() -> None:
    everything = [*CASES, *(c for c, _ in GA_CASES)]
    assert len({dataclasses.astuple(c)[1:] for c in CASES}) == len(CASES)
    assert {c.quant for c in everything} == {"none", "nf4", "fp4"}


def test_adapters_are_trained_and_the_base_is_not() -> None:
    """The run's optimizer states are the adapters' (fp32, two per adapter) and the trained copy's,
    never the frozen base's: the states of fp32-save-head add up to PEFT's trainable parameters."""
    case = next(c for c in CASES if c.name == "hfpeft-fp32-save-head")
    events = hf_predict(case, plan_of(case)).events
    states = sum(e.size for e in events if e.op == ALLOC and e.tag.endswith(("exp_avg", "exp_avg_sq")))
    peft_model = hf_peft_steps.build(case)
    trainable = sum(p.numel() * p.element_size() for p in peft_model.parameters() if p.requires_grad)
    assert states == 2 * trainable
