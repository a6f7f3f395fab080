"""torch's reentrant checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``) as ops on the tape.

``CheckpointFunction`` (torch 2.13 ``torch/utils/checkpoint.py``), an ``autograd.Function``:

- **forward**: ``ctx.save_for_backward(*tensor_inputs)`` (the positional tensors: transformers'
  ``GradientCheckpointingLayer`` passes the hidden states alone, ``partial(forward, self, **kwargs)`` binding
  the rest), ``ctx.run_function = run_function`` (the partial: the position ids, the rotary tables, the masks
  and kwargs such as ``num_items_in_batch``, an attribute held until the graph goes, not a saved tensor),
  ``ctx.fwd_cpu_state = torch.get_rng_state()`` (a host tensor; on CUDA the device states are host tensors
  too), then ``with torch.no_grad(): outputs = run_function(*args)``: no node inside, nothing saved, no
  ``ctx`` of an ``autograd.Function`` such as bitsandbytes' ``MatMul8bitFp`` (so no ``ctx.A``). The output
  gets the ``CheckpointFunctionBackward`` node when an input requires grad (else nothing is kept);
- **backward**: ``detach_variable(inputs)`` (aliases that require grad as their inputs did: leaves), the
  forward re-run on them ``with torch.enable_grad()`` and the forward's autocast state (a fresh autocast
  cache, cleared as the block exits), whole (not stopped at its last save, as the non-reentrant re-run is),
  then ``torch.autograd.backward(outputs, grads)``: a nested run of the engine over the re-run's graph (its
  nodes' sequence numbers above the outer graph's, so they run before any outer one), the detached inputs'
  ``AccumulateGrad`` stealing their gradients into ``.grad``, returned as the node's. ``outputs`` (the
  **recomputed layer output**) is a local of ``backward``: alive through the inner backward and freed at the
  return, with the re-run's graph (its ``ctx`` attributes: ``ctx.A``) before its storage
  (``TensorImpl::release_resources`` resets the autograd meta first). The engine then frees the incoming
  gradient and the saved inputs (``release_variables``).

Over more than one rank under the Trainer (tests/unit/test_timeline_hf_reentrant_ranks.py): FSDP2's hooks stay
around the checkpoint (transformers checkpoints the layer's ``forward``, not ``__call__``: modeling_layers.py:84), as
around the non-reentrant one; DDP's reducer hooks fire in the nested backward as each gradient is made (a PEFT model
needs ``ddp_find_unused_parameters=False``: ``hf_ddp.wrap``).

Under TRL's activation offload (``hf_offload.py``) the hooks pack the saved input in the forward and the re-run's
saves in the backward, and release the nested backward's copies by graph task (``Tape.graph``): the next outer
node that unpacks frees them (tests/unit/test_timeline_hf_reentrant_offload.py).

The RNG states are host tensors (the CPU generator's 5,056-byte state is not an op's output either): no
device bytes. Nothing here is stopped early or cached: each layer's backward is its re-run's whole graph.
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor


class Reentrant:
    """One run's reentrant checkpoints: ``held``, the ``ctx`` attributes (the partials' tensors) kept until
    the graph goes (:meth:`free_graph`); ``inner(begin)``: a function called before a re-run that returns
    the one that frees what the re-run's graph holds beyond its saved tensors (``Int8.held``'s ``ctx.A``),
    called as ``backward`` returns."""

    def __init__(self, tape: Tape, inner: Callable[[], Callable[[], None]] | None = None) -> None:
        self.tape = tape
        self.inner = inner
        self.held: list[Tensor] = []

    def checkpoint(
        self, forward: Callable[[], Tensor], inputs: list[Tensor], attrs: list[Tensor], rerun: Callable[..., Tensor]
    ) -> Tensor:
        """``CheckpointFunction.apply(run_function, True, *inputs)``: ``forward()`` under ``no_grad``;
        ``attrs``: the tensors ``run_function`` holds (kept with the graph); ``rerun(*detached)`` the
        forward with grad on, returning its output (held by the caller)."""
        t = self.tape
        with t.no_grad():
            out = forward()

        def apply(tape: Tape, node: Node, grads: list[Tensor | None], saved: list) -> list:
            return self._backward(node, grads, saved, rerun)

        node = t.node("CheckpointFunction", apply, inputs, saved=inputs)
        if node is not None:  # the ctx lives with the graph; without a node it goes as apply returns
            self.held += [t.hold(a) for a in attrs]
        out.fn = node
        return out

    def _backward(self, node: Node, grads: list[Tensor | None], saved: list, rerun: Callable[..., Tensor]) -> list:
        """``CheckpointFunction.backward``: the re-run on detached inputs, the inner backward seeded with the
        incoming gradient, the detached inputs' ``.grad`` returned; then its locals go."""
        t = self.tape
        slots: dict[str, Tensor] = {}
        detached = []
        for i, (x, edge) in enumerate(zip(saved, node.nexts, strict=True)):
            d = Tensor(x.numel, x.itemsize, t.hold(x).st, transposed=x.transposed)  # x.detach(): an alias
            d.fn = ops.leaf(slots, str(i)) if edge is not None else None  # requires_grad_ as x: a leaf
            detached.append(d)
        free_inner = self.inner() if self.inner is not None else None
        out = rerun(*detached)
        t.backward(out, t.hold(grads[0]))  # torch.autograd.backward(outputs, args): the args tuple holds it too
        t.scope, t._node = node.scope, node
        outs = [slots.pop(str(i), None) for i in range(len(saved))]  # the detached inputs' .grad
        for d in detached:  # the frame's locals in order: detached_inputs, then outputs
            t.drop(d)
        if free_inner is not None:  # the re-run's graph, released with its root's autograd meta
            free_inner()
        t.drop(out)
        return outs

    def free_graph(self) -> None:
        """The graph goes (from the loss down): each checkpoint's ``ctx.run_function`` with it."""
        for a in reversed(self.held):
            self.tape.drop(a)
        self.held = []
