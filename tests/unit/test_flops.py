"""Model FLOPs per token (PaLM Appendix B) against published and hand-computed counts."""

from __future__ import annotations

import pytest

from memplan.costmodel import params as P
from memplan.costmodel.flops import (
    attention_flops_per_token,
    matmul_params,
    rank_flops_per_step,
    training_flops_per_token,
)
from memplan.specs.loader import load_model
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan


def test_llama3_8b_matches_6n_plus_attention():
    m = load_model("llama3-8b")
    # 8.03B params, of which the 128256 x 4096 input embedding is a lookup, not a matmul
    assert matmul_params(m) == P.total_params(m) - 128256 * 4096
    # 12 L H Q T with L 32, H Q 4096, T 8192
    assert attention_flops_per_token(m, 8192) == 12 * 32 * 4096 * 8192
    assert training_flops_per_token(m, 8192) == pytest.approx(6 * 7.50e9 + 12.9e9, rel=0.01)


def test_tied_head_counted_once_as_a_matmul():
    untied = ModelSpec(name="u", hidden_size=64, num_layers=2, num_attention_heads=4, ffn_size=128, vocab_size=1000)
    tied = untied.model_copy(update={"tied_embeddings": True})
    assert matmul_params(tied) == matmul_params(untied)
    assert P.total_params(tied) == P.total_params(untied) - 1000 * 64


def test_moe_counts_only_active_experts():
    m = load_model("mixtral-8x7b")
    # Mixtral: 46.7B total, 12.9B active; the 32000 x 4096 embedding is not a matmul
    assert matmul_params(m) == pytest.approx(12.9e9 - 32000 * 4096, rel=0.01)


def test_causal_halves_attention_only():
    m = load_model("llama3-8b")
    full, causal = training_flops_per_token(m, 4096), training_flops_per_token(m, 4096, causal=True)
    assert full - causal == attention_flops_per_token(m, 4096) / 2


def test_rank_share_splits_over_model_parallel_ranks():
    m = load_model("llama3-8b")
    one = rank_flops_per_step(m, 4096, 8192, Plan())
    assert rank_flops_per_step(m, 4096, 8192, Plan(tp=2, pp=2)) == pytest.approx(one / 4)
    assert rank_flops_per_step(m, 4096, 8192, Plan(dp=8)) == one  # each replica has its own tokens


def test_mla_attention_counts_query_key_and_value_widths():
    """DeepSeek-V3: QK^T over 192-wide heads, AV over 128-wide value heads: 6 L H (192 + 128) s."""
    m = load_model("deepseek-v3")
    assert attention_flops_per_token(m, 4096) == 6 * 61 * 128 * (192 + 128) * 4096


def _windowed(pattern: tuple[str, ...], **window) -> ModelSpec:
    return ModelSpec(
        name="w", hidden_size=64, num_layers=4, num_attention_heads=4, ffn_size=128, vocab_size=100,
        attention_pattern=pattern, **window,
    )  # fmt: skip


def test_sliding_and_chunked_layers_attend_their_window_under_causal_kernels():
    s, w = 4096, 1024
    full = attention_flops_per_token(_windowed(()), s, causal=True)
    sliding = attention_flops_per_token(_windowed(("sliding", "full"), sliding_window=w), s, causal=True)
    chunked = attention_flops_per_token(_windowed(("chunked", "full"), attention_chunk_size=w), s, causal=True)
    per_layer = full / 4
    assert sliding == pytest.approx(2 * per_layer + 2 * per_layer * (w * (s - w / 2) / s) / (s / 2))
    assert chunked == pytest.approx(2 * per_layer + 2 * per_layer * (w / 2) / (s / 2))
    assert chunked < sliding < full
    # kernels that compute every score (eager, the math path) skip nothing, window or not
    assert attention_flops_per_token(_windowed(("sliding",), sliding_window=w), s) == attention_flops_per_token(
        _windowed(()), s
    )
    # a window the sequence does not reach changes nothing
    assert attention_flops_per_token(_windowed(("sliding",), sliding_window=s), s, causal=True) == full
