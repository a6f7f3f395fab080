"""The ops of the bundled trainer's step: what each allocates forward, what it saves, and what
its backward formula allocates (``tools/autograd/derivatives.yaml``), on sizes only.

Each op takes and returns :class:`~memplan.costmodel.timeline.autograd.Tensor` handles; the
caller says when Python drops them (``tape.done``). Inputs are saved before an op's output is
allocated, outputs after it (the generated ``VariableType`` kernels); ``mul`` and ``mm``
compute the last input's gradient first (tests/data/gpu-traces).
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.timeline.autograd import FIRST, Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category

SDPA_SCRATCH = 256  # flash attention's forward scratch allocation (traces)
PHILOX = 8  # the rng seed and offset tensors SDPA returns (traces)
_GRADIENTS, _ACTIVATIONS = Category.GRADIENTS, Category.ACTIVATIONS  # read once: a member on its class is a slow lookup
# CUDA only, from source (act_offload.py: saves unpacked contiguous): flash's backward copy of a
# heads-major output, and the view back of a heads-major dv
FLASH_OUT_COPY, HEADS_MAJOR_COPY = "flash_out_contiguous", "grad_heads_major_copy"


def _is_leaf(t: Tensor | None) -> bool:
    return t is not None and t.fn is not None and t.fn.seq == FIRST


def grad_category(t: Tensor | None) -> Category:
    """A gradient that a leaf will keep is a ``gradients`` allocation."""
    return _GRADIENTS if t is not None and t.fn is not None and t.fn.seq == FIRST else _ACTIVATIONS  # _is_leaf


def result(tape: Tape, numel: int, itemsize: int, tag: str, node: Node | None) -> Tensor:
    """An op's output, its gradient going to ``node``."""
    t = tape.new(numel, itemsize, tag)
    t.fn = node
    return t


def leaf(grads: dict, key: str) -> Node:
    """A parameter's ``AccumulateGrad``: steals the gradient into ``grads[key]``, or adds into
    the one there (a tied weight's second use: the new one is freed)."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        if key not in grads:
            grads[key] = tape.hold(g[0])
        return []

    return Node(FIRST, f"{key}.AccumulateGrad", apply, [])


# --- casts and views ---------------------------------------------------------------------------------
def to(tape: Tape, x: Tensor, itemsize: int, tag: str, category: Category | None = None) -> Tensor:
    """``x.to(dtype)``: ``x`` itself when the dtype does not change. Backward
    (ToCopyBackward0): the gradient cast back to ``x``'s dtype."""
    if x.itemsize == itemsize:
        return tape.alias(x)
    numel, back = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, back, "grad", grad_category(x))]

    t = tape.new(numel, itemsize, tag, category)
    t.fn = tape.node(tag, apply, [x])
    t.transposed = x.transposed  # _to_copy keeps a dense tensor's strides
    return t


