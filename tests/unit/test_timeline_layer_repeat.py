"""The middle decoder layers emitted from a built layer's events (``timeline/layer_repeat.py``)
equal the layers built op by op: the same events (ids, sizes, categories, streams, tags, order),
snapshots and host peak, over a grid of plans (data parallel 1 and 8, ZeRO 0 to 3, recompute
none / selective / full, bf16 / bf16-mixed / fp32, TP 2 with and without SP, PP 2, gradient
accumulation), with three steady steps; and the plans it is enabled for do emit layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.costmodel.timeline import layer_repeat
from memplan.costmodel.timeline.layer_repeat import NotRepeatable, retag, span
from memplan.costmodel.timeline.trainer import trainer_run
from memplan.specs.resolve import resolve_job

LLAMA_1B = str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")  # 16 layers, tied

# name: (plan, whether its layers are emitted)
GRID = {
    "single_bf16_mixed": (dict(precision="bf16-mixed"), True),
    "single_bf16": (dict(precision="bf16"), True),
    "single_fp32_full": (dict(precision="fp32", recompute="full"), True),
    "single_selective_accumulation": (dict(recompute="selective", global_batch=8), True),
    "single_bf16_master": (dict(precision="bf16-master"), True),
    "zero3": (dict(dp=8, zero=3), True),
    "zero3_accumulation_full": (dict(dp=8, zero=3, global_batch=32, recompute="full"), True),
    "zero3_fp32_selective": (dict(dp=8, zero=3, precision="fp32", recompute="selective"), True),
    "zero3_bf16": (dict(dp=8, zero=3, precision="bf16"), True),
    "tp_sp_zero3_selective": (dict(dp=4, tp=2, sequence_parallel=True, zero=3, recompute="selective"), True),
    "tp_sp_bf16_mixed": (dict(tp=2, sequence_parallel=True, precision="bf16-mixed"), True),
    "tp_without_sp": (dict(tp=2, sequence_parallel=False), True),
    "ddp": (dict(dp=8, zero=0, precision="bf16-mixed"), False),
    "zero1": (dict(dp=8, zero=1), False),
    "zero2": (dict(dp=8, zero=2, precision="bf16"), False),
    "pipeline": (dict(pp=2, global_batch=8), False),
    "pipeline_zero3": (dict(pp=2, dp=4, zero=3, global_batch=8, recompute="full"), False),
    "selective_op": (dict(recompute="selective-op", precision="bf16-mixed"), False),
    "recompute_layers": (dict(recompute="full", recompute_layers=3), False),
}

DEFAULT = {"single_bf16_mixed", "zero3_accumulation_full", "tp_sp_zero3_selective", "single_fp32_full", "ddp"}


def _runs(plan: dict, monkeypatch) -> tuple:
    """(op by op, emitted, layer blocks emitted) for ``plan``; fails where the emission fell back."""
    job = resolve_job(LLAMA_1B, None, {"seq_len": 512, "micro_batch": 1, **plan}, inference=False)
    built = trainer_run(job.model, job.workload, job.plan, steady_steps=3, repeated=False)
    emitted = []
    emit = layer_repeat.LayerRepeat._emit

    def counted(self, *args):
        emitted.append(args[3])
        return emit(self, *args)

    def refused(*args, **kwargs):
        raise AssertionError(f"the layers fell back to op by op: {args}")

    monkeypatch.setattr(layer_repeat.LayerRepeat, "_emit", counted)
    monkeypatch.setattr(layer_repeat.NotRepeatable, "__init__", refused)
    copied = trainer_run(job.model, job.workload, job.plan, steady_steps=3)
    return built, copied, len(emitted), job.model.num_layers


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in sorted(GRID)]
)
def test_emitted_layers_equal_the_layers_built_op_by_op(name, monkeypatch):
    plan, enabled = GRID[name]
    built, copied, blocks, layers = _runs(plan, monkeypatch)
    assert built is not None
    assert copied.events == built.events
    assert copied.snapshots == built.snapshots
    assert (copied.host_peak, copied.stage) == (built.host_peak, built.stage)
    micro_batches = 2 if plan.get("global_batch") else 1
    # the warm-up step and the first steady step emit their span's forward and backward (the later
    # steps are the first's events again: repeat.py)
    assert blocks == (2 * 2 * micro_batches * len(span(layers)) if enabled else 0)


def test_retag_shifts_every_layer_index():
    assert retag("fsdp.layers.5.all_gather_output", 3) == "fsdp.layers.8.all_gather_output"
    assert retag("layers.12.attention.wq.dW", -2) == "layers.10.attention.wq.dW"
    assert retag("tok_embeddings.embedding", 4) == "tok_embeddings.embedding"
    assert retag("layers.1.x", 0) == "layers.1.x"


def test_span_leaves_the_first_and_last_layers_built():
    assert span(16) == range(3, 14)
    assert not span(5)


def test_a_carried_tensor_that_does_not_pair_falls_back_to_op_by_op(monkeypatch):
    """A forward whose carried tensor is not where the copy looks for it raises NotRepeatable, and
    the run is then built op by op: the same events as with emission off."""
    job = resolve_job(LLAMA_1B, None, {"seq_len": 512, "micro_batch": 1, "dp": 8, "zero": 3}, inference=False)
    built = trainer_run(job.model, job.workload, job.plan, steady_steps=1, repeated=False)
    raised = []
    mapped = layer_repeat.LayerRepeat._mapped

    def off_by_one(self, tensor, shift):
        return mapped(self, tensor, shift) + 1

    init = NotRepeatable.__init__

    def record(self, *args):
        raised.append(args)
        init(self, *args)

    monkeypatch.setattr(layer_repeat.LayerRepeat, "_mapped", off_by_one)
    monkeypatch.setattr(NotRepeatable, "__init__", record)
    fallback = trainer_run(job.model, job.workload, job.plan, steady_steps=1)
    assert raised  # the pairing failed ...
    assert fallback.events == built.events  # ... and the run was built op by op
