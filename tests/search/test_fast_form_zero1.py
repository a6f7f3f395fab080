"""The search's fast form under the bundled trainer's ZeRO-1: the whole model's partition carried
into the cut runs (``fast_run._zero1_shard``, ``_cut_shard``).

``ZeroRedundancyOptimizer`` deals whole parameters, largest first, to the least-loaded rank
(``timeline/zero1.py``), so the most-loaded rank of a 4- or 6-layer model steps other layers'
tensors, in another order, than the whole model's: the cut runs' optimizer spans did not line up
and the phase model answered (+0.97% and -66.6% on the 1B config, LoRA fp32 and QLoRA; -3.25% and
-38.1% on llama3-8b, fp32 and QLoRA). The cut runs now step the whole model's share; the plans
are held to the whole run in tests/search/test_fast_form_grid.py."""

from __future__ import annotations

from pathlib import Path

from memplan.costmodel import fast_run as FR
from memplan.costmodel.timeline import zero1
from memplan.costmodel.timeline.trainer import optimized_params, trainer_run
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA1B = load_model(str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json"))
LORA = Plan(dp=8, zero=1, finetune="lora", precision="fp32", recompute="none")
WL = TrainingWorkload(seq_len=1024, micro_batch=1, global_batch=8)


def _cut(model, depth: int):
    return model.model_copy(update={"num_layers": depth})


def _labels(plan: Plan, carried: bool) -> list[list[str]]:
    """The cut runs' span labels at their two depths, with or without the whole model's share."""
    shard = FR._zero1_shard(LLAMA1B, WL, plan, "memplan")
    out = []
    for n in FR.cut_depths(LLAMA1B.num_layers):
        cut_shard = FR._cut_shard(shard, LLAMA1B.num_layers, n) if carried else None
        spans = FR._span_peaks(_cut(LLAMA1B, n), WL, plan, "memplan", "cuda", None, cut_shard)
        out.append([label for label, _ in spans])
    return out


def test_the_cut_runs_own_partitions_do_not_line_up():
    """The cause: each cut model's own most-loaded rank steps adapters of other layers (at 4
    layers the next to last's where at 6 the last's), so the optimizer's spans differ."""
    shallow, deep = _labels(LORA, carried=False)
    assert shallow != deep


def test_the_carried_partition_lines_up():
    shallow, deep = _labels(LORA, carried=True)
    assert shallow == deep


def test_the_cut_share_is_the_whole_models_renamed():
    """The same elements in the same order, each name one of the cut model's parameters of the same
    size, at the same place: the first two layers', the last two's, the middle ones' the second's."""
    shard, layers = FR._zero1_shard(LLAMA1B, WL, LORA, "memplan"), LLAMA1B.num_layers
    for n in FR.cut_depths(layers):
        cut = FR._cut_shard(shard, layers, n)
        own = dict(optimized_params(_cut(LLAMA1B, n), WL, LORA))
        assert [size for _, size in cut] == [size for _, size in shard]
        assert all(own[name] == size for name, size in cut)
        renamed = dict(zip((name for name, _ in shard), (name for name, _ in cut), strict=True))
        for before, after in renamed.items():
            i = FR._LAYER.search(before)
            if i is None:
                assert after == before
                continue
            j = int(FR._LAYER.search(after).group(1))
            k = int(i.group(1))
            assert j == {0: 0, 1: 1, layers - 2: n - 2, layers - 1: n - 1}.get(k, 1), (before, after)


def test_the_carried_share_is_the_runs_own_where_it_is_the_same():
    """``trainer_run(zero1_shard=...)`` with the model's own most-loaded share is the run without it."""
    own = zero1.shard(optimized_params(LLAMA1B, WL, LORA), LORA.dp)
    assert trainer_run(LLAMA1B, WL, LORA, zero1_shard=own).events == trainer_run(LLAMA1B, WL, LORA).events


def test_only_zero1_carries_a_share():
    for fields in (dict(dp=8, zero=0), dict(dp=1), dict(dp=8, zero=3)):
        assert FR._zero1_shard(LLAMA1B, WL, Plan(finetune="lora", precision="fp32", **fields), "memplan") is None
    assert FR._zero1_shard(LLAMA1B, WL, LORA, "hf") is None  # the Trainer's ZeRO-1 is DeepSpeed's
