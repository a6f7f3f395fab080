"""A byte-level autograd: tensors as reference-counted allocations, ops as graph nodes.

The bundled trainer's memory over a step is decided by PyTorch's reference counting: a tensor
is freed when its last reference goes, and autograd's references are the saved tensors of
the graph's nodes and the gradients in flight. This module replays those rules on sizes only,
so that the trainer's forward written as ops (``trainer_model.py``) yields the allocation and
free order the CUDA caching allocator sees (tests/data/gpu-traces):

- a :class:`Tensor` is freed at its last reference (Python's, a node's saved slot, a gradient
  buffer, a checkpoint's storage); views hold their base (a gradient view is not reused);
- the backward runs nodes in decreasing sequence number among ready ones (the autograd
  engine's ready queue, ``torch/csrc/autograd/engine.cpp``); ``AccumulateGrad`` runs first;
- a node's apply allocates its gradients, reductions to broadcast inputs follow
  (``validate_outputs``), then the incoming gradients and saved tensors are released;
- a second gradient into one input buffer is added in place when the held one is a plain
  tensor (not a view, not a DTensor) with no other reference, else out of place: for dense
  gradients ``InputBuffer::accumulate`` never adds into the new one (a tied weight's head dW,
  a transposed view, and its embedding gradient: traces h200_a_master1b, h200_a_fp32full); a
  DTensor sum whose new part is Replicate over a sharded one's rows (a tied head under TP: the
  vocabulary-parallel embedding's gradient) first clones this rank's chunk of it;
- non-reentrant checkpointing (``torch.utils.checkpoint``) keeps no saved tensors in the
  forward; the first unpack in the backward re-runs the region's forward, stopping right
  after its last saved tensor is packed; an unpacked tensor goes at the end of its node's apply;
- under saved-tensor hooks (``act_offload.py``: ``save_on_cpu``) a save keeps a host copy, not
  the tensor; the node's apply unpacks a device copy of each first and frees it as it returns, and
  a checkpoint packs its inputs too, its re-run running on their copies;
- under ``torch.no_grad()`` (:meth:`Tape.no_grad`: the reentrant checkpoint's forward, ``reentrant.py``) no
  node is made: nothing is saved, every output is a tensor without a ``grad_fn``;
- under a selective-checkpoint policy (``create_selective_checkpoint_contexts``) the forward
  also keeps the outputs of the ops the policy saves (:meth:`Tape.keep`), and the re-run hands
  them back instead of computing them (:meth:`Tape.cached`); what the re-run never reached
  goes with the region (``recompute.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import count

from memplan.costmodel.timeline.act_offload import Packed, SaveOnCpu
from memplan.costmodel.timeline.events import Builder, Category, Stream

FIRST = 1 << 62  # AccumulateGrad's sequence number: it runs as soon as it is ready
_ACTIVATIONS, _GRADIENTS = Category.ACTIVATIONS, Category.GRADIENTS  # read once: a member on its class is a slow lookup
MiB = 2**20
REDUCE_WORKSPACE_CAP = 132 * MiB  # largest staging buffer of a (b, s, h) -> (h,) sum in the traces


# Storage, Tensor, Node and Region are written out rather than made by ``@dataclass(slots=True)``:
# each generated class costs ~1.7 M instructions to make at import (its methods' source compiled,
# the class built again for its slots; callgrind), a third of the module's import, paid by every
# cold ``memplan estimate``. Compared by identity, as ``eq=False`` made them.


class Storage:
    """One allocation. ``refs`` counts its holders; a ``managed`` one (parameters, FSDP's
    unsharded parameters) is freed by its owner, never by reference counting. ``gathered``:
    FSDP2's unsharded parameter: no Parameter's storage to saved-tensor hooks (hf_offload)."""

    __slots__ = ("tid", "refs", "managed", "gathered")

    def __init__(self, tid: int, refs: int = 1, managed: bool = False, gathered: bool = False) -> None:
        self.tid = tid
        self.refs = refs
        self.managed = managed
        self.gathered = gathered


class Tensor:
    """A tensor over a :class:`Storage` (views share their base's)."""

    __slots__ = ("numel", "itemsize", "st", "fn", "view", "dtensor", "transposed", "heads_major", "offset")

    def __init__(
        self,
        numel: int,
        itemsize: int,
        st: Storage,
        fn: Node | None = None,  # the node that receives this tensor's gradient
        view: bool = False,  # shares its base's storage (which then has two users)
        dtensor: bool = False,  # a DTensor: never added into in place
        transposed: bool = False,  # not contiguous: a transpose's view, or heads-major over token-major memory
        heads_major: bool = False,  # flash's dv off an unpacked (contiguous) v: its view back is a copy
        offset: int = 0,  # elements into the storage (a split's later parts): TRL's key (hf_offload.TrlOffload)
    ) -> None:
        self.numel = numel
        self.itemsize = itemsize
        self.st = st
        self.fn = fn
        self.view = view
        self.dtensor = dtensor
        self.transposed = transposed
        self.heads_major = heads_major
        self.offset = offset


class Node:
    """One backward function: ``apply(tape, node, grads, saved) -> input grads`` (one per
    ``nexts`` entry; None where no gradient flows)."""

    __slots__ = ("seq", "scope", "apply", "nexts", "saved", "region", "pre", "post", "meta", "dtensor", "kept")

    def __init__(
        self,
        seq: int,
        scope: str,
        apply: Callable,
        nexts: list[Node | None],
        saved: list | None = None,  # Tensors, or checkpoint slots (ints)
        region: Region | None = None,
        pre: Callable | None = None,  # a hook run before apply (FSDP2's pre-backward)
        post: Callable | None = None,  # a hook run after it (``node.register_hook``: hf_offload.py's release)
        meta: list | None = None,  # per input (numel, itemsize, over_rows): the gradient it must have
        dtensor: bool = False,  # a DTensor op: its gradients are never added into in place
    ) -> None:
        self.seq = seq
        self.scope = scope
        self.apply = apply
        self.nexts = nexts
        self.saved = [] if saved is None else saved
        self.region = region
        self.pre = pre
        self.post = post
        self.meta = meta
        self.dtensor = dtensor
        # TRL's ids of the saves its hooks kept on the device: in its tracker, and a deduplicated one's key in its
        # dedup map, until this node runs (hf_offload.py)
        self.kept: tuple[int, ...] = ()


class Region:
    """A non-reentrant checkpoint: ``rerun(*inputs)`` replays the region's forward for recompute
    (on its inputs, or on their device copies where they were packed: ``frame.get_inputs()``).
    ``policy(op, recompute) -> saved``: a selective checkpoint's; ``kept``: its storage, per op."""

    __slots__ = ("rerun", "inputs", "slots", "storage", "unpacked", "done", "policy", "kept")

    def __init__(
        self,
        rerun: Callable[..., None],
        inputs: list[Tensor | Packed],
        slots: int = 0,
        storage: dict[int, Tensor] | None = None,
        unpacked: int = 0,
        done: bool = False,
        policy: Callable[[str, bool], bool] | None = None,
        kept: dict[str, list[list[Tensor]]] | None = None,
    ) -> None:
        self.rerun = rerun
        self.inputs = inputs
        self.slots = slots
        self.unpacked = unpacked
        self.done = done
        self.storage = {} if storage is None else storage
        self.policy = policy
        self.kept = {} if kept is None else kept


class _StopRecompute(Exception):
    """Raised at the last saved tensor of a recompute (``_StopRecomputationError``)."""


class Tape:
    """Allocations through a :class:`Builder`, the graph, and the backward engine."""

    def __init__(self, builder: Builder) -> None:
        self.b = builder
        self.seq = count()
        self.scope = ""
        self.region: Region | None = None  # forward inside a checkpoint: nothing is saved
        self._recompute: Region | None = None
        self._slot = 0
        self._pyrefs: list[Tensor] = []  # Python references taken during a recompute
        self._apply_saved: list[Tensor] | None = None
        self.on_first_mm: Callable[[], None] | None = None  # cuBLAS's lazily allocated workspace
        self.dtensor = False  # ops recorded now run on DTensors (sequence-parallel norms)
        self.reduce_workspace = True  # CUDA's sum-to-weight staging buffer (False on CPU)
        # InputBuffer adds a second gradient into the held one in place when it may (False: a
        # measurement that holds every storage's Python object makes each sum out of place)
        self.inplace_accumulate = True
        # a TorchDispatchMode is on (a CPU measurement's): ``isTensorSubclassLike`` is then true of every
        # tensor, and the backward formulas with a subclass branch (``index_backward``,
        # ``value_selecting_reduction_backward``) write out of place into a second buffer (hf_moe_ops.py)
        self.subclass_like = False
        self.hooks: SaveOnCpu | None = None  # the forward's saved-tensor hooks (act_offload.py, hf_offload.py)
        self._node: Node | None = None  # the node the backward runs (``torch._C._current_autograd_node``)
        self.packed = False  # a node has saved a Packed host copy (only then does a node's apply look for them)
        self.grad_enabled = True  # False under ``torch.no_grad()``: no node, nothing saved (:meth:`no_grad`)
        # the running backward's graph task (``torch._C._current_graph_task_id``; 0 outside one), how many are
        # running (a reentrant checkpoint's backward nests one: reentrant.py), and the callbacks queued on it
        # (``Variable._execution_engine.queue_callback``), run as it ends
        self.graph = self.depth = 0
        self._graphs = count(1)
        self.callbacks: list[Callable[[], None]] = []

    @contextmanager
    def scoped(self, scope: str) -> Iterator[None]:
        """Tags of what is allocated inside start with ``scope`` (a module's path)."""
        outer, self.scope = self.scope, scope
        try:
            yield
        finally:
            self.scope = outer

    @contextmanager
    def dtensor_ops(self, on: bool = True) -> Iterator[None]:
        """Ops recorded inside run on DTensors: their gradients are never added into in place."""
        outer, self.dtensor = self.dtensor, on
        try:
            yield
        finally:
            self.dtensor = outer

    @contextmanager
    def no_grad(self) -> Iterator[None]:
        """``torch.no_grad()``: ops record no node (``GradMode::is_enabled()`` false), so save nothing."""
        outer, self.grad_enabled = self.grad_enabled, False
        try:
            yield
        finally:
            self.grad_enabled = outer

    # --- storage -------------------------------------------------------------------------------
    def new(self, numel: int, itemsize: int, tag: str, category: Category | None = None, stream=Stream.COMPUTE):
        """A fresh tensor held by the caller (Python's reference)."""
        scope = self.scope
        if scope:
            tag = f"{scope}.{tag}"
        t = Tensor(numel, itemsize, Storage(self.b.alloc(numel * itemsize, category or _ACTIVATIONS, tag, stream)))
        if self._recompute is not None:
            self._pyrefs.append(t)
        return t

    def temporaries(self, requests: list[tuple[int, str]], category: Category) -> list[int]:
        """Compute-stream tensors of (bytes, tag) made in order, held by the caller as their
        allocations' ids alone (:meth:`release`): a foreach op's outputs, which nothing saves or views
        (the optimizer step's), without a :class:`Tensor` each (a few hundred a step)."""
        assert self._recompute is None, "a recompute tracks its tensors' Python references"
        alloc, prefix = self.b.alloc, f"{self.scope}." if self.scope else ""
        return [alloc(size, category, prefix + tag) for size, tag in requests]

    def release(self, ids: list[int]) -> None:
        """The :meth:`temporaries` ``ids`` go, last first (CPython's list deallocation)."""
        free = self.b.free
        for tid in reversed(ids):
            free(tid)

    def managed(self, numel: int, itemsize: int, tag: str, category: Category, stream=Stream.COMPUTE) -> Tensor:
        """A tensor its owner frees (:meth:`free`): parameters, gradients, FSDP buffers."""
        t = self.new(numel, itemsize, tag, category, stream)
        t.st.managed = True
        return t

    def view(self, t: Tensor, numel: int | None = None) -> Tensor:
        """A view of ``t``: a new handle on its storage (held by the caller)."""
        v = Tensor(t.numel if numel is None else numel, t.itemsize, t.st, view=True, dtensor=t.dtensor)
        v.transposed, v.offset = t.transposed, t.offset
        v.st.refs += 1
        if self._recompute is not None:
            self._pyrefs.append(v)
        return v

    def hold(self, t: Tensor) -> Tensor:
        t.st.refs += 1
        return t

    def drop(self, t: Tensor | None) -> None:
        if t is None:
            return
        st = t.st
        if st.managed:
            return
        st.refs -= 1
        if st.refs == 0:
            self.b.free(st.tid)

    def done(self, *tensors: Tensor | None) -> None:
        """Python lets go of these tensors (a local rebound, a temporary consumed)."""
        for t in tensors:
            if t is None:
                continue
            if self._recompute is not None and t in self._pyrefs:
                self._pyrefs.remove(t)
            self.drop(t)

    def alias(self, t: Tensor) -> Tensor:
        """Another Python reference to ``t`` (``x.float()`` of an fp32 tensor returns it)."""
        if self._recompute is not None:
            self._pyrefs.append(t)
        return self.hold(t)

    @property
    def recomputing(self) -> bool:
        """Inside a checkpoint's re-run: what its graph holds goes with it."""
        return self._recompute is not None

    def free(self, t: Tensor) -> None:
        """An owner frees a managed tensor (FSDP2's ``resize_(0)``, ``tie_weights``)."""
        self.b.free(t.st.tid)

    # --- graph ---------------------------------------------------------------------------------
    def node(self, name: str, apply: Callable, inputs, saved=(), meta: list | None = None) -> Node | None:
        """A node over ``inputs`` (tensors or None); None when no input needs a gradient.
        ``meta``: per input (numel, itemsize, over_rows) the engine reduces and casts the
        gradient to (``over_rows``: a sum over the leading dims, to a weight vector)."""
        if not self.grad_enabled:
            return None
        nexts = [t.fn if t is not None else None for t in inputs]
        if not any(nexts):
            return None
        n = Node(next(self.seq), f"{self.scope}.{name}" if self.scope else name, apply, nexts, meta=meta)
        n.dtensor = self.dtensor
        for t in saved:
            self.save(n, t)
        return n

    def save(self, node: Node, t: Tensor) -> None:
        """A saved tensor: held by the node, or a checkpoint slot (recomputed later)."""
        if self._recompute is not None:
            region = self._recompute
            region.storage[self._slot] = self.hold(t)
            self._slot += 1
            if self._slot == region.slots:
                raise _StopRecompute
        elif self.region is not None:
            node.saved.append(self.region.slots)
            node.region = self.region
            self.region.slots += 1
        elif self.hooks is not None:
            packed = self.hooks.pack(self, t)
            node.saved.append(packed)
            self.packed = True
            if packed is t:  # kept on the device by TRL's hooks: in their tracker until the node runs
                node.kept += (self.hooks.kept_id,)
        else:
            node.saved.append(t if t.st.managed else self.hold(t))

    def dead_save(self) -> bool:
        """A save inside a checkpoint that nothing unpacks (a graph that never reaches the loss: hf_dora.DeadSaves;
        ``torch/utils/checkpoint.py``): in a non-reentrant checkpoint's forward ``_checkpoint_hook.pack_hook`` gives
        it a holder, a slot of the frame that nothing unpacks (counted as unpacked at once); in the re-run
        ``_recomputation_hook.pack_hook`` finds that holder dead and stores nothing, the slot still counted, so the
        re-run stops after the region's last save (``_StopRecomputationError``). False outside a checkpoint (the
        caller holds the tensor)."""
        region = self._recompute
        if region is not None:
            self._slot += 1
            if self._slot == region.slots:
                raise _StopRecompute
            return True
        if self.region is not None:
            self.region.slots += 1
            self.region.unpacked += 1
            return True
        return False

    def checkpoint(
        self,
        forward: Callable[[], object],
        inputs: list[Tensor],
        rerun: Callable | None = None,
        policy=None,
        packed: int | None = None,
    ) -> object:
        """Run ``forward`` as a non-reentrant checkpoint over ``inputs`` (held until the
        region's last saved tensor is unpacked); ``rerun`` (default ``forward``) replays it;
        ``policy(op, recompute)``: a selective checkpoint's (True: the op's outputs are kept).
        Under saved-tensor hooks the inputs are packed (``_CheckpointFrame.save_inputs``): the
        first ``packed`` of them (None: all), the positional arguments ``_NoopSaveInputs`` saves;
        the rest, bound in the checkpointed function (transformers' ``partial(forward, **kwargs)``),
        are held on the device."""
        hooks = self.hooks
        n = len(inputs) if packed is None else packed
        held = [hooks.pack(self, t) if hooks is not None and i < n else self.hold(t) for i, t in enumerate(inputs)]
        region = Region(rerun=rerun or (lambda *_: forward()), inputs=held, policy=policy)
        outer, self.region = self.region, region
        try:
            return forward()
        finally:
            self.region = outer

    def keep(self, op: str, outs: list[Tensor]) -> None:
        """In a selective checkpoint's forward: the storage keeps the outputs of an op its
        policy saves (``_CachingTorchDispatchMode``: detached aliases, appended per op)."""
        region = self.region
        if region is not None and region.policy is not None and region.policy(op, False):
            region.kept.setdefault(op, []).append([self._alias_of(t) for t in outs])

    def cached(self, op: str) -> list[Tensor] | None:
        """In a selective checkpoint's re-run: the kept outputs of an op its policy saved, taken
        out of the storage (``_CachedTorchDispatchMode``, ``pop(0)``); None: compute it."""
        region = self._recompute
        if region is None or region.policy is None or not region.policy(op, True):
            return None
        outs = region.kept[op].pop(0)
        self._pyrefs.extend(outs)
        return outs

    def _alias_of(self, t: Tensor) -> Tensor:
        t.st.refs += 1
        return Tensor(t.numel, t.itemsize, t.st, transposed=t.transposed)

    def _rerun(self, region: Region) -> None:
        """The re-run on ``frame.get_inputs()``: the inputs, or device copies of packed ones
        (the unpack hook's locals: they go after the re-run's frames)."""
        node = self._node
        copies = [t.hooks.unpack(self, t, "checkpoint_input", node) for t in region.inputs if isinstance(t, Packed)]
        it = iter(copies)
        args = [next(it) if isinstance(t, Packed) else t for t in region.inputs]
        self._recompute = region
        self._slot = 0
        self._pyrefs = []
        try:
            region.rerun(*args)
        except _StopRecompute:
            pass
        finally:
            self._recompute = None
            for t in reversed(self._pyrefs):  # the unwound frames' locals, innermost first
                self.drop(t)
            self._pyrefs = []
        for t in copies:
            self.drop(t)
        region.done = True

    def end_apply(self) -> None:
        """Unpacked checkpoint tensors go when the node's apply returns."""
        if self._apply_saved is not None:
            for t in self._apply_saved:
                self.drop(t)
            self._apply_saved = None

    # --- backward ------------------------------------------------------------------------------
    def backward(self, root: Tensor, seed: Tensor) -> None:
        """``root.backward(seed)``: run every node reachable from ``root.fn``, a graph task of its own."""
        outer = self.graph, self.callbacks
        self.graph, self.callbacks = next(self._graphs), []
        self.depth += 1
        self._execute(root, seed)
        for callback in self.callbacks:  # the graph task's final callbacks
            callback()
        self.graph, self.callbacks = outer
        self.depth -= 1

    def _execute(self, root: Tensor, seed: Tensor) -> None:
        deps: dict[Node, int] = {}  # the graph is a DAG from root: a node is new at its first edge
        stack = [root.fn]
        while stack:
            for m in stack.pop().nexts:
                if m is None:
                    continue
                if m in deps:
                    deps[m] += 1
                else:
                    deps[m] = 1
                    stack.append(m)
        # each node's input buffer: its first gradient, the later ones added in (_accumulate)
        buffers: dict[Node, list[Tensor | None]] = {root.fn: [seed]}
        ready = [(-root.fn.seq, 0, root.fn)]
        tick = count(1)
        pop, push, run, accumulate, drop = heapq.heappop, heapq.heappush, self._run, self._accumulate, self.drop
        while ready:
            node = pop(ready)[2]
            outs = run(node, buffers.pop(node, [None]))
            for m, g in zip(node.nexts, outs, strict=True):
                if m is None:
                    drop(g)
                    continue
                if g is not None:
                    held = buffers.get(m)
                    if held is None:
                        buffers[m] = [g]
                    else:
                        accumulate(held, g)
                left = deps[m] - 1
                deps[m] = left
                if left == 0:
                    push(ready, (-m.seq, next(tick), m))

    def _run(self, node: Node, grads: list[Tensor | None]) -> list[Tensor | None]:
        self.scope = node.scope
        self._node = node
        if node.pre is not None:
            node.pre()
        if node.kept:  # the apply unpacks them (TRL's tracker)
            self.hooks.unpacked(self, node.kept)
        saved = held = node.saved  # held: the node's own references, dropped after its apply
        if node.region is not None:
            if not node.region.done:
                self._rerun(node.region)
                self.scope = node.scope
            saved = [node.region.storage.pop(k) for k in node.saved]
            self._apply_saved = saved
        elif self.packed and any(isinstance(t, Packed) for t in saved):
            held = [t for t in saved if isinstance(t, Tensor)]
            saved = self._unpack(saved)
        if grads.count(None) == len(grads):  # no gradient flows in
            outs = [None] * len(node.nexts)
        else:
            outs = node.apply(self, node, grads, saved)
        if self._apply_saved is not None:  # end_apply, tested here first: most nodes unpack nothing
            self.end_apply()
        if node.meta is not None:
            outs = [self._validate(g, m) for g, m in zip(outs, node.meta, strict=True)]
        if node.dtensor:
            for g in outs:
                if g is not None:
                    g.dtensor = True
        if node.post is not None:  # post hooks: after validate_outputs, the incoming gradients alive
            post, node.post = node.post, None
            post()
        drop = self.drop
        for g in grads:
            drop(g)
        if node.region is None:
            for t in held:
                drop(t)
        else:
            region = node.region
            region.unpacked += len(node.saved)
            if region.unpacked == region.slots:  # the frame goes: its storage, then its inputs
                for per_op in region.kept.values():
                    for t in (t for kept in per_op for t in kept):
                        self.drop(t)
                region.kept = {}
                for t in region.inputs:
                    if isinstance(t, Packed):
                        t.hooks.release(t)
                    else:
                        self.drop(t)
                region.inputs = []
        node.saved = []
        return outs

    def _unpack(self, saved: list) -> list[Tensor]:
        """The apply's unpacked saves: device copies of the packed ones (their host copies go
        with the node), freed as the apply returns; held ones stay the node's to drop."""
        out, copies = [], []
        for t in saved:
            if isinstance(t, Packed):
                t.hooks.release(t)
                copies.append(t.hooks.unpack(self, t, "unpacked", self._node))
                out.append(copies[-1])
            else:
                out.append(t)
        self._apply_saved = copies
        return out

    def _validate(self, g: Tensor | None, meta: tuple[int, int, bool] | None) -> Tensor | None:
        """``validate_outputs``: sum a broadcast gradient down to its input, cast its dtype.
        A sum over the leading dims to a weight vector stages partial sums in a global
        buffer: numel x 8 B up to :data:`REDUCE_WORKSPACE_CAP` (traces)."""
        if g is None or meta is None:
            return g
        numel, itemsize, over_rows = meta
        if g.numel > numel:
            out = self.new(numel, g.itemsize, "weight.grad" if over_rows else "grad_sum_to", self._gcat(over_rows))
            if over_rows and self.reduce_workspace:
                ws = self.new(min(g.numel * 8, REDUCE_WORKSPACE_CAP), 1, "reduce_workspace")
                sem = self.new(max(numel // 32, 64), 1, "reduce_semaphores")
                self.drop(sem)
                self.drop(ws)
            self.drop(g)
            g = out
        if g.itemsize != itemsize:
            out = self.new(g.numel, itemsize, "grad_cast")
            self.drop(g)
            g = out
        return g

    def _sum_category(self, *parts: Tensor) -> Category:
        """A sum of gradients is a parameter's gradient when one of its parts is (a tied weight's:
        the embedding's gradient added to the LM head's becomes ``.grad``)."""
        live = self.b.live
        grads = any((e := live.get(p.st.tid)) is not None and e[3] == Category.GRADIENTS for p in parts)
        return Category.GRADIENTS if grads else _ACTIVATIONS

    @staticmethod
    def _gcat(leaf: bool) -> Category:
        return _GRADIENTS if leaf else _ACTIVATIONS

    def _accumulate(self, buffer: list[Tensor | None], g: Tensor) -> None:
        old = buffer[0]
        if old is None:
            buffer[0] = g
        elif self.inplace_accumulate and _reusable(old):
            self.drop(g)  # old.add_(g)
        else:
            # a Replicate gradient of every row into a row shard's (a tied head under TP): the DTensor
            # add redistributes it first, a clone of this rank's chunk (``Shard._replicate_to_shard``)
            chunk = self.new(old.numel, g.itemsize, "grad_replicate_to_shard") if g.numel > old.numel else None
            out = self.new(old.numel, old.itemsize, "grad_sum", self._sum_category(old, g))
            out.dtensor = old.dtensor or g.dtensor
            if chunk is not None:
                self.drop(chunk)  # the dispatch's local argument, gone as the op returns
            self.drop(old)
            self.drop(g)
            buffer[0] = out


def _reusable(t: Tensor) -> bool:
    """``can_accumulate_inplace``: dense, not a subclass, the last reference to its storage."""
    return not t.view and not t.dtensor and t.st.refs == 1
