"""The step-time model's kernel classes on one GPU (docs/cost-model.md, "Kernel classes on one GPU").

Measured on one NVIDIA H100 80GB HBM3 (torch 2.11, the bundled trainer, 2026-11-24): median step
times of a Llama-3.2-1B-shaped model (/work/shared/gpu-traces/llama1b.config.json, copied below).

In-sample: the kernel classes (the fp32 GEMM fraction, the 0.8 x HBM element-wise rate, the
itemised score and loss traffic) were written against these three runs, so ``H100_RUNS`` checks
the fit, not a prediction. The held-out single-GPU runs, read from the allocator traces' own
timestamps and not used to write these classes, are in tests/unit/test_time_attention_kernels.py:
``t1b_full_x`` on the H100 (+12.5%, a strict xfail) and ``h200_a_master1b`` on the H200 (-2.0%);
its ``t1b_none`` is the first run below again.
"""

from __future__ import annotations

import pytest

from memplan.costmodel.time import (
    Efficiency,
    attention_backend,
    estimate_time,
    gemm_seconds,
    math_score_bytes_per_token,
    matmul_efficiency,
    matmul_peak_flops,
)
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

H100 = load_gpu("h100-sxm")
ONE = ClusterSpec(gpus_per_node=1, nodes=1)
# Llama-3.2-1B's shape (llama1b.config.json): tied embeddings, GQA 32 / 8 heads
LLAMA1B = ModelSpec(
    name="llama1b",
    architecture="llama",
    hidden_size=2048,
    num_layers=16,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=64,
    ffn_size=8192,
    vocab_size=128256,
    tied_embeddings=True,
    max_position_embeddings=131072,
)


def _step(precision: str, attention: str, seq_len: int, micro_batch: int = 2, model: ModelSpec = LLAMA1B):
    work = TrainingWorkload(seq_len=seq_len, micro_batch=micro_batch, global_batch=micro_batch)
    return estimate_time(model, work, Plan(precision=precision, attention=attention), H100, ONE, "memplan")


# (precision, attention, seq_len, measured median step s, error the model reaches)
H100_RUNS = [
    pytest.param("bf16-mixed", "flash", 4096, 0.241, id="bf16-mixed-flash-s4096"),
    pytest.param("fp32", "flash", 2048, 0.857, id="fp32-math-s2048"),
    pytest.param(
        "bf16-mixed",
        "eager",
        2048,
        0.298,
        id="bf16-mixed-eager-s2048",
        marks=pytest.mark.xfail(
            strict=True,
            reason="reached -13.7% (0.257 s vs 0.298 s measured): the itemised score traffic "
            "(60 B per score element), the score GEMMs at HBM bandwidth and the GQA repeats do not "
            "account for the rest",
        ),
    ),
]


def test_the_model_matches_the_h100_config_file():
    assert LLAMA1B.q_size == 2048 and LLAMA1B.kv_size == 512 and LLAMA1B.kv_heads == 8


@pytest.mark.parametrize(("precision", "attention", "seq_len", "measured"), H100_RUNS)
def test_h100_single_gpu_steps_within_10_pct(precision, attention, seq_len, measured):
    predicted = _step(precision, attention, seq_len).step_time_s
    error = predicted / measured - 1
    assert abs(error) <= 0.10, f"{predicted:.4f} s vs {measured} s measured: {100 * error:+.1f}%"


def test_attention_backend_follows_sdpa_dispatch():
    work = TrainingWorkload(seq_len=2048, micro_batch=1, global_batch=1)
    mha = LLAMA1B.model_copy(update={"num_kv_heads": None})
    # torch 2.11 puts cuDNN first on sm90 (attention.cuda_priority); a fused kernel either way
    assert attention_backend(LLAMA1B, work, Plan(precision="bf16-mixed"), H100) == "cudnn"
    assert attention_backend(LLAMA1B, work, Plan(precision="bf16-mixed", attention="triton"), H100) == "flash"
    assert attention_backend(LLAMA1B, work, Plan(precision="bf16-mixed", attention="eager"), H100) == "eager"
    assert attention_backend(LLAMA1B, work, Plan(precision="fp32"), H100) == "math"  # GQA: no efficient kernel
    assert attention_backend(mha, work, Plan(precision="fp32"), H100) == "efficient"
    assert attention_backend(LLAMA1B, work, Plan(precision="fp32", attention="eager"), H100) == "eager"


def test_fp32_gemms_run_on_cuda_cores_not_tensor_cores():
    """PyTorch's default fp32 matmul precision is "highest" (no TF32): IEEE fp32 on CUDA cores,
    66.9 of the H100's 989.4 bf16 TFLOP/s; bf16-mixed (autocast) runs its matmuls in bf16."""
    assert matmul_peak_flops(H100, "fp32") == pytest.approx(66.9e12)
    assert matmul_peak_flops(H100, "bf16-mixed") == pytest.approx(989.4e12)
    eff = Efficiency.for_gpu(H100)
    fp32 = matmul_peak_flops(H100, "fp32") * matmul_efficiency(eff, "fp32")
    bf16 = matmul_peak_flops(H100, "bf16-mixed") * matmul_efficiency(eff, "bf16-mixed")
    ratio = bf16 / fp32
    assert 9 < ratio < 11  # 989.4 x 0.51 / (66.9 x 0.75)
    # the same step's GEMMs, fp32 against bf16-mixed: the GEMM time scales by that ratio
    fp32_step, bf16_step = _step("fp32", "flash", 2048), _step("bf16-mixed", "flash", 2048)
    assert fp32_step.breakdown["compute"] > 8 * bf16_step.breakdown["compute"]
    assert fp32_step.step_time_s > 3 * bf16_step.step_time_s


