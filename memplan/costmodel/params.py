"""Parameter counts, per layer and per model, exactly as the Hugging Face modules hold them.

Checked against transformers' own models built on the meta device (tests/golden) and the
published counts (Llama-2-7B 6,738,415,616; Llama-3-8B 8,030,261,248; ...). Multimodal configs
(Gemma 3, Llama 4) are counted for their text model only.
"""

from __future__ import annotations

from functools import lru_cache

from memplan.specs.model import ModelSpec


def norm_params(model: ModelSpec, width: int | None = None) -> int:
    """RMSNorm holds a weight; LayerNorm a weight and a bias."""
    width = model.hidden_size if width is None else width
    return width * (2 if model.norm == "layernorm" else 1)


def qk_norm_params(model: ModelSpec) -> int:
    """QK norms: per head, one head_dim weight each for Q and K (Qwen3, Gemma 3); full width, q + kv (OLMo 2);
    none for Llama 4's weightless L2 norm."""
    if not (model.qk_norm and model.qk_norm_weight):
        return 0
    if model.qk_norm_scope == "full":
        return norm_params(model, model.q_size) + norm_params(model, model.kv_size)
    return 2 * norm_params(model, model.head_size)


def mla_params(model: ModelSpec) -> int:
    """Multi-head latent attention (DeepSeek-V2 paper, section 2.1), as transformers' DeepseekV2Attention builds it.

    Queries: h*r_q + r_q (RMSNorm) + r_q*a*(n + r), or one h*a*(n + r) without q_lora_rank; keys and values:
    h*(r_kv + r) + r_kv (RMSNorm) + r_kv*a*(n + v); output a*v*h. attention_bias adds biases to q_a, kv_a and o.
    """
    mla = model.mla
    assert mla is not None
    h, heads = model.hidden_size, model.num_attention_heads
    q_width = heads * mla.qk_head_dim
    if mla.q_lora_rank is None:
        count = h * q_width
    else:
        count = h * mla.q_lora_rank + norm_params(model, mla.q_lora_rank) + mla.q_lora_rank * q_width
        count += mla.q_lora_rank if mla.down_proj_bias else 0
    kv_a = mla.kv_lora_rank + mla.qk_rope_head_dim
    count += h * kv_a + (kv_a if mla.down_proj_bias else 0) + norm_params(model, mla.kv_lora_rank)
    count += mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    count += model.attn_out_size * h + (h if model.attn_out_bias else 0)
    return count


def attention_params(model: ModelSpec) -> int:
    """Q, K, V and output projections: h*(q + 2kv) + q*h, plus biases and QK norms (fused QKV: the same)."""
    if model.mla is not None:
        return mla_params(model)
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    count = h * (q + 2 * kv) + q * h
    if model.qkv_bias:
        count += q + 2 * kv
    if model.attn_out_bias:
        count += h
    return count + qk_norm_params(model)


def mlp_params(model: ModelSpec, ffn_size: int) -> int:
    """Gated (SwiGLU): 3*h*f (fused gate_up: h*2f + f*h, the same); plain: 2*h*f; biases f (+ f for gated) + h."""
    h = model.hidden_size
    matrices = 3 if model.mlp == "gated" else 2
    count = matrices * h * ffn_size
    if model.mlp_bias:
        count += (matrices - 1) * ffn_size + h
    return count


def moe_params(model: ModelSpec) -> tuple[int, int]:
    """(expert params, non-expert params) of one MoE feed-forward block.

    Router h*E (+E), E routed experts, shared experts, and Qwen2-MoE's shared-expert gate h*1.
    """
    moe = model.moe
    assert moe is not None
    h = model.hidden_size
    experts = moe.num_experts * mlp_params(model, moe.expert_ffn_size)
    shared = moe.num_shared_experts * mlp_params(model, moe.shared_ffn_size)
    router = h * moe.num_experts + (moe.num_experts if moe.router_bias else 0)
    gate = h if moe.shared_expert_gate else 0
    return experts, shared + router + gate


def layer_norm_params(model: ModelSpec) -> int:
    """The hidden-width norms of one layer: two (pre or post norms), four (Gemma's sandwich norms)."""
    return model.norms_per_layer * norm_params(model)


def moe_buffer_elements(model: ModelSpec) -> int:
    """Persistent non-parameter elements: DeepSeek-V3's router score-correction bias, E per MoE layer.

    transformers holds it as a buffer (in the checkpoint, no gradient, no optimizer state), so it is not in
    total_params; weights memory may add it.
    """
    if model.moe is None or not model.moe.router_score_bias:
        return 0
    return model.num_moe_layers * model.moe.num_experts


@lru_cache(maxsize=4096)
def layer_params(model: ModelSpec, index: int) -> int:
    """All parameters of transformer layer ``index``: attention, MLP or MoE, its norms (2, or 4 for Gemma)."""
    count = attention_params(model) + layer_norm_params(model)
    if model.is_moe_layer(index):
        return count + sum(moe_params(model))
    return count + mlp_params(model, model.ffn_size)


def embedding_params(model: ModelSpec) -> int:
    """Token embedding V*h, plus learned positions P*h (GPT-2)."""
    count = model.vocab_size * model.hidden_size
    if model.position_embedding == "learned":
        count += model.max_position_embeddings * model.hidden_size
    return count


def head_params(model: ModelSpec) -> int:
    """Final norm plus the LM head (V*h when untied, nothing extra when tied)."""
    head = 0 if model.tied_embeddings else model.vocab_size * model.hidden_size
    return norm_params(model) + head


@lru_cache(maxsize=4096)
def total_params(model: ModelSpec) -> int:
    """Every parameter of the model, counted once (tied weights once)."""
    layers = sum(layer_params(model, i) for i in range(model.num_layers))
    return embedding_params(model) + layers + head_params(model)


def expert_params(model: ModelSpec) -> int:
    """Parameters that live in routed experts (sharded by expert parallelism)."""
    if model.moe is None:
        return 0
    return model.num_moe_layers * moe_params(model)[0]


@lru_cache(maxsize=4096)
def active_params(model: ModelSpec) -> int:
    """Parameters one token passes through: routed experts count top_k / num_experts."""
    if model.moe is None:
        return total_params(model)
    per_expert = mlp_params(model, model.moe.expert_ffn_size)
    inactive = model.num_moe_layers * (model.moe.num_experts - model.moe.top_k) * per_expert
    return total_params(model) - inactive
