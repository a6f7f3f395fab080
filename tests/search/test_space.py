"""The enumerated plan space: every plan valid, nothing valid missing on small cases, every
dimension offered where it applies."""

from __future__ import annotations

import pytest

from memplan.search.space import (
    DIMENSIONS,
    SpaceOptions,
    enumerate_space,
    global_batch_range,
)
from memplan.specs.job import check_compatible
from memplan.specs.loader import load_model
from memplan.specs.model import ModelSpec


def tiny(layers: int = 2) -> ModelSpec:
    return ModelSpec(
        name="tiny", hidden_size=128, num_layers=layers, num_attention_heads=2, num_kv_heads=2, ffn_size=256,
        vocab_size=1000,
    )  # fmt: skip


def test_hand_counted_small_space():
    # tp=1 pp=1 dp=2: micro-batch {1, 2} x ZeRO 0-3 x 4 recompute = 32; tp=1 pp=2 dp=1: micro-batch
    # {1, 2, 4} x ZeRO 0 x 4 = 12 (2 layers: no interleaving); tp=2 dp=1: 12. Total 56.
    options = SpaceOptions(gpus=2, gpus_per_node=2, seq_len=64, global_batches=(4,), max_micro_batch=4)
    assert len(enumerate_space(tiny(2), options)) == 56
    # 4 layers: pp=2 also runs interleaved (2 x 2 chunks) where 4 / micro-batch is even (1, 2)
    assert len(enumerate_space(tiny(4), options)) == 56 + 2 * 4


