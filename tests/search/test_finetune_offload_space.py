"""Offload in the fine-tuning search (issue 17, item 6; issue 20's single GPU): activation offload
in the space under ``--allow-offload`` for the loops that run it, scored by the time model's PCIe
term; seeds start without it; the table's offload label says what a plan offloads."""

from __future__ import annotations

import pytest

from memplan.costmodel.memory import activation_offload_bytes
from memplan.costmodel.time import activation_offload_s
from memplan.search.evaluate import Context, evaluate
from memplan.search.seeds import template_seeds
from memplan.search.space import SpaceOptions, activation_offloads, enumerate_space
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model

L8 = load_model("llama3-8b")
LORA = {"finetune": "lora", "precisions": ("bf16",), "seq_len": 4096}


@pytest.mark.parametrize(
    ("allow", "runtime", "want"),
    [(True, "hf", ("none", "cpu")), (True, "hf-loop", ("none", "cpu")), (True, "memplan", ("none", "cpu")),
     (True, "megatron", ("none",)), (False, "hf", ("none",))],
)  # fmt: skip
def test_activation_offload_is_offered_where_a_loop_runs_it(allow, runtime, want):
    assert activation_offloads(allow, runtime) == want


def test_the_space_doubles_with_activation_offload_and_keeps_every_other_plan():
    plain = enumerate_space(L8, SpaceOptions(gpus=1, allow_offload=True, **LORA))
    both = enumerate_space(L8, SpaceOptions(gpus=1, allow_offload=True, offload_activations=("none", "cpu"), **LORA))
    assert len(both) == 2 * len(plain)
    assert {c.key[:-1] for c in both.candidates if c.plan.offload_activations == "cpu"} == {
        c.key[:-1] for c in plain.candidates
    }
    assert both.choices["offload_activations"] == ("none", "cpu")
    states = {"none", "optimizer", "optimizer+params", "optimizer(nvme)", "optimizer(nvme)+params",
              "optimizer(nvme)+params(nvme)"}  # fmt: skip
    labels = {c.offload_label for c in both.candidates}
    assert labels == states | {"activations"} | {f"{s}+activations" for s in states - {"none"}}


def test_an_offloaded_plan_pays_the_pcie_term():
    gpu = load_gpu("rtx-4090")
    ctx = Context(model=L8, gpu=gpu, cluster=ClusterSpec(gpus_per_node=1), runtime="hf")
    space = enumerate_space(L8, SpaceOptions(gpus=1, offload_activations=("none", "cpu"), micro_batch=1, **LORA))
    pairs = {}
    for c in space.candidates:
        if c.plan.recompute == "none":
            pairs[c.plan.offload_activations] = evaluate(c, ctx)
    off, on = pairs["none"], pairs["cpu"]
    assert on.peak_allocated_bytes < off.peak_allocated_bytes  # the layers' saved tensors leave the device
    mechanism, moved = activation_offload_bytes(L8, on.workload, on.plan, "hf")
    assert mechanism == "trl" and moved > 0
    assert on.step_time_s > off.step_time_s  # TRL's streams hide part of the copies, not all (PCIe 4.0 x16)
    assert activation_offload_s(moved, gpu.pcie_bytes_per_s, 0.0, mechanism) == 2 * moved / gpu.pcie_bytes_per_s


def test_templates_start_without_activation_offload():
    gpu = load_gpu("a100-80gb")
    ctx = Context(model=L8, gpu=gpu, cluster=ClusterSpec(gpus_per_node=1), runtime="hf")
    options = SpaceOptions(gpus=1, allow_offload=True, offload_activations=("none", "cpu"), max_micro_batch=4, **LORA)
    space = enumerate_space(L8, options)
    found = template_seeds(space, lambda c: evaluate(c, ctx), "throughput")
    assert found and all(ev.plan.offload_activations == "none" for ev in found)


def test_the_bundled_trainer_is_offered_offload_only_where_it_runs_it():
    """Runtime memplan: offload on the plans the trainer offloads (tp = pp = cp = 1, no FSDP2, recompute
    none or full, no accumulation over dp); the others keep offload_activations none."""
    from memplan.costmodel.trainer_offload import unmodelled

    options = SpaceOptions(gpus=2, allow_offload=True, offload_activations=("none", "cpu"), offload_runtime="memplan")
    space = enumerate_space(L8, options.model_copy(update={"seq_len": 2048, "global_batches": (8,)}))
    offloaded = [c for c in space.candidates if c.plan.offload_activations == "cpu"]
    assert offloaded and all(unmodelled(c.plan) is None for c in offloaded)
    assert {c.plan.recompute for c in offloaded} == {"none", "full"}
    assert any(c.plan.tp > 1 for c in space.candidates if c.plan.offload_activations == "none")
    ctx = Context(model=L8, gpu=load_gpu("h100-sxm"), cluster=ClusterSpec(gpus_per_node=2), runtime="memplan")
    scored = [evaluate(c, ctx) for c in offloaded[:20]]
    assert all(ev.peak_allocated_bytes > 0 for ev in scored)
