"""Pipelines combined with the other mechanisms in the op-level run
(``costmodel/timeline/pipeline.py``): fp32 and bf16-master on a pipeline rank, alone and under
FSDP2; FSDP2 over interleaved chunks (``apply_fsdp`` per chunk, each its own root); TP + SP on one
data rank or under FSDP2, with a pipeline or without (the last chunk's loss under ``loss_parallel``,
which keeps the labels; the first chunk's vocabulary-parallel embedding, whose gradient covers the
whole vocabulary and stays so, unsharded, until the reduction after the last action; without FSDP2,
until ``zero_grad``, bf16-master's optimizer step copying it whole to fp32). The embedding's
gradient is held at tp 4 without a pipeline too: before, read as an fp32 gradient of the local rows
and its cast (the same bytes at tp 2, t8_tp2_x), the run was 2,706,476 B (-12.9%) under the trainer
at tp 4 ZeRO-3 bf16 and 14,336,024 B (-40.8%) on the pipelined tp 4 case.

No GPU ran these plans: each is held against the bundled trainer itself, run on CPU under rank
simulation and measured the way tests/validate measures it (MemTracker, the steady peak over the
measured steps), as tests/unit/test_timeline_pipeline.py and test_timeline_zero1.py do. What only
CUDA allocates is left out of the run (cuBLAS's workspaces, the CUDA kernels' scratch named in
test_timeline_zero1.py's ``CUDA_ONLY``); in fp32 the trainer runs under SDPA's math backend, the
kernel CUDA takes for fp32 with GQA (``support.sdpa_kernel``). Measured 2026-11-27
(torch 2.13.0+cpu): every case below within 156 B of the trainer's peak, for the step and for the
forward and backward alone (at most 0.001%; those bytes are not traced to a tensor, as in
test_timeline_pipeline.py).

The trainer refuses pipelines over DDP or ZeRO-1 (``validate.support.check_plan``: "with pipeline
parallel the trainer shards data parallel with FSDP2"): there is nothing to hold such a run
against, and those plans stay on the phase model.
"""

from __future__ import annotations

import contextlib

import pytest
from test_timeline_zero1 import CUDA_ONLY, TIED, TINY
from timeline_peaks import steady_peaks

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

CPU_BOUND = 0.0001  # 0.01% of the trainer's peak

