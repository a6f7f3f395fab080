"""Reserved memory and "fits" for a CPU run of an op-level plan: no caching allocator.

PyTorch's CPU allocator caches nothing: ``c10::alloc_cpu`` (c10/core/impl/alloc_cpu.cpp) asks
``posix_memalign`` for each storage (64-byte aligned, ``gAlignment``) and ``free_cpu`` hands it
back at once; ``DefaultCPUAllocator`` keeps no pool (the ``CPUCachingAllocator`` of mobile builds
is not the default). What it holds at any moment is the bytes of the live storages, so on CPU
``reserved`` is the run's allocated peak, and the run fits when that peak is within the limit.
What glibc's ``malloc`` keeps mapped after a ``free`` (its arenas, the trim threshold) is the C
library's, not PyTorch's, and is not counted (as the CPU meters count: MemTracker, the
accuracy suites' ``StorageTracker``, ``MemplanCallback``'s live bytes).

The run replayed here is the CPU's view of it (``timeline.cpu.cpu_view``: CUDA-only tensors left
out); the phases' peaks over the steady steps are taken as the bundled trainer's meter takes
them (``reserve.replay``'s marks).
"""

from __future__ import annotations

from memplan.costmodel.reserve import Failure, GiB, Replay, Verdict
from memplan.costmodel.timeline.events import ALLOC, FREE, STEADY, Timeline
from memplan.costmodel.timeline.phases import PHASE_MARKS, SETUP


def cpu_replay(timeline: Timeline, limit_bytes: int | None = None) -> Replay:
    """The live bytes of ``timeline`` event by event: the peak (reserved equals it), where and in
    which phase it is reached, each phase's peak over the steady steps, and the first allocation
    that takes the live bytes past ``limit_bytes`` (``failure``; the walk goes on to the end)."""
    live = high = 0
    peak_event, peak_phase, failure = -1, None, None
    phase, steady, phase_high = SETUP, False, 0
    peaks: dict[str, int] = {}
    for i, (op, _, size, category, stream, tag) in enumerate(timeline.raw):
        if op == ALLOC:
            live += size
            if live > high:
                high, peak_event, peak_phase = live, i, phase
            phase_high = max(phase_high, live)
            if failure is None and limit_bytes is not None and live > limit_bytes:
                failure = Failure(size, str(category), tag, stream.value, live - size, live - size, 0)
        elif op == FREE:
            live -= size
        elif tag in PHASE_MARKS:  # the meter's phase change: its peak counter reset
            if steady and phase is not None:
                peaks[phase] = max(peaks.get(phase, 0), phase_high)
            phase_high, phase = live, PHASE_MARKS[tag]
        elif tag == STEADY:
            steady = True
    return Replay(
        max_reserved=high,
        max_allocated=high,
        segments=0,
        cached_free=0,
        largest_free=0,
        reserved_by_stream={},
        failure=failure,
        peak_event=peak_event,
        phase_peaks=peaks or None,
        peak_phase=peak_phase if peaks else None,
    )


def cpu_verdict(timeline: Timeline, limit_bytes: int) -> Verdict:
    """Whether the CPU run of ``timeline`` (its CPU view) stays within ``limit_bytes``: its peak of
    live bytes, which is also what the CPU allocator holds (module docstring)."""
    r = cpu_replay(timeline, limit_bytes)
    held, limit = f"{r.max_allocated / GiB:.2f} GiB", f"{limit_bytes / GiB:.2f} GiB"
    if r.failure is None:
        reason = f"fits: the run holds {held} at its peak of {limit} available (CPU: no caching allocator)"
        return Verdict(r.max_allocated, True, reason, r, None, None)
    reason = f"does not fit: {held} allocated at the peak, {limit} available"
    return Verdict(r.max_allocated, False, reason, r, r.failure, None)
