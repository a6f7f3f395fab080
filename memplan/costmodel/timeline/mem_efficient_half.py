"""SDPA's memory-efficient (CUTLASS) kernel in 16 bits on compute capability 8.0 / 9.0, at every head dim.

From source (pytorch/pytorch, the 2.11-era ``aten/src/ATen/native/transformers/cuda``, the same lines in torch
2.13's headers ``mem_eff_attention/kernel_forward.h``, ``kernel_backward.h``, ``kernels/cutlassF.h``,
``cutlassB.h``; no GPU trace ran it):

Forward, ``_efficient_attention_forward`` (``attention.cu``, its ``launchKernel`` lambda): the first kernel of
``dispatch_cutlassF_bf16_sm80`` (``f16`` alike) whose ``kMaxK`` covers q's and v's head dims (``value.size(3) >
Kernel::kMaxK || key.size(3) > Kernel::kMaxK`` skips one): 64x64_rf (``kMaxK`` 64), 64x128_rf (128), 32x128_gmem
(65536). ``kSingleValueIteration = kMaxK <= kKeysPerBlock`` holds for the two ``_rf`` ones, and ``kKeepOutputInRF =
kSingleValueIteration``, so ``kNeedsOutputAccumulatorBuffer = !kKeepOutputInRF && output_accum_t (float) !=
output_t`` only over 128 (``kernel_forward.h``): there, after ``res`` (B, M, heads, Kv, 16-bit) and the log-sum-exp
(``mem_efficient.lse_numel``), ``output_accum = at::empty({B, M, num_heads, Kv}, float)``, freed as the lambda
returns (:func:`output_accumulator`); up to 128 the output and the log-sum-exp alone.

Backward, ``_efficient_attention_backward`` (``attention_backward.cu``): the first kernel of
``dispatch_cutlassB_bf16_sm80`` (``cutlassB.h``) whose ``kMaxK`` covers ``maxK = max(K, Kv)``, without dropout,
whose shared memory fits, seq-aligned ones only where M and N are multiples of their blocks (the same blocks as
the next). On 8.0 / 9.0 (``128x64_k96`` is offered on 8.6 / 8.9 alone): 64x64 up to 32, 64x64 up to 64,
``128x128_k128`` (``kPreload``) up to 128, then ``128x64_k65536``: :data:`BACKWARD_BLOCKS`. Where ``sizeof
(SharedStorage)`` exceeds ``sharedMemPerBlockOptin`` the next one runs (``64x64_k128``, ``64x64_k65536``): not
checked on a GPU; taken to fit on A100 / H100 / H200, whose shared memory the 128-row kernels were generated for
(``kernels/generate_kernels.py``: "We still need fallback to 64 for GPUs with less shmem (Sm75, Sm86 ...)").

In the kernel (``kernel_backward.h``): ``kOutputInRF = kIsHalf && kMaxK <= kBlockSizeI`` holds up to 128 (64 <= 64,
128 <= 128) and fails over it, so ``kNeedsAccumGradK = kNeedsAccumGradV = !kOutputInRF && output_accum_t !=
output_t`` stage dK / dV in the workspace only over 128; ``kKernelComputesDelta = kIsHalf && (kOutputInRF ||
kMinComputeCapability != 70)`` holds on the Sm80 kernels, so ``delta = at::empty({B, nH, M}, float)`` and no
product or sum; ``kEnableSplitKeys = kMinSm >= 70`` makes ``kNeedsAccumGradQ``. The workspace, ``at::empty(
{p.workspace_size()}, Byte)``: per (batch, head) ``align_up(gk + gv + gq, 4)`` floats with ``gk = num_splits_key *
kBlockSizeJ * align_up(K, kBlockSizeI)`` (0 without ``kNeedsAccumGradK``), ``gv`` the same over ``Kv``, ``gq =
ceil_div(M, kBlockSizeI) * ceil_div(K, kBlockSizeJ) * sizeof(GradQTempStorage) / 4`` (``MatmulGradQ::
ThreadblockShape = <kBlockSizeI, kBlockSizeJ>``; a 16-byte lock header, :data:`GRAD_Q_LOCK`, and the block's
``kNumThreads * FragmentC::kElements = kBlockSizeI x kBlockSizeJ`` fp32 accumulators, ``GmemTile::
kElementsStored``); zeroed in place when the keys are split. ``num_splits_key`` (the launch's heuristic, SDPA
passing none): ``ceil_div(N, kBlockSizeJ)``, 1 when the grid without splits has >= 256 blocks and ``N <= 2 *
kBlockSizeJ``, and where gK / gV are staged at most ``200 / (B * nH)`` (integer division), at least 1; it moves the
workspace only where they are. grad_q, grad_k, grad_v are ``at::empty`` of q's, k's and v's sizes before the
lambda; delta goes as the lambda returns, the workspace as the function does.

Lines in torch 2.13's installed headers (``torch/include/ATen/native/transformers/cuda/mem_eff_attention``):
``kernel_forward.h:113-119`` (``kSingleValueIteration``, ``kAlignLSE``, ``kKeepOutputInRF``,
``kNeedsOutputAccumulatorBuffer``); ``kernel_backward.h:251`` (``kOutputInRF``), ``:272`` (``kKernelComputesDelta``),
``:495-498`` (``MatmulGradQ::ThreadblockShape``), ``:614-628`` (``kEnableSplitKeys``, ``kNeedsAccumGradQ/K/V``,
``GradQTempStorage``), ``:857-890`` (``workspace_elements_gk/gv/gq``, ``workspace_size``), ``:112``
(``GmemTile::kElementsStored``); ``kernels/cutlassF.h:27-31`` and ``:277-281`` (the bf16 and fp32 Sm80 forward
kernels), ``:284-300`` (``dispatch_cutlassF``: compute capability 80 to 121 on the Sm80 lists); ``kernels/cutlassB.h
:228-246``, ``:318-336``, ``:853-866`` (the bf16, f16 and fp32 Sm80 backward kernels), ``:869-898``
(``dispatch_cutlassB``: 80 to 121 on the Sm80 lists).
"""

