"""memplan's Triton kernels: FlashAttention-2 forward and backward (``memplan.kernels``).

The bundled trainer validates plans with these kernels, so the attention memory the planner
predicts for flash attention (the output and the fp32 log-sum-exp, never the s x s scores) is the
memory the kernel really uses. See docs/kernels.md.

    from memplan.kernels import flash_attention
    out = flash_attention(q, k, v, causal=True)  # q (b, q_heads, s, d); k, v (b, kv_heads, s, d)

Dispatch (``backend="auto"``): CUDA tensors on an NVIDIA GPU of compute capability 8.0 or newer
(Ampere, Hopper) with Triton importable run the Triton kernels; CPU tensors run them through
Triton's interpreter when ``TRITON_INTERPRET=1`` was set before the kernels were first loaded
(how CI tests them); anything else falls back to ``F.scaled_dot_product_attention``.
``kernel_available(q)`` says which one a tensor gets. Triton is imported only when the kernels
are first needed, so this package imports (and falls back) without it.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Literal

import torch

from .reference import check_attention_inputs, flash_attention_reference, sdpa_attention

Backend = Literal["auto", "triton", "fallback"]

__all__ = [
    "Backend",
    "flash_attention",
    "flash_attention_reference",
    "flash_attention_with_lse",
    "kernel_available",
]


@functools.cache
def triton_kernels() -> ModuleType | None:
    """The kernel module, or None where Triton is not installed (imported on first use)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from . import fused_attention

    return fused_attention


def _kernels_run_on(device_type: str, device_index: int | None) -> bool:
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False
        kernels = triton_kernels()
        return kernels is not None and kernels.INTERPRETED
    if device_type != "cuda" or torch.version.hip is not None:
        return False
    kernels = triton_kernels()
    if kernels is None:
        return False
    # the interpreter runs anywhere; compiled kernels need Ampere's bf16 tensor cores or newer
    return kernels.INTERPRETED or torch.cuda.get_device_capability(device_index) >= (8, 0)


# torch.compile takes the answer as a constant of the device instead of tracing the body (what
# torch.compiler.assume_constant_result sets; calling it would import torch._dynamo, and with it
# Triton, on `import memplan.kernels`)
_kernels_run_on._dynamo_marked_constant = True


def kernel_available(t: torch.Tensor) -> bool:
    """Whether attention on tensors like ``t`` runs memplan's Triton kernels under ``backend="auto"``."""
    return _kernels_run_on(t.device.type, t.device.index)


def _autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under ``torch.autocast``, q, k, v in its dtype, as autocast gives SDPA (a lower-precision op
    on CUDA and CPU): the trainer's bf16-mixed step RoPEs q and k against fp32 tables, so they
    arrive in fp32 beside a bf16 v. The op itself has no autocast rule."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    # autocast casts floating tensors but fp64 (at::autocast::is_eligible); the checks refuse the rest
    return tuple(t.to(dtype) if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t for t in (q, k, v))


def _use_kernels(q: torch.Tensor, backend: Backend) -> bool:
    if backend == "fallback":
        return False
    if backend == "auto":
        return kernel_available(q)
    if backend == "triton":
        if not kernel_available(q):
            raise ValueError(
                f"backend='triton' cannot run on {q.device} here: it needs Triton and a CUDA GPU of compute "
                "capability 8.0+, or CPU tensors with TRITON_INTERPRET=1 set before the kernels were loaded"
            )
        return True
    raise ValueError(f"backend must be 'auto', 'triton' or 'fallback', got {backend!r}")


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """softmax(q k^T * softmax_scale [+ causal mask]) v, differentiable; same shape, dtype as q.

    q: (batch, q_heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim) with q_heads a
    multiple of kv_heads (GQA / MQA; K/V are never repeated). float16, bfloat16 or float32;
    head_dim 1 to 256; any strides with a contiguous last dim. softmax_scale defaults to
    1/sqrt(head_dim). backend: "auto" (see ``kernel_available``), "triton" (ValueError where the
    kernels cannot run) or "fallback" (``F.scaled_dot_product_attention``). Bad inputs raise
    ValueError before anything runs. Under ``torch.autocast`` the inputs are cast to its dtype first.
    """
    q, k, v = _autocast(q, k, v)
    check_attention_inputs(q, k, v)
    if _use_kernels(q, backend):
        from .fused_attention import attention_with_lse

        return attention_with_lse(q, k, v, causal, softmax_scale)[0]
    return sdpa_attention(q, k, v, causal, softmax_scale)


def flash_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): ``flash_attention``'s output and the fp32 natural-log log-sum-exp of each row's
    scaled scores, (batch, q_heads, seq), both differentiable. Its fallback is the fp32 reference
    (``flash_attention_reference``, which materialises the scores) with out cast to q's dtype."""
    q, k, v = _autocast(q, k, v)
    check_attention_inputs(q, k, v)
    if _use_kernels(q, backend):
        from .fused_attention import attention_with_lse

        return attention_with_lse(q, k, v, causal, softmax_scale)
    out, lse = flash_attention_reference(q, k, v, causal, softmax_scale)
    return out.to(q.dtype), lse
