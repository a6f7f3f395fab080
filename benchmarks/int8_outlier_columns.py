"""Count the LLM.int8 outlier columns of the bundled trainer's decoder linears, on CPU.

    python benchmarks/int8_outlier_columns.py MODEL SEQ MICRO_BATCH [LAYERS]

Builds ``memplan.train.model.Transformer`` for MODEL (cut to LAYERS layers if given), random as the
trainer makes it (``init_weights``: normal(0, 0.02), norms at one), runs one forward over random
tokens (``MICRO_BATCH`` x ``SEQ``) in fp32 without a graph and counts, for every linear's input cast
to fp16 as ``MatMul8bitLt`` casts it, the columns where some token reaches ``|x| >= 6.0``: the
``outlier_cols`` bitsandbytes' CUDA kernel splits off and whose ``subA`` its autograd node keeps
(``timeline/int8.py``). Prints one JSON object: per layer and linear the columns and the element
probability, and what ``int8_outliers.RandomInit`` predicts for the down projection. The weights are
not quantized (their int8 rounding moves these counts by far less than a column's share: a weight's
rounding error is 1e-4 of its variance). Minutes for a 1B model at 16k tokens on two cores.
"""

from __future__ import annotations

import json
import sys

import torch

from memplan.costmodel.timeline.int8_outliers import THRESHOLD, RandomInit
from memplan.specs.loader import load_model
from memplan.train.model import Transformer, rope_tables


def count(model: str, seq: int, micro_batch: int, layers: int | None = None, seed: int = 0, **changes) -> dict:
    """Per layer, per linear (``wq``, ``wo``, ``w1``, ``w2``): outlier columns and element probability.
    ``changes``: other ModelSpec fields (a smaller vocabulary for a quick count)."""
    spec = load_model(model)
    if layers is not None:
        changes["num_layers"] = layers
    spec = spec.model_copy(update=changes)
    torch.manual_seed(seed)
    net = Transformer(spec, attention_impl="flash")
    net.init_weights(seed)
    found: dict[str, dict[str, list]] = {}

    def hook(layer: str, name: str):  # noqa: ANN202 - a forward pre-hook
        def seen(module, args) -> None:  # noqa: ANN001
            x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float16)
            mask = x.abs() >= THRESHOLD
            found.setdefault(layer, {})[name] = [int(mask.any(dim=0).sum()), float(mask.float().mean())]

        return seen

    for i, block in net.layers.items():
        for name, linear in (("wq", block.attention.wq), ("wo", block.attention.wo)):
            linear.register_forward_pre_hook(hook(i, name))
        for name in ("w1", "w2"):
            getattr(block.feed_forward, name).register_forward_pre_hook(hook(i, name))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq), generator=gen)
    with torch.no_grad():
        h = net.tok_embeddings(tokens)
        cos, sin = rope_tables(seq, spec.head_size, net.rope_theta, h.dtype, h.device)
        for block in net.layers.values():
            h = block(h, cos, sin)
    predicted = RandomInit(spec.hidden_size).columns("w2", seq * micro_batch, spec.ffn_size)
    return {"tokens": seq * micro_batch, "predicted_w2": predicted, "layers": found}


if __name__ == "__main__":
    args = sys.argv[1:]
    layers = int(args[3]) if len(args) > 3 else None
    print(json.dumps(count(args[0], int(args[1]), int(args[2]), layers), indent=1))
