"""The advice's lowest peak with the whole runs bounded first (``advice.lowest_peak``), against every plan's peak.

Under ``--runtime hf`` a plan under FSDP2 (or over a model whose layers do not repeat) costs a whole run of
the Trainer (``fast_run._whole_hf_peak``); ``memplan tune`` asks every plan of a space twice its size for
the advice (``advice.more_gpus``). ``lowest_peak`` now bounds those plans from below by their run's first
step (``fast_run.run_peak_bound``: the same events, ``hf_plan_run(steps=1)``) and runs whole only those the
bound does not rule out. Held here: the first step's run is the whole run's start, event for event (so its
peak is a lower bound by construction), and the answer is the plain loop's over every plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.costmodel import fast_run
from memplan.costmodel.timeline.hf_trainer import hf_plan_run
from memplan.search.advice import lowest_peak
from memplan.search.evaluate import Context, peak_reserved, whole_run
from memplan.search.space import SpaceOptions, enumerate_space
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA1B = load_model(str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json"))


def _cut(name: str, layers: int):
    return load_model(name).model_copy(update={"num_layers": layers})


# (model, plan fields, seq, accumulation): FSDP2 under both builds, DDP, one rank; Llama, Gemma 2/3, an MoE
STARTS = [
    (LLAMA1B, dict(dp=8, zero=2, model_build="from_pretrained", precision="bf16", recompute="full"), 1024, 1),
    (LLAMA1B, dict(dp=8, zero=3, model_build="to_device", precision="bf16-mixed", recompute="none"), 1024, 2),
    (_cut("gemma2-9b", 6), dict(precision="bf16", recompute="none"), 512, 1),
    (_cut("gemma3-12b", 6), dict(dp=8, precision="fp32", recompute="full"), 512, 2),
    (_cut("qwen3-30b-a3b", 4), dict(dp=8, zero=3, precision="bf16", recompute="full"), 512, 1),
]


@pytest.mark.parametrize("model,fields,seq,accumulation", STARTS, ids=lambda c: getattr(c, "name", None))
def test_the_first_step_is_the_whole_runs_start(model, fields, seq, accumulation):
    plan = Plan(**fields)
    wl = TrainingWorkload(seq_len=seq, global_batch=plan.dp * accumulation)
    whole, first = hf_plan_run(model, wl, plan), hf_plan_run(model, wl, plan, steps=1)
    end = next(i for i, e in enumerate(whole.events) if e[5] == "step0")  # the first step's end mark
    assert first.events == whole.events[: end + 1]
    bound = fast_run.run_peak_bound(model, wl, plan, "cuda")
    assert bound is not None and bound <= fast_run._whole_hf_peak(model, wl, plan, "hf", "cuda", None).allocated


def _space(gpus: int):
    options = SpaceOptions(gpus=gpus, seq_len=1024, max_micro_batch=2, precisions=("bf16",))
    return enumerate_space(LLAMA1B, options).candidates


def test_the_lowest_peak_is_every_plans_lowest():
    """The 1B Llama on 16 GPUs under ``hf``: the same plan and bytes as the plain loop over every plan's peak,
    with fewer whole runs (the bound ruled some out)."""
    candidates = _space(16)
    cluster = ClusterSpec(gpus_per_node=8, nodes=2)

    def ctx() -> Context:
        return Context(LLAMA1B, load_gpu("a100-40gb"), cluster, runtime="hf")

    plain = ctx()
    wholes = sum(whole_run(c, plain) for c in candidates)
    values = [peak_reserved(c, plain) for c in candidates]
    expected = min(range(len(values)), key=lambda i: (values[i], i))
    bounded = ctx()
    assert lowest_peak(candidates, bounded) == (candidates[expected], values[expected])
    assert wholes > 0
    ran = sum(1 for c in candidates if c in bounded.run_peaks and fast_run.whole_hf_run(LLAMA1B, c.plan, "hf", "cuda"))
    assert ran < wholes
