"""StageReplay against ``torch.distributed.pipelining`` itself, byte for byte (issue 29).

Under rank simulation memplan cannot run PyTorch's schedules (the fake process group moves nothing), so
a pipelined run measures ``memplan.train.pipeline.StageReplay``: memplan's account of what a stage
keeps. Here the schedules run for real, on gloo ranks in processes of their own, and each rank's live
tensor storages are counted at the entry of every forward and backward and after the step
(pipeline_ranks.py); StageReplay, run for the same rank in one process, must give the same sequence:
the same actions in the same order, the same live bytes at each, the same peak between each two.
"""

from __future__ import annotations

import pytest

from tests.validate.pipeline_ranks import Case, Mark, measure

CASES = [
    Case("1f1b", 2),
    Case("gpipe", 2),
    Case("interleaved", 2, virtual=2),
    Case("1f1b", 4),
    Case("interleaved", 4, virtual=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stage_replay_equals_torch_schedule_at_every_action(case: Case):
    ranks = measure(case)
    assert sorted(ranks) == list(range(case.pp))
    for rank, sides in ranks.items():
        measured, replayed = sides["torch"], sides["replay"]
        assert [m.action for m in replayed] == [m.action for m in measured], (case.name, rank)
        assert len(measured) == 2 * case.virtual * case.microbatches + 1
        for got, want in zip(replayed, measured, strict=True):
            assert got == want, f"{case.name} rank {rank}: replay {_show(got)}, torch {_show(want)}"


def _show(mark: Mark) -> str:
    return f"{mark.action} live {mark.live:,} peak {mark.peak:,}"
