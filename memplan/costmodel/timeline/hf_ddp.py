"""DDP as ``transformers.Trainer`` runs it under ``torchrun`` (accelerate 1.15, torch 2.13), on one rank.

The Trainer hands accelerate ``DistributedDataParallelKwargs(find_unused_parameters=...)`` alone
(``Trainer._build_accelerator_args``: ``ddp_find_unused_parameters`` unset, so ``not
model.is_activation_checkpointing`` for a ``PreTrainedModel`` and True for any other model, a PEFT
model included; ``bucket_cap_mb`` and the rest unset), and accelerate's ``to_kwargs`` passes only what
differs from its defaults: ``DistributedDataParallel(model, device_ids=[rank], find_unused_parameters=...)``
with ``gradient_as_bucket_view=False`` and DDP's own 25 MiB buckets (``bucket_cap_mb=None``: a 1 MiB
first bucket). What that allocates beyond the one-rank run (``torch/nn/parallel/distributed.py``,
``torch/csrc/distributed/c10d/reducer.cpp``; checked on CPU against the real Trainer on two gloo ranks,
tests/unit/test_timeline_hf_ddp.py):

- construction, inside ``accelerator.prepare``: ``verify_params_across_processes`` and the broadcast of
  every parameter and buffer (``_sync_module_states``: frozen ones too) as the bundled trainer's DDP
  (``ddp.verify_params``, ``ddp.broadcast_coalesced``); the reducer's buckets, assigned over the
  parameters that require grad (``BucketCapacityConfig.compute_bucket_size_limits``: one bucket per
  dtype without ``find_unused_parameters``, else 1 MiB then 25 MiB buckets in parameter order, sorted
  by first index and handed to the ``Reducer`` reversed), allocated in that order and kept; with
  ``find_unused_parameters`` the ``local_used_map_`` (int32 per parameter, on the host: on CPU it
  counts) and ``local_used_map_dev_`` on the device (``Reducer::initialize_local_used_map``);
- ``gradient_as_bucket_view=False``: ``.grad`` stays its own tensor; the reducer's hook copies it into
  its bucket view (``mark_variable_ready_dense``: ``at::mul_out(bucket_view, grad, 1 / world)``) and
  the all-reduced bucket back into it (``copy_bucket_to_grad``): nothing allocated, and the gradients
  and the buckets are both alive (the one-rank run's gradients, unchanged, plus the buckets);
- each forward, ``_pre_forward``: the rebuild of the buckets in gradient-ready order once, after the
  first synced backward, only without ``find_unused_parameters`` (``Reducer::should_rebuild_buckets``),
  as ``ddp.Ddp.pre_forward``; then, when the previous forward synced (``require_forward_param_sync``),
  the buffers' broadcast (``_sync_buffers``: the rotary tables flattened into one transient tensor);
- with ``find_unused_parameters``, ``_post_forward`` passes every output tensor through ``_DDPSink``,
  which clones each (``_ddp_sink_clone``): the loss and the (fp32) logits are copied, the originals go
  as it returns, and the loss's clone carries the gradient through (its backward returns it as is);
- ``get_batch_samples``: ``num_items_in_batch`` gathered over the ranks
  (``accelerator.gather(...).sum()``, ``average_tokens_across_devices``): a clone of the count, the
  gathered tensor (NCCL: one ``empty`` of ``dp`` counts; gloo on CPU: ``dp`` ``empty_like`` and their
  ``cat``), their sum;
- gradient accumulation: every micro-batch but the last under ``no_sync()`` (the Trainer's
  ``sync_context``); the hooks then return at once and the gradients accumulate in ``.grad`` as on one
  rank.

Only the Trainer's defaults are followed: not ``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb``,
``ddp_broadcast_buffers`` or ``ddp_static_graph`` set by hand, nor a communication hook; but one case: a PEFT model
under torch's reentrant checkpoint (``reentrant.py``), where the Trainer's ``find_unused_parameters=True`` fails in
the first backward (``prepare_for_backward`` finds no adapter in the graph of layers run under ``no_grad`` and marks
them ready; their hooks then fire in the re-runs: "Expected to mark a variable ready only once"), so the run that
trains sets ``ddp_find_unused_parameters=False`` and this one follows it (:func:`wrap`). The reducer's hooks fire
inside each checkpoint's nested backward, in the order the gradients are made, as without it
(tests/unit/test_timeline_hf_reentrant_ranks.py).

On CPU the real run also copies each parameter (``model.to("cpu:0")``, an index the parameters lack),
each batch and the count once more, and keeps host copies of the verify metadata and bucket indices:
transients below the step's peak that a CUDA run does not have, left out here.
"""

