"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) in the op-level run of ``transformers.Trainer``.

Read from transformers 5.23 ``models/deepseek_v3/modeling_deepseek_v3.py``; the layer is Llama's
(``DeepseekV3DecoderLayer``, l.485-529) with multi-head latent attention and, from layer
``first_k_dense_replace`` on, the sparse block:

- ``DeepseekV3Attention.forward`` (l.426-482): ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (one ``q_proj``
  when ``q_lora_rank`` is None), viewed (b, heads, s, qk_head_dim) and split into the nope and rope parts;
  ``kv_a_proj_with_mqa(x)`` split into the latent (normed by ``kv_a_layernorm``) and one shared RoPE key;
  RoPE over the rope parts (``rope_interleave``, the config's default: ``apply_rotary_pos_emb_interleave``,
  l.310-346, on the even / odd slices; else Llama's ``rotate_half``); ``cat((q_pass, q_rot))``;
  ``expand_kv`` (l.407-424): ``kv_b_proj`` of the latent split into the keys' nope part and the values,
  ``new_empty`` keys with both parts ``copy_``'d in; SDPA over qk_head_dim with v_head_dim values;
- the router (``DeepseekV3TopkRouter.forward``, l.133-158): fp32 logits (``F.linear`` of fp32 casts of
  the input and the weight), ``sigmoid``, ``+ e_score_correction_bias`` (a buffer, fp32 as
  ``_keep_in_fp32_modules_strict`` loads it), the group scores (top-2 of each of ``n_group`` groups,
  summed), the groups' top-k and their mask, ``masked_fill``, the top-k experts, ``gather`` of their
  scores, the renormalisation (``norm_topk_prob``: ``/= sum + 1e-20``) and ``* routed_scaling_factor``;
- ``DeepseekV3MoE.forward`` (l.215-222): the router, the experts (``grouped_mm``, ``hf_moe.MoeBlock.experts``,
  under fp32 scores), then the ungated shared experts (one ``DeepseekV3MLP`` of ``n_shared_experts x
  moe_intermediate_size``) on the block's input, added.

The ops' allocations, saves and backward formulas are ``hf_mla_ops.py``'s. The CPU runs SDPA's math path
(``attention.sdpa_backend``: its flash kernel needs one head dim for q, k and v). Checked on CPU against the
real Trainer (tests/unit/test_timeline_hf_mla.py). On CUDA SDPA runs the memory-efficient kernel (flash needs
one head dim; ``mem_efficient.py`` and ``mem_efficient_half.py``, from source, no GPU trace); the other ops
allocate what they allocate on CPU (aten's outputs and autograd's formulas do not depend on the device).
"""

from __future__ import annotations

import dataclasses

from memplan.costmodel.timeline import mem_efficient, ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.hf_families import split
from memplan.costmodel.timeline.hf_mla_ops import copy_slices, expand_heads, gather, math_sdpa, scalar_mul, sub
from memplan.costmodel.timeline.hf_model import LAYER_PARAMS, HfLlama
from memplan.costmodel.timeline.hf_moe import MoeBlock, moe_config
from memplan.costmodel.timeline.hf_moe_ops import INDEX, renormalise
from memplan.costmodel.timeline.hf_offload import orphaned

ATTENTION_PARAMS = (  # DeepseekV3Attention.__init__ (l.370-403), registration order
    ("self_attn.q_a_proj", "qa", "h"),
    ("self_attn.q_a_layernorm", "qa", "1"),
    ("self_attn.q_b_proj", "qb", "qa"),
    ("self_attn.kv_a_proj_with_mqa", "kva", "h"),
    ("self_attn.kv_a_layernorm", "kvr", "1"),
    ("self_attn.kv_b_proj", "kvb", "kvr"),
    ("self_attn.o_proj", "h", "o"),
)
PLAIN_Q = (("self_attn.q_proj", "qb", "h"),)  # q_lora_rank None
NORMS = LAYER_PARAMS[7:]  # input_layernorm, post_attention_layernorm
DENSE_MLP = LAYER_PARAMS[4:7]
SPARSE_MLP = (  # DeepseekV3MoE.__init__ (l.206-213): experts, gate, shared_experts
    ("mlp.experts.gate_up_proj", "E2fe", "h"),
    ("mlp.experts.down_proj", "Eh", "fe"),
    ("mlp.gate", "E", "h"),
    ("mlp.shared_experts.gate_proj", "fs", "h"),
    ("mlp.shared_experts.up_proj", "fs", "h"),
    ("mlp.shared_experts.down_proj", "h", "fs"),
)


def attention_params(plain_q: bool) -> tuple:
    return (*PLAIN_Q, *ATTENTION_PARAMS[3:]) if plain_q else ATTENTION_PARAMS


def layer_params(extra: dict, sparse: bool) -> tuple:
    """Layer i's parameters: MLA, then the dense MLP or the sparse block, then the two norms."""
    attn = attention_params(extra["mla"]["q_lora_rank"] is None)
    return (*attn, *(SPARSE_MLP if sparse else DENSE_MLP), *NORMS)


def mla_sizes(extra: dict, heads: int) -> dict[str, int]:
    """The MLA widths ``hf_model.param_shapes`` reads (``layer_params``)."""
    m = extra["mla"]
    qk = m["nope"] + m["rope"]
    return {
        "qa": m["q_lora_rank"] or 0,
        "qb": heads * qk,
        "kva": m["kv_lora_rank"] + m["rope"],
        "kvr": m["kv_lora_rank"],
        "kvb": heads * (m["nope"] + m["v"]),
        "o": heads * m["v"],
    }


def mla_config(model, gpu_arch=None) -> dict:
    """``moe_config`` with what the router and MLA read beyond it."""
    cfg = moe_config(model, gpu_arch)
    mla = model.mla
    cfg["fp32_scores"] = True  # the sigmoid scores of fp32 logits
    cfg["groups"], cfg["topk_groups"] = model.moe.router_groups, model.moe.router_topk_groups
    cfg["mla"] = {
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "nope": mla.qk_nope_head_dim,
        "rope": mla.qk_rope_head_dim,
        "v": mla.v_head_dim,
        "interleave": mla.rope_interleave,
    }
    cfg["mla_sizes"] = mla_sizes(cfg, model.num_attention_heads)
    return cfg


class HfDeepseekV3(MoeBlock, HfLlama):
    """``DeepseekV3ForCausalLM``: MLA, the sigmoid router with its score bias and groups, the shared
    experts; ``extra`` is ``mla_config``'s."""

    @property
    def mla(self) -> dict:
        return self.extra["mla"]

    def buffers(self) -> list[tuple[str, int]]:
        """The routers' ``e_score_correction_bias`` (fp32 whatever the model's dtype: counted here in the
        model's dtype's elements), then the rotary buffers over ``qk_rope_head_dim``."""
        e, dense = self.extra["experts"], self.extra["dense"]
        bias = [
            (f"model.layers.{i}.mlp.gate.e_score_correction_bias", e * 4 // self.d.pd)
            for i in range(self.d.layers)
            if i not in dense
        ]
        half = self.mla["rope"] // 2
        return [*bias, *((f"model.rotary_emb.{name}", half) for name in ("inv_freq", "original_inv_freq"))]

    def rope_tables(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``DeepseekV3RotaryEmbedding.forward``: Llama's tables over ``qk_rope_head_dim``."""
        full = self.d
        self.d = dataclasses.replace(full, head_dim=self.mla["rope"])
        try:
            return super().rope_tables(x)
        finally:
            self.d = full

    # --- attention -----------------------------------------------------------------------------
    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``DeepseekV3Attention.forward`` with ``sdpa_attention_forward``."""
        t, d, m = self.tape, self.d, self.mla
        name = f"{prefix}.self_attn"
        heads, qk = d.heads, m["nope"] + m["rope"]
        with t.scoped(name):
            q = self.queries(x, name, heads * qk)
            qh = ops.heads_view(t, q, "q_heads", copy_grad=True)
            t.done(q)
            q_pass, q_rot = split(t, qh, (m["nope"], m["rope"]), "q_split")
            t.done(qh)
            ckv = self.linear(x, f"{name}.kv_a_proj_with_mqa", m["kv_lora_rank"] + m["rope"], "kv_a_proj_with_mqa")
            kv_nope, k_rot = split(t, ckv, (m["kv_lora_rank"], m["rope"]), "kv_split")
            latent = self.rms_norm(kv_nope, f"{name}.kv_a_layernorm")
            t.done(kv_nope)
            q_emb, k_emb = self.mla_rope(q_rot, k_rot, cos, sin)
            t.done(q_rot, k_rot)
            latent, k_emb = self.cached(latent, k_emb)  # the cache holds the latents (transformers 5.23)
            query = self.cat_promoted(q_pass, q_emb, "query_states")
            key, value = self.expand_kv(latent, k_emb, name)
            out = self.mla_sdpa(query, key, value)
            y = self.linear(out, f"{name}.o_proj", d.h, "o_proj")
            t.done(out, q_pass, q_emb, ckv, latent, k_emb, query, key, value)
        return y

    def cat_promoted(self, a: Tensor, b: Tensor, tag: str) -> Tensor:
        """``torch.cat((a, b), dim=-1)``, a 16-bit ``a`` cast to an fp32 ``b``'s dtype first (under
        autocast the projections are bf16, RoPE's products fp32), the cast freed as cat returns."""
        t = self.tape
        a2 = ops.to(t, a, b.itemsize, f"{tag}.promote")
        out = ops.cat(t, a2, b, tag)
        t.done(a2)
        return out

    def queries(self, x: Tensor, name: str, width: int) -> Tensor:
        """``q_b_proj(q_a_layernorm(q_a_proj(x)))``, or ``q_proj(x)``."""
        t, rank = self.tape, self.mla["q_lora_rank"]
        if rank is None:
            return self.linear(x, f"{name}.q_proj", width, "q_proj")
        a = self.linear(x, f"{name}.q_a_proj", rank, "q_a_proj")
        n = self.rms_norm(a, f"{name}.q_a_layernorm")
        t.done(a)
        q = self.linear(n, f"{name}.q_b_proj", width, "q_b_proj")
        t.done(n)
        return q

    def mla_rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``apply_rotary_pos_emb_interleave`` (or ``apply_rotary_pos_emb``) of the rope parts."""
        t = self.tape
        if not self.mla["interleave"]:
            return self.rope(q, cos, sin, "q_rope"), self.rope(k, cos, sin, "k_rope")
        c, s = t.view(cos, cos.numel // 2), t.view(sin, sin.numel // 2)
        # x[..., 0::2], x[..., 1::2]: views whose backward (SliceBackward0) zeroes an x-sized gradient
        parts = [(ops.half_slice(t, x, f"{p}1"), ops.half_slice(t, x, f"{p}2")) for x, p in ((q, "q"), (k, "k"))]
        outs = [self.interleaved(x1, x2, c, s, f"{p}_rope") for (x1, x2), p in zip(parts, "qk", strict=True)]
        t.done(c, s, *(x for pair in parts for x in pair))
        return outs[0], outs[1]

    def interleaved(self, x1: Tensor, x2: Tensor, cos: Tensor, sin: Tensor, tag: str) -> Tensor:
        """``cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)``."""
        t = self.tape
        a, b = ops.mul(t, x1, cos, f"{tag}.x1_cos"), ops.mul(t, x2, sin, f"{tag}.x2_sin")
        lo = sub(t, a, b, f"{tag}.lo")
        t.done(a, b)
        c, e = ops.mul(t, x2, cos, f"{tag}.x2_cos"), ops.mul(t, x1, sin, f"{tag}.x1_sin")
        hi = ops.add(t, c, e, f"{tag}.hi")
        t.done(c, e)
        out = ops.cat(t, lo, hi, tag)
        t.done(hi, lo)
        return out

    def expand_kv(self, latent: Tensor, k_rot: Tensor, name: str) -> tuple[Tensor, Tensor]:
        """``expand_kv``: ``kv_b_proj`` of the latent, split into the keys' nope part and the values;
        ``new_empty`` keys with the nope part and the expanded rope key ``copy_``'d in."""
        t, d, m = self.tape, self.d, self.mla
        kv = self.linear(latent, f"{name}.kv_b_proj", d.heads * (m["nope"] + m["v"]), "kv_b_proj")
        kvh = ops.heads_view(t, kv, "kv_heads", copy_grad=True)
        t.done(kv)
        k_nope, value = split(t, kvh, (m["nope"], m["v"]), "kv_b_split")
        t.done(kvh)
        k_exp = expand_heads(t, k_rot, d.tokens * d.heads * m["rope"], "k_rot_expand")
        key = copy_slices(t, k_nope, k_exp, d.tokens * d.heads * (m["nope"] + m["rope"]))
        t.done(k_nope, k_exp)
        return key, value

    def mla_sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """SDPA over qk_head_dim queries and keys and v_head_dim values: on CPU the math path
        (``precision.math_sdpa``'s ops), then ``transpose(1, 2).contiguous()`` (a copy) and the reshape; on
        CUDA the memory-efficient kernel (``kernel`` "efficient": ``attention.sdpa_backend``, flash needing one
        head dim; ``mem_efficient.sdpa``, fp32 or 16-bit), whose output is token-major already, so
        ``sdpa_attention_forward``'s reshape, transpose and ``.contiguous()`` and the attention's reshape are
        views (transformers 5.23 ``integrations/sdpa_attention.py``: no padding of v for SDPA)."""
        t, d, m = self.tape, self.d, self.mla
        if self.cache is not None:  # autocast casts SDPA's fp32 inputs to bf16 (the query: RoPE's fp32)
            q, k, v = (ops.to(t, x, 2, f"{n}_cast") for x, n in ((q, "q"), (k, "k"), (v, "v")))
        else:
            q, k, v = (t.alias(x) for x in (q, k, v))
        if self.kernel == "efficient":
            out = mem_efficient.sdpa(t, q, k, v, d.b, d.heads, d.s, m["nope"] + m["rope"], m["v"])
        else:
            out = math_sdpa(t, q, k, v, d.b, d.heads, d.s)
        t.done(q, k, v)
        flat = t.alias(out) if self.kernel == "efficient" else prec.merge_heads(t, out)
        t.done(out)
        return flat

    # --- the sparse block ----------------------------------------------------------------------
    def sparse(self, x: Tensor, name: str) -> Tensor:
        """``DeepseekV3MoE.forward``: the router, the experts, the shared experts, their sum."""
        t, cfg = self.tape, self.extra
        with t.scoped(name):
            logits, scores, ids = self.router(x, f"{name}.gate")
            out = self.experts(x, scores, ids, f"{name}.experts")
            shared = self.gated_mlp(x, f"{name}.shared_experts", cfg["shared_ffn"])
            total = ops.add(t, out, shared, "shared_add")
            t.done(shared, out)
            t.done(logits, scores, ids)  # the frame's locals: ``_``, the weights, the indices
        return total

    def router(self, x: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """``DeepseekV3TopkRouter.forward``: (logits, top-k weights, top-k indices). The choice of experts
        (``scores_for_choice`` through the last ``topk``) keeps only indices, so no gradient reaches it:
        its graph dies with its tensors (CPU log: the masked scores, the group scores and the first top-k's
        indices their autograd nodes hold go as the router returns)."""
        t, d, cfg = self.tape, self.d, self.extra
        tokens, e, k, groups = d.tokens, cfg["experts"], cfg["top_k"], cfg["groups"]
        logits = self.router_logits(x, name)
        scores = ops.output_saved(t, logits, "sigmoid", "sigmoid_backward")
        choice = t.new(tokens * e, 4, "scores_for_choice")
        top2 = t.new(tokens * groups * 2, 4, "group_top2")  # the top 2 of each group
        top2_ids = t.new(tokens * groups * 2, INDEX, "group_top2_ids")
        orphaned(t, top2_ids)  # the saves of the nodes that die as the router returns: TRL packs them
        group_scores = t.new(tokens * groups, 4, "group_scores")
        t.done(top2)
        group_values = t.new(tokens * cfg["topk_groups"], 4, "group_topk")
        group_idx = t.new(tokens * cfg["topk_groups"], INDEX, "group_idx")
        orphaned(t, group_idx)
        t.done(group_values)
        group_mask = t.new(tokens * groups, 4, "group_mask")
        score_mask = t.new(tokens * e, 4, "score_mask")
        as_bool = t.new(tokens * e, 1, "score_mask_bool")
        inverted = t.new(tokens * e, 1, "score_mask_not")
        orphaned(t, inverted)
        t.done(as_bool)
        filled = t.new(tokens * e, 4, "masked_fill")
        t.done(choice)
        values, ids = t.new(tokens * k, 4, "topk.values"), t.new(tokens * k, INDEX, "topk.indices")
        orphaned(t, ids)
        t.done(values)
        weights = gather(t, scores, ids, tokens * k, "gather")
        if cfg["norm_topk"]:
            weights = renormalise(t, weights, tokens, eps=True)
        scaled = scalar_mul(t, weights, "routed_scaling")
        t.done(weights)
        # the frame's locals (the masked scores' node, its saved mask first; the group scores' node, the
        # first top-k's indices first)
        t.done(scores, inverted, filled, top2_ids, group_scores, group_idx, group_mask, score_mask)
        return logits, scaled, ids

    def router_logits(self, x: Tensor, name: str) -> Tensor:
        """``F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))``: fp32 logits, or
        under autocast bf16 ones (``F.linear`` runs in bf16 whatever its inputs)."""
        t, e = self.tape, self.extra["experts"]
        x32 = ops.to(t, x, 4, "input_fp32")
        w32 = ops.to(t, self.weights[f"{name}.weight"], 4, "weight_fp32")
        if self.cache is None:
            logits = ops.linear(t, x32, w32, self.d.tokens * e, "router_logits")
        else:  # autocast runs F.linear in bf16: the weight's cast (cached when it is the fp32 leaf), the input's
            leaf = self.weights[f"{name}.weight"].itemsize == 4  # ``weight.type(float32)`` returned the weight
            w = self.weight(f"{name}.weight") if leaf else ops.to(t, w32, 2, "weight_cast")
            xin = ops.to(t, x32, 2, "input_cast")
            logits = ops.linear(t, xin, w, self.d.tokens * e, "router_logits")
            t.done(xin, w)
        t.done(w32, x32)
        return logits
