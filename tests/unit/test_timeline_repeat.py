"""A steady step emitted again from the step before's events (``timeline/repeat.py``) equals the
step built op by op: the same events (ids, sizes, categories, streams, tags, order), snapshots and
host peak, over every mechanism family of the bundled trainer's run, with three steady steps (a
repeat of a repeat)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.costmodel.timeline import repeat as repeat_module
from memplan.costmodel.timeline import trainer
from memplan.costmodel.timeline.events import Builder, Category
from memplan.costmodel.timeline.repeat import derive, repeat
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
def test_a_repeated_step_equals_the_step_built_op_by_op(name, monkeypatch):
    plan, kwargs = GRID[name]
    job = resolve_job(LLAMA_1B, None, {"seq_len": 512, "micro_batch": 1, **plan}, inference=False)
    built = trainer_run(job.model, job.workload, job.plan, steady_steps=3, repeated=False, **kwargs)
    derived = []

    def spy(*args):
        derived.append(repeat_module.derive(*args))
        return derived[-1]

    monkeypatch.setattr(trainer, "derive", spy)
    copied = trainer_run(job.model, job.workload, job.plan, steady_steps=3, **kwargs)
    assert built is not None, name  # a plan the op-level run models
    # the first steady step derived from the warm-up step's events (repeat.derive) but where the warm-up
    # step differs otherwise: a pipeline's receive buffers, DDP's bucket rebuild (ZeRO-1 runs over DDP),
    # LLM.int8's outlier columns, Triton's autotuning
    plain = plan.get("pp", 1) == 1 and not (plan.get("dp", 1) > 1 and plan.get("zero", 0) < 2)
    assert derived == ([True] if plain and plan.get("quant") != "int8" and plan.get("attention") != "triton" else [])
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


def _step_of(b: Builder, kept: list[int], spans: list, first: bool = True) -> None:
    """A step: a batch (freeing the one before, where there is one), on the ``first`` step a state
    (a span of ``spans``), work, and a batch kept."""
    batch = b.alloc(256, Category.ACTIVATIONS, "batch")
    for tensor in kept:
        b.free(tensor)
    kept[:] = [batch]
    if first:
        at = b.position()
        b.alloc(2048, Category.OPTIMIZER_STATES, "state")
        spans.append((at[0], b.position()[0], at[1], b.position()[1]))
    work = b.alloc(1024, Category.ACTIVATIONS, "work")
    b.mark("phase:optimizer")
    b.free(work)


def test_a_step_derived_from_the_first_equals_the_second_built():
    """``derive``: the first step's events without its spans, the carried batch freed where the second
    step frees it, the ids as the second step built op by op numbers them."""
    built, kept, spans = Builder(), [], []
    _step_of(built, kept, spans)
    _step_of(built, kept, [], first=False)
    b, kept, spans = Builder(), [], []
    start = b.position()
    _step_of(b, kept, spans)
    end = b.position()
    assert derive(b, start, end, spans, {1: list(kept)})
    ops = [(e.op, e.tag) for e in b.build().events[end[0] :]]
    assert ops == [(0, "batch"), (1, "batch"), (0, "work"), (2, "phase:optimizer"), (1, "work")]
    assert b.build().events == built.build().events
    assert b.mark_ids == built.mark_ids
    assert b.position() == built.position()  # the state's id is not made again


def test_a_step_is_not_derived_where_its_events_do_not_allow_it():
    """A span that frees what it did not allocate, a tensor a span made freed outside it, a free of what
    the block did not allocate, a carried tensor not live: False, nothing appended."""
    for case in ("span frees outside", "freed outside the span", "not the block's", "not live"):
        b = Builder()
        before = b.alloc(64, Category.ACTIVATIONS, "before")
        start = b.position()
        at = b.position()
        state = b.alloc(64, Category.OPTIMIZER_STATES, "state")
        if case == "span frees outside":
            b.free(before)
        spans = [(at[0], b.position()[0], at[1], b.position()[1])]
        if case == "freed outside the span":
            b.free(state)
        if case == "not the block's":
            b.free(before)
        kept = b.alloc(64, Category.ACTIVATIONS, "batch")
        carried = {b.position()[0]: [kept + (1 if case == "not live" else 0)]}
        end = b.position()
        assert not derive(b, start, end, spans, carried), case
        assert b.position() == end, case