def heads_view(tape: Tape, x: Tensor, tag: str, copy_grad: bool, contiguous: bool = False) -> Tensor:
    """``x.view(b, s, -1, hd).transpose(1, 2)``: no allocation. Backward reshapes the
    gradient back; it is a copy when the gradient comes heads-major (RoPE's slice gradients
    for q and k), a view for SDPA's own dv. ``contiguous``: one head or one position (a dim
    of size one has no stride that counts: ``TensorImpl::compute_contiguous``), or the plain
    ``view`` without the transpose: the view is contiguous (TRL's offload does not clone it,
    hf_offload.py), and heads-major memory is token-major memory (no copy back)."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        if copy_grad:
            return [tape.new(g[0].numel, g[0].itemsize, "grad_contiguous")]
        if g[0].heads_major and not contiguous:  # flash's dv off an unpacked v (act_offload.py)
            return [tape.new(g[0].numel, g[0].itemsize, HEADS_MAJOR_COPY)]
        return [tape.view(g[0])]

    v = tape.view(x)
    v.fn = tape.node(tag, apply, [x])
    v.transposed = not contiguous
    return v


# --- matmul --------------------------------------------------------------------------------------------
def linear(tape: Tape, x: Tensor, w: Tensor, out_numel: int, tag: str) -> Tensor:
    """``F.linear(x, w)`` without bias (``matmul`` folded to ``mm``): saves x for dW and w for
    dX, each only when that gradient is needed (a frozen weight keeps no input: the generated
    kernel's ``should_compute_output``). Backward (MmBackward0): dW (w's shape) then dX, a view
    of the 2-D product. dW reaches the weight through ``w.t()``'s TBackward, a transposed view: a
    tied weight's two gradients are then summed out of place (``InputBuffer::accumulate``; traces
    h200_a_master1b 5618-5622 and h200_a_fp32full: the head's dW and the embedding's gradient
    freed after the sum); under autocast the cast's backward makes it a plain tensor first. An
    ``mm`` a selective checkpoint saves is kept in the forward and handed back in the re-run."""
    x_numel, w_numel = x.numel, w.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        itemsize = g[0].itemsize
        dw = tape.new(w_numel, itemsize, "dW", grad_category(w)) if node.nexts[1] is not None else None
        if dw is not None:
            dw.view = True  # TBackward's grad.t()
            if tape.on_first_mm is not None:
                tape.on_first_mm()
        dx = tape.new(x_numel, itemsize, "dX") if node.nexts[0] is not None else None
        if dx is not None:
            dx.view = True  # the 2-D product reshaped back
            if tape.on_first_mm is not None:  # a frozen weight's: the backward's first product
                tape.on_first_mm()
        return [dx, dw]

    saved = ([_transpose(w)] if _needs(x) else []) + ([x] if _needs(w) else [])  # mat2 packed first
    node = tape.node(tag, apply, [x, w], saved=saved)
    kept = tape.cached("mm")
    if kept is not None:
        kept[0].fn = node
        return kept[0]
    out = result(tape, out_numel, x.itemsize, tag, node)
    if tape.on_first_mm is not None:
        tape.on_first_mm()
    tape.keep("mm", [out])
    return out


def _transpose(w: Tensor) -> Tensor:
    """``w.t()``, the ``mat2`` that ``mm`` saves: a transposed view over ``w``'s storage (the node
    that saves it takes the reference)."""
    return Tensor(w.numel, w.itemsize, w.st, view=True, dtensor=w.dtensor, transposed=True)


# --- elementwise ---------------------------------------------------------------------------------------
def mul(tape: Tape, a: Tensor, b: Tensor, tag: str, over_rows: bool = False) -> Tensor:
    """``a * b`` with broadcasting and type promotion. Saves ``a`` for b's gradient and ``b``
    for a's. Backward: ``g * a`` (b's) then ``g * b`` (a's); the engine sums a broadcast one
    down (``over_rows``: ``a`` is a weight vector) and casts each to its input's dtype."""
    numel, itemsize = max(a.numel, b.numel), max(a.itemsize, b.itemsize)
    saved = ([b] if _needs(a) else []) + ([a] if _needs(b) else [])  # MulBackward0 packs other first

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        gb = tape.new(numel, g[0].itemsize, "grad_other") if node.nexts[1] is not None else None
        ga = tape.new(numel, g[0].itemsize, "grad_self") if node.nexts[0] is not None else None
        return [ga, gb]

    meta = [(a.numel, a.itemsize, over_rows), (b.numel, b.itemsize, False)]
    node = tape.node(tag, apply, [a, b], saved=saved, meta=meta)
    return result(tape, numel, itemsize, tag, node)


def _needs(t: Tensor) -> bool:
    return t.fn is not None


def add(tape: Tape, a: Tensor, b: Tensor, tag: str) -> Tensor:
    """``a + b``: saves nothing; the gradient passes to both (cast to each one's dtype)."""
    numel, itemsize = max(a.numel, b.numel), max(a.itemsize, b.itemsize)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.hold(g[0]) if m is not None else None for m in node.nexts]

    meta = [(a.numel, a.itemsize, False), (b.numel, b.itemsize, False)]
    return result(tape, numel, itemsize, tag, tape.node(tag, apply, [a, b], meta=meta))


def unary(tape: Tape, x: Tensor, tag: str, temps: int = 0, save_input: bool = False, out_numel: int = 0) -> Tensor:
    """An elementwise op whose backward allocates ``temps`` temporaries then the gradient:
    ``pow(x, 2)`` (saves x; 2: ``x.pow(1)``, ``2 * that``), ``silu`` (saves x), ``neg``,
    ``+ eps`` (passes the gradient), ``mean(-1)`` (``out_numel``; gradient expanded / N)."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        if temps < 0:
            return [tape.hold(g[0])]
        ts = [tape.new(numel, itemsize, f"grad_tmp{i}") for i in range(temps)]
        out = tape.new(numel, itemsize, "grad")
        for t in reversed(ts):
            tape.drop(t)
        return [out]

    node = tape.node(tag, apply, [x], saved=[x] if save_input else [])
    return result(tape, out_numel or numel, itemsize, tag, node)


def output_saved(tape: Tape, x: Tensor, tag: str, grad_tag: str = "grad") -> Tensor:
    """An op of ``x``'s shape and dtype that saves its result for the backward, whose backward
    allocates the gradient: ``tanh`` (``tanh_backward``), ``softmax(x, -1)``
    (``_softmax_backward_data``)."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, grad_tag)]

    node = tape.node(tag, apply, [x])
    out = result(tape, numel, itemsize, tag, node)
    if node is not None:
        tape.save(node, out)
    return out