from __future__ import annotations

import sys

from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.ddp import (
    BUCKET_CAP,
    FIRST_BUCKET,
    Reducer,
    assign_buckets_by_dtype,
    broadcast_coalesced,
    verify_params,
)
from memplan.costmodel.timeline.events import Category


class HfDdp(Reducer):
    """The reducer of one rank under the Trainer: buckets, the local-used map, the forward's hooks."""

    def __init__(
        self,
        tape: Tape,
        dp: int,
        reducer: dict[str, tuple[int, int]],
        ndims: int,
        states: list[tuple[int, int]],
        buffers: list[tuple[int, int]],
        find_unused: bool,
        cuda: bool,
    ) -> None:
        """``reducer``: (elements, itemsize) of the parameters that require grad, in
        ``named_parameters()`` order, of ``ndims`` dimensions in all; ``states`` and ``buffers``:
        (bytes, itemsize) of every parameter and every buffer (``_get_module_states``: parameters
        first), for the broadcasts."""
        self.tape, self.dp, self.reducer, self.cuda = tape, dp, reducer, cuda
        self.find_unused = find_unused
        self.buffers = buffers
        self.sync = True  # False inside ``no_sync()``
        self.param_sync = True  # ``require_forward_param_sync``: the last forward synced
        self.ready: list[str] = []
        self.rebuilt = find_unused  # never rebuilt with find_unused_parameters
        verify_params(tape, dp, ndims)
        broadcast_coalesced(tape, states + buffers, "ddp.broadcast_flat")
        names = list(reducer)
        limits = [FIRST_BUCKET, BUCKET_CAP] if find_unused else [sys.maxsize]
        order = assign_buckets_by_dtype([self._bytes(n) for n in names], self._dtypes(names), limits)
        self.buckets = [self._bucket([names[i] for i in b], "reducer.bucket") for b in reversed(sorted(order))]
        if find_unused:
            if not cuda:
                tape.managed(len(names), 4, "reducer.local_used_map", Category.COMM)
            tape.managed(len(names), 4, "reducer.local_used_map_dev", Category.COMM)

    def _bytes(self, name: str) -> int:
        numel, itemsize = self.reducer[name]
        return numel * itemsize

    def _dtypes(self, names: list[str]) -> list[int]:
        return [self.reducer[n][1] for n in names]

    # --- the step ------------------------------------------------------------------------------------
    def gather_count(self, count: Tensor) -> Tensor:
        """``accelerator.gather(count).sum()`` (``_gpu_gather_one``): the clone of the 0-d count,
        the gathered counts, their sum; the gathered ones go with the expression."""
        t = self.tape
        with t.scoped("gather_num_items"):
            clone = t.new(1, 8, "clone")
            if self.cuda:  # all_gather_into_tensor into one empty
                gathered = t.new(self.dp, 8, "all_gather")
                t.done(clone)
            else:  # gloo: a list of empty_like, all_gather, cat
                parts = [t.new(1, 8, "all_gather") for _ in range(self.dp)]
                gathered = t.new(self.dp, 8, "cat")
                t.done(clone, *parts)
            total = t.new(1, 8, "sum")
            t.done(gathered)
        return total

    def pre_forward(self) -> None:
        """``_pre_forward``: the rebuild once the first synced backward gave the ready order
        (:meth:`backward_done`), then the buffers' broadcast."""
        t = self.tape
        if not self.rebuilt and self.ready:
            self.rebuilt = True
            self._rebuild()
        if self.param_sync:
            broadcast_coalesced(t, self.buffers, "ddp.sync_buffers_flat")

    def post_forward(self, outputs: list[Tensor]) -> list[Tensor]:
        """``_post_forward``: ``_DDPSink`` over the outputs with ``find_unused_parameters`` (their
        clones returned, the originals let go; the first, the loss, carries the gradient)."""
        self.param_sync = self.sync
        if not self.find_unused:
            return outputs
        t = self.tape
        with t.scoped("ddp_sink"):
            clones = [t.new(x.numel, x.itemsize, "clone", _category(t, x)) for x in outputs]
        loss, clone = outputs[0], clones[0]
        clone.fn = t.node("ddp_sink", _passthrough, [loss])
        t.done(*outputs)
        return clones

    def backward_done(self, grads: dict) -> None:
        """After a backward: the first synced one's gradient-ready order, for the rebuild."""
        if self.sync and not self.rebuilt and not self.ready:
            self.ready = [name for name in grads if name in self.reducer]


