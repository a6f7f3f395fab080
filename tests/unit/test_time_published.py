"""The step-time model's fitted efficiencies and the published runs (benchmarks/time_vs_published.py).

The A100 and H100 profiles' ``efficiency.matmul`` is fitted on llm-foundry's published MPT
runs; these tests recompute the fit, so a change to the time model that moves it shows up
here rather than silently in docs/accuracy.md.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from benchmark_script import load

from memplan.costmodel.time import Efficiency, eager_score_bytes_per_token, elementwise_bytes_per_token, estimate_time
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload


@pytest.fixture(scope="module")
def published():
    return load("time_vs_published")


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-sxm"])
def test_the_profiles_matmul_efficiency_is_the_fit(published, gpu):
    assert load_gpu(gpu).efficiency.matmul == pytest.approx(published.fit_matmul(gpu), abs=0.005)


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-sxm"])
def test_fit_sets_are_large_models_and_predicted_within_15_pct_at_the_median(published, gpu):
    """In-sample: the fit set's median error is zero by construction of the fit; this checks which
    rows the fit takes and their spread, not a prediction. The held-out rows are below: the same
    tables' rows the fit leaves out, and the other publishers' runs (Megatron-LM, torchtitan)."""
    rows = published.fit_rows(gpu)
    assert len(rows) >= 15
    assert all(r.model.hidden_size >= 4096 and r.attention_share <= 0.2 for r in rows)
    errors = [abs(published.predict(r)["error_pct"]) for r in rows]
    assert statistics.median(errors) <= 15


def test_llm_foundry_rows_left_out_of_the_fit_are_reported_apart(published):
    """Held out of the fit, the same tables' models under 7B (attention at most a fifth of the
    FLOPs): 38 rows, median |error| 12.4%, 24 within 15%, worst 37.5% (2026-11-27, docs/accuracy.md).
    Small GEMMs run below the fitted efficiency and the model has no size term: the bounds are the
    figures reached, so a change that moves them shows here."""
    rows = [
        r
        for r in published.llm_foundry_rows()
        if r.model.hidden_size < published.FIT_MIN_HIDDEN and r.attention_share <= published.FIT_MAX_ATTENTION_SHARE
    ]
    assert len(rows) == 38 and not any(published.in_fit_set(r) for r in rows)
    errors = [abs(published.predict(r)["error_pct"]) for r in rows]
    assert statistics.median(errors) <= 12.5 and max(errors) <= 38 and sum(e <= 15 for e in errors) >= 24


def test_every_published_table_row_is_read(published):
    rows = published.llm_foundry_rows()
    assert sum(r.gpu == "h100-sxm" for r in rows) == 52
    assert sum(r.gpu == "a100-80gb" for r in rows) == 61


def test_estimate_time_uses_the_gpu_profiles_efficiencies():
    model, plan = load_model("llama3-8b"), Plan(dp=8, zero=3)
    work = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=8)
    gpu = load_gpu("h100-sxm")
    default = estimate_time(model, work, plan, gpu, ClusterSpec())
    explicit = estimate_time(model, work, plan, gpu, ClusterSpec(), eff=Efficiency.for_gpu(gpu))
    generic = estimate_time(model, work, plan, gpu, ClusterSpec(), eff=Efficiency())
    assert default.step_time_s == explicit.step_time_s
    assert default.step_time_s > generic.step_time_s  # 0.50 of peak is below the generic 0.75
    b200 = load_gpu("b200")  # no published fit: the generic defaults
    assert Efficiency.for_gpu(b200) == Efficiency()


def test_elementwise_traffic_follows_the_architecture():
    """LayerNorm is one kernel in eager PyTorch, RMSNorm five; a plain MLP's activation reads
    and writes once, SwiGLU's silu-then-multiply more; learned positions have no RoPE."""
    llama, gpt = load_model("llama3-8b"), load_model("gpt3-175b")
    plan = Plan()
    rms = elementwise_bytes_per_token(llama, plan, 1, 2, fused=False)
    as_layernorm = elementwise_bytes_per_token(llama.model_copy(update={"norm": "layernorm"}), plan, 1, 2, False)
    assert as_layernorm < rms
    no_rope = elementwise_bytes_per_token(llama.model_copy(update={"position_embedding": "learned"}), plan, 1, 2, False)
    assert no_rope < rms
    h, f = gpt.hidden_size, gpt.ffn_size
    # GPT: 2 LayerNorms (2 d), 2 adds (3 d), GELU (2 d on f); no RoPE; x 3 for the backward
    assert elementwise_bytes_per_token(gpt, plan, 1, 2, fused=False) == pytest.approx(3 * ((2 * 4 + 2 * 6) * h + 4 * f))


