"""Model spec: dense decoder-only transformers (Llama / Mistral / Qwen2 / GPT) and MoE."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_MAX_DIM = 10**7  # no real transformer has a hidden size, FFN size or vocabulary above this


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
    layer_freq: int = Field(1, gt=0, description="Every layer_freq-th layer is MoE (Qwen2-MoE decoder_sparse_step).")
    dense_layers: tuple[int, ...] = Field(
        (), description="Layer indices that keep a dense MLP (Qwen mlp_only_layers, DeepSeek first_k_dense)."
    )

    # A validator's message starts with the field it blames ("top_k: ..."); the loader turns that
    # prefix into the field path of the error.
    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        return self

    @property
    def shared_ffn_size(self) -> int:
        return self.shared_expert_ffn_size or self.expert_ffn_size


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
    qk_norm: bool = Field(False, description="RMSNorm on queries and keys per head (Qwen3).")
    vocab_size: int = Field(gt=0, le=_MAX_DIM)
    tied_embeddings: bool = Field(False, description="LM head shares the input embedding matrix.")
    position_embedding: Literal["rope", "learned", "alibi", "none"] = "rope"
    max_position_embeddings: int = Field(4096, gt=0, le=100_000_000)
    moe: MoESpec | None = None
    source: str | None = Field(None, description="Where the figures come from (a config.json, a paper).")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
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
        return self

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
