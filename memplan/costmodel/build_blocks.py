"""The parameters' blocks: what the bundled trainer's build holds beyond the parameters' bytes.

The trainer builds its parameters first, in module order, into an empty caching allocator, and
never frees them: ``to_empty`` of each local tensor (``trainer._Run._build_params``; a tied head's
own copy comes last and is freed), or under FSDP2 each rank's shard, dim 0 padded to a multiple of
dp (``fsdp.Fsdp._build``, ``FSDPParam``'s padded ``torch.chunk``; the 4 B process-group tensor
before them is freed at once). Their blocks are therefore a
function of their sizes and order alone (``allocator.blocks.repeated_fresh_blocks``): llama3-8b's
1,835,008 B MLP shards at dp 64 fill 20 MiB segments eleven at a time, the eleventh holding the
segment's last 2,621,440 B (+786,432 B, eight times over the 96), and its 16,416,768 B embedding
and head shards hold 16 MiB segments each (+360,448 B): +7,012,352 B, and +24,960 B of the norms'
shards' 512 B roundings, beside every moment of the step (docs/cost-model.md, "The search's fast form against the run").

Parameters only: the tensors a step creates (optimizer states, masters, activations) are cut from
the blocks the step before freed, which sizes alone do not decide.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.costmodel.allocator.blocks import repeated_fresh_blocks
from memplan.costmodel.precision import POLICIES
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan


def builds_like_the_trainer(model: ModelSpec, plan: Plan) -> bool:
    """Whether the rank's parameters are the bundled trainer's build on the device: full training of
    a dense model on one pipeline stage, without context or expert parallelism or parameter offload."""
    return (
        plan.finetune == "full"
        and plan.pp == 1
        and plan.cp == 1
        and plan.ep == 1
        and plan.offload_params == "none"
        and model.moe is None
    )


class _Dims(NamedTuple):
    """The model fields ``_layer_shapes`` reads, as a plain (hashable) tuple."""

    hidden_size: int
    ffn_size: int
    q_size: int
    kv_size: int
    vocab_size: int
    num_layers: int
    tied_embeddings: bool
    qkv_bias: bool


def _layer_shapes(model: _Dims, tp: int) -> tuple[tuple[int, int], ...]:
    """One layer's parameters' local (rows, cols) in module order, as the run's
    ``trainer_model.param_shapes`` (tests/unit/test_allocator_blocks.py holds the two builds equal):
    the norms whole, the column-parallel wq, wk, wv, w1, w3 (and Qwen2's q, k, v biases, each after
    its weight) split by rows under TP, the row-parallel wo and w2 by columns."""
    h, q, kv, f = model.hidden_size, model.q_size // tp, model.kv_size // tp, model.ffn_size // tp
    bias = model.qkv_bias
    attention = tuple(s for rows in (q, kv, kv) for s in (((rows, h), (rows, 1)) if bias else ((rows, h),)))
    return ((h, 1), *attention, (h, q), (h, 1), (f, h), (h, f), (f, h))


@lru_cache(maxsize=256)
def _excess(model: _Dims, tp: int, shard: int, pd: int) -> int:
    """``parameter_block_excess`` of a model's shape, each dim 0 padded to a multiple of ``shard``
    and divided by it."""
    hidden, layers, vocab_rows = model.hidden_size, model.num_layers, model.vocab_size // tp

    vocab = -(-vocab_rows // shard) * hidden * pd
    head = (vocab,)
    layer = tuple(-(-rows // shard) * cols * pd for rows, cols in _layer_shapes(model, tp))
    tail = (-(-hidden // shard) * pd,) + (() if model.tied_embeddings else (vocab,))
    params = sum(head) + layers * sum(layer) + sum(tail)
    return repeated_fresh_blocks(head, layer, layers, tail) - params


def parameter_block_excess(model: ModelSpec, plan: Plan) -> int:
    """What the build's blocks hold beyond the parameters' bytes (0 where the build is not the
    trainer's): the unsplit rests and the 512 B roundings.
    Once per model shape, TP degree, shard and parameter dtype (a search's plans share a few)."""
    if not builds_like_the_trainer(model, plan):
        return 0
    fsdp2 = plan.dp > 1 and plan.zero >= 2
    pd = POLICIES[plan.precision].param_bytes  # trainer.dims for its four precisions; fp8 and fp16-master 2
    dims = _Dims(
        model.hidden_size, model.ffn_size, model.q_size, model.kv_size, model.vocab_size, model.num_layers,
        model.tied_embeddings, model.qkv_bias,
    )  # fmt: skip
    return _excess(dims, plan.tp, plan.dp if fsdp2 else 1, pd)
