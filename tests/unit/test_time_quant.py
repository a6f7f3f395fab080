"""What LoRA / QLoRA and FSDP2's CPU offload add to the step time (``time_lora``, ``time.host_adam_s``):
each term's mechanism, not its size."""

from __future__ import annotations

import pytest

from memplan.costmodel import time as T
from memplan.costmodel import time_lora as Q
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

MODEL = load_model("llama3-8b")
GPU = load_gpu("h200")
ONE = ClusterSpec(gpus_per_node=8, nodes=1)
WORK = TrainingWorkload(seq_len=4096, micro_batch=4, global_batch=4)


def lora(**fields) -> Plan:
    base = dict(finetune="lora", lora_rank=16, lora_targets=("all-linear",), precision="bf16", recompute="full")
    return Plan(**{**base, **fields})


def qlora(quant: str = "nf4", **fields) -> Plan:
    return lora(finetune="qlora", quant=quant, **fields)


def step(plan: Plan, work: TrainingWorkload = WORK, runtime: str = "memplan", eff: T.Efficiency | None = None):
    return T.estimate_time(MODEL, work, plan, GPU, ONE, runtime, eff)


def test_dequantization_scales_with_the_base_weights_and_the_passes():
    nf4 = qlora(recompute="none", double_quant=False)
    one = Q.dequant_bytes(MODEL, nf4, 1, 2, 0.0)
    assert Q.dequant_bytes(MODEL, nf4, 32, 2, 0.0) == pytest.approx(32 * one)
    weights = sum(i * o for i, o in T.layer_matmul_widths(MODEL))
    # forward and backward, each reading 0.5 B + an fp32 absmax per 64 and writing bf16
    assert one == pytest.approx(weights * (0.5 + 4 / 64 + 2) * 2)
    # full recomputation dequantizes once more: 3 passes for 2
    assert Q.dequant_bytes(MODEL, nf4, 1, 2, 1.0) == pytest.approx(one * 3 / 2)
    # double quantization rebuilds the absmaxes first
    assert Q.dequant_bytes_per_weight("nf4", True, 2) > Q.dequant_bytes_per_weight("nf4", False, 2)
    # LLM.int8 multiplies its int8 codes in the forward: the backward's dequantization only
    assert Q.dequant_passes("int8", 1.0) == 1.0
    assert Q.dequant_bytes_per_weight("int8", False, 4) == 1 + 3 * 4
    assert Q.dequant_bytes(MODEL, lora(), 32, 2, 1.0) == 0.0


def test_dequant_time_is_per_micro_batch_not_per_token():
    small, large = (TrainingWorkload(seq_len=s, micro_batch=1, global_batch=1) for s in (512, 4096))
    a, b = step(qlora(), small).breakdown, step(qlora(), large).breakdown
    assert a["dequant"] == pytest.approx(b["dequant"])
    assert a["quant_casts"] == pytest.approx(b["quant_casts"] / 8)
    assert "dequant" not in step(lora()).breakdown and "quant_casts" not in step(lora()).breakdown


def test_frozen_linears_skip_the_weight_gradient_gemm():
    layer, rate = 6.0e9, 1e15
    plan = lora(recompute="none")
    assert T.frozen_gemm_seconds(layer, 0.0, 0.0, plan, rate, rate, rate) == pytest.approx(layer * 2 / 3 / rate)
    # full recomputation runs the forward (a third of 6 N) again
    assert T.frozen_gemm_seconds(layer, 0.0, 1 / 3, plan, rate, rate, rate) == pytest.approx(layer / rate)
    # a trained LM head copy gets its weight gradient back
    head = 1.0e9
    frozen = T.frozen_gemm_seconds(0.0, head, 0.0, plan, rate, rate, rate)
    saved = T.frozen_gemm_seconds(0.0, head, 0.0, lora(modules_to_save=("lm_head",)), rate, rate, rate)
    assert saved == pytest.approx(frozen * 3 / 2)
    assert step(lora()).breakdown["compute"] < step(Plan(precision="bf16", recompute="full")).breakdown["compute"]


