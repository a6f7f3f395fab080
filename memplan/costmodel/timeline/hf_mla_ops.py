"""The aten ops of DeepSeek-V3's layer (``hf_mla.py``) on the byte-level tape: what each allocates forward,
what it saves, and what its backward allocates (``derivatives.yaml``, ``FunctionsManual.cpp``,
``torch/csrc/autograd/functions/tensor.cpp``; observed on CPU with ``tests/accuracy/alloc_log.py``, torch 2.13).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.hf_moe_ops import zeros_then_put


def sub(tape: Tape, a: Tensor, b: Tensor, tag: str) -> Tensor:
    """``a - b``: saves nothing; a's gradient passes, b's is the negated one (a new tensor)."""
    numel, itemsize = max(a.numel, b.numel), max(a.itemsize, b.itemsize)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        neg = tape.new(g[0].numel, g[0].itemsize, "grad_neg") if node.nexts[1] is not None else None
        return [tape.hold(g[0]) if node.nexts[0] is not None else None, neg]

    meta = [(a.numel, a.itemsize, False), (b.numel, b.itemsize, False)]
    return ops.result(tape, numel, itemsize, tag, tape.node(tag, apply, [a, b], meta=meta))


def scalar_mul(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``x * c`` for a Python float (MulBackward1: saves nothing; backward ``grad * c``)."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, "grad")]

    return ops.result(tape, numel, itemsize, tag, tape.node(tag, apply, [x]))


def gather(tape: Tape, x: Tensor, idx: Tensor, out_numel: int, tag: str) -> Tensor:
    """``x.gather(1, idx)``: saves x and the index (derivatives.yaml, ``gather``: ``self:
    gather_backward(grad, self, dim, index, sparse_grad)`` names ``self``: ``GatherBackward0._saved_self``); the
    router's ``scores`` are then saved twice, by ``sigmoid`` and here: one storage held, but two host copies
    under ``save_on_cpu``); backward ``gather_backward`` (FunctionsManual.cpp): zeros of x's shape and
    ``scatter_add_`` into them, out of place under a dispatch mode (``zeros_then_put``)."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [zeros_then_put(tape, numel, itemsize, "scatter_add")]

    return ops.result(tape, out_numel, itemsize, tag, tape.node(tag, apply, [x], saved=[x, idx]))


def expand_heads(tape: Tape, x: Tensor, numel: int, tag: str) -> Tensor:
    """``x.expand(-1, heads, -1, -1)`` of a one-head tensor: a view; backward (ExpandBackward0) the
    gradient summed back to x's size (``sum_to_size``, a new tensor)."""
    small, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(small, itemsize, "grad_sum_to")]

    v = tape.view(x, numel)
    v.fn = tape.node(tag, apply, [x])
    return v


def copy_slices(tape: Tape, k_nope: Tensor, k_rot: Tensor, numel: int) -> Tensor:
    """``key_states = kv_nope.new_empty(...)``, then ``key_states[..., :nope].copy_(k_nope)`` and
    ``key_states[..., nope:].copy_(k_rot)``: the new tensor (no gradient) under two ``CopySlices``.
    Backward of each (``CopySlices::apply_impl``, torch/csrc/autograd/functions/tensor.cpp): the base's
    gradient (``new_empty_strided`` of the key's size and a ``copy_`` of the incoming one), a contiguous
    clone of the slice handed to ``CopyBackwards`` (whose source gradient is that clone, ``to`` of one
    dtype returning it), and where the base before the copy takes a gradient (the second copy's: the
    first one's output) ``zeros_like`` of the slice, copied into the base's gradient and freed."""
    itemsize = k_nope.itemsize

    def node(src: Tensor, base: Tensor | None, tag: str) -> Node | None:
        part = src.numel

        def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
            base_grad = tape.new(numel, itemsize, f"{tag}.grad_base")
            clone = tape.new(part, itemsize, f"{tag}.grad_slice_clone")
            zeros = tape.new(part, itemsize, f"{tag}.zeros_like") if node.nexts[0] is not None else None
            if src.itemsize != itemsize:  # ``grad.to(src_options)``: an fp32 source's (RoPE's under autocast)
                cast = tape.new(part, src.itemsize, f"{tag}.grad_src_cast")
                tape.drop(clone)
                clone = cast
            tape.drop(zeros)
            if node.nexts[0] is None:
                tape.drop(base_grad)
                base_grad = None
            return [base_grad, clone]

        return tape.node(tag, apply, [base, src])

    key = tape.new(numel, itemsize, "key_states")
    key.fn = node(k_nope, None, "copy_nope")
    key.fn = node(k_rot, key, "copy_rope")
    return key


