"""Assert that training code stays under a memory budget: a context manager and a pytest plugin.

In the spirit of pytest-memray's ``limit_memory``, for accelerator memory::

    def test_step_fits(limit_memory):            # the fixture is the context manager
        with limit_memory("2GiB", track=(model, optimizer)) as usage:
            train_step(model, optimizer, batch)
        assert usage.peak_bytes > 0

    @pytest.mark.memplan_limit("2GiB")           # the whole test call
    def test_training_fits(): ...

What is measured:

- CUDA: the caching allocator's peak over the block (``torch.cuda.reset_peak_memory_stats`` at
  entry, ``max_memory_allocated`` at exit, or ``max_memory_reserved`` with ``metric="reserved"``):
  everything on the device, including what existed before the block;
- CPU: PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``): every tensor created
  in the block, plus the parameters, gradients and optimizer states of the modules and optimizers
  given in ``track`` (which exist before it). ``reserved`` is an allocator figure: CUDA only.

Sizes say their unit (``"2GiB"`` = 2 x 2^30 bytes, ``"2GB"`` = 2 x 10^9) or are plain bytes.
The plugin registers through the ``pytest11`` entry point ``memplan``; torch is imported only
when a limit is entered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from memplan.check.spec import parse_size
from memplan.units import format_bytes

MARKER = "memplan_limit"


class MemoryLimitExceeded(AssertionError):
    """The block's peak went over the limit (a test failure, not an error)."""


@dataclass
class MemoryUsage:
    """Filled in when the block ends: the peak, in bytes, on ``device``."""

    limit_bytes: int
    device: str
    metric: str
    peak_bytes: int | None = None


def _device(device: Any) -> Any:
    import torch

    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def limit_memory(
    limit: str | int,
    *,
    device: Any = None,
    metric: Literal["allocated", "reserved"] = "allocated",
    track: Sequence[Any] = (),
) -> Iterator[MemoryUsage]:
    """Fail with :class:`MemoryLimitExceeded` when the block's peak memory exceeds ``limit``.

    ``device``: where to measure (default: the current CUDA device, else the CPU); ``track``:
    modules / optimizers / tensors that exist before the block and count towards it on CPU
    (on CUDA the allocator already counts them). An exception inside the block propagates
    unchanged, without a limit check.
    """
    try:
        limit_bytes = parse_size(limit)
    except ValueError as err:
        raise ValueError(f"limit_memory: {err}") from None
    import torch

    dev = _device(device)
    usage = MemoryUsage(limit_bytes=limit_bytes, device=str(dev), metric=metric)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield usage
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_reserved(dev) if metric == "reserved" else torch.cuda.max_memory_allocated(dev)
    elif metric == "reserved":
        raise ValueError(f"limit_memory: reserved is the CUDA caching allocator's figure; on {dev} use allocated")
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        if track:
            tracker.track_external(*track)
        with tracker:
            yield usage
        snap = tracker.get_tracker_snapshot("peak")
        peak = sum(cats.get("Total", 0) for d, cats in snap.items() if torch.device(d).type == dev.type)
    usage.peak_bytes = int(peak)
    if usage.peak_bytes > limit_bytes:
        raise MemoryLimitExceeded(
            f"peak {metric} memory on {dev} was {format_bytes(usage.peak_bytes, 'MiB')} "
            f"({usage.peak_bytes} bytes), over the limit of {format_bytes(limit_bytes, 'MiB')} ({limit_bytes} bytes)"
        )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(limit, device=None, metric='allocated'): fail the test when the memory peak of its call "
        "exceeds limit ('2GiB', '2GB' or bytes); see memplan.testing",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Run a test marked ``memplan_limit`` inside :func:`limit_memory`."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return (yield)
    with limit_memory(*marker.args, **marker.kwargs):
        return (yield)


@pytest.fixture(name="limit_memory")
def _limit_memory_fixture() -> Any:
    """The :func:`limit_memory` context manager, as a fixture."""
    return limit_memory
