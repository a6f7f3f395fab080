"""``allocator.run.run_events`` (a run fed to the allocator in one frame, its common paths inlined)
against the same events fed through ``CachingAllocator.malloc`` / ``free`` one by one: every
block, pool key and counter equal after the run, and the same allocated peak and state there."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from memplan.costmodel.allocator import AllocatorConfig, AllocatorOOM, CachingAllocator, load_snapshot, parse_alloc_conf
from memplan.costmodel.allocator.run import ALLOC, FREE, RunPeak, run_events

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
MARK = 2
CONFIGS = {
    "default": AllocatorConfig(),
    "expandable": parse_alloc_conf("expandable_segments:True"),
    "max-split": parse_alloc_conf("max_split_size_mb:64,roundup_power2_divisions:4"),
}
STREAMS = {"compute": 0, "all_gather": 1, "reduce_scatter": 2}


def one_by_one(alloc: CachingAllocator, events: list[tuple], on_mark=None) -> RunPeak:  # noqa: ANN001
    """The loop ``reserve.replay`` ran before ``run_events``: ``malloc`` / ``free`` per event."""
    live, high, peak_event, at_peak, pending = {}, alloc.allocated, -1, alloc.stats(), False
    for i, (op, tensor, size, _, stream, _) in enumerate(events):
        if op == ALLOC:
            try:
                live[tensor] = alloc.malloc(size, STREAMS[stream])
            except AllocatorOOM as error:
                return RunPeak(high, peak_event, alloc.stats() if pending else at_peak, i, error)
            if alloc.allocated > high:
                high, peak_event, pending = alloc.allocated, i, True
        elif op == FREE:
            if pending:
                at_peak, pending = alloc.stats(), False
            alloc.free(live.pop(tensor))
        elif on_mark is not None:
            on_mark(alloc, i)
    return RunPeak(high, peak_event, alloc.stats() if pending else at_peak)


def state(alloc: CachingAllocator) -> tuple:
    """Everything the allocator holds: counters, each pool's keys and blocks, each segment's chain."""
    segments, pools = {}, []
    for small, pool in sorted(alloc._pools.items()):
        cached = [
            (k, b.size, b.addr, b.stream, b.segment, b.gc_count_base)
            for k, b in zip(pool.keys, pool.blocks, strict=True)
        ]
        pools.append((small, cached, list(pool.unmapped), pool.get_free_blocks_call_count))
        # the key each cached block carries (run_events finds a merged neighbour by it) is its pool key
        assert [b.key for b in pool.blocks] == pool.keys
        for block in (*pool.blocks, *pool.unmapped_blocks):
            while block.prev is not None:
                block = block.prev
            segments[block.segment] = block
    chains = {}
    for segment, block in segments.items():
        chain = []
        while block is not None:
            chain.append((block.addr, block.size, block.allocated, block.mapped, block.expandable))
            # the home run_events' free reads: its pool's lists and its stream's key bits
            pool, home = alloc._pools[block.small], block.home
            if block.expandable:
                assert home is None
            else:
                assert home[0] is pool.keys and home[1] is pool.blocks and home[2] == block.stream << 128
            block = block.next
        chains[segment] = chain
    counters = {k: v for k, v in vars(alloc).items() if isinstance(v, int | dict) and not k.startswith("_")}
    stats = alloc.stats()
    # stats' cached bytes come from the counters (reserved less allocated and deferred): the pools' blocks
    assert stats.cached_free == sum(pool.cached_bytes() for pool in alloc._pools.values())
    return stats, pools, sorted(chains.items()), counters


def both(
    events: list[tuple],
    config: AllocatorConfig,
    capacity: int | None = None,
    prepare=None,  # noqa: ANN001 (a callable given each allocator before the run)
    reset: bool = False,
) -> tuple[RunPeak, tuple]:
    """``run_events`` and the one-by-one loop over ``events``; asserts they end in one state. ``prepare``
    is applied to both allocators first; ``reset``: each mark resets the peaks, as ``reserve.replay``'s do."""
    fast, slow = CachingAllocator(config, capacity_bytes=capacity), CachingAllocator(config, capacity_bytes=capacity)
    if prepare is not None:
        prepare(fast)
        prepare(slow)
    marks: list[int] = []

    def mark(alloc: CachingAllocator, i: int) -> None:
        marks.append(i)
        if reset:
            alloc.max_allocated = alloc.allocated

    got = run_events(fast, events, STREAMS, lambda i, event: mark(fast, i))
    want = one_by_one(slow, events, lambda alloc, i: reset and setattr(alloc, "max_allocated", alloc.allocated))
    assert (got.high, got.event, got.stats, got.oom) == (want.high, want.event, want.stats, want.oom)
    assert (got.error is None) == (want.error is None)
    assert state(fast) == state(slow)
    stop = got.oom if got.oom >= 0 else len(events)
    assert marks == [i for i, event in enumerate(events[:stop]) if event[0] == MARK]
    return got, state(fast)


