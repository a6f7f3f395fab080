"""Eager attention (``attention: eager``) in the op-level run (``costmodel/timeline/eager.py``).

No GPU trace ran eager attention: the run is held against the bundled trainer itself on CPU,
measured the way tests/validate measures it (MemTracker, the steady peak over the measured steps),
CUDA's temporaries left out (``timeline_peaks.steady_peaks``; here the softmax backward's
``grad * output``). The eager path is the same composite on both devices. The cases are sized so
that most peak inside a layer's attention backward (the s x s scores beside the softmax's fp32
gradient), a small MLP and vocabulary.

Measured 2026-11-27 (torch 2.13.0+cpu), predicted - measured: -156 B in every case (at most
0.0010%), for the step and for the forward and backward alone. Measured step peaks: bf16 at 256
tokens 24,967,204 B; fp32 without GQA 36,488,100; selective recompute 15,038,500; full recompute
with 2 micro-batches 12,340,900; fp32 with 2 x 128 tokens 29,689,252; ZeRO-3 dp 2 22,751,908; DDP
dp 2 with full recompute 14,666,404; TP 2 + SP over ZeRO-3 dp 2 11,873,444.
"""

from __future__ import annotations

import pytest
from timeline_peaks import assert_the_trainer_peaks_where_the_run_does

from memplan.costmodel.reserve import plan_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

SMALL = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=256, vocab_size=256
)
MHA = SMALL.model_copy(update=dict(name="tiny-mha", num_kv_heads=6))  # no repeat: k and v cloned by matmul

EAGER = dict(attention="eager")
# name: (model, plan, (seq_len, micro_batch, global_batch))
CASES = {
    "bf16-s256": (SMALL, dict(precision="bf16", **EAGER), (256, 1, None)),
    "fp32-mha-s256": (MHA, dict(precision="fp32", **EAGER), (256, 1, None)),
    "bf16-selective": (SMALL, dict(precision="bf16", recompute="selective", **EAGER), (128, 2, None)),
    "bf16-full-accum2": (SMALL, dict(precision="bf16", recompute="full", **EAGER), (128, 2, 4)),
    "fp32": (SMALL, dict(precision="fp32", **EAGER), (128, 2, None)),
    "zero3-dp2-bf16-s256": (SMALL, dict(precision="bf16", dp=2, zero=3, **EAGER), (256, 1, None)),
    "ddp2-full-bf16-s256": (SMALL, dict(precision="bf16", dp=2, zero=0, recompute="full", **EAGER), (256, 1, None)),
    "tp2-sp-zero3-dp2-bf16-s256": (
        SMALL, dict(precision="bf16", tp=2, sequence_parallel=True, dp=2, zero=3, **EAGER), (256, 1, None)
    ),
}  # fmt: skip


# in the default run: each mechanism once; the other cases under -m slow (the default suite's time)
DEFAULT = {"bf16-s256", "fp32-mha-s256", "zero3-dp2-bf16-s256"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_the_bundled_trainer_on_cpu_with_eager_attention_peaks_where_the_run_does(name):
    pytest.importorskip("torch")

    model, changes, (seq, micro_batch, global_batch) = CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=global_batch)
    assert_the_trainer_peaks_where_the_run_does(name, model, workload, plan)


def test_the_estimate_answers_eager_plans_with_the_op_level_run():
    # bf16-mixed (autocast) and LoRA: test_timeline_eager_variants.py
    for changes in (dict(precision="bf16"), dict(precision="bf16-master", recompute="full")):
        job = resolve_job("llama3-8b", None, dict(seq_len=2048, attention="eager", **changes), False)
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", (changes, which)
