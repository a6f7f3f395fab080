"""torch's reentrant checkpoint (``use_reentrant=True``: ``timeline/reentrant.py``) under the real
``transformers.Trainer`` (``gradient_checkpointing_kwargs={"use_reentrant": True}``) and the real hand-written loop
(``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``; over a quantized
base PEFT's ``prepare_model_for_kbit_training(model)``, which leaves torch its default, True: the three cases of
test_timeline_hf_int8_families.py and test_timeline_hf_loop_peft_families.py), on CPU: the peak of live storages
over three optimizer steps (``StorageTracker``) equal to the run's, full fine-tuning, LoRA, QLoRA (nf4) and an
LLM.int8 base over Llama's layout and the families. A few cases run by default (seconds); the rest under ``-m slow``.

The mechanism (reentrant.py): the layers' forward under ``no_grad`` (no saved tensor, no ``ctx.A``), each layer's
``CheckpointFunctionBackward`` holding its input, its partial's tensors (the rotary tables, the position ids) kept
with the graph (to the next forward under the hand loop, which keeps ``out``), and in the backward the layer re-run
whole with its recomputed output alive through the nested backward.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import family_steps  # noqa: E402
import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
import peft_steps  # noqa: E402
import test_timeline_hf_loop_families as F  # noqa: E402
from hf_predict import case_quant  # noqa: E402
from peft_steps import PeftCase, plan_of  # noqa: E402
from storage_tracker import StorageTracker  # noqa: E402
from test_timeline_hf_loop_families import _fp32_score_bias  # noqa: E402
from test_timeline_hf_peft_families import QLORA_RECIPE  # noqa: E402
from test_timeline_hf_peft_families import _case as _lora  # noqa: E402
from test_timeline_hf_quant_moe import EXTRA as QUANT_MOE_EXTRA  # noqa: E402

from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_loop import hf_loop_run  # noqa: E402
from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims, hf_run  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan, checkpoint_reentrant  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
KWARGS = {"use_reentrant": True}


# --- measured -------------------------------------------------------------------------------------------------------
def _reentrant_args(model, args, ids) -> None:  # noqa: ANN001, ARG001
    """``TrainingArguments(gradient_checkpointing_kwargs={"use_reentrant": True})`` (5.23's alias of
    ``activation_checkpointing_kwargs``, which ``train()`` reads)."""
    args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = dict(KWARGS)


def _peft_model(case: PeftCase, loop: str):  # noqa: ANN202
    """The case's PEFT model: over a quantized base ``prepare_model_for_kbit_training(model)`` (reentrant; the Trainer
    re-enables checkpointing with the args' kwargs), over a 16-bit one for the loop the base checkpointed reentrantly
    with ``enable_input_require_grads`` (what PEFT does over a quantized one), for the Trainer left to its args."""
    import peft

    if case.quant != "none":
        return peft_steps.build(case)
    plain = peft_steps.build(dataclasses.replace(case, checkpointing=False))
    if loop == "trainer":
        return plain
    base = plain.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(KWARGS))
    base.enable_input_require_grads()
    plain.train()
    assert isinstance(plain, peft.PeftModel)
    return plain


def measure_peft(case: PeftCase, loop: str) -> int:
    """peft_steps' loop (``loop="hand"``) or ``Trainer.train()`` over the case's PEFT model, three steps."""
    model = _peft_model(case, loop)
    tracker = StorageTracker()
    if loop == "hand":
        model, opt, ids = peft_steps._setup(case, model)
        tracker.track_module(model)
        tracker.track(ids, *peft_steps.quant_state_tensors(model))
        with tracker:
            peft_steps._steps(case, model, opt, ids, STEPS)
        return tracker.peak
    return hf_peft_steps.train_peak(case, model, 1, STEPS, tracker, lambda args: _reentrant_args(model, args, None))


def measure_full(case: hf_steps.Case) -> int:
    """Full fine-tuning: the Trainer with the reentrant kwargs, or the hand loop over a model checkpointed so
    (DeepSeek-V3's score bias in fp32 first, as ``from_pretrained`` keeps it: test_timeline_hf_loop_families.py)."""

    def loaded(model) -> None:  # noqa: ANN001
        if case.arch == "deepseek_v3":
            _fp32_score_bias(model)

    def trainer(model, args, ids) -> None:  # noqa: ANN001
        loaded(model)
        _reentrant_args(model, args, ids)

    def hand(model) -> None:  # noqa: ANN001
        loaded(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=KWARGS)

    if case.loop == "trainer":
        return hf_steps._measure_trainer(case, STEPS, trainer)
    plain = dataclasses.replace(case, checkpointing=False)  # measure_hand's own enable is non-reentrant
    return hf_steps.measure_hand(plain, STEPS, hand)


# --- predicted ------------------------------------------------------------------------------------------------------
def predict(case, plan: Plan, lora: bool) -> int:  # noqa: ANN001
    """The run of the case's runtime on CPU's kernels with the plan's checkpoint (``checkpoint_reentrant``)."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    runtime = "hf" if case.loop == "trainer" else "hf-loop"
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, runtime=runtime, device="cpu") is None, case.name
    reentrant = checkpoint_reentrant(plan, runtime)
    assert reentrant, case.name
    d = hf_dims(model, workload, plan, runtime)
    common = dict(
        steps=STEPS, qkv_bias=model.qkv_bias, arch=model.architecture, extra=family_config(model),
        lora=HfLoraConfig.of(plan, model.architecture) if lora else None,
        quant=case_quant(case, plan) if lora else None,
        inplace_accumulate=False, reentrant=reentrant,
        subclass_like=model.moe is not None,  # the tracker's dispatch mode (hf_moe_ops.zeros_then_put)
    )  # fmt: skip
    if runtime == "hf":
        timeline = hf_run(d, model.tied_embeddings, "cpu_flash", batches=STEPS, **common)
    else:
        sliding = tuple(i for i, kind in enumerate(model.layer_attention_kinds) if kind == "sliding")
        timeline = hf_loop_run(d, model.tied_embeddings, "cpu_flash", window_layers=sliding, **common)
    return timeline.peak()[0]


def _peft_plan(case: PeftCase) -> Plan:
    """peft_steps' plan, the checkpoint said (the loop's default over a quantized base is already reentrant)."""
    runtime = "hf" if case.loop == "trainer" else "hf-loop"
    return plan_of(case, runtime).model_copy(update={"use_reentrant": True})


def _full_plan(case: hf_steps.Case) -> Plan:
    return Plan(precision=case.precision, autocast=case.plan_autocast, recompute="full", use_reentrant=True)


# --- the cases ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Loop:
    """A PEFT case under one loop (``trainer`` or ``hand``)."""

    case: PeftCase
    loop: str
    slow: bool = True

    def __getattr__(self, name: str):  # noqa: ANN204  (the case's fields: predict reads them)
        return getattr(self.case, name)


_FAMILY = {c.name: c for c in family_steps.BASE}
LLAMA = dict(hf_steps.BASE_SMALL, layers=2)
FULL = [
    pytest.param(  # the peak is the loss's backward, either checkpoint's: slow
        hf_steps.Case("reentrant-llama-fp32", loop="trainer", checkpointing=True, **LLAMA),
        id="trainer-llama-fp32",
        marks=pytest.mark.slow,
    ),
    pytest.param(hf_steps.Case("reentrant-llama-fp32-hand", checkpointing=True, **LLAMA), id="hand-llama-fp32"),
    pytest.param(
        dataclasses.replace(
            _FAMILY["qwen3"], name="reentrant-qwen3-autocast", loop="trainer", autocast=True, checkpointing=True
        ),
        id="trainer-qwen3-autocast",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        dataclasses.replace(_FAMILY["olmo2"], name="reentrant-olmo2-fp32-hand", checkpointing=True),
        id="hand-olmo2",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        dataclasses.replace(_FAMILY["gemma3"], name="reentrant-gemma3-fp32", loop="trainer", checkpointing=True),
        id="trainer-gemma3",
        marks=pytest.mark.slow,
    ),
    # MoE and MLA (test_timeline_hf_loop_families.py's shapes): the experts' and the router's ops in the re-run
    *(
        pytest.param(
            dataclasses.replace(F._case(f"reentrant-{name}", arch, extra, shape), loop=loop, checkpointing=True),
            id=f"{loop}-{name}",
            marks=() if (loop, name) == ("hand", "deepseek-v3") else pytest.mark.slow,  # 0.3 s: by default
        )
        for loop, name, arch, extra, shape in [
            ("hand", "mixtral", "mixtral", F.MIXTRAL, F.MOE),
            ("hand", "qwen2-moe", "qwen2_moe", F.QWEN2, F.MOE),
            ("hand", "deepseek-v3", "deepseek_v3", F.MLA + F.ROUTER, F.MLA_SHAPE),
            ("trainer", "mixtral", "mixtral", F.MIXTRAL, F.MOE),
            ("trainer", "deepseek-v2", "deepseek_v2", F.V2, F.MLA_SHAPE),
            ("trainer", "deepseek-v3", "deepseek_v3", F.MLA + F.ROUTER, F.MLA_SHAPE),
        ]
    ),
]


@pytest.mark.parametrize("case", FULL)
def test_full_fine_tuning_under_the_reentrant_checkpoint(case: hf_steps.Case) -> None:
    measured, predicted = measure_full(case), predict(case, _full_plan(case), lora=False)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


CKPT = dict(checkpointing=True)


def _quant_moe(arch: str, quant: str) -> PeftCase:
    """test_timeline_hf_quant_moe.py's tiny MoE over a quantized base, checkpointed."""
    fields = {**peft_steps.TINY, "arch": arch, "extra": QUANT_MOE_EXTRA[arch], "quant": quant, **CKPT}
    return PeftCase(f"reentrant-{arch}-{quant}", **fields)


