"""``attention: triton``: memplan's Triton FlashAttention-2 (``memplan.kernels``), op by op.

The trainer's ``flash_attention(q, k, v, causal=True, backend="triton")``
(``memplan/train/model.py``, ``attention``) on (b, heads, s, d) views of token-major q, k, v,
read off memplan's own source (``kernels/__init__.py``, ``kernels/fused_attention.py``):

Forward. Under ``torch.autocast`` (bf16-mixed without FSDP2) ``_autocast`` casts q, k, v to bf16
in that order (``t.to(dtype)``: the RoPE'd q and k are fp32, v already bf16 from its autocast
linear, a no-op). The ``memplan::flash_attention_forward`` op (``torch.library.triton_op``)
allocates ``out = torch.empty_like(q)`` (q's dtype and token-major strides: the caller's
``out.transpose(1, 2).reshape(b, s, -1)`` is a view), then ``lse = torch.empty((b, heads, s),
float32)``; nothing else (the s x s scores live in registers). Its autograd formula
(``_setup_context``) saves q, k, v, out and lse; ``flash_attention`` returns ``[0]``, so lse lives
on only as a saved tensor. No philox seeds, no scratch (SDPA's flash kernel has both: ``ops.sdpa``).

Backward (``_backward`` through the ``autograd.Function`` that ``register_autograd`` generates,
torch/_library/autograd.py): lse's gradient is undefined, and the Function materialises it as
``zeros`` of lse's shape before calling ``_backward`` (``ctx.materialize_grads`` defaults to
True; CPU dispatch log: ``aten.zeros`` (b, heads, s) fp32 before the backward op). Then
``memplan::flash_attention_backward``: ``do`` is the token-major gradient of the reshape (its
last stride 1: no ``contiguous`` copy), ``lse.contiguous()`` a no-op; ``dq, dk, dv =
torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)`` (the saved tensors' layouts: dv
of a token-major v is token-major, its view back to wv's output a view), then ``delta =
torch.empty_like(lse)`` (the preprocess kernel's ``rowsum(dO * O) - dlse``, fp32), freed as the
op returns; the materialised zeros go when the Function's backward returns. GQA is summed
inside the dK/dV kernel: K and V are never repeated.

On CUDA the kernels are autotuned: the first launch of each (``_attn_fwd``, ``_attn_bwd_dkdv``,
``_attn_bwd_dq``; the key, sequence, head dim, causal, group and dtypes, is the same in every
layer) benchmarks the configs ``_pruner`` keeps when it keeps more than one (Triton 3.8
``Autotuner.run``/``_bench``), each through ``triton.testing.do_bench``, which allocates a 256 MiB
L2-flush buffer (``torch.empty(256 MiB // 4, int32)``, ``backends/nvidia/driver.py``
``get_empty_cache_for_benchmark``) through the caching allocator and frees it as it returns: the
run's warm-up step, after the launch's own tensors. The interpreter runs one config, so the CPU
comparison has none (:data:`AUTOTUNE_FLUSH`); from source, no GPU trace.

Every dtype the kernel takes (fp32, fp16, bf16) allocates the same tensors, in q's dtype but
lse, dlse and delta (fp32). ``delta`` is allocated inside the custom op, below the dispatch
mode the CPU meter (MemTracker) watches: the CPU comparison leaves it out (:data:`DELTA`).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor

# allocated inside the backward custom op, where the CPU meter (a TorchDispatchMode) sees only
# the op's outputs; a real allocation on CUDA and CPU alike
DELTA = "triton_delta"
AUTOTUNE_FLUSH = "autotune_l2_flush"  # do_bench's buffer (CUDA only)
L2_FLUSH_BYTES = 256 * 1024 * 1024  # get_empty_cache_for_benchmark: cache_size
# kernels/fused_attention.py ``_CONFIGS``: (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and
# padded head dim of 16-bit inputs, or "fp32" (tests/unit/test_timeline_triton.py compares them)
CONFIGS = {
    "fwd": {
        64: ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)),
        128: ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 8, 2)),
        256: ((64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)),
        "fp32": ((32, 32, 4, 2), (64, 32, 8, 2), (32, 32, 8, 2)),
    },
    "dkdv": {
        64: ((32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 8, 3), (16, 64, 4, 3)),
        128: ((16, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3), (16, 64, 4, 2)),
        256: ((16, 32, 8, 2), (16, 64, 8, 2)),
        "fp32": ((16, 32, 4, 2), (16, 32, 8, 2), (32, 32, 8, 2)),
    },
    "dq": {
        64: ((128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)),
        128: ((128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)),
        256: ((64, 32, 8, 2), (32, 32, 4, 2)),
        "fp32": ((32, 32, 4, 2), (64, 32, 8, 2), (32, 32, 8, 2)),
    },
}
SMEM_BUDGET_BYTES = 160 * 1024  # _SMEM_BUDGET_BYTES
_TUNED: WeakKeyDictionary = WeakKeyDictionary()  # per run (tape): the kernels already tuned


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def benchmarked(kind: str, head_dim: int, seq: int, itemsize: int) -> int:
    """How many configs ``_pruner(kind)`` keeps for these inputs, 0 where one alone is left (no
    benchmark): the bucket's configs whose blocks fit the sequence (rounded up to a power of two,
    at least 16) and whose tiles (``_tile_bytes``) fit the shared-memory budget."""
    pad = max(16, _pow2(head_dim))
    bucket = "fp32" if itemsize == 4 else min(b for b in (64, 128, 256) if b >= pad)
    cap = max(16, _pow2(seq))
    kept = 0
    for m, n, _, stages in CONFIGS[kind][bucket]:
        resident, streamed = {"fwd": (m, 2 * n), "dq": (2 * m, 2 * n), "dkdv": (2 * n, 2 * m)}[kind]
        kept += max(m, n) <= cap and itemsize * pad * (resident + stages * streamed) <= SMEM_BUDGET_BYTES
    return kept if kept > 1 else 0


def _autotune(tape: Tape, kind: str, shape: tuple[int, int, int]) -> None:
    """The first launch of ``kind`` in the run: ``do_bench``'s flush buffer per benchmarked config."""
    tuned = _TUNED.setdefault(tape, set())
    if kind in tuned:
        return
    tuned.add(kind)
    for _ in range(benchmarked(kind, *shape)):
        tape.drop(tape.new(L2_FLUSH_BYTES, 1, AUTOTUNE_FLUSH))


