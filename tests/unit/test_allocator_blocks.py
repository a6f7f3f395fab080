"""The blocks a build holds (``allocator.blocks``, ``build_blocks``) against the allocator model
and the op-level run's own build."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from memplan.costmodel.allocator import AllocatorConfig, CachingAllocator
from memplan.costmodel.allocator.blocks import fresh_blocks, repeated_fresh_blocks
from memplan.costmodel.build_blocks import parameter_block_excess
from memplan.costmodel.timeline.events import ALLOC, FREE, Category
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

MiB = 2**20
LLAMA1B = Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json"


def block_excess(sizes: tuple[int, ...]) -> int:
    return fresh_blocks(sizes) - sum(sizes)


def _allocated(sizes) -> int:
    """What the allocator model holds after ``sizes`` are malloc'd in order, none freed."""
    alloc = CachingAllocator(AllocatorConfig())
    for size in sizes:
        alloc.malloc(size)
    return alloc.allocated


@pytest.mark.parametrize(
    "sizes",
    [
        (1_835_008,) * 96,  # llama3-8b's MLP shards at dp 64: the 11th of each 20 MiB segment unsplit
        (131_334_144, 16_416_768, 65_667_072),  # >= 10 MiB: each its segment, rest <= 1 MiB kept
        (6_817_792,) * 32,  # a third of each 20 MiB segment's requests keeps 518,144 B
        (4, 8_192, 1_048_576, 1_048_577, 3 * MiB + 1, 9 * MiB, 10 * MiB, 10 * MiB + 512),
    ],
)
def test_fresh_blocks_are_the_allocators(sizes):
    assert fresh_blocks(sizes) == _allocated(sizes)


def test_fresh_blocks_of_mixed_sizes_are_the_allocators():
    rng = random.Random(27)
    for _ in range(20):
        sizes = tuple(
            rng.choice((rng.randint(1, MiB), rng.randint(MiB, 12 * MiB), rng.randint(12 * MiB, 40 * MiB)))
            for _ in range(60)
        )
        assert fresh_blocks(sizes) == _allocated(sizes), sizes


def test_a_repeated_body_is_placed_as_every_repeat_would_be():
    """``repeated_fresh_blocks`` (a build's alike layers, the period found) is ``fresh_blocks`` of the
    whole sequence, which is the allocator's."""
    rng = random.Random(28)

    def pick() -> int:
        return rng.choice((rng.randint(1, MiB), rng.randint(MiB, 12 * MiB), rng.randint(12 * MiB, 40 * MiB)))

    for _ in range(150):
        head, tail = tuple(pick() for _ in range(rng.randint(0, 3))), tuple(pick() for _ in range(rng.randint(0, 3)))
        body, times = tuple(pick() for _ in range(rng.randint(1, 6))), rng.randint(0, 90)
        whole = head + body * times + tail
        assert repeated_fresh_blocks(head, body, times, tail) == _allocated(whole), (head, body, times, tail)


def test_an_unsplit_rest_counts():
    # 1,835,008 B: ten split off a 20 MiB segment leave 2,621,440 B; the eleventh keeps all of it
    assert block_excess((1_835_008,) * 11) == 2_621_440 - 1_835_008
    assert block_excess((131_334_144,)) == 786_432  # V/8 x h fp32 of a 1B Llama: 63 x 2 MiB
    assert block_excess((262_668_288,)) == 0  # 8B's: 1.5 MiB would remain, so the block is split


@pytest.mark.parametrize(
    "name,fields",
    [
        ("llama3-8b", dict(dp=64, zero=3, precision="bf16")),
        ("llama3-8b", dict(dp=8, tp=8, zero=3, sequence_parallel=True, precision="bf16")),
        ("llama3-8b", dict(dp=8, zero=2, precision="bf16-mixed")),
        ("llama3-8b", dict(tp=8, precision="bf16-master")),
        ("qwen2.5-7b", dict(dp=8, zero=3, precision="bf16")),  # q, k, v biases after their weights
        ("qwen2.5-7b", dict(dp=64, zero=3, precision="fp32")),
        (str(LLAMA1B), dict(dp=8, tp=2, zero=3, sequence_parallel=True, precision="bf16")),  # tied
        (str(LLAMA1B), dict(tp=8, precision="bf16-mixed")),
    ],
)
def test_the_parameters_blocks_are_the_runs_build(name, fields):
    """The run's build (every allocation before the first that is not a parameter, FSDP2's
    process-group tensor aside, and the frees among them) through the allocator model holds the parameters' bytes plus
    ``parameter_block_excess``."""
    from memplan.costmodel.timeline.trainer import dims, trainer_run
    from memplan.costmodel.timeline.trainer_model import param_shapes

    model, plan = load_model(name), Plan(**fields)
    run = trainer_run(model, TrainingWorkload(seq_len=512, micro_batch=1, global_batch=plan.dp), plan)
    alloc, blocks, params = CachingAllocator(AllocatorConfig()), {}, 0
    for op, tensor, size, category, _, tag in run.events:
        if op == FREE and tensor in blocks:  # the process-group tensor; a tied head's copy (tie_weights)
            alloc.free(blocks.pop(tensor))
            params -= size if category == Category.PARAMETERS else 0
        if op != ALLOC:
            continue
        if category != Category.PARAMETERS and tag != "process_group_init":
            break
        blocks[tensor] = alloc.malloc(size)
        params += size if category == Category.PARAMETERS else 0
    shapes = param_shapes(dims(model, TrainingWorkload(), plan), model.tied_embeddings).values()
    shard = plan.dp if plan.dp > 1 and plan.zero >= 2 else 1
    pd = 2 if fields["precision"] in ("bf16", "bf16-master") else 4
    assert params == sum(-(-rows // shard) * cols for rows, cols in shapes) * pd
    assert alloc.allocated - params == parameter_block_excess(model, plan)
    assert parameter_block_excess(model, Plan(**fields, pp=2)) == 0  # a pipeline stage's build: not this rule
