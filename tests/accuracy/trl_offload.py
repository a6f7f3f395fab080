"""TRL's own activation offload (trl 1.16.0, ``trl/models/activation_offloading.py``) run on CPU, its host copies
counted apart from device tensors.

``SFTTrainer`` builds its context in ``__init__`` (``get_act_offloading_ctx_manager(model=self.model)``, every
default: pinned host copies, streams, ``min_offload_size=1024``, ``max_fwd_stash_size=5``, no-op hooks around
``lm_head``) and enters it around ``Trainer.training_step`` (trl/trainer/sft_trainer.py); :class:`TrlTrainer`
does the same over the real ``transformers.Trainer``. TRL's code runs unchanged; the patch that lets it run on a
CPU-only torch, and nothing else:

- its constructor reads ``torch.accelerator.current_accelerator().type`` (``None`` on a CPU-only build) and
  ``torch.get_device_module`` of it: both answer ``cpu`` while it is built, so ``accelerator_type == "cpu"``
  (``pack_tensor`` offloads only tensors on the accelerator) and the device module is ``torch.cpu``'s with the
  two calls TRL makes that it lacks, ``Stream.synchronize`` (in ``__exit__``) and ``empty_cache`` (in
  ``__enter__`` once bitsandbytes is imported), both no-ops: CPU ops run in order on the calling thread.
  ``use_streams`` stays TRL's default (True): ``torch.cpu``'s streams and events are no-ops, and what streams
  change in memory is TRL's own bookkeeping (the forward stash, the backward stash freed a node later, the
  dedup map), which runs as on a GPU;
- ``use_pin_memory`` is set False after it is built: a CPU-only torch has no pinned allocator; pinning decides
  where the host copy lives, not its size;
- ``Tensor.record_stream``, which TRL calls on a tensor brought back when a view of it outlives its node (the
  checkpoint's recompute), has no CPU kernel: a no-op during the step. On a GPU it delays the block's reuse, not
  its allocated bytes (``CUDACachingAllocator``'s ``free`` lowers ``allocated_bytes`` before it inserts the
  stream's events).

Counting: on CPU, TRL's host copy (``torch.empty_like(..., device="cpu")`` or, for a broadcast tensor,
``torch.empty(storage size, device="cpu")``, filled by ``copy_``) is a CPU storage like any other, and bringing
it back (``.to("cpu")``) returns it as it is. :class:`HostCopies`, a dispatch mode entered only inside TRL's pack
and unpack hooks, runs those two allocations and every op on a host copy with the outer modes off (the device
trackers never see them) and counts them in ``host_current`` / ``host_peak``; when TRL's unpack returns a host
copy's storage (TRL's device copy on a GPU, made at that point), its bytes leave the host count and every
``LiveBytes`` tracker on the mode stack takes it as a device allocation, from there until its storage dies (held,
as on a GPU, by the autograd node and TRL's backward stash). A host copy TRL drops unrestored (an original
still in the forward stash is returned instead) leaves the host count when it dies.
"""

from __future__ import annotations

import weakref
from unittest import mock

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from memplan.integrations.live_bytes import LiveBytes

_HOST_ALLOCS = (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format)  # TRL's host copies


class _CpuStream(torch.cpu.Stream):
    """``torch.cpu.Stream`` with the ``synchronize`` TRL's ``__exit__`` calls: nothing to wait for on CPU."""

    def synchronize(self) -> None:
        pass


class _CpuAsAccelerator:
    """The device module TRL's constructor takes for ``cpu``: ``torch.cpu``'s streams plus ``empty_cache``."""

    Stream = _CpuStream
    stream = staticmethod(torch.cpu.stream)

    @staticmethod
    def current_stream() -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def empty_cache() -> None:
        pass  # a GPU's empty_cache returns cached blocks (reserved), never allocated bytes


def _no_record_stream(tensor: torch.Tensor, stream) -> None:  # noqa: ANN001
    """``record_stream`` on CPU (module doc): nothing to defer."""


def _storages(tree) -> list[torch.UntypedStorage]:  # noqa: ANN001
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class HostCopies(TorchDispatchMode):
    """TRL's host copies: ``host_current`` / ``host_peak`` bytes, hidden from the device trackers (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, int] = {}  # storage _cdata -> bytes
        self.host_current = self.host_peak = 0
        self.reused_addresses = 0  # saves TRL kept as deduplicated by a stale key (trl_offload's counted_pack)
        self.keyed: dict[int, weakref.ref] = {}  # TRL's tensor id -> the storage its dedup key was taken from

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _HOST_ALLOCS:
            with _disable_current_modes():
                out = func(*args, **kwargs)
            self._add(out.untyped_storage())
            return out
        if any(s._cdata in self._host for s in _storages((args, kwargs))):
            with _disable_current_modes():  # the copy_ into a host copy, a view of one at the unpack
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _add(self, storage: torch.UntypedStorage) -> None:
        self._host[storage._cdata] = storage.nbytes()
        self.host_current += storage.nbytes()
        self.host_peak = max(self.host_peak, self.host_current)
        weakref.finalize(storage, self._drop, storage._cdata)

    def _drop(self, key: int) -> None:
        self.host_current -= self._host.pop(key, 0)

    def to_device(self, t: torch.Tensor) -> None:
        """``t``, returned by TRL's unpack, is a host copy brought back: from here a device tensor."""
        storage = t.untyped_storage()
        if storage._cdata not in self._host:
            return
        self._drop(storage._cdata)
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, LiveBytes):
                mode._add(storage)