def math_sdpa(tape: Tape, q: Tensor, k: Tensor, v: Tensor, b: int, heads: int, s: int) -> Tensor:
    """``_scaled_dot_product_attention_math`` on CPU over (b, heads, s, qk) ``q`` and ``k`` and (b, heads,
    s, v) ``v`` without GQA (``precision.math_sdpa``'s ops; CPU log, torch 2.13): 16-bit inputs cast to
    fp32 first (q, k, v), the scaled query, the causal mask in fp32, the scaled transposed key, the
    scores, the masked scores (an out-of-place ``add``), the softmax (one op), in 16 bits the
    probabilities' cast the composite returns beside the output (dropped by SDPA), the values made
    contiguous (a slice of ``kv_b_proj``'s output), their product, in 16 bits its cast back (the fp32
    product freed as the cast returns); returns the output."""
    scores, dtype = b * heads * s * s, q.itemsize
    q32, k32, v32 = (ops.to(tape, x, 4, f"sdpa_math.{n}_fp32") for x, n in ((q, "q"), (k, "k"), (v, "v")))
    query = prec._scaled(tape, q32, q.numel, "sdpa_math.query")
    mask = prec._causal_mask(tape, s, 4)
    key = prec._scaled(tape, k32, k.numel, "sdpa_math.key_t")
    key.transposed = True
    attn = bmm(tape, query, key, scores, "sdpa_math.scores")
    tape.done(key)
    masked = ops.add(tape, attn, mask, "sdpa_math.masked")
    tape.done(attn)
    probs = ops.output_saved(tape, masked, "sdpa_math.probs", "softmax_backward")
    tape.done(masked)
    returned = tape.new(scores, dtype, "sdpa_math.attn_cast") if dtype != 4 else None  # attn.to(origin_dtype)
    values = prec._contiguous(tape, v32, "sdpa_math.values_contiguous", copy_grad=False)
    raw = bmm(tape, probs, values, v.numel, "sdpa_math.out")
    tape.done(values)
    out32 = prec._unsafe_view(tape, raw, "sdpa_math.out_view")
    out = ops.to(tape, out32, dtype, "sdpa_math.out_cast")
    tape.done(out32)
    tape.done(mask, v32, k32, q32, returned, query, probs)
    return out


def bmm(tape: Tape, a: Tensor, b: Tensor, out_numel: int, tag: str) -> Tensor:
    """``bmm(a, b)`` (``precision._bmm``) saving each input only for the other's gradient (BmmBackward0:
    ``self`` where ``mat2`` takes a gradient, ``mat2`` where ``self`` does): under LoRA on kv_b_proj alone
    the first layer's frozen queries take none, and the scaled key goes as the product returns."""
    an, bn = a.numel, b.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        gb = tape.new(bn, b.itemsize, "grad_mat2") if node.nexts[1] is not None else None
        ga = tape.new(an, a.itemsize, "grad_self") if node.nexts[0] is not None else None
        return [ga, gb]

    saved = ([b] if a.fn is not None else []) + ([a] if b.fn is not None else [])  # mat2 packed first
    node = tape.node(tag, apply, [a, b], saved=saved)
    return ops.result(tape, out_numel, a.itemsize, tag, node)
