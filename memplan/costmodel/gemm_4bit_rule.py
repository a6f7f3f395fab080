"""Which kernel CUDA's ``bitsandbytes::gemm_4bit`` runs for M rows of a 4-bit weight N x K, on a known GPU.

bitsandbytes 0.50.2 ``backends/cuda/ops.py`` (the lines cited below are that file's): between
``_GEMM_4BIT_CUSTOM_FLOOR_M`` (4) and ``_gemm_4bit_custom_max_m`` (1536) rows, the ``gemm_4bit``
kernel registered for CUDA (l. 934-982) asks ``_gemm_4bit_use_custom_cuda(device_index, A.dtype,
M, N, K)`` (l. 583-811) whether to run the fused kernel (``_gemm_4bit_kernel_impl``) or to
dequantize the weight and call ``F.linear`` (``_dequant_linear_fallback``). The rule reads the
GPU through ``_gpu_dispatch_props`` (l. 73-75: ``multi_processor_count``, ``major``, ``minor`` of
``torch.cuda.get_device_properties``), so a GPU profile's ``compute_capability`` and
``sm_count`` decide it exactly. Written here as the source writes it, branch for branch, in the
source's order: a pure function of (M, N, K, dtype, compute capability, SMs).
"""

from __future__ import annotations

from typing import Literal

from memplan.costmodel.quant import CudaArch  # (multi_processor_count, major, minor)

Dtype = Literal["bf16", "fp16", "fp32"]


def use_custom_cuda(m: int, n: int, k: int, dtype: Dtype, arch: CudaArch) -> bool:
    """``_gemm_4bit_use_custom_cuda(device_index, dtype, M, N, K)`` for 4 < M <= 1536 (l. 600-601:
    ``if M <= _GEMM_4BIT_CUSTOM_FLOOR_M: return True`` is the caller's, :func:`gemm_4bit_kernel`'s)."""
    sms, major, minor = arch
    if m <= 4:  # l. 600-601
        return True
    n_blocks = (n + 63) // 64  # l. 604
    if dtype == "fp32" or major < 7:  # l. 608-609: no MMA kernel, the SIMT range only
        return m < 8
    if major == 7 and (minor < 5 or dtype != "fp16"):  # l. 610-611
        return m < 8
    if (major == 8 and minor == 7) or major == 11:  # l. 614-615: sm87, sm110
        return False
    if major == 10:  # l. 618-623: sm100 (B200/B300)
        if n_blocks >= sms * 3:
            return m <= 32
        if n_blocks >= sms:
            return False if k >= n else m <= 8
        return False
    if n * k < 4 * 1024 * 1024:  # l. 635: the small-weight path
        return _small_weight(m, n, k, arch, n_blocks)
    if m > 512:  # l. 677-678
        return False
    if m < 8:  # l. 684-699
        return _simt_rows(m, n, k, arch, n_blocks)
    return _tiers(m, n, k, arch, n_blocks)  # l. 701-811: M in [8, 512]


def _small_weight(m: int, n: int, k: int, arch: CudaArch, n_blocks: int) -> bool:
    """l. 635-674: N x K under 4 Mi elements."""
    sms, major, minor = arch
    sm75, sm80, hbm = (major, minor) == (7, 5), (major, minor) == (8, 0), (major, minor) == (8, 0) or major == 9
    if k * 2 < n:  # l. 636-657: very short K
        if hbm:
            low_wave = n_blocks * 3 < sms
            if sm80:
                return m <= (1536 if low_wave else 512)
            return m <= (512 if low_wave else 320)
        if sm75:
            if n_blocks >= sms * 3:
                return m <= 320
            if k >= 1024:
                return m <= 64
            if k >= 704:
                return m <= 96
            return m <= 320
        if n_blocks >= sms:
            return m <= 320
        return m <= 192 if n_blocks * k > sms * 320 else m <= 320
    quarter_wave = n_blocks * 4 <= sms  # l. 659
    if sm80 and quarter_wave:  # l. 660-664
        if k >= n:
            return m <= (32 if n_blocks * 8 <= sms else 128)
        return m <= 384
    if sm75 and n_blocks < sms and m > 8:  # l. 666-667
        return m <= 64
    if quarter_wave:  # l. 670-671
        return m <= (32 if (k < n or hbm) else 23)
    if n_blocks * 2 <= sms:  # l. 672-673
        return m <= 16
    return False  # l. 674