def random_run(seed: int, n: int = 4000) -> list[tuple]:
    """Allocations of a run's kinds of sizes (small, 1-10 MiB, large; repeated sizes) on three
    streams, each freed after a random while or never, with a mark now and then."""
    rng = random.Random(seed)
    sizes = [
        rng.choice([rng.randint(1, 2**20), rng.randint(2**20, 10 * 2**20), rng.randint(2**23, 2**30)])
        for _ in range(40)
    ]
    events, live, tensor = [], [], 0
    for _ in range(n):
        r = rng.random()
        if r < 0.02:
            events.append((MARK, -1, 0, None, "compute", "mark"))
        elif r < 0.55 or not live:
            stream = rng.choice(["compute"] * 8 + ["all_gather", "reduce_scatter"])
            size = rng.choice(sizes) if rng.random() < 0.9 else rng.randint(1, 2**29)
            events.append((ALLOC, tensor, size, "activations", stream, ""))
            live.append((tensor, size, stream))
            tensor += 1
        else:
            t, size, stream = live.pop(rng.randrange(len(live)) if rng.random() < 0.5 else -1)
            events.append((FREE, t, size, "activations", stream, ""))
    return events


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("seed", range(4))
def test_random_runs_equal_the_one_by_one_calls(config, seed):
    events = random_run(seed)
    free, _ = both(events, CONFIGS[config])
    assert free.oom == -1 and free.high > 0
    # bounded: the retries (release_cached_blocks) and, past them, an out-of-memory stop
    for fraction in (0.9, 0.6):
        both(events, CONFIGS[config], capacity=int(free.stats.max_reserved * fraction))


def trace_run(name: str) -> list[tuple]:
    """A real trace's allocations and frees (``free_requested``) as a run's events."""
    names = {0: "compute"}
    events, ids = [], {}
    for event in load_snapshot(TRACES / f"{name}.pkl.gz")["device_traces"][0]:
        stream = names.setdefault(event.get("stream", 0), list(STREAMS)[min(len(names), 2)])
        if event["action"] == "alloc":
            ids[event["addr"]] = tensor = len(events)
            events.append((ALLOC, tensor, event["size"], "activations", stream, ""))
        elif event["action"] == "free_requested" and event["addr"] in ids:
            events.append((FREE, ids.pop(event["addr"]), event["size"], "activations", stream, ""))
    return events


@pytest.mark.parametrize("name", ["t8_z3_bf16", "t8_tp2_x", "h200_b_pp4"])
def test_real_traces_equal_the_one_by_one_calls(name):
    events = trace_run(name)
    config = CONFIGS["expandable"] if name.endswith("_x") else CONFIGS["default"]
    free, _ = both(events, config)
    both(events, config, capacity=int(free.stats.max_reserved * 0.8))


def _used(alloc: CachingAllocator) -> None:
    """An allocator used before the run: its max_allocated (256 GiB, freed) above the run's whole peak."""
    alloc.free(alloc.malloc(2**38, 0))
    alloc.malloc(3 * 2**20, 1)


def _pending(alloc: CachingAllocator) -> None:
    """A free still waiting on another stream (``record_stream``) when the run starts."""
    alloc.free(alloc.malloc(5 * 2**20, 0), pending_streams=[1])


def _gc_counted(alloc: CachingAllocator) -> None:
    """A pool's ``get_free_blocks_call_count`` kept under earlier settings (garbage collection)."""
    alloc._pools[False].get_free_blocks_call_count = 7
    alloc.free(alloc.malloc(4 * 2**20, 0))


@pytest.mark.parametrize("reset", [False, True], ids=["marks", "resets"])
@pytest.mark.parametrize("prepare", [_used, _pending, _gc_counted])
@pytest.mark.parametrize("seed", range(2))
def test_runs_from_a_used_allocator(prepare, seed, reset):
    """Runs that start where the inlined paths' shortcuts do not hold (a peak above the allocated bytes,
    a deferred free, a garbage-collection count), with marks that reset the peaks or not: the same state
    and peak."""
    events = random_run(seed + 10, 2500)
    free, _ = both(events, CONFIGS["default"], prepare=prepare, reset=reset)
    held = 2**38 if prepare is _used else 0  # its freed 256 GiB segment, cached until a retry releases it
    limit = held + int((free.stats.max_reserved - held) * 0.7)
    both(events, CONFIGS["default"], capacity=limit, prepare=prepare, reset=reset)
