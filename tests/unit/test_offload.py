"""Activation offload to CPU (``plan.offload_activations: cpu``): the memory model's wiring (what
leaves the device, what stays, the pinned host memory), the refusals, and the time model's PCIe
term. The measured side is tests/accuracy/test_offload_accuracy.py."""

from __future__ import annotations

import pytest

from memplan.costmodel import memory as M
from memplan.costmodel.time import activation_offload_s, estimate_time
from memplan.errors import MemplanError
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA = load_model("llama3-8b")
WORK = TrainingWorkload(seq_len=2048, micro_batch=2)
LORA = dict(finetune="lora", precision="bf16", lora_targets=("all-linear",))


def _estimate(runtime: str = "hf", **plan):
    return M.estimate_training(LLAMA, WORK, Plan(**{**LORA, **plan}), runtime)


@pytest.mark.parametrize("runtime", ["hf", "hf-loop"])
@pytest.mark.parametrize("finetune", [LORA, dict(precision="bf16-mixed")])
def test_offload_moves_the_layers_to_pinned_host_memory(runtime, finetune):
    plan = dict(finetune)
    before = M.estimate_training(LLAMA, WORK, Plan(**plan), runtime)
    after = M.estimate_training(LLAMA, WORK, Plan(**plan, offload_activations="cpu"), runtime)
    assert after.peak.allocated <= before.peak.allocated
    assert max(after.phases["forward"], after.phases["backward"]) < before.phases["backward"]
    # what left the device is on the host: at least the layers' saved activations, at most all of them
    # plus the head's and the weights save_on_cpu copies
    assert after.offload.cpu > before.offload.cpu
    assert after.offload.cpu >= before.activations.total // 2
    assert after.model_states == before.model_states


def test_trl_keeps_what_two_ops_save_and_save_on_cpu_keeps_nothing_of_the_layers():
    """TRL's hooks leave each norm's fp32 input (saved by pow and by the mul) on the device; the
    hand loop's save_on_cpu leaves only its DynamicCache's keys and values."""
    x = M._shape(LLAMA, WORK, Plan(**LORA), M.POLICIES["bf16"], M.RUNTIMES["hf"])
    kept = M.trl_kept_layer(LLAMA, x, Plan(**LORA), grad_in=True)
    assert kept >= 2 * 4 * LLAMA.hidden_size * x.tokens
    assert kept < M.lora_activations(LLAMA, x, Plan(**LORA), M.RUNTIMES["hf"], _layout(), "cuda").per_layer


def _layout():
    from memplan.costmodel.layout import stage_layout

    return stage_layout(LLAMA, 1, 1, 1, 1, 0)


def test_checkpointed_layers_stay_on_the_device():
    """transformers' non-reentrant checkpoint holds each layer's input itself: the device peak does not
    move (measured), the host still gets copies."""
    before = _estimate(recompute="full")
    after = _estimate(recompute="full", offload_activations="cpu")
    assert after.peak.allocated == pytest.approx(before.peak.allocated, rel=0.02)
    assert after.offload.cpu > 0


def test_host_bytes_add_to_offloaded_optimizer_states():
    plan = dict(zero=1, offload_optimizer="cpu")
    states = _estimate(**plan).offload.cpu
    both = _estimate(**plan, offload_activations="cpu").offload.cpu
    assert both > states > 0


def test_megatron_is_refused_by_field():
    with pytest.raises(MemplanError) as err:
        M.estimate_training(LLAMA, WORK, Plan(precision="bf16", offload_activations="cpu"), "megatron")
    assert err.value.field == "plan.offload_activations"
    assert "not runtime megatron" in str(err.value)


@pytest.mark.parametrize(
    ("fields", "part"),
    [(dict(recompute="selective"), "recompute selective"), (dict(tp=2), "tensor parallel"), (LORA, "finetune lora")],
)
def test_the_bundled_trainer_is_refused_by_field_where_it_does_not_offload(fields, part):
    plan = Plan(**{"precision": "bf16", "recompute": "none", **fields}, offload_activations="cpu")
    with pytest.raises(MemplanError) as err:
        M.estimate_training(LLAMA, WORK, plan, "memplan")
    assert err.value.field == "plan.offload_activations"
    assert part in str(err.value)


