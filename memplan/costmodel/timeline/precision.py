"""fp32 attention on CUDA: SDPA's math path, op by op.

In fp32 ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` has no
fused kernel on CUDA (flash and cuDNN take 16-bit only, memory-efficient no ``enable_gqa``:
``attention.sdpa_backend``), so torch 2.11 runs the composite
``_scaled_dot_product_attention_math`` (``aten/src/ATen/native/transformers/attention.cpp``):

    query = q * sqrt(scale)
    mask = where(ones(s, s, bool).tril().logical_not(), -inf, 0.0)       # (s, s) in q's dtype
    k_exp, v_exp = repeat_interleave(k), repeat_interleave(v)             # GQA: to q's heads
    attn = matmul(query, k_exp.transpose(-2, -1) * sqrt(scale)); attn.add_(mask)
    attn = _safe_softmax(attn, -1)
    return matmul(attn, v_exp), attn

``matmul`` folds to ``bmm``: ``query`` (laid out as RoPE left it, ``(b, s, heads, d)`` in
memory) is cloned contiguous first; the key side reshapes as a view. Autograd records every op
(graph read on CPU with torch 2.13). The caller's ``out.transpose(1, 2).reshape(b, s, -1)`` is a
copy (the fused kernels return that layout, the math path does not).

Trace ``h200_a_fp32full`` (Llama-3.2-1B-shaped, b 2, s 4096, 32 heads / 8 KV, head_dim 64, full
recompute), the first layer's forward: 315 ``query`` (67,108,864 B), 316-328 the mask (16 MiB
bool ones and tril, two 4 B scalars, the 64 MiB fp32 mask), 329-332 ``k_exp``, ``v_exp``, the
scaled key, the query's clone, 334 the scores (4 GiB), 336-338 the clone and the scaled key
freed, 340 the probabilities (4 GiB), 342-350 ``_safe_softmax``'s ``eq(-inf)`` (1 GiB bool),
its row ``all`` (b heads s bool) and a 4 B zero, freed, 352 the scores freed, 353 the output,
355-361 ``k_exp``, ``v_exp``, ``query`` and the mask freed, 363 the probabilities, 364 the
transposed copy. Its recompute (2787-2824) keeps the clone, the scaled key, ``v_exp`` and the
probabilities for the backward (2941-2980).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor

SCALAR = 4  # at::scalar_tensor in fp32


def _scaled(tape: Tape, x: Tensor, numel: int, tag: str) -> Tensor:
    """``x * c`` for a Python scalar ``c`` (MulBackward1: saves nothing; its gradient is
    ``grad * c``, a new tensor)."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, x.itemsize, "grad")]

    return ops.result(tape, numel, x.itemsize, tag, tape.node(tag, apply, [x]))


def _repeat_heads(tape: Tape, x: Tensor, numel: int, tag: str) -> Tensor:
    """``x.unsqueeze(2).expand(..., groups, ...).clone().view(...)``: a copy with every KV head
    repeated; backward sums the gradient over the groups into a tensor of ``x``'s size."""
    small = x.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(small, x.itemsize, "grad_sum_groups")]

    return ops.result(tape, numel, x.itemsize, tag, tape.node(tag, apply, [x]))


