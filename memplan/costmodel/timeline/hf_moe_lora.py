"""PEFT 0.21.2's ``lora.ParamWrapper`` over an MoE block's 3-D experts, on the byte-level tape.

Where transformers 5.23 converts a model type from v4 checkpoints (Qwen3-MoE), PEFT moves the MLP names of
``target_modules`` to ``target_parameters`` on the experts (``utils/transformers_weight_conversion.py:
_convert_peft_config_moe``: gate_proj and up_proj to ``gate_up_proj`` at twice the rank and alpha, down_proj to
``down_proj``) and wraps each in ``lora.ParamWrapper`` (``tuners/lora/layer.py``), nested in the experts'
parameter order: ``gate_up_proj``'s wrapper innermost, ``down_proj``'s outside it. Per parameter of shape
(E, n, k): ``lora_A`` (r E x k) and ``lora_B`` (n x r E), fp32. Each wrapper's forward
(``_activate_lora``, outer first):

- ``get_delta_factors``: ``lora_A.weight.reshape(E, r, k)`` and ``lora_B.weight.reshape(n, r, E).permute(2, 0,
  1)``, views (cast to the base's dtype: none in fp32);
- ``register_parametrization(experts, name, _LoraFactorsProxy(lhs, rhs, scaling))``, which evaluates the
  parametrization once to check it (``torch/nn/utils/parametrize.py``): a ``baddbmm`` of the weight's size,
  freed;
- under ``parametrize.cached()`` the experts' forward reads the weight once (``grouped_mm_experts_forward``):
  ``baddbmm(W, lhs, rhs, alpha=scaling)``, a new weight of W's size that requires grad, cached until the
  outermost wrapper's forward returns (``hf_moe.MoeBlock.experts`` then lets it go).

``grouped_mm`` with that weight saves its input for the weight's gradient, and the weight where its input
takes a gradient (``hf_moe_ops.grouped_mm``). Backward: the weight's gradient (E x n x k), then BaddbmmBackward0
(``derivatives.yaml``: ``grad.bmm(batch2^T) * alpha``, ``batch1^T.bmm(grad) * alpha``: a ``bmm`` and its scaled
copy each, the ``bmm`` freed), then, after the block's later nodes (the factors' views were made before them),
``lora_B``'s gradient through PermuteBackward0 (a view) and ViewBackward0 (a reshape of a permuted tensor: a
copy) and ``lora_A``'s through ViewBackward0 (a view). ``all-linear`` on Mixtral and Qwen3-MoE wraps the
experts so and the router's 2-D weight too (:func:`router_delta`, :func:`plus_delta`). Checked on CPU against
the real Trainer, equal to the byte (tests/unit/test_timeline_hf_moe.py,
``test_lora_on_qwen3_moes_experts_equals_the_trainers``,
``test_all_linear_over_mixtral_and_qwen3_moe_equals_the_trainers``).
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.hf_offload import orphaned

MLP = ("gate_proj", "up_proj", "down_proj")
# the MoE families whose targets PEFT converts: all-linear to the experts and the router's weight, and on
# Qwen3-MoE the MLP names to the experts (Mixtral's match no module: specs.job refuses them)
CONVERTED = ("qwen3-moe", "mixtral")


def wrapped_experts(arch: str, targets: frozenset[str], rank: int, all_linear: bool) -> tuple[tuple[str, int], ...]:
    """The experts' parameters PEFT wraps, outermost first, with their rank: ``gate_up_proj`` (gate and up
    fused: twice the rank, ``rank_pattern``) innermost, ``down_proj`` outside it."""
    if arch not in CONVERTED or not (all_linear or arch == "qwen3-moe"):
        return ()
    wrapped = [("gate_up_proj", 2 * rank)] if {"gate_proj", "up_proj"} <= targets else []
    wrapped += [("down_proj", rank)] if "down_proj" in targets else []
    return tuple(reversed(wrapped))


def factors(tape: Tape, weights: dict[str, Tensor], name: str) -> tuple[Tensor, Tensor]:
    """``get_delta_factors`` of the wrapper of ``name`` (``...experts.down_proj``): ``lhs``, lora_B
    reshaped and permuted (its gradient's reshape back copies), and ``rhs``, lora_A reshaped (a view), each
    cast to the weight's dtype (a 16-bit base's: copies, held by the proxy and saved by its ``baddbmm``)."""
    a, b = weights[f"{name}.lora_A.weight"], weights[f"{name}.lora_B.weight"]
    itemsize = weights[f"{name}.weight"].itemsize
    rhs = _view(tape, a, copy_back=False, tag=f"{name}.lora_A.reshape")
    lhs = _view(tape, b, copy_back=True, tag=f"{name}.lora_B.reshape_permute")
    # (experts, out, rank) over (out, rank x experts) memory: strides (1, rank x experts, experts), not contiguous
    # (TRL's offload clones it where it is offloaded: FSDP2's gathered factors, hf_offload.py); rhs, lora_A's
    # reshape, is contiguous
    lhs.transposed = True
    cast = ops.to(tape, lhs, itemsize, f"{name}.lhs_cast"), ops.to(tape, rhs, itemsize, f"{name}.rhs_cast")
    tape.done(rhs, lhs)
    return cast


def _view(tape: Tape, w: Tensor, copy_back: bool, tag: str) -> Tensor:
    """A view of a trained weight; backward a view of the gradient, or a copy (``copy_back``)."""
    numel = w.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, g[0].itemsize, "grad_reshape_copy") if copy_back else tape.view(g[0])]

    v = tape.view(w)
    v.fn = tape.node(tag, apply, [w])
    return v


def check(tape: Tape, w: Tensor, tag: str, saved: tuple[Tensor, ...] = ()) -> None:
    """``register_parametrization``'s evaluation of the new parametrization: a weight-sized result, freed (the
    experts' ``baddbmm``, whose node saves the factors, ``saved``, and dies with it: under TRL's hooks packs never
    unpacked, ``hf_offload.orphaned``; the router's ``W + delta`` saves nothing)."""
    for f in saved:
        orphaned(tape, f)
    tape.drop(tape.new(w.numel, w.itemsize, f"{tag}.parametrization_check"))