def attention(tape: Tape, q: Tensor, k: Tensor, v: Tensor, rows: int, shape: tuple[int, int], autocast: bool) -> Tensor:
    """``flash_attention(q, k, v, causal=True, backend="triton")`` over ``rows`` = b x heads x s
    query rows, ``shape`` (head_dim, s): under ``autocast`` q, k, v cast to bf16 first; the output
    and the fp32 lse, saved with q, k, v. A selective checkpoint that saves the op
    (``selective-op``) keeps out and lse and hands them back, as for SDPA (``ops.sdpa``)."""
    cast = [ops.to(tape, x, 2, f"{n}_cast") if autocast else tape.alias(x) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    out = _forward(tape, *cast, rows, shape)
    tape.done(*cast)  # flash_attention's frame
    return out


def _forward(tape: Tape, q: Tensor, k: Tensor, v: Tensor, rows: int, shape: tuple[int, int]) -> Tensor:
    """``memplan::flash_attention_forward`` and its autograd node."""
    qn, kn, vn, itemsize = q.numel, k.numel, v.numel, q.itemsize
    tune = (*shape, itemsize)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        dlse = tape.new(rows, 4, "dlse_zeros")  # materialize_grads: lse's undefined gradient
        dq, dk, dv = (tape.new(n, itemsize, name) for n, name in ((qn, "dq"), (kn, "dk"), (vn, "dv")))
        # empty_like keeps the saved v's strides: an unpacked (contiguous) save gives a heads-major dv
        dv.heads_major = bool(saved) and not saved[2].transposed
        delta = tape.new(rows, 4, DELTA)
        _autotune(tape, "dkdv", tune)  # after the preprocess pass, which is not tuned
        _autotune(tape, "dq", tune)
        tape.drop(delta)  # the op's local
        tape.drop(dlse)  # the Function's backward arguments
        return [dq, dk, dv]

    node = tape.node("flash_attention_forward", apply, [q, k, v], saved=[q, k, v])

    def forward() -> list[Tensor]:
        out = ops.result(tape, qn, itemsize, "flash_attention.out", node)
        out.transposed = q.transposed  # empty_like(q)
        lse = tape.new(rows, 4, "flash_attention.lse")
        _autotune(tape, "fwd", tune)
        return [out, lse]

    return ops.attention_output(tape, node, forward)  # flash_attention returns out alone
