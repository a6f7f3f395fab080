"""The allocator's size policies, one function per C++ function of ``CUDACachingAllocator.cpp``.

Sizes are ints of bytes. Each takes the :class:`AllocatorConfig` it depends on; none keeps state.
"""

from __future__ import annotations

from memplan.costmodel.allocator.config import (
    AllocatorConfig,
    kMinBlockSize,
    kMinLargeAlloc,
    kRoundLarge,
    kRoundUpPowerOfTwoIntervals,
    kSmallBuffer,
    kSmallSize,
)

_INTERVAL_START_LOG2 = 20  # log2(kRoundUpPowerOfTwoStart = 1 MiB)
DEFAULT_CONFIG = AllocatorConfig()


def roundup_power2_divisions(size: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the divisions set for size's interval.

    Interval index = floor(log2 size) - 20, clamped to [0, 15]: sizes under 2 MiB share entry 0,
    sizes of 32 GiB and up share entry 15.
    """
    index = max(0, size.bit_length() - 1 - _INTERVAL_START_LOG2)
    return config.roundup_power2_divisions[min(index, kRoundUpPowerOfTwoIntervals - 1)]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: size rounded up to the next of ``divisions`` equal steps
    between the powers of two around it (1200 with 4 divisions: steps 1024, 1280, 1536, 1792 -> 1280).

    A power of two stays as it is; a step below 1 B rounds up to the next power of two.
    """
    if size & (size - 1) == 0:
        return size
    if divisions < 2:
        raise ValueError("roundup_power2_next_division: only 2 or more divisions are supported")
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """``round_size``: at least kMinBlockSize (512 B), then a multiple of 512 B, or the next power-of-two
    division when ``roundup_power2_divisions`` sets more than one for this size and size > 512 x divisions."""
    if size < kMinBlockSize:
        return kMinBlockSize
    divisions = roundup_power2_divisions(size, config)
    if divisions > 1 and size > kMinBlockSize * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // kMinBlockSize) * kMinBlockSize


def is_small(size: int) -> bool:
    """``get_pool``: a rounded size up to kSmallSize (1 MiB) goes to the small pool."""
    return size <= kSmallSize


def get_allocation_size(size: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a rounded request that no cached block fits.

    <= 1 MiB: a kSmallBuffer (2 MiB); < kMinLargeAlloc (10 MiB): a large segment (kLargeBuffer,
    20 MiB, or ``large_segment_size_mb``); larger: the size rounded up to kRoundLarge (2 MiB).
    """
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return config.large_segment_size
    return -(-size // kRoundLarge) * kRoundLarge


def should_split(block_size: int, size: int, small_pool: bool, config: AllocatorConfig = DEFAULT_CONFIG) -> bool:
    """``should_split``: whether a block handed out for ``size`` keeps its remainder as a free block.

    Small pool or expandable segments: when >= kMinBlockSize (512 B) remains. Large pool: when the
    request is below ``max_split_size`` and more than kSmallSize (1 MiB) remains; otherwise the
    whole block is handed out (and counted as allocated).
    """
    remaining = block_size - size
    if small_pool or config.expandable_segments:
        return remaining >= kMinBlockSize
    return size < config.max_split_bytes and remaining > kSmallSize


def fits_oversize_rules(block_size: int, size: int, config: AllocatorConfig = DEFAULT_CONFIG) -> bool:
    """The two ``max_split_size`` checks at the end of ``get_free_block``.

    A request below ``max_split_size`` never takes an oversize (unsplittable) cached block; a request
    at or above it takes one only if the block is less than ``max_non_split_rounding_size``
    (20 MiB by default) larger.
    """
    max_split = config.max_split_bytes
    if size < max_split and block_size >= max_split:
        return False
    return not (size >= max_split and block_size >= size + config.non_split_rounding_bytes)
