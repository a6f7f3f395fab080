"""An LLM.int8 base (``BitsAndBytesConfig(load_in_8bit=True)``: ``hf_bnb.Bnb8bit``, ``int8.py``) under PEFT LoRA
over the families beyond Llama's layout (Qwen3, Phi-3, OLMo 2, Gemma 2, Gemma 3), under the real
``transformers.Trainer`` and the real hand-written loop (``--runtime hf-loop``, ``hf_loop.py``), on CPU: the peak
of live storages over three optimizer steps (``StorageTracker``), equal to the byte on every case.

The Trainer's cases are tests/unit/test_timeline_hf_peft_families.py's shapes (a random model saved and loaded
back in 8 bits, ``prepare_model_for_kbit_training``, ``get_peft_model``; tests/accuracy/hf_peft_steps.py). What
they found: under ``bf16=True`` an int8 linear whose input is already bf16 (the attention's output, the gated
product before ``down_proj``) dequantizes to bf16 and autocast casts nothing (``int8.Int8._cpu``); OLMo 2's first
layer gives its projections the embedding's output unnormed, a leaf that requires grad under checkpointing, whose
bf16 cast autocast caches for the forward (``hf_model.HfLlama.input_cast``); Gemma's ``embed_scale`` stays in
the loaded dtype (``Bnb8bit.stored``).

The loop's cases run peft_steps' loop (``out`` kept to the next forward, with the graph and each int8 linear's
``ctx.A``) with checkpointing as transformers enables it (``gradient_checkpointing_enable()``:
``use_reentrant=False``) and ``enable_input_require_grads``, as peft_steps does over a 16-bit base. PEFT's
``prepare_model_for_kbit_training(model)`` default passes ``{}`` down, so torch's reentrant checkpoint runs
(``reentrant.py``: the layers' forward under ``no_grad`` keeps no ``ctx.A``; over nf4 too): the cases below.
"""

from __future__ import annotations

import dataclasses

import pytest
from estimate_json import estimate_memory
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import peft_steps  # noqa: E402
from peft_steps import PeftCase, plan_of  # noqa: E402
from storage_tracker import StorageTracker  # noqa: E402
from test_timeline_hf_peft_families import FAMILIES, _case  # noqa: E402

from memplan.costmodel.timeline.hf_bnb import Bnb4bit, Bnb8bit  # noqa: E402
from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_loop import hf_loop_run  # noqa: E402
from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
VARIANTS = {
    "fp32": {},
    "all-linear-dropout": dict(targets=("all-linear",), dropout=0.1),
    "ckpt": dict(checkpointing=True),
    "autocast": dict(autocast=True),
    "bf16-base": dict(dtype="bfloat16"),
    "autocast-ckpt": dict(autocast=True, checkpointing=True),
    # the usual recipe over an 8-bit base: a bf16 load, bf16=True, checkpointing
    "recipe": dict(dtype="bfloat16", autocast=True, checkpointing=True),
    "recipe-all-linear": dict(dtype="bfloat16", autocast=True, checkpointing=True, targets=("all-linear",)),
    "all-linear-ckpt": dict(targets=("all-linear",), checkpointing=True),
    "autocast-ckpt-save-head": dict(autocast=True, checkpointing=True, modules_to_save=("lm_head",)),
}
# the default run (the file's time): the Trainer's cases of what these families found, the rest -m slow
DEFAULT = {
    ("phi3", "fp32"),  # the fused qkv_proj (adapters) and gate_up_proj as int8 linears
    ("olmo2", "recipe"),  # layer 0's cached input cast, the bf16 inputs of o_proj and down_proj
    ("gemma3", "bf16-base"),  # embed_scale in the loaded bf16
}


def _int8(arch: str, tag: str, **fields) -> PeftCase:
    return _case(arch, f"int8-{tag}", slow=(arch, tag) not in DEFAULT, quant="int8", **{**VARIANTS[tag], **fields})


CASES = [_int8(arch, tag) for arch in FAMILIES for tag in VARIANTS]


def _quant(case: PeftCase) -> Bnb8bit | Bnb4bit:
    """The plan's 8-bit (or 4-bit) base, loaded in the case's dtype (the plan reads its precision from the compute
    dtype)."""
    plan = plan_of(case)
    return dataclasses.replace(Bnb8bit.of(plan) or Bnb4bit.of(plan), stored=4 if case.dtype == "float32" else 2)


