"""Where validation runs go, and how measured runs re-rank the plans (no run launched here)."""

from __future__ import annotations

import pytest

from memplan.search.evaluate import Context, evaluate
from memplan.search.space import SpaceOptions, enumerate_space
from memplan.search.tune import rerank
from memplan.search.tuning import RankedPlan
from memplan.search.validation import Outcome, ValidationSettings, run_spec
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model


@pytest.fixture(scope="module")
def plans():
    model, gpu = load_model("llama3-8b"), load_gpu("h100-sxm")
    ctx = Context(model, gpu, ClusterSpec(gpus_per_node=8, nodes=1))
    space = enumerate_space(model, SpaceOptions(gpus=8, seq_len=4096, global_batches=(64,)))
    return ctx, [evaluate(c, ctx) for c in space.candidates[:6]]


@pytest.mark.parametrize(
    ("device", "gpus", "expect_device", "expect_simulate"),
    [("auto", 0, "cpu", True), ("auto", 8, "cuda", False), ("auto", 4, "cuda", True), ("cpu", 8, "cpu", True)],
)
def test_where_a_run_goes(plans, device: str, gpus: int, expect_device: str, expect_simulate: bool):
    ctx, evs = plans
    settings = ValidationSettings(device=device, memory_limit=2**30)
    spec = run_spec(ctx.model, evs[0], ctx.gpu, settings, gpus)
    assert spec.device == expect_device and spec.simulate == expect_simulate
    assert spec.rank == evs[0].peak_rank and spec.plan == evs[0].plan and spec.workload == evs[0].workload
    assert (spec.memory_limit is not None) == (expect_device == "cpu")  # a simulated capacity is a CPU thing
    assert (spec.peak_flops is not None) == (expect_device == "cuda")
    assert spec.alloc_conf is None  # no allocator asked for: the environment's
    expandable = ValidationSettings(device=device, alloc_conf="expandable_segments:True")
    assert run_spec(ctx.model, evs[0], ctx.gpu, expandable, gpus).alloc_conf == "expandable_segments:True"


def _outcome(status: str, tokens: float | None = None) -> Outcome:
    return Outcome(status=status, reason=None, device="cuda", device_name="H100", simulated=tokens is None,
                   predicted_peak_bytes=1, predicted_step_time_s=1.0, measured_tokens_per_s=tokens)  # fmt: skip


def test_measured_runs_re_rank_and_out_of_memory_goes_last(plans):
    _, evs = plans
    ranked = [RankedPlan(rank=i, trial=i, evaluation=ev) for i, ev in enumerate(evs, 1)]
    ranked[0] = ranked[0].model_copy(update={"validation": _outcome("ok", 1000.0)})
    ranked[1] = ranked[1].model_copy(update={"validation": _outcome("oom")})
    ranked[2] = ranked[2].model_copy(update={"validation": _outcome("ok", 2000.0)})
    ranked[3] = ranked[3].model_copy(update={"validation": _outcome("ok")})  # simulated: no real time
    out = rerank(ranked)
    assert [r.trial for r in out] == [3, 1, 4, 5, 6, 2]
    assert [r.rank for r in out] == [1, 2, 3, 4, 5, 6]
