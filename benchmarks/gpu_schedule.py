"""The GPU suite's schedule: which units share the one GPU, which run alone, when each starts and ends.

Pure: no torch, no processes, no clock. ``make_schedule`` takes the units (each a ``Job``: its budget,
its predicted reserved peak, whether it must run alone) and the GPU's capacity and returns the
waves the suite runs them in:

- one **side-by-side wave** first: the units whose measured figures are memory only
  (``max_memory_allocated`` / ``max_memory_reserved``), as separate processes. Each process has its
  own caching allocator, so its allocated and reserved peaks are what they would be alone; what the
  processes share is the device's memory, so at every moment the units running together hold at
  most the capacity: each one counted at its predicted reserved peak plus ``margin`` of it, plus
  the memory each of its processes holds outside the caching allocator. Units start longest first
  (list scheduling) in at most ``max_lanes`` lanes, each as soon as one is free and its memory fits.
- then one **alone wave** per unit (a group, a sweep's micro-batches, in one lane in order): the
  out-of-memory boundary, step-time and benchmark units, with nothing else on the GPU.

A ``limit_s`` (seconds from the command's start, ``setup_s`` already spent before the first unit)
drops what would end after it: a side-by-side unit that cannot start in time, an alone unit, or the
tail of a group.

The defaults' sources: ``OUTSIDE_BYTES``, the memory a process holds outside the caching allocator
(CUDA context, kernels' modules), was 0.73-0.81 GiB in every out-of-memory message read with
torch 2.11 (three on an H200, one on an H100: ../shared/gpu-traces/README.md); ``MARGIN`` is the
reserved peak's worst under-prediction on the ten H200 runs of 2026-11-27 (-22.2%, Llama 1B fp32
with full recomputation: 31.06 GiB predicted, 39.93 GiB measured), rounded up to 25%.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GIB = 2**30
OUTSIDE_BYTES = int(0.8 * GIB)  # per process, outside the caching allocator (measured 0.73-0.81 GiB, torch 2.11)
MARGIN = 0.25  # of each predicted reserved peak (worst measured under-prediction: -22.2%)
MAX_LANES = 4  # processes side by side at most


@dataclass(frozen=True)
class Job:
    """What the scheduler knows of a unit. ``predicted_bytes``: the predicted reserved peak of all its
    processes together (0: unknown, alone units only); ``processes``: how many it starts on the GPU."""

    key: str
    budget_s: float
    predicted_bytes: int = 0
    alone: bool = True
    group: str | None = None
    processes: int = 1


@dataclass(frozen=True)
class Slot:
    key: str
    lane: int
    start_s: float
    end_s: float
    hold_bytes: int  # what it holds of the capacity (0 in an alone wave: it has the GPU)


@dataclass(frozen=True)
class Wave:
    alone: bool
    slots: tuple[Slot, ...]

    @property
    def start_s(self) -> float:
        return min(s.start_s for s in self.slots)

    @property
    def end_s(self) -> float:
        return max(s.end_s for s in self.slots)

    @property
    def lanes(self) -> int:
        return len({s.lane for s in self.slots})

    def peak_hold_bytes(self) -> int:
        """The most the wave's units hold at once (every change happens at some unit's start)."""
        return max(sum(o.hold_bytes for o in self.slots if o.start_s <= s.start_s < o.end_s) for s in self.slots)


@dataclass(frozen=True)
class Schedule:
    waves: tuple[Wave, ...]
    dropped: tuple[str, ...]
    capacity_bytes: int
    setup_s: float
    limit_s: float | None
    report_s: float = 0.0

    @property
    def end_s(self) -> float:
        """When the command ends: the last unit, then the report."""
        last = max((w.end_s for w in self.waves), default=self.setup_s)
        return last + self.report_s

    @property
    def slots(self) -> list[Slot]:
        return [s for w in self.waves for s in w.slots]

    def fits(self) -> bool:
        return self.limit_s is None or self.end_s <= self.limit_s


def hold_bytes(job: Job, outside_bytes: int = OUTSIDE_BYTES, margin: float = MARGIN) -> int:
    """What a side-by-side unit holds of the device: its predicted reserved peak and the margin,
    plus each of its processes' memory outside the caching allocator."""
    return int(job.predicted_bytes * (1 + margin)) + job.processes * outside_bytes


