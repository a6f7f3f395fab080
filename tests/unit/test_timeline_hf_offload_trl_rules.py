"""Two of TRL's offload rules the op-level run follows (``timeline/hf_offload.py``; docs/cost-model.md, "Two more of
TRL's rules, traced over quantized bases"): in TRL's own code (trl 1.16.0, ``OffloadActivations`` run on CPU as
tests/accuracy/trl_offload.py runs it) and in the run's ``TrlOffload`` on a tape.

- a copy brought back for a checkpoint's re-run that the re-run saved again (``x.detach()``) leaves TRL's backward
  stash at its own node (``record_stream``), not after the next node that unpacks;
- TRL's ``curr_autograd_node`` keeps the last node that unpacked an offloaded save, and what it reaches (a custom
  Function's ctx attributes), alive after the backward, until the next backward's first such node.

The slow Trainer cases that these rules brought to TRL's figures are in test_timeline_hf_offload_ranks.py,
test_timeline_hf_quant_moe_ranks.py and test_timeline_hf_offload_moe.py. Seconds in all.
"""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Tape
from memplan.costmodel.timeline.events import Builder
from memplan.costmodel.timeline.hf_offload import TrlOffload

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("transformers")

from torch.utils.checkpoint import checkpoint  # noqa: E402

ROWS, COLS = 4, 64  # 4 x 64 fp32: 1,024 B, TRL's min_offload_size


def _trl():  # noqa: ANN202 - trl's OffloadActivations over a model without a head (none to pause)
    from trl_offload import trl_offload

    with mock.patch("trl.models.activation_offloading.logger"):  # "no output head was detected"
        return trl_offload(torch.nn.Linear(COLS, COLS))


def _streamed() -> tuple[list, mock._patch]:
    calls: list = []
    return calls, mock.patch.object(torch.Tensor, "record_stream", lambda t, stream: calls.append(tuple(t.shape)))


def test_trl_lets_go_of_a_copy_the_checkpoints_rerun_saved_at_its_node() -> None:
    """``exp(h * h)`` checkpointed, then five ``sin``s (five offloaded saves: ``h`` leaves the forward stash): the
    re-run, started by ``ExpBackward0``, saves ``h.detach()`` twice for the ``MulBackward0`` after it, and TRL's hook
    on ``ExpBackward0`` finds the copy's storage held more than at its unpack; the ``sin``s' copies are not."""
    ctx = _trl()
    calls, patch = _streamed()
    x = torch.randn(ROWS, COLS, requires_grad=True)
    with patch, ctx:
        h = x * 2  # no save: a scalar's product
        y = checkpoint(lambda a: torch.exp(a * a), h, use_reentrant=False)  # _NoopSaveInputs packs h: offloaded
        del h
        for _ in range(5):
            y = torch.sin(y)
        y.sum().backward()
    assert calls == [(ROWS, COLS)], calls  # h's copy, let go of at ExpBackward0's hook


def test_trl_keeps_the_last_unpacking_nodes_graph_after_the_backward() -> None:
    """A custom Function's ctx attribute (bitsandbytes' ``ctx.A``) outlives the backward while TRL holds the node
    that unpacked last (``curr_autograd_node``), and goes when that reference does."""
    held: list[weakref.ref] = []

    class Keeps(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):  # noqa: ANN001, ANN205
            ctx.kept = a.clone()  # an attribute, not a saved tensor: the hooks never see it
            held.append(weakref.ref(ctx.kept))
            return a * 1

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            return g

    ctx = _trl()
    calls, patch = _streamed()
    x = torch.randn(ROWS, COLS, requires_grad=True)
    with patch, ctx:
        h = Keeps.apply(x * 2)
        loss = (h * h).sum()  # MulBackward0 saves h twice: the first offloaded, the second deduplicated
        del h
        loss.backward()
    del loss
    gc.collect()
    assert ctx.curr_autograd_node is not None and held[0]() is not None  # alive after the step
    ctx.curr_autograd_node = None  # what the next backward's first unpacking node does
    assert held[0]() is None


def _tape() -> tuple[Tape, TrlOffload, dict]:
    tape = Tape(Builder())
    hooks = tape.hooks = TrlOffload()
    return tape, hooks, {}


def test_the_run_lets_go_of_a_copy_the_rerun_saved_at_its_node() -> None:
    """The same steps in the run: ``h``'s copy leaves the backward stash at the re-run's node (before: held until the
    next node that unpacks, here none: the end of the step)."""
    tape, hooks, grads = _tape()
    x = tape.new(ROWS * COLS, 4, "x")
    x.fn = ops.leaf(grads, "x")
    h = ops.unary(tape, x, "double")  # saves nothing

    def region(a):  # noqa: ANN001, ANN202 - the forward, and the re-run on the input's copy
        return ops.output_saved(tape, ops.mul(tape, a, a, "square"), "exp")

    y = tape.checkpoint(lambda: region(h), [h], rerun=region, packed=1)
    tape.done(h)
    for i in range(5):
        y, prior = ops.output_saved(tape, y, f"sin{i}"), y
        tape.done(prior)
    tape.backward(y, tape.new(ROWS * COLS, 4, "seed"))
    assert hooks.back == {}
    assert not [e for e in tape.b.live.values() if e[-1] == "checkpoint_input"]


def test_the_run_keeps_what_the_last_unpacking_node_reaches_until_the_next_backward() -> None:
    """``TrlOffload.reached`` is the node TRL holds and those it reaches; what ``hold_graph`` takes goes when the next
    backward's first unpacking node rebinds it."""
    tape, hooks, grads = _tape()
    x = tape.new(ROWS * COLS, 4, "x")
    x.fn = ops.leaf(grads, "x")

    def step() -> None:
        h = ops.unary(tape, x, "double")
        loss = ops.unary(tape, ops.mul(tape, h, h, "square"), "sum", out_numel=1)
        tape.done(h)
        tape.backward(loss, tape.new(1, 4, "seed"))
        hooks.end_of_step(tape)

    step()
    reached = hooks.reached()
    assert hooks.node is not None and {hooks.node, x.fn} <= reached  # the square's node, down to the leaf
    kept = tape.new(ROWS * COLS, 4, "ctx_attribute")
    hooks.hold_graph([kept])
    assert kept.st.tid in tape.b.live
    step()  # its MulBackward0 unpacks h's copy: a new node, the last step's goes
    assert kept.st.tid not in tape.b.live
