"""The caching-allocator model, policy by policy, against values worked out from PyTorch's rules
(``c10/cuda/CUDACachingAllocator.cpp``, ``c10/core/AllocatorConfig.cpp``, torch 2.11)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import memplan.costmodel.allocator as allocator_package
from memplan.costmodel.allocator import AllocatorConfig, AllocatorOOM, CachingAllocator, parse_alloc_conf
from memplan.costmodel.allocator.config import (
    kLargeBuffer,
    kMB,
    kMinBlockSize,
    kMinLargeAlloc,
    kRoundLarge,
    kSmallBuffer,
    kSmallSize,
)
from memplan.costmodel.allocator.sizing import (
    fits_oversize_rules,
    get_allocation_size,
    is_small,
    round_size,
    roundup_power2_divisions,
    roundup_power2_next_division,
    should_split,
)
from memplan.errors import MemplanError

GiB = 2**30
REQUEST_15_66_GIB = int(15.66 * GiB)  # 16,814,796,963 B


def test_constants_have_their_cpp_values():
    assert (kMinBlockSize, kSmallSize, kSmallBuffer) == (512, 1048576, 2097152)
    assert (kMinLargeAlloc, kRoundLarge, kLargeBuffer) == (10485760, 2097152, 20971520)


# --- sizing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "rounded", "segment"),
    [
        (1, 512, kSmallBuffer),  # below kMinBlockSize: one 512 B block in a 2 MiB small segment
        (512, 512, kSmallBuffer),
        (kMB, kMB, kSmallBuffer),  # 1 MiB is still small
        (kMB + 1, kMB + 512, kLargeBuffer),  # just over: large pool, a 20 MiB segment
        (10 * kMB - 1, 10 * kMB, 10 * kMB),  # rounds to exactly kMinLargeAlloc: own segment
        (10 * kMB, 10 * kMB, 10 * kMB),
        (10 * kMB + 1, 10 * kMB + 512, 12 * kMB),  # segment rounded up to 2 MiB
        (REQUEST_15_66_GIB, 16_814_797_312, 8018 * kRoundLarge),  # 32,841,401 x 512 B; 8,018 x 2 MiB
    ],
)
def test_round_size_and_segment_size(request_bytes, rounded, segment):
    assert round_size(request_bytes) == rounded
    assert get_allocation_size(rounded) == segment


def test_pool_is_small_up_to_one_mib():
    assert is_small(round_size(kMB)) and not is_small(round_size(kMB + 1))


def test_roundup_power2_next_division():
    assert roundup_power2_next_division(1200, 4) == 1280  # steps 1024, 1280, 1536, 1792
    assert roundup_power2_next_division(1024, 4) == 1024  # powers of two stay
    assert roundup_power2_next_division(1280, 4) == 1280
    assert roundup_power2_next_division(3, 4) == 4  # step under 1 B: the next power of two
    with pytest.raises(ValueError):
        roundup_power2_next_division(1200, 1)


def test_round_size_with_power2_divisions():
    config = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(REQUEST_15_66_GIB, config) == 16 * GiB  # [8, 16) GiB in steps of 2 GiB
    assert round_size(5 * kMB + 1, config) == 5 * kMB + kMB  # [4, 8) MiB in steps of 1 MiB
    assert round_size(1200, config) == 1536  # 1200 < 512 x 4: plain 512 B rounding
    assert round_size(3000, config) == 3072  # [2048, 4096) in steps of 512 B


def test_roundup_power2_divisions_interval_index():
    config = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert config.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    assert roundup_power2_divisions(1000, config) == 1  # below 1 MiB: the first interval
    assert roundup_power2_divisions(300 * kMB, config) == 1  # [256, 512) MiB
    assert roundup_power2_divisions(600 * kMB, config) == 2  # [512, 1024) MiB
    assert roundup_power2_divisions(100 * GiB, config) == 4  # past 32 GiB: the last interval


def test_should_split():
    assert should_split(kSmallBuffer, kSmallBuffer - 512, small_pool=True)  # 512 B left: split
    assert not should_split(kSmallBuffer, kSmallBuffer - 512 + 1, small_pool=True)
    assert should_split(kLargeBuffer, 2 * kMB, small_pool=False)  # 18 MiB left
    assert not should_split(12 * kMB, 11 * kMB, small_pool=False)  # exactly 1 MiB left: kept whole
    assert should_split(12 * kMB, 11 * kMB - 512, small_pool=False)
    capped = parse_alloc_conf("max_split_size_mb:20")
    assert not should_split(100 * kMB, 20 * kMB, small_pool=False, config=capped)  # request >= max_split
    assert should_split(100 * kMB, 20 * kMB - 512, small_pool=False, config=capped)
    expandable = AllocatorConfig(expandable_segments=True)
    assert should_split(12 * kMB, 12 * kMB - 512, small_pool=False, config=expandable)


def test_oversize_rules_of_get_free_block():
    capped = parse_alloc_conf("max_split_size_mb:64")
    assert not fits_oversize_rules(64 * kMB, 30 * kMB, capped)  # small request, oversize block
    assert fits_oversize_rules(60 * kMB, 30 * kMB, capped)
    assert fits_oversize_rules(100 * kMB - 512, 80 * kMB, capped)  # within 20 MiB of the request
    assert not fits_oversize_rules(100 * kMB, 80 * kMB, capped)
    assert fits_oversize_rules(10 * GiB, kMB)  # unlimited: anything goes


# --- malloc / free -----------------------------------------------------------------------------


def test_small_and_large_pool_segments():
    alloc = CachingAllocator()
    a = alloc.malloc(1)
    b = alloc.malloc(1000)
    assert (a.small, b.small, a.segment == b.segment) == (True, True, True)  # packed in one 2 MiB segment
    assert alloc.reserved == kSmallBuffer and alloc.allocated == 512 + 1024
    c = alloc.malloc(kMB + 1)
    assert not c.small and alloc.reserved == kSmallBuffer + kLargeBuffer
    d = alloc.malloc(3 * kMB)  # fits in the rest of c's 20 MiB segment
    assert d.segment == c.segment and alloc.stats().segment_allocs == 2
    e = alloc.malloc(17 * kMB)  # 16 MiB - 512 B left there: a segment of its own, 18 MiB
    assert e.segment != c.segment and alloc.reserved == kSmallBuffer + kLargeBuffer + 18 * kMB
    assert alloc.segments == 3


def test_large_block_not_split_when_at_most_one_mib_remains():
    alloc = CachingAllocator()
    block = alloc.malloc(19 * kMB + kMB // 2)  # 19.5 MiB: a 20 MiB segment, 0.5 MiB left over
    assert block.size == 20 * kMB and not block.is_split()
    assert alloc.allocated == 20 * kMB  # allocated counts the whole block, as PyTorch's stats do
    alloc.free(block)
    small = alloc.malloc(2 * kMB)  # the cached 20 MiB block is split: 18 MiB stay cached
    assert small.size == 2 * kMB and small.is_split() and alloc.stats().cached_free == 18 * kMB


def test_best_fit_smallest_block_then_lowest_address():
    alloc = CachingAllocator()
    blocks = [alloc.malloc(size * kMB) for size in (12, 16, 14, 12)]
    fourteen, lowest_twelve = blocks[2].segment, min(blocks[0].addr, blocks[3].addr)
    for block in blocks:
        alloc.free(block)
    assert alloc.malloc(13 * kMB).segment == fourteen  # 14 MiB: the smallest that fits
    assert alloc.malloc(12 * kMB).addr == lowest_twelve  # equal sizes: lowest address
    assert alloc.stats().segment_allocs == 4


def test_free_merges_with_free_neighbours():
    alloc = CachingAllocator()
    a, b, c = (alloc.malloc(4 * kMB) for _ in range(3))  # one 20 MiB segment: a b c [8 MiB free]
    assert a.segment == b.segment == c.segment
    alloc.free(b)
    assert alloc.stats().largest_free == 8 * kMB  # b alone: no free neighbour
    alloc.free(a)
    assert alloc.stats().largest_free == 8 * kMB  # a + b = 8 MiB
    alloc.free(c)  # a + b + c + the rest: the whole segment again
    stats = alloc.stats()
    assert stats.largest_free == kLargeBuffer and stats.cached_free == kLargeBuffer and stats.allocated == 0
    whole = alloc.malloc(kLargeBuffer)
    assert not whole.is_split() and alloc.stats().segment_allocs == 1


def test_streams_have_their_own_blocks():
    alloc = CachingAllocator()
    alloc.free(alloc.malloc(12 * kMB, stream=0))
    other = alloc.malloc(12 * kMB, stream=7)  # stream 0's cached block is not for stream 7
    assert alloc.stats().segment_allocs == 2 and other.stream == 7
    assert alloc.stats().reserved_by_stream == ((0, 12 * kMB), (7, 12 * kMB))


def test_free_used_on_another_stream_waits_for_it():
    alloc = CachingAllocator()
    block = alloc.malloc(12 * kMB, stream=0)
    alloc.free(block, pending_streams=[3])  # record_stream(3): not reusable until stream 3 is done
    assert alloc.allocated == 0 and alloc.stats().pending_free == 12 * kMB
    alloc.malloc(12 * kMB)
    assert alloc.stats().segment_allocs == 2
    alloc.process_events(completed_streams=[5])
    assert alloc.stats().pending_free == 12 * kMB
    alloc.process_events(completed_streams=[3])
    assert alloc.stats().pending_free == 0 and alloc.stats().cached_free == 12 * kMB
    other = alloc.malloc(12 * kMB)
    alloc.free(other, pending_streams=[0])  # its own stream: freed at once
    assert alloc.stats().pending_free == 0


def test_oom_path_frees_cached_segments_and_retries():
    alloc = CachingAllocator(capacity_bytes=64 * kMB)
    first, second = alloc.malloc(30 * kMB), alloc.malloc(30 * kMB)
    alloc.free(first)
    alloc.free(second)
    block = alloc.malloc(40 * kMB)  # 60 MiB cached + 40 MiB > 64 MiB: free the cache, then retry
    stats = alloc.stats()
    assert block.size == 40 * kMB and stats.reserved == 40 * kMB
    assert (stats.device_frees, stats.alloc_retries, stats.segment_allocs) == (2, 1, 3)
    with pytest.raises(AllocatorOOM) as caught:
        alloc.malloc(30 * kMB)
    oom = caught.value
    assert (oom.requested, oom.alloc_size, oom.reserved, oom.allocated, oom.cached_free) == (
        30 * kMB,
        30 * kMB,
        40 * kMB,
        40 * kMB,
        0,
    )
    assert isinstance(oom, MemplanError) and alloc.stats().ooms == 1


def test_oom_keeps_split_segments_in_use():
    alloc = CachingAllocator(capacity_bytes=40 * kMB)
    held = alloc.malloc(2 * kMB)  # a 20 MiB segment, split, 18 MiB cached but not freeable
    with pytest.raises(AllocatorOOM) as caught:
        alloc.malloc(30 * kMB)
    assert caught.value.cached_free == 18 * kMB and alloc.reserved == kLargeBuffer
    assert held.allocated


def test_max_split_size_releases_oversize_blocks_first():
    alloc = CachingAllocator(parse_alloc_conf("max_split_size_mb:32"), capacity_bytes=128 * kMB)
    big = alloc.malloc(64 * kMB)
    small = alloc.malloc(12 * kMB)
    alloc.free(big)
    alloc.free(small)
    alloc.malloc(60 * kMB)  # the cached 64 MiB block is within 20 MiB of 60 MiB: reused
    assert alloc.stats().segment_allocs == 2
    alloc.malloc(56 * kMB)  # 76 + 56 > 128: release_available_cached_blocks finds no oversize block
    assert alloc.stats().device_frees == 1  # ... so release_cached_blocks freed the 12 MiB one


def test_max_split_size_oversize_block_released_without_full_flush():
    alloc = CachingAllocator(parse_alloc_conf("max_split_size_mb:32"), capacity_bytes=100 * kMB)
    big, small = alloc.malloc(80 * kMB), alloc.malloc(12 * kMB)
    alloc.free(big)
    alloc.free(small)
    alloc.malloc(50 * kMB)  # 80 >= 50 + 20: not reused; 92 + 50 > 100: the oversize block goes, not the 12
    stats = alloc.stats()
    assert (stats.device_frees, stats.alloc_retries, stats.cached_free) == (1, 0, 12 * kMB)


def test_max_split_size_keeps_oversize_blocks_from_small_requests():
    alloc = CachingAllocator(parse_alloc_conf("max_split_size_mb:32"))
    alloc.free(alloc.malloc(80 * kMB))
    alloc.malloc(20 * kMB)  # below max_split_size: never given (a piece of) the oversize block
    assert alloc.stats().segment_allocs == 2 and alloc.stats().cached_free == 80 * kMB


def test_max_split_size_release_falls_back_to_full_flush():
    alloc = CachingAllocator(parse_alloc_conf("max_split_size_mb:32"), capacity_bytes=100 * kMB)
    big, small = alloc.malloc(40 * kMB), alloc.malloc(12 * kMB)
    alloc.free(big)
    alloc.free(small)
    alloc.malloc(50 * kMB)  # oversize blocks free only 40 MiB < 50 MiB: release_cached_blocks, retry
    stats = alloc.stats()
    assert (stats.device_frees, stats.alloc_retries, stats.cached_free) == (2, 1, 0)


def test_expandable_segments_grow_by_pages():
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True), record_history=True)
    a = alloc.malloc(30 * kMB)  # maps two 20 MiB pages
    assert (alloc.reserved, alloc.segment_maps, alloc.segment_allocs) == (40 * kMB, 1, 0)
    b = alloc.malloc(5 * kMB)  # fits in the mapped 10 MiB left: no new map
    assert alloc.reserved == 40 * kMB and b.addr == a.addr + a.size
    c = alloc.malloc(20 * kMB)  # 5 MiB free + one more page, contiguous
    assert alloc.reserved == 60 * kMB and alloc.segment_maps == 2 and c.addr == b.addr + b.size
    tiny = alloc.malloc(100)  # small pool: its own segment of 2 MiB pages
    assert alloc.reserved == 62 * kMB and alloc.segments == 2
    for block in (a, b, c, tiny):
        alloc.free(block)
    assert alloc.stats().largest_free == 60 * kMB  # merged back into one mapped block
    alloc.empty_cache()  # unmap every free page, release the empty segments
    stats = alloc.stats()
    assert (stats.reserved, stats.segments, stats.device_frees) == (0, 0, 2)
    actions = [event[0] for event in alloc.history]
    assert actions == ["segment_map", "segment_map", "segment_map", "segment_unmap", "segment_unmap"]


def test_expandable_best_fit_prefers_blocks_that_cannot_grow():
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a, _, c = alloc.malloc(7 * kMB), alloc.malloc(7 * kMB), alloc.malloc(6 * kMB)  # one 20 MiB page
    a_addr = a.addr  # a freed Block object is reused by the pool: keep its address
    alloc.free(a)  # 7 MiB free between allocated blocks
    alloc.free(c)  # 6 MiB free before the unmapped rest: counts as 6 MiB + the unmapped range
    assert alloc.malloc(6 * kMB).addr == a_addr  # so the 7 MiB block is the best fit
    assert alloc.segment_maps == 1


def test_garbage_collection_frees_old_cached_segments_without_a_retry():
    config = parse_alloc_conf("garbage_collection_threshold:0.5")
    alloc = CachingAllocator(config, capacity_bytes=200 * kMB, memory_fraction=0.5)  # 100 MiB allowed
    alloc.free(alloc.malloc(40 * kMB))
    alloc.free(alloc.malloc(60 * kMB))
    alloc.malloc(70 * kMB)  # 100 MiB reserved > 50 MiB: collect before asking for more
    stats = alloc.stats()
    assert (stats.reserved, stats.device_frees, stats.alloc_retries) == (70 * kMB, 2, 0)


def test_empty_cache_keeps_segments_with_blocks_in_use():
    alloc = CachingAllocator()
    held = alloc.malloc(4 * kMB)
    alloc.free(alloc.malloc(4 * kMB))
    alloc.free(alloc.malloc(30 * kMB))
    alloc.empty_cache()
    assert alloc.reserved == kLargeBuffer and held.allocated and alloc.stats().device_frees == 1


def test_peaks_and_reset():
    alloc = CachingAllocator()
    block = alloc.malloc(12 * kMB)
    alloc.free(block)
    assert (alloc.max_allocated, alloc.max_reserved) == (12 * kMB, 12 * kMB)
    alloc.reset_peak()
    assert (alloc.max_allocated, alloc.max_reserved) == (0, 12 * kMB)


def test_bad_calls():
    alloc = CachingAllocator()
    with pytest.raises(ValueError):
        alloc.malloc(0)
    block = alloc.malloc(512)
    alloc.free(block)
    with pytest.raises(ValueError):
        alloc.free(block)
    with pytest.raises(MemplanError) as caught:
        CachingAllocator(parse_alloc_conf("backend:cudaMallocAsync"))
    assert caught.value.field == "backend"


# --- PYTORCH_CUDA_ALLOC_CONF ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", AllocatorConfig()),
        ("expandable_segments:True", AllocatorConfig(expandable_segments=True)),
        ("expandable_segments:False,", AllocatorConfig()),  # a trailing comma is accepted
        (" expandable_segments : True ", AllocatorConfig(expandable_segments=True)),  # spaces are dropped
        ("max_split_size_mb:20", AllocatorConfig(max_split_size=20 * kMB)),  # the minimum, kLargeBuffer
        (
            "max_split_size_mb:128,garbage_collection_threshold:0.6",
            AllocatorConfig(max_split_size=128 * kMB, garbage_collection_threshold=0.6),
        ),
        ("max_non_split_rounding_mb:40", AllocatorConfig(max_non_split_rounding_size=40 * kMB)),
        (
            "large_segment_size_mb:40,max_split_size_mb:40",
            AllocatorConfig(large_segment_size=40 * kMB, max_split_size=40 * kMB),
        ),
        ("roundup_power2_divisions:4", AllocatorConfig(roundup_power2_divisions=(4,) * 16)),
        ("roundup_power2_divisions:[]", AllocatorConfig()),
        ("roundup_power2_divisions:[>:8]", AllocatorConfig(roundup_power2_divisions=(0,) + (8,) * 15)),
        ("backend:native", AllocatorConfig()),
        ("backend:cudaMallocAsync", AllocatorConfig(backend="cudaMallocAsync")),
    ],
)
def test_parse_accepts(text, expected):
    assert parse_alloc_conf(text) == expected


def test_parse_accepts_settings_that_do_not_change_device_memory():
    config = parse_alloc_conf(
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,release_lock_on_cudamalloc:True,"
        "graph_capture_record_stream_reuse:False,pinned_use_background_threads:True,pinned_reserve_segment_size_mb:64"
    )
    assert config.expandable_segments is False and config.max_split_size is None
    assert dict(config.other_settings) == {
        "pinned_use_cuda_host_register": "True",
        "pinned_num_register_threads": "8",
        "release_lock_on_cudamalloc": "True",
        "graph_capture_record_stream_reuse": "False",
        "pinned_use_background_threads": "True",
        "pinned_reserve_segment_size_mb": "64",
    }


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("foo:1", "foo"),
        ("expandable_segment:True", "expandable_segment"),
        ("expandable_segments:true", "expandable_segments"),  # only True / False
        ("expandable_segments", "expandable_segments"),  # no value
        ("expandable_segments:", "expandable_segments"),
        ("max_split_size_mb:19", "max_split_size_mb"),  # must be >= 20 (kLargeBuffer / MiB)
        ("max_split_size_mb:abc", "max_split_size_mb"),
        ("large_segment_size_mb:40,max_split_size_mb:30", "max_split_size_mb"),  # >= large_segment_size_mb
        ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb"),
        ("large_segment_size_mb:10", "large_segment_size_mb"),  # must be > 10
        ("garbage_collection_threshold:1.0", "garbage_collection_threshold"),
        ("garbage_collection_threshold:0", "garbage_collection_threshold"),
        ("garbage_collection_threshold:x", "garbage_collection_threshold"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:0", "roundup_power2_divisions"),  # 0 only inside a list
        ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[300:2]", "roundup_power2_divisions"),  # bounds are powers of two
        ("roundup_power2_divisions:[256:2", "roundup_power2_divisions"),  # not closed
        ("backend:foo", "backend"),
        ("pinned_num_register_threads:3", "pinned_num_register_threads"),
        ("pinned_num_register_threads:256", "pinned_num_register_threads"),  # at most 128
        ("pinned_reserve_segment_size_mb:0", "pinned_reserve_segment_size_mb"),
        ("release_lock_on_cudamalloc:yes", "release_lock_on_cudamalloc"),
    ],
)
def test_parse_rejects(text, field):
    with pytest.raises(MemplanError) as caught:
        parse_alloc_conf(text, source="PYTORCH_ALLOC_CONF")
    assert caught.value.source == "PYTORCH_ALLOC_CONF" and caught.value.field == field


def test_config_from_snapshot_settings():
    settings = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_non_split_rounding_mb:40",
        "max_split_size": -1,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": True,
        "roundup_power2_divisions": {str(2**i): (4 if i >= 10 else 0) for i in range(16)},
    }
    config = AllocatorConfig.from_snapshot_settings(settings)
    assert config.expandable_segments and config.max_split_size is None
    assert config.max_non_split_rounding_size == 40 * kMB
    assert config.roundup_power2_divisions == (0,) * 10 + (4,) * 6
    assert AllocatorConfig.from_snapshot_settings({"max_split_size": 64 * kMB}).max_split_size == 64 * kMB


def test_allocator_imports_only_the_standard_library():
    """It runs on the estimate path and in the search: no torch, no numpy."""
    for path in Path(allocator_package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top == "memplan" or top in sys.stdlib_module_names, f"{path.name} imports {name}"
