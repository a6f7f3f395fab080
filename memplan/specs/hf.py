"""Read a Hugging Face ``config.json`` as it is into a :class:`ModelSpec`.

Each reader mirrors the defaults of the transformers configuration class it stands for, so a
config.json that leaves a field out means what transformers would make of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.errors import MemplanError
from memplan.specs.model import MoESpec

Config = dict[str, Any]

# transformers' layer_types names -> memplan's attention kinds
_ATTENTION_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


def _bad(field: str, reason: str) -> MemplanError:
    """A config.json value memplan cannot model; the loader puts the file in front."""
    return MemplanError(reason, field=field)


def _period(values: list[Any]) -> tuple[Any, ...]:
    """The shortest prefix that, repeated, gives ``values`` (Gemma 3: 5 sliding, 1 full for 48 layers -> 6)."""
    for n in range(1, len(values) + 1):
        if all(v == values[i % n] for i, v in enumerate(values)):
            return tuple(values[:n])
    return ()


def _attention_pattern(
    layer_types: Any, num_layers: int, allowed: tuple[str, ...], window: int | None
) -> tuple[str, ...]:
    """config.json layer_types as a repeating pattern of memplan kinds; sliding layers with no window are full.

    An empty result means every layer is full causal attention (the ModelSpec default).
    """
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise _bad("layer_types", f"expected a list of {num_layers} attention kinds (one per layer)")
    for kind in layer_types:
        if kind not in allowed:
            raise _bad("layer_types", f"unknown attention kind {kind!r} (known here: {', '.join(allowed)})")
    kinds = [_ATTENTION_KINDS[k] for k in layer_types]
    if window is None:  # transformers sets the layer's window to None: plain causal attention
        kinds = ["full" if k == "sliding" else k for k in kinds]
    pattern = _period(kinds)
    return () if pattern == ("full",) else pattern


def _sliding(cfg: Config, layer_types: Any, num_layers: int, default_window: int | None) -> dict[str, Any]:
    """attention_pattern and sliding_window of a family with full and sliding layers."""
    window = cfg.get("sliding_window", default_window)
    pattern = _attention_pattern(layer_types, num_layers, ("full_attention", "sliding_attention"), window)
    return {"attention_pattern": pattern, "sliding_window": window if "sliding" in pattern else None}


def _no_bidirectional(cfg: Config) -> None:
    if cfg.get("use_bidirectional_attention"):
        raise _bad("use_bidirectional_attention", "bidirectional (encoder) attention is not modelled")


def _head_dim(cfg: Config) -> int | None:
    return cfg.get("head_dim") or None


def _kv_heads(cfg: Config, default: int | None, heads_default: int | None = None) -> int:
    """num_key_value_heads: null means one per attention head; absent means the config class default.

    The defaults differ by class (Llama None, Mistral / Mixtral 8, Qwen2 32, Qwen2-MoE 16, Qwen3-MoE 4, Gemma 4,
    Llama 4 8); heads_default is the class's num_attention_heads default where the reader does not require it.
    """
    if "num_key_value_heads" in cfg:
        value = cfg["num_key_value_heads"]
    else:
        value = default
    if value:
        return value
    return cfg["num_attention_heads"] if heads_default is None else cfg.get("num_attention_heads", heads_default)


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
    """MistralConfig (transformers 5.23 configuration_mistral.py: ``sliding_window: int | None = 4096``): the window
    the file sets, 4096 where the key is absent, none where it is null; on every layer (``MistralModel.forward``
    builds one mask for all of them, ``create_sliding_window_causal_mask`` when the window is set)."""
    fields = _llama_like(
        cfg, "mistral", qkv_bias=False, tied_default=False, kv_heads_default=8, positions_default=4096 * 32
    )
    fields.update(_window(cfg, 4096))
    return fields


def _window(cfg: Config, default: int | None) -> dict[str, Any]:
    """Mistral's and Mixtral's ``sliding_window`` as the spec's fields (one window on every layer, or none):
    an integer or null, as their configs type it (``int | None``: transformers 5.23's strict dataclass validation
    refuses a string or a bool); a window of 0 or less the ModelSpec refuses (no key is seen)."""
    window = cfg.get("sliding_window", default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise _bad("sliding_window", f"expected an integer number of keys or null, got {window!r}")
    return {"attention_pattern": ("sliding",) if window is not None else (), "sliding_window": window}


def _qwen_sliding(cfg: Config, num_layers: int) -> dict[str, Any]:
    """Qwen2Config / Qwen3Config.__post_init__: sliding layers only with use_sliding_window, from max_window_layers
    on (default 28)."""
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    first = cfg.get("max_window_layers", 28)
    default = [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
    ]
    return _sliding({**cfg, "sliding_window": window}, cfg.get("layer_types") or default, num_layers, None)


def _qwen2(cfg: Config) -> dict[str, Any]:
    # Qwen2Attention: q/k/v always carry a bias, o_proj never does.
    fields = _llama_like(cfg, "qwen2", qkv_bias=True, tied_default=False, kv_heads_default=32, positions_default=32768)
    fields.update(_qwen_sliding(cfg, cfg["num_hidden_layers"]))
    return fields


def _mixtral(cfg: Config) -> dict[str, Any]:
    """MixtralConfig (transformers 5.23 configuration_mixtral.py: ``sliding_window: int | None = None``): Mistral's
    layer with the sparse block; the window the file sets (null in Mixtral-8x7B's), none where the key is absent,
    on every layer as Mistral's (``MixtralModel.forward``, modeling_mixtral.py:443: one mask,
    ``create_sliding_window_causal_mask`` when the window is set; ``MixtralAttention`` passes it to the kernel)."""
    fields = _llama_like(
        cfg, "mixtral", qkv_bias=False, tied_default=False, kv_heads_default=8, positions_default=4096 * 32
    )
    fields.update(_window(cfg, None))
    fields["moe"] = MoESpec(
        num_experts=cfg.get("num_local_experts", 8),
        top_k=cfg.get("num_experts_per_tok", 2),
        expert_ffn_size=cfg["intermediate_size"],
        norm_topk_prob=True,  # MixtralTopKRouter.forward always divides by the top-k sum
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
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # Qwen2MoeConfig's default
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
        # transformers 5.x writes the count as num_local_experts (Qwen3MoeConfig.attribute_map)
        num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 128)),
        top_k=cfg.get("num_experts_per_tok", 8),
        expert_ffn_size=cfg.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
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


def _qwen3(cfg: Config) -> dict[str, Any]:
    """Qwen3Config: head_dim 128 and 32 KV heads by default; attention_bias on q, k, v and o; QK RMSNorm per head."""
    bias = bool(cfg.get("attention_bias", False))
    fields = _llama_like(cfg, "qwen3", qkv_bias=bias, tied_default=False, kv_heads_default=32, positions_default=32768)
    fields.update(attn_out_bias=bias, qk_norm=True, head_dim=cfg.get("head_dim", 128))
    fields.update(_qwen_sliding(cfg, cfg["num_hidden_layers"]))
    return fields


_GEMMA_DEFAULTS = {  # Gemma2Config / Gemma3TextConfig class defaults
    "gemma2": {"vocab_size": 256000, "max_position_embeddings": 8192, "attn": 50.0, "final": 30.0, "pattern": 2},
    "gemma3": {"vocab_size": 262208, "max_position_embeddings": 131072, "attn": None, "final": None, "pattern": 6},
}


def _gemma(cfg: Config, version: str, *, tied: bool | None = None) -> dict[str, Any]:
    """Gemma 2 / Gemma 3 text: head_dim 256, sandwich norms, gelu_tanh, tied embeddings, sliding layers.

    Gemma 2 alternates sliding and full layers and soft-caps attention scores (50) and logits (30); Gemma 3
    has 5 sliding layers per full one (sliding_window_pattern), QK RMSNorm per head and no soft-capping. The
    MLP reads hidden_activation (a hidden_act key beside it is ignored by transformers, and here).
    """
    defaults = _GEMMA_DEFAULTS[version]
    _no_bidirectional(cfg)
    bias = bool(cfg.get("attention_bias", False))
    num_layers = cfg.get("num_hidden_layers", 26)
    period = defaults["pattern"] if version == "gemma2" else cfg.get("sliding_window_pattern", 6)
    default_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
    return {
        "architecture": version,
        "hidden_size": cfg.get("hidden_size", 2304),
        "num_layers": num_layers,
        "num_attention_heads": cfg.get("num_attention_heads", 8),
        "num_kv_heads": _kv_heads(cfg, 4, 8),
        "head_dim": cfg.get("head_dim", 256),
        "ffn_size": cfg.get("intermediate_size", 9216),
        "mlp": "gated",
        "activation": _activation(cfg.get("hidden_activation", "gelu_pytorch_tanh")),
        "norm": "rmsnorm",
        "layer_norms": "sandwich",
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "qk_norm": version == "gemma3",
        "vocab_size": cfg.get("vocab_size", defaults["vocab_size"]),
        "tied_embeddings": cfg.get("tie_word_embeddings", True) if tied is None else tied,
        "position_embedding": "rope",
        "max_position_embeddings": cfg.get("max_position_embeddings", defaults["max_position_embeddings"]),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", defaults["attn"]),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", defaults["final"]),
        **_sliding(cfg, cfg.get("layer_types") or default_types, num_layers, 4096),
    }


def _gemma2(cfg: Config) -> dict[str, Any]:
    return _gemma(cfg, "gemma2")


def _gemma3_text(cfg: Config) -> dict[str, Any]:
    return _gemma(cfg, "gemma3")


def _text_model(cfg: Config, read: Callable[[Config], dict[str, Any]], arch: str) -> dict[str, Any]:
    """The text model of a multimodal config.json (its text_config); the vision tower is not counted."""
    text = cfg.get("text_config") or {}  # None: the text config class defaults
    if not isinstance(text, dict):
        raise _bad("text_config", f"expected a mapping, got {type(text).__name__}")
    try:
        fields = read(text)
    except KeyError as exc:
        raise KeyError(f"text_config.{exc.args[0]}") from None
    fields["source"] = f"text model only: text_config of {arch}, no vision tower or projector"
    return fields


def _gemma3_multimodal(cfg: Config) -> dict[str, Any]:
    # Gemma3ForConditionalGeneration ties its lm_head by the top-level tie_word_embeddings (default true).
    tied = cfg.get("tie_word_embeddings", True)
    return _text_model(cfg, lambda text: _gemma(text, "gemma3", tied=tied), "Gemma3ForConditionalGeneration")


def _rotary_fraction(cfg: Config) -> float:
    """partial_rotary_factor, at the top level or inside rope_parameters / rope_scaling (Phi-4-mini 0.75)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return float(cfg.get("partial_rotary_factor", 1.0))
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def _phi3(cfg: Config) -> dict[str, Any]:
    """Phi3Config: fused qkv_proj and gate_up_proj (same counts as separate matrices), no biases, one window."""
    if cfg.get("attention_bias"):
        raise _bad("attention_bias", "transformers' Phi3 builds its qkv_proj and o_proj without biases")
    window = cfg.get("sliding_window")  # Phi3Config default None; Phi-3-mini 2047, on every layer
    return {
        "architecture": "phi3",
        "hidden_size": cfg.get("hidden_size", 3072),
        "num_layers": cfg.get("num_hidden_layers", 32),
        "num_attention_heads": cfg.get("num_attention_heads", 32),
        "num_kv_heads": _kv_heads(cfg, None, 32),
        "head_dim": _head_dim(cfg),  # not a Phi3Config field, but Phi3Attention reads one if the file has it
        "ffn_size": cfg.get("intermediate_size", 8192),
        "mlp": "gated",
        "activation": _activation(cfg.get("hidden_act", "silu")),
        "norm": "rmsnorm",
        "fused_qkv": True,
        "fused_gate_up": True,
        "vocab_size": cfg.get("vocab_size", 32064),
        "tied_embeddings": cfg.get("tie_word_embeddings", False),
        "position_embedding": "rope",
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "partial_rotary_factor": _rotary_fraction(cfg),
        "attention_pattern": ("sliding",) if window is not None else (),
        "sliding_window": window,
    }


