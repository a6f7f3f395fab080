"""FP8 training: what the fp8 linear layers add to or take from a step's memory, by library and recipe.

``precision: fp8`` keeps bf16 weights with fp32 master weights (``precision.POLICIES``) and runs the
transformer layers' linear layers in fp8. Attention (SDPA), the norms, the embedding and the LM head
stay in bf16: torchtitan converts every ``nn.Linear`` but ``output`` (``Float8LinearConverter``),
Megatron-LM builds its output layer from ``tensor_parallel.ColumnParallelLinear``, not from Transformer
Engine. Who runs the fp8 linears follows the runtime:

- ``megatron``: Transformer Engine (TE, ``transformer_engine/pytorch/module/linear.py``, 2.x). Each
  linear saves its input for the backward in fp8 (the column-wise copy only, 1 byte per element) and
  keeps its weight quantized in a workspace cached across micro-batches (``_fp8_workspaces``, Megatron
  passes ``is_first_microbatch``): on Hopper the row-wise data and its transpose, 2 bytes per weight
  element (Blackwell keeps one: ``Float8Quantizer.inner_tensor_specs``). ``delayed`` scaling keeps an
  amax history of 1024 steps and a scale per quantizer (``DelayedScaling.amax_history_len``, 3 forward
  and 2 backward quantizers per GEMM, ``base.py`` ``set_meta_tensor``); ``tensorwise`` is TE's
  ``Float8CurrentScaling`` (Megatron's ``--fp8-recipe tensorwise``).
- ``memplan``, ``hf``, ``hf-loop``: torchao's ``Float8Linear`` (``convert_to_float8_training``, torchao
  0.18), run eagerly. It saves its *high-precision* input and weight (``matmul_with_hp_or_float8_args``:
  ``ctx.save_for_backward(input_hp, weight_hp_t)``; pytorch/ao#1850: "we currently depend on
  torch.compile" to save fp8 instead) and casts both again in the backward, so the saved activations
  are bf16's; what fp8 adds are the casts' temporaries (pytorch/ao#2262: dynamic float8 "will actually
  use some additional memory"). Scaling is dynamic (no history). Under FSDP2,
  ``enable_fsdp_float8_all_gather`` (tensorwise only) all-gathers the linear weights in fp8.

torch.compile (which may save fp8 copies instead, pytorch/ao#936) is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memplan.costmodel import params as P
from memplan.costmodel.activations import Shape, layer_matmul_widths
from memplan.costmodel.layout import StageLayout
from memplan.errors import MemplanError
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan

Library = Literal["transformer-engine", "torchao"]

TE_AMAX_HISTORY_LEN = 1024  # transformer_engine/common/recipe/__init__.py, DelayedScaling.amax_history_len
TE_QUANTIZERS_PER_GEMM = 5  # input, weight, output forward; grad_output, grad_input backward (base.py)
FP32 = 4
# an eager torchao cast of n elements holds, at its peak, tensor.to(float32) * scale (4n), its clamp
# (4n) and the fp8 result (1n): Float8TrainingTensor's _ToFloat8ConstrFunc and to_fp8_saturated
CAST_PEAK_PER_ELEMENT = 9


def library(runtime: str) -> Library:
    """Transformer Engine under Megatron-LM, torchao's float8 training under the PyTorch-native loops."""
    return "transformer-engine" if runtime == "megatron" else "torchao"


def recipe(fp8_recipe: str, runtime: str) -> str:
    """The scaling recipe a plan's ``fp8_recipe`` stands for in ``runtime``: ``auto`` is each library's
    default (TE's ``DelayedScaling``, Megatron's ``--fp8-recipe delayed``; torchao's ``tensorwise``).
    A recipe the library does not have is a :class:`MemplanError` on ``plan.fp8_recipe``."""
    lib = library(runtime)
    if fp8_recipe == "auto":
        return "delayed" if lib == "transformer-engine" else "tensorwise"
    offered = ("delayed", "tensorwise") if lib == "transformer-engine" else ("tensorwise", "rowwise")
    if fp8_recipe not in offered:
        raise MemplanError(
            f"fp8 recipe {fp8_recipe} is not one {lib} runs under runtime {runtime} (it runs {', '.join(offered)})",
            field="plan.fp8_recipe",
        )
    return fp8_recipe


