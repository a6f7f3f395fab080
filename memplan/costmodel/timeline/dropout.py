"""``nn.Dropout`` in training as ops on the byte-level tape (LoRA's ``lora_dropout``).

``at::dropout`` (``aten/src/ATen/native/Dropout.cpp``, torch 2.13) takes the fused kernel where
``is_fused_kernel_acceptable`` holds (a CUDA input, 0 < p < 1): ``native_dropout`` returns the
output and a bool mask, and its backward (``native_dropout_backward``) keeps the mask alone and
allocates the gradient. Elsewhere (CPU) it is the composite ``_dropout_impl``:
``input * (empty_like(input).bernoulli_(1 - p).div_(1 - p))``, the noise in the input's dtype,
kept by the product for the input's gradient. The CPU form is checked against the bundled
trainer on CPU (tests/unit/test_timeline_lora_variants.py); the CUDA form comes from the
source, not from a trace.
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor


def dropout(tape: Tape, x: Tensor, cuda: bool) -> Tensor:
    """``F.dropout(x, p, training=True)`` with 0 < p < 1: CUDA's fused kernel or CPU's composite."""
    if not cuda:
        noise = tape.new(x.numel, x.itemsize, "dropout_noise")
        out = ops.mul(tape, x, noise, "dropout")
        tape.done(noise)
        return out
    return native_dropout(tape, x)


def native_dropout(tape: Tape, x: Tensor) -> Tensor:
    """``native_dropout`` (``cuda/Dropout.cu``): the output, then a bool mask (1 B an element),
    the mask saved; its backward allocates the gradient alone."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, "grad")]

    node = tape.node("dropout", apply, [x])
    out = ops.result(tape, numel, itemsize, "dropout", node)
    mask = tape.new(numel, 1, "dropout_mask")
    if node is not None:
        tape.save(node, mask)
    tape.done(mask)
    return out
