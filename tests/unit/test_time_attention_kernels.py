"""The fused attention kernel's speed by kernel and phase, and the single-GPU runs it moves
(docs/cost-model.md, "The single-GPU over-prediction, term by term").

cuDNN's SDPA (what torch 2.11 runs on Hopper) against FlashAttention-2 (the profiles' ``attention``
fraction): Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608), Figs. 5 and 6, H100 SXM5, BF16.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.costmodel.flops import attention_flops_per_token
from memplan.costmodel.time import (
    Efficiency,
    attention_backend,
    attention_speedups,
    estimate_time,
    fused_attention_seconds,
)
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

H100, H200 = load_gpu("h100-sxm"), load_gpu("h200")
ONE = ClusterSpec(gpus_per_node=1, nodes=1)
LLAMA1B = load_model(Path(__file__).resolve().parents[1] / "data" / "gpu-traces" / "llama1b.config.json")


def _work(seq_len: int, micro_batch: int) -> TrainingWorkload:
    return TrainingWorkload(seq_len=seq_len, micro_batch=micro_batch, global_batch=micro_batch)


def test_the_hopper_profiles_carry_cudnns_published_speedups():
    """Forward (causal) and backward (the only backward panels: without causal mask), summed
    over sequence lengths 2k-16k: head dim 64 1464/1140 and 1677/1121, head dim 128 2070/1285 and
    1998/1241."""
    for gpu in (H100, H200):
        assert Efficiency.for_gpu(gpu).cudnn_attention == ((64, 1.284, 1.496), (128, 1.611, 1.610))
    assert 1464 / 1140 == pytest.approx(1.284, abs=5e-4) and 1677 / 1121 == pytest.approx(1.496, abs=5e-4)
    assert 2070 / 1285 == pytest.approx(1.611, abs=5e-4) and 1998 / 1241 == pytest.approx(1.610, abs=5e-4)
    assert Efficiency.for_gpu(load_gpu("a100-80gb")).cudnn_attention == ()  # torch runs flash there


def test_speedups_by_kernel_and_head_dim():
    eff = Efficiency.for_gpu(H100)
    assert attention_speedups(eff, "cudnn", 64) == (1.284, 1.496)
    assert attention_speedups(eff, "cudnn", 128) == (1.611, 1.610)
    assert attention_speedups(eff, "cudnn", 96) == pytest.approx(((1.284 + 1.611) / 2, (1.496 + 1.610) / 2))
    assert attention_speedups(eff, "cudnn", 32) == (1.284, 1.496)  # held at the end rows
    for kernel in ("flash", "efficient"):
        assert attention_speedups(eff, kernel, 64) == (1.0, 1.0)
    assert attention_speedups(Efficiency(), "cudnn", 64) == (1.0, 1.0)  # no figures: priced as flash


def test_fused_attention_seconds_split_forward_and_backward():
    assert fused_attention_seconds(3.0, (1.0, 1.0), 0.0) == pytest.approx(3.0)
    assert fused_attention_seconds(3.0, (2.0, 4.0), 0.0) == pytest.approx(1 / 2 + 2 / 4)
    # full recomputation runs the forward again, at the forward's speed
    assert fused_attention_seconds(3.0, (2.0, 4.0), 1 / 3) == pytest.approx(2 / 2 + 2 / 4)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cudnn_attention_is_faster_than_flash_by_the_sourced_ratio(recompute):
    work, plan = _work(8192, 1), Plan(precision="bf16-mixed", recompute=recompute)
    assert attention_backend(LLAMA1B, work, plan, H100) == "cudnn"
    cudnn = estimate_time(LLAMA1B, work, plan, H100, ONE)
    flash = estimate_time(LLAMA1B, work, plan, H100, ONE, attention_kernel="flash")
    flops = 8192 * attention_flops_per_token(LLAMA1B, 8192, True, LLAMA1B.num_layers)
    flash_s = flops / (H100.peak_flops["bf16"] * 0.33)  # forward and backward
    redo = 1 if recompute == "full" else 0
    cudnn_s = flash_s / 3 * (1 + redo) / 1.284 + 2 * flash_s / 3 / 1.496
    assert flash.breakdown["compute"] - cudnn.breakdown["compute"] == pytest.approx(
        flash_s * (1 + redo / 3) - cudnn_s, rel=1e-9
    )
    assert flash.breakdown["memory_bound"] == cudnn.breakdown["memory_bound"]


def test_a_plan_whose_sdpa_falls_to_math_is_unaffected():
    """fp32 with GQA: no fused kernel takes it (the math path, priced as GEMMs and score traffic)."""
    work, plan = _work(2048, 2), Plan(precision="fp32")
    assert attention_backend(LLAMA1B, work, plan, H100) == "math"
    with_rows = estimate_time(LLAMA1B, work, plan, H100, ONE)
    without = estimate_time(LLAMA1B, work, plan, H100, ONE, eff=Efficiency.for_gpu(H100).model_copy(
        update={"cudnn_attention": ()}
    ))  # fmt: skip
    assert with_rows.step_time_s == without.step_time_s
    eager = Plan(precision="bf16-mixed", attention="eager")  # a kernel override leaves eager alone
    assert (
        estimate_time(LLAMA1B, work, eager, H100, ONE, attention_kernel="cudnn").step_time_s
        == estimate_time(LLAMA1B, work, eager, H100, ONE).step_time_s
    )


# The bundled trainer's single-GPU runs that had the GPU alone (/work/shared/gpu-traces/README.md;
# docs/cost-model.md's table): measured step (ms), and the bound the model reaches
SINGLE_GPU_RUNS = [
    pytest.param(H100, Plan(precision="bf16-mixed"), 4096, 2, 241, 0.05, id="t1b_none"),
    pytest.param(H100, Plan(precision="bf16-mixed", recompute="full"), 8192, 4, 1050, 0.13, id="t1b_full_x"),
    pytest.param(H200, Plan(precision="bf16-master"), 4096, 1, 121, 0.03, id="h200_a_master1b"),
]


@pytest.mark.parametrize(("gpu", "plan", "seq_len", "micro_batch", "measured_ms", "bound"), SINGLE_GPU_RUNS)
def test_single_gpu_runs_against_their_measured_steps(gpu, plan, seq_len, micro_batch, measured_ms, bound):
    predicted = estimate_time(LLAMA1B, _work(seq_len, micro_batch), plan, gpu, ONE).step_time_s * 1e3
    assert abs(predicted / measured_ms - 1) <= bound, f"{predicted:.1f} ms against {measured_ms} ms"


@pytest.mark.xfail(
    strict=True,
    reason="+12.5% (1181 against 1050 ms). Its H100 kernel profile (the GPU alone, 1063 ms under the profiler, "
    "+11.1%; tests/unit/test_time_gpu_profiles.py) shows which term: the bf16 GEMMs over by 243 ms (608 against "
    "365 ms of cuBLAS kernels: the profile's 0.51, fitted on multi-GPU FSDP steps, where cuBLAS ran at 84% of "
    "peak), the memory-bound kernels under by 59 ms and cuDNN's attention under by 37 ms (docs/cost-model.md)",
)
def test_t1b_full_x_within_10_pct():
    plan = Plan(precision="bf16-mixed", recompute="full")
    predicted = estimate_time(LLAMA1B, _work(8192, 4), plan, H100, ONE).step_time_s * 1e3
    assert abs(predicted / 1050 - 1) <= 0.10