def test_eager_attention_computes_every_score_and_pays_for_the_softmax_in_hbm():
    """Eager attention runs the full s x s matmuls (no causal skipping) and its softmax over
    materialised scores: 3 x (fused 2 d, unfused 6 d + 8, dropout + 2 d + 1) bytes per
    score element, a s / t elements per token and layer."""
    gpt = load_model("gpt3-175b")
    a, s = gpt.num_attention_heads, 2048
    eager = Plan(tp=8, attention="eager")
    assert eager_score_bytes_per_token(gpt, Plan(tp=8), s, 1, 2, True, True) == 0  # flash: nothing
    assert eager_score_bytes_per_token(gpt, eager, s, 1, 2, True, False) == pytest.approx(3 * 4 * a * s / 8)
    assert eager_score_bytes_per_token(gpt, eager, s, 1, 2, True, True) == pytest.approx(3 * 9 * a * s / 8)
    assert eager_score_bytes_per_token(gpt, eager, s, 2, 2, False, False) == pytest.approx(2 * 3 * 20 * a * s / 8)
    work = TrainingWorkload(seq_len=s, micro_batch=1, global_batch=64)
    gpu, cluster = load_gpu("a100-80gb"), ClusterSpec(nodes=8)
    flash = estimate_time(gpt, work, Plan(tp=8, pp=8), gpu, cluster, "megatron")
    slow = estimate_time(gpt, work, Plan(tp=8, pp=8, attention="eager"), gpu, cluster, "megatron")
    assert slow.step_time_s > flash.step_time_s
    assert slow.mfu < flash.mfu and slow.flops_per_step == flash.flops_per_step  # same model FLOPs


def test_megatron_throughput_converts_by_their_equation_3(published):
    """1T on 3072 GPUs at 163 teraFLOP/s: 96 l h^2 (1 + s/6h + V/16lh) FLOPs per token."""
    per_token = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert published.megatron_tokens_per_s(163, 25600, 128) == pytest.approx(163e12 / per_token)
    assert published.megatron_tokens_per_s(163, 25600, 128) == pytest.approx(19.96, abs=0.01)


def test_megatron_published_runs_are_predicted_within_15_pct(published):
    """Narayanan et al. 2021, Tables 1 and 2 (PTD-P): 16 runs from 1.7B on 32 A100s to 1T on
    3072, predicted with the A100 profile as it is (its matmul efficiency is fitted on other
    software, llm-foundry)."""
    rows = published.MEGATRON_ROWS
    assert len(rows) == 16
    errors = {r.name: published.predict(r)["error_pct"] for r in rows}
    assert all(abs(e) <= 15 for e in errors.values()), errors


def test_torchtitan_runs_are_predicted_on_their_own_hardware_within_15_pct(published):
    """torchtitan's four FSDP runs (Llama 3 8B and 70B on 64 A100; Llama 3.1 8B on 8 and 128
    H100). The H100 rows ran on HBM2e parts at 2.4 TB/s, as their source states: predicting them
    with the SXM profile's 3.35 TB/s under-costs every memory-bound kernel (+16.5% and +20.2%)."""
    rows = [r for r in published.TEST_ROWS if r.source.startswith("torchtitan")]
    assert len(rows) == 4
    h100 = [r for r in rows if r.gpu == "h100-sxm"]
    assert len(h100) == 2 and all(r.gpu_spec.hbm_bytes_per_s == 2.4e12 for r in h100)
    assert load_gpu("h100-sxm").hbm_bytes_per_s == 3.35e12  # the bundled profile is untouched
    errors = {r.name: published.predict(r)["error_pct"] for r in rows}
    assert all(abs(e) <= 15 for e in errors.values()), errors
    as_sxm = [published.predict(replace(r, hardware={}))["error_pct"] for r in h100]
    assert all(e > 15 for e in as_sxm), as_sxm


def test_published_runs_are_priced_with_the_attention_kernel_they_ran(published):
    """llm-foundry's 2023 MPT runs used flash-attn; torchtitan's H100 runs used torch of 2024-12-23
    (the 2.7 line), whose SDPA puts flash before cuDNN on H100. torch 2.11 would pick cuDNN there,
    priced faster on Hopper (docs/cost-model.md): without the kernel named, those rows would move."""
    assert published.TORCHTITAN_H100_KERNEL == "flash"
    assert {r.attention_kernel for r in published.llm_foundry_rows()} == {"flash"}
    h100 = [r for r in published.TEST_ROWS if r.source == published.TORCHTITAN_H100]
    assert len(h100) == 2 and all(r.attention_kernel == "flash" for r in h100)
    as_cudnn = [published.predict(replace(r, attention_kernel=None))["error_pct"] for r in h100]
    assert all(c > published.predict(r)["error_pct"] for c, r in zip(as_cudnn, h100, strict=True))
