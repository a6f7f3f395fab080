"""The step-time model against steps profiled with the GPU alone (issue 26).

Three on one NVIDIA H200 and two on one H100 80GB HBM3, torch 2.11.0+cu130, bitsandbytes 0.50.2,
2026-11-28: ``memplan validate`` of the bundled trainer under torch.profiler's CUDA activity
(benchmarks/gpu_step_profile.py), the measured step and each kernel's device time in
tests/data/gpu-runs/ (``prof-*`` entries of ``h200-2026-11-28.json`` and ``h100-2026-11-28.json``,
``profiles/<device>-*.json``). The issue's bounds: a single-GPU step within 10% of measured, QLoRA's step
over LoRA's within 25% of the measured ratio. The term-by-term split is
benchmarks/time_vs_profile.py's (docs/cost-model.md, "The step time against kernel profiles").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_script import load

from memplan.specs.loader import load_gpu

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "data" / "gpu-runs" / "h200-2026-11-28.json"
H100_RUNS = RUNS.with_name("h100-2026-11-28.json")
PROFILED = ("t1b_full_x", "lora8b", "qlora8b", "t1b_full_x-h100", "t1b_none-h100")


@pytest.fixture(scope="module")
def bench():
    return load("time_vs_profile")


@pytest.fixture(scope="module")
def rows(bench):
    return {**bench.compare(RUNS), **bench.compare(H100_RUNS)}


def test_the_profiled_runs_had_the_gpu_alone():
    runs = {**json.loads(RUNS.read_text())["validate"], **json.loads(H100_RUNS.read_text())["validate"]}
    assert {f"prof-{n}" for n in PROFILED} == {n for n in runs if n.startswith("prof-")}
    assert all(runs[f"prof-{n}"]["alone"] for n in PROFILED)


def test_the_runs_arguments_read_back_into_their_plans(bench, rows):
    """t1b_full_x's terms did not change since validate priced it: the same step to the float. The
    8B plans' did (the fp32 adapters' casts, the math path's recomputed forward): their fields."""
    for name in ("t1b_full_x", "t1b_full_x-h100", "t1b_none-h100"):
        assert rows[name]["predicted_step_s"] == pytest.approx(rows[name]["predicted_then_s"], rel=1e-12)
    assert (rows["t1b_full_x"]["gpu"], rows["t1b_none-h100"]["gpu"]) == ("h200", "h100-sxm")
    runs = json.loads(RUNS.read_text())["validate"]
    for name, finetune, quant in (("lora8b", "lora", "none"), ("qlora8b", "qlora", "nf4")):
        job = bench.job_of(runs[f"prof-{name}"]["args"])
        plan, work = job.plan, job.workload
        assert (plan.finetune, plan.quant, plan.lora_rank, plan.lora_targets) == (finetune, quant, 16, ("all-linear",))
        assert (plan.precision, plan.recompute, plan.dp, job.runtime) == ("bf16", "full", 1, "memplan")
        assert (work.seq_len, work.micro_batch, job.gpu.name) == (4096, 4, "h200")


STEP_MISSES = {
    "t1b_full_x-h100": "+11.1% (1181 ms predicted, 1063 ms measured under the profiler; 1050 in the trace run)"
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=STEP_MISSES[n])) if n in STEP_MISSES else n
     for n in PROFILED],
)  # fmt: skip
def test_single_gpu_step_within_10_pct_of_the_gpu_alone(rows, name):
    """H200: t1b_full_x +7.9% (1055 / 978 ms), LoRA 8B +2.4% (2615 / 2553), QLoRA 8B -8.3% (7480 / 8156).
    H100: t1b_none +3.2% (252 / 244); t1b_full_x +11.1% (1181 / 1063), its bf16 GEMMs over-priced
    (``test_each_large_term_within_a_quarter_of_its_kernels``)."""
    r = rows[name]
    assert abs(r["predicted_step_s"] / r["measured_step_s"] - 1) <= 0.10


