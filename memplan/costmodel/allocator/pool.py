"""``Block`` and ``BlockPool``: the allocator's free lists, as in ``CUDACachingAllocator.cpp``.

A segment (one cudaMalloc, or one expandable segment's address range) is a doubly linked list
of blocks in address order; free blocks also sit in their pool, a set ordered by
(stream, size, address) (``BlockComparatorSize``), so a lower bound on (stream, size) is the
best fit. Here the set is a sorted list of keys searched with :mod:`bisect`: pools hold
hundreds to a few thousand free blocks, where inserting into a list beats a tree in Python.
A key is the triple packed into one integer, ``stream << 128 | size << 64 | address``
(:func:`key`; sizes and addresses are below 2**64), which orders as the tuple does and compares
in one C call where a tuple compares element by element: a replay does ~50,000 such searches.
"""

from __future__ import annotations

from bisect import bisect_left

_SIZE = 1 << 64  # a key's size unit; the address is what is left


def key(stream: int, size: int, addr: int = 0) -> int:
    """The pool key of (stream, size, address): ordered as the tuple (module docstring)."""
    return stream << 128 | size << 64 | addr


def key_stream(k: int) -> int:
    return k >> 128


def key_size(k: int) -> int:
    return (k >> 64) & (_SIZE - 1)


class Block:
    """``Block``: a piece of a segment, allocated or free; blocks compare by identity.

    Written out with ``__slots__`` rather than as a slotted dataclass: a dataclass's generated methods
    are compiled from source when the module is imported, on every ``memplan estimate``."""

    __slots__ = (
        "size", "stream", "addr", "small", "segment", "allocated", "mapped", "expandable", "event_count",
        "gc_count_base", "prev", "next", "key", "home",
    )  # fmt: skip
    # What ``run.run_events`` reads instead of building or looking up (neither is the allocator's state):
    # ``key``, its pool key (``key()``), written whenever it goes into a pool's sorted lists and read only
    # while it is there (a free neighbour a free merges is found by it); unset on a block never cached.
    # ``home``, its pool's key and block lists and its stream's key bits (``CachingAllocator._home``),
    # set by ``CachingAllocator`` on the blocks it makes outside expandable segments (None on those).

    def __init__(
        self,
        size: int,
        stream: int,
        addr: int,
        small: bool,  # which pool: small (<= 1 MiB requests) or large
        segment: int,  # id of the segment (cudaMalloc or expandable segment) it belongs to
        allocated: bool = False,
        mapped: bool = True,  # False: unmapped address space of an expandable segment
        expandable: bool = False,
        event_count: int = 0,  # streams (record_stream) whose work must finish before the free completes
        gc_count_base: int = 0,  # pool's get_free_block count when it was cached (garbage collection)
        prev: Block | None = None,
        next: Block | None = None,  # noqa: A002 (the segment's next block, as the C++ struct names it)
    ) -> None:
        self.size = size
        self.stream = stream
        self.addr = addr
        self.small = small
        self.segment = segment
        self.allocated = allocated
        self.mapped = mapped
        self.expandable = expandable
        self.event_count = event_count
        self.gc_count_base = gc_count_base
        self.prev = prev
        self.next = next
        self.home = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in Block.__slots__[:-4])
        return f"Block({fields})"

    def is_split(self) -> bool:
        """``Block::is_split``: part of a segment that holds other blocks too."""
        return self.prev is not None or self.next is not None

    def free_to_merge(self) -> bool:
        """What ``try_merge_blocks`` asks of a neighbour: free, no pending stream uses."""
        return not self.allocated and self.event_count == 0


