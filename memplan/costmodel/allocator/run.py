"""A whole run of allocations and frees through one :class:`CachingAllocator`, in one Python frame.

``reserve.replay`` feeds an op-level run (~32,000 events for an 8B step) through the allocator, on
every ``memplan estimate``. Called event by event, ``malloc`` and ``free`` -> ``free_block`` ->
``try_merge_blocks`` cost four Python calls and a ``Block`` dataclass per split, more than the
allocator's own work. :func:`run_events` does the two common cases in its own loop, on the
allocator's own pools and blocks (one state, no copy of it):

- ``malloc`` served by a cached block (``get_free_block``'s best fit: the first pool key at or
  above (stream, size)), split when ``should_split`` says so (``alloc_found_block``);
- ``free`` -> ``free_block``: merged with its free neighbours and cached.

Everything else goes through :meth:`CachingAllocator.malloc` / :meth:`~CachingAllocator.free`
themselves: a request no cached block serves (a new segment, the garbage collection pass, the
retries, out of memory), and every event of an allocator whose settings the two paths above do not
follow (expandable segments, ``max_split_size``, ``garbage_collection_threshold``). Each path is
``CUDACachingAllocator.cpp``'s (torch 2.11) step for step, so the result is the allocator's to the
byte: ``tests/unit/test_allocator_run.py`` holds every block, key and counter against the
event-by-event calls.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from memplan.costmodel.allocator.caching import CachingAllocator, stats_of
from memplan.costmodel.allocator.config import SIZE_MAX, kMinBlockSize, kSmallSize
from memplan.costmodel.allocator.pool import Block
from memplan.costmodel.allocator.stats import AllocatorOOM, AllocatorStats

ALLOC, FREE = 0, 1  # ``timeline.events``' op codes; any other op is handed to ``on_other``


class RunPeak(NamedTuple):
    """Where a run's allocated bytes were highest, and the allocator's state there.

    ``event``: the index of the first allocation that reached the highest allocated bytes (-1 if
    none raised it above the start); ``stats``: the allocator just after it (taken before the next
    free: allocations only raise ``allocated``); ``oom``: the index of the request the allocator
    could not serve, where the run stopped (with ``error``), else -1."""

    high: int
    event: int
    stats: AllocatorStats
    oom: int = -1
    error: AllocatorOOM | None = None


def _follows_fast_paths(alloc: CachingAllocator) -> bool:
    """Whether the allocator's settings and state are those the loop's own paths follow: no expandable
    segments (and none left from earlier settings), no ``max_split_size`` (a cached block of any
    size serves a smaller request, ``fits_oversize_rules``), no garbage collection count to keep (nor
    one kept under earlier settings: every block's ``gc_count_base`` is then 0, the count it would be
    given), no free waiting on another stream (every block's ``event_count`` is 0)."""
    config = alloc.config
    return (
        config is alloc._settings_of
        and not config.expandable_segments
        and not alloc._expandable
        and config.max_split_bytes == SIZE_MAX
        and not alloc._gc
        and not alloc._pending
        and not any(pool.get_free_blocks_call_count for pool in alloc._pools.values())
    )


def run_events(
    alloc: CachingAllocator,
    events: Sequence[tuple],
    stream_ids: Mapping[object, int],
    on_other: Callable[[int, tuple], None] | None = None,
) -> RunPeak:
    """Feed ``events`` (``(op, tensor, size, _, stream, _)`` tuples, ``timeline.events.Event``) to
    ``alloc``: ``ALLOC`` mallocs ``size`` bytes on ``stream_ids[stream]`` for ``tensor``, ``FREE``
    frees that tensor's block; any other event is passed to ``on_other(index, event)`` (a mark).
    Stops at the first request the allocator cannot serve. Returns the allocated peak."""
    if not _follows_fast_paths(alloc):
        return _run_calls(alloc, events, stream_ids, on_other)
    pools = alloc._pools
    sizes_of = alloc._sizes
    malloc, counters = alloc.malloc, alloc.counters  # the peak's state as counters, its stats made once
    # each pool's key and block lists, by ``Block.small``
    lists = {small: (pool.keys, pool.blocks) for small, pool in pools.items()}
    # stream -> (its number, its pool keys' high bits, its sizes), in a plain dict: the interpreter's fast path
    streams: dict[object, tuple[int, int, dict]] = {}
    # what a lookup past the end of the pool finds: a block of no stream (its stream's test fails)
    beyond = Block(0, -1, 0, False, 0)
    current = object()  # the stream of the last allocation: consecutive ones mostly share it
    live: dict[int, Block] = {}
    spare: list[Block] = []  # blocks a merge absorbed, reused by the next splits
    # allocated and max_allocated kept here between the calls that read or set them on ``alloc``
    allocated, top = alloc.allocated, alloc.max_allocated
    high, peak_event, at_peak, pending = allocated, -1, counters(), False
    bar = top if top < high else high  # an allocation above it raises max_allocated or the run's peak
    for i, (op, tensor, size, _, stream, _) in enumerate(events):
        if not op:  # ALLOC
            if stream is not current:
                ids = streams.get(stream)
                if ids is None:
                    sid = stream_ids[stream]
                    ids = streams[stream] = (sid, sid << 128, {})
                sid, stream_bits, hot = ids
                current = stream
            # size -> (rounded, its lowest key on this stream, small, its pool's keys and blocks); a size
            # first seen on this stream goes to ``malloc`` (no lookup's result to test on the common path)
            try:
                rounded, low, small, keys, blocks = hot[size]
            except KeyError:
                pass
            else:  # get_free_block, inlined: the first key at or above (stream, rounded)
                j = bisect_left(keys, low)
                try:
                    block = blocks[j]
                except IndexError:  # no key at or above it: no cached block serves it
                    block = beyond
                # a block of this stream: its number compared (one-digit integers, the interpreter's
                # specialised compare), not its key with the next stream's first (five digits)
                if block.stream == sid:
                    size_found = block.size
                    left = size_found - rounded
                    if left >= kMinBlockSize if small else left > kSmallSize:  # should_split
                        rest = block  # the front ``rounded`` bytes are handed out, the rest cached
                        addr = rest.addr
                        if spare:
                            block = spare.pop()
                            block.size, block.stream, block.addr, block.small = rounded, sid, addr, small
                            block.segment = rest.segment
                        else:
                            block = Block(rounded, sid, addr, small, rest.segment)
                        block.home = rest.home
                        prev = block.prev = rest.prev
                        if prev is not None:
                            prev.next = block
                        block.next = rest
                        rest.prev = block
                        addr = rest.addr = addr + rounded
                        rest.size = left
                        # pool.insert, inlined: the rest's key is below the found block's, still at j; most
                        # often above the key before it (so above every key before it), and the rest takes
                        # its place in the lists: one compare, not a bisection
                        rest.key = k = stream_bits | left << 64 | addr
                        if j and keys[j - 1] > k:
                            del keys[j], blocks[j]
                            j = bisect_left(keys, k, 0, j)
                            keys.insert(j, k)
                            blocks.insert(j, rest)
                        else:
                            keys[j] = k
                            blocks[j] = rest
                        allocated += rounded
                    else:
                        del keys[j], blocks[j]
                        allocated += size_found
                    block.allocated = True
                    live[tensor] = block
                    if allocated > bar:
                        if allocated > top:
                            top = allocated
                        if allocated > high:
                            high, peak_event, pending = allocated, i, True
                        bar = top if top < high else high
                    continue
            # the allocator's own malloc: a new segment, its retries, out of memory
            alloc.allocated, alloc.max_allocated = allocated, top
            try:
                block = malloc(size, sid)
            except AllocatorOOM as error:
                return RunPeak(high, peak_event, stats_of(counters() if pending else at_peak), i, error)
            allocated, top = alloc.allocated, alloc.max_allocated
            if size not in hot:
                rounded, small, _ = sizes_of[size]
                keys, blocks = lists[small]
                hot[size] = (rounded, stream_bits | rounded << 64, small, keys, blocks)
            live[tensor] = block
            if allocated > high:
                high, peak_event, pending = allocated, i, True
            bar = top if top < high else high
        elif op == FREE:
            block = live.pop(tensor)  # a tensor freed twice, or never allocated: KeyError
            if pending:
                alloc.allocated, alloc.max_allocated = allocated, top
                at_peak, pending = counters(), False
            block.allocated = False  # live holds allocated blocks only: free's test is not needed
            size = block.size
            allocated -= size
            keys, blocks, high_bits = block.home  # its neighbours' too: a segment is one stream's, one pool's
            # free_block, inlined: try_merge_blocks with each free neighbour (none has pending stream uses).
            # The key of the last neighbour merged stays in the lists (at ``hole``) until the block's own
            # key is placed: that key is above it (the block is now larger), and most often it takes its place.
            prev, nxt, hole = block.prev, block.next, -1
            if prev is not None and not prev.allocated:
                hole = bisect_left(keys, prev.key)
                size += prev.size
                block.addr = prev.addr
                spare.append(prev)
                prev = block.prev = prev.prev
                if prev is not None:
                    prev.next = block
            if nxt is not None and not nxt.allocated:
                j = bisect_left(keys, nxt.key)
                if hole >= 0:  # both neighbours merged: the previous one's key goes now
                    del keys[hole], blocks[hole]
                    if j > hole:
                        j -= 1
                hole = j
                size += nxt.size
                spare.append(nxt)
                nxt = block.next = nxt.next
                if nxt is not None:
                    nxt.prev = block
            block.size = size
            block.key = k = high_bits | size << 64 | block.addr
            if hole < 0:
                j = bisect_left(keys, k)
                keys.insert(j, k)
                blocks.insert(j, block)
                continue
            j = hole + 1
            if j == len(keys) or keys[j] > k:  # no key between the merged neighbour's and this one: its place
                keys[hole] = k
                blocks[hole] = block
            else:
                del keys[hole], blocks[hole]
                j = bisect_left(keys, k, hole)
                keys.insert(j, k)
                blocks.insert(j, block)
        elif on_other is not None:
            alloc.allocated, alloc.max_allocated = allocated, top
            on_other(i, events[i])
            allocated, top = alloc.allocated, alloc.max_allocated
            bar = top if top < high else high
    alloc.allocated, alloc.max_allocated = allocated, top
    return RunPeak(high, peak_event, stats_of(counters() if pending else at_peak))


def _run_calls(
    alloc: CachingAllocator,
    events: Sequence[tuple],
    stream_ids: Mapping[object, int],
    on_other: Callable[[int, tuple], None] | None,
) -> RunPeak:
    """:func:`run_events` through :meth:`CachingAllocator.malloc` and :meth:`~CachingAllocator.free`
    for every event: the allocators whose settings the inlined paths do not follow."""
    malloc, free, stats = alloc.malloc, alloc.free, alloc.stats
    live: dict[int, Block] = {}
    high, peak_event, at_peak, pending = alloc.allocated, -1, stats(), False
    for i, (op, tensor, size, _, stream, _) in enumerate(events):
        if op == ALLOC:
            try:
                live[tensor] = malloc(size, stream_ids[stream])
            except AllocatorOOM as error:
                return RunPeak(high, peak_event, stats() if pending else at_peak, i, error)
            if alloc.allocated > high:
                high, peak_event, pending = alloc.allocated, i, True
        elif op == FREE:
            if pending:
                at_peak, pending = stats(), False
            free(live.pop(tensor))
        elif on_other is not None:
            on_other(i, events[i])
    return RunPeak(high, peak_event, stats() if pending else at_peak)