V2 = dict(pp=2, pp_schedule="interleaved", virtual_stages=2)
TP2 = dict(tp=2, sequence_parallel=True, dp=2)
# a vocabulary large beside the layers: the embedding's backward is the step's peak
WIDE = ModelSpec(
    name="tiny-wide-vocab", hidden_size=256, num_layers=2, num_attention_heads=8, num_kv_heads=4, ffn_size=512,
    vocab_size=16000,
)  # fmt: skip
# name: (model, plan, global batch, pipeline rank); micro-batches of 1 x 128 tokens
CPU_CASES = {
    "1f1b-pp2-first-fp32": (TINY, dict(precision="fp32", pp=2), 4, 0),
    "1f1b-pp2-last-fp32-full": (TINY, dict(precision="fp32", pp=2, recompute="full"), 4, 1),
    "gpipe-pp2-last-tied-fp32-selective-op": (
        TIED, dict(precision="fp32", pp=2, pp_schedule="gpipe", recompute="selective-op"), 4, 1
    ),
    "1f1b-pp2-last-bf16-master": (TINY, dict(precision="bf16-master", pp=2), 4, 1),
    "interleaved-pp2-v2-first-bf16-master": (
        TINY, dict(V2, precision="bf16-master"), 4, 0
    ),
    "1f1b-pp2-last-zero2-dp2-fp32": (TINY, dict(precision="fp32", pp=2, dp=2, zero=2), 8, 1),
    "1f1b-pp2-first-zero3-dp2-bf16-master": (TINY, dict(precision="bf16-master", pp=2, dp=2, zero=3), 8, 0),
    "interleaved-pp2-v2-first-zero2-dp2-bf16-mixed": (TINY, dict(V2, precision="bf16-mixed", dp=2, zero=2), 8, 0),
    "interleaved-pp2-v2-last-zero3-dp2-bf16": (TINY, dict(V2, precision="bf16", dp=2, zero=3), 8, 1),
    "interleaved-pp2-v2-last-zero3-dp2-full": (
        TINY, dict(V2, precision="bf16-mixed", dp=2, zero=3, recompute="full"), 8, 1
    ),
    "interleaved-pp2-v2-first-zero2-dp2-fp32-selective-op": (
        TINY, dict(V2, precision="fp32", dp=2, zero=2, recompute="selective-op"), 8, 0
    ),
    "1f1b-pp2-first-tp2-sp-zero3-dp2-bf16-mixed": (TINY, dict(TP2, pp=2, precision="bf16-mixed", zero=3), 8, 0),
    "1f1b-pp2-last-tp2-sp-zero2-dp2-bf16": (TINY, dict(TP2, pp=2, precision="bf16", zero=2), 8, 1),
    "gpipe-pp2-last-tp2-sp-zero3-dp2-bf16-mixed": (
        TINY, dict(TP2, pp=2, pp_schedule="gpipe", precision="bf16-mixed", zero=3), 8, 1
    ),
    "interleaved-pp2-v2-first-tp2-sp-zero2-dp2-fp32": (TINY, dict(TP2, **V2, precision="fp32", zero=2), 8, 0),
    "interleaved-pp2-v2-last-tp2-sp-zero3-dp2-selective": (
        TINY, dict(TP2, **V2, precision="bf16-mixed", zero=3, recompute="selective"), 8, 1
    ),
    "1f1b-pp2-first-tp4-sp-zero3-dp2-bf16-mixed": (
        WIDE, dict(TP2, tp=4, pp=2, precision="bf16-mixed", zero=3), 8, 0
    ),
    "1f1b-pp2-first-tp2-sp-bf16": (TINY, dict(TP2, dp=1, pp=2, precision="bf16"), 4, 0),
    "1f1b-pp2-last-tp2-sp-bf16": (TINY, dict(TP2, dp=1, pp=2, precision="bf16"), 4, 1),
    "interleaved-pp2-v2-first-tp2-sp-bf16-master": (TINY, dict(TP2, **V2, dp=1, precision="bf16-master"), 4, 0),
    # no pipeline: TP on one data rank; the vocabulary-parallel embedding's gradient at tp 4 (``ops.embedding``)
    "tp2-sp-bf16-mixed": (TINY, dict(TP2, dp=1, precision="bf16-mixed"), None, 0),
    "tp2-sp-fp32-full": (TINY, dict(TP2, dp=1, precision="fp32", recompute="full"), None, 0),
    "tp2-sp-bf16-master-selective": (TINY, dict(TP2, dp=1, precision="bf16-master", recompute="selective"), None, 0),
    "tp4-sp-zero3-dp2-bf16": (WIDE, dict(TP2, tp=4, precision="bf16", zero=3), None, 0),
    "tp4-sp-zero2-dp2-bf16-mixed": (WIDE, dict(TP2, tp=4, precision="bf16-mixed", zero=2), None, 0),
}  # fmt: skip
SLOW = {
    "gpipe-pp2-last-tied-fp32-selective-op", "interleaved-pp2-v2-first-bf16-master", "1f1b-pp2-last-bf16-master",
    "interleaved-pp2-v2-last-zero3-dp2-full", "gpipe-pp2-last-tp2-sp-zero3-dp2-bf16-mixed",
    "interleaved-pp2-v2-last-tp2-sp-zero3-dp2-selective", "tp4-sp-zero2-dp2-bf16-mixed", "tp2-sp-bf16-mixed",
    "tp2-sp-bf16-master-selective",
    "1f1b-pp2-last-fp32-full",
    "1f1b-pp2-last-zero2-dp2-fp32",
    "interleaved-pp2-v2-first-zero2-dp2-fp32-selective-op",
    "1f1b-pp2-last-tp2-sp-zero2-dp2-bf16",
    "interleaved-pp2-v2-first-tp2-sp-zero2-dp2-fp32",
    "1f1b-pp2-first-tp4-sp-zero3-dp2-bf16-mixed",
    "1f1b-pp2-last-tp2-sp-bf16",
    "interleaved-pp2-v2-first-tp2-sp-bf16-master",
}  # fmt: skip


