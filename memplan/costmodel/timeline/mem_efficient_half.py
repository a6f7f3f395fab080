"""SDPA's memory-efficient (CUTLASS) kernel in 16 bits over a head dim above 128 (MLA's q/k 192, v 128).

From source (pytorch/pytorch, the 2.11-era ``aten/src/ATen/native/transformers/cuda``; no GPU trace ran it):

Forward, ``_efficient_attention_forward`` (``attention.cu``, its ``launchKernel`` lambda): the first kernel of
``dispatch_cutlassF_bf16_sm80`` (``mem_eff_attention/kernels/cutlassF.h``: 64x64_rf with ``kMaxK`` 64, 64x128_rf
with 128, 32x128_gmem with 65536) whose ``kMaxK`` covers ``max(q.size(3), v.size(3))``; over 128 the gmem one,
whose output is not kept in registers (``kKeepOutputInRF = kSingleValueIteration``, false), so
``kNeedsOutputAccumulatorBuffer = !kKeepOutputInRF && output_accum_t (float) != output_t`` holds
(``kernel_forward.h``): after ``res`` (B, M, heads, Kv, 16-bit) and the log-sum-exp (``mem_efficient.lse_numel``),
``output_accum = at::empty({B, M, num_heads, Kv}, float)``, freed as the lambda returns.

Backward, ``_efficient_attention_backward`` (``attention_backward.cu``): the first kernel of
``dispatch_cutlassB_bf16_sm80`` (``kernels/cutlassB.h``) whose ``kMaxK`` covers ``maxK = max(K, Kv)``, without
dropout, whose shared memory fits: over 128 ``128x64_k65536`` (then ``64x64_k65536`` where ``sizeof(SharedStorage)``
exceeds ``sharedMemPerBlockOptin``: not checked on a GPU; taken to fit on A100 / H100 / H200, whose shared
memory the 128-row kernels were generated for, ``kernels/generate_kernels.py``: "We still need fallback to 64 for
GPUs with less shmem (Sm75, Sm86 ...)"). In it (``kernel_backward.h``): ``kOutputInRF = kIsHalf
&& kMaxK <= kBlockSizeI`` is false, so ``kNeedsAccumGradK = kNeedsAccumGradV = !kOutputInRF && output_accum_t !=
output_t`` hold; ``kKernelComputesDelta = kIsHalf && (kOutputInRF || kMinComputeCapability != 70)`` holds on the
Sm80 kernels, so ``delta = at::empty({B, nH, M}, float)`` and no product or sum; ``kEnableSplitKeys = kMinSm >= 70``
makes ``kNeedsAccumGradQ``. The workspace, ``at::empty({p.workspace_size()}, Byte)``: per (batch, head)
``align_up(gk + gv + gq, 4)`` floats with ``gk = num_splits_key * kBlockSizeJ * align_up(K, kBlockSizeI)``,
``gv`` the same over ``Kv``, ``gq = ceil_div(M, kBlockSizeI) * ceil_div(K, kBlockSizeJ) * sizeof(GradQTempStorage)
/ 4`` (a 16-byte lock header, :data:`GRAD_Q_LOCK`, and the ``kBlockSizeI x kBlockSizeJ`` fp32 tile);
zeroed in place when the keys are split. ``num_splits_key`` (the launch's heuristic): ``ceil_div(N, kBlockSizeJ)``,
1 when the grid without splits has >= 256 blocks and ``N <= 2 * kBlockSizeJ``, at most ``200 / (B * nH)`` (integer
division) because gK/gV need the staging area, at least 1. grad_q, grad_k, grad_v are ``at::empty`` of q's, k's
and v's sizes before the lambda; delta goes as the lambda returns, the workspace as the function does.
"""

from __future__ import annotations

GRAD_Q_LOCK = 16  # GradQTempStorage: int32 lock, counter, pad[2] (kernel_backward.h)
RF_MAX_K = 128  # cutlassF.h: the 16-bit forward kernels that keep the output in registers reach kMaxK 128
BLOCK_I, BLOCK_J = 128, 64  # cutlassB.h: bf16/f16 128x64_k65536, the first 16-bit backward kernel over kMaxK 128
SPLIT_GRID, SPLIT_BUDGET = 256, 200  # attention_backward.cu: the split-keys heuristic's two constants


def followed(head_dim: int, value_dim: int) -> bool:
    """Whether the 16-bit kernel choice here holds: a head dim above 128 (the k65536 kernels alone;
    at 128 and below the seq-aligned and register-resident kernels and their preloads take over)."""
    return max(head_dim, value_dim) > RF_MAX_K


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def num_splits_key(b: int, heads: int, s: int) -> int:
    """``p.num_splits_key`` of ``_efficient_attention_backward`` without ``num_splits_key`` passed (SDPA's)."""
    splits = -(-s // BLOCK_J)
    if b * heads >= SPLIT_GRID and s <= 2 * BLOCK_J:  # the grid (1, nH, B) before splitting
        splits = 1
    splits = min(splits, SPLIT_BUDGET // (b * heads))  # kNeedsAccumGradK || kNeedsAccumGradV
    return max(splits, 1)


def workspace_bytes(b: int, heads: int, s: int, head_dim: int, value_dim: int) -> int:
    """``p.workspace_size()`` of the 128x64 16-bit backward kernel: gK's and gV's fp32 staging per split of
    the keys, then dQ's per-tile accumulators and locks, per (batch, head), aligned to 4 floats."""
    splits = num_splits_key(b, heads, s)
    gk = splits * BLOCK_J * _up(head_dim, BLOCK_I)
    gv = splits * BLOCK_J * _up(value_dim, BLOCK_I)
    gq = -(-s // BLOCK_I) * -(-head_dim // BLOCK_J) * (GRAD_Q_LOCK + BLOCK_I * BLOCK_J * 4) // 4
    return b * heads * _up(gk + gv + gq, 4) * 4
