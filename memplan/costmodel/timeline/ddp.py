"""DDP as the bundled trainer applies it (``parallel.apply_ddp``: ZeRO-0, dp > 1), on one rank.

``DistributedDataParallel(model, gradient_as_bucket_view=True)`` with the trainer's all-reduce
hook, built after ``to_empty`` / ``tie_weights`` / ``init_weights``. What it allocates
(PyTorch ``torch/nn/parallel/distributed.py`` and ``torch/csrc/distributed/c10d/``: ``reducer.cpp``,
``comm.cpp``; trace ``h200_a_ddp1b``, events 238-293 and 10135-10207):

- ``_verify_param_shape_across_processes``: the parameter count (8 B) all-gathered into
  ``dp`` 8-byte tensors, then the shapes and strides of every parameter (int64, 2 per dim),
  freed at once;
- ``_sync_module_states``: ``_broadcast_coalesced`` of the parameters in 250 MiB buckets
  (``compute_bucket_assignment_by_size``: a bucket closes when it reaches the limit); each
  bucket is flattened into one tensor (a bucket of one tensor is its view: nothing), at most
  two in flight, the older freed when a third starts;
- the ``Reducer``: one bucket of every parameter (``bucket_size_limits=[sys.maxsize]`` until
  the rebuild), in the parameters' dtype; it lives for the run;
- each backward: ``AccumulateGrad`` steals the gradient, the reducer's post-hook copies it into
  its bucket view and points ``.grad`` at the view, so the stolen gradient goes at once
  (``mark_variable_ready_dense``); the hook's ``div_`` and the all-reduce work in place;
  ``zero_grad(set_to_none=True)`` frees nothing (views of the buckets);
- the next forward's ``_rebuild_buckets`` (once): the buckets rebuilt in the order the
  gradients became ready in the first backward, the first capped at 1 MiB
  (``_DEFAULT_FIRST_BUCKET_BYTES``), the others at 25 MiB (``bucket_cap_mb``);
  ``sync_bucket_indices`` puts the indices (int32, one per parameter plus one) and the bucket
  sizes (int32, one per bucket) on the device, then the old bucket goes before the new ones
  are allocated (``initialize_buckets``);
- gradient accumulation: the trainer runs every micro-batch but the last under ``no_sync()``
  (``runner._train``). There ``require_backward_grad_sync`` is False, so the forward does not
  ``prepare_for_backward`` and the reducer's hooks return at once (``expect_autograd_hooks_``
  false: ``Reducer::autograd_hook``): ``AccumulateGrad`` steals the first gradient into
  ``.grad`` and adds each later one in place (``accumulate_grad.h``, ``variable_grad +=
  new_grad``), nothing is recorded for the rebuild. In the last micro-batch the incoming
  gradient is added into the held one and freed when ``AccumulateGrad`` returns, then the hook
  copies the sum into its bucket view and points ``.grad`` at the view
  (``mark_variable_ready_dense``: ``grad`` not an alias of the bucket), freeing the sum. The
  run follows the first micro-batch and the last (``MICRO_BATCHES_MODELLED``); those between hold
  every gradient as the last does before its sync: following all six of six gave the same
  allocated and reserved peaks (tests/unit/test_timeline_zero1.py).
"""

from __future__ import annotations

import sys

from memplan.costmodel.timeline.autograd import FIRST, Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category

MiB = 2**20
BROADCAST_BUCKET = 250 * MiB  # DistributedDataParallel.broadcast_bucket_size
FIRST_BUCKET = 1 * MiB  # dist._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_CAP = 25 * MiB  # bucket_cap_mb default
IN_FLIGHT = 2  # broadcast_coalesced's max_in_flight


def assign_buckets(sizes: list[int], limits: list[int]) -> list[list[int]]:
    """``compute_bucket_assignment_by_size`` over one dtype: indices into ``sizes`` (bytes),
    a bucket closing once it reaches its limit, the limits taken in turn (the last repeats)."""
    out, bucket, total, k = [], [], 0, 0
    for i, size in enumerate(sizes):
        bucket.append(i)
        total += size
        if total >= limits[k]:
            out.append(bucket)
            bucket, total, k = [], 0, min(k + 1, len(limits) - 1)
    if bucket:
        out.append(bucket)
    return out


