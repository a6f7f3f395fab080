"""The op-level run of the hand-written transformers loop (``costmodel/timeline/hf_loop.py``, ``--runtime
hf-loop``) against the loop itself on CPU: the peak of live storages over three steps, counted by
``StorageTracker`` (tests/accuracy/hf_steps.py's harness, ``loop="hand"``), equal to the byte on every
case the run models (SDPA, the CPU's kernels: every ``hand`` case of hf_steps.py but the eager ones
and the ``cuda-math-*`` ones; the heavy bf16 and bf16-mixed cases under ``-m slow``, their ``-small``
twins by default).

PEFT: every LoRA, 4-bit and LLM.int8 case of tests/accuracy/peft_steps.py (whose loop is this one, AdamW over the
adapters), measured with the batch counted as hf_steps.py counts it (peft_steps' own count leaves ``ids``
out), also equal to the byte.

As in tests/unit/test_timeline_hf.py the tracker holds each storage's Python object, so the run is
compared with ``inplace_accumulate=False`` (the engine's out-of-place sum); on every case here the
peak is the same either way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from estimate_json import estimate_memory as _estimate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import peft_steps  # noqa: E402
from storage_tracker import StorageTracker  # noqa: E402

from memplan.costmodel.timeline.hf_bnb import Bnb4bit, Bnb8bit  # noqa: E402
from memplan.costmodel.timeline.hf_loop import hf_loop_run  # noqa: E402
from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
CASES = [c for c in hf_steps.HAND if c.attention == "sdpa" and c.device == "cpu"]
# the heaviest fp32 cases (5-7 s each) under -m slow too: their mechanisms run by default in the
# vocabulary-dominated bf16, the 8-layer bf16 and fp32, and the checkpointed Llama and Mistral cases
HEAVY = ("vocab-fp32", "layers-fp32-ckpt", "mistral-fp32-ckpt")


def _plan(case: hf_steps.Case) -> Plan:
    return Plan(
        precision=case.precision, autocast=case.plan_autocast, recompute="full" if case.checkpointing else "none"
    )


def _spec(case: hf_steps.Case):
    return model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)


def predict(case: hf_steps.Case, inplace_accumulate: bool = False, window_layers: bool | None = None) -> int:
    """The run's peak for the case's config.json, workload and precision, on CPU's kernels (Mistral's
    config.json has a ``sliding_window``: its cache layers are sliding ones, unless told)."""
    model = _spec(case)
    d = hf_dims(model, TrainingWorkload(seq_len=case.seq, micro_batch=case.batch), _plan(case), "hf-loop")
    timeline = hf_loop_run(
        d,
        model.tied_embeddings,
        "cpu_flash",
        steps=STEPS,
        qkv_bias=model.qkv_bias,
        window_layers=case.arch == "mistral" if window_layers is None else window_layers,
        inplace_accumulate=inplace_accumulate,
    )
    return timeline.peak()[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow or c.name in HEAVY else []) for c in CASES]
)
def test_peak_equals_the_loops(case: hf_steps.Case) -> None:
    measured = hf_steps.measure_peak(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
    assert predict(case, inplace_accumulate=True) == predicted


PEFT_CASES = peft_steps.CASES  # the LLM.int8 ones over the families: tests/unit/test_timeline_hf_int8_families.py


def predict_peft(case: peft_steps.PeftCase) -> int:
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = peft_steps.plan_of(case, "hf-loop")
    d = hf_dims(model, TrainingWorkload(seq_len=case.seq, micro_batch=case.batch), plan, "hf-loop")
    quant = Bnb4bit.of(plan) or Bnb8bit.of(plan)
    if quant is not None:  # loaded in the case's dtype (the plan assumes its compute dtype)
        quant = dataclasses.replace(quant, stored=4 if case.dtype == "float32" else 2)
    timeline = hf_loop_run(
        d,
        model.tied_embeddings,
        "cpu_flash",
        steps=STEPS,
        qkv_bias=model.qkv_bias,
        window_layers=case.arch == "mistral",
        lora=HfLoraConfig.of(plan),
        quant=quant,
        inplace_accumulate=False,
    )
    return timeline.peak()[0]


def measure_peft(case: peft_steps.PeftCase) -> int:
    """peft_steps' loop under ``StorageTracker``, the model, its quantization state and the batch counted."""
    model, opt, ids = peft_steps._setup(case)
    tracker = StorageTracker()
    tracker.track_module(model)
    tracker.track(*peft_steps.quant_state_tensors(model), ids)
    with tracker:
        peft_steps._steps(case, model, opt, ids, STEPS)
    return tracker.peak


