"""torch's reentrant checkpoint (``timeline/reentrant.py``) under activation offload: TRL's (``timeline/hf_offload.py``)
in the real ``transformers.Trainer``, and ``save_on_cpu`` (``act_offload.py``) in the hand-written loop, on CPU
(transformers 5.23, peft 0.21.2, bitsandbytes 0.50.2, accelerate 1.15).

``TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})`` with the
Trainer's ``training_step`` under TRL's own ``OffloadActivations`` (tests/accuracy/offload_steps.py; its emulation
under FSDP2 and where TRL's figures depend on the allocator, ``ALLOCATOR_DEPENDENT``), the peak of live storages over
three steps and the host copies at most against the op-level run (``hf_predict(..., offload=True)``, the plan's
``use_reentrant``). TRL's hooks are on through the backward, so each layer's re-run (``CheckpointFunction.backward``,
under ``enable_grad``) saves under them:
- the forward runs under ``no_grad``: only each checkpoint's saved input is packed (and nothing of DeepSeek-V3's
  router, whose nodes the no-grad forward never makes: ``hf_offload.orphaned``);
- the re-run's saves are packed as a forward's (offloaded, the originals stashed, deduplicated by address);
- a copy brought back is released after the next node **of the graph task that unpacked first** has run (TRL's
  ``graph_id == curr_graph_id``): the nested backward of a re-run is another graph task, so its copies stay until
  the next outer node that unpacks (the next layer's ``CheckpointFunctionBackward``, through its whole re-run and
  nested backward) has run. Released node by node instead: -300,032 B (-19.4%) on the LoRA case below;
- TRL's tracker empties once every save is unpacked (with a frozen embedding, at layer 0's input): the re-run's
  first pack then starts a "forward" (its dedup map reset) and the next unpack takes the nested graph task as its
  own (released node by node there, and all at its end by the callback TRL queues on it). Not followed: +1,351,680
  B (+83.6%) on the one-layer case below.

The hand-written loop (``--runtime hf-loop``) under ``save_on_cpu`` around its forward and backward
(offload_steps.py's loop), checkpointed reentrantly (PEFT's ``prepare_model_for_kbit_training`` over a quantized
base, the loop's default): the re-run's saves are copied to the host in the backward and each copy brought back goes
as its node returns; the run packed nothing in the backward before (+6% to +28% where a layer's backward peaks).

Default: two one-rank Trainer cases, one FSDP2 case and one hand-loop case (1-3 s each); the rest under ``-m slow``
(1-6 s each, FSDP2 full fine-tuning 10 s, DDP about 40 s).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import family_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
import test_timeline_hf_loop_families as F  # noqa: E402
from hf_predict import case_model, case_workload, hf_predict  # noqa: E402
from offload_steps import OffloadCase, measure  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402

KWARGS = {"use_reentrant": True}
# TrainingArguments(gradient_checkpointing_kwargs=...): 5.23's alias of activation_checkpointing_kwargs, read by train()
REENTRANT = {"gradient_checkpointing_kwargs": dict(KWARGS), "activation_checkpointing_kwargs": dict(KWARGS)}
RECIPE = dict(quant="nf4", double_quant=True, dtype="bfloat16", autocast=True)  # QLoRA's (test_..._peft_families)


def plan(case, **update) -> Plan:  # noqa: ANN001 - hf_steps.Case or PeftCase
    update = {"offload_activations": "cpu", "use_reentrant": True, **update}
    if isinstance(case, PeftCase):
        return plan_of(case).model_copy(update=update)
    return Plan(precision=case.precision, autocast=case.plan_autocast, recompute="full", **update)


def run(case, **update):  # noqa: ANN001, ANN201 - a Timeline
    """The op-level run of the plan (``subclass_like`` over MoE: the tracker is a dispatch mode)."""
    p = plan(case, **update)
    assert hf_supported(case_model(case), p, case_workload(case), device="cpu") is None, case.name
    return hf_predict(case, p, offload=True, subclass_like=case_model(case).moe is not None)


def _lora(name: str, **fields) -> PeftCase:
    return PeftCase(f"reentoff-{name}", **{**TINY, "checkpointing": True, **fields})


def _full(name: str, base: hf_steps.Case, **fields) -> hf_steps.Case:
    return dataclasses.replace(base, name=f"reentoff-{name}", loop="trainer", checkpointing=True, **fields)


_FAMILY = {c.name: c for c in family_steps.BASE}
LAYERS = hf_steps.Case("layers", **{**hf_steps.LAYERS_SMALL, "vocab": 512})  # layer-dominated (8 layers)
LORA = _lora("lora-qv")  # the nested graph task's copies: -300,032 B released node by node
ONE_LAYER = _lora("lora-1layer-all-linear", layers=1, targets=("all-linear",), dropout=0.1, vocab=64, seq=128)


def _moe(name: str, arch: str, extra: tuple, shape: dict) -> hf_steps.Case:
    return dataclasses.replace(F._case(f"reentoff-{name}", arch, extra, shape), loop="trainer", checkpointing=True)


def _slow(case, id: str):  # noqa: ANN001, ANN202, A002 - pytest's name
    return pytest.param(case, id=id, marks=pytest.mark.slow)


ONE_RANK = [
    pytest.param(LORA, id="llama-lora-qv"),
    pytest.param(ONE_LAYER, id="llama-lora-1layer"),  # the tracker emptied: +1,351,680 B if not followed
    _slow(_lora("lora-autocast", autocast=True), id="llama-lora-autocast"),
    _slow(_lora("lora-bf16", dtype="bfloat16"), id="llama-lora-bf16"),
    _slow(_lora("lora-all-dropout", targets=("all-linear",), dropout=0.1), id="llama-lora-all-linear-dropout"),
    _slow(_lora("qlora-recipe", **RECIPE), id="llama-qlora-recipe"),
    _slow(_lora("nf4", quant="nf4"), id="llama-nf4"),
    _slow(_lora("int8", quant="int8"), id="llama-int8"),
    _slow(_lora("qwen3-lora", arch="qwen3"), id="qwen3-lora"),
    _slow(_lora("gemma3-lora", arch="gemma3", extra=family_steps._GEMMA), id="gemma3-lora"),
    _slow(_full("llama-fp32", LAYERS), id="llama-full-fp32"),
    _slow(_full("llama-bf16", LAYERS, dtype="bfloat16"), id="llama-full-bf16"),
    _slow(_full("qwen3-autocast", _FAMILY["qwen3"], autocast=True, vocab=256), id="qwen3-full-autocast"),
    _slow(_full("gemma3-fp32", _FAMILY["gemma3"], vocab=256), id="gemma3-full-fp32"),
    _slow(_moe("mixtral", "mixtral", F.MIXTRAL, F.MOE), id="mixtral-full-fp32"),
    _slow(_moe("qwen2-moe", "qwen2_moe", F.QWEN2, F.MOE), id="qwen2-moe-full-fp32"),
    _slow(_moe("deepseek-v3", "deepseek_v3", F.MLA + F.ROUTER, F.MLA_SHAPE), id="deepseek-v3-full-fp32"),
]


# Measured with TRL's own OffloadActivations since the merge of 2026-11-29 (this file was written against the
# emulation). Eleven cases differed under TRL's code: seven until the run released a kept save's dedup key at its
# unpack as TRL does (``TrlOffload.unpacked``: each re-run's rotary tables offloaded again), gemma3-lora until a
# broadcast save's host copy was its storage alone (``hf_offload._stored``), deepseek-v3's host copies until those never
# unpacked went with the step (``TrlOffload.end_of_step``), qwen3-full-autocast's figure moves between runs with the
# addresses TRL reuses (offload_steps.ALLOCATOR_DEPENDENT), and qwen3-lora (-31,744 B, -1.12%; a strict xfail until
# 2026-11-29) until the run laid out CPU SDPA's query, output and log-sum-exp as torch does, so that TRL's contiguous
# clone of each is followed (test_timeline_hf_offload_layouts.py)


@pytest.mark.parametrize("case", ONE_RANK)
def test_peak_and_host_copies_equal_the_trainers(case) -> None:  # noqa: ANN001
    peak, host = measure(OffloadCase(f"trl-like-{case.name}", case), reentrant=True)
    timeline = run(case)
    assert timeline.peak()[0] == peak, f"{case.name}: {timeline.peak()[0]:,} B predicted, {peak:,} B measured"
    assert timeline.host_peak == host, f"{case.name}: host {timeline.host_peak:,} B predicted, {host:,} B measured"


SLOW = pytest.mark.slow
RANKS = [
    pytest.param(_lora("fsdp-lora"), "zero3", id="lora-zero3"),
    pytest.param(_lora("fsdp-lora"), "zero2", id="lora-zero2", marks=SLOW),
    pytest.param(_full("fsdp-full", LAYERS), "zero3", id="full-zero3", marks=SLOW),
    pytest.param(_lora("fsdp-qlora", quant="nf4", quant_storage="bfloat16"), "zero3", id="qlora-zero3", marks=SLOW),
    pytest.param(_lora("ddp-lora"), "ddp", id="lora-ddp", marks=SLOW),
    pytest.param(_full("ddp-full", LAYERS), "ddp", id="full-ddp", marks=SLOW),
]


@pytest.mark.parametrize(("case", "kind"), RANKS)
def test_rank_0s_peak_over_ddp_and_fsdp2_equals_the_trainers(case, kind: str) -> None:  # noqa: ANN001
    """TRL's hooks and the reentrant checkpoint compose with the Trainer's DDP (``ddp_find_unused_parameters=False``,
    which a PEFT model needs under this checkpoint: test_timeline_hf_reentrant_ranks.py) and FSDP2 (the unsharded
    weights' views the re-run saves offloaded: ``Storage.gathered``)."""
    import hf_ddp_steps
    import hf_fsdp_steps

    if kind == "ddp":
        args = {**REENTRANT, "ddp_find_unused_parameters": False}
        measured, ranks = hf_ddp_steps.measure(case, offload=True, args_update=args), dict(dp=hf_ddp_steps.WORLD)
    else:
        zero = int(kind[-1])
        measured = hf_fsdp_steps.measure(case, reshard=zero >= 3, offload=True, args_update=dict(REENTRANT))
        ranks = dict(dp=hf_fsdp_steps.WORLD, zero=zero)
    predicted = run(case, **ranks).peak()[0]
    assert predicted == measured, f"{case.name} {kind}: {predicted:,} B predicted, {measured:,} B measured"


# --- the hand-written loop under save_on_cpu (``--runtime hf-loop``) ------------------------------------------------
def loop_run(case):  # noqa: ANN001, ANN201 - a Timeline
    """``hf_loop_run`` of the case's plan with ``save_on_cpu`` (no build: the harness loads on the CPU, where a double
    quantization's dynamic map is not the device's: tests/hf_predict.py)."""
    from hf_predict import case_quant

    from memplan.costmodel.timeline.hf_families import family_config
    from memplan.costmodel.timeline.hf_loop import hf_loop_run
    from memplan.costmodel.timeline.hf_lora import HfLoraConfig
    from memplan.costmodel.timeline.hf_trainer import hf_dims

    model, lora = case_model(case), isinstance(case, PeftCase)
    p = plan(case) if not lora else plan_of(case, "hf-loop").model_copy(update=UPDATE)
    assert hf_supported(model, p, case_workload(case), runtime="hf-loop", device="cpu") is None, case.name
    sliding = tuple(i for i, kind in enumerate(model.layer_attention_kinds) if kind == "sliding")
    return hf_loop_run(
        hf_dims(model, case_workload(case), p, "hf-loop"), model.tied_embeddings, "cpu_flash", steps=3,
        qkv_bias=model.qkv_bias, arch=model.architecture, extra=family_config(model), window_layers=sliding,
        lora=HfLoraConfig.of(p, model.architecture) if lora else None, quant=case_quant(case, p) if lora else None,
        inplace_accumulate=False, reentrant=True, offload=True, subclass_like=model.moe is not None,
    )  # fmt: skip


UPDATE = {"offload_activations": "cpu", "use_reentrant": True}


def _hand(case):  # noqa: ANN001, ANN202
    return dataclasses.replace(case, name=f"{case.name}-hand", loop="hand")


HAND = [
    pytest.param(_lora("nf4", quant="nf4"), id="llama-qlora-nf4"),  # PeftCase: the hand loop is peft_steps'
    _slow(_lora("qlora-recipe", **RECIPE), id="llama-qlora-recipe"),
    _slow(_lora("int8", quant="int8"), id="llama-int8"),
    _slow(_lora("lora-qv"), id="llama-lora-qv"),
    _slow(_lora("qwen3-nf4", arch="qwen3", quant="nf4"), id="qwen3-qlora-nf4"),
    _slow(_hand(_full("llama-fp32", LAYERS)), id="llama-full-fp32"),
    _slow(_hand(_full("qwen3-autocast", _FAMILY["qwen3"], autocast=True, vocab=256)), id="qwen3-full-autocast"),
    _slow(_hand(_moe("mixtral", "mixtral", F.MIXTRAL, F.MOE)), id="mixtral-full-fp32"),
]


@pytest.mark.parametrize("case", HAND)
def test_the_hand_loops_peak_and_host_copies_under_save_on_cpu(case) -> None:  # noqa: ANN001
    """``save_on_cpu`` around the loop's forward and backward: the re-run's saves are copied to the host in the
    backward and brought back by the nested backward's nodes, each copy gone as its node returns (no release rule
    beyond the node's own)."""
    peak, host = measure(OffloadCase(f"save_on_cpu-{case.name}", case, "save_on_cpu"), reentrant=True)
    timeline = loop_run(case)
    assert timeline.peak()[0] == peak, f"{case.name}: {timeline.peak()[0]:,} B predicted, {peak:,} B measured"
    assert timeline.host_peak == host, f"{case.name}: host {timeline.host_peak:,} B predicted, {host:,} B measured"


def test_the_cases_span_families_precisions_and_bases() -> None:
    cases = [p.values[0] for p in ONE_RANK]
    assert {c.arch for c in cases} >= {"llama", "qwen3", "gemma3", "mixtral", "qwen2_moe", "deepseek_v3"}
    assert {c.precision for c in cases} >= {"fp32", "bf16", "bf16-mixed"}
    assert {getattr(c, "quant", "none") for c in cases} == {"none", "nf4", "int8"}
    assert {isinstance(c, PeftCase) for c in cases} == {True, False}
