"""The caching allocator's constants and its ``PYTORCH_CUDA_ALLOC_CONF`` settings.

Constants keep their C++ names (``c10/core/AllocatorConfig.h``,
``c10/cuda/CUDACachingAllocator.cpp``). :func:`parse_alloc_conf` accepts what torch 2.11's two
parsers accept, run one after the other over the same string as PyTorch does at start-up:
``AcceleratorAllocatorConfig::parseArgs`` (``c10/core/AllocatorConfig.cpp``: the device-generic
keys) then ``CUDAAllocatorConfig::parseArgs`` (``c10/cuda/CUDAAllocatorConfig.cpp``: the CUDA
keys, and the check that every key is known to one of the two).
"""

from __future__ import annotations

import re
from dataclasses import field
from typing import Literal

from memplan.errors import MemplanError
from memplan.records import record

kMB = 1024 * 1024
kMinBlockSize = 512  # every size rounds up to a multiple of it
kSmallSize = 1 * kMB  # requests up to it go to the small pool
kSmallBuffer = 2 * kMB  # a small-pool segment (and an expandable small-pool page)
kMinLargeAlloc = 10 * kMB  # large requests below it get a kLargeBuffer segment
kRoundLarge = 2 * kMB  # larger segments round up to it
kLargeBuffer = 20 * kMB  # segment for a 1-10 MiB request; expandable large-pool page
kRoundUpPowerOfTwoIntervals = 16  # roundup_power2_divisions: one entry per [2^k, 2^k+1) MiB, 1 MiB .. 64 GiB
SIZE_MAX = 2**64 - 1  # size_t's maximum: max_split_size when unlimited
kMaxRegisterThreads = 128  # CUDAAllocatorConfig::pinned_max_register_threads

ACCELERATOR_KEYS = frozenset(
    {
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "pinned_use_background_threads",
    }
)
CUDA_KEYS = frozenset(
    {
        "backend",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
        "graph_capture_record_stream_reuse",
    }
)
_CUDA_BOOL_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
    }
)
Backend = Literal["native", "cudaMallocAsync"]


@record(slots=True)
class AllocatorConfig:
    """The settings that change device memory, plus those PyTorch accepts and memplan only records.

    ``max_split_size`` is ``None`` for unlimited (C++: ``SIZE_MAX``); ``max_non_split_rounding_size``
    is ``None`` for its default, ``large_segment_size``. ``roundup_power2_divisions`` has one entry
    per power-of-two interval of sizes in MiB, [1, 2), [2, 4), ... [32768, inf); 0 or 1 = no rounding.
    """

    backend: Backend = "native"
    expandable_segments: bool = False
    max_split_size: int | None = None
    max_non_split_rounding_size: int | None = None
    large_segment_size: int = kLargeBuffer
    roundup_power2_divisions: tuple[int, ...] = (0,) * kRoundUpPowerOfTwoIntervals
    garbage_collection_threshold: float = 0.0
    # accepted, no effect on device memory: (key, value as written)
    other_settings: tuple[tuple[str, str], ...] = field(default=())

    @property
    def max_split_bytes(self) -> int:
        """``CUDAAllocatorConfig::max_split_size()``: blocks this large or larger are never split."""
        return SIZE_MAX if self.max_split_size is None else self.max_split_size

    @property
    def non_split_rounding_bytes(self) -> int:
        """``max_non_split_rounding_size()``: how much larger an oversize cached block may be than a request."""
        if self.max_non_split_rounding_size is None:
            return self.large_segment_size
        return self.max_non_split_rounding_size

    @classmethod
    def from_snapshot_settings(cls, settings: dict, source: str = "allocator_settings") -> AllocatorConfig:
        """The config a snapshot's ``allocator_settings`` describes.

        The dict (``torch.cuda.memory._snapshot()["allocator_settings"]``) holds the parsed values of
        the keys that matter here, and the settings string; the string is parsed first for what the
        dict leaves out (``max_non_split_rounding_mb``, ``large_segment_size_mb``, ``backend``).
        """
        text = settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""
        base = parse_alloc_conf(text, source=source) if text else cls()
        max_split = settings.get("max_split_size", -1)
        divisions = settings.get("roundup_power2_divisions")
        if isinstance(divisions, dict):
            by_mib = sorted((int(k), int(v)) for k, v in divisions.items())
            divisions = tuple(v for _, v in by_mib)
        return cls(
            backend=base.backend,
            expandable_segments=bool(settings.get("expandable_segments", base.expandable_segments)),
            max_split_size=None if max_split in (-1, None) or max_split >= SIZE_MAX else int(max_split),
            max_non_split_rounding_size=base.max_non_split_rounding_size,
            large_segment_size=base.large_segment_size,
            roundup_power2_divisions=tuple(divisions) if divisions else base.roundup_power2_divisions,
            garbage_collection_threshold=float(
                settings.get("garbage_collection_threshold", base.garbage_collection_threshold)
            ),
            other_settings=base.other_settings,
        )


