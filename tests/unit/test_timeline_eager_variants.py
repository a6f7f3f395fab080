"""Eager attention under autocast (bf16-mixed) and under LoRA in the op-level run
(``costmodel/timeline/eager.py``), in the rank layouts and recomputes the run follows.

No GPU ran eager attention: the run is held against the bundled trainer itself on CPU, measured
the way tests/validate measures it (MemTracker, the steady peak over the measured steps), CUDA's
temporaries left out (``timeline_peaks.steady_peaks``: the softmax backward's ``grad * output``,
cuBLAS's workspaces, the embedding backward's scratch) and LoRA's dropout on CPU's kernel
(``trainer_run(..., cuda=False)``). Beside the step's peak and the forward's and backward's (as
tests/unit/test_timeline_eager.py), the forward's alone: it peaks inside a layer's attention,
where matmul's fold of RoPE's q is a view at one sequence and a copy at two.

Measured 2026-11-27 (torch 2.13.0+cpu), predicted - measured, for the step, the forward and
backward, and the forward: -156 B in full training (-80 B under ZeRO-1, -76 B on the pipeline
rank), -224 to -228 B under LoRA (at most 0.0028%; the few bytes are not traced to a tensor, as in
test_timeline_recompute.py). Before this module followed autocast, bf16-mixed at 256 tokens was
1,573,020 B (4.4%) under the trainer: k repeated in fp32, its and q's bf16 casts, the fp32
probabilities' cast. Before the fold was a view at b = 1, the bf16 forward of the MHA model at
512 tokens was 393,216 B over (q's and k's copies); before a selective re-run kept autocast,
bf16-mixed selective was 196,452 B over (the re-run's scores in fp32).
"""

from __future__ import annotations

import pytest
from timeline_peaks import CPU_BOUND, _cuda_only, steady_peaks

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline.events import ALLOC, FREE, MARK, Timeline
from memplan.costmodel.timeline.trainer import MICRO_BATCHES_MODELLED, supported, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

SMALL = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=256, vocab_size=256
)
MHA = SMALL.model_copy(update=dict(name="tiny-mha", num_kv_heads=6))  # k and v unrepeated: folded as they are

EAGER = dict(attention="eager")
MIXED = dict(precision="bf16-mixed", **EAGER)
LORA = dict(finetune="lora", lora_rank=8, lora_targets=("all-linear",), **EAGER)
# name: (model, plan, (seq_len, micro_batch, global_batch))
CASES = {
    "bf16-mixed-b2": (SMALL, MIXED, (128, 2, None)),
    "bf16-mixed-mha-b1": (MHA, MIXED, (256, 1, None)),
    "bf16-mha-b1-s512": (MHA, dict(precision="bf16", **EAGER), (512, 1, None)),
    "bf16-mixed-selective": (SMALL, dict(MIXED, recompute="selective"), (128, 2, None)),
    "bf16-mixed-full-accum2": (SMALL, dict(MIXED, recompute="full"), (128, 2, 4)),
    "bf16-mixed-selective-op": (SMALL, dict(MIXED, recompute="selective-op"), (128, 2, None)),
    "bf16-mixed-ddp2": (SMALL, dict(MIXED, dp=2, zero=0), (256, 1, None)),
    "bf16-mixed-zero1-dp2-full": (SMALL, dict(MIXED, dp=2, zero=1, recompute="full"), (128, 2, None)),
    "bf16-mixed-zero3-dp2": (SMALL, dict(MIXED, dp=2, zero=3), (256, 1, None)),  # MixedPrecisionPolicy
    "bf16-mixed-tp2-sp": (SMALL, dict(MIXED, tp=2, sequence_parallel=True), (256, 1, None)),
    "bf16-mixed-pp2-1f1b": (SMALL, dict(MIXED, pp=2, pp_schedule="1f1b"), (128, 1, 4)),
    "lora-bf16-mixed": (SMALL, dict(LORA, precision="bf16-mixed"), (256, 1, None)),
    "lora-bf16-mha-b1-s512": (MHA, dict(LORA, precision="bf16"), (512, 1, None)),
    "lora-bf16-mixed-selective": (SMALL, dict(LORA, precision="bf16-mixed", recompute="selective"), (128, 2, None)),
    "lora-bf16-mixed-full-dropout-copy-accum2": (
        SMALL,
        dict(LORA, precision="bf16-mixed", recompute="full", lora_dropout=0.1, modules_to_save=("lm_head",)),
        (128, 1, 2),
    ),
    "lora-fp32": (SMALL, dict(LORA, precision="fp32"), (256, 1, None)),
    "lora-bf16-master-full": (SMALL, dict(LORA, precision="bf16-master", recompute="full"), (256, 1, None)),
    "lora-bf16-ddp2": (SMALL, dict(LORA, precision="bf16", dp=2), (256, 1, None)),
}

# in the default run: each mechanism once (LoRA under autocast with a selective re-run, the fold at
# one sequence); the other cases under -m slow (the default suite's time)
DEFAULT = {"lora-bf16-mixed-selective", "bf16-mha-b1-s512"}


def _forward_peak(timeline: Timeline) -> int:
    """The run's highest live bytes in the steady steps' forwards, CUDA's allocations left out
    (as :func:`timeline_peaks.steady_peaks`)."""
    live = best = 0
    steady = forward = False
    for e in timeline:
        if e.op == MARK:
            steady = steady or e.tag == "step0"
            forward = e.tag == "phase:forward" if e.tag.startswith("phase:") else forward
        elif _cuda_only(e.tag):
            continue
        elif e.op == ALLOC:
            live += e.size
            best = max(best, live) if steady and forward else best
        elif e.op == FREE:
            live -= e.size
    return best


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    pytest.importorskip("torch")
    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    model, changes, (seq, micro_batch, global_batch) = CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=global_batch)
    assert supported(model, workload, plan) is None  # the estimate follows it op by op
    timeline = trainer_run(model, workload, plan, max_micro_batches=MICRO_BATCHES_MODELLED, cuda=False)
    predicted = (*steady_peaks(timeline), _forward_peak(timeline))
    record = run(RunSpec(model=model, workload=workload, plan=plan, rank=0, steps=2))
    assert record.status == "ok", record.reason
    phases = record.phases
    measured = (record.peak_allocated, max(phases["forward"].allocated, phases["backward"].allocated))
    measured += (phases["forward"].allocated,)
    for what, p, got in zip(("step", "forward and backward", "forward"), predicted, measured, strict=True):
        assert abs(p / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {p:,}, measured {got:,}"


def test_the_estimate_answers_eager_autocast_and_lora_plans_with_the_op_level_run():
    for changes in (
        dict(precision="bf16-mixed"),
        dict(precision="bf16-mixed", recompute="selective", dp=4, zero=0),
        dict(precision="bf16", finetune="lora", lora_rank=16, recompute="full"),
        dict(precision="bf16-mixed", finetune="lora", lora_rank=16, dp=2, zero=1),
    ):
        job = resolve_job("llama3-8b", None, dict(seq_len=2048, attention="eager", **changes), False)
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", (changes, which)


def test_eager_attention_over_a_4_bit_base_is_answered_by_the_run():
    """fp32 layer inputs beside bitsandbytes' kernels: checked against the trainer on CPU in
    tests/unit/test_timeline_quant_compose.py."""
    job = resolve_job("llama3-8b", None, dict(seq_len=2048, attention="eager", finetune="qlora"), False)
    assert supported(job.model, job.workload, job.plan) is None
    assert trainer_run(job.model, job.workload, job.plan) is not None
