"""The aten ops of transformers' MoE block (``hf_moe.py``) on the byte-level tape: what each allocates
forward, what it saves, and what its backward formula allocates (``derivatives.yaml``,
``FunctionsManual.cpp``; observed on CPU with ``tests/accuracy/alloc_log.py``).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor

INDEX = 8  # int64 ids, permutations and indices
GROUPED_MM_ARGS = "grouped_mm_args"  # CUDA only: the CUTLASS kernel's argument buffer


def sort(tape: Tape, n: int) -> tuple[Tensor, Tensor]:
    """``torch.sort`` of n int64 ids (no gradient): the values, then the permutation."""
    return tape.new(n, INDEX, "sort.values"), tape.new(n, INDEX, "sort.indices")


def zeros_then_put(tape: Tape, numel: int, itemsize: int, op: str) -> Tensor:
    """A backward that zeroes its input's shape and writes the gradient in (``index_backward``:
    ``index_put_``, ``value_selecting_reduction_backward``: ``scatter_``; FunctionsManual.cpp): in place,
    but out of place into a second buffer under a dispatch mode (``Tape.subclass_like``: the CPU
    tracker's; the zeros go as the op returns)."""
    zeros = tape.new(numel, itemsize, "new_zeros")
    if not tape.subclass_like:
        return zeros
    out = tape.new(numel, itemsize, op)
    tape.drop(zeros)
    return out


def index_rows(tape: Tape, x: Tensor, idx: Tensor, out_numel: int, tag: str) -> Tensor:
    """``x[idx]``: IndexBackward0 saves ``idx``; backward ``new_zeros`` of x's shape, then
    ``index_put_(accumulate=True)`` (``zeros_then_put``)."""
    numel = x.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [zeros_then_put(tape, numel, g[0].itemsize, "index_put")]

    node = tape.node(tag, apply, [x], saved=[idx])
    return ops.result(tape, out_numel, x.itemsize, tag, node)


def cutlass_args_bytes(experts: int) -> int:
    """The argument buffer CUDA's bf16 grouped GEMM allocates per call (``GroupMM.cu``,
    ``bf16bf16_grouped_gemm_impl_sm90_sm100``: ``input_args_size`` = A, B and output pointers over
    the group count rounded up to 2, the problem shapes (3 int32 each) and three 8-byte strides per
    group), freed as the call returns."""
    return -(-experts // 2) * 2 * 3 * 8 + experts * 12 + 3 * experts * 8


def grouped_mm(tape: Tape, x: Tensor, w: Tensor, offs: Tensor, out_numel: int, tag: str, args: int = 0) -> Tensor:
    """``F.grouped_mm(x, w.transpose(-2, -1), offs=offs)``: saves the offsets and x (and w), x only
    where w takes a gradient. Backward:
    the weight's gradient (E x n x k, reaching ``.grad`` through the transpose's view), then x's.
    ``args``: the bytes of CUDA's CUTLASS argument buffer each call allocates after its output and
    frees (``cutlass_args_bytes``; 0 on the CPU and on CUDA's fallback, ``_grouped_mm_fallback``'s
    ``mm_out`` into slices of the output, which allocates nothing on the device)."""
    x_numel, w_numel = x.numel, w.numel

    def scratch(tape: Tape) -> None:
        if args:
            tape.drop(tape.new(args, 1, GROUPED_MM_ARGS))

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        itemsize = g[0].itemsize
        dw = tape.new(w_numel, itemsize, "dW", ops.grad_category(w)) if node.nexts[1] is not None else None
        if dw is not None:
            dw.view = True
            scratch(tape)
        dx = tape.new(x_numel, itemsize, "dX") if node.nexts[0] is not None else None
        if dx is not None:
            scratch(tape)
        return [dx, dw]

    # derivatives.yaml ``_grouped_mm``: self's formula reads mat2, mat2's reads self; the generated kernel
    # saves self only where mat2's gradient is computed (a frozen expert's, under PEFT: not)
    # and mat2 where self's is: a parameter is held anyway, a parametrized weight (hf_moe_lora.py) is not; under
    # saved-tensor hooks (save_on_cpu, act_offload.py) outside a checkpoint the parameter's save is packed too;
    # mat2 is ``w.transpose(-2, -1)``, a non-contiguous view (TRL's hooks clone it before the copy: hf_offload.py)
    packed = tape.hooks is not None and tape.region is None and not tape.recomputing
    keep_w = [ops._transpose(w)] if x.fn is not None and (not w.st.managed or packed) else []
    # packed in the generated kernel's order (TRL's tensor ids): mat2, offs, self
    node = tape.node(tag, apply, [x, w], saved=[*keep_w, offs, *([x] if w.fn is not None else [])])
    out = ops.result(tape, out_numel, x.itemsize, tag, node)
    scratch(tape)
    return out


def reshape_copy(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``x.view(T, k, h)`` under ``.sum(dim=1)``: the sum's gradient is expanded over k, and
    ViewBackward0's reshape of it to S x h copies."""
    numel = x.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, g[0].itemsize, "grad_reshape_copy")]

    v = tape.view(x)
    v.fn = tape.node(tag, apply, [x])
    return v


def row_sum(tape: Tape, x: Tensor, out_numel: int, tag: str) -> Tensor:
    """``x.sum(dim, keepdim)`` to ``out_numel`` elements: saves nothing; backward an expanded view
    of the gradient."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.view(g[0])]

    return ops.result(tape, out_numel, x.itemsize, tag, tape.node(tag, apply, [x]))


def renormalise(tape: Tape, values: Tensor, tokens: int, eps: bool = False) -> Tensor:
    """``values /= values.sum(dim=-1, keepdim=True)``: the sum (T), then ``div_``, whose autograd
    kernel saves a clone of ``values`` and the sum. Backward (DivBackward0, CPU log): the other's
    gradient ``-grad * ((self / other) / other)`` (two quotients, the negation, the product), then
    the values' ``grad / other``, then the product summed to T; returns the values with the node.
    ``eps``: the divisor is ``sum + 1e-20`` (DeepSeek-V3's router, ``hf_mla.py``), the sum a temporary."""
    numel, itemsize = values.numel, values.itemsize
    total = row_sum(tape, values, tokens, "topk_sum")
    if eps:
        total, summed = ops.unary(tape, total, "add_eps", temps=-1), total
        tape.done(summed)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        q1, q2 = tape.new(numel, itemsize, "div"), tape.new(numel, itemsize, "div")
        neg = tape.new(numel, itemsize, "neg")
        prod = tape.new(numel, itemsize, "mul")
        for t in (neg, q2, q1):
            tape.drop(t)
        grad_self = tape.new(numel, itemsize, "grad_self")
        grad_other = tape.new(tokens, itemsize, "grad_other_sum")
        tape.drop(prod)
        return [grad_self, grad_other]

    node = tape.node("renormalise", apply, [values, total])
    if node is not None:
        clone = tape.new(numel, itemsize, "div_.self_clone")
        tape.save(node, clone)
        tape.done(clone)
        tape.save(node, total)
    tape.done(total)
    values.fn = node
    return values


def topk(tape: Tape, probs: Tensor, tokens: int, k: int) -> tuple[Tensor, Tensor]:
    """``torch.topk(probs, k)``: fp32 values, int64 indices (saved). Backward: ``new_zeros`` of
    probs' shape, then ``scatter_`` (``zeros_then_put``)."""
    numel = probs.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [zeros_then_put(tape, numel, g[0].itemsize, "scatter")]

    node = tape.node("topk", apply, [probs])
    values = ops.result(tape, tokens * k, probs.itemsize, "topk.values", node)
    indices = tape.new(tokens * k, INDEX, "topk.indices")
    if node is not None:
        tape.save(node, indices)
    return values, indices


def softmax(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``softmax(x, -1)``: saves its output; backward ``_softmax_backward_data`` (x's shape)."""
    return ops.output_saved(tape, x, tag, "softmax_backward")
