"""Model spec: decoder-only transformers (Llama / Mistral / Qwen / Gemma / Phi-3 / OLMo 2 / GPT), MoE and MLA."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_MAX_DIM = 10**7  # no real transformer has a hidden size, FFN size or vocabulary above this

AttentionKind = Literal["full", "sliding", "chunked"]


class MoESpec(BaseModel):
    """Mixture-of-experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_experts: int = Field(gt=1, le=4096, description="Routed experts per MoE layer.")
    top_k: int = Field(gt=0, le=256, description="Routed experts each token is sent to.")
    expert_ffn_size: int = Field(gt=0, le=_MAX_DIM, description="Intermediate size of one routed expert.")
    num_shared_experts: int = Field(0, ge=0, le=64, description="Always-active shared experts.")
    shared_expert_ffn_size: int | None = Field(
        None, gt=0, le=_MAX_DIM, description="Intermediate size of each shared expert (default: expert_ffn_size)."
    )
    shared_expert_gate: bool = Field(
        False, description="A sigmoid gate (hidden -> 1) on the shared expert (Qwen2-MoE)."
    )
    router_bias: bool = Field(False, description="The router linear has a bias.")
    norm_topk_prob: bool = Field(
        False,
        description="The top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen2/3-MoE "
        "norm_topk_prob): the in-place division transformers' op-level run follows (timeline/hf_moe.py).",
    )
    router_score_bias: bool = Field(
        False,
        description="A per-expert score-correction bias steers the routing (DeepSeek-V3 e_score_correction_bias): "
        "num_experts elements per MoE layer, a persistent buffer in transformers (no gradient), not a parameter.",
    )
    fused_gate_up: bool = Field(
        False, description="Routed experts hold gate and up as one [E, h, 2f] tensor (Llama 4); same count."
    )
    router_groups: int = Field(
        1,
        gt=0,
        le=4096,
        description="Expert groups the router picks from (DeepSeek-V3 n_group): the group scores' width in "
        "transformers' op-level run (timeline/hf_mla.py).",
    )
    router_topk_groups: int = Field(
        1, gt=0, le=4096, description="Groups each token's experts come from (DeepSeek-V3 topk_group)."
    )
    layer_freq: int = Field(1, gt=0, description="Every layer_freq-th layer is MoE (Qwen2-MoE decoder_sparse_step).")
    dense_layers: tuple[int, ...] = Field(
        (), description="Layer indices that keep a dense MLP (Qwen mlp_only_layers, DeepSeek first_k_dense)."
    )

    # A validator's message starts with the field it blames ("top_k: ..."); the loader turns that
    # prefix into the field path of the error.
    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.num_experts % self.router_groups:
            raise ValueError(
                f"router_groups: num_experts ({self.num_experts}) is not a multiple of router_groups "
                f"({self.router_groups})"
            )
        if self.router_topk_groups > self.router_groups:
            raise ValueError(
                f"router_topk_groups: router_topk_groups ({self.router_topk_groups}) exceeds router_groups "
                f"({self.router_groups})"
            )
        return self

    @property
    def shared_ffn_size(self) -> int:
        return self.shared_expert_ffn_size or self.expert_ffn_size


