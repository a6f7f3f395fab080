"""transformers' Trainer's last step emitted from the one before (``timeline/hf_repeat.py``) against the run
built op by op: the same events, tensor ids, tags and marks, over one rank and accelerate's FSDP2 (ZeRO-2/3,
either build), the precisions, recomputation, gradient accumulation and the families (Llama, Qwen2's biases,
Phi-3, OLMo 2, Qwen3, Mistral, Gemma 2 and 3 whose layers differ, Qwen3-MoE and Mixtral, DeepSeek-V2 and V3's
latent attention); DDP is built op by op.
A few cases by default, the grid under ``-m slow``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from memplan.costmodel.timeline import hf_trainer
from memplan.costmodel.timeline.hf_trainer import hf_plan_run
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA1B = load_model(str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json"))
FSDP2 = [dict(dp=8, zero=z, model_build=b) for z in (2, 3) for b in ("from_pretrained", "to_device")]


def _cut(name: str, layers: int):
    return load_model(name).model_copy(update={"num_layers": layers})


def _assert_emitted_is_built(monkeypatch, model, fields: dict, seq: int, accumulation: int = 1) -> None:
    plan = Plan(**fields)
    wl = TrainingWorkload(seq_len=seq, global_batch=plan.dp * accumulation)
    emitted = []
    real = hf_trainer.repeat_step

    def counted(*args):
        emitted.append(real(*args))
        return emitted[-1]

    monkeypatch.setattr(hf_trainer, "repeat_step", counted)
    fast = hf_plan_run(model, wl, plan, repeated=True)
    assert emitted == ([] if plan.dp > 1 and plan.zero < 2 else [True])  # DDP: built op by op
    built = hf_plan_run(model, wl, plan)
    assert fast.events == built.events and fast.snapshots == built.snapshots
    assert (fast.host_peak, fast.managed) == (built.host_peak, built.managed)


CASES = [
    (LLAMA1B, dict(precision="bf16", recompute="full"), 1024, 1),
    (LLAMA1B, dict(FSDP2[0], precision="bf16-mixed", recompute="none"), 1024, 2),  # two batches a step
    (LLAMA1B, dict(FSDP2[3], precision="fp32", recompute="full"), 1024, 1),  # loaded on the host
    (LLAMA1B, dict(dp=8, precision="bf16", recompute="full"), 1024, 1),  # DDP: not emitted
    (_cut("gemma3-12b", 6), dict(FSDP2[1], precision="bf16", recompute="full"), 512, 1),
    (_cut("qwen3-30b-a3b", 4), dict(precision="bf16", recompute="none"), 512, 2),
]


@pytest.mark.parametrize("model,fields,seq,accumulation", CASES, ids=lambda c: getattr(c, "name", None))
def test_the_emitted_step_is_the_built_one(monkeypatch, model, fields, seq, accumulation):
    _assert_emitted_is_built(monkeypatch, model, fields, seq, accumulation)


def _grid():
    """One rank and FSDP2's four layouts x bf16, bf16-mixed, fp32 x recompute none / full x one or two
    batches a step (the 1B Llama); the families on one rank and under FSDP2."""
    ranks = [{}, *FSDP2]
    for rank, p, r, ga in itertools.product(ranks, ("bf16", "bf16-mixed", "fp32"), ("none", "full"), (1, 2)):
        yield LLAMA1B, dict(rank, precision=p, recompute=r), 1024, ga
    families = (("qwen2.5-7b", 4), ("phi3-mini", 4), ("gemma2-9b", 6), ("gemma3-12b", 6), ("qwen3-30b-a3b", 4))
    for (name, layers), rank, r in itertools.product(families, ({}, FSDP2[0], FSDP2[3]), ("none", "full")):
        yield _cut(name, layers), dict(rank, precision="bf16-mixed", recompute=r), 512, 2
    for r in ("none", "full"):  # latent attention: the run follows it on one rank
        yield _cut("deepseek-v3", 5), dict(precision="bf16", recompute=r), 512, 2
    yield _cut("olmo2-7b", 4), dict(FSDP2[0], precision="bf16"), 512, 2  # q, k norms over the whole width
    yield _cut("mistral-7b", 4), dict(precision="bf16-mixed"), 512, 2  # its window
    yield _cut("qwen3-8b", 4), dict(FSDP2[1], precision="bf16"), 512, 2
    yield _cut("mixtral-8x7b", 3), dict(precision="bf16"), 512, 2  # experts without a shared one
    yield _cut("deepseek-v2-lite", 3), dict(precision="bf16"), 512, 2  # V2's latent attention, its MoE


@pytest.mark.slow
@pytest.mark.parametrize("model,fields,seq,accumulation", list(_grid()))
def test_the_emitted_step_is_the_built_one_over_the_grid(monkeypatch, model, fields, seq, accumulation):
    _assert_emitted_is_built(monkeypatch, model, fields, seq, accumulation)
