"""The search's fast form of fp32 pipelines against the op-level run.

``evaluate.fast_peak`` answers an fp32 pipelined plan from the bundled trainer's run of the followed
pipeline rank with every chunk cut to two depths (``fast_run._pipeline_peak``): the same rank,
schedule and micro-batches at both, each span's peak affine in the chunk's depth. The phase model's
sums missed these plans by -8.77% (pp 2, 1F1B) and -7.28% (pp 2, interleaved), 4,096 tokens and 8
micro-batches on the 1B Llama of the H200 traces: CUDA's math SDPA backward beside the schedule's
in-flight micro-batches. Held here against the whole run replayed through the allocator model
(``reserve.replay``'s ``max_allocated``) within 0.1%, over pp 2 and 4, 1F1B, GPipe and interleaved,
recompute none and full, one data rank or FSDP2's ZeRO-2 / ZeRO-3 over two, 2,048 and 4,096 tokens.
The 1B config is deepened so that every chunk is cut (at least ``SHALLOWEST + STEP`` layers), the
16-layer model's shallower chunks being run whole."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from memplan.costmodel import fast_run
from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.reserve import plan_run, replay
from memplan.search.evaluate import Context, fast_peak
from memplan.search.space import Candidate
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA1B = load_model(str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json"))
BOUND = 0.001  # issue 27: the fast form's peak is the run's, within 0.1%
MICRO_BATCHES = 8
# layers of the model each (pp, virtual stages) runs: 8, 6, 8 and 6 layers a chunk, every chunk cut
LAYERS = {(2, 1): 16, (2, 2): 24, (4, 1): 32, (4, 2): 48}
SCHEDULES = {"1f1b": 1, "gpipe": 1, "interleaved": 2}
DATA = {"one": {}, "zero2": dict(dp=2, zero=2), "zero3": dict(dp=2, zero=3)}


def _plan(pp: int, schedule: str, recompute: str, data: str) -> Plan:
    v = SCHEDULES[schedule]
    return Plan(pp=pp, pp_schedule=schedule, virtual_stages=v, precision="fp32", recompute=recompute, **DATA[data])


def _grid(pps=(2, 4), seqs=(2048, 4096), default=False):
    """The plans; with ``default``, those past one per schedule and data layout (pp 2: no recompute on
    one data rank, full recompute over FSDP2) are ``slow`` (the default suite's time)."""
    for pp, schedule, recompute, data, seq in itertools.product(pps, SCHEDULES, ("none", "full"), DATA, seqs):
        kept = pp == 2 and (recompute == "none") == (data == "one")
        marks = [] if kept or not default else [pytest.mark.slow]
        yield pytest.param(
            pp, schedule, recompute, data, seq, id=f"pp{pp}-{schedule}-{recompute}-{data}-{seq}", marks=marks
        )


def _fast_and_run(model, plan: Plan, wl: TrainingWorkload) -> tuple[int, int]:
    """(the fast form's allocated peak, the whole run's), checking the fast form took the cut runs."""
    assert fast_run.applies(model, plan, "memplan", "cuda")
    ctx = Context(model, load_gpu("h200"), ClusterSpec(gpus_per_node=8, nodes=8))
    fast = fast_peak(Candidate(plan, wl), ctx).allocated
    assert ctx.run_peaks[Candidate(plan, wl)] is not None  # the cut runs answered, not the phase model
    run, which = plan_run(model, wl, plan, "memplan")
    assert which == "trainer"
    return fast, replay(run, AllocatorConfig()).max_allocated


def _assert_within(model, plan: Plan, seq: int) -> None:
    wl = TrainingWorkload(seq_len=seq, micro_batch=1, global_batch=plan.dp * MICRO_BATCHES)
    fast, run = _fast_and_run(model, plan, wl)
    assert abs(fast - run) <= BOUND * run, (plan, seq, f"{fast - run:+,} B", f"{(fast - run) / run:+.4%}")


@pytest.mark.parametrize("pp,schedule,recompute,data,seq", list(_grid(seqs=(4096,), default=True)))
def test_the_fast_form_is_the_run_for_fp32_pipelines(pp, schedule, recompute, data, seq):
    plan = _plan(pp, schedule, recompute, data)
    model = LLAMA1B.model_copy(update={"num_layers": LAYERS[pp, plan.virtual_stages]})
    _assert_within(model, plan, seq)


@pytest.mark.slow
@pytest.mark.parametrize("pp,schedule,recompute,data,seq", list(_grid(seqs=(2048,))))
def test_the_fast_form_is_the_run_for_fp32_pipelines_at_2048_tokens(pp, schedule, recompute, data, seq):
    plan = _plan(pp, schedule, recompute, data)
    model = LLAMA1B.model_copy(update={"num_layers": LAYERS[pp, plan.virtual_stages]})
    _assert_within(model, plan, seq)


@pytest.mark.parametrize(
    "layers,fields",
    [
        (18, dict(pp=2, precision="fp32", recompute="none")),  # 9 a chunk: cut to 5 and 7 (odd parity)
        (16, dict(pp=4, precision="fp32", recompute="full")),  # 4 a chunk: run whole
        (16, dict(pp=4, pp_schedule="interleaved", virtual_stages=2, precision="fp32", recompute="none")),  # 2
    ],
)
def test_odd_and_shallow_chunks(layers, fields):
    _assert_within(LLAMA1B.model_copy(update={"num_layers": layers}), Plan(**fields), 2048)


def test_the_cut_runs_follow_the_whole_models_rank(monkeypatch):
    """Both cut runs follow the rank the whole run does (asked of the whole model), whichever the
    cut model's own most-loaded rank would be."""
    from memplan.costmodel.timeline import trainer

    plan = Plan(pp=2, pp_schedule="gpipe", precision="fp32", recompute="full")
    wl = TrainingWorkload(seq_len=2048, micro_batch=1, global_batch=MICRO_BATCHES)
    followed, stages = trainer.phase_stage(LLAMA1B, wl, plan), []
    real = trainer.trainer_run

    def spy(model, workload, plan, *args, **kwargs):
        stages.append((model.num_layers, kwargs.get("stage")))
        return real(model, workload, plan, *args, **kwargs)

    monkeypatch.setattr(trainer, "trainer_run", spy)
    assert fast_run.run_peak(LLAMA1B, wl, plan, "memplan", "cuda") is not None
    assert stages == [(8, followed), (12, followed)]


def test_bf16_pipelines_stay_on_the_sums():
    """Only fp32 full training is pipelined through the cut runs: bf16 pipelines are within 0.02% on
    the sums (tests/search/test_fast_form_grid.py), and the trainer runs no LoRA under a pipeline."""
    assert fast_run.applies(LLAMA1B, Plan(pp=2, precision="fp32"), "memplan", "cuda")
    assert not fast_run.applies(LLAMA1B, Plan(pp=2, precision="bf16"), "memplan", "cuda")
    assert not fast_run.applies(LLAMA1B, Plan(pp=2, precision="fp32"), "hf", "cuda")
    assert not fast_run.applies(LLAMA1B, Plan(pp=2, tp=2, precision="fp32"), "memplan", "cuda")
