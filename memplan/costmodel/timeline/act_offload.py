"""Activation offload (``offload_activations: cpu``): the bundled trainer's ``save_on_cpu``, op by op.

The trainer (``memplan/train/offload.py``; ``runner._train``'s ``forward_of`` and ``loss_of``) runs
each micro-batch's forward and loss under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
(``torch/autograd/graph.py``, torch 2.13):

- its pack hook copies every tensor autograd saves there, parameters included, into a new pinned
  host tensor (``torch.empty(t.size(), pin_memory=True).copy_(t)``) and the saved variable keeps
  that copy instead of the tensor (``SavedVariable::set_hooks_and_pack_data``): the device tensor
  goes with Python's last reference. A tensor two ops save is copied twice;
- its unpack hook, ``host.to(device, non_blocking=True)``, makes one new contiguous device tensor
  of the saved tensor's size when the node that saved it runs: the generated ``apply`` unpacks
  every saved variable before computing anything, and the copies die as it returns
  (:meth:`~memplan.costmodel.timeline.autograd.Tape.end_apply`); the host copy goes with the node;
- under ``recompute: full`` a checkpointed layer's own saves go to the checkpoint's hooks (the
  innermost win), but ``_CheckpointFrame.save_inputs`` saves the layer's tensor inputs (x, cos,
  sin) under these: they go to the host, and the recompute runs on ``frame.get_inputs()``, their
  device copies, which die when the unpack hook that ran it returns (``torch/utils/checkpoint.py``).

Checked on CPU against the trainer's emulation (``EmulatedSaveOnCpu``: the host copy outside
torch's allocator, the device copy inside it), which makes the same device requests: peaks and
host bytes (tests/unit/test_timeline_act_offload.py). No GPU trace ran activation offload; what
CUDA does besides is from source, not a trace: a pinned host tensor is the host allocator's
(``CachingHostAllocator``), never the device's. In fp32 the saves are SDPA's math path's
(``precision.py``), its strided scaled key staged as it is packed (tests/unit/
test_timeline_fp32_corners.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from memplan.costmodel.timeline.events import Category

if TYPE_CHECKING:  # autograd imports this module
    from memplan.costmodel.timeline.autograd import Node, Tape, Tensor


# CUDA only, from source: ``packed.copy_(t)`` of a non-contiguous device tensor into the contiguous
# host one (the weight's transpose ``mm`` saves; q, k, v and flash's output as SDPA saves them) takes
# ``copy_kernel_cuda``'s temporaries path (``copy_requires_temporaries``, aten/src/ATen/native/cuda/
# Copy.cu): ``src.expand_as(dst).contiguous()`` on the device, freed as the copy returns
STAGING = "pack_staging"


class Packed:
    """A saved tensor's pinned host copy: its size, the hooks that hold it, and the node its
    gradient goes to (``SavedVariable`` keeps the autograd metadata: an unpacked copy has it).
    Written out, not a slotted dataclass: ~1.7 M instructions less at import (``autograd.Storage``)."""

    __slots__ = ("numel", "itemsize", "hooks", "fn", "released")

    def __init__(
        self, numel: int, itemsize: int, hooks: SaveOnCpu, fn: Node | None = None, released: bool = False
    ) -> None:
        self.numel = numel
        self.itemsize = itemsize
        self.hooks = hooks
        self.fn = fn
        self.released = released


class SaveOnCpu:
    """The saved-tensor hooks of ``save_on_cpu``; ``host_bytes``: pinned copies alive, and
    ``host_peak`` their most (the emulation's ``host_bytes``/``host_peak``)."""

    def __init__(self) -> None:
        self.host_bytes = self.host_peak = 0

    def pack(self, tape: Tape, t: Tensor) -> Packed:
        """``pack_to_cpu``: a pinned host copy; the device tensor is not held. A transposed one
        is first copied contiguous on the device (CUDA, :data:`STAGING`)."""
        if t.transposed:
            tape.drop(tape.new(t.numel, t.itemsize, STAGING))
        self.host_bytes += t.numel * t.itemsize
        self.host_peak = max(self.host_peak, self.host_bytes)
        return Packed(t.numel, t.itemsize, self, t.fn)

    def unpack(self, tape: Tape, packed: Packed, tag: str = "unpacked", node: Node | None = None) -> Tensor:  # noqa: ARG002
        """The unpack hook (:func:`unpack`); the host copy goes when the saved variable does."""
        return unpack(tape, packed, tag)

    def release(self, packed: Packed) -> None:
        """The saved variable goes (its node has run, or its checkpoint frame): the host copy too."""
        if not packed.released:
            packed.released = True
            self.host_bytes -= packed.numel * packed.itemsize


def unpack(tape: Tape, packed: Packed, tag: str = "unpacked") -> Tensor:
    """``unpack_from_cpu``: a new device tensor of the saved one's size (contiguous: the host
    copy's layout), held by the caller."""
    copy = tape.new(packed.numel, packed.itemsize, tag, Category.ACTIVATIONS)
    copy.fn = packed.fn
    return copy


@contextmanager
def saving(tape: Tape, hooks: SaveOnCpu | None) -> Iterator[None]:
    """``with offload:`` (``runner._train``'s ``forward_of`` and ``loss_of``): what autograd saves
    inside goes to ``hooks`` (None: nothing changes)."""
    outer, tape.hooks = tape.hooks, hooks if hooks is not None else tape.hooks
    try:
        yield
    finally:
        tape.hooks = outer