def _run_peaks(model: ModelSpec, workload: TrainingWorkload, plan: Plan, stage: int) -> tuple[int, int]:
    """The steady peaks of pipeline rank ``stage``'s run, what only CUDA allocates left out."""
    run = trainer_run(model, workload, plan, stage=stage)
    assert run is not None
    return steady_peaks([e for e in run if e.tag.rsplit(".", 1)[-1] not in CUDA_ONLY])


def _measure(model: ModelSpec, workload: TrainingWorkload, plan: Plan, stage: int) -> tuple[int, int]:
    """The bundled trainer on CPU, the first rank of pipeline stage ``stage``: the steady peak,
    and the forward's and backward's."""
    pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    math = sdpa_kernel(SDPBackend.MATH) if plan.precision == "fp32" else contextlib.nullcontext()
    with math:
        record = run(RunSpec(model=model, workload=workload, plan=plan, rank=stage * plan.dp * plan.tp, steps=2))
    assert record.status == "ok", record.reason
    return record.peak_allocated, max(record.phases[p].allocated for p in ("forward", "backward"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CPU_CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    model, changes, global_batch, stage = CPU_CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=128, micro_batch=1, global_batch=global_batch)
    assert supported(model, workload, plan) is None  # the estimate follows it op by op
    predicted, measured = _run_peaks(model, workload, plan, stage), _measure(model, workload, plan, stage)
    for what, p, got in zip(("step", "forward and backward"), predicted, measured, strict=True):
        assert abs(p / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {p:,}, measured {got:,}"


def test_the_estimate_answers_these_pipelines_with_the_op_level_run():
    for changes in (
        dict(pp=4, precision="fp32", recompute="full"),
        dict(pp=4, precision="bf16-master", dp=2, zero=3, global_batch=16),
        dict(pp=2, virtual_stages=2, pp_schedule="interleaved", precision="bf16-mixed", dp=4, zero=2, global_batch=16),
        dict(pp=4, tp=2, sequence_parallel=True, precision="bf16-mixed", dp=2, zero=3, recompute="full"),
        dict(pp=4, tp=2, sequence_parallel=True, precision="bf16"),
        dict(tp=4, sequence_parallel=True, precision="bf16-mixed", recompute="selective"),
    ):
        job = resolve_job("llama3-8b", None, dict(dict(seq_len=4096, global_batch=8), **changes), inference=False)
        assert supported(job.model, job.workload, job.plan) is None
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", which


def test_tp_over_ddp_stays_on_the_phase_model():
    """The trainer refuses it (``validate.support.check_plan``: DDP over DTensor parameters)."""
    plan = dict(tp=2, sequence_parallel=True, dp=2, zero=0)
    job = resolve_job("llama3-8b", None, plan, inference=False)
    assert "tensor parallel without FSDP2" in (supported(job.model, job.workload, job.plan) or "")


@pytest.mark.parametrize("zero", [0, 1])
def test_pipelines_over_ddp_or_zero1_stay_on_the_phase_model(zero):
    """The trainer refuses them (``validate.support.check_plan``): nothing to hold the run against."""
    job = resolve_job("llama3-8b", None, dict(pp=4, dp=2, zero=zero, global_batch=16), inference=False)
    assert "pipeline" in (supported(job.model, job.workload, job.plan) or "")
    assert trainer_run(job.model, job.workload, job.plan) is None
