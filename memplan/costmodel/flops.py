"""Model FLOPs of a training step: what MFU divides by the device's peak.

PaLM (Chowdhery et al. 2022, Appendix B): one token's forward and backward cost 6 N for the
matmuls with the N parameters it multiplies by, plus 12 L H Q T for attention's two
sequence-long matmuls (L layers, H query heads of width Q, T tokens of context).
"""

from __future__ import annotations

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
    that in backward, over ``layers`` (default all). ``causal`` halves it, for kernels that
    skip the masked blocks."""
    flops = 12 * (model.num_layers if layers is None else layers) * model.q_size * seq_len
    return flops / 2 if causal else float(flops)


def training_flops_per_token(model: ModelSpec, seq_len: int, causal: bool = False) -> float:
    """Model FLOPs of one token's forward and backward: 6 N + 12 L H Q T."""
    return 6 * matmul_params(model) + attention_flops_per_token(model, seq_len, causal)


def rank_flops_per_step(model: ModelSpec, seq_len: int, tokens_per_rank: int, plan: Plan) -> float:
    """One rank's share of the step's model FLOPs: its data-parallel replica's tokens,
    split over the tp x pp x cp ranks that hold the replica."""
    return tokens_per_rank * training_flops_per_token(model, seq_len) / (plan.tp * plan.pp * plan.cp)