def predict(case: PeftCase, ga: int = 1) -> int:
    """The Trainer's run on CPU's kernels, as test_timeline_hf_peft_families.predict over an 8-bit base."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = plan_of(case)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    return hf_predict(case, plan, ga=ga).peak()[0]  # the base loaded as _quant says (hf_predict.case_quant)


def _param(case: PeftCase):
    return pytest.param(case, marks=pytest.mark.slow) if case.slow else case


@pytest.mark.parametrize("case", [_param(c) for c in CASES], ids=lambda c: c.name)
def test_the_trainer_over_an_8bit_base_peaks_where_the_run_does(case: PeftCase) -> None:
    measured = hf_peft_steps.measure(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


GA = [
    (_int8("gemma3", "autocast-ckpt"), 2),
    (_int8("phi3", "bf16-base"), 2),
    (_int8("qwen3", "fp32", modules_to_save=("embed_tokens",)), 1),
    (_int8("olmo2", "fp32", modules_to_save=("embed_tokens",)), 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ga"), GA, ids=lambda c: getattr(c, "name", str(c)))
def test_accumulation_and_trained_embeddings(case: PeftCase, ga: int) -> None:
    measured = hf_peft_steps.measure(case, ga=ga, steps=STEPS)
    predicted = predict(case, ga)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


# --- the hand-written loop ------------------------------------------------------------------------------------
LOOP_VARIANTS = ("fp32", "ckpt", "autocast", "recipe", "all-linear-dropout")
LOOP_DEFAULT = {("llama", "ckpt")}  # every layer's int8 inputs kept with `out` to the next forward


def _loop_case(arch: str, tag: str) -> PeftCase:
    if arch in FAMILIES:
        case = _case(arch, f"loop-int8-{tag}", quant="int8", **VARIANTS[tag])
    else:
        case = PeftCase(f"loop-int8-{arch}-{tag}", **{**peft_steps.TINY, "arch": arch}, quant="int8", **VARIANTS[tag])
    return dataclasses.replace(case, slow=(arch, tag) not in LOOP_DEFAULT)


LOOP_CASES = [_loop_case(arch, tag) for arch in ("llama", "qwen2", *FAMILIES) for tag in LOOP_VARIANTS]


def _loop_model(case: PeftCase, reentrant: bool = False):
    """peft_steps' 8-bit model; checkpointing as transformers enables it (non-reentrant) with
    ``enable_input_require_grads`` unless ``reentrant`` (PEFT's default: ``peft_steps.build``)."""
    import peft

    if reentrant or not case.checkpointing:
        return peft_steps.build(case)
    model = peft.prepare_model_for_kbit_training(peft_steps._quantized_base(case), use_gradient_checkpointing=False)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = peft.get_peft_model(model, case.lora_config())
    model.train()
    return model


def measure_loop(case: PeftCase, ga: int = 1, reentrant: bool = False) -> int:
    """peft_steps' loop under ``StorageTracker``: the model, its quantization state and the batch counted."""
    model, opt, ids = peft_steps._setup(case, _loop_model(case, reentrant))
    tracker = StorageTracker()
    tracker.track_module(model)
    tracker.track(*peft_steps.quant_state_tensors(model), ids)
    with tracker:
        peft_steps._steps(case, model, opt, ids, STEPS, ga=ga)
    return tracker.peak


def predict_loop(case: PeftCase, ga: int = 1, reentrant: bool = False) -> int:
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = plan_of(case, "hf-loop")
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, runtime="hf-loop", device="cpu") is None, case.name
    sliding = tuple(i for i, kind in enumerate(model.layer_attention_kinds) if kind == "sliding")
    timeline = hf_loop_run(
        hf_dims(model, workload, plan, "hf-loop"), model.tied_embeddings, "cpu_flash", steps=STEPS,
        qkv_bias=model.qkv_bias, window_layers=sliding, arch=model.architecture, extra=family_config(model),
        lora=HfLoraConfig.of(plan, model.architecture), quant=_quant(case), inplace_accumulate=False, ga=ga,
        reentrant=reentrant,
    )  # fmt: skip
    return timeline.peak()[0]


@pytest.mark.parametrize("case", [_param(c) for c in LOOP_CASES], ids=lambda c: c.name)
def test_the_loop_over_an_8bit_base_peaks_where_the_run_does(case: PeftCase) -> None:
    measured, predicted = measure_loop(case), predict_loop(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize("case", [_loop_case("llama", "ckpt"), _loop_case("olmo2", "autocast")], ids=lambda c: c.name)
def test_the_loop_with_accumulation(case: PeftCase) -> None:
    """``loss = out.loss / 2``: the int8 inputs go with the previous iteration's divided loss."""
    measured, predicted = measure_loop(case, ga=2), predict_loop(case, ga=2)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


# PEFT's prepare_model_for_kbit_training(model) default: torch's reentrant checkpoint (reentrant.py: the layers'
# forward under no_grad keeps no ctx.A; each re-run's go with its backward). Before it was followed: over the 8-bit
# base +21.1% (1,575,868 B predicted, 1,300,904 B measured), over nf4 -2.84% (1,122,520 B, 1,155,288 B)
REENTRANT = [
    pytest.param(_loop_case("llama", "ckpt"), id="int8"),
    pytest.param(
        dataclasses.replace(_loop_case("llama", "ckpt"), name="loop-nf4-llama-ckpt", quant="nf4", double_quant=True),
        id="nf4",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", REENTRANT)
def test_the_loop_under_peft_s_default_reentrant_checkpoint(case: PeftCase) -> None:
    """``prepare_model_for_kbit_training(model)`` checkpoints reentrantly: the run with ``reentrant.py``'s checkpoint
    (the loop's default over a quantized base, ``specs.plan.checkpoint_reentrant``) equal to the byte."""
    measured, predicted = measure_loop(case, reentrant=True), predict_loop(case, reentrant=True)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


# --- the estimate -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("olmo2-7b", ["--runtime", "hf"]),
        ("gemma3-12b", ["--runtime", "hf", "--seq-len", "512"]),  # under its 1024-token window
        ("phi3-mini", ["--runtime", "hf", "--lora-targets", "qkv_proj,o_proj"]),
        pytest.param("qwen3-8b", ["--runtime", "hf-loop"], marks=pytest.mark.slow),
        pytest.param("gemma2-9b", ["--runtime", "hf", "--recompute", "full"], marks=pytest.mark.slow),
        pytest.param("llama3-8b", ["--runtime", "hf-loop", "--recompute", "full"], marks=pytest.mark.slow),
    ],
)
def test_the_estimate_answers_an_8bit_base_op_level(capsys, name: str, args: list[str]) -> None:
    """``--quant int8`` over each family under the Trainer, and under the loop where its LoRA is followed: the
    op-level run answers it (before: refused, or the phase model)."""
    seq = [] if "--seq-len" in args else ["--seq-len", "1024"]
    memory = estimate_memory(capsys, [name, "--finetune", "qlora", "--quant", "int8", *seq, *args])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