class _Tokens:
    """``ConfigTokenizer``: splits on ``,`` ``:`` ``[`` ``]`` (each its own token), drops whitespace.

    As in PyTorch, a wrong separator where ``:`` or ``,`` is expected is not an error
    (``checkToken`` only answers true/false and the parsers ignore it); reading past the end is.
    """

    def __init__(self, text: str, source: str):
        self.source = source
        self.items: list[str] = []
        buf = ""
        for ch in text:
            if ch in ",:[]":
                if buf:
                    self.items.append(buf)
                    buf = ""
                self.items.append(ch)
            elif not ch.isspace():
                buf += ch
        if buf:
            self.items.append(buf)
        self.key = ""

    def __len__(self) -> int:
        return len(self.items)

    def at(self, i: int) -> str:
        if i >= len(self.items):
            raise self.error(f"value missing after '{self.key}'")
        return self.items[i]

    def error(self, reason: str) -> MemplanError:
        return MemplanError(reason, source=self.source, field=self.key or None)

    def to_size_t(self, i: int) -> int:
        """``std::stoull``: the leading (signed) decimal digits; a minus wraps modulo 2^64."""
        token = self.at(i)
        sign, digits = (token[0], token[1:]) if token[:1] in "+-" else ("+", token)
        n = len(digits) - len(digits.lstrip("0123456789"))
        if n == 0:
            raise self.error(f"expected an unsigned integer, got '{token}'")
        value = int(digits[:n])
        if value > SIZE_MAX:
            raise self.error(f"'{token}' is out of range for size_t")
        return (-value) % 2**64 if sign == "-" else value

    def to_double(self, i: int) -> float:
        """``std::stod``: the leading decimal number (or inf/nan) of the token."""
        token = self.at(i)
        match = _DOUBLE_PREFIX.match(token)
        if match is None:
            raise self.error(f"expected a number, got '{token}'")
        return float(match.group(0))

    def to_bool(self, i: int) -> bool:
        token = self.at(i)
        if token not in ("True", "False"):
            raise self.error(f"expected True or False, got '{token}'")
        return token == "True"

    def skip_key(self, i: int) -> int:
        """``ConfigTokenizer::skipKey``: the index of the key's value, or of the ``]`` closing its list."""
        i += 2
        if self.at(i) != "[":
            return i
        i += 1
        while i < len(self.items) and self.items[i] != "]":
            i += 1
        if i >= len(self.items):
            raise self.error("list not closed with ']'")
        return i


_DOUBLE_PREFIX = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", re.IGNORECASE)


def _is_power_of_two(value: int) -> bool:
    """``llvm::isPowerOf2_64``: false for 0."""
    return value > 0 and value & (value - 1) == 0