def _key(t: torch.Tensor) -> tuple:
    from trl.models.activation_offloading import _get_unique_tensor_key

    return _get_unique_tensor_key(t)


def _stale(held: weakref.ref | None, storage: torch.UntypedStorage) -> bool:
    """Whether the storage TRL took an address from (``held``) is gone or another: the address was reused."""
    return held is None or held() is None or held()._cdata != storage._cdata


def _offloadable(ctx, t: torch.Tensor) -> bool:  # noqa: ANN001 - trl's OffloadActivations
    """Whether TRL's ``pack_tensor`` would offload ``t`` were its address not matched: on the accelerator, at least
    ``min_offload_size`` bytes, no parameter (its checks after the dedup map's, less the address ones)."""
    big = t.numel() * t.element_size() >= ctx.min_tensor_size_bytes
    return t.device.type == ctx.accelerator_type and big and not isinstance(t, torch.nn.Parameter)


def trl_offload(model: torch.nn.Module):  # noqa: ANN201 - trl's OffloadActivations
    """TRL's context as ``SFTTrainer`` builds it (``get_act_offloading_ctx_manager(model)``), CPU its accelerator;
    ``.host``: its host copies (:class:`HostCopies`)."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    cpu = mock.patch.object(torch.accelerator, "current_accelerator", return_value=torch.device("cpu"))
    module = mock.patch.object(torch, "get_device_module", return_value=_CpuAsAccelerator)
    with cpu, module:
        ctx = get_act_offloading_ctx_manager(model)
    ctx.use_pin_memory = False
    host = ctx.host = HostCopies()
    pack, unpack = ctx.pack_hook, ctx.unpack_hook
    # the storages behind ctx.param_storages' addresses (update_model_params'): FSDP2 frees them once it shards
    params = {p.untyped_storage().data_ptr(): weakref.ref(p.untyped_storage()) for p in model.parameters()}

    def counted_pack(t: torch.Tensor):  # noqa: ANN202
        # a save TRL keeps by an address whose storage is gone (``reused_addresses``): a parameter's, freed when
        # FSDP2 sharded it, or a dedup key (data pointer plus offset, dtype) taken from a non-contiguous save whose
        # contiguous clone TRL stashed; which tensor takes a freed address is the allocator's (glibc's malloc here,
        # the caching allocator on a GPU). Counted only where the address changes TRL's answer: a save it would
        # offload otherwise (:func:`_offloadable`); one it keeps anyway (under ``min_offload_size``, a parameter)
        # stays on the device whichever storage the address held
        storage = t.untyped_storage()
        stale = _stale(params.get(storage.data_ptr()), storage) if storage.data_ptr() in ctx.param_storages else False
        key = _key(t)
        prior = ctx.storage_to_tensor_id.get(key)
        if prior is not None:
            stale = _stale(host.keyed.get(prior), storage)  # checked first by TRL: the dedup map decides
        host.reused_addresses += stale and _offloadable(ctx, t)
        with host:
            ident = pack(t)
        if ctx._storage_key_by_tensor_id.get(ident) == key:
            host.keyed[ident] = weakref.ref(t.untyped_storage())
        return ident

    def counted_unpack(ident):  # noqa: ANN001, ANN202
        with host:
            out = unpack(ident)
        host.to_device(out)
        return out

    ctx.pack_hook, ctx.unpack_hook = counted_pack, counted_unpack
    return ctx


class TrlTrainer(transformers.Trainer):
    """``transformers.Trainer`` with ``SFTTrainer``'s ``training_step``: under TRL's offload context, built from
    the Trainer's model at the end of ``__init__`` as ``SFTTrainer`` builds it."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.maybe_activation_offload_context = trl_offload(self.model)

    def training_step(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        with mock.patch.object(torch.Tensor, "record_stream", _no_record_stream), self.maybe_activation_offload_context:
            return super().training_step(*args, **kwargs)

    @property
    def host_peak(self) -> int:
        return self.maybe_activation_offload_context.host.host_peak


__all__ = ["HostCopies", "TrlTrainer", "trl_offload"]
