"""Under LoRA / QLoRA the optimizer step and the gradient reduction cover the trained
parameters only (the adapters and saved modules), not the frozen base."""

from __future__ import annotations

import pytest

from memplan.costmodel import lora as L
from memplan.costmodel.time import estimate_time, trained_params
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

MODEL = load_model("llama3-8b")
GPU = load_gpu("h100-sxm")
WORK = TrainingWorkload(seq_len=2048, micro_batch=1, global_batch=8)


def lora(**fields) -> Plan:
    return Plan(finetune="lora", lora_rank=16, lora_targets=("all-linear",), **fields)


def test_trained_params_are_the_adapters_and_saved_modules():
    plan = Plan(finetune="lora", lora_rank=16, lora_targets=("q_proj", "v_proj"), modules_to_save=("lm_head",))
    h, kv = MODEL.hidden_size, 8 * 128  # 8 KV heads of 128
    per_layer = 16 * (h + h) + 16 * (h + kv)  # q_proj h -> h, v_proj h -> kv
    assert trained_params(MODEL, plan) == MODEL.num_layers * per_layer + MODEL.vocab_size * h
    assert L.trainable_params(MODEL, ("q_proj", "v_proj"), 16, ()) == MODEL.num_layers * per_layer
    assert trained_params(MODEL, Plan()) == trained_params(MODEL, Plan(finetune="full"))
    assert trained_params(MODEL, Plan()) > 8_000_000_000


@pytest.mark.parametrize("dp", [1, 8])
def test_the_optimizer_step_scales_with_the_trained_parameters(dp):
    cluster = ClusterSpec(gpus_per_node=8, nodes=1)
    full = estimate_time(MODEL, WORK, Plan(dp=dp), GPU, cluster, "hf")
    adapters = estimate_time(MODEL, WORK, lora(dp=dp), GPU, cluster, "hf")
    ratio = trained_params(MODEL, lora()) / trained_params(MODEL, Plan())
    assert 0.001 < ratio < 0.01
    # the same per-parameter cost, under the same precision policy: the ratio of parameters
    assert adapters.breakdown["optimizer"] == pytest.approx(full.breakdown["optimizer"] * ratio, rel=1e-9)
    if dp > 1:  # the gradient all-reduce moves the adapters' gradients only
        assert adapters.breakdown.get("dp_comm", 0.0) < full.breakdown["dp_comm"] * 0.05