def _simt_rows(m: int, n: int, k: int, arch: CudaArch, n_blocks: int) -> bool:
    """l. 684-699: M = 5 to 7 past the small-weight path."""
    sms, major, minor = arch
    sm80, sm90 = (major, minor) == (8, 0), major == 9
    threshold = 36 if sm90 else 48
    if (sm80 or sm90) and m >= 6 and n_blocks >= threshold:
        lt_75pct_wave, lt_60pct_wave = n_blocks * 4 < sms * 3, n_blocks * 5 < sms * 3
        if k > n and lt_75pct_wave:
            return False
        if k == n:
            if sm80 and lt_60pct_wave:
                return False
            if sm90 and lt_75pct_wave and not lt_60pct_wave:
                return False
    return True


def _tiers(m: int, n: int, k: int, arch: CudaArch, n_blocks: int) -> bool:
    """l. 701-811: the per-architecture tier ladders for M in [8, 512]."""
    sms, major, minor = arch
    if (major, minor) == (7, 5):  # l. 703-709
        if n_blocks >= sms * 3:
            return m <= (128 if k < n else 64)
        return m <= 64 if n_blocks >= sms // 2 else m <= 32
    if (major, minor) == (8, 0):
        return _sm80(m, n, k, sms, n_blocks)
    if (major, minor) == (8, 6):  # l. 736-743
        if n_blocks >= sms:
            return m <= 128
        return m <= 64 if n_blocks >= sms // 2 else m <= 16
    if major == 9:
        return _sm90(m, n, k, sms, n_blocks)
    if (major, minor) == (12, 1) and n_blocks >= sms:  # l. 761-766: sm121 at >= 1 wave
        return m <= 256
    if (major, minor) == (12, 0):
        return _sm120(m, n, k, sms, n_blocks)
    return _fallback_tiers(m, n, k, sms, n_blocks)


def _sm80(m: int, n: int, k: int, sms: int, n_blocks: int) -> bool:
    """l. 711-734: A100."""
    if n_blocks >= sms * 3:
        return m <= 128
    if n_blocks >= sms:
        return m <= (64 if k < n else 32)
    if k >= n * 3 and n_blocks * 4 > sms:
        return False
    if k == n and n_blocks >= 48 and n_blocks * 5 < sms * 3:
        return False
    if n_blocks * 2 < sms:
        if k <= n:
            return m <= 128
        if n_blocks * 3 >= sms:
            return False
    if n_blocks >= sms // 2 and k < n:
        return m <= 128
    return m <= 16


def _sm90(m: int, n: int, k: int, sms: int, n_blocks: int) -> bool:
    """l. 745-759: H100 / H200 (``is_sm90 = major == 9``)."""
    if n_blocks >= sms * 3:
        return m <= 64
    if n_blocks >= sms * 2:
        return m <= 48
    if n_blocks >= sms:
        return m <= 32
    if n_blocks >= sms // 2:
        if k >= n and n_blocks * 4 < sms * 3:
            return False
        return m <= 16
    return False


def _sm120(m: int, n: int, k: int, sms: int, n_blocks: int) -> bool:
    """l. 768-784: RTX 5000 series (sm120)."""
    if n_blocks >= sms * 3:
        return m <= 256
    if n_blocks >= sms * 2:
        return m <= 128
    if n_blocks * 5 >= sms * 4:
        return m <= (96 if k >= n else 64)
    if n_blocks >= sms:
        return m <= 64
    if n_blocks >= sms // 2:
        return m <= (64 if (k * 2 >= n and n_blocks >= 128) else 8)
    if k > n * 2 and n_blocks > 64:
        return m <= 16
    return m <= 8


def _fallback_tiers(m: int, n: int, k: int, sms: int, n_blocks: int) -> bool:
    """l. 786-811: sm89 (RTX 4090, L40S), sm121 under one wave, any other architecture."""
    tall_k_2xn = k > n * 2
    if n_blocks >= sms * 3:
        return m <= 256
    if n_blocks >= sms * 2:
        return m <= 128
    if n_blocks * 5 >= sms * 4:
        if tall_k_2xn or n_blocks >= 200:
            return m <= 128
        if k >= n:
            return m <= (128 if sms >= 60 else 32)
        return m <= 64
    if n_blocks >= sms // 2:
        if tall_k_2xn:
            return m <= 64
        return m <= 8 if n_blocks >= 64 else m <= 32
    if k > n and n_blocks <= 48:
        return m <= (12 if k >= n * 3 else 10)
    return m <= (16 if (tall_k_2xn or n_blocks < 48) else 8)