def te_weight_workspace_bytes(linear_elements: int) -> int:
    """TE's cached fp8 weights: row-wise data and its transpose (Hopper), 1 byte each per element."""
    return 2 * linear_elements


def te_scaling_state_bytes(gemms: int, fp8_recipe: str) -> int:
    """TE's per-module scaling state, fp32: ``delayed`` an amax history of 1024 rows and a scale per
    quantizer (``DelayedScalingRecipeState``: ``amax_history`` (len, n), ``scale`` (n,)); current
    (``tensorwise``) scaling a scale and an amax per quantizer."""
    rows = TE_AMAX_HISTORY_LEN + 1 if fp8_recipe == "delayed" else 2
    return gemms * TE_QUANTIZERS_PER_GEMM * rows * FP32


def te_saved_input_delta(tokens: int, d: int, h: int, q: int, f: int, t: int, rep: int, dense: float = 1.0) -> int:
    """Bytes one layer's saved activations change by under TE fp8, against Korthikanti's bf16
    accounting (``activations.korthikanti_*``), for ``tokens`` tokens at ``d`` bytes per element.

    The two layer norms' outputs (the QKV and fc1 inputs, h wide, split by t under SP) and the fc2
    input (f/t, the SwiGLU output, which only fc2 saves) are kept in fp8 instead of d. The attention
    projection's input is the attention output, which the flash kernel keeps in d for its own
    backward: TE's fp8 copy of it (q/t) comes on top. ``dense``: the share of the stage's layers
    whose MLP is dense (MoE experts are not modelled here)."""
    attention = tokens * q // t - tokens * (d - 1) * h // rep
    mlp = tokens * (d - 1) * (h // rep + f // t)
    return attention - int(dense * mlp)


def torchao_linear_backward_extra(tokens: int, n_in: int, n_out: int, rowwise: bool) -> int:
    """The most bytes torchao's ``matmul_with_hp_or_float8_args.backward`` holds beyond the incoming
    gradient and its two outputs (grad_input, grad_weight: the caller's ``layer_temp`` and
    gradients), for a linear of ``n_in`` x ``n_out`` on ``tokens`` tokens.

    In order: grad_output cast to fp8 (dim 0), the saved weight cast again, the grad_input GEMM
    (``preprocess_addmm`` copies the row-major transposed fp8 weight to column-major), grad_output
    cast again (dim 1), the saved input cast again, the grad_weight GEMM (both operands copied to the
    layouts ``_scaled_mm`` takes). Each cast peaks at 9 bytes per element (``CAST_PEAK_PER_ELEMENT``)
    and leaves one; the fp8 operands stay until the backward returns. Under ``rowwise`` without fast
    accumulation (the backward GEMMs' default) ``addmm_float8_unwrapped`` scales the output by the
    outer product of the two fp32 scale vectors, a 4-byte tensor of the output's shape."""
    go, w, x = tokens * n_out, n_in * n_out, tokens * n_in
    post_in = FP32 * x if rowwise else 0
    post_w = FP32 * w if rowwise else 0
    moments = (
        CAST_PEAK_PER_ELEMENT * go,  # grad_output cast (dim 0)
        go + CAST_PEAK_PER_ELEMENT * w,  # weight cast
        go + 2 * w + post_in,  # grad_input GEMM: the weight's column-major copy (and the rowwise scale)
        go + w + CAST_PEAK_PER_ELEMENT * go,  # grad_output cast (dim 1)
        2 * go + w + CAST_PEAK_PER_ELEMENT * x,  # input cast
        3 * go + w + 2 * x + post_w,  # grad_weight GEMM: both operands copied
    )
    return max(moments)


def torchao_linear_forward_extra(tokens: int, n_in: int, n_out: int) -> int:
    """The most bytes torchao's forward holds beyond its input and output: the input's cast (9 bytes
    per element at its peak, then its fp8 copy, 1) and then the weight's (9 per element)."""
    x, w = tokens * n_in, n_in * n_out
    return max(CAST_PEAK_PER_ELEMENT * x, x + CAST_PEAK_PER_ELEMENT * w)


def fsdp_gathered_bytes(linear_elements: int, other_elements: int, unsharded_bytes: int, fp8_gather: bool) -> int:
    """One FSDP2 group's all-gathered parameters: the fp8 linears' weights at 1 byte each under
    torchao's ``enable_fsdp_float8_all_gather`` (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``
    casts the shard, ``fsdp_post_all_gather`` wraps the gathered fp8 data), the rest (norms) at the
    mixed-precision param dtype."""
    linear = 1 if fp8_gather else unsharded_bytes
    return linear_elements * linear + other_elements * unsharded_bytes


@dataclass(frozen=True, slots=True)
class Fp8Step:
    """What fp8 changes in one rank's step (all zero outside ``precision: fp8``): ``weights`` the
    persistent fp8 weights and scaling state, ``layer_delta`` one layer's saved bytes against bf16,
    ``backward_extra`` / ``forward_extra`` the casts' temporaries at a layer's peak, ``gather_fp8``
    whether FSDP2 all-gathers the linear weights in fp8."""

    weights: int = 0
    layer_delta: int = 0
    backward_extra: int = 0
    forward_extra: int = 0
    gather_fp8: bool = False


NO_FP8 = Fp8Step()  # what every plan outside ``precision: fp8`` gets (built once: the search's hot path)


def linear_elements(model: ModelSpec, layout: StageLayout) -> int:
    """The transformer layers' linear weights on this rank (the fp8 ones): the layers' parameters
    less their norms; the embedding and the LM head stay bf16."""
    return layout.layer_params - layout.layers * (P.layer_norm_params(model) + P.qk_norm_params(model))


def fp8_step(layout: StageLayout, plan: Plan, runtime: str, x: Shape, fsdp2: bool, moe_fraction: float) -> Fp8Step:
    """The fp8 terms of one rank's step for ``plan`` run by ``runtime`` (module docstring)."""
    if plan.precision != "fp8":
        return NO_FP8
    m = x.model
    chosen = recipe(plan.fp8_recipe, runtime)
    if plan.fp8_all_gather and not fsdp2:
        raise MemplanError(
            "the fp8 all-gather is torchao's under FSDP2: runtime memplan with zero 2 or 3 over dp x cp > 1",
            field="plan.fp8_all_gather",
        )
    widths = layer_matmul_widths(m)
    row_parallel = (3, len(widths) - 1)  # the attention output projection and down / fc2
    widths = [(i // x.t, o) if k in row_parallel else (i, o // x.t) for k, (i, o) in enumerate(widths)]
    if library(runtime) == "transformer-engine":
        h = m.hidden_size
        delta = te_saved_input_delta(x.tokens, x.d, h, m.q_size, m.ffn_size, x.t, x.rep, 1.0 - moe_fraction)
        gemms = layout.layers * len(widths)
        return Fp8Step(
            weights=te_weight_workspace_bytes(linear_elements(m, layout)) + te_scaling_state_bytes(gemms, chosen),
            layer_delta=delta,
            # the fc2 backward quantizes its incoming gradient row- and column-wise (linear.py)
            backward_extra=2 * x.tokens * h // x.rep if layout.layers else 0,
        )
    if not layout.layers:
        return Fp8Step(gather_fp8=plan.fp8_all_gather)
    down_in, down_out = widths[-1]
    rowwise = chosen == "rowwise"
    return Fp8Step(
        backward_extra=torchao_linear_backward_extra(x.tokens, down_in, down_out, rowwise),
        forward_extra=torchao_linear_forward_extra(x.tokens, down_in, down_out),
        gather_fp8=plan.fp8_all_gather,
    )