def _parse_mib_at_least(tok: _Tokens, i: int, minimum_mib: int, strict: bool = False) -> int:
    """A size in MiB, checked against its minimum, clamped to ``SIZE_MAX / kMB``, returned in bytes."""
    value = tok.to_size_t(i)
    if value < minimum_mib or (strict and value == minimum_mib):
        relation = ">" if strict else ">="
        raise tok.error(f"must be {relation} {minimum_mib} (MiB), got {value}")
    return min(value, SIZE_MAX // kMB) * kMB


def _parse_divisions(tok: _Tokens, i: int) -> tuple[int, tuple[int, ...]]:
    """``parseRoundUpPower2Divisions``: one int for every interval, or ``[MiB:div, ..., >:div]``."""
    divisions = [0] * kRoundUpPowerOfTwoIntervals
    i += 2
    if tok.at(i) != "[":
        value = tok.to_size_t(i)
        if not _is_power_of_two(value):
            raise tok.error(f"divisions must be a power of 2, got {value}")
        return i, (value,) * kRoundUpPowerOfTwoIntervals
    first, last_index = True, 0
    i += 1
    while i < len(tok) and tok.items[i] != "]":
        boundary_index = i
        i += 2
        value = tok.to_size_t(i)
        if value != 0 and not _is_power_of_two(value):
            raise tok.error(f"divisions must be a power of 2 or 0, got {value}")
        if tok.items[boundary_index] == ">":
            divisions[last_index + 1 :] = [value] * (kRoundUpPowerOfTwoIntervals - last_index - 1)
        else:
            boundary = tok.to_size_t(boundary_index)
            if not _is_power_of_two(boundary):
                raise tok.error(f"interval bounds must be powers of 2 (MiB), got {boundary}")
            index = min(boundary.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index] = value
            last_index = index
        if tok.at(i + 1) != "]":
            i += 2
        else:
            i += 1
    if i >= len(tok):
        raise tok.error("list not closed with ']'")
    return i, tuple(divisions)


def _accelerator_pass(tok: _Tokens, values: dict) -> None:
    """``AcceleratorAllocatorConfig::parseArgs``: ``large_segment_size_mb`` first, then the rest."""
    for i in range(len(tok)):
        if tok.items[i] == "large_segment_size_mb":
            tok.key = "large_segment_size_mb"
            values["large_segment_size"] = _parse_mib_at_least(tok, i + 2, kMinLargeAlloc // kMB, strict=True)
    large_mib = values.get("large_segment_size", kLargeBuffer) // kMB
    i = 0
    while i < len(tok):
        key = tok.key = tok.items[i]
        if key == "max_split_size_mb":
            i += 2
            values["max_split_size"] = _parse_mib_at_least(tok, i, large_mib)
        elif key == "max_non_split_rounding_mb":
            i += 2
            values["max_non_split_rounding_size"] = _parse_mib_at_least(tok, i, large_mib)
        elif key == "garbage_collection_threshold":
            i += 2
            threshold = tok.to_double(i)
            if not 0.0 < threshold < 1.0:
                raise tok.error(f"must be in (0.0, 1.0), got {tok.items[i]}")
            values["garbage_collection_threshold"] = threshold
        elif key == "roundup_power2_divisions":
            i, values["roundup_power2_divisions"] = _parse_divisions(tok, i)
        elif key == "expandable_segments":
            i += 2
            values["expandable_segments"] = tok.to_bool(i)
        elif key == "pinned_use_background_threads":
            i += 2
            values["other"].append((key, str(tok.to_bool(i))))
        else:
            if key not in ACCELERATOR_KEYS | CUDA_KEYS:
                raise tok.error(f"unrecognized key '{key}' in the allocator config")
            i = tok.skip_key(i)
        i += 2  # the ',' (or whatever PyTorch lets stand in for it) and the next key


def _cuda_pass(tok: _Tokens, values: dict) -> None:
    """``CUDAAllocatorConfig::parseArgs``: the CUDA keys; all others were read by the first pass."""
    i = 0
    while i < len(tok):
        key = tok.key = tok.items[i]
        if key == "backend":
            i += 2
            backend = tok.at(i)
            if backend not in ("native", "cudaMallocAsync"):
                raise tok.error(f"unknown allocator backend '{backend}', options are native and cudaMallocAsync")
            values["backend"] = backend
        elif key in _CUDA_BOOL_KEYS:
            i += 2
            values["other"].append((key, str(tok.to_bool(i))))
        elif key == "pinned_num_register_threads":
            i += 2
            threads = tok.to_size_t(i)
            if not _is_power_of_two(threads) or threads > kMaxRegisterThreads:
                raise tok.error(f"must be a power of 2 and <= {kMaxRegisterThreads}, got {threads}")
            values["other"].append((key, str(threads)))
        elif key == "pinned_reserve_segment_size_mb":
            i += 2
            if tok.to_size_t(i) == 0:
                raise tok.error("must be > 0")
            values["other"].append((key, tok.items[i]))
        else:
            if key not in ACCELERATOR_KEYS:
                raise tok.error(f"unrecognized key '{key}' in the CUDA allocator config")
            i = tok.skip_key(i)
        i += 2


def parse_alloc_conf(text: str, source: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorConfig:
    """The :class:`AllocatorConfig` a ``PYTORCH_CUDA_ALLOC_CONF`` string sets, or the reason PyTorch rejects it.

    Accepts what ``AcceleratorAllocatorConfig::parseArgs`` then ``CUDAAllocatorConfig::parseArgs`` accept
    (torch 2.11): ``key:value`` pairs separated by commas, lists in brackets. Value ranges as in
    PyTorch: ``max_split_size_mb`` and ``max_non_split_rounding_mb`` >= ``large_segment_size_mb`` (20 by
    default), ``large_segment_size_mb`` > 10, ``garbage_collection_threshold`` in (0, 1),
    ``roundup_power2_divisions`` powers of two (0 allowed inside a list), booleans written ``True``/
    ``False``, ``backend`` ``native`` or ``cudaMallocAsync``. Raises :class:`MemplanError` with
    ``field`` = the key at fault.
    """
    tok = _Tokens(text, source)
    values: dict = {"other": []}
    _accelerator_pass(tok, values)
    _cuda_pass(tok, values)
    other = tuple(values.pop("other"))
    return AllocatorConfig(**values, other_settings=other)
