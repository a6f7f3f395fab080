"""Which parameters one rank holds: its pipeline stage's layers, sharded by TP and EP.

Megatron-LM layout: stage i of p holds layers [i*L/p, (i+1)*L/p) (interleaved: chunks
c*p + i of L/(p*v) layers); the first stage holds the embedding, the last the final norm and
the LM head (with tied embeddings and p > 1 the last stage keeps its own copy of the
embedding matrix, as Megatron does). Tensor parallelism shards the attention and MLP
matrices and the vocabulary by t and replicates the norms; expert parallelism shards the
routed experts by ep (expert tensor parallelism = t).
"""

from __future__ import annotations

from functools import lru_cache

from memplan.costmodel import params as P
from memplan.records import record
from memplan.specs.model import ModelSpec


@record(slots=True)
class StageLayout:
    """Parameter counts (elements) held by one rank of pipeline stage ``stage``."""

    stage: int
    is_first: bool
    is_last: bool
    layers: int
    dense_params: int
    expert_params: int
    largest_layer_params: int
    layer_params: int = 0  # the transformer layers' own params (no embedding, head, final norm)

    def __init__(
        self,
        stage: int,
        is_first: bool,
        is_last: bool,
        layers: int,
        dense_params: int,
        expert_params: int,
        largest_layer_params: int,
        layer_params: int = 0,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "stage", stage)
        _set(self, "is_first", is_first)
        _set(self, "is_last", is_last)
        _set(self, "layers", layers)
        _set(self, "dense_params", dense_params)
        _set(self, "expert_params", expert_params)
        _set(self, "largest_layer_params", largest_layer_params)
        _set(self, "layer_params", layer_params)

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params


def stage_layer_indices(num_layers: int, pp: int, virtual_stages: int, stage: int) -> list[int]:
    """Layer indices on pipeline rank ``stage``: chunks c*pp + stage of L/(pp*v) layers."""
    per_chunk = num_layers // (pp * virtual_stages)
    chunks = [c * pp + stage for c in range(virtual_stages)]
    return [chunk * per_chunk + j for chunk in chunks for j in range(per_chunk)]


def _layer_split(model: ModelSpec, index: int, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) params of layer ``index`` on one rank: matrices / tp, experts / (tp*ep)."""
    norms = P.layer_norm_params(model)  # two, or Gemma's four; replicated across TP
    sharded = P.attention_params(model)
    if model.is_moe_layer(index):
        experts, rest = P.moe_params(model)
        return norms + (sharded + rest) // tp, experts // (tp * ep)
    return norms + (sharded + P.mlp_params(model, model.ffn_size)) // tp, 0


def vocab_shard_params(model: ModelSpec, tp: int) -> int:
    """One TP rank's slice of a V x h matrix (embedding or LM head), vocabulary padded to t."""
    return -(-model.vocab_size // tp) * model.hidden_size


@lru_cache(maxsize=65536)
def stage_layout(model: ModelSpec, tp: int, ep: int, pp: int, virtual_stages: int, stage: int) -> StageLayout:
    """Per-rank parameter counts of one pipeline stage (embedding on the first, head on the last)."""
    indices = stage_layer_indices(model.num_layers, pp, virtual_stages, stage)
    splits = [_layer_split(model, i, tp, ep) for i in indices]
    dense = sum(d for d, _ in splits)
    expert = sum(e for _, e in splits)
    layers = dense + expert
    is_first, is_last = stage == 0, stage == pp - 1
    vocab_shard = vocab_shard_params(model, tp)
    if is_first:
        dense += vocab_shard + P.embedding_params(model) - model.vocab_size * model.hidden_size
    if is_last:
        dense += P.norm_params(model)
        if not model.tied_embeddings or pp > 1:
            dense += vocab_shard
    largest = max((d + e for d, e in splits), default=0)
    return StageLayout(stage, is_first, is_last, len(indices), dense, expert, largest, layers)
