"""Eager attention (``attention: eager``): the bundled trainer's ``_eager_attention``, op by op.

``memplan/train/model.py`` (transformers' eager path, scores materialised) on (b, heads, s, d) ``q``
and unrepeated ``k``, ``v``:

    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)    # GQA: to q's heads
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return probs @ v

Autograd records each op (``tools/autograd/derivatives.yaml``): ``repeat_interleave`` is
``unsqueeze``, ``expand`` and a contiguous ``clone`` (``aten/src/ATen/native/Repeat.cpp``), its
backward a sum over the groups; ``matmul`` folds the batch dims to ``bmm``
(``aten/src/ATen/native/LinearAlgebra.cpp``, ``_matmul_impl``): ``q``, laid out as RoPE left it, is
cloned contiguous first (a key or value that is not repeated too), and ``bmm`` saves both inputs;
the division by a Python scalar saves nothing; ``masked_fill`` saves the mask; ``softmax(dtype=
float32)`` of a 16-bit input converts it first (``toType``; CUDA's half-to-float shortcut is fp16's
only) and saves its fp32 result, whose 16-bit cast ``probs`` the second ``bmm`` saves. The frame's
locals go as it returns (k, v, scores, mask, probs: what no node saved). The fold is a view when
the (b, heads) dims merge: a contiguous operand, or one of a single sequence or head
(``_batched``; CPU, torch 2.13: at b = 1 RoPE's q and an unrepeated k fold as views).

Under autocast (bf16-mixed without FSDP2: ``torch.autocast`` around the forward) RoPE's product
with the fp32 tables makes q and k fp32 (type promotion; v stays the linear's bf16), so k is
repeated in fp32. ``matmul`` is on autocast's lower-precision list (``ATen/autocast_mode.h``,
``AT_FORALL_LOWER_PRECISION_FP``, registered for CUDA and CPU): its wrapper casts each fp32
operand to a bf16 tensor of the same strides (``cached_cast``: no cache, not a leaf),
``k.transpose(-1, -2)`` before ``q`` (the wrapper's ``cached_cast(...)...`` arguments, evaluated
right to left by GCC's builds: the aten log on CPU shows k's ``_to_copy`` first, as the H200
traces show SDPA's k cast before q's), and ``bmm`` saves the casts' folds; the casts' backward
(ToCopyBackward0) is the gradient cast back to fp32, q's first (its node is the later one).
``softmax(-1, dtype=float32)`` runs as without autocast (``AT_FORALL_FP32_SET_OPT_DTYPE``:
an explicit dtype is kept); ``.to(q.dtype)`` is then a no-op (q is fp32) and ``probs @ v`` casts the fp32
probabilities to bf16 (saved) while v passes as it is: the same bytes saved as in bf16, with an
fp32 s x s gradient cast in the backward. A selective checkpoint's re-run restores the forward's
autocast state (``torch.utils.checkpoint``), so the re-run casts too (``trainer_model.core``).

CUDA only, from source (left out of the CPU comparison): the softmax backward's ``grad * output``
temporary (``softmax_backward_cuda_out``, as on the math path: ``precision._safe_softmax``).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor

SOFTMAX_TMP = "grad_times_output"  # CUDA's softmax backward temporary


def _masked_fill(tape: Tape, x: Tensor, mask: Tensor, tag: str) -> Tensor:
    """``x.masked_fill(mask, -inf)``: saves the mask; backward ``grad.masked_fill(mask, 0)``."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, "grad")]

    return ops.result(tape, numel, itemsize, tag, tape.node(tag, apply, [x], saved=[mask]))


