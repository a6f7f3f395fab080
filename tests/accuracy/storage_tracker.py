"""Live tensor storages counted by a dispatch mode alone: MemTracker's accounting without its module hooks.

MemTracker counts each storage an op creates (``size x element size`` on CPU) from its creation until
its Python storage object is finalised, plus the parameters, buffers and whatever it is handed. It
also runs ``ModTracker``, which hooks every module's inputs and outputs for the backward
(``register_multi_grad_hook``). Where a module's input is a leaf that requires grad (the embedding
output ``enable_input_require_grads`` marks, under gradient checkpointing with a frozen embedding)
those hooks keep the leaf and its ``.grad`` alive after the step: one more pair per step, so a peak
over three steps counts two pairs that a run without the tracker frees (docs/cost-model.md,
"Fine-tuning: LoRA and QLoRA"). This tracker counts the same storages the same way, at the same ops,
and holds no reference to anything; on a run MemTracker does not perturb the two agree to the byte
(tests/accuracy/test_peft_accuracy.py).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageTracker(TorchDispatchMode):
    """Bytes of live storages: those handed to :meth:`track` plus every storage an op creates while
    the mode is on; ``peak`` the highest total seen after any op."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # storage data pointer -> bytes
        self.current = 0
        self.peak = 0

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._add(t.untyped_storage())

    def track_module(self, module: torch.nn.Module) -> None:
        self.track(*module.parameters(), *module.buffers())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        size = storage.nbytes()
        if key in self._live or size == 0:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())
        return out
