"""FlashAttention-2 forward and backward in Triton: causal or not, GQA / MQA, any sequence length.

Algorithm: FlashAttention-2 (Dao 2023, arXiv 2307.08691), after FlashAttention (Dao et al. 2022,
arXiv 2205.14135) and the online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867); the layout
of the code follows Triton's 06-fused-attention tutorial.

Forward, one program per (query block, batch x query head): load the query block once, loop over
key/value blocks keeping a running row maximum ``m``, a running row sum ``l`` and an unnormalised
output ``acc``; rescale both by ``exp(m_old - m_new)`` when the maximum grows; at the end write
``out = acc / l`` and the log-sum-exp ``lse = m + log(l)``. The s x s scores live only block by
block in registers: what the forward keeps for the backward is ``out`` and ``lse`` (4 bytes per
head per token), never the scores.

Backward, three kernels:
  1. preprocess: ``delta = rowsum(dO * O)`` (minus the gradient of ``lse`` when one flows in);
  2. dK/dV, one program per (key block, batch x KV head): loop over the query heads of the KV
     head's group and over their query blocks, recompute ``P = exp(S - lse)`` and accumulate
     ``dV += P^T dO`` and ``dK += dS^T Q`` with ``dS = P * (dP - delta)``, ``dP = dO V^T``; a GQA
     group's query heads sum into one dK/dV in registers, so K and V are never repeated;
  3. dQ, one program per (query block, batch x query head): ``dQ += dS K`` over key blocks.
No atomics: every program owns the rows it writes.

Exponentials are base 2 (``exp2``, native on the GPU): scores are scaled by
``softmax_scale * log2(e)``. The stored ``lse`` is the natural log-sum-exp of the scaled scores
(what ``torch.logsumexp(q @ k^T * softmax_scale, -1)`` gives), in fp32.

Masks: causal programs skip the key blocks wholly above the diagonal, run the blocks wholly
below it without a mask, and mask only the diagonal blocks and the ragged tail (sequence lengths
need not be multiples of the block sizes); head dims that are not powers of two are padded to
the next one with masked loads.

Layout: ``q`` (batch, q_heads, seq, head_dim), ``k`` and ``v`` (batch, kv_heads, seq, head_dim),
any strides over the first three dims, the last dim contiguous. ``out`` takes ``q``'s layout
(``empty_like``), so the trainer's ``out.transpose(1, 2).reshape(b, s, -1)`` stays a view.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction

from .reference import check_attention_inputs, default_scale

LOG2E = tl.constexpr(1.4426950408889634)  # 1/ln(2): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): natural lse = base-2 lse * LN2
INT32_MAX = 2**31 - 1  # row offsets inside one (batch, head) slice are 32-bit in the kernels


# ---------------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b accumulated in fp32. WIDEN: Triton's interpreter (3.6 to 3.8) multiplies bf16 bit
    patterns as integers in ``tl.dot``, so under it bf16 tiles are widened to fp32 first (bf16
    products are exact in fp32, as on the tensor cores); never set on the GPU."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tile_ptrs(base, rows, offs_d, stride_row):
    return base + rows[:, None] * stride_row + offs_d[None, :]


@triton.jit
def _tile_mask(rows, offs_d, n_rows, HEAD_DIM: tl.constexpr):
    mask = rows[:, None] < n_rows
    if offs_d.shape[0] != HEAD_DIM:  # head dim padded to a power of two
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def _load_tile(base, rows, offs_d, stride_row, n_rows, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A (rows, head_dim) tile, zero past n_rows when MASK_ROWS; tiles with no row out of bounds
    load without a row mask, keeping vectorised, pipelined loads."""
    ptrs = _tile_ptrs(base, rows, offs_d, stride_row)
    if MASK_ROWS:
        return tl.load(ptrs, mask=_tile_mask(rows, offs_d, n_rows, HEAD_DIM), other=0.0)
    elif offs_d.shape[0] != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store_tile(base, value, rows, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr):
    ptrs = _tile_ptrs(base, rows, offs_d, stride_row)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=_tile_mask(rows, offs_d, n_rows, HEAD_DIM))