@pytest.mark.parametrize(
    ("name", "gpus", "options"),
    [
        ("llama3-8b", 8, {"seq_len": 8192, "global_batches": (128,)}),
        ("llama3-70b", 64, {"seq_len": 8192, "global_batches": (512,), "allow_offload": True}),
        ("mixtral-8x7b", 16, {"seq_len": 4096, "global_batches": (256,), "precisions": ("bf16-mixed", "bf16")}),
        ("llama3-8b", 16, {"seq_len": 32768, "global_batches": (64, 128)}),
        ("llama3-8b", 4, {"seq_len": 2048}),
    ],
)
def test_every_plan_is_valid_and_uses_every_gpu(name: str, gpus: int, options: dict):
    model = load_model(name)
    opts = SpaceOptions(gpus=gpus, gpus_per_node=min(gpus, 8), **options)
    space = enumerate_space(model, opts)
    assert len(space) > 0
    keys = set()
    for c in space.candidates:
        p, w = c.plan, c.workload
        check_compatible(model, w, p)  # raises if not
        assert p.world_size == gpus
        assert p.tp <= opts.gpus_per_node
        assert p.sequence_parallel == (p.tp > 1)
        # ZeRO over one data rank only with offload: stage 1 with the optimizer on the CPU (ZeRO-Offload),
        # stage 3 with the optimizer and the parameters on the CPU, or the optimizer on NVMe (ZeRO-Infinity)
        nvme = [("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")]
        offloaded = {1: [("cpu", "none")], 3: [("cpu", "cpu"), *nvme]}.get(p.zero, [])
        one_rank_ok = opts.allow_offload and (p.offload_optimizer, p.offload_params) in offloaded
        assert p.zero == 0 or p.dp * p.cp > 1 or one_rank_ok
        assert w.micro_batch & (w.micro_batch - 1) == 0 and w.micro_batch <= opts.max_micro_batch
        assert w.global_batch in (opts.global_batches or (None,))
        if w.global_batch is not None:
            assert w.global_batch % (w.micro_batch * p.dp) == 0
        if p.pp_schedule == "interleaved":
            assert p.virtual_stages == 2 and model.num_layers % (2 * p.pp) == 0
            assert (w.global_batch // (w.micro_batch * p.dp)) % p.pp == 0
        if p.ep > 1:
            assert (p.dp * p.cp) % p.ep == 0 and model.moe.num_experts % p.ep == 0
        assert p.precision in opts.precisions
        keys.add(c.key)
    assert len(keys) == len(space)  # no plan twice


def test_dimensions_covered_for_llama3_70b():
    space = enumerate_space(load_model("llama3-70b"), SpaceOptions(gpus=64, seq_len=8192, global_batches=(512,)))
    values = space.values
    assert set(values["tp"]) == {1, 2, 4, 8}
    assert set(values["pp"]) == {1, 2, 4, 8, 16}  # divisors of 80 layers that divide 64 GPUs
    assert set(values["schedule"]) == {"1f1b", "interleaved"}
    assert set(values["zero"]) == {0, 1, 2, 3}
    assert set(values["recompute"]) == {"none", "selective", "selective-op", "full"}
    assert set(values["micro_batch"]) == {1, 2, 4, 8, 16}
    assert values["cp"] == (1,) and values["offload"] == ("none",)
    assert values["precision"] == ("bf16-master",)  # one default precision, the plan's
    assert set(space.choices) == {"tp", "pp", "schedule", "zero", "recompute", "micro_batch"}


def test_context_parallel_only_for_long_sequences_or_when_asked():
    model = load_model("llama3-8b")
    assert enumerate_space(model, SpaceOptions(gpus=16, seq_len=8192)).values["cp"] == (1,)
    assert set(enumerate_space(model, SpaceOptions(gpus=16, seq_len=32768)).values["cp"]) == {1, 2, 4, 8}
    assert set(enumerate_space(model, SpaceOptions(gpus=16, seq_len=8192, max_cp=2)).values["cp"]) == {1, 2}


def test_expert_parallel_for_moe_only():
    assert enumerate_space(load_model("llama3-8b"), SpaceOptions(gpus=16)).values["ep"] == (1,)
    values = enumerate_space(load_model("mixtral-8x7b"), SpaceOptions(gpus=16)).values
    assert set(values["ep"]) == {1, 2, 4, 8}


def test_offload_only_when_allowed():
    model = load_model("llama3-8b")
    space = enumerate_space(model, SpaceOptions(gpus=8, allow_offload=True))
    nvme = {"optimizer(nvme)", "optimizer(nvme)+params", "optimizer(nvme)+params(nvme)"}
    assert set(space.values["offload"]) == {"none", "optimizer", "optimizer+params"} | nvme
    for c in space.candidates:
        if c.coordinates["offload"] == "optimizer+params":
            assert c.plan.zero == 3 and c.plan.offload_params == "cpu"
        if c.coordinates["offload"] in nvme:  # ZeRO-Infinity's NVMe tier: on one data rank, stage 3
            assert c.plan.zero == 3 and c.plan.dp * c.plan.cp == 1
    assert enumerate_space(model, SpaceOptions(gpus=8)).values["offload"] == ("none",)


def test_fixed_micro_batch_and_global_batch_range():
    assert global_batch_range(256, 1024) == (256, 512, 1024)
    assert global_batch_range(100, 300) == (100, 128, 256, 300)
    space = enumerate_space(load_model("llama3-8b"), SpaceOptions(gpus=8, micro_batch=2, global_batches=(64, 128)))
    assert space.values["micro_batch"] == (2,)
    assert set(space.values["global_batch"]) == {64, 128}


def test_find_and_nearest():
    space = enumerate_space(load_model("llama3-8b"), SpaceOptions(gpus=8, seq_len=8192, global_batches=(128,)))
    c = space.candidates[17]
    assert space.find(space.params(c)) is c
    assert space.nearest(space.params(c)) is c
    # ZeRO-3 with tp=8 leaves no data parallelism: not a plan; the nearest keeps tp, pp, recompute
    wanted = {**space.params(c), "tp": 8, "pp": 1, "zero": 3, "recompute": "full", "micro_batch": 16}
    assert space.find(wanted) is None
    near = space.nearest(wanted)
    assert (near.plan.tp, near.plan.pp, near.plan.zero) == (8, 1, 0)
    assert near.workload.micro_batch == 16 and near.plan.recompute == "full"  # dp=1: 128 sequences per replica


def test_no_plan_at_all():
    # 3 GPUs: TP 3 does not split 32 heads; PP 3 does not split 32 layers; DP 3 does not split 128 sequences
    space = enumerate_space(load_model("llama3-8b"), SpaceOptions(gpus=3, gpus_per_node=3, global_batches=(128,)))
    assert len(space) == 0


def test_dimensions_are_the_plan_coordinates():
    space = enumerate_space(tiny(4), SpaceOptions(gpus=2, gpus_per_node=2, seq_len=64, global_batches=(4,)))
    assert tuple(space.candidates[0].coordinates) == DIMENSIONS
    assert all(set(space.params(c)) == set(space.choices) for c in space.candidates)


def test_one_gpu_with_offload_tries_zero_offload():
    """DeepSpeed's ZeRO-Offload on one GPU (stage 1, optimizer states and step on the CPU) is in
    the space when offload is allowed, and only then."""
    model = load_model("llama3-8b")
    plans = [c.plan for c in enumerate_space(model, SpaceOptions(gpus=1, allow_offload=True)).candidates]
    assert any(p.zero == 1 and p.offload_optimizer == "cpu" for p in plans)
    assert all(p.offload_optimizer == "cpu" for p in plans if p.zero == 1)
    # and ZeRO-3 with the parameters on the CPU too (ZeRO-Infinity's CPU offload, FSDP2's CPUOffloadPolicy);
    # stage 2 on one rank is stage 1 and is not tried twice
    assert {p.zero for p in plans} == {0, 1, 3}
    # or the optimizer states on NVMe with the parameters on the GPU, the CPU or NVMe (ZeRO-Infinity's NVMe tier)
    assert {(p.offload_optimizer, p.offload_params) for p in plans if p.zero == 3} == {
        ("cpu", "cpu"), ("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme"),
    }  # fmt: skip
    plain = [c.plan for c in enumerate_space(model, SpaceOptions(gpus=1)).candidates]
    assert {p.zero for p in plain} == {0}


def test_finetune_space_keeps_the_adapters_and_varies_the_base_when_allowed():
    model = load_model("llama3-8b")
    lora = dict(finetune="lora", lora_rank=8, lora_targets=("all-linear",), modules_to_save=("lm_head",))
    fixed = enumerate_space(model, SpaceOptions(gpus=1, **lora))
    assert {(c.plan.finetune, c.plan.quant, c.plan.lora_rank) for c in fixed.candidates} == {("lora", "none", 8)}
    assert all(
        c.plan.lora_targets == ("all-linear",) and c.plan.modules_to_save == ("lm_head",) for c in fixed.candidates
    )
    bits = enumerate_space(model, SpaceOptions(gpus=1, quants=("none", "int8", "nf4"), **lora))
    assert {(c.plan.finetune, c.plan.quant) for c in bits.candidates} == {
        ("lora", "none"),
        ("qlora", "int8"),
        ("qlora", "nf4"),
    }
    assert "quant" in bits.choices and "quant" not in fixed.choices
    qlora = enumerate_space(model, SpaceOptions(gpus=1, finetune="qlora", quants=("nf4",)))
    assert all(c.plan.double_quant and c.plan.quant == "nf4" for c in qlora.candidates)
