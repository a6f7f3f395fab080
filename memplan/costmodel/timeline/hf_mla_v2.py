"""DeepSeek-V2 (``DeepseekV2ForCausalLM``) in the op-level run of ``transformers.Trainer``: DeepSeek-V3's
layer (``hf_mla.py``) where transformers 5.23 ``models/deepseek_v2/modeling_deepseek_v2.py`` writes it
differently:

- the rotary table (``DeepseekV2RotaryEmbedding.forward``, l.214-220): under ``no_grad`` the fp32 angles
  over ``qk_rope_head_dim / 2``, ``torch.polar(torch.ones_like(freqs), freqs)`` and its product with
  ``attention_scaling``: one complex64 table (s, rope / 2) whatever the model's dtype, shared by every
  layer (the run passes it as both of Llama's ``cos`` and ``sin``);
- RoPE in complex form (``apply_rotary_emb``, l.259-272): ``view_as_complex(x.float().reshape(..., -1, 2))``
  (the ``float()`` a copy of a 16-bit x, alive until the function returns; the reshape of the query's
  strided slice a view), ``* freqs_cis`` (a complex64 product; MulBackward0 saves the table), then
  ``view_as_real(...).flatten(3).type_as(x)``: the product itself in fp32, its 16-bit cast else. No
  promotion follows: ``cat((q_nope, q_pe))`` is of one dtype under autocast too;
- the router (``DeepseekV2TopkRouter.forward``, l.97-116): the fp32 logits of V3's, ``softmax(dim=-1,
  dtype=float32)`` (its output saved), ``topk`` of the scores (``greedy``) or of the scores masked to the
  ``topk_group`` best groups (``group_limited_greedy``: each group's ``max``, the groups' ``topk``, a
  ``zeros_like`` mask ``scatter_``'d, expanded and reshaped to T x E, its ``~bool()``, and an out-of-place
  ``masked_fill`` of the scores, which saves the mask), ``* routed_scaling_factor``; no score bias, no
  renormalisation (``norm_topk_prob`` is not read);
- no buffer beside the rotary ones (``_keep_in_fp32_modules_strict`` names nothing V2 has).

The experts (``DeepseekV2Experts``: V3's, ``grouped_mm`` under fp32 scores), the ungated shared experts
(one ``DeepseekV2MLP`` of ``n_shared_experts x moe_intermediate_size``), the dense first layers, MLA's
projections, ``expand_kv`` and SDPA are V3's line for line (``DeepseekV2Moe.forward`` l.129-136,
``DeepseekV2Attention.forward`` l.367-418). Checked on CPU against the real Trainer
(tests/unit/test_timeline_hf_mla_v2.py).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.hf_mla import HfDeepseekV3
from memplan.costmodel.timeline.hf_mla_ops import scalar_mul
from memplan.costmodel.timeline.hf_moe_ops import INDEX, softmax, topk

COMPLEX = 8  # complex64


def complex_mul(tape: Tape, x: Tensor, table: Tensor, tag: str) -> Tensor:
    """``view_as_real(view_as_complex(x) * freqs_cis)`` over x's fp32 elements (a complex64 element is two):
    the product saves the table alone (it takes no gradient). Backward: ``ViewAsRealBackward0``'s
    ``view_as_complex(grad.contiguous())`` (a copy of a strided gradient: the query's slice of the cat's),
    then ``grad * freqs_cis.conj()`` (a new tensor); ``view_as_complex``'s backward a view of it."""
    numel = x.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        copy = tape.new(numel, 4, "grad_contiguous") if g[0].view else None
        grad = tape.new(numel, 4, "grad")
        tape.drop(copy)
        return [grad, None]

    node = tape.node(tag, apply, [x, table], saved=[table])
    return ops.result(tape, numel, 4, tag, node)