_DEEPSEEK_DEFAULTS = {  # DeepseekV2Config / DeepseekV3Config class defaults
    "deepseek-v2": {
        "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "max_position_embeddings": 2048,
        "n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1407, "first_k_dense_replace": 0,
        "num_experts_per_tok": None,
    },
    "deepseek-v3": {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
        "num_attention_heads": 128, "max_position_embeddings": 4096,
        "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
        "num_experts_per_tok": 8,
    },
}  # fmt: skip


def _deepseek(cfg: Config, version: str) -> dict[str, Any]:
    """DeepSeek-V2 / V3 as transformers builds them: MLA attention, dense MLPs in the first
    first_k_dense_replace layers, then MoE with n_shared_experts shared experts fused into one MLP of
    n_shared_experts x moe_intermediate_size. n_group / topk_group / topk_method only steer routing.
    """
    d = {**_DEEPSEEK_DEFAULTS[version], **cfg}
    # num_key_value_heads is left out: kv_b_proj gives every attention head its own key and value, and the cache
    # holds the latent (DeepseekV2Attention reads the field only for repeat_kv's group count).
    heads = d["num_attention_heads"]
    if d.get("moe_layer_freq", 1) != 1:
        raise _bad("moe_layer_freq", "transformers builds MoE on every layer from first_k_dense_replace on; only 1")
    if d.get("mlp_bias"):
        raise _bad("mlp_bias", "biases on the dense and shared MLPs but not the routed experts are not modelled")
    if d["num_experts_per_tok"] is None:
        raise KeyError("num_experts_per_tok")
    bias = bool(d.get("attention_bias", False))
    # a mapping, not an MLASpec: ModelSpec validates it, so an error names mla.<field> (the config.json key)
    mla = {
        "q_lora_rank": d.get("q_lora_rank", 1536),
        "kv_lora_rank": d.get("kv_lora_rank", 512),
        "qk_nope_head_dim": d.get("qk_nope_head_dim", 128),
        "qk_rope_head_dim": d.get("qk_rope_head_dim", 64),
        "v_head_dim": d.get("v_head_dim", 128),
        "down_proj_bias": bias,
        "rope_interleave": version == "deepseek-v3" and bool(d.get("rope_interleave", True)),
    }
    shared, num_layers = d["n_shared_experts"] or 0, d["num_hidden_layers"]
    moe = MoESpec(
        num_experts=d["n_routed_experts"],
        top_k=d["num_experts_per_tok"],
        expert_ffn_size=d["moe_intermediate_size"],
        num_shared_experts=1 if shared else 0,
        shared_expert_ffn_size=shared * d["moe_intermediate_size"] or None,
        dense_layers=tuple(range(min(d["first_k_dense_replace"], num_layers))),
        router_score_bias=version == "deepseek-v3",
        # DeepseekV3Config: norm_topk_prob True, n_group 8, topk_group 4 by default; V2's router never renormalises
        norm_topk_prob=version == "deepseek-v3" and bool(d.get("norm_topk_prob", True)),
        **_deepseek_groups(d, version),
    )
    return {
        "architecture": version,
        "hidden_size": d["hidden_size"],
        "num_layers": num_layers,
        "num_attention_heads": heads,
        "num_kv_heads": heads,
        "head_dim": mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
        "ffn_size": d["intermediate_size"],
        "mlp": "gated",
        "activation": _activation(d.get("hidden_act", "silu")),
        "norm": "rmsnorm",
        "attn_out_bias": bias,
        "vocab_size": d["vocab_size"],
        "tied_embeddings": d.get("tie_word_embeddings", False),
        "position_embedding": "rope",
        "max_position_embeddings": d["max_position_embeddings"],
        "moe": moe,
        "mla": mla,
        # DeepseekV3Config.num_mtp_layers (num_nextn_predict_layers in the file), default 1; V2 has none
        "num_mtp_layers": d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 1))
        if version == "deepseek-v3"
        else 0,
    }


