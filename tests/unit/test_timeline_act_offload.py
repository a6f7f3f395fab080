"""Activation offload (``offload_activations: cpu``, ``save_on_cpu``) in the op-level run
(``costmodel/timeline/act_offload.py``).

No GPU trace ran activation offload: the run is held against the bundled trainer itself, run on CPU
and measured the way tests/validate measures it (MemTracker, the steady peak over the measured
steps), with the trainer's CPU emulation of ``save_on_cpu`` (``memplan/train/offload.py``: the host
copy outside torch's allocator, each unpacked copy inside it, as on CUDA). Left out of the comparison
are the run's CUDA-only allocations (``timeline_peaks.steady_peaks``): cuBLAS's workspaces, the
embedding backward's index buffers, the staging copies of non-contiguous saves and flash's copies of
unpacked saves (from source, act_offload.py). Most cases use a model whose widest moment is inside a
layer's backward (a wide MLP, a small vocabulary), where the unpacked copies are live.

Measured 2026-11-27 (torch 2.13.0+cpu), predicted - measured, for the step and for the forward and
backward alone: every case -156 B (-140 B under full recompute), at most 0.0008%; the host copies:
the trainer's exactly, but for the 16 B of philox seed and offset each flash call saves on CUDA and
not on CPU. (``step`` / ``forward and backward`` / host, measured: bf16 40,330,268 / 38,851,492 /
50,265,476; bf16-mixed 80,652,188 / 69,830,308 / 52,169,476; full recompute 42,554,276 both /
3,191,172; bf16-master with full recompute 96,780,956 / 74,811,812 / 3,191,172.)
"""

from __future__ import annotations

import pytest
from timeline_peaks import assert_the_trainer_peaks_where_the_run_does

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline import act_offload
from memplan.costmodel.timeline.ops import FLASH_OUT_COPY, PHILOX
from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

CPU_BOUND = 0.0001  # 0.01% of the trainer's peak, as test_timeline_recompute.py

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
TIED = TINY.model_copy(update=dict(name="tiny-tied", tied_embeddings=True))
# the widest moment inside a layer's backward (the MLP's), not the loss's or the embedding's
WIDE = TINY.model_copy(update=dict(name="tiny-wide", ffn_size=1536, vocab_size=256))

OFF = dict(offload_activations="cpu")
# name: (model, plan, (micro_batch, global_batch)); sequences of 128 tokens
CASES = {
    "bf16": (WIDE, dict(precision="bf16", **OFF), (4, None)),
    "bf16-mixed": (WIDE, dict(precision="bf16-mixed", **OFF), (4, None)),
    "full-bf16": (WIDE, dict(precision="bf16", recompute="full", **OFF), (4, None)),
    "full-bf16-master": (WIDE, dict(precision="bf16-master", recompute="full", **OFF), (4, None)),
    "accum2-bf16": (WIDE, dict(precision="bf16", **OFF), (4, 8)),
    "ddp2-full-bf16": (WIDE, dict(precision="bf16", dp=2, zero=0, recompute="full", **OFF), (4, None)),
    "tied-bf16": (TIED, dict(precision="bf16", **OFF), (1, None)),
}


class _Recorded(act_offload.SaveOnCpu):
    """The run's hooks, kept for their host bytes."""

    made: list[act_offload.SaveOnCpu] = []

    def __init__(self) -> None:
        super().__init__()
        _Recorded.made.append(self)


# in the default run: each mechanism once; the other cases under -m slow (the default suite's time)
DEFAULT = {"bf16", "full-bf16", "ddp2-full-bf16"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_the_bundled_trainer_offloading_on_cpu_peaks_where_the_run_does(name, monkeypatch):
    pytest.importorskip("torch")
    model, changes, (micro_batch, global_batch) = CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=128, micro_batch=micro_batch, global_batch=global_batch)
    _Recorded.made = []
    monkeypatch.setattr(act_offload, "SaveOnCpu", _Recorded)
    record = assert_the_trainer_peaks_where_the_run_does(name, model, workload, plan)
    # the host copies: CUDA's flash also saves its philox seed and offset (the CPU kernel has none)
    philox = 0 if plan.recompute == "full" else 2 * PHILOX * model.num_layers
    assert [h.host_peak - philox for h in _Recorded.made] == [record.offload_host_bytes]


def test_the_estimate_answers_offloaded_plans_with_the_op_level_run():
    for changes in (
        dict(precision="bf16", recompute="full"),
        dict(precision="bf16-mixed"),
        dict(precision="bf16-master", recompute="full", dp=2, zero=0),
    ):
        job = resolve_job(
            "llama3-8b", None, dict(seq_len=4096, micro_batch=1, offload_activations="cpu", **changes), False
        )
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", (changes, which)
    job = resolve_job("llama3-8b", None, dict(seq_len=4096, offload_activations="cpu", recompute="selective"), False)
    assert supported(job.model, job.workload, job.plan) == "activation offload with this plan"


def test_offload_keeps_no_layer_activation_on_the_device():
    """The forward's saves go to the host: the step's peak drops, and the device copies come back
    one node at a time; on CUDA the transposed saves stage a contiguous copy as they are packed,
    and flash's backward copies the unpacked output (from source)."""
    workload = TrainingWorkload(seq_len=4096, micro_batch=1)
    plain, offloaded = Plan(precision="bf16"), Plan(precision="bf16", offload_activations="cpu")
    job = resolve_job("llama3-8b", None, dict(seq_len=4096), False)
    a, b = trainer_run(job.model, workload, plain), trainer_run(job.model, workload, offloaded)
    assert b.peak()[0] < a.peak()[0]
    tags = {e.tag.rpartition(".")[2] for e in b}
    assert {act_offload.STAGING, FLASH_OUT_COPY, "unpacked"} <= tags
    assert not {act_offload.STAGING, FLASH_OUT_COPY, "unpacked"} & {e.tag.rpartition(".")[2] for e in a}
