"""What the allocator model reports: its statistics and its out-of-memory error."""

from __future__ import annotations

from memplan.errors import MemplanError
from memplan.records import record


@record(slots=True)
class AllocatorStats:
    """A copy of the counters ``torch.cuda.memory_stats()`` reads (``DeviceStats``), in bytes.

    ``allocated`` counts whole blocks (a request rounded, or the unsplit block it was given);
    ``reserved`` is every cudaMalloc'd segment or mapped expandable page. ``segment_allocs`` counts
    ``segment_alloc`` events (cudaMalloc), ``segment_maps`` ``segment_map`` events; ``device_frees``
    counts cudaFree and unmap calls. ``cached_free`` is reserved memory in no block that is allocated
    or waiting on another stream; ``largest_free`` the largest such block (``cacheInfo``).
    """

    allocated: int
    reserved: int
    max_allocated: int
    max_reserved: int
    pending_free: int  # freed blocks whose streams (record_stream) have not finished
    cached_free: int
    largest_free: int
    segments: int  # live segments: cudaMalloc'd ones plus expandable segments
    segment_allocs: int
    segment_maps: int
    device_frees: int
    alloc_retries: int
    ooms: int
    reserved_by_stream: tuple[tuple[int, int], ...]  # (stream, reserved bytes), streams in order

    @property
    def segment_events(self) -> int:
        """Segment events a trace shows: ``segment_alloc`` plus ``segment_map``."""
        return self.segment_allocs + self.segment_maps


class AllocatorOOM(MemplanError):
    """``malloc`` ran out of memory after freeing every cached segment it could (``OutOfMemoryError``)."""

    def __init__(self, *, requested: int, alloc_size: int, stream: int, stats: AllocatorStats, capacity: int | None):
        self.requested = requested
        self.alloc_size = alloc_size
        self.stream = stream
        self.reserved = stats.reserved
        self.allocated = stats.allocated
        self.cached_free = stats.cached_free
        self.capacity = capacity
        limit = "unlimited" if capacity is None else f"{capacity} B"
        super().__init__(
            f"out of memory: tried to allocate {alloc_size} B ({requested} B requested) on stream {stream}; "
            f"capacity {limit}, {stats.allocated} B allocated, {stats.reserved} B reserved, "
            f"{stats.cached_free} B reserved but free"
        )