def _deepseek_groups(d: dict, version: str) -> dict[str, int]:
    """The router's expert groups: V3's always (``n_group``, ``topk_group``); V2's under ``topk_method:
    group_limited_greedy`` (``DeepseekV2TopkRouter.forward``), none under ``greedy`` (its default). V2's
    group-limited routing over one group picks as greedy does and is read as greedy (the op-level run leaves
    out its T x E mask temporaries)."""
    if version == "deepseek-v3":
        return {"router_groups": d.get("n_group") or 8, "router_topk_groups": d.get("topk_group") or 4}
    if d.get("topk_method", "greedy") != "group_limited_greedy":
        return {"router_groups": 1, "router_topk_groups": 1}
    return {"router_groups": d.get("n_group") or 1, "router_topk_groups": d.get("topk_group") or 1}


def _deepseek_v2(cfg: Config) -> dict[str, Any]:
    return _deepseek(cfg, "deepseek-v2")


def _deepseek_v3(cfg: Config) -> dict[str, Any]:
    return _deepseek(cfg, "deepseek-v3")


def _olmo2(cfg: Config) -> dict[str, Any]:
    """Olmo2Config: no pre-norms, RMSNorm on the attention and MLP outputs, QK RMSNorm over the full width."""
    bias = bool(cfg.get("attention_bias", False))
    return {
        "architecture": "olmo2",
        "hidden_size": cfg.get("hidden_size", 4096),
        "num_layers": cfg.get("num_hidden_layers", 32),
        "num_attention_heads": cfg.get("num_attention_heads", 32),
        "num_kv_heads": _kv_heads(cfg, None, 32),
        "head_dim": _head_dim(cfg),  # read by Olmo2Attention when the file has one
        "ffn_size": cfg.get("intermediate_size", 11008),
        "mlp": "gated",
        "activation": _activation(cfg.get("hidden_act", "silu")),
        "norm": "rmsnorm",
        "layer_norms": "post",
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "qk_norm": True,
        "qk_norm_scope": "full",
        "vocab_size": cfg.get("vocab_size", 50304),
        "tied_embeddings": cfg.get("tie_word_embeddings", False),
        "position_embedding": "rope",
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
    }