def make_schedule(
    jobs: Iterable[Job],
    capacity_bytes: int,
    limit_s: float | None = None,
    setup_s: float = 0.0,
    report_s: float = 0.0,
    outside_bytes: int = OUTSIDE_BYTES,
    margin: float = MARGIN,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """The waves (see the module's docstring). A side-by-side unit that could not fit the device
    even by itself runs alone instead; ``limit_s`` counts the report's ``report_s`` too."""
    jobs = list(jobs)
    end_by = None if limit_s is None else limit_s - report_s
    shared = [j for j in jobs if not j.alone and j.group is None]
    too_big = [j for j in shared if hold_bytes(j, outside_bytes, margin) > capacity_bytes]
    shared = [j for j in shared if j not in too_big]
    dropped: list[str] = []
    waves: list[Wave] = []
    wave, t = _side_by_side(shared, capacity_bytes, setup_s, end_by, outside_bytes, margin, max_lanes, dropped)
    if wave is not None:
        waves.append(wave)
    for task in _alone_tasks([j for j in jobs if j.alone or j.group is not None] + too_big):
        slots = []
        for job in task:
            if end_by is not None and t + job.budget_s > end_by:
                dropped += [j.key for j in task[len(slots) :]]  # the rest of a group goes with it
                break
            slots.append(Slot(job.key, 0, t, t + job.budget_s, 0))
            t += job.budget_s
        if slots:
            waves.append(Wave(True, tuple(slots)))
    return Schedule(tuple(waves), tuple(dropped), capacity_bytes, setup_s, limit_s, report_s)


def _alone_tasks(jobs: list[Job]) -> list[list[Job]]:
    """Alone units in order, a group's units together where its first one stands."""
    tasks: list[list[Job]] = []
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        if job.group is None:
            tasks.append([job])
        elif job.group in groups:
            groups[job.group].append(job)
        else:
            groups[job.group] = [job]
            tasks.append(groups[job.group])
    return tasks


def _side_by_side(
    jobs: list[Job],
    capacity: int,
    t: float,
    end_by: float | None,
    outside: int,
    margin: float,
    max_lanes: int,
    dropped: list[str],
) -> tuple[Wave | None, float]:
    """List scheduling, longest first: at each moment start every waiting unit that fits (lanes and
    memory); else wait for the next end. (wave or None, when the wave ends)."""
    waiting = sorted(jobs, key=lambda j: -j.budget_s)
    running: list[Slot] = []
    slots: list[Slot] = []
    while waiting:
        for job in list(waiting):
            hold = hold_bytes(job, outside, margin)
            if end_by is not None and t + job.budget_s > end_by:
                waiting.remove(job)
                dropped.append(job.key)
                continue
            if len(running) < max_lanes and sum(s.hold_bytes for s in running) + hold <= capacity:
                lane = min(set(range(max_lanes)) - {s.lane for s in running})
                slot = Slot(job.key, lane, t, t + job.budget_s, hold)
                running.append(slot)
                slots.append(slot)
                waiting.remove(job)
        if waiting:
            t = min(s.end_s for s in running)
            running = [s for s in running if s.end_s > t]
    if not slots:
        return None, t
    wave = Wave(False, tuple(slots))
    return wave, wave.end_s


def render(schedule: Schedule, names: dict[str, str] | None = None) -> list[str]:
    """The schedule as text lines: each wave, its units with lane, start, end and what they hold."""
    names = names or {}
    gib = GIB
    lines = [
        f"schedule on {schedule.capacity_bytes / gib:.2f} GiB: setup {schedule.setup_s:.0f} s, "
        f"then {len(schedule.waves)} waves"
    ]
    for i, wave in enumerate(schedule.waves, 1):
        kind = (
            "alone"
            if wave.alone
            else f"side by side, {wave.lanes} lanes, at most {wave.peak_hold_bytes() / gib:.1f} GiB"
        )
        lines.append(f"  wave {i} ({kind}): {wave.start_s:5.0f} s -> {wave.end_s:5.0f} s")
        for s in wave.slots:
            held = f"  holds {s.hold_bytes / gib:5.1f} GiB" if s.hold_bytes else ""
            note = f"  {names[s.key]}" if names.get(s.key) else ""
            lines.append(f"    lane {s.lane}  {s.start_s:5.0f} -> {s.end_s:5.0f} s  {s.key}{held}{note}")
    if schedule.report_s:
        lines.append(f"  report: {schedule.end_s - schedule.report_s:5.0f} s -> {schedule.end_s:5.0f} s")
    limit = "" if schedule.limit_s is None else f" of {schedule.limit_s:.0f} s allowed"
    verdict = "" if schedule.limit_s is None else ("  (fits)" if schedule.fits() else "  (DOES NOT FIT)")
    lines.append(f"total: {schedule.end_s:.0f} s ({schedule.end_s / 60:.1f} min){limit}{verdict}")
    if schedule.dropped:
        lines.append(f"dropped (no time left): {', '.join(schedule.dropped)}")
    return lines
