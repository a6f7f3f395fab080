"""Read a Hugging Face ``config.json`` as it is into a :class:`ModelSpec`.

Each reader mirrors the defaults of the transformers configuration class it stands for, so a
config.json that leaves a field out means what transformers would make of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.specs.model import MoESpec

Config = dict[str, Any]


def _head_dim(cfg: Config) -> int | None:
    return cfg.get("head_dim") or None


def _kv_heads(cfg: Config, default: int | None) -> int:
    """num_key_value_heads: null means one per attention head; absent means the config class default.

    The defaults differ by class (Llama None, Mistral / Mixtral 8, Qwen2 32, Qwen2-MoE 16, Qwen3-MoE 4).
    """
    if "num_key_value_heads" in cfg:
        return cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    return default or cfg["num_attention_heads"]


def _llama_like(
    cfg: Config,
    architecture: str,
    *,
    qkv_bias: bool,
    tied_default: bool,
    kv_heads_default: int | None,
    positions_default: int,
) -> dict[str, Any]:
    """Fields shared by Llama, Mistral, Qwen2 and their MoE variants."""
    return {
        "architecture": architecture,
        "hidden_size": cfg["hidden_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_kv_heads": _kv_heads(cfg, kv_heads_default),
        "head_dim": _head_dim(cfg),
        "ffn_size": cfg["intermediate_size"],
        "mlp": "gated",
        "activation": _activation(cfg.get("hidden_act", "silu")),
        "norm": "rmsnorm",
        "qkv_bias": qkv_bias,
        "attn_out_bias": bool(cfg.get("attention_bias", False)) and not qkv_bias,
        "vocab_size": cfg["vocab_size"],
        "tied_embeddings": cfg.get("tie_word_embeddings", tied_default),
        "position_embedding": "rope",
        "max_position_embeddings": cfg.get("max_position_embeddings", positions_default),
    }


def _activation(name: str) -> str:
    return {"gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "swish": "silu"}.get(name, name)


def _llama(cfg: Config) -> dict[str, Any]:
    # LlamaConfig: attention_bias puts biases on q, k, v and o; mlp_bias on the MLP.
    fields = _llama_like(
        cfg,
        "llama",
        qkv_bias=bool(cfg.get("attention_bias", False)),
        tied_default=False,
        kv_heads_default=None,
        positions_default=2048,
    )
    fields["attn_out_bias"] = bool(cfg.get("attention_bias", False))
    fields["mlp_bias"] = bool(cfg.get("mlp_bias", False))
    return fields


def _mistral(cfg: Config) -> dict[str, Any]:
    return _llama_like(
        cfg, "mistral", qkv_bias=False, tied_default=False, kv_heads_default=8, positions_default=4096 * 32
    )


def _qwen2(cfg: Config) -> dict[str, Any]:
    # Qwen2Attention: q/k/v always carry a bias, o_proj never does.
    return _llama_like(cfg, "qwen2", qkv_bias=True, tied_default=False, kv_heads_default=32, positions_default=32768)


def _mixtral(cfg: Config) -> dict[str, Any]:
    fields = _llama_like(
        cfg, "mixtral", qkv_bias=False, tied_default=False, kv_heads_default=8, positions_default=4096 * 32
    )
    fields["moe"] = MoESpec(
        num_experts=cfg.get("num_local_experts", 8),
        top_k=cfg.get("num_experts_per_tok", 2),
        expert_ffn_size=cfg["intermediate_size"],
    )
    return fields


def _qwen_moe_layers(cfg: Config) -> dict[str, Any]:
    return {"layer_freq": cfg.get("decoder_sparse_step", 1), "dense_layers": tuple(cfg.get("mlp_only_layers") or ())}


def _qwen2_moe(cfg: Config) -> dict[str, Any]:
    fields = _llama_like(
        cfg,
        "qwen2-moe",
        qkv_bias=bool(cfg.get("qkv_bias", True)),
        tied_default=False,
        kv_heads_default=16,
        positions_default=32768,
    )
    # Qwen2MoeSparseMoeBlock always builds the shared expert and its gate; the class default width is 5632.
    shared = cfg.get("shared_expert_intermediate_size", 5632)
    fields["moe"] = MoESpec(
        num_experts=cfg.get("num_experts", 60),
        top_k=cfg.get("num_experts_per_tok", 4),
        expert_ffn_size=cfg.get("moe_intermediate_size", 1408),
        num_shared_experts=1 if shared else 0,
        shared_expert_ffn_size=shared or None,
        shared_expert_gate=bool(shared),
        **_qwen_moe_layers(cfg),
    )
    return fields


def _qwen3_moe(cfg: Config) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    fields = _llama_like(
        cfg, "qwen3-moe", qkv_bias=bias, tied_default=False, kv_heads_default=4, positions_default=32768
    )
    fields["attn_out_bias"] = bias
    fields["qk_norm"] = True
    fields["moe"] = MoESpec(
        num_experts=cfg.get("num_experts", 128),
        top_k=cfg.get("num_experts_per_tok", 8),
        expert_ffn_size=cfg.get("moe_intermediate_size", 768),
        **_qwen_moe_layers(cfg),
    )
    return fields


def _gpt2(cfg: Config) -> dict[str, Any]:
    hidden = cfg.get("n_embd", 768)
    return {
        "architecture": "gpt2",
        "hidden_size": hidden,
        "num_layers": cfg.get("n_layer", 12),
        "num_attention_heads": cfg.get("n_head", 12),
        "ffn_size": cfg.get("n_inner") or 4 * hidden,
        "mlp": "plain",
        "activation": _activation(cfg.get("activation_function", "gelu_new")),
        "norm": "layernorm",
        "qkv_bias": True,
        "attn_out_bias": True,
        "mlp_bias": True,
        "vocab_size": cfg.get("vocab_size", 50257),
        "tied_embeddings": cfg.get("tie_word_embeddings", True),
        "position_embedding": "learned",
        "max_position_embeddings": cfg.get("n_positions", 1024),
    }


def _gpt_neox(cfg: Config) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", True))
    return {
        "architecture": "gpt-neox",
        "hidden_size": cfg["hidden_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "ffn_size": cfg["intermediate_size"],
        "mlp": "plain",
        "activation": _activation(cfg.get("hidden_act", "gelu")),
        "norm": "layernorm",
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "mlp_bias": True,
        "vocab_size": cfg["vocab_size"],
        "tied_embeddings": cfg.get("tie_word_embeddings", False),
        "position_embedding": "rope",
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
    }


READERS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "GPT2LMHeadModel": _gpt2,
    "GPTNeoXForCausalLM": _gpt_neox,
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
}


# Where each ModelSpec field comes from in a config.json, so that an error names the key the
# user wrote (num_hidden_layers) rather than memplan's name for it (num_layers).
_LLAMA_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_kv_heads": "num_key_value_heads",
    "ffn_size": "intermediate_size",
    "activation": "hidden_act",
    "tied_embeddings": "tie_word_embeddings",
}
_QWEN_MOE_KEYS = {
    **_LLAMA_KEYS,
    "moe.num_experts": "num_experts",
    "moe.top_k": "num_experts_per_tok",
    "moe.expert_ffn_size": "moe_intermediate_size",
    "moe.shared_expert_ffn_size": "shared_expert_intermediate_size",
    "moe.layer_freq": "decoder_sparse_step",
    "moe.dense_layers": "mlp_only_layers",
}
_HF_KEYS: dict[str, dict[str, str]] = {
    "LlamaForCausalLM": _LLAMA_KEYS,
    "MistralForCausalLM": _LLAMA_KEYS,
    "Qwen2ForCausalLM": _LLAMA_KEYS,
    "MixtralForCausalLM": {
        **_LLAMA_KEYS,
        "moe.num_experts": "num_local_experts",
        "moe.top_k": "num_experts_per_tok",
        "moe.expert_ffn_size": "intermediate_size",
    },
    "Qwen2MoeForCausalLM": _QWEN_MOE_KEYS,
    "Qwen3MoeForCausalLM": _QWEN_MOE_KEYS,
    "GPT2LMHeadModel": {
        "hidden_size": "n_embd",
        "num_layers": "n_layer",
        "num_attention_heads": "n_head",
        "ffn_size": "n_inner",
        "activation": "activation_function",
        "tied_embeddings": "tie_word_embeddings",
        "max_position_embeddings": "n_positions",
    },
    "GPTNeoXForCausalLM": _LLAMA_KEYS,
}


def hf_key(architecture: str, field: str) -> str:
    """The config.json key a ModelSpec field (dotted path) is read from; the field itself if none differs."""
    return _HF_KEYS.get(architecture, {}).get(field, field)


def is_hf_config(data: Config) -> bool:
    """A dict looks like a config.json when it names architectures or a model_type."""
    return "architectures" in data or "model_type" in data


def hf_architecture(cfg: Config) -> str:
    """The transformers class a config.json names (``architectures[0]``, else from model_type)."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if archs:
        return str(archs[0])
    model_type = cfg.get("model_type", "")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise KeyError(f"model_type {model_type!r}")


def hf_model_fields(cfg: Config) -> dict[str, Any]:
    """ModelSpec fields for a config.json; raises KeyError naming an unknown architecture or a missing field."""
    return READERS[hf_architecture(cfg)](cfg)
