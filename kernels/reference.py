"""The attention op's contract: input checks, an fp32 reference, and the SDPA fallback.

``softmax(q k^T * softmax_scale + causal mask) v`` on (batch, heads, seq, head_dim) tensors, the
query heads a multiple of the K/V heads (GQA: query head ``h`` attends with K/V head
``h // (q_heads // kv_heads)``). The checks are the same on every backend, so an input the CPU
fallback accepts runs on the GPU kernels too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # the kernels' largest head dim (tiles of 256 still fit in shared memory)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError unless q, k, v are (batch, heads, seq, head_dim) tensors the op accepts."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} needs a contiguous last dim (stride 1), got strides {tuple(t.stride())}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} shapes differ")
    (b, hq, s, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or head_dim")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} unsupported: 1 to {MAX_HEAD_DIM}")


def default_scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    """1/sqrt(head_dim) unless given (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def flash_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, softmax_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in fp32 by plain math: repeated K/V heads and the full s x s scores (the
    reference the tests hold the kernels to, differentiable by autograd)."""
    check_attention_inputs(q, k, v)
    group = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * default_scale(q, softmax_scale)  # (b, h, s, s)
    if causal:
        s = q.shape[2]
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, softmax_scale: float | None = None
) -> torch.Tensor:
    """The fallback where the Triton kernels cannot run: PyTorch's SDPA, K/V heads unrepeated."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=default_scale(q, softmax_scale), enable_gqa=q.shape[1] != k.shape[1]
    )