@pytest.mark.parametrize("case", PEFT_CASES, ids=lambda c: c.name)
def test_peft_peak_equals_the_loops(case: peft_steps.PeftCase) -> None:
    pytest.importorskip("peft")
    if case.quant != "none":
        pytest.importorskip("bitsandbytes")
    measured, predicted = measure_peft(case), predict_peft(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_cases_span_the_runs_mechanisms() -> None:
    """fp32, bf16 and bf16-mixed, checkpointing, tied heads, GQA, the three families, in the default suite."""
    default = [c for c in CASES if not c.slow and c.name not in HEAVY]
    assert {c.precision for c in default} == {"fp32", "bf16", "bf16-mixed"}
    assert {c.arch for c in default} == {"llama", "mistral", "qwen2"}
    assert any(c.checkpointing for c in default) and any(c.tied for c in default)
    assert any(c.kv_heads < c.heads for c in default) and any(
        c.checkpointing and c.dtype == "bfloat16" for c in default
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_case_is_a_plan_the_cli_answers_with_the_run(case: hf_steps.Case) -> None:
    """On CUDA every case's plan is the run's, fp32 without GQA too (CUDA's memory-efficient SDPA kernel,
    followed from source on compute capability 8.0 / 9.0; the CPU's flash kernel is the one checked here)."""
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(_spec(case), _plan(case), workload, runtime="hf-loop") is None


def test_mistral_window_tensors() -> None:
    """Mistral's default ``sliding_window`` (4096, past every position here) makes each cache layer a
    ``DynamicSlidingWindowLayer``, whose int64 window scalar the plan's spec cannot see: 8 B a layer."""
    case = next(c for c in CASES if c.name == "mistral-bf16-gqa-small")
    assert predict(case) - predict(case, window_layers=False) == 8 * case.layers


def _run(case: hf_steps.Case, kernel: str):
    model = _spec(case)
    d = hf_dims(model, TrainingWorkload(seq_len=case.seq, micro_batch=case.batch), _plan(case), "hf-loop")
    return hf_loop_run(d, model.tied_embeddings, kernel, qkv_bias=model.qkv_bias)


def test_cache_only_without_checkpointing_and_cuda_tensors() -> None:
    """``use_cache`` builds a DynamicCache unless checkpointing turns it off; on CUDA the run holds
    cuBLAS's workspaces and no optimizer ``step`` (foreach AdamW keeps it on the CPU)."""
    plain = next(c for c in CASES if c.name == "llama-bf16-mha-small")
    ckpt = next(c for c in CASES if c.name == "llama-bf16-gqa-ckpt-small")
    cpu_tags = {e.tag for e in _run(plain, "cpu_flash").events}
    assert any(t.startswith("past_key_values") for t in cpu_tags)
    assert any(t.endswith(".step") for t in cpu_tags)
    assert not any(t.startswith("past_key_values") for t in {e.tag for e in _run(ckpt, "cpu_flash").events})
    cuda_tags = {e.tag for e in _run(plain, "flash").events}
    assert {"cublas_workspace.forward", "cublas_workspace.backward"} <= cuda_tags
    assert not any(t.endswith(".step") or t == "adamw.one" for t in cuda_tags)


LLAMA1B = str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")


@pytest.mark.parametrize(
    "args",
    [
        [LLAMA1B, "--runtime", "hf-loop", "--precision", "bf16", "--seq-len", "2048", "--micro-batch", "2"],
        [LLAMA1B, "--runtime", "hf-loop", "--precision", "bf16-mixed", "--recompute", "full"],
        [LLAMA1B, "--runtime", "hf-loop", "--precision", "fp32", "--seq-len", "1024"],
        [LLAMA1B, "--runtime", "hf-loop", "--precision", "bf16", "--finetune", "lora", "--recompute", "full"],
        [LLAMA1B, "--runtime", "hf-loop", "--precision", "bf16-mixed", "--finetune", "qlora", "--seq-len", "2048"],
        # gradient accumulation: loss = out.loss / ga, opt.step() every ga iterations (..._hf_loop_families.py)
        [LLAMA1B, "--runtime", "hf-loop", "--global-batch", "8"],
    ],
)
def test_estimate_answers_an_hf_loop_cuda_plan_op_level(capsys, args: list[str]) -> None:
    memory = _estimate(capsys, args)
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    peak = memory["peak"]
    assert peak["reserved_detail"]["timeline"] == "hf-loop"
    assert peak["allocated"] == peak["reserved_detail"]["timeline_allocated"]


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        # eager attention over MLA (the dense and MoE families' is the run's: test_timeline_hf_eager.py)
        (["deepseek-v2-lite", "--runtime", "hf-loop", "--attention", "eager"], "eager attention"),
        ([LLAMA1B, "--runtime", "hf-loop", "--dp", "2"], "more than one rank"),
        # the loop's own reason, not the Trainer's FSDP or ZeRO-1 ones its multi-rank checks would give
        (["llama3-8b", "--gpus", "8", "--zero", "3", "--runtime", "hf-loop"], "more than one rank under the hf-loop"),
        (["llama3-8b", "--gpus", "8", "--zero", "1", "--runtime", "hf-loop"], "more than one rank under the hf-loop"),
    ],
)
def test_an_hf_loop_plan_the_run_does_not_model_says_so(capsys, args: list[str], reason: str) -> None:
    memory = _estimate(capsys, args)
    assert memory["model"] == "phase" and reason in memory["model_reason"]
