"""The quick forms of the search's whole runs under transformers' Trainer, against the forms they replace.

``fast_run._whole_hf_peak`` answers the FSDP2 plans and the models whose layers do not repeat by the whole
run's allocated peak and the phase of the span it falls in. It took the highest of every span
(``span_peaks`` with ``middle``, the first of equals); it now takes ``reserve.replay``'s ``max_allocated``
and ``peak_event`` and reads the phase off the events before it (``fast_run.phase_at``). Held equal here,
byte and phase, to the highest span, over the families (Llama, Gemma 2 and 3 whose layers differ, an MoE, MLA),
FSDP2's ZeRO-2/3 under both builds, DDP and one rank; the product grid under ``-m slow``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from memplan.costmodel import fast_run
from memplan.costmodel.reserve import plan_run
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA1B = load_model(str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json"))
FSDP2 = [dict(dp=8, zero=z, model_build=b) for z in (2, 3) for b in ("from_pretrained", "to_device")]


def _highest_span(model, wl, plan) -> fast_run.RunPeak:
    """What ``_whole_hf_peak`` answered before: the highest span of the whole run, the first of equals."""
    run, which = plan_run(model, wl, plan, "hf", "cuda")
    assert which == "hf"
    label, allocated = max(fast_run.span_peaks(run, model.num_layers, middle=True), key=lambda s: s[1])
    return fast_run.RunPeak(allocated, fast_run._phase(label))


def _assert_same(model, fields: dict, seq: int, micro_batch: int = 1, accumulation: int = 1) -> None:
    plan = Plan(**fields)
    wl = TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=micro_batch * plan.dp * accumulation)
    fast = fast_run._whole_hf_peak(model, wl, plan, "hf", "cuda", None)
    assert fast == _highest_span(model, wl, plan), (model.name, fields, seq, micro_batch, accumulation)


def _cut(name: str, layers: int):
    return load_model(name).model_copy(update={"num_layers": layers})


# (model, plan fields, seq): the families once each, the phases the peak falls in (the build under
# from_pretrained, the forward, the backward) and each rank layout
CASES = [
    (LLAMA1B, dict(FSDP2[0], precision="bf16", recompute="full"), 1024),  # the build's full copies
    (LLAMA1B, dict(FSDP2[3], precision="bf16-mixed", recompute="none"), 1024),
    (_cut("gemma2-9b", 6), dict(precision="bf16-mixed", recompute="none"), 1024),  # eager, sliding and global
    (_cut("gemma3-12b", 6), dict(dp=8, precision="bf16", recompute="full"), 512),  # DDP
    (_cut("qwen3-30b-a3b", 4), dict(FSDP2[1], precision="bf16", recompute="full"), 512),  # experts
    (_cut("deepseek-v2-lite", 5), dict(FSDP2[3], precision="bf16-mixed", recompute="none"), 512),  # MLA, CPU load
]


@pytest.mark.parametrize("model,fields,seq", CASES, ids=lambda c: getattr(c, "name", None))
def test_the_peak_event_gives_the_highest_span(model, fields, seq):
    _assert_same(model, fields, seq)


def _grid():
    """FSDP2's four layouts x bf16, bf16-mixed, fp32 x recompute none / full x (1,024 tokens, micro-batch 1,
    2, two micro-batches a step; 4,096 tokens) on the 1B Llama; the families on one rank, DDP and FSDP2
    (DeepSeek-V3 on one rank and under FSDP2 built by ``from_pretrained``)."""
    sizes = ((1024, 1, 1), (1024, 2, 1), (1024, 1, 2), (4096, 1, 1))  # (seq, micro-batch, accumulation)
    for rank, p, r, (seq, mb, ga) in itertools.product(FSDP2, ("bf16", "bf16-mixed", "fp32"), ("none", "full"), sizes):
        yield LLAMA1B, dict(rank, precision=p, recompute=r), seq, mb, ga
    for name, layers in (("gemma2-9b", 6), ("gemma3-12b", 6), ("qwen3-30b-a3b", 4)):
        for rank, r in itertools.product(({}, dict(dp=8), FSDP2[1], FSDP2[2]), ("none", "full")):
            yield _cut(name, layers), dict(rank, precision="bf16", recompute=r), 512, 1, 1
    # latent attention; V3 under FSDP2 loaded by from_pretrained alone (the Trainer cannot load it on the CPU)
    for rank, r in itertools.product(({}, FSDP2[0], FSDP2[2]), ("none", "full")):
        yield _cut("deepseek-v3", 5), dict(rank, precision="bf16", recompute=r), 512, 1, 1


@pytest.mark.slow
@pytest.mark.parametrize("model,fields,seq,micro_batch,accumulation", list(_grid()))
def test_the_peak_event_gives_the_highest_span_over_the_grid(model, fields, seq, micro_batch, accumulation):
    _assert_same(model, fields, seq, micro_batch, accumulation)
