"""Expandable segments: one reserved virtual range per stream and pool, its pages mapped on demand.

With ``expandable_segments:True`` the allocator keeps, per stream and pool, a virtual range of
9/8 of the device's memory and maps physical pages into it as it grows: kSmallBuffer (2 MiB)
pages for the small pool, kLargeBuffer (20 MiB, ``large_segment_size_mb``) pages for the large
one (``CUDACachingAllocator.cpp``, Note [Expandable Segments]). Each map is a ``segment_map``
event of a trace, each unmap a ``segment_unmap``. :class:`ExpandableSegment` is the page table
(``struct ExpandableSegment``); :class:`ExpandableSegments` holds the allocator's methods that use
it (``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``, ``unmap_block``).
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.allocator.config import AllocatorConfig, kSmallBuffer
from memplan.costmodel.allocator.pool import Block, BlockPool, merge_into


class ExpandableSegment:
    """The page table of one expandable segment: which ``page_size`` pages of its range are mapped
    (written out with ``__slots__``, as ``pool.Block`` is: no dataclass compiled at import)."""

    __slots__ = ("segment", "stream", "small", "base", "page_size", "max_pages", "mapped")

    def __init__(self, segment: int, stream: int, small: bool, base: int, page_size: int, max_pages: int) -> None:
        self.segment = segment
        self.stream = stream
        self.small = small
        self.base = base
        self.page_size = page_size
        self.max_pages = max_pages
        self.mapped = bytearray(max_pages)

    @property
    def size(self) -> int:
        """``ExpandableSegment::size``: the whole virtual range, mapped or not."""
        return self.max_pages * self.page_size

    def pages_to_map(self, addr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::map``'s range: the pages [begin, end) covering [addr, addr + size)."""
        begin = (addr - self.base) // self.page_size
        end = -(-(addr + size - self.base) // self.page_size)
        return begin, end

    def pages_to_unmap(self, addr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::unmap``'s range: the pages lying wholly inside [addr, addr + size)."""
        begin = -(-(addr - self.base) // self.page_size)
        end = (addr + size - self.base) // self.page_size
        return begin, end

    def set_mapped(self, begin: int, end: int, mapped: bool) -> None:
        value = 1 if mapped else 0
        for page in range(begin, end):
            if self.mapped[page] == value:
                raise ValueError(f"page {page} of segment {self.segment} is already in that state")
            self.mapped[page] = value

    def mapped_bytes(self) -> int:
        return sum(self.mapped) * self.page_size


def _allocatable(block: Block | None) -> bool:
    """``find_expandable_block``'s test: a block that can become part of a new allocation."""
    return block is not None and not block.allocated and block.event_count == 0


class ExpandableSegments:
    """The :class:`~memplan.costmodel.allocator.caching.CachingAllocator` methods for expandable segments.

    A mixin: it reads and updates the allocator's state (pools, reserved bytes, counters).
    """

    config: AllocatorConfig
    capacity_bytes: int | None
    reserved: int
    segments: int
    segment_maps: int
    device_frees: int
    _pools: dict[bool, BlockPool]
    _expandable: dict[int, ExpandableSegment]
    _device_bytes: int
    _va_up: int

    _new_segment: Callable[[], int]
    _add_reserved: Callable[[int, int], None]
    _record: Callable[[str, int, int, int, int], None]

    def _try_allocate_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages until a free run of >= size bytes exists."""
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if nxt is None or not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map_block merged the free block before it into it
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        """``find_expandable_block``: the lowest unmapped range (with the free block before it) that
        has room for size, or a new expandable segment for this stream and pool."""
        for candidate in pool.unmapped_of(stream):
            if _allocatable(candidate.prev):
                candidate = candidate.prev
            room, block = 0, candidate
            while room < size and _allocatable(block):
                room += block.size
                block = block.next
            if room >= size:
                return candidate
        page = kSmallBuffer if pool.small else self.config.large_segment_size
        pages = -(-(self._device_bytes + self._device_bytes // 8) // page)
        segment = ExpandableSegment(self._new_segment(), stream, pool.small, self._va_up, page, pages)
        self._va_up += segment.size
        self._expandable[segment.segment] = segment
        self.segments += 1
        candidate = Block(segment.size, stream, segment.base, pool.small, segment.segment, mapped=False)
        candidate.expandable = True
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, block: Block, size: int) -> bool:
        """``map_block``: map the pages under the first ``size`` bytes of an unmapped range, merge the
        result with free neighbours and cache it; False when the device has no room."""
        segment = self._expandable[block.segment]
        begin, end = segment.pages_to_map(block.addr, size)
        mapped = (end - begin) * segment.page_size
        if self.capacity_bytes is not None and self.reserved + mapped > self.capacity_bytes:
            return False
        segment.set_mapped(begin, end, True)
        pool = self._pools[block.small]
        pool.remove_unmapped(block)
        start, block.mapped = block.addr, True
        if mapped < block.size:
            rest = Block(block.size - mapped, block.stream, block.addr + mapped, block.small, block.segment)
            rest.mapped, rest.expandable = False, True
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.insert_unmapped(rest)
            block.size = mapped
        merge_into(block, block.prev, pool)
        merge_into(block, block.next, pool)
        pool.insert(block)
        self._add_reserved(mapped, block.stream)
        self.segment_maps += 1
        self._record("segment_map", block.segment, start, mapped, block.stream)
        return True

    def _unmap_block(self, block: Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free expandable block, keeping the edges cached."""
        segment = self._expandable[block.segment]
        begin, end = segment.pages_to_unmap(block.addr, block.size)
        if begin >= end:
            return
        pool = self._pools[block.small]
        pool.remove(block)
        start, size = segment.base + begin * segment.page_size, (end - begin) * segment.page_size
        before, after = start - block.addr, block.addr + block.size - (start + size)
        if before > 0:  # prev? -> before -> block
            edge = Block(before, block.stream, block.addr, block.small, block.segment, expandable=True)
            edge.prev, edge.next = block.prev, block
            if block.prev is not None:
                block.prev.next = edge
            block.prev = edge
            pool.insert(edge)
        if after > 0:  # block -> after -> next?
            edge = Block(after, block.stream, start + size, block.small, block.segment, expandable=True)
            edge.prev, edge.next = block, block.next
            if block.next is not None:
                block.next.prev = edge
            block.next = edge
            pool.insert(edge)
        block.addr, block.size, block.mapped = start, size, False
        merge_into(block, block.prev, pool)
        merge_into(block, block.next, pool)
        pool.insert_unmapped(block)
        segment.set_mapped(begin, end, False)
        self._add_reserved(-size, block.stream)
        self.device_frees += 1
        self._record("segment_unmap", block.segment, start, size, block.stream)
