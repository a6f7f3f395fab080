"""The bundled trainer's timeline (``costmodel.timeline.trainer``) replayed through the allocator
model against the six H100 runs of tests/data/gpu-traces (README there: plans and figures).

These six are the runs the timeline was transcribed from (``trainer.py``, ``fsdp.py``,
``tensor_parallel.py`` cite them), so matching them is a regression test of the transcription,
not a held-out prediction; the runs it was not built from are the H200 ones of
tests/data/gpu-traces/h200.json (tests/unit/test_capacity_margin.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.reserve import replay
from memplan.costmodel.timeline.events import ALLOC, FREE
from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.resolve import resolve_job

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
LLAMA_1B = str(TRACES / "llama1b.config.json")

# name: (model, plan, expandable_segments, measured max_memory_allocated, measured max_memory_reserved)
RUNS = {
    "t1b_none": (
        LLAMA_1B,
        dict(dp=1, precision="bf16-mixed", seq_len=4096, micro_batch=2, global_batch=2),
        False,
        47_075_763_200,
        47_752_151_040,
    ),
    "t1b_full_x": (
        LLAMA_1B,
        dict(dp=1, precision="bf16-mixed", recompute="full", seq_len=8192, micro_batch=4, global_batch=4),
        True,
        70_825_436_160,
        81_499_521_024,
    ),
    "t8_z3_bf16": (
        "llama3-8b",
        dict(dp=8, zero=3, precision="bf16", recompute="full", seq_len=4096, micro_batch=2, global_batch=16),
        False,
        22_169_104_384,
        31_224_496_128,
    ),
    "t8_tp2_x": (
        "llama3-8b",
        dict(
            dp=4,
            tp=2,
            sequence_parallel=True,
            zero=3,
            precision="bf16-mixed",
            recompute="full",
            seq_len=8192,
            micro_batch=1,
            global_batch=4,
        ),
        True,
        22_289_758_208,
        28_775_022_592,
    ),
    "t70_z3": (
        "llama3-70b",
        dict(dp=64, zero=3, precision="bf16-mixed", recompute="full", seq_len=4096, micro_batch=1, global_batch=64),
        False,
        29_060_026_368,
        41_334_865_920,
    ),
    "t8_sel": (
        "llama3-8b",
        dict(dp=8, zero=3, precision="bf16-mixed", recompute="selective", seq_len=4096, micro_batch=1, global_batch=8),
        False,
        45_911_342_080,
        57_688_457_216,
    ),
}
RESERVED_TOLERANCE = 0.05
ALLOCATED_TOLERANCE = 0.02

# t1b_full_x under the default allocator: PyTorch saw 79.18 GiB, less the CUDA context and cuBLAS
H100_CAPACITY = 85_018_877_624
OUTSIDE_ALLOCATOR = 545_259_520


def _job(name: str, **changes):
    model, plan, *_ = RUNS[name]
    return resolve_job(model, None, dict(plan, **changes), inference=False)


@pytest.fixture(scope="module")
def timelines() -> dict:
    out = {}
    for name in RUNS:
        job = _job(name)
        out[name] = trainer_run(job.model, job.workload, job.plan)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_replayed_peaks_still_match_the_run_they_were_transcribed_from(timelines, name):
    *_, expandable, allocated, reserved = RUNS[name]
    result = replay(timelines[name], AllocatorConfig(expandable_segments=expandable))
    assert result.failure is None
    assert abs(result.max_reserved / reserved - 1) <= RESERVED_TOLERANCE, (result.max_reserved, reserved)
    assert abs(result.max_allocated / allocated - 1) <= ALLOCATED_TOLERANCE, (result.max_allocated, allocated)


def test_default_allocator_runs_out_where_the_run_did(timelines):
    """t1b_full_x ran out of memory with the default allocator ("Tried to allocate 15.66 GiB",
    17.34 GiB reserved but unallocated) and fit with expandable segments."""
    timeline, limit = timelines["t1b_full_x"], H100_CAPACITY - OUTSIDE_ALLOCATOR
    failed = replay(timeline, AllocatorConfig(expandable_segments=False), capacity_bytes=limit).failure
    assert failed is not None
    b, s, vocab = 4, 8192, 128_256
    assert failed.size == b * s * vocab * 4  # an fp32 b x s x V tensor of the loss backward: 15.66 GiB
    assert failed.category == "logits_and_loss"
    assert replay(timeline, AllocatorConfig(expandable_segments=True), capacity_bytes=limit).failure is None


@pytest.mark.parametrize("name", list(RUNS))
def test_steady_steps_leave_what_they_found(timelines, name):
    """Nothing leaks from one steady step to the next: live bytes at both ends are equal."""
    live, at_mark = 0, {}
    for e in timelines[name]:
        if e.op == ALLOC:
            live += e.size
        elif e.op == FREE:
            live -= e.size
        else:
            at_mark[e.tag] = live
    assert at_mark["step1"] == at_mark["step2"]
    assert at_mark["step0"] > at_mark["build"]  # optimizer states and cuBLAS workspaces


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (dict(pp=2, zero=0, global_batch=32), "pipeline"),  # over DDP: the trainer refuses it
        (dict(zero=1, offload_optimizer="cpu"), "offload"),
        (dict(precision="fp16-master"), "precision"),
        # the bundled trainer's (a fine-tuning plan defaults to the Trainer, which refuses int8 under FSDP2)
        (
            dict(finetune="qlora", quant="int8", precision="bf16-mixed", runtime="memplan"),
            "LLM.int8 base under autocast",
        ),
    ],
    ids=["pipeline", "zero1-offload", "fp16-master", "int8-autocast"],
)
def test_plans_it_cannot_follow_get_none(changes, reason):
    job = _job("t8_sel", **changes)
    assert trainer_run(job.model, job.workload, job.plan) is None
    assert reason in supported(job.model, job.workload, job.plan)


def test_the_70b_run_is_quick_enough_for_estimate():
    job = _job("t70_z3")
    start = time.perf_counter()
    timeline = trainer_run(job.model, job.workload, job.plan)
    replay(timeline, AllocatorConfig())
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"trainer_run + replay of the 70B plan took {elapsed:.2f} s"