class HfDeepseekV2(HfDeepseekV3):
    """``DeepseekV2ForCausalLM``: V3's MLA with complex RoPE, the softmax router (greedy or group-limited),
    the shared experts; ``extra`` is ``hf_mla.mla_config``'s."""

    def buffers(self) -> list[tuple[str, int]]:
        """The rotary buffers over ``qk_rope_head_dim``."""
        half = self.mla["rope"] // 2
        return [(f"model.rotary_emb.{name}", half) for name in ("inv_freq", "original_inv_freq")]

    def rope_tables(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``DeepseekV2RotaryEmbedding.forward``: ``position_ids[..., None].float() * inv_freq.float()`` (a
        16-bit model's ``inv_freq`` upcast first), ``ones_like``, ``polar``, ``* attention_scaling``; the
        complex table twice (one tensor: Llama's two tables' place)."""
        t, d = self.tape, self.d
        n = d.s * (self.mla["rope"] // 2)
        with t.scoped("model.rotary_emb"):
            pos = t.new(d.s, 4, "position_ids_float")
            inv = t.new(n // d.s, 4, "inv_freq_float") if d.pd != 4 else None
            freqs = t.new(n, 4, "freqs")
            t.done(pos, inv)
            ones = t.new(n, 4, "ones_like")
            polar = t.new(n, COMPLEX, "polar")
            t.done(ones)
            table = t.new(n, COMPLEX, "freqs_cis")
            t.done(polar, freqs)
        return table, t.alias(table)

    def mla_rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``apply_rotary_emb(q_pe, k_pe, freqs_cis)``: the fp32 inputs first (both), then each product and
        its cast back; the fp32 copies go as the function returns."""
        t = self.tape
        table = t.view(cos)
        x32 = [ops.to(t, x, 4, f"{p}_pe_float") for x, p in ((q, "q"), (k, "k"))]
        outs = []
        for x, x_f, p in zip((q, k), x32, "qk", strict=True):
            prod = complex_mul(t, x_f, table, f"{p}_rope")
            outs.append(ops.to(t, prod, x.itemsize, f"{p}_rope.type_as"))
            t.done(prod)
        t.done(table, *x32)
        return outs[0], outs[1]

    def router(self, x: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """``DeepseekV2TopkRouter.forward``: (logits, scaled top-k weights, top-k indices)."""
        t, d, cfg = self.tape, self.d, self.extra
        logits = self.router_logits(x, name)
        x32 = ops.to(t, logits, 4, "logits_fp32")  # softmax(dtype=float32): ``input.toType``, then ``_softmax``
        scores = softmax(t, x32, "softmax")
        t.done(x32)
        chosen, temps = self.group_limited(scores) if cfg["groups"] > 1 else (t.alias(scores), [])
        values, ids = topk(t, chosen, d.tokens, cfg["top_k"])
        scaled = scalar_mul(t, values, "routed_scaling")
        t.done(values)
        t.done(scores, chosen, *temps)  # the frame's locals
        return logits, scaled, ids

    def group_limited(self, scores: Tensor) -> tuple[Tensor, list[Tensor]]:
        """``group_limited_greedy``'s masked scores (l.103-113) and the locals the router keeps to its return
        (the group maxima with their indices, which ``MaxBackward0`` saves, the groups' indices, the mask and
        its T x E expansion). No gradient reaches the choice of groups: the group scores' graph goes with them."""
        t, cfg, tokens = self.tape, self.extra, self.d.tokens
        e, groups = cfg["experts"], cfg["groups"]
        group_max = t.new(tokens * groups, 4, "group_max")
        group_max_ids = t.new(tokens * groups, INDEX, "group_max.indices")
        top = t.new(tokens * cfg["topk_groups"], 4, "group_topk")
        group_idx = t.new(tokens * cfg["topk_groups"], INDEX, "group_idx")
        t.done(top)
        group_mask = t.new(tokens * groups, 4, "group_mask")
        score_mask = t.new(tokens * e, 4, "score_mask")
        as_bool = t.new(tokens * e, 1, "score_mask_bool")
        inverted = t.new(tokens * e, 1, "score_mask_not")
        t.done(as_bool)
        masked = masked_fill(t, scores, inverted, "masked_fill")
        t.done(inverted)
        return masked, [group_max, group_max_ids, group_idx, group_mask, score_mask]


def masked_fill(tape: Tape, x: Tensor, mask: Tensor, tag: str) -> Tensor:
    """``x.masked_fill(mask, value)`` out of place: saves the mask; backward ``grad.masked_fill(mask, 0)``."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, "grad")]

    return ops.result(tape, numel, itemsize, tag, tape.node(tag, apply, [x], saved=[mask]))
