"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, torch 2.11).

Pure Python, standard library only: it runs on the estimate path and inside the search.
``CachingAllocator.malloc``/``free`` follow the C++ retry order; ``replay_trace`` feeds a memory
snapshot's events through it to check the model against the allocator's own record.
"""

from memplan.costmodel.allocator.caching import CachingAllocator
from memplan.costmodel.allocator.config import AllocatorConfig, parse_alloc_conf
from memplan.costmodel.allocator.pool import Block, BlockPool
from memplan.costmodel.allocator.stats import AllocatorOOM, AllocatorStats
from memplan.costmodel.allocator.trace import ReplayResult, load_snapshot, replay_trace

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