class MLASpec(BaseModel):
    """Multi-head latent attention (DeepSeek-V2 / V3): low-rank queries and one compressed KV latent per token.

    Per layer: q_a_proj h x q_lora_rank, its RMSNorm and q_b_proj q_lora_rank x heads*(nope + rope) (or one
    q_proj h x heads*(nope + rope) when q_lora_rank is None); kv_a_proj_with_mqa h x (kv_lora_rank + rope), its
    RMSNorm over kv_lora_rank, kv_b_proj kv_lora_rank x heads*(nope + v); o_proj heads*v x h. The KV cache holds
    the latent and the shared RoPE key: kv_lora_rank + qk_rope_head_dim per token (DeepSeek-V2 paper, section 2.1).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_lora_rank: int | None = Field(
        None, gt=0, le=_MAX_DIM, description="Rank of the query down-projection; None: one plain q_proj."
    )
    kv_lora_rank: int = Field(gt=0, le=_MAX_DIM, description="Width of the compressed KV latent.")
    qk_nope_head_dim: int = Field(ge=0, le=100_000, description="Per-head query / key width without RoPE.")
    qk_rope_head_dim: int = Field(gt=0, le=100_000, description="Per-head query / key width with RoPE (key shared).")
    v_head_dim: int = Field(gt=0, le=100_000, description="Per-head value width.")
    down_proj_bias: bool = Field(
        False, description="q_a_proj and kv_a_proj_with_mqa carry biases (config.json attention_bias)."
    )
    rope_interleave: bool = Field(
        False,
        description="RoPE over interleaved pairs (DeepSeek-V3 rope_interleave, its default): transformers' "
        "apply_rotary_pos_emb_interleave, on the even and odd slices (timeline/hf_mla.py).",
    )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Elements one token keeps in one layer's KV cache: the latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class ModelSpec(BaseModel):
    """A decoder-only transformer, as much of it as memory and time depend on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Short name, e.g. 'llama3-8b'.")
    architecture: str = Field("llama", description="Family it follows (llama, mistral, qwen2, gpt2, gpt-neox, ...).")
    hidden_size: int = Field(gt=0, le=_MAX_DIM)
    num_layers: int = Field(gt=0, le=10_000)
    num_attention_heads: int = Field(gt=0, le=10_000)
    num_kv_heads: int | None = Field(
        None, gt=0, le=10_000, description="KV heads (GQA / MQA); default: attention heads."
    )
    head_dim: int | None = Field(None, gt=0, le=100_000, description="Default: hidden_size / attention heads.")
    ffn_size: int = Field(gt=0, le=_MAX_DIM, description="Dense MLP intermediate size.")
    mlp: Literal["gated", "plain"] = Field("gated", description="gated: SwiGLU (3 matrices); plain: up/down (2).")
    activation: Literal["silu", "gelu", "gelu_new", "gelu_tanh", "relu"] = "silu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    qkv_bias: bool = Field(False, description="Biases on Q/K/V projections (Qwen2, GPT-2, GPT-NeoX).")
    attn_out_bias: bool = Field(False, description="Bias on the attention output projection (GPT-2, GPT-NeoX).")
    mlp_bias: bool = Field(False, description="Biases in the MLP (GPT-2, GPT-NeoX).")
    qk_norm: bool = Field(False, description="A norm on queries and keys (Qwen3, Gemma 3, OLMo 2, Llama 4).")
    qk_norm_scope: Literal["head", "full"] = Field(
        "head",
        description="head: one norm of head_dim shared by all heads (Qwen3, Gemma 3); full: one norm over the "
        "whole projection, q_size for queries and kv_size for keys (OLMo 2).",
    )
    qk_norm_weight: bool = Field(
        True, description="The QK norm holds a weight (RMSNorm); false: a weightless L2 norm (Llama 4)."
    )
    layer_norms: Literal["pre", "sandwich", "post"] = Field(
        "pre",
        description="Norms per layer. pre: before attention and before the MLP (2); sandwich: before and after "
        "each (4, Gemma 2 / 3); post: on the attention and MLP outputs before the residual add (2, OLMo 2).",
    )
    fused_qkv: bool = Field(False, description="Q, K and V are one matrix (Phi-3 qkv_proj); same count.")
    fused_gate_up: bool = Field(False, description="The MLP's gate and up are one matrix (Phi-3 gate_up_proj).")
    vocab_size: int = Field(gt=0, le=_MAX_DIM)
    tied_embeddings: bool = Field(False, description="LM head shares the input embedding matrix.")
    position_embedding: Literal["rope", "learned", "alibi", "none"] = "rope"
    max_position_embeddings: int = Field(4096, gt=0, le=100_000_000)
    partial_rotary_factor: float = Field(
        1.0, gt=0, le=1, description="Fraction of each head's width RoPE rotates (Phi-4-mini 0.75)."
    )
    rope_pattern: tuple[bool, ...] = Field(
        (),
        description="Whether layer i applies RoPE: rope_pattern[i % len], repeated over the layers; empty: every "
        "layer (Llama 4: three RoPE layers, then one without (NoPE)).",
    )
    attention_pattern: tuple[AttentionKind, ...] = Field(
        (),
        description="Attention of layer i: attention_pattern[i % len], repeated over the layers; empty: every layer "
        "full causal (Gemma 2: sliding, full; Gemma 3: 5 sliding, 1 full; Llama 4: 3 chunked, 1 full).",
    )
    sliding_window: int | None = Field(
        None, gt=0, le=100_000_000, description="Keys a query of a sliding layer sees (config.json sliding_window)."
    )
    attention_chunk_size: int | None = Field(
        None, gt=0, le=100_000_000, description="Chunk length of a chunked layer: a query sees keys of its chunk only."
    )
    attn_logit_softcapping: float | None = Field(
        None, gt=0, description="Attention scores become cap * tanh(score / cap) (Gemma 2)."
    )
    final_logit_softcapping: float | None = Field(
        None, gt=0, description="Output logits become cap * tanh(logit / cap) (Gemma 2)."
    )
    moe: MoESpec | None = None
    mla: MLASpec | None = Field(None, description="Multi-head latent attention (DeepSeek-V2 / V3) instead of Q/K/V.")
    num_mtp_layers: int = Field(
        0,
        ge=0,
        le=100,
        description="Multi-token-prediction modules in the published checkpoint (DeepSeek-V3: 1); transformers "
        "builds none, and they are not counted.",
    )
    checkpoint_quantization: str | None = Field(
        None,
        description="quant_method of the published weights (config.json quantization_config, e.g. fp8); memory "
        "follows the plan's precision and quant, not this.",
    )
    random_init: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The checkpoint holds its random initialisation: weights normal(0, this std), norms at their "
        "initial value (a model built from_config and saved, as tests and benchmarks without a hub make them; "
        "read from a model folder's safetensors, or the live model in MemplanCallback). What the weights' values "
        "set follows it: LLM.int8's outlier columns on CUDA (int8_outliers.RandomInit). None: trained weights.",
    )
    source: str | None = Field(None, description="Where the figures come from (a config.json, a paper).")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_kv_heads ({self.kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size: hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); give head_dim"
            )
        if self.moe is not None:
            bad = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"moe.dense_layers: index {bad[0]} outside 0..{self.num_layers - 1}")
        self._check_attention()
        return self

    def _check_attention(self) -> None:
        for name, pattern in (("attention_pattern", self.attention_pattern), ("rope_pattern", self.rope_pattern)):
            if len(pattern) > self.num_layers:
                raise ValueError(f"{name}: {len(pattern)} entries for {self.num_layers} layers")
        if "sliding" in self.attention_pattern and self.sliding_window is None:
            raise ValueError("sliding_window: attention_pattern has sliding layers; give their window")
        if "chunked" in self.attention_pattern and self.attention_chunk_size is None:
            raise ValueError("attention_chunk_size: attention_pattern has chunked layers; give their chunk size")
        if self.mla is not None:
            if self.head_dim != self.mla.qk_head_dim:
                raise ValueError(
                    f"head_dim: MLA's query / key head is qk_nope_head_dim + qk_rope_head_dim "
                    f"({self.mla.qk_head_dim}), got {self.head_dim}"
                )
            if self.kv_heads != self.num_attention_heads:
                raise ValueError("num_kv_heads: MLA expands the latent to one key / value per attention head")
            if self.qk_norm or self.fused_qkv or self.qkv_bias:
                raise ValueError("mla: MLA has no Q/K/V projections for qk_norm, fused_qkv or qkv_bias")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection output: heads x head_dim."""
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of one of the key / value projection outputs: kv_heads x head_dim."""
        return self.kv_heads * self.head_size

    def is_moe_layer(self, index: int) -> bool:
        """Qwen2-MoE rule: MoE where (index + 1) % layer_freq == 0 and not in dense_layers."""
        if self.moe is None:
            return False
        return (index + 1) % self.moe.layer_freq == 0 and index not in self.moe.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def norms_per_layer(self) -> int:
        """Hidden-width norms in one layer: 4 for sandwich norms (Gemma 2 / 3), else 2."""
        return 4 if self.layer_norms == "sandwich" else 2

    def attention_kind(self, index: int) -> AttentionKind:
        """full, sliding or chunked attention in layer ``index``."""
        pattern = self.attention_pattern
        return pattern[index % len(pattern)] if pattern else "full"

    def attention_window(self, index: int) -> int | None:
        """Most keys a query of layer ``index`` attends to: the sliding window or chunk; None when unbounded."""
        kind = self.attention_kind(index)
        if kind == "sliding":
            return self.sliding_window
        if kind == "chunked":
            return self.attention_chunk_size
        return None

    @property
    def layer_attention_kinds(self) -> tuple[AttentionKind, ...]:
        return tuple(self.attention_kind(i) for i in range(self.num_layers))

    def uses_rope(self, index: int) -> bool:
        """Whether layer ``index`` rotates its queries and keys (Llama 4's NoPE layers do not)."""
        if self.position_embedding != "rope":
            return False
        return self.rope_pattern[index % len(self.rope_pattern)] if self.rope_pattern else True

    @property
    def v_head_size(self) -> int:
        """Per-head value width (MLA: v_head_dim; otherwise head_dim)."""
        return self.mla.v_head_dim if self.mla else self.head_size

    @property
    def attn_out_size(self) -> int:
        """Width of the attention output before o_proj: heads x value head width."""
        return self.num_attention_heads * self.v_head_size

    @property
    def kv_cache_width(self) -> int:
        """Elements one token keeps in one layer's KV cache: K and V (2 x kv_size), MLA: latent + RoPE key."""
        return self.mla.cache_width if self.mla else 2 * self.kv_size