def assign_buckets_by_dtype(sizes: list[int], dtypes: list[int], limits: list[int]) -> list[list[int]]:
    """``compute_bucket_assignment_by_size`` (``reducer.cpp``) over several dtypes: a bucket per
    dtype, each closing once it reaches its own next limit (:func:`assign_buckets` per dtype,
    interleaved in the order they close), the open ones last (in first-seen order: the C++ keeps
    them in an ``unordered_map``; their order moves no byte of the peak). The initial assignment
    (no limit: one bucket per dtype) is sorted by each bucket's first index by the caller."""
    out: list[list[int]] = []
    open_: dict[int, tuple[list[int], int, int]] = {}  # dtype -> (indices, bytes, limit index)
    for i, (size, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
        bucket, total, k = open_.get(dtype, ([], 0, 0))
        bucket.append(i)
        if total + size >= limits[k]:
            out.append(bucket)
            open_[dtype] = ([], 0, min(k + 1, len(limits) - 1))
        else:
            open_[dtype] = (bucket, total + size, k)
    return out + [bucket for bucket, _, _ in open_.values() if bucket]


def broadcast_buckets(states: list[tuple[int, int]], limit: int) -> list[list[int]]:
    """``broadcast_coalesced`` (``torch/csrc/distributed/c10d/comm.cpp``) buckets ``states``
    (bytes, itemsize) with ``compute_bucket_assignment_by_size(tensors, {buffer_size})``: a bucket
    per dtype closing at ``limit`` (:func:`assign_buckets_by_dtype`), and, no tensor indices given,
    the buckets sorted by the first index each holds (``reducer.cpp``). Checked on CPU over a 4-bit
    base under DDP (tests/unit/test_timeline_quant_variants.py): the fp32 group of the embedding,
    norms, head and adapters flattened before the uint8 one of the packed weights."""
    sizes, dtypes = [size for size, _ in states], [itemsize for _, itemsize in states]
    return sorted(assign_buckets_by_dtype(sizes, dtypes, [limit]), key=lambda bucket: bucket[0])


def verify_params(tape: Tape, dp: int, ndims: int) -> None:
    """``verify_params_across_processes`` over parameters of ``ndims`` dimensions in all: the count
    (8 B), its all-gather into ``dp`` 8-byte tensors, the shapes' and strides' metadata (int64, 2
    per dimension), freed at once."""
    t = tape
    with t.scoped("ddp.verify"):
        counts = [t.new(1, 8, "param_count", Category.COMM) for _ in range(dp + 1)]
        t.done(t.new(2 * ndims, 8, "metadata", Category.COMM))
        t.done(*counts[1:], counts[0])


def broadcast_coalesced(tape: Tape, states: list[tuple[int, int]], tag: str) -> None:
    """``_broadcast_coalesced`` of ``states`` (bytes, itemsize) from rank 0 (``comm.cpp``):
    :func:`broadcast_buckets` of 250 MiB, each of more than one tensor flattened into one
    (a bucket of one tensor is its own view), two in flight, the older freed when a third starts."""
    t, flights = tape, []
    sizes = [size for size, _ in states]
    for bucket in broadcast_buckets(states, BROADCAST_BUCKET):
        if len(flights) == IN_FLIGHT:
            t.done(flights.pop(0))
        size = sum(sizes[i] for i in bucket) if len(bucket) > 1 else 0
        flights.append(t.new(size, 1, tag, Category.COMM) if size else None)
    t.done(*flights)


def sync_bucket_indices(tape: Tape, params: int, buckets: int) -> None:
    """``Reducer::sync_bucket_indices`` before a rebuild: the indices (int32, one per parameter
    plus one) and the bucket sizes (int32, one per bucket) on the device, freed at once."""
    t = tape
    with t.scoped("ddp.sync_bucket_indices"):
        indices = t.new(params + 1, 4, "indices", Category.COMM)
        t.done(t.new(buckets, 4, "bucket_sizes", Category.COMM), indices)


class Reducer:
    """What the bundled trainer's DDP (:class:`Ddp`) and the Trainer's (``hf_ddp.HfDdp``) share: a
    bucket's flat allocation and ``Reducer::rebuild_buckets``. A subclass sets ``tape``, ``ready``
    (the first synced backward's gradient-ready order) and ``buckets``, and says a parameter's
    bytes and dtype (``_bytes``, ``_dtypes``)."""

    tape: Tape
    ready: list[str]
    buckets: list[Tensor]

    def _bytes(self, name: str) -> int:
        raise NotImplementedError

    def _dtypes(self, names: list[str]) -> list[int]:
        raise NotImplementedError

    def _bucket(self, names: list[str], tag: str) -> Tensor:
        return self.tape.managed(sum(self._bytes(n) for n in names), 1, tag, Category.GRADIENTS)

    def _rebuild(self) -> None:
        """``_rebuild_buckets`` in the ready order (a 1 MiB first bucket, then 25 MiB, per dtype):
        the indices synced, the old buckets freed, the new ones allocated."""
        t, ready = self.tape, self.ready
        order = assign_buckets_by_dtype(
            [self._bytes(n) for n in ready], self._dtypes(ready), [FIRST_BUCKET, BUCKET_CAP]
        )
        sync_bucket_indices(t, len(ready), len(order))
        for bucket in self.buckets:
            t.free(bucket)
        self.buckets = [self._bucket([ready[i] for i in b], f"reducer.bucket{k}") for k, b in enumerate(order)]


class Ddp(Reducer):
    """The reducer of one rank: its buckets and the order gradients became ready."""

    def __init__(
        self,
        tape: Tape,
        dp: int,
        shapes: dict,
        weights: dict[str, Tensor],
        itemsize: int,
        states: list[tuple[int, int]] | None = None,
        itemsizes: dict[str, int] | None = None,
    ) -> None:
        """``shapes``: the parameters that require grad (the reducer's), in order, of dtype
        ``itemsize`` unless ``itemsizes`` says otherwise (LoRA's 16-bit head copy beside fp32
        adapters); ``states``: (bytes, itemsize) of every parameter in ``named_parameters()``
        order, frozen ones included (LoRA's base), for the broadcast; by default the reducer's."""
        self.tape, self.dp, self.shapes, self.itemsize = tape, dp, shapes, itemsize
        self.itemsizes = {name: (itemsizes or {}).get(name, itemsize) for name in shapes}
        self.states = states if states is not None else [(self._bytes(n), itemsize) for n in shapes]
        self.names = list(shapes)
        self.ready: list[str] = []  # the first backward's gradient-ready order
        self.rebuilt = False
        self.sync = True  # False inside ``no_sync()``
        self.held: dict[str, Tensor] = {}  # ``.grad`` accumulated under ``no_sync()``
        for name in self.names:
            weights[name].fn = self._leaf(name)
        self._verify()
        self._broadcast()
        sizes = [self._bytes(n) for n in self.names]  # bucket_size_limits=[sys.maxsize]: one per dtype
        first = assign_buckets_by_dtype(sizes, self._dtypes(self.names), [sys.maxsize])
        self.buckets = [self._bucket([self.names[i] for i in b], "reducer.bucket") for b in sorted(first)]

    def _bytes(self, name: str) -> int:
        rows, cols = self.shapes[name]
        return rows * cols * self.itemsizes[name]

    def _dtypes(self, names: list[str]) -> list[int]:
        return [self.itemsizes[n] for n in names]

    def _leaf(self, name: str) -> Node:
        """``AccumulateGrad`` and the reducer's hook: the gradient is copied into its bucket view
        and freed when the node returns; the first synced backward records the ready order.
        Under ``no_sync()`` the gradient is held (stolen, or added into the held one)."""

        def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
            if not self.sync:
                if name not in self.held:
                    self.held[name] = tape.hold(g[0])
                return []
            held = self.held.pop(name, None)
            if held is not None:  # ``held += g``: g goes as AccumulateGrad returns, then the sum
                tape.drop(g[0])
                g[0] = None  # the engine's reference, dropped just now
                tape.drop(held)
            if not self.rebuilt and name not in self.ready:
                self.ready.append(name)
            return []

        return Node(FIRST, f"{name}.AccumulateGrad", apply, [])

    # --- construction ------------------------------------------------------------------------------
    def _verify(self) -> None:
        """``verify_params_across_processes`` over the reducer's parameters (a norm's weight and a
        bias one dimension, the rest two)."""
        ndims = sum(1 if name.endswith(("norm.weight", ".bias")) else 2 for name in self.names)
        verify_params(self.tape, self.dp, ndims)

    def _broadcast(self) -> None:
        """``_broadcast_coalesced`` of the parameters from rank 0."""
        broadcast_coalesced(self.tape, self.states, "ddp.broadcast_flat")

    # --- steps ---------------------------------------------------------------------------------------
    def pre_forward(self) -> None:
        """``_rebuild_buckets`` at the first forward after a backward (once)."""
        if self.rebuilt or not self.ready:
            return
        self.rebuilt = True
        self._rebuild()
