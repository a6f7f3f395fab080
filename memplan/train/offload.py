"""Activation offload to CPU (``offload_activations: cpu``) in the bundled trainer.

What it runs: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward and
the loss of each micro-batch, the way PyTorch documents offloading for a plain loop (no
activation-offload option of torchtitan's was found in the sources searched, so nothing here
claims to follow one). Every tensor autograd saves in
that region, parameters included, is copied into pinned host memory by the pack hook; the
unpack hook copies it back to the device when its node runs in the backward, and that copy
dies with the node. The backward needs no context: the hooks travel with the saved tensors.

On CPU there is no second memory: ``save_on_cpu`` would keep the tensor itself. So on CPU the
pack hook copies the values into a numpy array, outside torch's allocator (MemTracker does
not count it, as device memory would not hold the pinned copy), and the unpack hook clones
them into a new tensor (counted, as the device copy would be) - the emulation of
tests/accuracy/offload_steps.py. ``host_bytes`` / ``host_peak``: the host copies alive.

With ``recompute: full`` the checkpointed layers' own saves go to the checkpoint's hooks (the
innermost saved-tensor hooks win), but what the checkpoint itself saves for the recomputation, each
layer's input and RoPE's tables, passes the outer hooks and is offloaded, with what the embedding,
final norm, LM head and loss save (``costmodel.trainer_offload.host_bytes``, exact on CPU).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch


def _host_copy(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype, torch.Size]:
    """The tensor's values, contiguous, in a numpy array (outside torch's allocator)."""
    src = t.detach()
    if src.dtype == torch.bfloat16:
        src = src.view(torch.int16)  # numpy has no bfloat16; a view makes no new storage
    return np.array(src.numpy(), copy=True), t.dtype, t.shape


def _device_copy(packed: tuple[np.ndarray, torch.dtype, torch.Size]) -> torch.Tensor:
    """A new tensor holding the host copy's values: one torch allocation (counted), filled
    through numpy, as ``save_on_cpu``'s ``tensor.to(device)`` makes one device allocation
    (``torch.from_numpy(...).clone()`` would show a tracker the numpy-backed tensor as well)."""
    arr, dtype, shape = packed
    out = torch.empty(shape, dtype=dtype)
    view = out.view(torch.int16) if dtype == torch.bfloat16 else out
    view.numpy().reshape(arr.shape)[...] = arr
    return out


class EmulatedSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu`` on a CPU-only machine: every saved tensor copied out of torch's
    allocator in the forward and back into it, contiguous, when its node runs."""

    def __init__(self) -> None:
        self.host_bytes = self.host_peak = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> tuple[np.ndarray, torch.dtype, torch.Size]:
        packed = _host_copy(t)
        self.host_bytes += packed[0].nbytes
        self.host_peak = max(self.host_peak, self.host_bytes)
        # the host copy lives as long as autograd holds the packed value (its node's release)
        weakref.finalize(packed[0], self._release, packed[0].nbytes)
        return packed

    def _release(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _unpack(self, packed: tuple[np.ndarray, torch.dtype, torch.Size]) -> torch.Tensor:
        return _device_copy(packed)


def offload_context(device: torch.device) -> torch.autograd.graph.saved_tensors_hooks:
    """The saved-tensor hooks to run the forward and loss under: ``save_on_cpu`` with pinned
    memory on CUDA, its emulation on CPU."""
    if device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return EmulatedSaveOnCpu()