# ---------------------------------------------------------------------------------------------
# autotune configs: a small set, pruned by head dim, sequence length and dtype
# ---------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim of 16-bit inputs, and for fp32
# inputs (IEEE fp32 dots run on the CUDA cores, not the tensor cores, and want small tiles); M
# indexes queries, N keys. Checked offline for sm_80 and sm_90 with Triton 3.8 (ptxas and
# cuobjdump -res-usage): every config the pruner keeps compiles within the A100's shared memory;
# in 16 bits the forward and dQ spill no registers on sm_90 and dK/dV at most 56 bytes (it holds
# two fp32 (BLOCK_N, head_dim) accumulators, hence its narrow query blocks and 8 warps).
_CONFIGS = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 8, 2)],
        256: [(64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
        "fp32": [(32, 32, 4, 2), (64, 32, 8, 2), (32, 32, 8, 2)],
    },
    "dkdv": {
        64: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 8, 3), (16, 64, 4, 3)],
        128: [(16, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3), (16, 64, 4, 2)],
        256: [(16, 32, 8, 2), (16, 64, 8, 2)],
        "fp32": [(16, 32, 4, 2), (16, 32, 8, 2), (32, 32, 8, 2)],
    },
    "dq": {
        64: [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
        128: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
        256: [(64, 32, 8, 2), (32, 32, 4, 2)],
        "fp32": [(32, 32, 4, 2), (64, 32, 8, 2), (32, 32, 8, 2)],
    },
}
# the interpreter runs one config of small blocks (fast tests; several blocks per sequence even at
# seq 64, and BLOCK_M != BLOCK_N so the diagonal logic is exercised)
_INTERPRET_CONFIG = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
# shared memory one config's tiles may take: the A100's 163 KiB per block, less headroom
_SMEM_BUDGET_BYTES = 160 * 1024


def _configs(kind: str) -> list[triton.Config]:
    if triton.knobs.runtime.interpret:
        table = [_INTERPRET_CONFIG[kind]]
    else:
        table = sorted({c for configs in _CONFIGS[kind].values() for c in configs})
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in table]