PEFT = [
    Loop(_lora("qwen3", "reentrant-fp32", **CKPT), "trainer", slow=False),
    Loop(_lora("qwen3", "reentrant-fp32", **CKPT), "hand", slow=False),
    Loop(_lora("phi3", "reentrant-autocast-dropout", autocast=True, dropout=0.1, **CKPT), "trainer"),
    Loop(_lora("olmo2", "reentrant-bf16", dtype="bfloat16", **CKPT), "hand"),
    Loop(_lora("gemma2", "reentrant-fp32", **CKPT), "trainer"),
    # QLoRA (the recipe: a bf16 base in nf4, double quantization, bf16=True) and LLM.int8 bases
    Loop(_lora("qwen3", "reentrant-qlora-recipe", **QLORA_RECIPE), "trainer"),
    Loop(_lora("gemma3", "reentrant-qlora-recipe", **QLORA_RECIPE), "hand"),
    Loop(_lora("qwen3", "reentrant-int8", quant="int8", **CKPT), "trainer"),
    Loop(_lora("phi3", "reentrant-int8-autocast", quant="int8", autocast=True, **CKPT), "hand"),
    Loop(PeftCase("reentrant-llama-int8", **peft_steps.TINY, quant="int8", **CKPT), "trainer"),
    # the loop's default over a quantized MoE base: PEFT's reentrant checkpoint over fp32 experts (hf_bnb's linears)
    Loop(_quant_moe("mixtral", "nf4"), "hand", slow=False),
    Loop(_quant_moe("qwen3_moe", "int8"), "hand"),
]


@pytest.mark.parametrize(
    "run", [pytest.param(r, marks=[pytest.mark.slow] if r.slow else [], id=f"{r.loop}-{r.case.name}") for r in PEFT]
)
def test_peft_under_the_reentrant_checkpoint(run: Loop) -> None:
    measured, predicted = measure_peft(run.case, run.loop), predict(run, _peft_plan(run), lora=True)
    assert predicted == measured, f"{run.loop} {run.case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_cases_span_the_mechanisms() -> None:
    """Both loops over full fine-tuning, LoRA, QLoRA and LLM.int8, over Llama's layout and the dense families, and
    full fine-tuning over MoE (Mixtral, Qwen2-MoE) and MLA (DeepSeek-V2 / V3)."""
    loops = {(r.loop, r.case.quant) for r in PEFT}
    assert {("trainer", "none"), ("hand", "none"), ("trainer", "nf4"), ("hand", "nf4"), ("trainer", "int8")} <= loops
    assert {("hand", "int8")} <= loops
    archs = {r.case.arch for r in PEFT} | {p.values[0].arch for p in FULL}
    assert archs >= {"llama", "qwen3", "phi3", "olmo2", "gemma2", "gemma3", "mixtral", "qwen2_moe", "deepseek_v3"}