def _llama4_layers(cfg: Config, num_layers: int) -> tuple[list[bool], list[str], list[int]]:
    """Llama4TextConfig.__post_init__: which layers use RoPE, their attention kinds, which are MoE."""
    interval = cfg.get("no_rope_layer_interval", 4)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]  # 1: RoPE
    if not isinstance(rope, list) or len(rope) != num_layers:
        raise _bad("no_rope_layers", f"expected a list of {num_layers} flags (1: the layer uses RoPE)")
    types = cfg.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in rope]
    step = cfg.get("interleave_moe_layer_step", 1)
    moe_layers = cfg.get("moe_layers")
    moe_layers = list(range(step - 1, num_layers, step)) if moe_layers is None else moe_layers
    bad = [i for i in moe_layers if not 0 <= i < num_layers]
    if bad:
        raise _bad("moe_layers", f"layer {bad[0]} outside 0..{num_layers - 1}")
    return [bool(r) for r in rope], types, moe_layers


def _llama4_text(cfg: Config) -> dict[str, Any]:
    """Llama4TextConfig: MoE layers (routed experts with one fused gate_up tensor, one shared expert of the
    expert width) interleaved with dense MLPs of intermediate_size_mlp; chunked attention on RoPE layers, full
    attention on the NoPE ones; a weightless L2 QK norm (use_qk_norm) on the RoPE layers.
    """
    num_layers = cfg.get("num_hidden_layers", 48)
    rope, types, moe_layers = _llama4_layers(cfg, num_layers)
    chunk = cfg.get("attention_chunk_size", 8192)
    pattern = _attention_pattern(types, num_layers, ("full_attention", "chunked_attention"), None)
    if "chunked" in pattern and chunk is None:
        raise _bad("attention_chunk_size", "layer_types has chunked_attention layers; give their chunk size")
    moe_set = set(moe_layers)
    step = cfg.get("interleave_moe_layer_step", 1)
    regular = moe_set == {i for i in range(num_layers) if (i + 1) % step == 0}
    heads = cfg.get("num_attention_heads", 40)
    bias = bool(cfg.get("attention_bias", False))
    return {
        "architecture": "llama4",
        "hidden_size": cfg.get("hidden_size", 5120),
        "num_layers": num_layers,
        "num_attention_heads": heads,
        "num_kv_heads": _kv_heads(cfg, 8, 40),
        "head_dim": cfg.get("head_dim", 128) or None,
        "ffn_size": cfg.get("intermediate_size_mlp", 16384),
        "mlp": "gated",
        "activation": _activation(cfg.get("hidden_act", "silu")),
        "norm": "rmsnorm",
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "qk_norm": bool(cfg.get("use_qk_norm", True)),
        "qk_norm_weight": False,
        "vocab_size": cfg.get("vocab_size", 202048),
        "tied_embeddings": cfg.get("tie_word_embeddings", False),
        "position_embedding": "rope",
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096 * 32),
        "rope_pattern": () if all(rope) else _period(rope),
        "attention_pattern": pattern,
        "attention_chunk_size": chunk if "chunked" in pattern else None,
        "moe": MoESpec(
            num_experts=cfg.get("num_local_experts", 16),
            top_k=cfg.get("num_experts_per_tok", 1),
            expert_ffn_size=cfg.get("intermediate_size", 8192),
            num_shared_experts=1,
            layer_freq=step if regular else 1,
            dense_layers=() if regular else tuple(i for i in range(num_layers) if i not in moe_set),
            fused_gate_up=True,
        ),
    }


