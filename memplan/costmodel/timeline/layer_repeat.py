"""The middle decoder layers of a step emitted from a built layer's events, not built op by op.

The middle layers of a dense model are alike: each layer's forward makes the same requests as the
layer before it, and its backward the same as the layer after it, from the same live set up to the
tensor ids and the layer index in the tags (``layers.5.attention.wq`` for ``layers.4.attention.wq``).
Building them through the autograd engine costs ~13,000 instructions an event (docs/accuracy.md,
2026-11-28); copying a layer's events costs a tenth of that (``repeat.py`` does it for a whole step).

Per micro-batch, with ``T`` its template layer and ``L`` layers: layers 0 to ``T`` are built op by
op, then
layers ``T + 1`` to ``L - 3`` are emitted as copies of layer ``T``'s forward
(:meth:`LayerRepeat.emit_forward`), then ``L - 2`` and ``L - 1`` are built (the last one's backward
starts from the head's, not a layer's). In the graph one node stands for the emitted span
(:meth:`LayerRepeat._apply`): when the engine reaches it, layer ``L - 2``'s backward has just run,
and the node emits it again once per emitted layer, from ``L - 3`` down to ``T + 1``, before layer
``T``'s backward is built. What the run's Python objects keep for the emitted layers is set as the
built layers left it, renumbered (:meth:`LayerRepeat.relabel`): the span's output and its gradient,
autocast's cached weight casts, FSDP2's kept all-gather output, ZeRO-2's unsharded parameters, the
sharded gradients, the last reduce-scatter input and the prefetched all-gather, a plain run's
``.grad`` tensors. ``trainer._Run.layer_repeat`` says which plans use it.

The renumbering: each layer's forward and backward is a *block* of tensor ids. A tensor a block
allocates maps to the same offset in the copy's block; a tensor the template frees that another
block allocated (the previous layer's output, its all-gather output, the layer after's
reduce-scatter input) maps to the same offset in the block that stands to the copy as that block
stands to the template (the layer before, the layer after), and must be live there with the same
size, category, stream and tag (renumbered); a tensor outside every block (the residual stream's
gradient, which passes through every layer) is the same tensor. Anything else (a mark inside a
layer, a tensor not live where the copy frees it, a role that differs) raises
:class:`NotRepeatable`, and ``trainer.trainer_run`` builds the whole run op by op. That the emitted
run equals the op-by-op one, event for event, is checked over a grid of plans
(tests/unit/test_timeline_layer_repeat.py).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from functools import lru_cache

from memplan.costmodel.timeline.autograd import Node, Storage, Tape, Tensor
from memplan.costmodel.timeline.events import ALLOC, FREE
from memplan.costmodel.timeline.trainer_model import Model

# The forward's template layer: layers 0..T are built first, and the tensors the template frees that
# layer T - 1 allocated map to the same offsets in the block of the layer before each copy, so layer
# T - 1's block must be laid out as a regular layer's. Layer 0's is, but in the forward whose first
# matmul allocates cuBLAS's workspace (the warm-up step's first micro-batch: one id more in its block);
# there the template is layer 2. Each layer built instead of emitted costs ~1.4 M instructions
# (an 8B layer's forward and backward, ~300 events), so the template is the earliest that pairs.
TEMPLATE = 1
WORKSPACE_TEMPLATE = 2
BUILT_AFTER = 2  # layers built after the span: the last one's backward starts from the head's, not a layer's
FORWARD, BACKWARD = 0, 1
_LAYER = re.compile(r"(?<=layers\.)(\d+)")


class NotRepeatable(Exception):
    """The layers' events do not pair (module docstring): the run is built op by op."""


@lru_cache(maxsize=4096)
def _tag_parts(tag: str) -> tuple[str | int, ...]:
    """``tag`` split around its layer indices (ints), for :func:`retag`."""
    parts = _LAYER.split(tag)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def retag(tag: str, shift: int) -> str:
    """``tag`` with each ``layers.{i}`` as ``layers.{i + shift}``."""
    parts = _tag_parts(tag)
    if len(parts) == 1 or shift == 0:
        return tag
    return "".join(str(p + shift) if i % 2 else p for i, p in enumerate(parts))  # type: ignore[operator]