def test_qlora_over_lora_within_a_quarter_of_the_gpu_alone_ratio(rows):
    """Measured alone 3.19x (8156 / 2553 ms); predicted 2.86x (-10.4%). The 2.55x in the earlier docs
    came from runs that shared the GPU (tests/unit/test_time_quant.py keeps them)."""
    q, lo = rows["qlora8b"], rows["lora8b"]
    measured = q["measured_step_s"] / lo["measured_step_s"]
    assert measured == pytest.approx(3.19, abs=0.01)
    assert abs((q["predicted_step_s"] / lo["predicted_step_s"]) / measured - 1) <= 0.25


@pytest.mark.parametrize("name", PROFILED)
def test_the_split_adds_up_to_the_model_and_to_the_kernels(bench, rows, name):
    """The model's terms sum to its step (nothing left out of the split) and the kernel mapping
    places every kernel's time (nothing dropped from the profile)."""
    r = rows[name]
    assert sum(r["model_s"].values()) == pytest.approx(r["predicted_step_s"], rel=1e-9)
    device = "h100" if name.endswith("-h100") else "h200"
    profile = json.loads((RUNS.parent / "profiles" / f"{device}-{name.removesuffix('-h100')}.json").read_text())
    assert sum(r["kernels_s"].values()) == pytest.approx(sum(profile["by_class_us"].values()) / 1e6, rel=1e-9)


def test_kernels_are_put_in_their_terms(bench):
    assert bench.kernel_term("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "gemm") == "gemm (tensor cores)"
    fp32 = "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma"
    assert bench.kernel_term(fp32, "gemm") == "gemm (fp32, CUDA cores)"
    assert bench.kernel_term("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x128_8x4_nt_align1>", "gemm") == (
        "gemm (fp32, CUDA cores)"
    )
    assert bench.kernel_term("void cudnn::fusion::convert_dq_to_16bits<true>(void const*)", "other") == (
        "attention (fused)"
    )
    adam = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::TensorListMetadata<3>>"
    assert bench.kernel_term(adam, "elementwise") == "optimizer"
    assert bench.kernel_term("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>", "bitsandbytes") == (
        "memory-bound"
    )


TERM_MISSES = {  # (tensor-core GEMMs, memory-bound kernels): model / kernels - 1, as reached
    "t1b_full_x-h100": "+66% GEMMs (608 / 365 ms); memory-bound -14% (381 / 440 ms)",
    "t1b_none-h100": "+58% GEMMs (120 / 76 ms); memory-bound -17% (80 / 96 ms)",
    "t1b_full_x": "+65% GEMMs (608 / 368 ms), -26% memory-bound (266 / 361 ms)",
    "lora8b": "+59% GEMMs (1428 / 896 ms); memory-bound -6% (1052 / 1118 ms)",
    "qlora8b": "+62% GEMMs (1360 / 839 ms); memory-bound -21% (2629 / 3321 ms)",
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=TERM_MISSES[n])) for n in PROFILED],
)
def test_each_large_term_within_a_quarter_of_its_kernels(rows, name):
    """The step within 10% is not enough: each term should price its own kernels. Not reached: the
    profiles' ``matmul`` 0.51 (fitted on llm-foundry's whole multi-GPU FSDP steps) puts the bf16
    GEMMs at 505 TFLOP/s where cuBLAS ran them at 800-840 TFLOP/s on one H200 or H100 (81-85% of the
    dense peak), and the element-wise, cast and softmax kernels run below the 80% of HBM bandwidth the
    model gives them; the two errors offset (docs/cost-model.md)."""
    r = rows[name]
    for term in ("gemm (tensor cores)", "memory-bound"):
        model, kernels = r["model_s"][term], r["kernels_s"][term]
        assert abs(model / kernels - 1) <= 0.25, f"{term}: {model * 1e3:.0f} / {kernels * 1e3:.0f} ms"


