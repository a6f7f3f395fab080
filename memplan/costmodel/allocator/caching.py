"""``CachingAllocator``: PyTorch's CUDA caching allocator (``DeviceCachingAllocator``), one device.

``malloc`` follows ``DeviceCachingAllocator::malloc`` of ``c10/cuda/CUDACachingAllocator.cpp``
(torch 2.11) step by step: round the size, pick the pool, ``get_free_block`` (best fit on this
stream), then the garbage-collection pass, ``alloc_block`` (a new segment, or more pages of an
expandable segment), ``release_available_cached_blocks`` and retry, ``release_cached_blocks``
(free every unused segment) and retry, and only then out of memory. ``free`` -> ``free_block``
merges the block with its free neighbours. The device is a capacity in bytes (``None``:
unlimited). Addresses only break ties between free blocks of one size: they are made up, or
asked of ``segment_address`` (a replay takes them from the trace, as the driver chose them).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable

from memplan.costmodel.allocator.config import AllocatorConfig, kMinBlockSize, kRoundLarge, kSmallSize
from memplan.costmodel.allocator.expandable import ExpandableSegment, ExpandableSegments
from memplan.costmodel.allocator.pool import Block, BlockPool, key_size, key_stream, merge_into
from memplan.costmodel.allocator.sizing import get_allocation_size, round_size
from memplan.costmodel.allocator.stats import AllocatorOOM, AllocatorStats
from memplan.errors import MemplanError

# Made-up addresses, above the 48-bit range real ones come from: cudaMalloc'd segments handed out
# downwards (as cudaMalloc mostly does), expandable segments' reservations upwards.
_VA_TOP = 1 << 60
_VA_EXPANDABLE = 1 << 52
DEFAULT_DEVICE_BYTES = 80 * 2**30  # sizes an expandable segment's virtual range when no capacity is given


def _expandable_size(block: Block) -> int:
    """``get_free_block``'s size of an expandable block for best fit: itself plus the unmapped range after it."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class CachingAllocator(ExpandableSegments):
    """One device's caching allocator: ``malloc``/``free`` blocks, stats as ``torch.cuda.memory_stats``."""

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        capacity_bytes: int | None = None,
        memory_fraction: float | None = None,
        segment_address: Callable[[int, int], int | None] | None = None,
        record_history: bool = False,
    ):
        self.config = config or AllocatorConfig()
        if memory_fraction is not None and capacity_bytes is None:
            raise ValueError("memory_fraction is a fraction of capacity_bytes: give both")
        if self.config.backend != "native":
            raise MemplanError("backend:cudaMallocAsync is CUDA's own pool allocator, not modelled", field="backend")
        self.capacity_bytes = capacity_bytes
        # where cudaMalloc puts a new segment of (size, stream); None or no answer: a made-up address
        self._segment_address = segment_address
        # setMemoryFraction: a cap on reserved bytes, and what garbage collection measures against
        self._allowed = None if memory_fraction is None else int(memory_fraction * (capacity_bytes or 0))
        self._pools = {True: BlockPool(small=True), False: BlockPool(small=False)}
        self._homes: dict[tuple[bool, int], tuple[list[int], list[Block], int]] = {}  # _home's tuples
        self._pending: dict[int, tuple[Block, set[int]]] = {}  # id(block) -> (block, streams still using it)
        self._expandable: dict[int, ExpandableSegment] = {}
        self._device_bytes = capacity_bytes or DEFAULT_DEVICE_BYTES
        self._va_down, self._va_up, self._next_segment = _VA_TOP, _VA_EXPANDABLE, 0
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        self.pending_bytes = self.segments = self.segment_allocs = self.segment_maps = 0
        self.device_frees = self.alloc_retries = self.ooms = 0
        self.reserved_by_stream: dict[int, int] = {}
        # (action, segment id, addr, size, stream) of each segment event, as a trace records them
        self.history: list[tuple[str, int, int, int, int]] | None = [] if record_history else None
        self._settings_of: AllocatorConfig | None = None  # the config the figures below were read from
        self._settings()

    def _settings(self) -> None:
        """What ``malloc`` reads of the config on every call, read once: a run requests the same few
        hundred sizes thousands of times, so each size's rounding, pool and segment size are kept
        (``_sizes``: size -> (rounded, small pool?, allocation size)). Read again if ``config`` is replaced."""
        config = self._settings_of = self.config
        self._sizes: dict[int, tuple[int, bool, int]] = {}
        self._max_split = config.max_split_bytes
        self._non_split_rounding = config.non_split_rounding_bytes
        self._gc = self._allowed is not None and config.garbage_collection_threshold > 0

    # --- malloc ------------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> Block:
        """``DeviceCachingAllocator::malloc``: a block of at least ``size`` bytes usable on ``stream``."""
        if size <= 0:
            raise ValueError(f"malloc of {size} B: PyTorch never calls the allocator for empty tensors")
        config = self.config
        if config is not self._settings_of:
            self._settings()
        sizes = self._sizes.get(size)
        if sizes is None:
            rounded = round_size(size, config)
            sizes = self._sizes[size] = (rounded, rounded <= kSmallSize, get_allocation_size(rounded, config))
        rounded, small, alloc_size = sizes
        pool = self._pools[small]
        # get_free_block, inlined (every request of a replay): the smallest cached block of this stream
        # with >= rounded bytes, within the max_split_size rules (fits_oversize_rules, sizing.py)
        if self._gc:
            pool.get_free_blocks_call_count += 1
        keys, blocks = pool.keys, pool.blocks
        i = bisect_left(keys, stream << 128 | rounded << 64)  # pool.lower_bound: key(stream, rounded), inlined
        block = None
        if i != len(keys) and keys[i] >> 128 == stream:  # key_stream, inlined
            if blocks[i].expandable:
                i = self._expandable_fit(pool, stream, i)
            if i is not None:
                found, max_split = blocks[i], self._max_split
                if found.size < max_split if rounded < max_split else found.size < rounded + self._non_split_rounding:
                    del keys[i], blocks[i]
                    block = found
        if block is None:
            if self._gc:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, stream, rounded, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, stream, rounded):
                block = self._alloc_block(pool, stream, rounded, alloc_size)
            if block is None and self._release_cached_blocks():
                block = self._alloc_block(pool, stream, rounded, alloc_size, retry=True)
        if block is None:
            self.ooms += 1
            raise AllocatorOOM(
                requested=size, alloc_size=alloc_size, stream=stream, stats=self.stats(), capacity=self.capacity_bytes
            )
        # should_split (sizing.py) and alloc_found_block, inlined: this runs for every request of a
        # replay, and a Python call costs ~430 instructions (benchmarks/bench_estimate.py --instructions)
        left = block.size - rounded
        if small or config.expandable_segments:
            split = left >= kMinBlockSize
        else:
            split = rounded < self._max_split and left > kSmallSize
        if split:  # hand out the front ``rounded`` bytes and cache the rest
            remaining = block
            block = Block(rounded, remaining.stream, remaining.addr, remaining.small, remaining.segment)
            block.expandable = remaining.expandable
            if not block.expandable:
                block.home = self._home(block.small, block.stream)
            prev = block.prev = remaining.prev  # the new block goes before the rest in its segment
            if prev is not None:
                prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.addr += rounded
            remaining.size = left
            self._pools[remaining.small].insert(remaining)
        block.allocated = True
        allocated = self.allocated = self.allocated + block.size
        if allocated > self.max_allocated:
            self.max_allocated = allocated
        return block

    def _expandable_fit(self, pool: BlockPool, stream: int, i: int) -> int | None:
        """``get_free_block`` from the expandable block at ``i`` (the lower bound of this stream's
        request): with expandable segments, the smallest counting the unmapped space after it; with
        them turned off since, the first non-expandable block of the stream (``None`` if none)."""
        keys, blocks = pool.keys, pool.blocks
        if self.config.expandable_segments:
            j = i + 1
            while (
                blocks[i].expandable
                and j < len(keys)
                and key_stream(keys[j]) == stream
                and _expandable_size(blocks[j]) < _expandable_size(blocks[i])
            ):
                i, j = j, j + 1
            return i
        i += 1
        while i < len(keys) and blocks[i].expandable and key_stream(keys[i]) == stream:
            i += 1
        if i == len(keys) or key_stream(keys[i]) != stream:
            return None
        return i

    def _alloc_block(
        self, pool: BlockPool, stream: int, size: int, alloc_size: int, retry: bool = False
    ) -> Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` (cudaMalloc), or, with expandable segments,
        ``size`` bytes mapped into this stream's segment; ``None`` when the device has no room."""
        if retry:
            self.alloc_retries += 1
        if self._allowed is not None and self.reserved + alloc_size > self._allowed:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size)
        if self.capacity_bytes is not None and self.reserved + alloc_size > self.capacity_bytes:
            return None
        addr = self._segment_address(alloc_size, stream) if self._segment_address else None
        if addr is None:
            self._va_down -= -(-alloc_size // kRoundLarge) * kRoundLarge
            addr = self._va_down
        block = Block(alloc_size, stream, addr, pool.small, self._new_segment())
        block.home = self._home(pool.small, stream)
        self._add_reserved(alloc_size, stream)
        self.segments += 1
        self.segment_allocs += 1
        self._record("segment_alloc", block.segment, addr, alloc_size, stream)
        return block

    def _home(self, small: bool, stream: int) -> tuple[list[int], list[Block], int]:
        """A block's ``home`` (``Block``): its pool's sorted key and block lists and its stream's key bits,
        one tuple per (pool, stream), which ``run.run_events``' free reads in one attribute."""
        home = self._homes.get((small, stream))
        if home is None:
            pool = self._pools[small]
            home = self._homes[small, stream] = (pool.keys, pool.blocks, stream << 128)
        return home

    # --- free --------------------------------------------------------------------------------

    def free(self, block: Block, pending_streams: Iterable[int] = ()) -> None:
        """``free``: the block is no longer allocated; it returns to its pool (``free_block``) now, or,
        if it was used on other streams (``record_stream``), once those streams finish (see
        :meth:`process_events`, :meth:`complete_free`). The pool may reuse the ``Block`` object for a
        later allocation or a free remainder: do not read it after freeing it."""
        if not block.allocated:
            raise ValueError(f"block at {block.addr:#x} is not allocated")
        block.allocated = False
        self.allocated -= block.size
        if not pending_streams:  # the common case (no streams given): used on its own stream only
            self._free_block(block)
            return
        streams = set(pending_streams) - {block.stream}
        if not streams:
            self._free_block(block)
            return
        block.event_count = len(streams)
        self.pending_bytes += block.size
        self._pending[id(block)] = (block, streams)

    def process_events(self, completed_streams: Iterable[int] | None = None) -> None:
        """``process_events``: complete the deferred frees whose streams have all finished
        (``None``: every stream, as ``synchronize_and_free_events`` does)."""
        done = None if completed_streams is None else set(completed_streams)
        for block, streams in list(self._pending.values()):
            if done is not None:
                streams -= done
                block.event_count = len(streams)
            if done is None or not streams:
                self.complete_free(block)

    def complete_free(self, block: Block) -> None:
        """Complete one deferred free now (a trace's ``free_completed``)."""
        if self._pending.pop(id(block), None) is None:
            raise ValueError(f"block at {block.addr:#x} has no deferred free")
        block.event_count = 0
        self.pending_bytes -= block.size
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours of the segment and cache it in its pool."""
        pool = self._pools[block.small]
        # merge_into's test of the neighbour, first here: most neighbours are allocated
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            merge_into(block, prev, pool)
        if nxt is not None and not nxt.allocated:
            merge_into(block, nxt, pool)
        # pool.insert, inlined (every free of a replay comes here)
        block.gc_count_base = pool.get_free_blocks_call_count
        keys = pool.keys
        block.key = k = block.stream << 128 | block.size << 64 | block.addr
        i = bisect_left(keys, k)
        keys.insert(i, k)
        pool.blocks.insert(i, block)

    # --- giving memory back ------------------------------------------------------------------

    def empty_cache(self) -> None:
        """``emptyCache``: free every cached segment that holds no block in use; unmap free pages."""
        self._release_cached_blocks()

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size`` set, cudaFree one oversize cached
        segment big enough for size, else the largest ones of this stream until enough is freed."""
        max_split = self.config.max_split_size
        if max_split is None:
            return False
        keys, blocks = pool.keys, pool.blocks
        wanted = max(size, max_split)
        i = pool.lower_bound(stream, wanted)
        if i < len(keys) and key_stream(keys[i]) == stream and not blocks[i].expandable:
            self._release_block(blocks[i])
            return True
        released = 0
        while i > 0 and released < wanted and key_size(keys[i - 1]) >= max_split and key_stream(keys[i - 1]) == stream:
            i -= 1
            if not blocks[i].expandable:
                released += blocks[i].size
                self._release_block(blocks[i])
        return released >= wanted

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks``: wait for every stream, then free all unsplit cached segments and
        unmap the free pages of expandable ones (``release_blocks``)."""
        self.process_events(None)
        for pool in (self._pools[False], self._pools[True]):
            to_unmap = []
            for block in list(pool.blocks):
                if block.expandable:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and not block.is_split():
                    pool.remove_unmapped(block)  # release_expandable_segment
                    del self._expandable[block.segment]
                    self.segments -= 1
        return True

    def _release_block(self, block: Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        self._pools[block.small].remove(block)
        self._add_reserved(-block.size, block.stream)
        self.segments -= 1
        self.device_frees += 1
        self._record("segment_free", block.segment, block.addr, block.size, block.stream)

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: past ``garbage_collection_threshold`` x the allowed memory,
        cudaFree unsplit large cached segments not reused for longer than average, oldest first."""
        threshold = int(self.config.garbage_collection_threshold * (self._allowed or 0))
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self._pools[False]
        ages = [pool.get_free_blocks_call_count - b.gc_count_base for b in pool.blocks if not b.is_split()]
        total_age, count, freed = sum(ages), len(ages), True
        while reclaimed < target and freed and count > 0:
            age_threshold, freed = total_age / count, False
            for block in list(pool.blocks):
                age = pool.get_free_blocks_call_count - block.gc_count_base
                if not block.is_split() and not block.expandable and age >= age_threshold:
                    freed, reclaimed, total_age, count = True, reclaimed + block.size, total_age - age, count - 1
                    self._release_block(block)

    # --- stats -------------------------------------------------------------------------------

    def _new_segment(self) -> int:
        self._next_segment += 1
        return self._next_segment

    def _record(self, action: str, segment: int, addr: int, size: int, stream: int) -> None:
        if self.history is not None:
            self.history.append((action, segment, addr, size, stream))

    def _add_reserved(self, size: int, stream: int) -> None:
        self.reserved += size
        self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + size
        if self.reserved > self.max_reserved:
            self.max_reserved = self.reserved

    def reset_peak(self) -> None:
        """``resetPeakStats``: the peaks restart from the current values."""
        self.max_allocated, self.max_reserved = self.allocated, self.reserved

    def stats(self) -> AllocatorStats:
        """The counters now, as a frozen :class:`AllocatorStats`. Cached but free is what is reserved
        less what is allocated or waiting on another stream: every reserved byte (a cudaMalloc'd segment,
        a mapped page) lies in exactly one block, allocated, deferred or cached (mapped pages hold no
        unmapped block), so this equals the pools' blocks summed (``BlockPool.cached_bytes``,
        ``tests/unit/test_allocator_run.py`` holds the two equal) without walking them: a replay asks at
        each new peak."""
        return stats_of(self.counters())

    def counters(self) -> tuple:
        """What :meth:`stats` reads, as a plain tuple (``stats_of`` makes it the :class:`AllocatorStats`):
        a replay notes it at each of its new allocated peaks (94 in the 8B run) and makes the stats of
        the last one only: a ``stats()`` counted ~64,000 instructions (callgrind, 100 calls on the 8B
        replay's final state); noting this tuple instead took 4.3 M off that replay (~46,000 a peak)."""
        small, large = self._pools[True].largest(), self._pools[False].largest()
        return (
            self.allocated,
            self.reserved,
            self.max_allocated,
            self.max_reserved,
            self.pending_bytes,
            small if small > large else large,
            self.segments,
            self.segment_allocs,
            self.segment_maps,
            self.device_frees,
            self.alloc_retries,
            self.ooms,
            self.reserved_by_stream.copy(),
        )


def stats_of(counters: tuple) -> AllocatorStats:
    """The :class:`AllocatorStats` of :meth:`CachingAllocator.counters`' tuple."""
    (allocated, reserved, max_allocated, max_reserved, pending, largest, *counts, by_stream) = counters
    segments, segment_allocs, segment_maps, device_frees, alloc_retries, ooms = counts
    return AllocatorStats(
        allocated=allocated,
        reserved=reserved,
        max_allocated=max_allocated,
        max_reserved=max_reserved,
        pending_free=pending,
        cached_free=reserved - allocated - pending,
        largest_free=largest,
        segments=segments,
        segment_allocs=segment_allocs,
        segment_maps=segment_maps,
        device_frees=device_frees,
        alloc_retries=alloc_retries,
        ooms=ooms,
        reserved_by_stream=tuple(sorted((s, b) for s, b in by_stream.items() if b)),
    )
