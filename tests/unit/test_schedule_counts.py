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
    sends_held,
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


def test_the_sends_held_to_the_steps_end():
    """GPipe's and the interleaved schedule's sends keep every sent output (chunks but the global
    last) and input gradient (chunks but the global first) to the step's end. The interleaved last
    rank (pp 2, v 2, 8 micro-batches) holds chunk 1's 8 outputs and the 13 input gradients sent
    before its last forward, as many at its last loss backward with three chunks in flight (the run
    of this rank peaks there on the 1B: tests/search/test_fast_form_grid.py); GPipe's middle rank
    holds its ``m`` outputs at its first backward, none of its gradients yet."""
    assert sends_held("interleaved", 2, 2, 1, 8) == (21, 21)
    assert sends_held("gpipe", 4, 1, 1, 8) == (8, 8)
    assert sends_held("gpipe", 2, 1, 1, 8) == (0, 0)  # the last rank sends its gradients only
