"""A plan's evaluation: the memory and time models' figures, the fit under the margin,
calibration, and how plans are ranked."""

from __future__ import annotations

import pytest

from memplan.costmodel.memory import estimate_memory
from memplan.costmodel.time import Efficiency, estimate_time
from memplan.search.evaluate import Context, closest, evaluate, evaluate_all, pareto_front, rank
from memplan.search.space import SpaceOptions, enumerate_space
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model

GiB = 2**30


@pytest.fixture(scope="module")
def case():
    model, gpu = load_model("llama3-8b"), load_gpu("h100-sxm")
    ctx = Context(model, gpu, ClusterSpec(gpus_per_node=8, nodes=1), margin_bytes=4 * GiB)
    space = enumerate_space(model, SpaceOptions(gpus=8, seq_len=8192, global_batches=(128,)))
    return ctx, space, evaluate_all(space.candidates, ctx)


def test_figures_are_the_models(case):
    ctx, space, evs = case
    for ev in evs[::37]:
        mem = estimate_memory(ctx.model, ev.workload, ev.plan, "memplan")
        speed = estimate_time(ctx.model, ev.workload, ev.plan, ctx.gpu, ctx.cluster)
        assert ev.peak_allocated_bytes == mem.peak.allocated and ev.peak_reserved_bytes == mem.peak.reserved
        assert ev.step_time_s == speed.step_time_s and ev.tokens_per_s == speed.tokens_per_s and ev.mfu == speed.mfu
        assert ev.peak_rank == mem.peak.rank and ev.gradient_accumulation == mem.gradient_accumulation


def test_fit_keeps_the_margin(case):
    ctx, _, evs = case
    assert any(ev.fits for ev in evs) and not all(ev.fits for ev in evs)
    for ev in evs:
        # the memory outside the allocator (context, NCCL, workspaces) comes off the capacity
        assert ev.overhead_bytes > 0
        assert ev.headroom_bytes == ctx.gpu.capacity_bytes - ev.overhead_bytes - ev.peak_reserved_bytes
        assert ev.fits == (ev.peak_reserved_bytes + ev.overhead_bytes <= ctx.gpu.capacity_bytes - 4 * GiB)
        assert ev.fits == (ev.constraint <= 0)
        if ev.fits:
            assert ev.headroom_bytes >= 4 * GiB


def test_calibration_scales_time_and_allocated_peak(case):
    ctx, space, _ = case
    c = space.candidates[40]
    base = evaluate(c, ctx)
    eff = Efficiency.for_gpu(ctx.gpu, calibration=1.25)
    calibrated = evaluate(c, Context(ctx.model, ctx.gpu, ctx.cluster, efficiency=eff, peak_ratio=1.1))
    assert calibrated.step_time_s == pytest.approx(1.25 * base.step_time_s)
    assert calibrated.tokens_per_s == pytest.approx(base.tokens_per_s / 1.25)
    assert calibrated.peak_allocated_bytes == round(1.1 * base.peak_allocated_bytes)
    extra = calibrated.peak_allocated_bytes - base.peak_allocated_bytes
    # the allocator's slack grows with the allocated bytes; the fixed overhead does not
    assert extra < calibrated.peak_reserved_bytes - base.peak_reserved_bytes < 1.1 * extra + 2 * 2**20


def test_ranking(case):
    _, _, evs = case
    ranked = rank(evs, "throughput")
    fitting = [ev for ev in ranked if ev.fits]
    assert ranked[: len(fitting)] == fitting  # every fitting plan first
    assert [ev.tokens_per_s for ev in fitting] == sorted((ev.tokens_per_s for ev in fitting), reverse=True)
    others = ranked[len(fitting) :]
    assert [ev.peak_reserved_bytes for ev in others] == sorted(ev.peak_reserved_bytes for ev in others)
    smallest = rank(evs, "memory")[0]
    assert smallest.peak_reserved_bytes == min(ev.peak_reserved_bytes for ev in fitting)
    assert closest(evs).peak_reserved_bytes == min(ev.peak_reserved_bytes for ev in evs)


def test_pareto_front_is_not_dominated(case):
    _, _, evs = case
    front = pareto_front(evs)
    assert len(front) >= 2 and front[0] == rank(evs, "throughput")[0]
    fitting = [ev for ev in evs if ev.fits]
    for f in front:
        assert not any(
            o.tokens_per_s >= f.tokens_per_s
            and o.peak_reserved_bytes <= f.peak_reserved_bytes
            and (o.tokens_per_s > f.tokens_per_s or o.peak_reserved_bytes < f.peak_reserved_bytes)
            for o in fitting
        )
    # every fitting plan is dominated by (or equal to) a plan on the front
    for ev in fitting:
        assert any(f.tokens_per_s >= ev.tokens_per_s and f.peak_reserved_bytes <= ev.peak_reserved_bytes for f in front)


def test_a_plan_whose_replay_does_not_fit_is_never_recommended(case):
    """The fast form screens; the allocator's replay decides. Under a calibration that halves
    the allocated peak the screen keeps plans the replay (of the model's own timeline) cannot
    serve: the search's reported plans leave them out."""
    from dataclasses import replace as dc_replace

    from memplan.search.evaluate import replayed
    from memplan.search.tune import _replay_until

    ctx, space, _ = case
    optimistic = dc_replace(ctx, peak_ratio=0.5)
    ranked = rank(evaluate_all(space.candidates, optimistic), "throughput")
    screened = [ev for ev in ranked if ev.fits]
    dropped = [ev for ev in screened[:8] if not replayed(ev, optimistic).fits]
    assert dropped, "the screen should keep some plan the replay refuses"
    reported = _replay_until(ranked, 3, optimistic)
    assert reported and not {ev.candidate.key for ev in dropped} & {r.candidate.key for r in reported}
    for r in reported:
        assert r.fits and r.peak_reserved_bytes + r.overhead_bytes <= optimistic.limit_bytes
