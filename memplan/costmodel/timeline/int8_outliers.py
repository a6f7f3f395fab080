"""How many input columns of an LLM.int8 linear hold an outlier, over a randomly initialised base.

CUDA's ``MatMul8bitLt`` (bitsandbytes 0.50.2, threshold 6.0) splits off every input column with some
``|x| >= 6.0`` (``backends/cuda/ops.py`` ``int8_vectorwise_quant``: ``outliers = A.abs() >= threshold``,
``outlier_cols = torch.argwhere(outliers.any(dim=0))``) and keeps ``subA = A[:, outlier_cols]``
(``backends/default/ops.py`` ``int8_mixed_scaled_mm``) in ``ctx.tensors`` until the graph goes
(``autograd/_functions.py``: ``ctx.tensors = (CAt, subA, A)``): tokens x k bytes in the input's dtype per
call, the memory that ``int8.py`` books for k columns. k comes from the activations' values.

Over random weights (the bundled trainer's ``init_weights``: normal(0, 0.02), norms at one,
``memplan/train/model.py``; transformers' ``_init_weights`` with ``initializer_range`` 0.02 for a
model built ``from_config``) it follows from the initialisation. A decoder linear's input is either an
RMS-normed stream (q, k, v, gate, up: unit mean square per token; P(|x| >= 6) of a unit normal is 2e-9,
under 0.1 expected column per call at 16k tokens: none), the attention's output (an average of values:
smaller), or the down projection's ``silu(g) * u``, where g and u are one token's dot products of a
unit-RMS input with two independent weight rows: normal with variance ``std**2 * hidden`` (0.82 for
hidden 2048). The chance that one element reaches the threshold, ``P(|silu(g) u| >= 6)``, is a
one-dimensional integral over g (``erfc`` of the threshold over ``|silu(g)| sigma sqrt(2)``); a column
of T tokens holds one with ``1 - (1 - p) ** T``, treating tokens as independent.

Counted on the real layers on CPU (benchmarks/int8_outlier_columns.py, 2026-11-28: the bundled
trainer's Llama 1B, normal(0, 0.02), random tokens, the down projections' inputs cast to fp16 as the
kernel casts them): the element rate is the predicted one (4.7e-5 to 5.0e-5 against 4.9e-5), the
columns fewer: at 4 x 4,096 tokens 3,844 to 4,052 (the first layer 3,076) against 4,543, at 2 x 2,048
1,283 to 1,390 (919) against 1,500. Tokens are not independent: the normed stream carries a
component common to the tokens (at the third layer, 4,096 tokens, the token mean holds 10% of its
energy), which offsets each column's g and u and gathers the outliers in fewer columns. That share
comes from the random network's dynamics (the causal attention's averages), not from the shapes: not
modelled, so :class:`RandomInit` is an upper estimate of k (about 12% over at these sizes; on the 1B
H200 step +1.06% allocated, tests/unit/test_timeline_int8_cuda.py). A trained checkpoint's outliers
are a few feature dimensions (Dettmers et al. 2022, arXiv 2208.07339, Sec. 4): :class:`RandomInit`
describes random weights only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

THRESHOLD = 6.0  # BitsAndBytesConfig(llm_int8_threshold=6.0), train.quant.INT8_THRESHOLD
INIT_STD = 0.02  # memplan/train/model.py _normal_; transformers' LlamaConfig(initializer_range=0.02)
DOWN_PROJECTIONS = ("w2", "down_proj")  # the bundled trainer's and transformers' names of W_down
_STEPS = 200  # Simpson's rule over z in [-8, 8]: 1e-9 relative at sigma 0.9 (400 and 800 steps agree)


@lru_cache(maxsize=64)
def silu_product_tail(sigma: float, threshold: float = THRESHOLD) -> float:
    """``P(|silu(g) * u| >= threshold)`` for independent g, u ~ N(0, sigma**2): the integral over
    ``g = z sigma`` of ``phi(z) * erfc(threshold / (|silu(g)| sigma sqrt(2)))``, Simpson's rule."""
    zmax, n = 8.0, _STEPS
    h = 2 * zmax / n
    total = 0.0
    for i in range(n + 1):
        g = (-zmax + i * h) * sigma
        s = abs(g / (1.0 + math.exp(-g)))
        if s == 0.0:
            continue
        weight = 1 if i in (0, n) else (4 if i % 2 else 2)
        z = g / sigma
        total += weight * math.exp(-z * z / 2) * math.erfc(threshold / (s * sigma * math.sqrt(2.0)))
    return total * h / 3 / math.sqrt(2 * math.pi)


def expected_columns(columns: int, tokens: int, p: float) -> int:
    """Of ``columns`` inputs over ``tokens`` independent tokens, how many see at least one element
    of probability ``p``: ``columns * (1 - (1 - p) ** tokens)``, to the nearest column."""
    return round(columns * -math.expm1(tokens * math.log1p(-p)))


def is_down_projection(name: str) -> bool:
    """Whether the linear (or its weight) ``name`` is a decoder layer's down projection."""
    return name.removesuffix(".weight").rsplit(".", 1)[-1] in DOWN_PROJECTIONS


@dataclass(frozen=True)
class RandomInit:
    """The outlier columns of each int8 linear call over a base of random normal(0, ``std``)
    weights and unit norms, ``hidden`` wide: the down projection's, none elsewhere."""

    hidden: int
    std: float = INIT_STD

    def columns(self, name: str, tokens: int, cols: int) -> int:
        """k for one call of linear ``name`` (its weight's name) over ``tokens`` tokens, ``cols`` inputs."""
        if not is_down_projection(name):
            return 0
        sigma = self.std * math.sqrt(self.hidden)  # g = w . x, |x|**2 = hidden after the RMSNorm
        return expected_columns(cols, tokens, silu_product_tail(round(sigma, 12)))