def _key(config: triton.Config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _tile_bytes(config: triton.Config, args: dict, kind: str) -> int:
    """Shared memory of one config's tiles on Hopper (Ampere keeps one stage fewer): the resident
    tiles (Q; Q and dO; K and V) plus num_stages buffers of the two streamed ones."""
    m, n, _, stages = _key(config)
    resident, streamed = {"fwd": (m, 2 * n), "dq": (2 * m, 2 * n), "dkdv": (2 * n, 2 * m)}[kind]
    return args["Q"].element_size() * args["HEAD_DIM_PAD"] * (resident + stages * streamed)


def _pruner(kind: str):
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        args = {**named_args, **kwargs}
        if args["Q"].element_size() == 4:
            bucket = "fp32"
        else:
            bucket = min(b for b in (64, 128, 256) if b >= args["HEAD_DIM_PAD"])
        mine = [c for c in configs if _key(c) in _CONFIGS[kind][bucket]]
        # blocks no longer than the sequence (rounded up to a power of two, at least 16)
        seq = max(16, triton.next_power_of_2(args["N_CTX"]))
        fits = [c for c in mine if max(_key(c)[:2]) <= seq and _tile_bytes(c, args, kind) <= _SMEM_BUDGET_BYTES]
        # else the config of smallest tiles (short sequences, large head dims in fp32), of the
        # most warps among equals (fewer registers per thread)
        return fits or [min(mine, key=lambda c: (_tile_bytes(c, args, kind), -c.num_warps))]

    return prune


_AUTOTUNE_KEY = ["N_CTX", "HEAD_DIM", "CAUSAL", "GROUP"]  # the autotuner adds the tensors' dtypes


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, qk_scale, N_CTX,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    WIDEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [lo, hi); MASK: the blocks hold the diagonal or the tail."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(k_base, cols, offs_d, stride_kn, N_CTX, MASK, HEAD_DIM)  # (BLOCK_N, D)
        qk = _dot(q, tl.trans(k), WIDEN, PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 units
        if MASK:
            keep = cols[None, :] < N_CTX
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            # every row's first block holds a kept key, so the running maximum is finite and
            # exp2(-inf - m) = 0 never meets -inf - -inf
            qk = tl.where(keep, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)  # rescales what earlier blocks accumulated
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, cols, offs_d, stride_vn, N_CTX, MASK, HEAD_DIM)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, WIDEN, PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _pruner("fwd")})
@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse, qk_scale,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
    H, GROUP, N_CTX,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    WIDEN: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)  # batch x query head
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_kvh = off_h // GROUP  # GQA: query head h reads KV head h // GROUP, never a repeated copy
    q_base = Q + off_z * stride_qz + off_h * stride_qh
    k_base = K + off_z * stride_kz + off_kvh * stride_kh
    v_base = V + off_z * stride_vz + off_kvh * stride_vh
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)

    q = _load_tile(q_base, offs_m, offs_d, stride_qm, N_CTX, True, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if CAUSAL:
        # keys past the block's last query are skipped; those before its first need no mask
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
        lo_mask = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
    else:
        hi = N_CTX
        lo_mask = N_CTX // BLOCK_N * BLOCK_N  # the ragged tail block is masked
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, 0, lo_mask, qk_scale, N_CTX,
        False, CAUSAL, BLOCK_N, HEAD_DIM, WIDEN, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo_mask, hi, qk_scale, N_CTX,
        True, CAUSAL, BLOCK_N, HEAD_DIM, WIDEN, PRECISION,
    )  # fmt: skip

    # epilogue: normalise, and keep the natural-log lse for the backward
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(Lse + off_hz.to(tl.int64) * N_CTX + offs_m, lse, mask=offs_m < N_CTX)
    _store_tile(Out + off_z * stride_oz + off_h * stride_oh, acc, offs_m, offs_d, stride_om, N_CTX, HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------

PREPROCESS_BLOCK_M = 64  # rows per program of the delta pass (memory-bound; any power of two works)


@triton.jit
def _attn_bwd_preprocess(
    Out, DO, DLse, Delta,
    stride_oz, stride_oh, stride_om, stride_doz, stride_doh, stride_dom,
    H, N_CTX,
    HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) - dlse: the dS = P * (dP - delta) term of the softmax gradient; a
    gradient flowing into lse adds dlse * P to dS, hence the minus."""
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = _load_tile(Out + off_z * stride_oz + off_h * stride_oh, offs_m, offs_d, stride_om, N_CTX, True, HEAD_DIM)
    do = _load_tile(DO + off_z * stride_doz + off_h * stride_doh, offs_m, offs_d, stride_dom, N_CTX, True, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = off_hz.to(tl.int64) * N_CTX + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + row, mask=offs_m < N_CTX, other=0.0)
    tl.store(Delta + row, delta, mask=offs_m < N_CTX)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
    offs_n, offs_d, lo, hi, qk_scale, N_CTX,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    WIDEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block from query blocks [lo, hi), transposed (keys as rows)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        q = _load_tile(q_base, offs_m, offs_d, stride_qm, N_CTX, MASK, HEAD_DIM)  # (BLOCK_M, D)
        do = _load_tile(do_base, offs_m, offs_d, stride_dom, N_CTX, MASK, HEAD_DIM)
        if MASK:
            lse = tl.load(lse_base + offs_m, mask=offs_m < N_CTX, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < N_CTX, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        qkT = _dot(k, tl.trans(q), WIDEN, PRECISION)  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT * qk_scale - (lse * LOG2E)[None, :])
        if MASK:
            keep = offs_m[None, :] < N_CTX
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(keep, pT, 0.0)
        dv += _dot(pT.to(do.dtype), do, WIDEN, PRECISION)
        dpT = _dot(v, tl.trans(do), WIDEN, PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk += _dot(dsT.to(q.dtype), q, WIDEN, PRECISION)
    return dk, dv


@triton.autotune(configs=_configs("dkdv"), key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _pruner("dkdv")})
@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV, sm_scale, qk_scale,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    stride_doz, stride_doh, stride_dom, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    H_KV, GROUP, N_CTX,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    WIDEN: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_N % BLOCK_M == 0, "query blocks must tile a key block")
    start_n = tl.program_id(0)
    off_hz = tl.program_id(1)  # batch x KV head
    off_z = (off_hz // H_KV).to(tl.int64)
    off_kvh = (off_hz % H_KV).to(tl.int64)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = _load_tile(K + off_z * stride_kz + off_kvh * stride_kh, offs_n, offs_d, stride_kn, N_CTX, True, HEAD_DIM)
    v = _load_tile(V + off_z * stride_vz + off_kvh * stride_vh, offs_n, offs_d, stride_vn, N_CTX, True, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)

    # query blocks: [diag_lo, diag_hi) hold the diagonal (causal only), [body_lo, full_end) need no
    # mask, [tail_lo, N_CTX) is the ragged tail
    full_end = N_CTX // BLOCK_M * BLOCK_M
    if CAUSAL:
        diag_lo = start_n * BLOCK_N  # earlier queries cannot see these keys
        diag_hi = tl.minimum(diag_lo + BLOCK_N, N_CTX)
        body_lo = diag_lo + BLOCK_N
    else:
        diag_lo = 0
        diag_hi = 0
        body_lo = 0
    tail_lo = tl.maximum(body_lo, full_end)
    H = H_KV * GROUP
    for g in range(GROUP):  # the query heads sharing this KV head
        off_h = off_kvh * GROUP + g
        q_base = Q + off_z * stride_qz + off_h * stride_qh
        do_base = DO + off_z * stride_doz + off_h * stride_doh
        row_base = (off_z * H + off_h) * N_CTX
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, Lse + row_base, Delta + row_base, stride_qm, stride_dom,
            offs_n, offs_d, diag_lo, diag_hi, qk_scale, N_CTX, True, CAUSAL, BLOCK_M, HEAD_DIM, WIDEN, PRECISION,
        )  # fmt: skip
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, Lse + row_base, Delta + row_base, stride_qm, stride_dom,
            offs_n, offs_d, body_lo, full_end, qk_scale, N_CTX, False, CAUSAL, BLOCK_M, HEAD_DIM, WIDEN, PRECISION,
        )  # fmt: skip
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, Lse + row_base, Delta + row_base, stride_qm, stride_dom,
            offs_n, offs_d, tail_lo, N_CTX, qk_scale, N_CTX, True, CAUSAL, BLOCK_M, HEAD_DIM, WIDEN, PRECISION,
        )  # fmt: skip

    dk *= sm_scale  # S = softmax_scale * Q K^T
    _store_tile(DK + off_z * stride_dkz + off_kvh * stride_dkh, dk, offs_n, offs_d, stride_dkn, N_CTX, HEAD_DIM)
    _store_tile(DV + off_z * stride_dvz + off_kvh * stride_dvh, dv, offs_n, offs_d, stride_dvn, N_CTX, HEAD_DIM)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, qk_scale, N_CTX,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    WIDEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ of one query block from key blocks [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(k_base, cols, offs_d, stride_kn, N_CTX, MASK, HEAD_DIM)
        v = _load_tile(v_base, cols, offs_d, stride_vn, N_CTX, MASK, HEAD_DIM)
        p = tl.math.exp2(_dot(q, tl.trans(k), WIDEN, PRECISION) * qk_scale - lse2[:, None])
        if MASK:
            keep = cols[None, :] < N_CTX
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            p = tl.where(keep, p, 0.0)
        dp = _dot(do, tl.trans(v), WIDEN, PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, WIDEN, PRECISION)
    return dq


@triton.autotune(configs=_configs("dq"), key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _pruner("dq")})
@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, sm_scale, qk_scale,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    stride_doz, stride_doh, stride_dom, stride_dqz, stride_dqh, stride_dqm,
    H, GROUP, N_CTX,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    WIDEN: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)  # batch x query head
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_kvh = off_h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_tile(Q + off_z * stride_qz + off_h * stride_qh, offs_m, offs_d, stride_qm, N_CTX, True, HEAD_DIM)
    do = _load_tile(DO + off_z * stride_doz + off_h * stride_doh, offs_m, offs_d, stride_dom, N_CTX, True, HEAD_DIM)
    row = off_hz.to(tl.int64) * N_CTX + offs_m
    lse2 = tl.load(Lse + row, mask=offs_m < N_CTX, other=0.0) * LOG2E
    delta = tl.load(Delta + row, mask=offs_m < N_CTX, other=0.0)
    k_base = K + off_z * stride_kz + off_kvh * stride_kh
    v_base = V + off_z * stride_vz + off_kvh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
        lo_mask = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
    else:
        hi = N_CTX
        lo_mask = N_CTX // BLOCK_N * BLOCK_N
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, 0, lo_mask, qk_scale, N_CTX,
        False, CAUSAL, BLOCK_N, HEAD_DIM, WIDEN, PRECISION,
    )  # fmt: skip
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo_mask, hi, qk_scale, N_CTX,
        True, CAUSAL, BLOCK_N, HEAD_DIM, WIDEN, PRECISION,
    )  # fmt: skip
    dq *= sm_scale
    _store_tile(DQ + off_z * stride_dqz + off_h * stride_dqh, dq, offs_m, offs_d, stride_dqm, N_CTX, HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# launchers: checks, then the ops (torch.library.triton_op, so torch.compile sees the kernels)
# ---------------------------------------------------------------------------------------------

# the kernels run under Triton's interpreter (TRITON_INTERPRET=1 when this module was imported)
INTERPRETED = isinstance(_attn_fwd.fn, InterpretedFunction)


def check_kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the kernels need beyond the op's contract (``check_attention_inputs``), as ValueError."""
    check_attention_inputs(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        rows = t.shape[2]
        if rows > 1 and (rows - 1) * t.stride(2) + t.shape[3] > INT32_MAX:
            raise ValueError(
                f"{name}: a (batch, head) slice spans over 2**31 elements; the kernels index it in 32 bits"
            )


def _kernel_flags(q: torch.Tensor) -> dict:
    d = q.shape[-1]
    return {
        "HEAD_DIM": d,
        "HEAD_DIM_PAD": max(16, triton.next_power_of_2(d)),  # tl.dot needs tiles of at least 16
        "WIDEN": INTERPRETED and q.dtype == torch.bfloat16,
        # fp32 inputs get fp32 products (TF32 would round them to 10 mantissa bits)
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


@triton_op("memplan::flash_attention_forward", mutates_args=())
def flash_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out like ``q`` (its dtype and layout), lse (batch, q_heads, seq) fp32 natural log."""
    check_kernel_inputs(q, k, v)
    b, hq, n, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, n), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), b * hq)

    wrap_triton(_attn_fwd)[grid](
        q, k, v, out, lse, softmax_scale * 1.4426950408889634,  # 1/ln(2): scores in base-2 units
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        hq, hq // k.shape[1], n, CAUSAL=causal, **_kernel_flags(q),
    )  # fmt: skip
    return out, lse


@triton_op("memplan::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's inputs, its out and lse, and the gradients of out and lse."""
    check_kernel_inputs(q, k, v)
    if do.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"backward: do {tuple(do.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)} for q {q.shape}"
        )
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    if do.stride(-1) != 1:  # e.g. the expanded gradient of a sum
        do = do.contiguous()
    lse = lse.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk, dv
    flags = _kernel_flags(q)
    delta = torch.empty_like(lse)
    has_dlse = dlse is not None
    wrap_triton(_attn_bwd_preprocess)[(triton.cdiv(n, PREPROCESS_BLOCK_M), b * hq)](
        out, do, dlse.contiguous() if has_dlse else lse, delta,
        *out.stride()[:3], *do.stride()[:3], hq, n,
        HAS_DLSE=has_dlse, HEAD_DIM=flags["HEAD_DIM"], HEAD_DIM_PAD=flags["HEAD_DIM_PAD"], BLOCK_M=PREPROCESS_BLOCK_M,
    )  # fmt: skip
    qk_scale = softmax_scale * 1.4426950408889634  # 1/ln(2)

    def grid_kv(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), b * hkv)

    wrap_triton(_attn_bwd_dkdv)[grid_kv](
        q, k, v, do, lse, delta, dk, dv, softmax_scale, qk_scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        hkv, hq // hkv, n, CAUSAL=causal, **flags,
    )  # fmt: skip

    def grid_q(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), b * hq)

    wrap_triton(_attn_bwd_dq)[grid_q](
        q, k, v, do, lse, delta, dq, softmax_scale, qk_scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        hq, hq // hkv, n, CAUSAL=causal, **flags,
    )  # fmt: skip
    return dq, dk, dv


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    # all the backward needs: no s x s tensor is kept
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.softmax_scale)
    return dq, dk, dv, None, None


flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# torch.compile: versions whose Inductor cannot compile these kernels run the eager op instead
# ---------------------------------------------------------------------------------------------

# torch.compile over the kernels failed to compile ``_attn_fwd`` with torch 2.11.0 and Triton 3.6.0 (a
# report from an H100; not reproduced here, and the cause inside Inductor not pinned down); the GPU tests
# (``TestCuda.test_torch_compile``) are written against torch 2.13 with Triton 3.8. So the versions known
# to fail are torch below 2.12 together with Triton below 3.7; the other combinations are tried.
COMPILE_KNOWN_BAD = {"torch_below": (2, 12), "triton_below": (3, 7)}


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.11.0+cu130' or '3.6.0'."""
    parts = [int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def torch_version() -> tuple[int, int]:
    return _release(str(torch.__version__))


def triton_version() -> tuple[int, int]:
    return _release(triton.__version__)


def compile_unsupported() -> str | None:
    """Why torch.compile cannot compile the kernels with this torch and Triton, or None where it is tried."""
    torch_v, triton_v = torch_version(), triton_version()
    if torch_v < COMPILE_KNOWN_BAD["torch_below"] and triton_v < COMPILE_KNOWN_BAD["triton_below"]:
        return (
            f"memplan.kernels: torch.compile cannot compile the Triton attention kernels with torch "
            f"{'.'.join(map(str, torch_v))} and Triton {'.'.join(map(str, triton_v))} (known to fail below torch "
            "2.12 with Triton below 3.7); they run as the eager op outside the compiled graph"
        )
    return None


# torch.compile takes the answer as a constant instead of tracing the version parsing (what
# torch.compiler.assume_constant_result sets; see _kernels_run_on in kernels/__init__.py)
compile_unsupported._dynamo_marked_constant = True

_warned: set[str] = set()


def _eager_flash_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op called eagerly (a graph break under torch.compile): the kernels launch as Triton kernels
    outside the graph, and its autograd formula runs the backward op the same way."""
    reason = compile_unsupported()
    if reason is not None and reason not in _warned:
        _warned.add(reason)
        warnings.warn(reason, RuntimeWarning, stacklevel=3)
    return flash_attention_forward(q, k, v, causal, softmax_scale)


def _disable(fn):
    """``torch.compiler.disable(fn)``, with the reason (torch 2.8+) that the error of ``fullgraph=True`` shows."""
    reason = (
        f"memplan.kernels: torch {torch.__version__} with Triton {triton.__version__} cannot compile the kernels "
        "(known to fail below torch 2.12 with Triton below 3.7); the op runs eagerly, a graph break"
    )
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch before 2.8
        return torch.compiler.disable(fn)


_eager_forward = _disable(_eager_flash_attention_forward)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, softmax_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of ``memplan.kernels.flash_attention_with_lse``. Under torch.compile with a torch
    and Triton that cannot compile the kernels (``compile_unsupported``) it calls the op eagerly, behind
    ``torch.compiler.disable``, with one warning naming the versions; eager calls are never checked.
    ``torch.ops.memplan.flash_attention_forward`` called directly under torch.compile is not guarded."""
    args = (q, k, v, bool(causal), default_scale(q, softmax_scale))
    if torch.compiler.is_compiling() and compile_unsupported() is not None:
        return _eager_forward(*args)
    return flash_attention_forward(*args)
