"""The bundled trainer's decoder: a Llama-family transformer built from a memplan ModelSpec.

The graph follows transformers' Llama (so that the ``memplan`` runtime profile shares the
``hf`` layer accounting measured in docs/cost-model.md): RMSNorm upcast to fp32, RoPE as
``q * cos + rotate_half(q) * sin``, attention through ``scaled_dot_product_attention`` with
unrepeated GQA heads (or memplan's Triton kernel on CUDA), a gated SiLU MLP
``w2(silu(w1(x)) * w3(x))``. Layers live in a ``ModuleDict`` keyed by their global index so
that a pipeline stage keeps only its own (torchtitan's layout).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memplan.specs.model import ModelSpec
from memplan.validate.support import TrainerUnsupported, check_model  # noqa: F401 (re-exported)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: fp32 statistics, cast back, then the weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(seq: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device) -> tuple:
    """cos and sin of shape (seq, head_dim), the frequencies repeated for the two halves."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """transformers' eager path: repeated K/V, fp32 softmax cast back, scores materialised."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[-2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
    """Causal attention on (b, heads, s, head_dim) tensors, K/V heads unrepeated.

    ``flash``: ``F.scaled_dot_product_attention``, the kernel PyTorch's dispatcher picks for the
    device, dtype and shapes (``memplan.costmodel.attention.sdpa_backend`` models the choice: on
    CUDA flash for fp16/bf16, and in fp32 with GQA the math path, which keeps the s x s
    probabilities). ``triton``: memplan's Triton FlashAttention-2 (``memplan.kernels``), in any
    dtype; where it cannot run (no Triton, no CUDA GPU of compute capability 8.0+, CPU without
    ``TRITON_INTERPRET=1``) the error says so. ``eager``: scores materialised."""
    if impl == "eager":
        return _eager_attention(q, k, v)
    if impl == "triton":
        try:
            from memplan.kernels import flash_attention  # type: ignore[import-not-found]
        except ImportError as err:
            raise ValueError(
                f"attention=triton needs memplan.kernels (pip install 'memplan[kernels]'): {err}"
            ) from None
        return flash_attention(q, k, v, causal=True, backend="triton")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


FLASH_ATTENTION_OPS = frozenset(
    {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "flash_attention_forward",  # memplan.kernels (saves out and lse, like SDPA)
    }
)


def op_name(op) -> str:  # noqa: ANN001 - an OpOverload as a checkpoint policy receives it
    """``aten.mm.default`` -> ``mm``: the packet name a save list matches on."""
    return str(getattr(op, "__name__", op)).split(".")[0]


def _selective_policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    """Save-list policy of selective recomputation (Korthikanti Sec. 5): nothing the attention
    core computes is saved; the checkpoint keeps its inputs q, k, v and recomputes every op of
    the core in the backward, whichever kernel ran it. Up to 2026-11-24 only the fused SDPA ops,
    ``bmm`` and ``_softmax`` were recomputed and every other op's output saved: on SDPA's math
    path (fp32 with GQA on CUDA) that kept the scaled q and k, the repeated K/V and the
    probabilities (``_safe_softmax``), 3x what the math path keeps with no recomputation at all
    (measured on CPU, docs/cost-model.md); eager attention kept its scaled and masked scores."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context = partial(create_selective_checkpoint_contexts, _selective_policy)
    return checkpoint(attention, q, k, v, impl, use_reentrant=False, context_fn=context)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, impl: str) -> None:
        super().__init__()
        self.head_dim = spec.head_size
        self.impl = impl
        self.recompute_core = False  # selective recomputation of the attention core
        self.wq = nn.Linear(spec.hidden_size, spec.q_size, bias=spec.qkv_bias)
        self.wk = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.qkv_bias)
        self.wv = nn.Linear(spec.hidden_size, spec.kv_size, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.q_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # -1: the heads this tensor-parallel rank holds
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.recompute_core:
            out = _recomputed_attention(q, k, v, self.impl)
        else:
            out = attention(q, k, v, self.impl)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.w1 = nn.Linear(spec.hidden_size, spec.ffn_size, bias=False)
        self.w2 = nn.Linear(spec.ffn_size, spec.hidden_size, bias=False)
        self.w3 = nn.Linear(spec.hidden_size, spec.ffn_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, impl: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden_size)
        self.attention = Attention(spec, impl)
        self.ffn_norm = RMSNorm(spec.hidden_size)
        self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A whole decoder, or one pipeline chunk of it (``layer_ids``; embedding on the first
    chunk, final norm and LM head on the last). ``forward`` returns logits on the last chunk
    and the hidden states elsewhere."""

    def __init__(
        self,
        spec: ModelSpec,
        layer_ids: list[int] | None = None,
        first: bool = True,
        last: bool = True,
        attention_impl: str = "flash",
        rope_theta: float = 500000.0,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.rope_theta = rope_theta
        self.sp_degree = 1  # set by tensor parallelism with sequence parallel
        ids = range(spec.num_layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): Block(spec, attention_impl) for i in ids})
        self.norm = RMSNorm(spec.hidden_size) if last else None
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """The LM head shares the embedding matrix (tied models, on a stage holding both).
        Called again wherever a parameter is replaced: ``to_empty`` off the meta device and
        DTensor TP give each module a copy of its own."""
        if self.spec.tied_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # token ids carry the whole sequence; a received hidden state under sequence
        # parallelism holds 1 / sp_degree of it
        seq = x.shape[1] if self.tok_embeddings is not None else x.shape[1] * self.sp_degree
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        dtype = h.dtype
        cos, sin = rope_tables(seq, self.spec.head_size, self.rope_theta, dtype, h.device)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            assert self.output is not None
            h = self.output(self.norm(h))
        return h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Random weights (no checkpoint is ever loaded): normal(0, 0.02), norms at one."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                _normal_(module.weight, gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


def _normal_(weight: torch.Tensor, gen: torch.Generator) -> None:
    """normal(0, 0.02) on the local shard of a plain tensor or a DTensor (values differ per
    shard; a synthetic run needs no particular weights)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    if local.device.type == "cpu":
        local.normal_(0.0, 0.02, generator=gen)
    else:
        local.normal_(0.0, 0.02)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32 over the (b, s, V) logits; labels are pre-shifted."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