def parametrized(tape: Tape, w: Tensor, lhs: Tensor, rhs: Tensor, tag: str) -> Tensor:
    """``_LoraFactorsProxy.forward``: ``baddbmm(W, lhs, rhs, alpha=scaling)`` (W frozen: no edge to it)."""
    lhs_numel, rhs_numel = lhs.numel, rhs.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        out = []
        for numel in (lhs_numel, rhs_numel):  # batch1's gradient, then batch2's
            prod = tape.new(numel, g[0].itemsize, "bmm")
            out.append(tape.new(numel, g[0].itemsize, "mul_alpha"))
            tape.drop(prod)
        return out

    node = tape.node(tag, apply, [lhs, rhs], saved=[lhs, rhs])
    return ops.result(tape, w.numel, w.itemsize, tag, node)


def router_delta(
    tape: Tape, weights: dict[str, Tensor], name: str, read: Callable[[str], Tensor], cpu: bool = False
) -> Tensor:
    """The router's ``ParamWrapper._activate_lora`` (a 2-D weight: one expert, so ``get_delta_weight``, not
    the factors): ``lora_B.weight @ lora_A.weight`` (E x h; MmBackward0 saves both operands and computes mat2's
    gradient first) on the
    operands as ``read`` gives them (the model's ``weight``: under the Trainer's ``bf16=True`` autocast's cached
    bf16 casts, the product in bf16), times the scaling, cast to the weight's dtype, held by
    ``_LoraParameterProxy``; then ``register_parametrization``'s check (``W + delta``, freed). On ``cpu`` with
    16-bit adapters (FSDP2's bf16 all-gather of them, ``hf_fsdp_moe.py``) ``lora.Linear.get_delta_weight``
    multiplies fp32 copies (``cast_to_fp32``: ``weight_A.float()``, then ``weight_B.float()``, both saved by the
    product) and casts the scaled product back to the adapters' dtype."""
    w = weights[f"{name}.weight"]
    low = cpu and weights[f"{name}.lora_B.weight"].itemsize < 4
    if low:
        a = ops.to(tape, weights[f"{name}.lora_A.weight"], 4, f"{name}.lora_A.float")
        b = ops.to(tape, weights[f"{name}.lora_B.weight"], 4, f"{name}.lora_B.float")
    else:
        a, b = read(f"{name}.lora_A.weight"), read(f"{name}.lora_B.weight")

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        grad_a = tape.new(a.numel, g[0].itemsize, "grad_A")
        return [tape.new(b.numel, g[0].itemsize, "grad_B"), grad_a]

    node = tape.node(f"{name}.delta_mm", apply, [b, a], saved=[a, b])  # mat2 packed first; autocast's casts kept
    prod = ops.result(tape, w.numel, b.itemsize, f"{name}.delta_mm", node)
    tape.done(a, b)
    scaled = ops.unary(tape, prod, f"{name}.delta_scaling")
    tape.done(prod)
    if low:  # output_tensor.to(dtype=dtype): back to the adapters' 16 bits
        back = ops.to(tape, scaled, weights[f"{name}.lora_B.weight"].itemsize, f"{name}.delta_back")
        tape.done(scaled)
        scaled = back
    delta = ops.to(tape, scaled, w.itemsize, f"{name}.delta_cast")
    tape.done(scaled)
    check(tape, w, name)
    return delta


def plus_delta(tape: Tape, w: Tensor, delta: Tensor, tag: str) -> Tensor:
    """``_LoraParameterProxy.forward``: ``W + delta`` (AddBackward0 passes the gradient on to the delta)."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.view(g[0])]

    return ops.result(tape, w.numel, w.itemsize, tag, tape.node(tag, apply, [delta]))
