"""The phase model's pipeline counts are the run's: each closed form in ``timeline/schedule.py``
(what ``memory.inflight_layers``, ``memory._stage_phases`` and ``memory.cached_logits``
read) equals the walk over the actions the op-level run follows
(``schedule_actions``, the bundled trainer's order: ``memplan/train/pipeline.py``)."""

from __future__ import annotations

import pytest

from memplan.costmodel.timeline.schedule import (
    backward_first,
    chunks_in_flight,
    in_flight,
    last_chunk_outputs,
    schedule_actions,
)

GRID = [
    (schedule, p, v, m)
    for schedule, virtual in (("1f1b", (1,)), ("gpipe", (1,)), ("interleaved", (2, 3, 4)))
    for p in (2, 3, 4, 8)
    for v in virtual
    for m in range(1, 19)
    if schedule != "interleaved" or m % p == 0  # the trainer's interleaved schedule: m a multiple of p
]


@pytest.mark.parametrize("schedule,p,v,m", GRID)
def test_the_closed_forms_are_the_schedules_walk(schedule, p, v, m):
    for stage in range(p):
        walk = in_flight(schedule_actions(schedule, p, v, stage, m), v)
        chunks = chunks_in_flight(schedule, p, v, stage, m)
        assert chunks == walk.most, stage
        assert backward_first(schedule, m, v, chunks) == walk.backward_first, stage
    last = in_flight(schedule_actions(schedule, p, v, p - 1, m), v)
    assert last_chunk_outputs(schedule, m) == last.per_chunk[v - 1]


def test_gpipes_last_rank_holds_every_micro_batchs_logits():
    """GPipe runs every forward before the first backward: the last rank's first loss backward
    sees all ``m`` logits in ``fwd_cache``; 1F1B's last rank one (its backward follows each forward)."""
    assert in_flight(schedule_actions("gpipe", 2, 1, 1, 8), 1).per_chunk == (8,)
    assert in_flight(schedule_actions("1f1b", 2, 1, 1, 8), 1).per_chunk == (1,)
