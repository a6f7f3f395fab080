"""The bytes a run of requests holds in the caching allocator's blocks, allocated in order into
an empty pool and never freed: what ``max_memory_allocated`` counts for them.

``CUDACachingAllocator.cpp`` counts a block's whole size as allocated, not the bytes requested:
every size rounds up to 512 B (``round_size``), and a large-pool block is cut from the best-fitting
cached block or a new segment (``get_allocation_size``: 20 MiB for 1-10 MiB, else the size rounded
to 2 MiB) and split only when more than 1 MiB would remain (``should_split``): otherwise the
remainder stays in the block. A 1B Llama's V/8 x h fp32 tensor (131,334,144 B) holds its
132,120,576 B segment; the 11th 1,835,008 B shard packed into one 20 MiB segment holds the
segment's last 2,621,440 B. Which requests share a segment depends only on their sizes and order
when the pool starts empty and nothing is freed between them (the parameters a model builds:
docs/cost-model.md, "The search's fast form against the run").

Default allocator settings (no ``max_split_size``, no expandable segments, whose blocks split
whenever 512 B remain): the sums that use this module model the default allocator.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from functools import lru_cache

from memplan.costmodel.allocator.config import kSmallSize
from memplan.costmodel.allocator.sizing import get_allocation_size, round_size


def fresh_blocks(sizes: tuple[int, ...]) -> int:
    """The bytes the blocks of ``sizes`` (requested bytes, in allocation order, one stream) hold,
    allocated into an empty allocator with nothing freed in between. Small requests (<= 1 MiB)
    hold their 512 B rounding (their 2 MiB segments split down to 512 B); each large one takes the
    smallest free rest of an earlier segment that fits (``get_free_block``), else a new segment
    (``get_allocation_size``), and keeps the remainder when it is 1 MiB or less (``should_split``,
    no ``max_split_size``)."""
    return repeated_fresh_blocks(sizes, (), 0, ())


@lru_cache(maxsize=1024)
def repeated_fresh_blocks(head: tuple[int, ...], body: tuple[int, ...], times: int, tail: tuple[int, ...]) -> int:
    """``fresh_blocks(head + body * times + tail)`` (a model's build: the embedding, ``times`` alike
    layers, the norm and head) without placing every repeat: a free rest smaller than every large
    request still to come can serve none of them and is dropped, so the pool's state after a
    repeat recurs; from the first recurrence each period of repeats holds what the first did."""
    rounded = {size: round_size(size) for size in (*head, *body, *tail)}
    parts = [[rounded[size] for size in sizes] for sizes in (head, body, tail)]
    small = [sum(r for r in part if r <= kSmallSize) for part in parts]  # each holds its rounding
    (head_large, body_large, tail_large) = large = [[r for r in part if r > kSmallSize] for part in parts]
    smallest = min((*large[1], *large[2]), default=0)  # a rest below it serves no later request
    rests: list[int] = []  # the large pool's free blocks, by size

    def place(requests: list[int]) -> int:
        """The blocks of large requests: a free rest or a new segment each."""
        held = 0
        for r in requests:
            i = bisect_left(rests, r)
            block = rests.pop(i) if i < len(rests) else get_allocation_size(r)
            if block - r > kSmallSize:
                insort(rests, block - r)
                block = r
            held += block
        return held

    held = small[0] + place(head_large)
    seen: dict[tuple[int, ...], tuple[int, int]] = {}
    done = 0
    while done < times:
        rests[:] = [r for r in rests if r >= smallest]
        state = tuple(rests)
        if state in seen:  # the repeats since ``seen[state]`` recur until the last
            first, held_then = seen[state]
            period = done - first
            cycles = (times - done) // period
            held += cycles * (held - held_then)
            done += cycles * period
            seen.clear()
            if done == times:
                break
        seen[state] = (done, held)
        held += small[1] + place(body_large)
        done += 1
    return held + small[2] + place(tail_large)