def wrap(
    tape: Tape,
    dp: int,
    weights: dict[str, Tensor],
    shapes: dict[str, tuple[int, int]],
    trainable: dict[str, tuple[int, int]],
    buffers: list[Tensor],
    peft: bool,
    checkpointing: bool,
    cuda: bool,
    reentrant: bool = False,
) -> HfDdp:
    """``DistributedDataParallel`` over the Trainer's model as ``accelerator.prepare`` builds it:
    ``find_unused_parameters`` unless a ``PreTrainedModel`` is checkpointed (a PEFT model is not
    one) or the checkpoint is torch's reentrant one (``reentrant``: the run that trains sets
    ``ddp_find_unused_parameters=False``, module docstring). ``shapes``: the base's parameters in order,
    ``weights``: what the run built for them (a 4-bit base's packed bytes), ``trainable``: (elements,
    itemsize) of what requires grad, ``peft``: a PEFT model (the base frozen)."""
    params = _named_parameters(weights, shapes, trainable, peft)
    reducer = {name: trainable[name] for name, _, _, _ in params if name is not None}
    ndims = sum(dims for name, _, _, dims in params if name is not None)
    states = [(size, itemsize) for _, size, itemsize, _ in params]
    sizes = [(b.numel * b.itemsize, b.itemsize) for b in buffers]
    find_unused = not checkpointing or (peft and not reentrant)
    return HfDdp(tape, dp, reducer, ndims, states, sizes, find_unused, cuda)


def _named_parameters(
    weights: dict[str, Tensor], shapes: dict[str, tuple[int, int]], trainable: dict, peft: bool
) -> list[tuple[str | None, int, int, int]]:
    """(name if it requires grad, bytes, itemsize, dimensions) in ``named_parameters()`` order: a
    PEFT linear's ``base_layer`` weight and bias, then its ``lora_A`` and ``lora_B``
    (``LoraLayer.__init__`` registers them after the base); a ``modules_to_save`` copy after its
    original (``ModulesToSaveWrapper``: ``original_module`` first), a tied head's copy last."""
    out: list[tuple[str | None, int, int, int]] = []
    pending: list[str] = []

    def flush() -> None:
        out.extend((n, trainable[n][0] * trainable[n][1], trainable[n][1], 2) for n in pending)
        pending.clear()

    module = None
    for name, (_, cols) in shapes.items():
        if name.rsplit(".", 1)[0] != module:
            flush()
            module = name.rsplit(".", 1)[0]
            pending.extend(n for n in (f"{module}.lora_A.weight", f"{module}.lora_B.weight") if n in trainable)
        w, dims = weights[name], 1 if cols == 1 else 2
        out.append((None if peft else name, w.numel * w.itemsize, w.itemsize, dims))
        if peft and name in trainable:
            out.append((name, w.numel * w.itemsize, w.itemsize, dims))
    flush()
    placed = {n for n, _, _, _ in out}
    out.extend((n, size * b, b, 2) for n, (size, b) in trainable.items() if n not in placed)
    return out


def _passthrough(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
    """``_DDPSink.backward``: the incoming gradient, as is."""
    return [tape.hold(g[0])]


def _category(tape: Tape, x: Tensor) -> Category | None:
    entry = tape.b.live.get(x.st.tid)
    return None if entry is None else entry[3]
