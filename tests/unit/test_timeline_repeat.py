"""A steady step emitted again from the step before's events (``timeline/repeat.py``) equals the
step built op by op: the same events (ids, sizes, categories, streams, tags, order), snapshots and
host peak, over every mechanism family of the bundled trainer's run, with three steady steps (a
repeat of a repeat)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.costmodel.timeline.events import Builder, Category
from memplan.costmodel.timeline.repeat import repeat
from memplan.costmodel.timeline.trainer import trainer_run
from memplan.specs.resolve import resolve_job

LLAMA_1B = str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")  # tied embeddings

# name: (plan, further trainer_run arguments)
GRID = {
    "fsdp2_zero3": (dict(dp=8, zero=3), {}),
    "fsdp2_zero3_accumulation": (dict(dp=8, zero=3, global_batch=32), {}),
    "fsdp2_zero2_bf16": (dict(dp=8, zero=2, precision="bf16"), {}),
    "ddp_full_recompute": (dict(dp=2, zero=0, precision="bf16-mixed", recompute="full"), {}),
    "ddp_accumulation": (dict(dp=2, zero=0, precision="bf16-mixed", global_batch=8), {}),
    "zero1": (dict(dp=2, zero=1), {}),
    "tp_sp_selective": (dict(dp=2, tp=2, sequence_parallel=True, zero=3, recompute="selective"), {}),
    "tp_without_sp": (dict(tp=2), {}),
    "pipeline_1f1b_last_rank": (
        dict(pp=4, dp=2, zero=2, precision="bf16-mixed", recompute="full", global_batch=16),
        {"stage": 3},
    ),
    "pipeline_1f1b_first_rank": (dict(pp=4, dp=1, precision="bf16-mixed", global_batch=8), {}),
    "pipeline_interleaved": (dict(pp=2, pp_schedule="interleaved", virtual_stages=2, global_batch=8), {}),
    "pipeline_gpipe_zero2": (dict(pp=2, dp=2, zero=2, pp_schedule="gpipe", global_batch=8), {}),
    "lora_full_recompute": (dict(finetune="lora", lora_rank=16, recompute="full"), {}),
    "lora_ddp": (dict(dp=2, finetune="lora", lora_rank=8), {}),
    "qlora_nf4": (
        dict(finetune="qlora", quant="nf4", lora_rank=16, precision="bf16", recompute="full", seq_len=2048),
        {},
    ),
    "lora_int8": (dict(finetune="lora", quant="int8", lora_rank=8), {}),
    "fsdp2_cpu_offload": (
        dict(dp=8, zero=3, offload_params="cpu", offload_optimizer="cpu", precision="bf16-mixed", recompute="full"),
        {},
    ),
    "activation_offload": (dict(offload_activations="cpu", recompute="full"), {}),
    "selective_op": (dict(recompute="selective-op", precision="bf16-mixed"), {}),
    "recompute_layers": (dict(recompute="full", recompute_layers=3), {}),
    "fp32_full": (dict(precision="fp32", recompute="full"), {}),
    "bf16_master": (dict(precision="bf16-master"), {}),
    "eager_attention": (dict(attention="eager", precision="bf16-mixed"), {}),
    "triton_attention": (dict(attention="triton", precision="bf16-mixed"), {}),
    "lora_dropout_cpu": (dict(finetune="lora", lora_rank=8, lora_dropout=0.1), {"cuda": False}),
    "lora_zero1": (dict(dp=2, zero=1, finetune="lora", lora_rank=8), {}),
    "ddp_activation_offload": (dict(dp=2, zero=0, offload_activations="cpu", recompute="full"), {}),
    "tied_sum_out_of_place": (dict(precision="bf16-mixed"), {"inplace_accumulate": False}),
}


# the default suite's share (one plan of each kind of carried tensor: accumulation under FSDP2 and DDP,
# a pipeline's schedules, a quantized base, CPU's dropout, the host copies, an out-of-place sum); the
# rest under -m slow
DEFAULT = {
    "fsdp2_zero3_accumulation", "ddp_accumulation", "pipeline_1f1b_last_rank", "pipeline_interleaved", "qlora_nf4",
    "lora_dropout_cpu", "activation_offload", "tied_sum_out_of_place",
}  # fmt: skip


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in sorted(GRID)]
)
def test_a_repeated_step_equals_the_step_built_op_by_op(name):
    plan, kwargs = GRID[name]
    job = resolve_job(LLAMA_1B, None, {"seq_len": 512, "micro_batch": 1, **plan}, inference=False)
    built = trainer_run(job.model, job.workload, job.plan, steady_steps=3, repeated=False, **kwargs)
    copied = trainer_run(job.model, job.workload, job.plan, steady_steps=3, **kwargs)
    assert built is not None, name  # a plan the op-level run models
    assert copied.events == built.events
    assert copied.snapshots == built.snapshots
    assert (copied.host_peak, copied.stage) == (built.host_peak, built.stage)


def _step(b: Builder, kept: list[int], tag: str) -> None:
    """A step that frees what the step before kept and keeps one new tensor tagged ``tag``."""
    for tensor in kept:
        b.free(tensor)
    work = b.alloc(1024, Category.ACTIVATIONS, "work")
    b.free(work)
    kept[:] = [b.alloc(512, Category.ACTIVATIONS, tag)]


def test_a_block_whose_carried_tensors_do_not_pair_is_not_repeated():
    b, kept = Builder(), []
    _step(b, kept, "batch")
    start = b.position()
    _step(b, kept, "batch")  # frees a "batch", keeps a "batch": repeatable
    end = b.position()
    assert repeat(b, start, end)
    assert [e.tag for e in b.build().events[end[0] :]] == ["batch", "work", "work", "batch"]
    assert b.build().events[end[0]].tensor == kept[0]  # the carried-in batch is the one this block kept
    start = b.position()
    _step(b, [max(b.live)], "labels")  # frees a "batch", keeps a "labels": not the same live set
    end = b.position()
    assert not repeat(b, start, end)
    assert b.position() == end  # nothing appended