def _softmax(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``_softmax(x, -1)``: saves its result. Backward (``_softmax_backward_data``): the
    gradient, then CUDA's ``grad * output`` temporary, freed."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        out = tape.new(numel, itemsize, "grad")
        tape.drop(tape.new(numel, itemsize, SOFTMAX_TMP))
        return [out]

    node = tape.node(tag, apply, [x])
    out = ops.result(tape, numel, itemsize, tag, node)
    if node is not None:
        tape.save(node, out)
    return out


def _repeated(tape: Tape, x: Tensor, groups: int, numel: int, tag: str) -> Tensor:
    """``x.repeat_interleave(groups, 1)`` (a contiguous copy), or ``x`` itself for one group."""
    return prec._repeat_heads(tape, x, numel, tag) if groups > 1 else tape.alias(x)


def _batched(tape: Tape, x: Tensor, folds: bool, tag: str) -> Tensor:
    """``matmul``'s fold of a (b, heads, ...) operand to (b heads, ...) (``reshape``): a view of
    a contiguous one, or of one laid out (b, s, heads, d) when the fold is a view there too
    (``folds``: one sequence or one head, whose dims then merge), else a contiguous clone (its
    gradient goes back as a view)."""
    return prec._contiguous(tape, x, tag, copy_grad=False) if x.transposed and not folds else tape.alias(x)


def _view(tape: Tape, raw: Tensor, tag: str) -> Tensor:
    """``_unsafe_view`` of the scores' ``bmm``: its gradient comes contiguous, a view back."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.view(g[0])]

    out = tape.view(raw)
    out.fn = tape.node(tag, apply, [raw])
    tape.done(raw)
    return out


def _cast(tape: Tape, x: Tensor, autocast: bool, tag: str) -> Tensor:
    """Autocast's ``cached_cast`` of a ``matmul`` operand to bf16 (a new tensor of ``x``'s
    layout for an fp32 one, ``x`` itself for a bf16 one; no cache: not a leaf), or ``x``."""
    return ops.to(tape, x, 2, tag) if autocast else tape.alias(x)


def attention(
    tape: Tape, q: Tensor, k: Tensor, v: Tensor, b: int, heads: int, s: int, autocast: bool = False
) -> Tensor:
    """``_eager_attention`` on (b, heads, s, d) ``q`` and unrepeated ``k``, ``v``; returns
    ``probs @ v`` (its ``_unsafe_view``: the caller's transposed reshape is a copy). Under
    ``autocast`` (bf16-mixed) each ``matmul`` casts its operands first (``_cast``)."""
    n, groups, scores_numel = q.numel, q.numel // k.numel, b * heads * s * s
    kx = _repeated(tape, k, groups, n, "eager.k_repeated")
    vx = _repeated(tape, v, groups, n, "eager.v_repeated")
    k2 = _cast(tape, kx, autocast, "eager.k_autocast")  # the wrapper casts its last operand first
    q2 = _cast(tape, q, autocast, "eager.q_autocast")
    folds = b == 1 or heads == 1  # strides (s h d, d, h d, 1): b and heads merge only then
    qc, kc = _batched(tape, q2, folds, "eager.q_contiguous"), _batched(tape, k2, folds, "eager.k_contiguous")
    raw = prec._bmm(tape, qc, kc, scores_numel, "eager.scores")
    tape.done(kc, qc, q2, k2)  # matmul's folds, then the wrapper's casts
    raw = _view(tape, raw, "eager.scores_view")
    scores = prec._scaled(tape, raw, scores_numel, "eager.scaled")
    tape.done(raw)  # the matmul's result, a temporary of the statement
    ones = tape.new(s * s, 1, "eager.mask_ones")
    mask = tape.new(s * s, 1, "eager.mask")
    tape.done(ones)
    masked = _masked_fill(tape, scores, mask, "eager.masked")
    tape.done(scores)
    converted = ops.to(tape, masked, 4, "eager.scores_fp32")
    soft = _softmax(tape, converted, "eager.softmax")
    tape.done(converted)
    probs = ops.to(tape, soft, q.itemsize, "eager.probs")
    tape.done(soft)
    v2 = _cast(tape, vx, autocast, "eager.v_autocast")
    p2 = _cast(tape, probs, autocast, "eager.probs_autocast")
    vc = _batched(tape, v2, folds, "eager.v_contiguous")
    raw = prec._bmm(tape, p2, vc, n, "eager.out")
    tape.done(vc, p2, v2)
    out = prec._unsafe_view(tape, raw, "eager.out_view")
    tape.done(kx, vx, masked, mask, probs)  # the frame's locals: k, v, scores, mask, probs
    return out