def _prepared(events: list[tuple]) -> list[tuple]:
    """A template's events, flat, each with its tag split around its one layer index (``parts``, None:
    no index), so that a copy unpacks one tuple per event and renames the tag with one format
    (:meth:`LayerRepeat._emit`)."""
    out = []
    for e in events:
        parts = _tag_parts(e[5])
        if len(parts) > 3:
            raise NotRepeatable(f"a tag with two layer indices: {e[5]}")
        out.append((*e, parts if len(parts) == 3 else None))
    return out


def span(layers: int, template: int = TEMPLATE) -> range:
    """The layers emitted from the events of others after the ``template`` layer (empty when too few
    layers for it)."""
    return range(template + 1, layers - BUILT_AFTER)


class LayerRepeat:
    """One micro-batch's layer blocks, the forward's emission, and the span's backward node."""

    def __init__(self, model: Model, fsdp, grads: dict[str, Tensor]) -> None:
        self.tape, self.b, self.layers, self.model = model.tape, model.tape.b, model.d.layers, model
        self.fsdp, self.grads = fsdp, grads
        self.template = WORKSPACE_TEMPLATE  # :meth:`begin` picks each forward's
        self.span = span(self.layers, self.template)
        self.emitted = 0  # layers emitted so far in the run (tests read it)
        self._reset()

    def _reset(self) -> None:
        self.starts: list[int] = []  # each block's first tensor id, in id order
        self.blocks: list[tuple[int, int, int, int, int]] = []  # (first id, end id, kind, layer, first event)
        self.where: dict[tuple[int, int], tuple[int, int]] = {}  # (kind, layer) -> (first id, end id)
        self._allocations: dict[int, tuple] = {}  # :meth:`_allocation`'s finds
        self.backward_starts: dict[int, tuple[int, int, int]] = {}  # layer -> position its backward began
        self.template_out: Tensor | None = None
        self.template_kept: Tensor | None = None
        self.template_unsharded: dict[str, Tensor] = {}  # ZeRO-2: the template's group kept unsharded
        self.template_forward: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None

    # --- blocks ----------------------------------------------------------------------------------
    def _register(self, kind: int, layer: int, first: int, end: int, event: int) -> None:
        self.starts.append(first)
        self.blocks.append((first, end, kind, layer, event))
        self.where[kind, layer] = (first, end)

    def _origin(self, tensor: int) -> tuple[int, int, int] | None:
        """(kind, layer, offset) of the block that allocated ``tensor``; None outside every block."""
        i = bisect_right(self.starts, tensor) - 1
        if i < 0:
            return None
        first, end, kind, layer, _ = self.blocks[i]
        return (kind, layer, tensor - first) if tensor < end else None

    def _mapped(self, tensor: int, shift: int) -> int:
        """The tensor that stands to the copy (``shift`` layers on) as ``tensor`` to the template."""
        origin = self._origin(tensor)
        if origin is None:
            return tensor
        kind, layer, offset = origin
        target = self.where.get((kind, layer + shift))
        if target is None or offset >= target[1] - target[0]:
            raise NotRepeatable(f"no block {kind}/{layer + shift} for a carried tensor")
        return target[0] + offset

    # --- the forward -----------------------------------------------------------------------------
    def begin(self) -> None:
        """A micro-batch's forward starts: its blocks are its own; its template layer is
        :data:`TEMPLATE`, or :data:`WORKSPACE_TEMPLATE` where its first matmul allocates cuBLAS's
        workspace (``Tape.on_first_mm`` set)."""
        self._reset()
        self.template = TEMPLATE if self.tape.on_first_mm is None else WORKSPACE_TEMPLATE
        self.span = span(self.layers, self.template)

    def layer_built(self, i: int, start: tuple[int, int, int], out: Tensor) -> None:
        """Layer ``i``'s forward was built from ``start`` to now, ``out`` its output."""
        end = self.b.position()
        if end[2] != start[2]:
            raise NotRepeatable("a mark inside a layer")
        self._register(FORWARD, i, start[1], end[1], start[0])
        if i == self.template:
            self.template_forward = (start, end)
            self.template_out, self.template_kept = out, self.fsdp.kept if self.fsdp is not None else None
            self.template_unsharded = dict(self.fsdp.groups[i + 1].unsharded) if self.fsdp is not None else {}
        if i >= self.layers - BUILT_AFTER and out.fn is not None:
            self._watch_backward(i, out.fn)

    def _watch_backward(self, i: int, node: Node) -> None:
        """Record where layer ``i``'s backward begins: as the engine runs its output's node."""
        pre = node.pre

        def begin() -> None:
            self.backward_starts[i] = self.b.position()
            if pre is not None:
                pre()

        node.pre = begin

    def emit_forward(self, x: Tensor) -> Tensor:
        """Layers of the span, each a copy of the template's forward; their output, whose node
        (:meth:`LayerRepeat._apply`) emits their backward."""
        if self.template_forward is None or self.template_out is not x or self.tape.on_first_mm is not None:
            raise NotRepeatable("the template layer was not built as expected")
        start, end = self.template_forward
        events = _prepared(self.b.events[start[0] : end[0]])
        for k in self.span:
            self._emit(events, start[1], end[1], FORWARD, k, k - self.template)
        shift = self.span[-1] - self.template
        out = self.relabel(x, shift)
        node = Node(next(self.tape.seq), f"layers.{self.span[0]}-{self.span[-1]}", self._apply, [x.fn])
        out.fn = node
        self._cache_casts()
        if self.fsdp is not None:
            if self.fsdp.kept is not self.template_kept:
                raise NotRepeatable("FSDP2's kept all-gather output moved")
            self.fsdp.kept = self.relabel(self.template_kept, shift) if self.template_kept is not None else None
            self._keep_unsharded()
        return out

    def _cache_casts(self) -> None:
        """Autocast's cached weight casts of the emitted layers (``Model.weight``), in the order the
        forward makes them: the forward's end lets go of each (under full recompute the last
        reference: nothing saved them)."""
        cache = self.model.cache
        if not cache:
            return
        prefix = f"layers.{self.template}."
        template = [(name, cast) for name, cast in cache.items() if name.startswith(prefix)]
        for k in self.span:
            for name, cast in template:
                cache[retag(name, k - self.template)] = self.relabel(cast, k - self.template)

    def _keep_unsharded(self) -> None:
        """ZeRO-2 (``reshard_after_forward=False``): each emitted layer's group keeps its unsharded
        parameters to its backward, as the template's does (the backward's prefetch skips them)."""
        for k in self.span:
            shift = k - self.template
            group = self.fsdp.groups[k + 1]
            if group.unsharded or group.gathered is not None:
                raise NotRepeatable("an emitted layer's FSDP2 group is not resharded")
            group.unsharded = {retag(n, shift): self.relabel(p, shift) for n, p in self.template_unsharded.items()}

    # --- emission --------------------------------------------------------------------------------
    def _emit(self, events: list[tuple], first: int, end: int, kind: int, layer: int, shift: int):
        """``events`` (a block of ids ``first``..``end``, :func:`_prepared`) again as layer ``layer``'s
        block of ``kind``, ``shift`` layers from the template's."""
        b = self.b
        base, at = b._next, len(b.events)
        offset = base - first
        append, live, pop = b.events.append, b.live, b.live.pop
        for op, tensor, size, category, stream, tag, parts in events:
            if op == ALLOC:
                if parts is not None:
                    tag = f"{parts[0]}{parts[1] + shift}{parts[2]}"
                tensor += offset
                new = (ALLOC, tensor, size, category, stream, tag)
                append(new)
                live[tensor] = new
            elif op == FREE:
                if first <= tensor < end:  # the block's own tensor: freed with the tag it was allocated with
                    tensor += offset
                    name = pop(tensor)[5]
                else:
                    tensor = self._mapped(tensor, shift)
                    held = pop(tensor, None)
                    name = tag if parts is None else f"{parts[0]}{parts[1] + shift}{parts[2]}"
                    if held is None or held[2:] != (size, category, stream, name):
                        raise NotRepeatable(f"a carried tensor does not pair: {tag}")
                append((FREE, tensor, size, category, stream, name))
            else:
                raise NotRepeatable("a mark inside a layer")
        b._next = base + end - first
        self._register(kind, layer, base, base + end - first, at)

    def relabel(self, t: Tensor, shift: int) -> Tensor:
        """The Python tensor that stands to the emitted layers as ``t`` to the built ones: its
        storage renumbered (:meth:`_mapped`), live, and allocated as ``t`` was (renumbered)."""
        tid = self._mapped(t.st.tid, shift)
        if tid == t.st.tid:
            return t
        mine, held = self._allocation(t.st.tid), self.b.live.get(tid)
        if held is None or held[2:5] != mine[2:5] or held[5] != retag(mine[5], shift):
            raise NotRepeatable("a tensor the run keeps does not pair")
        st = Storage(tid, t.st.refs, t.st.managed, t.st.gathered)
        return Tensor(t.numel, t.itemsize, st, None, t.view, t.dtensor, t.transposed, t.heads_major)

    def _allocation(self, tensor: int) -> tuple:
        """The event that allocated ``tensor``, inside a block."""
        found = self._allocations.get(tensor)
        if found is not None:
            return found
        first, end, _, _, event = self.blocks[bisect_right(self.starts, tensor) - 1]
        events = self.b.events
        for i in range(event, len(events)):
            e = events[i]
            if e[1] == tensor and e[0] == ALLOC:
                self._allocations[tensor] = e
                return e
        raise NotRepeatable("no allocation for a kept tensor")

    # --- the backward ----------------------------------------------------------------------------
    def _apply(self, tape: Tape, node: Node, grads: list[Tensor | None], saved: list) -> list[Tensor | None]:
        """The span's node's backward (``Node.apply``)."""
        return self.emit_backward(grads)

    def emit_backward(self, grads: list[Tensor | None]) -> list[Tensor | None]:
        """The span's backward: layer ``L - 2``'s, just built, again for each layer of the span from
        the last; the gradient handed to the layer before the span."""
        last = self.layers - BUILT_AFTER
        if last not in self.backward_starts or last + 1 not in self.backward_starts:
            raise NotRepeatable("the layers after the span did not run their backward")
        start, end = self.backward_starts[last], self.b.position()
        if end[2] != start[2]:
            raise NotRepeatable("a mark inside a layer's backward")
        before = self.backward_starts[last + 1]
        self._register(BACKWARD, last + 1, before[1], start[1], before[0])
        self._register(BACKWARD, last, start[1], end[1], start[0])
        events = _prepared(self.b.events[start[0] : end[0]])
        for k in reversed(self.span):
            self._emit(events, start[1], end[1], BACKWARD, k, k - last)
        self.emitted += len(self.span)
        g = grads[0]
        out = self.relabel(g, self.span[0] - last) if g is not None else None
        if out is g and g is not None:
            self.tape.hold(g)  # the residual stream's gradient, passed through every layer
        self._fix_grads(last)
        if self.fsdp is not None:
            self._fix_fsdp(last)
        return [out]

    def _fix_grads(self, last: int) -> None:
        """A plain run's ``.grad`` tensors of the span's parameters, in the order the engine makes them."""
        prefix = f"layers.{last}."
        template = [(name, g) for name, g in self.grads.items() if name.startswith(prefix)]
        for k in reversed(self.span):
            for name, g in template:
                mine = retag(name, k - last)
                if mine not in self.grads:
                    self.grads[mine] = self.relabel(g, k - last)

    def _fix_fsdp(self, last: int) -> None:
        """FSDP2's state after the span's backward: each group reduced (its sharded gradient kept),
        the last reduce-scatter input, and the all-gather the last one prefetched (``fsdp.py``)."""
        fsdp, first = self.fsdp, self.span[0]
        groups = fsdp.groups
        shift = first - last
        if fsdp.reduce_input is not None:
            fsdp.reduce_input = self.relabel(fsdp.reduce_input, shift)
        prefetched = groups[last].gathered  # group of layer last - 1, prefetched by the template (ZeRO-3)
        if groups[first].gathered is not None or (prefetched is None) != bool(groups[last].unsharded):
            raise NotRepeatable("FSDP2's prefetch does not pair")
        if prefetched is not None:
            groups[first].gathered = self.relabel(prefetched, shift)
        template_grad = groups[last + 1].sharded_grad
        for k in self.span:
            group = groups[k + 1]
            if group.gathered is not None and k + 1 != last:
                raise NotRepeatable("an emitted layer's FSDP2 group is not resharded")
            group.gathered, group.unsharded = None, {}  # resharded by its post-backward
            if group.sharded_grad is None and template_grad is not None:
                group.sharded_grad = self.relabel(template_grad, k - last)
            fsdp.reduced.add(k + 1)