@pytest.mark.parametrize("name", PROFILED)
def test_bf16_gemms_at_a_cublas_kernel_rate_price_their_kernels(bench, rows, name):
    """At the MAMF table's 80.3% of the dense peak (one large GEMM, a kernel benchmark, not a step:
    ``time_vs_profile.CUBLAS_KERNEL_FRACTION``), the model's bf16 GEMM term is within 10% of the
    cuBLAS kernels of every profile: +5.0% (t1b_full_x, H200), +5.7% (H100), +0.2% (t1b_none),
    +1.2% (LoRA 8B), +3.0% (QLoRA 8B). The FLOP count and the shapes are right; the profiles' fitted
    ``matmul`` 0.51 is not a GEMM rate."""
    r = rows[name]
    model = r["kernel_rate"]["model_s"]["gemm (tensor cores)"]
    kernels = r["kernels_s"]["gemm (tensor cores)"]
    assert abs(model / kernels - 1) <= 0.10, f"{model * 1e3:.0f} / {kernels * 1e3:.0f} ms"


def test_index_bound_kernels_do_not_follow_hbm_bandwidth(bench, rows):
    """The same step (t1b_full_x) on the H100 and the H200: the same SMs and clocks, 1.43x the HBM
    bandwidth (the GPU profiles' datasheet figures). The vectorised memory-bound kernels take 1.39x
    as long on the H100 (252.0 / 181.6 ms): bandwidth-bound. The non-vectorised TensorIterator
    kernels (``time_vs_profile.memory_kind``: broadcast, strided and casting operands) take 1.05x
    (188.0 / 179.2 ms): bound by per-element work on the SMs, not by HBM. A bandwidth, however
    chosen, cannot price both halves: about half the memory-bound time of this step is the second."""
    h100, h200 = rows["t1b_full_x-h100"], rows["t1b_full_x"]
    hbm = load_gpu("h200").hbm_bytes_per_s / load_gpu("h100-sxm").hbm_bytes_per_s
    bandwidth = h100["memory_kinds_s"]["bandwidth-bound"] / h200["memory_kinds_s"]["bandwidth-bound"]
    index = h100["memory_kinds_s"]["index-bound"] / h200["memory_kinds_s"]["index-bound"]
    assert bandwidth == pytest.approx(hbm, rel=0.10)
    assert index == pytest.approx(1.0, abs=0.10)
    assert h200["memory_kinds_s"]["index-bound"] >= 0.4 * sum(h200["memory_kinds_s"].values())


KERNEL_RATE_MISSES = {  # the step with the GEMMs at the kernel rate and every other term as it is
    "t1b_full_x": "-14.8% (833 / 978 ms): memory-bound -95 ms, cuDNN attention -42 ms",
    "lora8b": "-18.0% (2094 / 2553 ms): the fp32 adapter GEMMs (350 ms) priced as bytes, memory-bound -66 ms",
    "qlora8b": "-14.4% (6984 / 8156 ms): memory-bound -692 ms, fp32 GEMMs -458 ms",
    "t1b_none-h100": "-14.8% (208 / 244 ms): memory-bound -16 ms, attention -7 ms, 14 ms outside kernels",
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KERNEL_RATE_MISSES[n]))
     if n in KERNEL_RATE_MISSES else n for n in PROFILED],
)  # fmt: skip
def test_single_gpu_step_within_10_pct_with_gemms_at_the_kernel_rate(rows, name):
    """The structure issue 26 asks for: each term at a rate not fitted to steps. With the GEMMs at the
    kernel rate and the other terms as they are, only t1b_full_x on the H100 is within 10% (-9.8%,
    960 / 1063 ms); the rest fall 14-18% short, by the under-priced memory-bound (index-bound
    kernels above), attention and fp32 terms. Not the model's default: the published multi-GPU
    comparison moves by +37-42% on torchtitan's H100 rows (docs/cost-model.md)."""
    r = rows[name]
    assert abs(r["kernel_rate"]["predicted_step_s"] / r["measured_step_s"] - 1) <= 0.10
