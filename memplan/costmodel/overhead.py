"""Memory outside the caching allocator, and the search's fast form of reserved memory.

``peak.reserved`` is what the allocator model holds when it replays the step
(``reserve.py``); the fixed overhead (CUDA context, workspaces, NCCL) lives outside it and is
subtracted from the capacity PyTorch sees. ``fast_reserved_bytes`` is the screen the search
applies to thousands of plans before the plans it reports are replayed.

Figures from ../shared/reference/published-figures.md ("Terms that estimators often miss"):
CUDA context 0.3-0.5 GB, each NCCL communicator about 0.5 GB, cuBLASLt workspace 32 MiB on
Hopper, caching-allocator reserved memory 1.05-1.10x allocated in 2 MiB-rounded segments.
They are defaults until validation runs calibrate them per GPU profile.
"""

from __future__ import annotations

MiB = 2**20
CUDA_CONTEXT_BYTES = 500 * MiB
CUBLAS_WORKSPACE_BYTES = 32 * MiB
NCCL_COMMUNICATOR_BYTES = 512 * MiB
ALLOCATOR_SLACK = 0.07  # midpoint-ish of the 1.05-1.10x reserved/allocated range
SEGMENT_BYTES = 2 * MiB


def communicators(dp: int, tp: int, pp: int, cp: int, ep: int) -> int:
    """Process groups with more than one rank each hold an NCCL communicator."""
    return (dp > 1) + (tp > 1) + (pp > 1) + (cp > 1) + (ep > 1)


def fixed_overhead_bytes(n_communicators: int) -> int:
    """CUDA context + cuBLAS workspace + NCCL communicators."""
    return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + n_communicators * NCCL_COMMUNICATOR_BYTES


def fast_reserved_bytes(allocated: int) -> int:
    """The search's screen: allocated x (1 + slack), rounded up to 2 MiB segments. Plans
    that are reported are replayed through the allocator model instead (``reserve.py``)."""
    with_slack = int(allocated * (1 + ALLOCATOR_SLACK))
    segments = -(-with_slack // SEGMENT_BYTES)
    return segments * SEGMENT_BYTES
