"""The middle decoder layers emitted from a built layer's events (``timeline/layer_repeat.py``)
equal the layers built op by op: the same events (ids, sizes, categories, streams, tags, order),
snapshots and host peak, over a grid of plans (:func:`_grid`) with three steady steps; the plans
it is enabled for do emit layers, and a pairing that fails falls back to op by op."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from memplan.costmodel.timeline import layer_repeat
from memplan.costmodel.timeline.layer_repeat import WORKSPACE_TEMPLATE, NotRepeatable, retag, span
from memplan.costmodel.timeline.trainer import trainer_run
from memplan.specs.resolve import resolve_job

LLAMA_1B = str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")  # 16 layers, tied


def _grid() -> dict[str, dict]:
    """dp 1 and 8, ZeRO 0 to 3, recompute none / selective / full, bf16 / bf16-mixed / fp32, TP 1
    and 2 with SP, PP 1 and 2, two micro-batches a step (the plans the run models)."""
    grid = {}
    for dp, zero, recompute, precision, tp, pp in itertools.product(
        (1, 8), (0, 1, 2, 3), ("none", "selective", "full"), ("bf16", "bf16-mixed", "fp32"), (1, 2), (1, 2)
    ):
        if dp == 1 and zero or dp > 1 and zero < 2 and (tp > 1 or pp > 1):  # not plans the run models
            continue
        plan = dict(dp=dp, zero=zero, recompute=recompute, precision=precision, tp=tp, pp=pp, global_batch=2 * dp)
        grid["-".join(f"{k}{v}" for k, v in plan.items() if k != "global_batch")] = plan | (
            {"sequence_parallel": True} if tp > 1 else {}
        )
    return grid


GRID = _grid()
# the default suite's share: the estimate's 8B plan kind, a single GPU under autocast with full
# recompute (whose casts the forward's end frees), ZeRO-2, TP + SP, and a plan that does not emit
DEFAULT = {
    "dp8-zero3-recomputenone-precisionbf16-tp1-pp1",
    "dp1-zero0-recomputefull-precisionbf16-mixed-tp1-pp1",
    "dp8-zero2-recomputeselective-precisionfp32-tp1-pp1",
    "dp8-zero3-recomputefull-precisionbf16-mixed-tp2-pp1",
    "dp8-zero0-recomputenone-precisionbf16-mixed-tp1-pp1",
}


def _emits(plan: dict) -> bool:
    """The plans whose layers are emitted (``_Run.layer_repeat``): no pipeline, no DDP."""
    return plan["pp"] == 1 and not (plan["dp"] > 1 and plan["zero"] < 2)


def _runs(plan: dict, monkeypatch) -> tuple:
    """(op by op, emitted, layer blocks emitted, layers) for ``plan``; fails where the emission
    fell back to op by op."""
    job = resolve_job(LLAMA_1B, None, {"seq_len": 256, "micro_batch": 1, **plan}, inference=False)
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
    plan = GRID[name]
    built, copied, blocks, layers = _runs(plan, monkeypatch)
    assert built is not None
    assert copied.events == built.events
    assert copied.snapshots == built.snapshots
    assert (copied.host_peak, copied.stage) == (built.host_peak, built.stage)
    # the warm-up step emits the span's forward and backward in each of its two micro-batches (the
    # steady steps are its events again: repeat.py); its first forward, whose layer 0 allocates
    # cuBLAS's workspace, from layer 2's, the second from layer 1's
    expected = 2 * (len(span(layers, WORKSPACE_TEMPLATE)) + len(span(layers)))
    assert blocks == (expected if _emits(plan) else 0)


def test_retag_shifts_every_layer_index():
    assert retag("fsdp.layers.5.all_gather_output", 3) == "fsdp.layers.8.all_gather_output"
    assert retag("layers.12.attention.wq.dW", -2) == "layers.10.attention.wq.dW"
    assert retag("tok_embeddings.embedding", 4) == "tok_embeddings.embedding"
    assert retag("layers.1.x", 0) == "layers.1.x"


def test_span_leaves_the_first_and_last_layers_built():
    assert span(16) == range(2, 14)
    assert span(16, WORKSPACE_TEMPLATE) == range(3, 14)
    assert not span(4)
    assert not span(5, WORKSPACE_TEMPLATE)


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


def test_the_default_share_is_in_the_grid():
    assert DEFAULT <= GRID.keys()
