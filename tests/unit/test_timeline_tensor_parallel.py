"""Tensor parallel without sequence parallel in the op-level run (``tensor_parallel.all_reduce``).

No GPU trace ran TP without SP: the run is held against the bundled trainer itself, run on CPU under
rank simulation and measured the way tests/validate measures it (MemTracker, the steady peak over
the measured steps), CUDA's allocations left out (``timeline_peaks.steady_peaks``). The funcol
all-reduces and DTensor's redistributions run the same code on both devices (a fake process group
on CPU). Measured 2026-11-27 (torch 2.13.0+cpu), predicted - measured: -92 B, -140 B under full
recompute, at most 0.003%, for the step and for the forward and backward alone; measured step
peaks: ZeRO-3 7,928,548 B; selective-op under the mixed policy 10,370,340; full recompute with 2
micro-batches 5,195,300; ZeRO-2 under the mixed policy 23,268,268.
"""

from __future__ import annotations

import pytest
from timeline_peaks import assert_the_trainer_peaks_where_the_run_does

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline.trainer import trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
SMALL = TINY.model_copy(update=dict(name="tiny-small", ffn_size=256, vocab_size=256))

TP = dict(tp=2, sequence_parallel=False, dp=2)
# name: (model, plan, (seq_len, micro_batch, global_batch))
CASES = {
    "zero3-bf16": (SMALL, dict(precision="bf16", zero=3, **TP), (256, 1, None)),
    "zero3-selective-op-bf16-mixed": (
        SMALL, dict(precision="bf16-mixed", zero=3, recompute="selective-op", **TP), (256, 2, None)
    ),
    "zero3-full-accum2-bf16": (SMALL, dict(precision="bf16", zero=3, recompute="full", **TP), (256, 1, 4)),
    "zero2-bf16-mixed": (TINY, dict(precision="bf16-mixed", zero=2, **TP), (128, 2, None)),
}  # fmt: skip


# in the default run: each mechanism once; the other cases under -m slow (the default suite's time)
DEFAULT = {"zero3-bf16", "zero2-bf16-mixed"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_the_bundled_trainer_on_cpu_with_tp_without_sp_peaks_where_the_run_does(name):
    pytest.importorskip("torch")

    model, changes, (seq, micro_batch, global_batch) = CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=global_batch)
    assert_the_trainer_peaks_where_the_run_does(name, model, workload, plan)


def test_without_sp_the_stream_is_whole_and_all_reduced():
    """The estimate answers with the op-level run; without SP each row-parallel output is
    all-reduced (a (b, s, h) copy), never reduce-scattered, and the layers' activations are
    larger than with SP."""
    plans = {sp: dict(dp=4, tp=2, zero=3, sequence_parallel=sp, precision="bf16", seq_len=4096) for sp in (False, True)}
    jobs = {sp: resolve_job("llama3-8b", None, plan, False) for sp, plan in plans.items()}
    job = jobs[False]
    _, which = plan_run(job.model, job.workload, job.plan, "memplan")
    assert which == "trainer", which
    runs = {sp: trainer_run(j.model, j.workload, j.plan) for sp, j in jobs.items()}
    tags = {sp: {e.tag.rpartition(".")[2] for e in run} for sp, run in runs.items()}
    assert "all_reduce" in tags[False] and "reduce_scatter" not in tags[False]
    assert "reduce_scatter" in tags[True] and "all_reduce" not in tags[True]
    assert runs[False].peak()[0] > runs[True].peak()[0]