def _contiguous(tape: Tape, x: Tensor, tag: str, copy_grad: bool) -> Tensor:
    """A layout copy (``clone`` inside ``matmul``, ``reshape`` of a transposed tensor). Its
    gradient is reshaped back: a copy when it arrives in the other layout (``copy_grad``), else
    a view."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        if copy_grad:
            return [tape.new(g[0].numel, g[0].itemsize, "grad_contiguous")]
        return [tape.view(g[0])]

    return ops.result(tape, x.numel, x.itemsize, tag, tape.node(tag, apply, [x]))


def _bmm(tape: Tape, a: Tensor, b: Tensor, out_numel: int, tag: str) -> Tensor:
    """``bmm(a, b)``: saves each input the other's gradient needs (before its output): a only where b
    requires grad, b only where a does (BmmBackward0's ``should_compute_output``: a frozen key under
    LoRA keeps no query, tests/unit/test_timeline_hf_peft_families.py). Backward: b's gradient, then a's."""
    an, bn = a.numel, b.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        gb = tape.new(bn, b.itemsize, "grad_mat2") if node.nexts[1] is not None else None
        ga = tape.new(an, a.itemsize, "grad_self") if node.nexts[0] is not None else None
        return [ga, gb]

    saved = ([a] if b.fn is not None else []) + ([b] if a.fn is not None else [])
    node = tape.node(tag, apply, [a, b], saved=saved)
    return ops.result(tape, out_numel, a.itemsize, tag, node)


def _causal_mask(tape: Tape, s: int, itemsize: int) -> Tensor:
    """``ones(s, s, bool).tril()``, then ``convert_boolean_attn_mask``: ``where(~m, -inf, 0)``
    over two scalar tensors (traces 316-328)."""
    ones = tape.new(s * s, 1, "mask_ones")
    tril = tape.new(s * s, 1, "mask_tril")
    tape.done(ones)
    neg, zero = tape.new(1, SCALAR, "mask_neg_inf"), tape.new(1, SCALAR, "mask_zero")
    mask = tape.new(s * s, itemsize, "mask")
    tape.done(zero, neg, tril)
    return mask


def _safe_softmax(tape: Tape, x: Tensor, rows: int, tag: str) -> Tensor:
    """``_safe_softmax(x, -1)``: the softmax (saved), ``x.eq(-inf)`` (bool), its ``all`` over
    the rows (bool) and a zero scalar, which zero fully masked rows in place. Backward
    (``softmax_backward_cuda_out``): the gradient, then ``tmp = grad * output``, freed."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        out = tape.new(numel, itemsize, "grad")
        tape.drop(tape.new(numel, itemsize, "grad_times_output"))
        return [out]

    node = tape.node(tag, apply, [x])
    out = ops.result(tape, numel, itemsize, tag, node)
    if node is not None:
        tape.save(node, out)
    masked = tape.new(numel, 1, f"{tag}.masked")
    masked_rows = tape.new(rows, 1, f"{tag}.masked_rows")
    zero = tape.new(1, SCALAR, f"{tag}.zero")
    tape.done(zero, masked_rows, masked)
    return out


def _unsafe_view(tape: Tape, raw: Tensor, tag: str) -> Tensor:
    """``_unsafe_view`` of a ``bmm`` result: no allocation; its backward reshapes the gradient,
    a copy when the gradient arrives transposed (the caller's ``transpose(1, 2)``)."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(g[0].numel, g[0].itemsize, "grad_reshape")]

    out = tape.view(raw)
    out.fn = tape.node(tag, apply, [raw])
    tape.done(raw)
    return out


def math_sdpa(tape: Tape, q: Tensor, k: Tensor, v: Tensor, b: int, heads: int, s: int) -> Tensor:
    """SDPA's math path on (b, heads, s, d) ``q`` and unrepeated ``k``, ``v``; returns the
    output (its ``_unsafe_view``). The freed tensors follow the trace's order (355-363)."""
    n, scores = q.numel, b * heads * s * s
    query = _scaled(tape, q, n, "sdpa_math.query")
    mask = _causal_mask(tape, s, q.itemsize)
    k_exp = _repeat_heads(tape, k, n, "sdpa_math.k_exp")
    v_exp = _repeat_heads(tape, v, n, "sdpa_math.v_exp")
    key = _scaled(tape, k_exp, n, "sdpa_math.key_t")
    # ``k_exp.transpose(-2, -1) * c`` keeps the transpose's strides (TensorIterator), and ``bmm``
    # takes it as a strided mat2 and saves it so: activation offload stages it (act_offload.pack)
    key.transposed = True
    qc = _contiguous(tape, query, "sdpa_math.query_contiguous", copy_grad=False)
    attn = _bmm(tape, qc, key, scores, "sdpa_math.scores")
    tape.done(qc, key)  # matmul's clone, then the statement's temporary
    probs = _safe_softmax(tape, attn, b * heads * s, "sdpa_math.probs")
    tape.done(attn)
    raw = _bmm(tape, probs, v_exp, n, "sdpa_math.out")
    out = _unsafe_view(tape, raw, "sdpa_math.out_view")
    tape.done(k_exp, v_exp, query, mask, probs)
    return out


def merge_heads(tape: Tape, out: Tensor) -> Tensor:
    """``out.transpose(1, 2).reshape(b, s, -1)`` of the math path's (b, heads, s, d) output: a
    copy (trace 364); its gradient goes back as a transposed view."""
    return _contiguous(tape, out, "merge_heads", copy_grad=False)
