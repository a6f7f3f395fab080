"""Model FLOPs of a training step: what MFU divides by the device's peak.

PaLM (Chowdhery et al. 2022, Appendix B): one token's forward and backward cost 6 N for the
matmuls with the N parameters it multiplies by, plus 12 L H Q T for attention's two
sequence-long matmuls (L layers, H query heads of width Q, T tokens of context).
"""

from __future__ import annotations

from functools import lru_cache

from memplan.costmodel import params as P
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan


def matmul_params(model: ModelSpec) -> int:
    """Parameters one token is multiplied by: the active ones (routed experts top_k of
    num_experts), less the embedding lookup (a gather), plus the LM head's V h once even when
    it shares the embedding's matrix."""
    head = model.vocab_size * model.hidden_size if model.tied_embeddings else 0
    return P.active_params(model) - P.embedding_params(model) + head


def attention_flops_per_token(model: ModelSpec, seq_len: int, causal: bool = False, layers: int | None = None) -> float:
    """12 L H Q T (PaLM App. B): QK^T and AV, 2 FLOPs per multiply-add, forward and twice
    that in backward, over ``layers`` (default all), generalised per layer to
    6 H (Q_qk + Q_v) T_i: MLA's query / key heads (qk_nope + qk_rope) are wider than its value
    heads (DeepSeek-V2, Sec. 2.1), and a sliding-window or chunked layer attends at most its
    window. ``causal``: kernels that skip the masked blocks (flash), T_i = s / 2 for full
    layers, the mean of min(position, w) over the positions, w (s - w / 2) / s, for a sliding
    window w < s, and about w / 2 for chunks of w (a query sees its chunk up to itself); otherwise every key is computed
    (eager and the math path mask scores, they do not skip them)."""
    count = model.num_layers if layers is None else layers
    width = model.q_size + model.attn_out_size  # H (Q_qk + Q_v): 2 H Q without MLA
    if not (causal and model.attention_pattern):  # every layer alike (the search's common case)
        return 6 * width * (seq_len / 2 if causal else seq_len) * count
    return _windowed_attention_flops(model, seq_len, count)


@lru_cache(maxsize=4096)
def _windowed_attention_flops(model: ModelSpec, seq_len: int, count: int) -> float:
    """:func:`attention_flops_per_token` of a causal kernel over the first ``count`` layers of
    a model whose layers attend differently, layer by layer (once per model, sequence and
    count: the search asks for the same few millions of times)."""
    width = model.q_size + model.attn_out_size
    total = 0.0
    for i in range(count):
        window = model.attention_window(i)
        if window is not None and window < seq_len and model.attention_kind(i) == "chunked":
            full, rest = divmod(seq_len, window)  # a query sees its chunk up to itself
            keys = (full * window * window / 2 + rest * rest / 2) / seq_len
        elif window is not None and window < seq_len:
            keys = window * (seq_len - window / 2) / seq_len
        else:
            keys = seq_len / 2
        total += 6 * width * keys
    return total


@lru_cache(maxsize=4096)
def training_flops_per_token(model: ModelSpec, seq_len: int, causal: bool = False) -> float:
    """Model FLOPs of one token's forward and backward: 6 N + 12 L H Q T."""
    return 6 * matmul_params(model) + attention_flops_per_token(model, seq_len, causal)


def rank_flops_per_step(model: ModelSpec, seq_len: int, tokens_per_rank: int, plan: Plan) -> float:
    """One rank's share of the step's model FLOPs: its data-parallel replica's tokens,
    split over the tp x pp x cp ranks that hold the replica."""
    return tokens_per_rank * training_flops_per_token(model, seq_len) / (plan.tp * plan.pp * plan.cp)
