"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, torch 2.11).

Pure Python, standard library only: it runs on the estimate path and inside the search.
``CachingAllocator.malloc``/``free`` follow the C++ retry order; ``replay_trace`` feeds a memory
snapshot's events through it to check the model against the allocator's own record.
"""

from memplan.costmodel.allocator.caching import CachingAllocator
from memplan.costmodel.allocator.config import AllocatorConfig, parse_alloc_conf
from memplan.costmodel.allocator.pool import Block, BlockPool
from memplan.costmodel.allocator.stats import AllocatorOOM, AllocatorStats

_TRACE = ("ReplayResult", "load_snapshot", "replay_trace")  # the trace reader, off the estimate path


def __getattr__(name: str) -> object:
    """``load_snapshot``, ``replay_trace`` and ``ReplayResult``, imported when first asked for."""
    if name in _TRACE:
        from memplan.costmodel.allocator import trace

        return getattr(trace, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AllocatorConfig",
    "AllocatorOOM",
    "AllocatorStats",
    "Block",
    "BlockPool",
    "CachingAllocator",
    "ReplayResult",
    "load_snapshot",
    "parse_alloc_conf",
    "replay_trace",
]
