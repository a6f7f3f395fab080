"""``--precision bf16`` under ``--runtime hf``: the Trainer's usual recipe, a bfloat16 model under
``TrainingArguments(bf16=True)`` (accelerate's autocast around the forward and the loss), as memplan's
exporters write it (``export/hf_trainer.py`` ``PRECISION``), answered by the op-level run from the plan.

Each case goes from a :class:`Plan` (``hf_support.hf_supported`` accepts it, ``hf_trainer.hf_dims``
makes its shapes) to the run on CPU's kernels, against the real ``Trainer.train()`` counted by
``StorageTracker`` (tests/accuracy/hf_steps.py, hf_peft_steps.py), equal to the byte: full fine-tuning
(Llama, Qwen2 with its biases; tied embeddings and checkpointing), PEFT LoRA (fp32 adapters over the
bf16 base, ``autocast_adapter_dtype=True``; with the Trainer's gradient checkpointing, whose recompute
runs under the autocast state the checkpoint saved) and the 4-bit QLoRA recipe (nf4, double
quantization, ``bnb_4bit_compute_dtype=bfloat16``, ``prepare_model_for_kbit_training``) at a micro-batch
over 1536 tokens, where the run follows bitsandbytes' CUDA path. The LLM.int8 recipe is in
test_timeline_int8.py (``int8-recipe``, from the same plan). As in test_timeline_hf.py the run is compared
with ``inplace_accumulate=False`` (the tracker holds each storage's Python object).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
from hf_predict import hf_predict  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
SMALL = dict(hf_steps.BASE_SMALL)


def _full(name: str, **fields) -> hf_steps.Case:
    return hf_steps.Case(f"hfbf16-{name}", loop="trainer", dtype="bfloat16", autocast=True, **fields)


FULL = [
    _full("mha", **SMALL),
    _full("gqa-tied-ckpt", **{**SMALL, "kv_heads": 1}, tied=True, checkpointing=True),
    _full("vocab-tied", **hf_steps.VOCAB_SMALL, tied=True),  # the logits' fp32 copy dominates
    _full("qwen2-gqa-ckpt", **{**SMALL, "kv_heads": 1}, arch="qwen2", checkpointing=True),
    _full("layers-gqa", **hf_steps.LAYERS_SMALL, slow=True),
]


def _predict(case, plan: Plan) -> int:
    """The run's peak for the case's config.json under ``plan``, which the hf run must accept."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, "hf") is None, case.name
    d = hf_dims(model, workload, plan)
    assert d.autocast and (d.pd == 2) == (plan.quant == "none"), case.name  # bf16 weights under bf16=True
    return hf_predict(case, plan).peak()[0]


def _params(cases):
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


@pytest.mark.parametrize("case", _params(FULL))
def test_full_fine_tuning_equals_the_trainers_peak(case: hf_steps.Case) -> None:
    assert case.precision == "bf16"
    plan = Plan(precision="bf16", recompute="full" if case.checkpointing else "none")
    measured = hf_steps.measure_peak(case, steps=STEPS)
    predicted = _predict(case, plan)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def _lora(name: str, **fields) -> PeftCase:
    return PeftCase(f"hfbf16-{name}", **{**TINY, "dtype": "bfloat16", "autocast": True, **fields})


LORA = [
    _lora("lora-qv"),
    _lora("lora-all-linear-ckpt", targets=("all-linear",), checkpointing=True),
    _lora("lora-qwen2-attn-ckpt-dropout", arch="qwen2", targets=("q_proj", "k_proj", "v_proj", "o_proj"),
          checkpointing=True, dropout=0.1),
    _lora("lora-tied-save-head", tied=True, modules_to_save=("lm_head",), slow=True),
    # QLoRA as its guides write it, at 2048 tokens a micro-batch: every 4-bit linear dequantizes on CUDA
    _lora("qlora-nf4-dq-ckpt", quant="nf4", double_quant=True, checkpointing=True, targets=("all-linear",),
          seq=1024),
    _lora("qlora-qwen2-nf4", arch="qwen2", quant="nf4", seq=1024, slow=True),
]  # fmt: skip


@pytest.mark.parametrize("case", _params(LORA))
def test_peft_equals_the_trainers_peak(case: PeftCase) -> None:
    if case.quant != "none":
        pytest.importorskip("bitsandbytes")
    plan = plan_of(case)
    assert plan.precision == "bf16"
    measured = hf_peft_steps.measure(case, steps=STEPS)
    predicted = _predict(case, plan)  # a 4-bit base loaded in bf16 (hf_predict.case_quant)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_bf16_is_bf16_true_under_the_trainer_alone() -> None:
    """``bf16`` runs under autocast for the Trainer (``hf``), not for the hand-written loop (``hf-loop``:
    a bf16 model trained as it is); ``bf16-mixed`` under both; fp32 under neither."""
    model = model_from_data(_full("dims").hf_config(), "dims/config.json", "dims")
    workload = TrainingWorkload(seq_len=64, micro_batch=1)
    autocast = {
        (p, r): hf_dims(model, workload, Plan(precision=p), r).autocast
        for p in ("bf16", "bf16-mixed", "fp32")
        for r in ("hf", "hf-loop")
    }
    assert autocast == {
        ("bf16", "hf"): True,
        ("bf16", "hf-loop"): False,
        ("bf16-mixed", "hf"): True,
        ("bf16-mixed", "hf-loop"): True,
        ("fp32", "hf"): False,
        ("fp32", "hf-loop"): False,
    }