def _llama4_multimodal(cfg: Config) -> dict[str, Any]:
    # Llama4ForConditionalGeneration's language model is a Llama4ForCausalLM(text_config): the text config's own
    # tie_word_embeddings decides, not the top-level one.
    return _text_model(cfg, _llama4_text, "Llama4ForConditionalGeneration")


READERS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "GPT2LMHeadModel": _gpt2,
    "GPTNeoXForCausalLM": _gpt_neox,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3_text,
    "Gemma3ForConditionalGeneration": _gemma3_multimodal,
    "Phi3ForCausalLM": _phi3,
    "DeepseekV2ForCausalLM": _deepseek_v2,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "Olmo2ForCausalLM": _olmo2,
    "Llama4ForCausalLM": _llama4_text,
    "Llama4ForConditionalGeneration": _llama4_multimodal,
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
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
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
    "Qwen3ForCausalLM": _LLAMA_KEYS,
    "Gemma2ForCausalLM": {**_LLAMA_KEYS, "activation": "hidden_activation"},
    "Gemma3ForCausalLM": {**_LLAMA_KEYS, "activation": "hidden_activation"},
    "Phi3ForCausalLM": _LLAMA_KEYS,
    "Olmo2ForCausalLM": _LLAMA_KEYS,
    "DeepseekV2ForCausalLM": {
        **_LLAMA_KEYS,
        "moe.num_experts": "n_routed_experts",
        "moe.top_k": "num_experts_per_tok",
        "moe.expert_ffn_size": "moe_intermediate_size",
        "moe.shared_expert_ffn_size": "n_shared_experts",
        "moe.dense_layers": "first_k_dense_replace",
        "mla.q_lora_rank": "q_lora_rank",
        "mla.kv_lora_rank": "kv_lora_rank",
        "mla.qk_nope_head_dim": "qk_nope_head_dim",
        "mla.qk_rope_head_dim": "qk_rope_head_dim",
        "mla.v_head_dim": "v_head_dim",
        "head_dim": "qk_nope_head_dim",
        "num_mtp_layers": "num_nextn_predict_layers",
    },
    "Llama4ForCausalLM": {
        **_LLAMA_KEYS,
        "ffn_size": "intermediate_size_mlp",
        "moe.num_experts": "num_local_experts",
        "moe.top_k": "num_experts_per_tok",
        "moe.expert_ffn_size": "intermediate_size",
        "moe.layer_freq": "interleave_moe_layer_step",
        "moe.dense_layers": "moe_layers",
        "rope_pattern": "no_rope_layers",
        "attention_pattern": "layer_types",
    },
}
_HF_KEYS["DeepseekV3ForCausalLM"] = {
    **_HF_KEYS["DeepseekV2ForCausalLM"],
    "moe.router_groups": "n_group",
    "moe.router_topk_groups": "topk_group",
    "moe.norm_topk_prob": "norm_topk_prob",
    "mla.rope_interleave": "rope_interleave",
}
for _arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
    _HF_KEYS[_arch] |= {"attention_pattern": "layer_types"}
_HF_KEYS["Qwen3ForCausalLM"] = {**_LLAMA_KEYS, "attention_pattern": "layer_types"}

# Multimodal config.jsons: the text model's fields live under text_config (but Gemma 3 ties by the top level).
_TEXT_CLASS = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}
_TOP_LEVEL = {"Gemma3ForConditionalGeneration": {"tied_embeddings"}}


def hf_key(architecture: str, field: str) -> str:
    """The config.json key a ModelSpec field (dotted path) is read from; the field itself if none differs."""
    if architecture in _TEXT_CLASS:
        key = hf_key(_TEXT_CLASS[architecture], field)
        if not field or field in _TOP_LEVEL.get(architecture, set()) or field.split(".")[0] in ("text_config",):
            return key
        return f"text_config.{key}"
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
    fields = READERS[hf_architecture(cfg)](cfg)
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        fields["checkpoint_quantization"] = str(quant["quant_method"])
    return fields