def test_eager_is_slower_than_flash_by_the_score_traffic():
    flash, eager = _step("bf16-mixed", "flash", 2048), _step("bf16-mixed", "eager", 2048)
    assert eager.flops_per_step == flash.flops_per_step  # same model FLOPs
    extra = eager.step_time_s - flash.step_time_s
    # a s score elements per token and layer, 60 B each (fwd + bwd), plus 12 B of GEMM operands
    scores = 2 * 2048 * LLAMA1B.num_attention_heads * 2048 * LLAMA1B.num_layers
    hbm = H100.hbm_bytes_per_s * Efficiency().hbm
    assert extra > scores * 60 / hbm
    assert extra == pytest.approx(scores * (60 + 12) / hbm, rel=0.15)


def test_math_path_traffic_grows_with_the_square_of_the_sequence():
    plan = Plan(precision="fp32")
    short = math_score_bytes_per_token(LLAMA1B, plan, 1024, 16, 4)
    assert math_score_bytes_per_token(LLAMA1B, plan, 2048, 16, 4) == pytest.approx(2 * short)  # per token: x s
    assert math_score_bytes_per_token(LLAMA1B, plan, 1024, 16, 4) == pytest.approx(42 * 32 * 1024 * 16)
    # a recomputed forward runs the forward's 30 of the 42 bytes again (not a third of them)
    redone = math_score_bytes_per_token(LLAMA1B, plan, 1024, 16, 4, 1.0)
    assert redone == pytest.approx((42 + 30) * 32 * 1024 * 16)


def test_score_gemms_are_memory_bound_in_bf16_and_compute_bound_in_fp32():
    """Per score element the math / eager path's GEMMs do 12 d_h FLOPs (fwd + bwd) and move 6 d
    bytes: d_h = 64 is below bf16's ridge point on H100, above fp32's."""
    per_element_flops, hbm = 12 * 64, H100.hbm_bytes_per_s * 0.8
    bf16 = gemm_seconds(per_element_flops, 12, 989.4e12 * 0.51, hbm)
    fp32 = gemm_seconds(per_element_flops, 24, 66.9e12 * 0.75, hbm)
    assert bf16 == pytest.approx(12 / hbm) and fp32 == pytest.approx(per_element_flops / (66.9e12 * 0.75))


@pytest.mark.parametrize(
    ("precision", "attention"), [("bf16-mixed", "flash"), ("fp32", "flash"), ("bf16-mixed", "eager")]
)
def test_step_time_grows_with_tokens_and_sequence(precision, attention):
    base = _step(precision, attention, 1024).step_time_s
    assert _step(precision, attention, 1024, micro_batch=4).step_time_s > base
    longer = _step(precision, attention, 2048).step_time_s
    assert longer > base
    if attention == "eager" or precision == "fp32":  # s x s scores: superlinear per sequence
        assert _step(precision, attention, 4096).step_time_s / longer > longer / base * 0.99


def test_a_faster_memory_or_fewer_layers_never_slows_the_step():
    work = TrainingWorkload(seq_len=2048, micro_batch=2, global_batch=2)
    plan = Plan(precision="bf16-mixed", attention="eager")
    fast = H100.model_validate({**H100.model_dump(), "hbm_bytes_per_s": 4.8e12})
    assert (
        estimate_time(LLAMA1B, work, plan, fast, ONE).step_time_s
        < estimate_time(LLAMA1B, work, plan, H100, ONE).step_time_s
    )
    half = LLAMA1B.model_copy(update={"num_layers": 8})
    assert (
        estimate_time(half, work, plan, H100, ONE).step_time_s
        < estimate_time(LLAMA1B, work, plan, H100, ONE).step_time_s
    )


def test_autocast_prices_fp32_residuals_and_the_trainers_foreach_adamw():
    """bf16-mixed under autocast moves more element-wise bytes than pure bf16 (fp32 residual
    stream, per-matmul input casts); the bundled trainer's foreach AdamW moves 80 B per param,
    Megatron's fused Adam 28."""
    work = TrainingWorkload(seq_len=2048, micro_batch=2, global_batch=2)
    mixed = estimate_time(LLAMA1B, work, Plan(precision="bf16-mixed"), H100, ONE)
    pure = estimate_time(LLAMA1B, work, Plan(precision="bf16"), H100, ONE)
    assert mixed.breakdown["memory_bound"] > pure.breakdown["memory_bound"]
    fused = estimate_time(LLAMA1B, work, Plan(precision="bf16-mixed"), H100, ONE, "megatron")
    assert mixed.breakdown["optimizer"] / fused.breakdown["optimizer"] == pytest.approx(80 / 28)