def test_the_bundled_trainer_offloads_everything_saved():
    """save_on_cpu around the forward and loss: the device keeps no layer's activations, the host every
    save (weights included), and the forward's peak is the loss's (measured: tests/validate)."""
    plan = dict(precision="bf16", recompute="none")
    before = M.estimate_training(LLAMA, WORK, Plan(**plan), "memplan")
    after = M.estimate_training(LLAMA, WORK, Plan(**plan, offload_activations="cpu"), "memplan")
    assert after.phases["forward"] < before.phases["forward"]
    assert after.offload.cpu > before.activations.total  # every save, once per save, weights included
    assert after.peak.breakdown.get("activations", 0) < before.activations.total // LLAMA.num_layers


def test_offload_mechanism_by_runtime():
    plan = Plan(offload_activations="cpu", recompute="none")
    assert M.offload_mechanism(plan, M.RUNTIMES["hf"]) == "trl"
    assert M.offload_mechanism(plan, M.RUNTIMES["hf-loop"]) == "save_on_cpu"
    assert M.offload_mechanism(plan, M.RUNTIMES["memplan"]) == "save_on_cpu"


# --- time ----------------------------------------------------------------------------------


def test_save_on_cpu_exposes_both_copies():
    assert activation_offload_s(64e9, 64e9, 10.0, "save_on_cpu") == pytest.approx(2.0)


def test_trl_hides_copies_behind_compute():
    # forward: 1 s of copies behind 1 s of forward compute; backward: behind 2 s
    assert activation_offload_s(64e9, 64e9, 3.0, "trl") == 0.0
    # 4 s one way: 3 s exposed in the forward, 2 s in the backward
    assert activation_offload_s(4 * 64e9, 64e9, 3.0, "trl") == pytest.approx(3.0 + 2.0)


@pytest.mark.parametrize("gpu", ["rtx-4090", "h100-sxm"])
def test_step_time_prices_the_offloaded_bytes_over_the_host_link(gpu):
    profile = load_gpu(gpu)
    cluster = ClusterSpec(gpus_per_node=1)
    plan = Plan(**LORA, offload_activations="cpu")
    loop = estimate_time(LLAMA, WORK, plan, profile, cluster, "hf-loop")
    _, moved = M.activation_offload_bytes(LLAMA, WORK, plan, "hf-loop")
    assert loop.breakdown["activation_offload"] == pytest.approx(2 * moved / profile.pcie_bytes_per_s)
    trainer = estimate_time(LLAMA, WORK, plan, profile, cluster, "hf")
    assert trainer.breakdown.get("activation_offload", 0.0) < loop.breakdown["activation_offload"]
    plain = estimate_time(LLAMA, WORK, Plan(**LORA), profile, cluster, "hf-loop")
    assert "activation_offload" not in plain.breakdown
    assert loop.step_time_s > plain.step_time_s


def test_half_the_host_bandwidth_doubles_save_on_cpu_time():
    profile = load_gpu("rtx-4090")
    slow = profile.model_copy(update={"pcie_bytes_per_s": profile.pcie_bytes_per_s / 2})
    plan = Plan(**LORA, offload_activations="cpu")
    cluster = ClusterSpec(gpus_per_node=1)
    fast_t = estimate_time(LLAMA, WORK, plan, profile, cluster, "hf-loop").breakdown["activation_offload"]
    slow_t = estimate_time(LLAMA, WORK, plan, slow, cluster, "hf-loop").breakdown["activation_offload"]
    assert slow_t == pytest.approx(2 * fast_t)


def test_the_bundled_trainer_pays_save_on_cpu_for_every_save():
    """Runtime memplan: save_on_cpu's term (both copies exposed) over the host bytes the model counts
    (every save, weights included)."""
    profile, cluster = load_gpu("h100-sxm"), ClusterSpec(gpus_per_node=1)
    plan = Plan(precision="bf16", recompute="none", offload_activations="cpu")
    mechanism, moved = M.activation_offload_bytes(LLAMA, WORK, plan, "memplan")
    assert mechanism == "save_on_cpu"
    assert moved == M.estimate_training(LLAMA, WORK, plan, "memplan").offload.cpu
    kept = M.estimate_training(LLAMA, WORK, Plan(precision="bf16", recompute="none"), "memplan").activations.total
    assert moved > kept  # each save once per save, and the weights
    step = estimate_time(LLAMA, WORK, plan, profile, cluster, "memplan")
    assert step.breakdown["activation_offload"] == pytest.approx(2 * moved / profile.pcie_bytes_per_s)
