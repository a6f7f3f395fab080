"""Live tensor bytes on the CPU, counted at the dispatcher: the CPU has no ``max_memory_allocated``.

A ``TorchDispatchMode`` sees every op's outputs; each new storage counts its ``nbytes`` from
then until its Python storage object is finalised (``weakref.finalize``: the mode holds no
reference to any tensor, so it keeps nothing alive that the step would free). Storages that
exist before the mode starts count only when handed to :meth:`LiveBytes.track` (parameters,
buffers, gradients, optimizer states). This is MemTracker's accounting
(``torch.distributed._tools.mem_tracker``: storage ``nbytes`` from creation to finalisation)
without its module hooks, which keep a leaf input and its gradient alive across steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of live storages: those handed to :meth:`track` plus every storage an op creates
    while the mode is on; ``peak`` is the highest total after any op."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # storage data pointer -> bytes
        self.current = 0
        self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._live or size == 0:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())
        return out
