"""FSDP2 over a tied embedding in the op-level run (``fsdp.py``: one root group holding the
embedding, which is the LM head's matrix, and the final norm; not resharded after the forward).

No GPU trace ran it: the run is held against the bundled trainer itself, run on CPU under rank
simulation and measured the way tests/validate measures it (MemTracker, the steady peak over the
measured steps), CUDA's allocations left out (``timeline_peaks.steady_peaks``). Gradient
accumulation and pipelines over a tied model: test_timeline_fsdp_variants.py. Measured 2026-11-27
(torch 2.13.0+cpu), predicted - measured: -88 B (-152 B under full recompute, +64 B with FSDP2's
CPU offload), at most 0.001%, for the step and for the forward and backward alone. Measured step
peaks: ZeRO-3 bf16 16,638,560 B; ZeRO-3 mixed 32,108,192; ZeRO-2 28,805,216; TP 2 + SP 18,056,616;
full recompute 17,628,256; selective-op 26,463,904; CPU offload 19,204,488.
"""

from __future__ import annotations

import pytest
from timeline_peaks import assert_the_trainer_peaks_where_the_run_does

from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

TIED = ModelSpec(
    name="tiny-tied", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512,
    vocab_size=3000, tied_embeddings=True,
)  # fmt: skip

FSDP = dict(dp=2, zero=3)
# name: (plan, micro_batch); sequences of 128 tokens
CASES = {
    "zero3-bf16": (dict(precision="bf16", **FSDP), 1),
    "zero3-bf16-mixed": (dict(precision="bf16-mixed", **FSDP), 2),
    "zero2-bf16": (dict(precision="bf16", dp=2, zero=2), 2),
    "tp2-sp-zero3-bf16-mixed": (dict(precision="bf16-mixed", tp=2, sequence_parallel=True, **FSDP), 2),
    "zero3-full-bf16": (dict(precision="bf16", recompute="full", **FSDP), 2),
    "zero3-selective-op-bf16-mixed": (dict(precision="bf16-mixed", recompute="selective-op", **FSDP), 2),
    "zero3-cpu-offload-bf16-mixed": (
        dict(precision="bf16-mixed", offload_params="cpu", offload_optimizer="cpu", **FSDP), 2
    ),
}  # fmt: skip


# in the default run: each mechanism once; the other cases under -m slow (the default suite's time)
DEFAULT = {"zero3-bf16", "zero2-bf16", "zero3-full-bf16"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_the_bundled_trainer_on_cpu_with_a_tied_root_group_peaks_where_the_run_does(name):
    pytest.importorskip("torch")

    changes, micro_batch = CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=128, micro_batch=micro_batch)
    assert_the_trainer_peaks_where_the_run_does(name, TIED, workload, plan)


def test_the_root_group_gathers_the_shared_matrix_once():
    """One all-gather of the root (embedding and final norm) a step, before the layers', none in
    the backward (not resharded after the forward); under accumulation one a micro-batch."""
    plan, workload = Plan(precision="bf16", **FSDP), TrainingWorkload(seq_len=128, micro_batch=1)
    tags = [
        e.tag for e in trainer_run(TIED, workload, plan, steady_steps=1) if e.op == 0 and "all_gather_output" in e.tag
    ]
    assert tags[0].startswith("fsdp.tok_embeddings") and sum(t.startswith("fsdp.tok_embeddings") for t in tags) == 2
    assert not any(t.startswith("fsdp.norm") for t in tags)
    accumulating = TrainingWorkload(seq_len=128, micro_batch=1, global_batch=4)
    assert supported(TIED, accumulating, plan) is None
    tags = [
        e.tag
        for e in trainer_run(TIED, accumulating, plan, steady_steps=1)
        if e.op == 0 and "all_gather_output" in e.tag
    ]
    assert sum(t.startswith("fsdp.tok_embeddings") for t in tags) == 4  # two micro-batches, two steps