def rsqrt(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``torch.rsqrt``: saves its result. Backward ``-0.5 * grad * result.pow(3)``: two
    temporaries, then the gradient."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        t1, t2 = tape.new(numel, itemsize, "grad_tmp0"), tape.new(numel, itemsize, "grad_tmp1")
        out = tape.new(numel, itemsize, "grad")
        tape.drop(t2)
        tape.drop(t1)
        return [out]

    node = tape.node(tag, apply, [x])
    out = result(tape, numel, itemsize, tag, node)
    if node is not None:
        tape.save(node, out)
    return out


def half_slice(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``x[..., half:]`` or ``x[..., :half]``: a view. Backward (SliceBackward0): a zero tensor
    of x's shape with the gradient copied in."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, "grad")]

    v = tape.view(x, x.numel // 2)
    v.fn = tape.node(tag, apply, [x])
    return v


def cat(tape: Tape, a: Tensor, b: Tensor, tag: str) -> Tensor:
    """``torch.cat((a, b), -1)``: backward hands each input a slice (a view) of the gradient."""
    sizes = (a.numel, b.numel)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.view(g[0], n) if m is not None else None for m, n in zip(node.nexts, sizes, strict=True)]

    return result(tape, a.numel + b.numel, a.itemsize, tag, tape.node(tag, apply, [a, b]))


# --- attention -------------------------------------------------------------------------------------------
def sdpa(tape: Tape, q: Tensor, k: Tensor, v: Tensor, lse_numel: int, tag: str) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` (flash): philox seed and
    offset, the output, the fp32 log-sum-exp (b x heads x s), a scratch block. Saves q, k, v,
    out, lse and the seeds. Backward: dq, dk, dv, and one workspace of the fp32 dq accumulator
    twice over plus the fp32 softmax row sums (``2 x b s q x 4 + b heads s x 4 + 256``). A
    selective checkpoint that saves it keeps out, lse and the seeds, and hands them back."""
    qn, kn, vn = q.numel, k.numel, v.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        # an unpacked output is heads-major: ``out.transpose(1, 2).contiguous()`` copies it
        # (``_flash_attention_backward``), and dq, dk, dv follow the unpacked q, k, v's layout
        out_copy = tape.new(qn, q.itemsize, FLASH_OUT_COPY) if saved and not saved[3].transposed else None
        dq, dk, dv = (tape.new(n, q.itemsize, name) for n, name in ((qn, "dq"), (kn, "dk"), (vn, "dv")))
        dv.heads_major = bool(saved) and not saved[2].transposed
        ws = tape.new(2 * qn * 4 + lse_numel * 4 + SDPA_SCRATCH, 1, "workspace")
        tape.drop(ws)
        tape.drop(out_copy)
        return [dq, dk, dv]

    node = tape.node(tag, apply, [q, k, v], saved=[q, k, v])

    def forward() -> list[Tensor]:
        seed, offset = tape.new(1, PHILOX, f"{tag}.philox_seed"), tape.new(1, PHILOX, f"{tag}.philox_offset")
        out = result(tape, qn, q.itemsize, f"{tag}.out", node)
        out.transposed = True  # flash writes (b, s, heads, d) and returns its transpose
        lse = tape.new(lse_numel, 4, f"{tag}.lse")
        scratch = tape.new(SDPA_SCRATCH, 1, f"{tag}.scratch")
        tape.done(scratch)
        return [out, lse, seed, offset]

    return attention_output(tape, node, forward)


def attention_output(tape: Tape, node: Node | None, forward: Callable[[], list[Tensor]]) -> Tensor:
    """An attention kernel's output, and what it keeps for its backward (``forward()``'s list,
    out first): under a selective checkpoint that saved them, the first run's, handed back
    (``tape.cached("sdpa")``); else ``forward()``'s, kept for the recompute. All are saved to
    ``node``, and all but out freed as the composite returns out alone (SDPA's flash and
    memory-efficient kernels, memplan's Triton kernel)."""
    kept = tape.cached("sdpa")
    if kept is not None:
        kept[0].fn = node
    else:
        kept = forward()
        tape.keep("sdpa", kept)
    out, *rest = kept
    try:
        if node is not None:
            for t in kept:
                tape.save(node, t)
    finally:
        tape.done(*rest)
    return out


# --- vocabulary-sized ops --------------------------------------------------------------------------------
def embedding(tape: Tape, ids: Tensor, w: Tensor, numel: int, tag: str, vocab_shards: int = 1) -> Tensor:
    """``F.embedding``: saves the ids. Backward (``embedding_dense_backward_cuda``) over N ids:
    int64 sort buffers and cub's radix-sort scratch (16.25 N + 16895 B, traces), the zeroed
    weight gradient, segment offsets, and fp32 partial sums of ``N + N // 10`` segments
    (N unique ids at most, split every 10 rows) x h. ``vocab_shards``: the vocabulary-parallel
    lookup over ``w``, one of that many row shards, whose DTensor backward runs over the whole
    vocabulary: a ``Replicate`` gradient of every row in the weight's dtype (torch 2.13:
    ``embedding_dense_backward`` with ``num_weights`` V; FSDP2 redistributes it to the weight's
    ``Shard(0)``, ``fsdp.py``). On t8_tp2_x (tp 2, bf16) it and its shard are the two tensors
    read before as an fp32 gradient and its cast, of the same sizes, in the same order."""
    n, h = ids.numel, numel // ids.numel
    parts = n + n // 10
    # cub's scan scratch (traces: N <= 8192 the H100 runs and h200_a_ddp1b, 16384 h200_b_z2_8b, 32768 t1b_full_x)
    scans = (1279, 1279 if n <= 8192 else 1535 if n <= 16384 else 1791)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        def index(k: int, name: str) -> Tensor:
            return tape.new(k, 8, name)

        sorted_ids, order, iota = index(n, "sorted_ids"), index(n, "sort_order"), index(n, "iota")
        tape.drop(tape.new(n * 65 // 4 + 16895, 1, "radix_sort_scratch"))
        tape.drop(iota)
        gw = tape.new(w.numel * vocab_shards, w.itemsize, "grad_weight", grad_category(w))
        held = [index(n, "segment_offsets"), index(1, "num_segments")]
        tmp = index(n, "segment_tmp")
        tape.drop(tape.new(scans[0], 1, "scan_scratch"))
        tape.drop(tmp)
        held += [index(n, "partials_per_segment"), index(n, "partial_offsets")]
        tape.drop(tape.new(scans[1], 1, "scan_scratch"))
        held += [index(1, "num_partials"), index(parts, "partial_segment_offsets")]
        tape.drop(tape.new(parts * h, 4, "grad_weight_per_segment"))
        for t in [*reversed(held), order, sorted_ids]:
            tape.drop(t)
        return [gw]

    node = tape.node(tag, apply, [w], saved=[ids])
    return result(tape, numel, w.itemsize, tag, node)


def log_softmax(tape: Tape, f: Tensor) -> Tensor:
    """``log_softmax`` over the vocabulary: saves its result; backward allocates the gradient."""
    numel = f.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, 4, "grad", Category.LOGITS)]

    node = tape.node("log_softmax", apply, [f])
    out = tape.new(numel, 4, "log_softmax", Category.LOGITS)
    out.fn = node
    if node is not None:
        tape.save(node, out)
    return out


def nll_loss(tape: Tape, ls: Tensor, target: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``nll_loss`` (mean): the loss and total_weight scalars. Saves its input (log_softmax's
    result, which that node holds too) and the ``target`` (the labels, which the step holds too)
    before its output, total_weight after (NllLossBackward0: what ``save_on_cpu`` copies,
    act_offload.py). Backward: a zeroed (b s, V) fp32 gradient with the picked entries set."""
    numel = ls.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, 4, "grad", Category.LOGITS)]

    node = tape.node("nll_loss", apply, [ls], saved=[ls] if target is None else [ls, target])
    out = result(tape, 1, 4, "nll_loss", node)
    weight = tape.new(1, 4, "total_weight")
    if node is not None:
        tape.save(node, weight)
    return out, weight
