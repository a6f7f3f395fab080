"""A tied embedding under bf16-mixed (autocast): the sum of its two gradients, the LM head's (the
autocast cast's backward, ``ToCopyBackward0``) and the embedding's, in the op-level run.

``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) adds the embedding's gradient
into the held one in place when ``can_accumulate_inplace`` holds: a plain tensor, its last
reference and its storage's. On CUDA the head's cast gradient is such a tensor: in t1b_full_x
(H100, Llama-3.2-1B-shaped, tied) each backward allocates the embedding's fp32 gradient and frees
it with no new allocation of that size before the optimizer step; the run does the same.

On CPU the bundled trainer is measured under MemTracker, a ``TorchDispatchMode``: every op's output
returns through Python, and such a tensor is not accumulated into in place (shown below with a bare
dispatch mode, torch 2.13.0+cpu), so the meter sees the sum out of place: one more fp32 copy of the
embedding, the forward's and backward's peak under full or selective-op recompute (without
recompute the logits' gradients peak higher). That is the meter's, not the trainer's on a GPU: the
CPU comparison runs the op-level run with ``inplace_accumulate=False``, the estimate keeps CUDA's.

Under TP both gradients are DTensors (the head's a row shard of the vocabulary, the embedding's
Replicate over every row: ``ops.embedding``'s ``vocab_shards``): the sum is out of place on any
device, and the DTensor add first redistributes the Replicate gradient to the shard, a clone of
this rank's chunk (torch/distributed/tensor/placement_types.py ``Shard._replicate_to_shard``,
``clone=True``); the run now makes both (``autograd.Tape._accumulate``).

Measured 2026-11-27 (torch 2.13.0+cpu, the tiny Llama below, 128 tokens): before, the forward's and
backward's peak was 2,205,848 B under the trainer's at tp 1, tp 2 and tp 2 + SP alike; now every
case is within 152 B of it (the step's and the forward's and backward's), as the untied ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from timeline_peaks import assert_peaks, measured_peaks, steady_peaks, trainer_record
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.costmodel.allocator import load_snapshot
from memplan.costmodel.timeline.events import ALLOC
from memplan.costmodel.timeline.support import supported
from memplan.costmodel.timeline.trainer import trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
TIED = ModelSpec(
    name="tiny-tied", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512,
    vocab_size=3000, tied_embeddings=True,
)  # fmt: skip
WORKLOAD = TrainingWorkload(seq_len=128, micro_batch=1)
MIXED = dict(precision="bf16-mixed")
TP2 = dict(tp=2, sequence_parallel=True)


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **(kwargs or {}))


def _cast_grad_is_the_sum(mode: TorchDispatchMode | None) -> bool:
    """A leaf used through an autocast-like cast and directly: whether its ``.grad`` is the cast's
    gradient, added into in place."""
    w = torch.randn(16, 16, requires_grad=True)
    seen = {}
    with mode if mode is not None else torch.autograd.set_grad_enabled(True):
        direct = w * 3
        cast = w.to(torch.bfloat16)
        loss = (cast * 2).float().sum() + direct.sum()
        cast.grad_fn.register_hook(lambda grad_inputs, _: seen.update(ptr=grad_inputs[0].data_ptr()))
        loss.backward()
    return seen["ptr"] == w.grad.data_ptr()


def test_a_dispatch_mode_makes_the_cast_gradients_sum_out_of_place():
    assert _cast_grad_is_the_sum(None)
    assert not _cast_grad_is_the_sum(_Passthrough())


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(dict(MIXED, recompute="full"), id="full"),
        pytest.param(dict(MIXED, recompute="full", **TP2), id="full-tp2-sp"),
        pytest.param(dict(MIXED, recompute="selective-op"), id="selective-op", marks=pytest.mark.slow),
        pytest.param(dict(MIXED, recompute="full", tp=2), id="full-tp2", marks=pytest.mark.slow),
        pytest.param(dict(MIXED, recompute="none", **TP2), id="none-tp2-sp", marks=pytest.mark.slow),
    ],
)
def test_the_trainer_on_cpu_peaks_where_the_run_does(plan):
    """The trainer under the meter against the run with its sums out of place."""
    plan = Plan(**plan)
    assert supported(TIED, WORKLOAD, plan) is None
    run = trainer_run(TIED, WORKLOAD, plan, inplace_accumulate=False)
    assert_peaks(str(plan), steady_peaks(run), measured_peaks(trainer_record(TIED, WORKLOAD, plan)))


def test_the_meters_sum_is_one_embedding_copy_at_tp1_and_none_under_tp():
    """At tp 1 the meter's out-of-place sum adds one fp32 gradient of the embedding to the
    backward's peak; under TP the sum is out of place on every device: the flag changes nothing."""
    fp32_embedding = TIED.vocab_size * TIED.hidden_size * 4
    for extra, more in ((dict(), fp32_embedding), (TP2, 0)):
        plan = Plan(**MIXED, recompute="full", **extra)
        cuda, cpu = (steady_peaks(trainer_run(TIED, WORKLOAD, plan, inplace_accumulate=f))[1] for f in (True, False))
        assert 0 <= cpu - cuda <= more and (cpu > cuda) == (more > 0), (extra, cpu - cuda)


def test_t1b_full_x_sums_the_tied_gradient_in_place():
    """Every fp32 allocation of the embedding's size (the parameter, its AdamW states, the head's
    cast gradient, the embedding's gradient, the optimizer's temporaries) in the H100 trace, one for
    one in the run; a run summing out of place makes one more per backward."""
    job = resolve_job(
        str(TRACES / "llama1b.config.json"),
        None,
        dict(dp=1, precision="bf16-mixed", recompute="full", seq_len=8192, micro_batch=4, global_batch=4),
        inference=False,
    )
    size = job.model.vocab_size * job.model.hidden_size * 4
    trace = load_snapshot(TRACES / "t1b_full_x.pkl.gz")["device_traces"][0]
    traced = sum(e["action"] == "alloc" and e["size"] == size for e in trace)

    def allocs(inplace: bool) -> int:
        run = trainer_run(job.model, job.workload, job.plan, inplace_accumulate=inplace)
        return sum(e.op == ALLOC and e.size == size for e in run)

    assert allocs(True) == traced
    assert allocs(False) == traced + 3  # a warm-up step and two measured ones
