"""``bf16-master``'s optimizer step: AdamW on fp32 master copies of the bf16 parameters.

``memplan.train.parallel.MasterAdamW.step`` as allocations (one rank, no offload, ``params``
in ``model.parameters()`` order, the local elements of each):

- first step, per parameter in order: ``p.detach().float()`` (an fp32 temporary), its
  ``.clone()`` (the master, kept), the temporary freed, then ``exp_avg`` and ``exp_avg_sq``
  (``zeros_like(master)``, fp32). The step counter is a CPU tensor: nothing on the GPU;
- every step: ``grads = [p.grad.float() for p in params]`` (every fp32 gradient copy alive
  together), then the functional ``adamw(..., foreach=True)``: ``torch._foreach_sqrt`` of the
  second moments (one fp32 temporary per parameter, ``_multi_tensor_adam``), the in-place
  updates, the temporaries freed last first; ``del grads`` frees the copies last first
  (CPython's list deallocation); ``torch._foreach_copy_`` into the bf16 parameters allocates
  nothing.

Trace ``h200_a_master1b`` (Llama-3.2-1B-shaped, tied embedding; events of the first step):
5627-5632 the embedding's 1,050,673,152 B float, clone, free, exp_avg, exp_avg_sq; 6560-6792
the 1,050,673,152 B embedding gradient copy then every layer's (67,108,864 B for a
2048 x 8192 matrix, 8,192 B for a norm); 6793-7022 the square roots; 7025-7315 their frees
from the last parameter to the embedding; then the copies' frees, in the same order.
"""

from __future__ import annotations

from collections.abc import Collection

from memplan.costmodel.timeline.autograd import Tape
from memplan.costmodel.timeline.events import Category

FP32 = 4


class MasterAdamW:
    """The masters and AdamW's two moments (kept across steps), and the step's temporaries."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.states: list[int] = []  # the masters' and moments' allocation ids (:meth:`create`)

    def step(
        self,
        params: list[tuple[str, int]],
        first: bool,
        fp32: Collection[str] = (),
        grads: dict[str, int] | None = None,
    ) -> None:
        """One ``optimizer.step()`` over ``params`` (name, local elements); those named in ``fp32``
        (LoRA's adapters beside a ``modules_to_save`` copy) are their own masters
        (``p.detach()``) and their gradients' ``.float()`` is the gradient itself; ``grads``: the
        elements of a gradient that differs from its parameter's (``p.grad.float()`` copies the
        gradient: under TP without FSDP2 the embedding's is the whole vocabulary's,
        ``ops.embedding``)."""
        t = self.tape
        if first:
            self.create(params, fp32)
        sizes, temp = grads or {}, Category.OPTIMIZER_TEMP
        copies = [(sizes.get(name, n) * FP32, f"{name}.grad_fp32") for name, n in params if name not in fp32]
        grads_fp32 = t.temporaries(copies, temp)
        roots = t.temporaries([(n * FP32, f"{name}.sqrt_tmp") for name, n in params], temp)
        t.release(roots)
        t.release(grads_fp32)

    def create(self, params: list[tuple[str, int]], fp32: Collection[str] = ()) -> None:
        """The first step's masters and moments, per parameter in order (module docstring): kept as
        their allocations' ids (nothing reads them as tensors; ``Tape.temporaries``' way, without a
        ``Tensor`` and ``Storage`` each: ~1,000 of them under bf16-master, a Python object apiece)."""
        t = self.tape
        alloc, free, states = t.b.alloc, t.b.free, Category.OPTIMIZER_STATES
        prefix = f"{t.scope}." if t.scope else ""
        for name, n in params:
            size, tag = n * FP32, prefix + name
            if name not in fp32:
                upcast = alloc(size, Category.ACTIVATIONS, f"{tag}.float")
                self.states.append(alloc(size, states, f"{tag}.master"))
                free(upcast)
            self.states.append(alloc(size, states, f"{tag}.exp_avg"))
            self.states.append(alloc(size, states, f"{tag}.exp_avg_sq"))
