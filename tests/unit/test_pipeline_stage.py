"""The pipeline rank an op-level estimate follows is the most loaded by the runs (``costmodel.stages``).

Every stage's run of the bundled trainer is built and replayed; the estimate follows the one that
runs out of memory first (``stages.load_key``), not the phase model's pick (``trainer.phase_stage``).
The plans here are ones where the two differ (a sweep of pp 2 / 4, 1F1B, GPipe and interleaved,
recompute none / full, fp32 / bf16, 2 to 8 micro-batches, CPU and CUDA, on the 1B Llama of the
H200 traces at 512 tokens found six, and four after the sums' pipeline moments of the same day, none
on CPU): each stage's run is built here directly and the estimate's
stage, reserved and allocated held against the most loaded of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.costmodel.cpu_reserve import cpu_replay
from memplan.costmodel.reserve import Failure, Replay, Verdict, replay
from memplan.costmodel.stages import load_key
from memplan.costmodel.timeline.cpu import cpu_view
from memplan.costmodel.timeline.trainer import followed_rank, most_loaded_stage, phase_stage, trainer_run
from memplan.estimation import memory_verdict
from memplan.specs.resolve import resolve_job

LLAMA1B = str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")
# (precision, device, what differs from pp 4, 1F1B, no recompute, 8 micro-batches of 1 x 512 tokens):
# the sweep of the module docstring again after the sums' pipeline moments of 2026-11-28 (the
# non-last stages' backward, autocast's casts per micro-batch), which made the phase model's pick
# agree with the runs on the first six it found; these four still differ (all on CUDA)
DIFFERING = [
    ("fp32", "cuda", {"global_batch": 4}),  # the sums name stage 3, the runs stage 0
    ("bf16-mixed", "cuda", {"global_batch": 4}),  # 3, 0
    ("bf16-mixed", "cuda", {"global_batch": 4, "recompute": "selective"}),  # 3, 0
    ("fp32", "cuda", {"recompute": "selective"}),  # 0, 3
]
# llama3-70b, TP 8 x PP 4 x DP 2 under ZeRO-3, full recompute (the default workload): the sums name
# stage 3 (29,446,111,232 B reserved), the runs stage 0 (30,737,956,864 B)
LLAMA70B_3D = dict(tp=8, pp=4, dp=2, zero=3, recompute="full")


def _job(precision: str, **extra):  # noqa: ANN003, ANN202
    plan = dict(pp=4, precision=precision, recompute="none", seq_len=512, micro_batch=1, global_batch=8)
    return resolve_job(LLAMA1B, None, {"gpu": "h200", **plan, **extra}, inference=False)


def _jobs():  # noqa: ANN202
    for precision, device, extra in DIFFERING:
        name = "-".join(f"{v}" for v in extra.values())
        yield pytest.param(lambda p=precision, e=extra: _job(p, **e), device, id=f"1b-{precision}-{name}-{device}")
    yield pytest.param(lambda: resolve_job("llama3-70b", None, LLAMA70B_3D, inference=False), "cuda", id="70b-3d")


def _each_stage(job, device: str) -> dict[int, Replay]:  # noqa: ANN001
    """Every stage's run, built and replayed here (unbounded: the default allocator on CUDA, the
    live bytes on CPU)."""
    out = {}
    for stage in range(job.plan.pp):
        cuda = device == "cuda"
        run = trainer_run(job.model, job.workload, job.plan, stage=stage, cuda=cuda, cpu_sdpa=not cuda)
        out[stage] = replay(run, job.allocator) if cuda else cpu_replay(cpu_view(run))
    return out


@pytest.mark.parametrize(("make", "device"), list(_jobs()))
def test_the_estimate_follows_the_stage_whose_run_is_the_most_loaded(make, device):
    job = make()
    replays = _each_stage(job, device)
    loaded = max(replays, key=lambda s: (replays[s].max_reserved, replays[s].max_allocated, -s))
    assert phase_stage(job.model, job.workload, job.plan, device) != loaded  # the case this test is for
    report, v, _ = memory_verdict(job, device)
    assert (report.peak.stage, report.peak.rank) == (loaded, followed_rank(job.model, job.workload, job.plan, loaded))
    assert report.peak.reserved == replays[loaded].max_reserved and v.fits
    assert report.peak.allocated == replays[loaded].max_allocated
    assert report.stage_reserved == {s: r.max_reserved for s, r in replays.items()}
    assert report.stage_peaks == {s: max(r.phase_peaks.values()) for s, r in replays.items()}
    assert most_loaded_stage(job.model, job.workload, job.plan, device) == loaded


def test_a_stage_that_does_not_fit_is_followed_before_a_fitting_one():
    """Within the capacity the job dies on the first rank the allocator cannot serve: one that does
    not fit comes first whatever its reserved; then the higher reserved, allocated, the lower stage."""

    def v(reserved: int, allocated: int, fits: bool) -> Verdict:
        r = Replay(reserved, allocated, 1, 0, 0, {}, None if fits else Failure(1, "c", "t", "s", 0, 0, 0))
        return Verdict(reserved, fits, "", r, r.failure, None)

    order = sorted(
        [(0, v(10, 9, True)), (1, v(8, 8, False)), (2, v(10, 9, True)), (3, v(10, 10, True)), (4, v(9, 9, False))],
        key=lambda sv: load_key(*sv),
    )
    assert [s for s, _ in order] == [4, 1, 3, 0, 2]


def test_within_the_capacity_the_stage_that_runs_out_is_followed():
    """With as much room as stage 3's replay reserves, stage 3 fits and stage 0 runs out: the
    estimate follows stage 0, does not fit, and still gives stage 3's reserved."""
    job = _job("bf16")
    replays = _each_stage(job, "cuda")
    limit = replays[3].max_reserved
    report, v, _ = memory_verdict(job, "cuda", limit)
    assert (report.peak.stage, v.fits, v.failure is not None) == (0, False, True)
    assert report.stage_reserved[3] == limit
