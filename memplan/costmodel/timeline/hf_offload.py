"""Activation offload under transformers' Trainer (``--runtime hf``): TRL's ``OffloadActivations``, op by op.

``SFTConfig(activation_offloading=True)`` (and axolotl's ``activation_offloading: true``) runs
``Trainer.training_step`` under TRL's saved-tensor hooks (trl 1.16.0, ``trl/models/activation_offloading.py``,
itself torchtune's; the head's no-op hooks from ``get_act_offloading_ctx_manager``; the wrapping in
``trl/trainer/sft_trainer.py``'s ``training_step``), as TRL itself runs them on CPU (tests/accuracy/trl_offload.py).
What differs from ``save_on_cpu`` (``act_offload.py``):

- kept on the device, the tensor itself held: a save under ``min_offload_size`` (1024 bytes), a parameter
  or a view of one (``w.t()``; not of FSDP2's unsharded parameters, gathered into storages the model did not
  have when the hooks were built: ``autograd.Storage.gathered``), anything the LM head saves (a no-op hook
  pair around ``lm_head``, which replaces TRL's pack: no tensor id taken, :attr:`TrlOffload.paused`), and a
  storage whose key TRL's dedup map holds (data pointer plus the view's offset, and dtype,
  ``_get_unique_tensor_key``: the second save of RMSNorm's input, ``nll_loss``'s of the log-probabilities; the
  two halves of a ``chunk(2)`` are two keys, ``autograd.Tensor.offset``): an offloaded save's key only while its
  original is in the forward stash (``release_storage_key``), a kept save's that matched it until its unpack, so
  the rotary tables every layer saves are offloaded again once the first copy's original left the stash;
- a broadcast save (an ``expand``: ``repeat_kv`` of one KV head) is copied as its storage alone, and brought back
  as that under an ``as_strided`` view (``has_broadcast``: :func:`_stored`);
- an offloaded save that is not contiguous, or a view at an offset (a transposed weight ``mm`` or ``grouped_mm``
  saves that is no parameter: PEFT's parametrized expert or router weight; the halves of a ``chunk(2)``), is first
  cloned contiguous (``pack_tensor``'s ``clone(memory_format=torch.contiguous_format)`` / ``contiguous()``, before
  the stash is trimmed): the clone is copied out and stashed, the original not held, its key still the original's
  (a later tensor at the original's freed address would take it: the allocator's, not followed; tests/accuracy/
  offload_steps.py's ``ALLOCATOR_DEPENDENT``);
- a save of a node that dies in the forward (DeepSeek-V3's router, ``register_parametrization``'s check of PEFT's
  expert factors) is packed and never unpacked: its host copy stays until the next step's ``__enter__`` clears
  TRL's tracker (:func:`orphaned`, :meth:`TrlOffload.end_of_step`);
- an offloaded save's original stays alive in the forward stash while it is among the last
  ``max_fwd_stash_size`` (5) saves; an unpack of a stashed one hands back the original, no copy;
- an unpacked copy is held (``bwd_tensor_stash``) until the next node that unpacks an offloaded save
  has run (a hook registered on that node: ``Node.post``), which also empties the forward stash; the
  host copy goes at the unpack; a copy something besides the stash holds once its own node has run (a
  checkpoint's re-run saved it again: TRL's storage use count grew, its ``record_stream`` branch) leaves the
  stash then (:meth:`TrlOffload._shared`);
- the last node that unpacked an offloaded save stays alive after the backward (TRL's ``curr_autograd_node``,
  never reset), with every node it reaches, until the next backward's first such node: what they hold beyond
  their saves (an int8 linear's ``ctx.A``, the leaf input and its ``.grad``) stays with them
  (:meth:`TrlOffload.reached`, :meth:`TrlOffload.hold_graph`);
- at the end of the backward everything goes (TRL's end-of-backward callback:
  :meth:`TrlOffload.end_of_step`);
- under torch's reentrant checkpoint (``reentrant.py``) the hooks are on through the backward, so each re-run's
  saves are packed there, and its nested backward is a graph task of its own: only nodes of the graph task that
  unpacked first release copies (``graph_id == curr_graph_id``), the nested one's stay until the next outer node
  that unpacks has run; the tracker (every pack until its unpack; a kept save until its node runs, ``Node.kept``)
  emptied, the next pack starts a forward (the dedup map reset) and the next unpack takes its graph task (a nested
  one's end frees every copy held: ``Tape.callbacks``).

Checked on CPU against TRL's own ``OffloadActivations`` through ``transformers.Trainer`` (tests/accuracy/
test_offload_accuracy.py; over DDP, FSDP2 and 4-bit / LLM.int8 bases tests/unit/
test_timeline_hf_offload_ranks.py; over MoE and MLA models test_timeline_hf_offload_moe.py; under the reentrant
checkpoint test_timeline_hf_reentrant_offload.py). On CUDA TRL's
copies keep the tensor's strides (``empty_like`` into pinned memory, ``to(device)`` back) and its streams order
them: not followed, the plan stays on the phase model (``hf_support``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from memplan.costmodel.timeline.act_offload import Packed, unpack

if TYPE_CHECKING:
    from memplan.costmodel.timeline.autograd import Node, Tape, Tensor

MIN_OFFLOAD_BYTES = 1024  # min_offload_size
FWD_STASH = 5  # max_fwd_stash_size
CLONE = "trl_contiguous_clone"  # pack_tensor's ``activation.clone(memory_format=torch.contiguous_format)``


class TrlPacked(Packed):
    """An offloaded save and the order of its pack (TRL's ``tensor_id``); ``numel``: the elements its host copy
    holds, and ``shown`` the save's own (more for a broadcast save, whose storage alone is copied). Written out as
    its base is."""

    __slots__ = ("ident", "shown")

    def __init__(
        self, numel: int, itemsize: int, hooks: TrlOffload, fn: Node | None = None, ident: int = 0, shown: int = 0
    ) -> None:
        Packed.__init__(self, numel, itemsize, hooks, fn)  # type: ignore[arg-type]
        self.ident = ident
        self.shown = shown or numel


class TrlOffload:
    """TRL's hooks over one ``training_step``; ``host_bytes`` / ``host_peak``: the host copies alive."""

    def __init__(self) -> None:
        self.host_bytes = self.host_peak = 0
        self.paused = 0  # > 0 inside the LM head
        self.next_id = 0
        # TRL's dedup map (``storage_to_tensor_id``): (storage, offset, itemsize) -> the pack that tracks it, an
        # offloaded save while its original is in the forward stash, or a kept save that matched it
        self.seen: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.stash: dict[int, Tensor] = {}  # id -> the original, held
        self.back: dict[int, Tensor] = {}  # id -> the copy brought back, held
        self.brought: dict[Node, list[int]] = {}  # node -> the ids it brought back (its hook checks their holders)
        self.node: Node | None = None  # ``curr_autograd_node``: held from one backward to the next
        self.graph_kept: list[Tensor] = []  # what the graph holds beyond saves, reached from ``node`` (hold_graph)
        # TRL's tracker (saves packed, kept or offloaded, not yet unpacked) and phase flags: a pack after the
        # tracker emptied starts a forward (``is_first_forward_call``: the dedup map reset), and the next unpack
        # records its graph task (``is_first_backward_call``: ``curr_graph_id``), whose nodes alone release
        self.pending = 0
        self.kept_id = 0  # the id of the save :meth:`pack` last kept on the device (0: the head's, none taken)
        self.first_forward = self.first_backward = True
        self.graph = 0
        # kept saves never unpacked (a graph that dies in the forward: hf_dora.DeadSaves), the tensors themselves in
        # TRL's tracker until the next step's ``__enter__`` clears it (:meth:`begin_step`)
        self.orphans: list[Tensor] = []

    def _track(self, key: tuple, ident: int) -> None:
        self.seen[key] = ident
        self.key_of[ident] = key

    def _untrack(self, ident: int) -> None:
        """``release_storage_key``: the key goes unless a later pack has taken it."""
        key = self.key_of.pop(ident, None)
        if key is not None and self.seen.get(key) == ident:
            del self.seen[key]

    def pack(self, tape: Tape, t: Tensor) -> Tensor | Packed:
        """Keep ``t`` on the device (held), or copy it to the host and stash the original."""
        if self.first_forward:
            self.first_forward, self.first_backward = False, True
            self.seen, self.key_of = {}, {}
        self.pending += 1
        self.kept_id = 0
        if self.paused:  # the head's no-op hooks stand in for TRL's: no id, no key
            return t if t.st.managed else tape.hold(t)
        self.next_id += 1
        ident = self.kept_id = self.next_id
        key = (t.st, t.offset, t.itemsize)
        if key in self.seen:  # checked first: the key moves to this kept save, until its unpack (the backward)
            self._track(key, ident)
            return t if t.st.managed else tape.hold(t)
        if (t.st.managed and not t.st.gathered) or t.numel * t.itemsize < MIN_OFFLOAD_BYTES:
            return t if t.st.managed else tape.hold(t)
        stored = _stored(tape, t)
        self.host_bytes += stored * t.itemsize
        # a non-contiguous save, or a view at an offset, that is no broadcast is first cloned contiguous (before
        # the stash is trimmed): the clone is copied out and stashed, the original not held (its key is still the
        # original's)
        clone = stored == t.numel and (t.transposed or t.offset)
        stashed = tape.new(t.numel, t.itemsize, CLONE) if clone else tape.hold(t)
        stashed.fn = t.fn
        self.host_peak = max(self.host_peak, self.host_bytes)
        for old in [k for k in self.stash if k <= ident - FWD_STASH]:
            tape.drop(self.stash.pop(old))
            self._untrack(old)
        self.stash[ident] = stashed
        self._track(key, ident)
        return TrlPacked(stored, t.itemsize, self, t.fn, ident=ident, shown=t.numel)

    def unpack(self, tape: Tape, packed: TrlPacked, tag: str = "unpacked", node: Node | None = None) -> Tensor:
        """The original from the stash, or a new device copy held until the next such node of the graph task that
        unpacked first has run (in a reentrant checkpoint's nested one, until the outer node after it has run);
        each such node empties the forward stash as it ends."""
        self.release(packed)
        self.unpacked(tape, (packed.ident,))
        if node is not None:
            if tape.graph == self.graph and node is not self.node:
                self.node = node  # the previous one goes, and what only it held: the last step's graph_kept
                for t in reversed(self.graph_kept):
                    tape.drop(t)
                self.graph_kept = []
                node.post = self._release(tape, node, list(self.back))
            elif node.post is None:
                node.post = self._release(tape, node, [])
        original = self.stash.pop(packed.ident, None)
        if original is not None:
            return original  # the stash's reference, now the caller's
        out = unpack(tape, packed, tag)
        self.back[packed.ident] = tape.hold(out)
        if node is not None:
            self.brought.setdefault(node, []).append(packed.ident)
        if packed.shown != packed.numel:  # ``as_strided`` back to the broadcast shape: a view of the copy
            view = tape.view(out, packed.shown)
            view.fn = out.fn
            tape.drop(out)
            return view
        return out

    def unpacked(self, tape: Tape, idents: tuple[int, ...]) -> None:
        """The saves ``idents`` unpacked (TRL's phase flags): the first after a forward records the graph task and
        queues the end-of-backward callback on it (the outer one's is :meth:`end_of_step`); each releases the key
        it tracks (``release_storage_key``: a kept save's too, so the next layer's re-run offloads the rotary
        tables again); the tracker emptied, the next pack starts a forward."""
        if self.first_backward:
            self.first_backward = False
            self.graph = tape.graph
            if tape.depth > 1:
                tape.callbacks.append(lambda: self._drop_back(tape))
        for ident in idents:
            self._untrack(ident)
        self.pending -= len(idents)
        if not self.pending:
            self.first_forward = True

    def _drop_back(self, tape: Tape) -> None:
        for t in self.back.values():
            tape.drop(t)
        self.back = {}
        self.brought = {}

    def release(self, packed: Packed) -> None:
        """The host copy goes at its unpack (or with the step)."""
        if not packed.released:
            packed.released = True
            self.host_bytes -= packed.numel * packed.itemsize

    def _release(self, tape: Tape, node: Node, previous: list[int]):
        def hook() -> None:
            for k in self.brought.pop(node, ()):
                self._shared(tape, k)
            for k in previous:
                tape.drop(self.back.pop(k, None))
            self._clear_stash(tape)

        return hook

    def _shared(self, tape: Tape, ident: int) -> None:
        """The node's hook on a copy it brought back (TRL's ``storage_count > storage_refcount``): a copy with
        holders besides the backward stash (a checkpoint's re-run saved it: ``_recomputation_hook``'s
        ``x.detach()``, a storage reference the unpack did not count) leaves the stash now (``record_stream``;
        on a GPU the block is freed when its last holder goes), not after the next node."""
        t = self.back.get(ident)
        if t is not None and t.st.refs > 1:
            tape.drop(self.back.pop(ident))

    def _clear_stash(self, tape: Tape) -> None:
        for ident, t in self.stash.items():
            tape.drop(t)
            self._untrack(ident)
        self.stash = {}

    def end_of_step(self, tape: Tape) -> None:
        """The end-of-backward callback: the last node's copies and the stash go; a new forward starts (the dedup
        map and the backward's flag reset each step, as the next step's ``__enter__`` resets TRL's).
        ``curr_autograd_node`` stays: TRL never resets it (:meth:`reached`)."""
        self._drop_back(tape)
        self._clear_stash(tape)
        # what was never unpacked (a save of a node that died in the forward, :func:`orphaned`) TRL's tracker holds
        # until the next step's ``__enter__`` (``self.tracker.clear()``), before any pack: its host copies go
        self.host_bytes = 0
        self.seen, self.key_of = {}, {}
        self.first_backward = True

    def begin_step(self, tape: Tape) -> None:
        """The next ``training_step``'s ``__enter__``: ``self.tracker.clear()`` lets go of the kept saves nothing
        unpacked (:attr:`orphans`)."""
        for t in self.orphans:
            tape.drop(t)
        self.orphans = []

    def reached(self) -> set[Node]:
        """The nodes TRL keeps alive after the backward: ``curr_autograd_node`` (the last node that unpacked an
        offloaded save, a Python reference TRL's ``unpack_tensor_with_streams`` rebinds only at the next
        backward's first such node) and every node it reaches through its edges (``next_functions``). Their
        saved tensors went as they ran; what they hold beyond those stays: a custom Function's ctx attributes
        (bitsandbytes' ``MatMul8bitLt`` / ``MatMul8bitFp``: ``ctx.A``, ``ctx.tensors``) and an
        ``AccumulateGrad``'s variable (``enable_input_require_grads``' leaf input, and its ``.grad``)."""
        seen: set[Node] = set()
        stack = [self.node] if self.node is not None else []
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(m for m in n.nexts if m is not None and m not in seen)
        return seen

    def hold_graph(self, kept: list[Tensor]) -> None:
        """What :meth:`reached` keeps of this step's graph (the run's references, moved here): it goes when
        ``curr_autograd_node`` is rebound, in the next backward (:meth:`unpack`)."""
        self.graph_kept += kept


def _stored(tape: Tape, t: Tensor) -> int:
    """The elements TRL's host copy of ``t`` holds: a broadcast save's (more elements than its storage: an
    ``expand``, as ``repeat_kv``'s of one KV head) storage alone (``has_broadcast``: ``torch.empty(storage
    size)``, brought back as that and ``as_strided`` to the save's shape), else the save's."""
    live = tape.b.live.get(t.st.tid)
    return live[2] // t.itemsize if live is not None and live[2] < t.numel * t.itemsize else t.numel


def orphaned(tape: Tape, t: Tensor) -> None:
    """A save of a node that dies in the forward, never unpacked (DeepSeek-V3's router: the group top-2's, the
    groups' top-k's and the final top-k's indices, ``masked_fill``'s mask; ``hf_mla.HfDeepseekV3.router``). Under
    TRL's hooks outside a checkpoint it is packed as any save: an offloaded one's host copy stays in TRL's
    ``tracker`` (emptied by unpacks, and by the next step's ``__enter__``: :meth:`TrlOffload.end_of_step`) and
    its original enters the forward stash, and a later save of the same storage stays on the device (the
    ``gather`` of the top-k's indices). A kept one (under 1024 bytes) is held by TRL's tracker, the tensor itself,
    until the next step's ``__enter__`` (:meth:`TrlOffload.begin_step`; before 2026-11-29 it went with its node, as
    the emulation had it). Under ``save_on_cpu`` the host copy goes with the node, inside the router: left out."""
    hooks = tape.hooks
    # under a reentrant checkpoint's no_grad forward there is no node: nothing saved (its re-run's are packed)
    if isinstance(hooks, TrlOffload) and tape.region is None and not tape.recomputing and tape.grad_enabled:
        packed = hooks.pack(tape, t)
        if packed is t and not t.st.managed:
            hooks.orphans.append(t)  # the hold pack took: TRL's tracker's until the next step (begin_step)


@contextmanager
def in_head(hooks: object) -> Iterator[None]:
    """TRL's no-op hooks around the output head: under :class:`TrlOffload` nothing it saves is offloaded."""
    trl = isinstance(hooks, TrlOffload)
    if trl:
        hooks.paused += 1
    try:
        yield
    finally:
        if trl:
            hooks.paused -= 1