def test_a_quantized_base_runs_attention_and_the_head_in_fp32():
    # llama3-8b has GQA: fp32 q, k, v leave SDPA its math path; over a bf16 base, a fused kernel
    assert T.attention_backend(MODEL, WORK, qlora(), GPU) == "math"
    assert T.attention_backend(MODEL, WORK, lora(), GPU) in ("flash", "cudnn", "efficient")
    # under autocast the activations stay in the compute dtype
    assert T.attention_backend(MODEL, WORK, qlora(precision="bf16-mixed"), GPU, autocast=True) != "math"
    assert Q.quantized_stream(qlora(), False) and not Q.quantized_stream(qlora(), True)
    q, l_ = step(qlora()), step(lora())
    assert q.breakdown["compute"] > 1.5 * l_.breakdown["compute"]
    # the adapters are fp32 over either base (PEFT's autocast_adapter_dtype); over the bf16 stream their
    # input is cast up and their sum back down, so the bf16 LoRA's adapters move more bytes than QLoRA's
    assert q.breakdown["lora_adapters"] < l_.breakdown["lora_adapters"]


def test_fp32_adapters_over_a_bf16_stream_cast_their_input_and_their_sum():
    """Per adapted linear and token (``time_lora.adapter_bytes_per_token``): over the bf16 stream, forward
    10 in + 28 out, backward 20 in + 28 out; over the fp32 stream (a quantized base), 4 in + 24 out and
    20 in + 16 out; adapters in the activations' dtype (autocast, a = d = 2): 2 in + 12 out, 10 in + 8 out."""
    ins, outs = Q.adapted_widths(MODEL, ("all-linear",))
    assert Q.ADAPTER_BYTES == 4
    assert Q.adapter_bytes_per_token(MODEL, lora(recompute="none"), 1, 2, 0.0) == 30 * ins + 56 * outs
    assert Q.adapter_bytes_per_token(MODEL, qlora(recompute="none"), 1, 4, 0.0) == 24 * ins + 40 * outs
    assert Q.adapter_bytes_per_token(MODEL, lora(recompute="none"), 1, 2, 0.0, a=2) == 12 * ins + 20 * outs
    # full recomputation runs the forward's kernels again
    assert Q.adapter_bytes_per_token(MODEL, lora(), 1, 2, 1.0) == 40 * ins + 84 * outs
    # under autocast the adapters' GEMMs and what follows them run in the autocast dtype
    mixed = step(lora(precision="bf16-mixed"), runtime="memplan").breakdown["lora_adapters"]
    tokens = WORK.micro_batch * WORK.seq_len
    hbm = GPU.hbm_bytes_per_s * T.Efficiency.for_gpu(GPU).hbm
    per_token = Q.adapter_bytes_per_token(MODEL, lora(precision="bf16-mixed"), 32, 2, 1.0, a=2)
    assert mixed == pytest.approx(tokens * per_token / hbm)


def test_int8_casts_its_input_and_multiplies_in_int8():
    int8 = step(qlora("int8")).breakdown
    assert int8["dequant"] > 0 and int8["quant_casts"] > 0
    plan = qlora("int8", recompute="none")
    layer, rate = 6.0e9, 1e15
    # forward at the int8 rate, the input gradient at the activations' (fp32) rate
    got = T.frozen_gemm_seconds(layer, 0.0, 0.0, plan, rate, rate / 10, rate * 2)
    assert got == pytest.approx(layer / 3 / (rate * 2) + layer / 3 / (rate / 10))


def test_lora_dropout_adds_adapter_traffic():
    dropped = Q.adapter_bytes_per_token(MODEL, lora(lora_dropout=0.1), 1, 2, 0.0)
    assert dropped > Q.adapter_bytes_per_token(MODEL, lora(), 1, 2, 0.0)
    assert Q.adapter_bytes_per_token(MODEL, Plan(), 1, 2, 0.0) == 0.0
    fewer = Q.adapter_bytes_per_token(MODEL, lora(lora_targets=("q_proj", "v_proj")), 1, 2, 0.0)
    assert 0 < fewer < Q.adapter_bytes_per_token(MODEL, lora(), 1, 2, 0.0)


