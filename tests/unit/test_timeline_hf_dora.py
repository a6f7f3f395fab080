"""PEFT DoRA (``LoraConfig(use_dora=True)``) in the op-level run (``timeline/hf_dora.py``) against the real
``transformers.Trainer`` and the hand-written loop on CPU: the peak of live storages over three optimizer
steps (``StorageTracker``, tests/accuracy/hf_peft_steps.py), equal to the byte.

DoRA differs from LoRA in its forward (the in x in identity through the adapters, ``W + scaling * B @ A`` and
its row norms, the base's output and the adapters' saved by the magnitude's products, the base run again on
the dropped-out input when ``lora_dropout`` > 0) and in a trained fp32 magnitude per output feature. Cases:
fp32, bf16 and autocast bases (the Trainer's ``bf16=True`` over fp32 and over bf16), dropout, the Trainer's
checkpointing and torch's reentrant one, all linears, ``modules_to_save``, Mistral, Qwen2 (its q/k/v biases:
``base_result - bias``), Qwen3, Phi-3 (fused projections), OLMo 2, Gemma 2 and 3, gradient accumulation, the hand
loop (``--runtime hf-loop``), and QDoRA over 4-bit bases (nf4 / fp4, double quantization, the usual recipe). One
Trainer case runs by default (seconds) with the checks that cost no training (the magnitude trained, the callback
reading ``use_dora``, refusals in one line, the time's warning); the rest under ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_ddp_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_peft_steps  # noqa: E402
from hf_predict import hf_predict  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402
from test_timeline_hf_loop_peft_families import measure_peft  # noqa: E402
from test_timeline_hf_loop_peft_families import predict as predict_loop  # noqa: E402
from test_timeline_hf_optimizers import LORA as OPTIMIZER_SHAPE  # noqa: E402
from test_timeline_hf_optimizers import _measure_lora as measure_optimizer  # noqa: E402
from test_timeline_hf_optimizers import _predict_lora as predict_optimizer  # noqa: E402
from test_timeline_hf_peft import predict as predict_ranks  # noqa: E402
from test_timeline_hf_peft_families import _case as _family_case  # noqa: E402
from test_timeline_reentrant import Loop, _peft_plan  # noqa: E402
from test_timeline_reentrant import measure_peft as measure_reentrant  # noqa: E402
from test_timeline_reentrant import predict as predict_reentrant  # noqa: E402

from memplan.costmodel.timeline.events import ALLOC  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402

STEPS = 3
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
HEAD = ("lm_head",)
ALL_DROPOUT = {"targets": ("all-linear",), "dropout": 0.1}
QDORA = {"quant": "nf4", "double_quant": True}
ALL_DROPOUT_AUTOCAST = {"targets": ("all-linear",), "dropout": 0.1, "autocast": True}


def _case(name: str, slow: bool = True, **fields) -> PeftCase:
    return PeftCase(f"hfdora-{name}", **{**TINY, "dora": True, "slow": slow, **fields})


CASES = [
    _case("fp32-qv", slow=False),
    _case("bf16-qv", dtype="bfloat16"),
    _case("autocast-qv", autocast=True),
    _case("autocast-bf16-base-qv", autocast=True, dtype="bfloat16"),
    _case("fp32-qv-dropout", dropout=0.1),
    _case("bf16-all-linear-dropout", dtype="bfloat16", dropout=0.1, targets=("all-linear",)),
    _case("autocast-dropout", autocast=True, dropout=0.1),
    _case("fp32-ckpt", checkpointing=True),
    _case("fp32-all-linear", targets=("all-linear",)),
    _case("autocast-ckpt", autocast=True, checkpointing=True),
    _case("fp32-ckpt-all-linear-dropout", checkpointing=True, dropout=0.1, targets=("all-linear",)),
    _case("autocast-bf16-ckpt-save-head", autocast=True, dtype="bfloat16", checkpointing=True, modules_to_save=HEAD),
    _case("mistral-bf16-qv", arch="mistral", dtype="bfloat16"),
    _case("qwen2-fp32-attn", arch="qwen2", targets=ATTN),
    _case("qwen2-autocast-attn-dropout", arch="qwen2", dtype="bfloat16", autocast=True, targets=ATTN, dropout=0.1),
    *(
        dataclasses.replace(_family_case(arch, tag, dora=True, **fields), name=f"hfdora-{arch}-{tag}")
        for arch, tag, fields in [
            ("qwen3", "fp32-qv", {}),
            ("phi3", "fp32-qkv", {}),
            ("olmo2", "fp32-all-linear", {"targets": ("all-linear",)}),
            ("gemma2", "fp32-qv", {}),
            ("gemma3", "fp32-qv-ckpt", {"checkpointing": True}),
            ("phi3", "autocast-all-linear-dropout", {"autocast": True, "targets": ("all-linear",), "dropout": 0.1}),
            ("gemma3", "bf16-all-linear", {"dtype": "bfloat16", "targets": ("all-linear",)}),
        ]
    ),
    # QDoRA: a 4-bit base (prepare_model_for_kbit_training), dequantized in each forward for the norm
    _case("qdora-nf4-fp32", quant="nf4", compute_dtype="float32"),
    _case("qdora-nf4-dq-bf16", **QDORA),
    _case("qdora-recipe", **QDORA, dtype="bfloat16", autocast=True, checkpointing=True),
    _case("qdora-fp4-all-linear-dropout", quant="fp4", **ALL_DROPOUT),
    _case("qdora-nf4-dq-bf16-base", **QDORA, dtype="bfloat16"),
    _case("qdora-fp4-autocast-all-linear-dropout", quant="fp4", autocast=True, **ALL_DROPOUT),
]


def _params(cases: list) -> list:
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


@pytest.mark.parametrize("case", _params(CASES))
def test_peak_equals_the_trainers(case: PeftCase) -> None:
    measured = hf_peft_steps.measure(case, steps=STEPS)
    predicted = hf_predict(case, plan_of(case)).peak()[0]
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


GA_CASES = [(_case("ga2-autocast-ckpt", autocast=True, checkpointing=True), 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ga"), GA_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_peak_with_gradient_accumulation(case: PeftCase, ga: int) -> None:
    measured = hf_peft_steps.measure(case, ga=ga, steps=STEPS)
    predicted = hf_predict(case, plan_of(case), ga=ga).peak()[0]
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


LOOP_CASES = [
    _case("loop-fp32-qv"),
    _case("loop-bf16-dropout", dtype="bfloat16", dropout=0.1),
    _case("loop-fp32-ckpt-all-linear", checkpointing=True, targets=("all-linear",)),
    _case("loop-qdora-nf4-dq-bf16-dropout", **QDORA, dropout=0.1),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: c.name)
def test_peak_equals_the_hand_loops(case: PeftCase) -> None:
    """``--runtime hf-loop``: peft_steps' loop (AdamW(foreach=True), ``out`` kept to the next forward)."""
    measured, predicted = measure_peft(case), predict_loop(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


REENTRANT = [
    Loop(_case(f"reentrant-{loop}-{tag}", checkpointing=True, **fields), loop)
    for loop in ("trainer", "hand")
    for tag, fields in [("fp32-qv", {}), ("autocast-all-linear-dropout", ALL_DROPOUT_AUTOCAST)]
]


@pytest.mark.slow
@pytest.mark.parametrize("run", REENTRANT, ids=lambda r: r.case.name)
def test_peak_under_the_reentrant_checkpoint(run: Loop) -> None:
    """torch's reentrant checkpoint (``use_reentrant: true``): the forward under no_grad (no graph for
    ``lora_weight``), the re-run in the backward with it (test_timeline_reentrant.py's harness)."""
    measured = measure_reentrant(run.case, run.loop)
    predicted = predict_reentrant(run, _peft_plan(run), lora=True)
    assert predicted == measured, f"{run.case.name}: {predicted:,} B predicted, {measured:,} B measured"


DDP_CASES = [
    (_case("ddp-qv"), 1),
    (_case("ddp-autocast-all-linear-ckpt-ga2", autocast=True, targets=("all-linear",), checkpointing=True), 2),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ga"), DDP_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_peak_under_ddp(case: PeftCase, ga: int) -> None:
    """The Trainer's DDP over two gloo ranks (test_timeline_hf_ddp.py's harness): rank 0's peak; the magnitudes
    in DDP's buckets beside the adapters."""
    measured = hf_ddp_steps.measure(case, ga)
    predicted = predict_ranks(case, ga=ga, dp=hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


OPTIMIZERS = ("sgd", "adafactor", "adamw-8bit", "paged-lion-32bit")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_peak_under_the_trainers_other_optimizers(optimizer: str) -> None:
    """``TrainingArguments(optim=...)`` (test_timeline_hf_optimizers.py's harness): the magnitude a vector among the
    parameters each optimizer steps (Adafactor's unfactored state, bitsandbytes' 8-bit and 32-bit states)."""
    case = PeftCase(f"hfdora-opt-{optimizer}", **{**OPTIMIZER_SHAPE, "dora": True})
    measured, predicted = measure_optimizer(case, optimizer), predict_optimizer(case, optimizer)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_magnitude_is_trained_beside_the_adapters() -> None:
    """The run's optimizer states are two per trainable parameter PEFT's DoRA model has: A, B and the magnitude
    (``lora_magnitude_vector``, fp32, one per output feature)."""
    case = CASES[0]
    events = hf_predict(case, plan_of(case)).events
    states = sum(e.size for e in events if e.op == ALLOC and e.tag.endswith(("exp_avg", "exp_avg_sq")))
    peft_model = hf_peft_steps.build(case)
    trained = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lora_magnitude_vector" in n for n in trained)
    assert states == 2 * sum(p.numel() * p.element_size() for p in trained.values())


def test_dora_is_never_answered_as_lora() -> None:
    """The same plan without ``lora_dora`` peaks lower (DoRA's saves); a plan the run does not follow is refused
    in one line naming the field, never handed to the phase model (which has no DoRA)."""
    from memplan.api import estimate

    case = CASES[0]
    lora = dataclasses.replace(case, dora=False)
    assert hf_predict(case, plan_of(case)).peak()[0] > hf_predict(lora, plan_of(lora)).peak()[0]
    for plan, runtime, reason in [
        (dict(finetune="lora", quant="int8"), "hf", "LLM.int8"),
        (dict(finetune="lora"), "memplan", "--runtime hf or hf-loop alone"),
        (dict(finetune="lora", offload_activations="cpu", dp=2), "hf", "activation offload over more than one rank"),
    ]:
        with pytest.raises(MemplanError) as err:
            gpus = plan.get("dp", 1)
            estimate(
                "llama3-8b", {**plan, "lora_dora": True}, {"seq_len": 512}, runtime=runtime, device="cpu", gpus=gpus
            )
        assert err.value.field == "plan.lora_dora" and reason in str(err.value) and "\n" not in str(err.value)


def _args(out: str, **kw) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=3, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, **kw,
    )  # fmt: skip


def test_the_callback_reads_use_dora() -> None:
    from memplan.integrations.transformers import trainer_plan

    model = hf_peft_steps.build(CASES[0])
    with tempfile.TemporaryDirectory() as out:
        plan = trainer_plan(model, _args(out), seq_len=64)["plan"]
    assert plan["lora_dora"] is True and plan["finetune"] == "lora"


def test_the_callback_warns_in_one_line_on_dora_it_does_not_follow(caplog) -> None:
    """DoRA over an LLM.int8 base (PEFT's own run fails there on CPU: ``hf_support.DORA_INT8``): one warning naming
    the field, no estimate, no raise inside the user's training."""
    from memplan.integrations.transformers import MemplanCallback

    model = hf_peft_steps.build(_case("callback-int8", quant="int8", layers=1))
    callback = MemplanCallback(seq_len=64)
    with tempfile.TemporaryDirectory() as out, caplog.at_level(logging.INFO, logger="memplan"):
        state, control = transformers.TrainerState(), transformers.TrainerControl()
        callback.on_train_begin(_args(out), state, control, model=model)
    assert callback.result is None
    (line,) = [r.getMessage() for r in caplog.records if r.name == "memplan"]
    assert line.startswith("memplan: no estimate for this run (plan.") and "\n" not in line
    assert "PEFT's DoRA over an LLM.int8 base" in line


def test_the_step_time_says_it_is_lora_s() -> None:
    """The memory is DoRA's own (the op-level run); the time model counts LoRA's adapter kernels: one warning."""
    from hf_predict import case_model

    from memplan.api import estimate

    case = CASES[0]
    plan = {"finetune": "lora", "lora_dora": True, "lora_rank": case.rank, "precision": "fp32"}
    workload = {"seq_len": case.seq, "micro_batch": case.batch}
    result = estimate(case_model(case), plan, workload, runtime="hf", device="cpu")
    assert result.memory.model == "op-level"
    (line,) = [w for w in result.warnings if w.startswith("lora_dora:")]
    assert "lower bound" in line and "\n" not in line


def test_validate_refuses_dora() -> None:
    """The bundled trainer (``memplan validate``) builds plain LoRA adapters: a DoRA plan is refused, in one line."""
    from memplan.specs.plan import Plan
    from memplan.validate.support import TrainerUnsupported, check_plan

    with pytest.raises(TrainerUnsupported, match="^lora_dora: PEFT's DoRA; the bundled trainer builds plain LoRA"):
        check_plan(Plan(finetune="lora", lora_dora=True))


@pytest.mark.slow
def test_the_callback_predicts_a_dora_run() -> None:
    """``MemplanCallback`` over a DoRA model in a real ``Trainer.train()``: the plan read with ``lora_dora``, the
    op-level run's prediction against the live bytes of steps 2-3 (what the callback's meter leaves out is the
    batches fetched before each step begins: tests/integrations/test_transformers_callback.py)."""
    import peft

    from memplan.integrations.transformers import MemplanCallback

    cfg = transformers.LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=344,
        vocab_size=4000, max_position_embeddings=256,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], use_dora=True, task_type="CAUSAL_LM")
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), config)
    callback = MemplanCallback(seq_len=128)
    ids = torch.randint(0, 4000, (2, 128))
    rows = [{"input_ids": r, "labels": r} for r in ids] * 4
    with tempfile.TemporaryDirectory() as out:
        args = _args(out, dataloader_num_workers=0)
        transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
    result, comparison = callback.result, callback.comparison
    assert result is not None and comparison is not None
    assert result.plan["lora_dora"] is True and result.memory.model == "op-level"
    assert 0 <= comparison.allocated_error <= 0.001, comparison
