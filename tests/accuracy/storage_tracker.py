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

import torch

from memplan.integrations.live_bytes import LiveBytes


class StorageTracker(LiveBytes):
    """Bytes of live storages: those handed to :meth:`track` plus every storage an op creates while
    the mode is on; ``peak`` the highest total seen after any op. The counting is
    :class:`memplan.integrations.live_bytes.LiveBytes` (the callback's CPU meter): a count of
    PyTorch's own storages, not a model of them."""

    def track(self, *tensors: torch.Tensor) -> None:  # type: ignore[override]
        super().track(tensors)

    def track_module(self, module: torch.nn.Module) -> None:
        self.track(*module.parameters(), *module.buffers())

    def reset_peak(self) -> None:
        self.peak = self.current