OFFLOAD = Plan(dp=8, zero=3, offload_params="cpu", offload_optimizer="cpu", precision="bf16-mixed", recompute="full")


def test_pytorch_adamw_on_the_host_runs_on_one_thread_per_rank():
    work = TrainingWorkload(seq_len=4096, micro_batch=2, global_batch=16)
    owned = T.P.total_params(MODEL) / 8
    one = step(OFFLOAD, work).breakdown["optimizer"]
    assert one == pytest.approx(owned * 80 / T.Efficiency().host_thread_bytes_per_s)
    four = step(OFFLOAD, work, eff=T.Efficiency.for_gpu(GPU).model_copy(update={"host_threads": 4}))
    assert four.breakdown["optimizer"] == pytest.approx(one / 4)
    # Megatron's offloaded optimizer: a vectorised CPU Adam
    assert T.host_adam_s(owned, T.Efficiency(), False) == pytest.approx(owned / 1e9)


def test_fsdp2_offloaded_params_do_not_cross_pcie_again_after_the_step():
    policy = T.POLICIES["bf16-mixed"]
    both = T.host_offload_s(1e9, OFFLOAD, policy, 64e9, T.Efficiency(), True)["offload"]
    states = T.host_offload_s(
        1e9, OFFLOAD.model_copy(update={"offload_params": "none"}), policy, 64e9, T.Efficiency(), True
    )
    assert both == pytest.approx(1e9 * policy.grad_bytes / 64e9)
    assert states["offload"] == pytest.approx(1e9 * (policy.grad_bytes + policy.param_bytes) / 64e9)


def test_no_offload_no_host_terms():
    b = step(Plan(dp=8, zero=3, precision="bf16-mixed", recompute="full")).breakdown
    assert "offload" not in b and "param_offload" not in b and "activation_offload" not in b


# measured on one NVIDIA H200, torch 2.11.0+cu130, bitsandbytes 0.50.2 (/work/shared/gpu-traces/README.md:
# h200_a_qlora8b, h200_a_lora8b, h200_b_off8b; the first two SHARED the GPU with other processes, and the LoRA
# run's two steps differ by 19%). The same two plans measured with the GPU alone on 2026-11-28 (LoRA 2553 ms,
# QLoRA 8156 ms: 3.19x, not 2.55x) are held in tests/unit/test_time_gpu_profiles.py.
QLORA_MS, LORA_MS, OFFLOAD_MS = 8169, 3202, 11431


def test_qlora_step_against_the_h200_run():
    predicted = step(qlora()).step_time_s * 1e3
    assert abs(predicted / QLORA_MS - 1) < 0.15  # -8.4% (before: -69.7%, LoRA's time; -11.9% before 2026-11-28)


def test_qlora_over_lora_within_a_quarter_of_the_measured_ratio():
    """2.86x predicted against the 2.55x of the shared-GPU runs (+12%; the GPU alone: 3.19x, -10.4%,
    tests/unit/test_time_gpu_profiles.py). It was 3.31x (+29.9%) before the fp32 adapters' casts
    (``time_lora.adapter_bytes_per_token``) and the math path's recomputed forward
    (``time.math_score_bytes_per_token``) were priced."""
    ratio = step(qlora()).step_time_s / step(lora()).step_time_s
    assert abs(ratio / (QLORA_MS / LORA_MS) - 1) <= 0.25


def test_offloaded_step_against_the_h200_run():
    work = TrainingWorkload(seq_len=4096, micro_batch=2, global_batch=16)
    predicted = step(OFFLOAD, work).step_time_s * 1e3
    assert abs(predicted / OFFLOAD_MS - 1) < 0.20  # -17.2% (before: -78.1%)