class BlockPool:
    """``BlockPool``: the free, mapped blocks of one pool (small or large) over all streams,
    and the unmapped ranges of its expandable segments (ordered by stream, address)."""

    __slots__ = ("small", "keys", "blocks", "unmapped", "unmapped_blocks", "get_free_blocks_call_count")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []  # key(stream, size, addr), sorted
        self.blocks: list[Block] = []  # the block of each key, same order
        self.unmapped: list[tuple[int, int]] = []  # (stream, addr), sorted
        self.unmapped_blocks: list[Block] = []
        self.get_free_blocks_call_count = 0

    def insert(self, block: Block) -> None:
        """``insert_into_blocks``: cache a free block, noting the call count for garbage collection."""
        block.gc_count_base = self.get_free_blocks_call_count
        block.key = k = block.stream << 128 | block.size << 64 | block.addr  # key(), inlined
        i = bisect_left(self.keys, k)
        self.keys.insert(i, k)
        self.blocks.insert(i, block)

    def remove(self, block: Block) -> None:
        i = bisect_left(self.keys, block.stream << 128 | block.size << 64 | block.addr)
        if i == len(self.keys) or self.blocks[i] is not block:
            raise KeyError(f"block at {block.addr:#x} is not in the pool")
        del self.keys[i]
        del self.blocks[i]

    def lower_bound(self, stream: int, size: int) -> int:
        """Index of the first free block of ``stream`` with at least ``size`` bytes (len if none)."""
        return bisect_left(self.keys, key(stream, size))

    def insert_unmapped(self, block: Block) -> None:
        key = (block.stream, block.addr)
        i = bisect_left(self.unmapped, key)
        self.unmapped.insert(i, key)
        self.unmapped_blocks.insert(i, block)

    def remove_unmapped(self, block: Block) -> None:
        i = bisect_left(self.unmapped, (block.stream, block.addr))
        if i == len(self.unmapped) or self.unmapped_blocks[i] is not block:
            raise KeyError(f"unmapped block at {block.addr:#x} is not in the pool")
        del self.unmapped[i]
        del self.unmapped_blocks[i]

    def unmapped_of(self, stream: int) -> list[Block]:
        """The unmapped ranges of ``stream``'s expandable segments, lowest address first."""
        i = bisect_left(self.unmapped, (stream,))
        j = bisect_left(self.unmapped, (stream + 1,))
        return self.unmapped_blocks[i:j]

    def cached_bytes(self) -> int:
        """The cached blocks' bytes, summed when asked (no running sum: it cost an update at every malloc
        and free of a replay; ``CachingAllocator.stats`` has the total from its counters)."""
        return sum([block.size for block in self.blocks])

    def largest(self) -> int:
        """The largest cached block: the last key of each stream's run (keys sort by stream, size)."""
        best, i = 0, 0
        while i < len(self.keys):
            stream = key_stream(self.keys[i])
            j = bisect_left(self.keys, (stream + 1) << 128)
            best = max(best, key_size(self.keys[j - 1]))
            i = j
        return best


def merge_into(dst: Block, src: Block | None, pool: BlockPool) -> int:
    """``try_merge_blocks``: absorb free neighbour ``src`` into ``dst``; the bytes absorbed (0 if none).

    ``src`` must be free with no pending stream uses, and mapped exactly when ``dst`` is; it leaves
    its pool (or the unmapped set).
    """
    if src is None or src.allocated or src.event_count or src.mapped != dst.mapped:  # not free_to_merge()
        return 0
    if src.mapped:  # pool.remove, inlined
        keys = pool.keys
        i = bisect_left(keys, src.stream << 128 | src.size << 64 | src.addr)
        if i == len(keys) or pool.blocks[i] is not src:
            raise KeyError(f"block at {src.addr:#x} is not in the pool")
        del keys[i], pool.blocks[i]
    else:
        pool.remove_unmapped(src)
    if dst.prev is src:
        dst.addr = src.addr
        dst.prev = src.prev
        if dst.prev is not None:
            dst.prev.next = dst
    else:
        dst.next = src.next
        if dst.next is not None:
            dst.next.prev = dst
    dst.size += src.size
    return src.size