from __future__ import annotations

GRAD_Q_LOCK = 16  # GradQTempStorage: int32 lock, counter, pad[2] (kernel_backward.h)
RF_MAX_K = 128  # cutlassF.h: the 16-bit forward kernels that keep the output in registers reach kMaxK 128
# dispatch_cutlassB_bf16_sm80 / f16_sm80's aligned kernels without dropout on compute capability 8.0 / 9.0, in
# order: (kMaxK, kBlockSizeI, kBlockSizeJ)
BACKWARD_BLOCKS = ((32, 64, 64), (64, 64, 64), (128, 128, 128), (65536, 128, 64))
SPLIT_GRID, SPLIT_BUDGET = 256, 200  # attention_backward.cu: the split-keys heuristic's two constants


def output_accumulator(head_dim: int, value_dim: int) -> bool:
    """Whether the 16-bit forward kernel keeps an fp32 output accumulator (``kNeedsOutputAccumulatorBuffer``):
    only the 32x128_gmem kernel, over heads above 128."""
    return max(head_dim, value_dim) > RF_MAX_K


def backward_kernel(max_k: int) -> tuple[int, int, int]:
    """``(kMaxK, kBlockSizeI, kBlockSizeJ)`` of the 16-bit backward kernel the dispatch picks for ``max(K, Kv)``."""
    return next(blocks for blocks in BACKWARD_BLOCKS if blocks[0] >= max_k)


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def num_splits_key(b: int, heads: int, s: int, block_j: int = 64, staged: bool = True) -> int:
    """``p.num_splits_key`` of ``_efficient_attention_backward`` without ``num_splits_key`` passed (SDPA's);
    ``staged``: the kernel stages gK / gV in the workspace (``kNeedsAccumGradK || kNeedsAccumGradV``)."""
    splits = -(-s // block_j)
    if b * heads >= SPLIT_GRID and s <= 2 * block_j:  # the grid (1, nH, B) before splitting
        splits = 1
    if staged:
        splits = min(splits, SPLIT_BUDGET // (b * heads))
    return max(splits, 1)


def workspace_bytes(b: int, heads: int, s: int, head_dim: int, value_dim: int) -> int:
    """``p.workspace_size()`` of the 16-bit backward kernel :func:`backward_kernel` picks: over 128 gK's and gV's
    fp32 staging per split of the keys, then (at every size) dQ's per-tile accumulators and locks, per (batch,
    head), aligned to 4 floats."""
    max_k, bi, bj = backward_kernel(max(head_dim, value_dim))
    gk = gv = 0
    if max_k > bi:  # kOutputInRF false: kNeedsAccumGradK / V
        splits = num_splits_key(b, heads, s, bj)
        gk = splits * bj * _up(head_dim, bi)
        gv = splits * bj * _up(value_dim, bi)
    gq = -(-s // bi) * -(-head_dim // bj) * (GRAD_Q_LOCK + bi * bj * 4) // 4
    return b * heads * _up(gk + gv + gq, 4) * 4
