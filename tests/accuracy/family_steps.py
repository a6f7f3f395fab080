"""Tiny configurations of the families memplan reads beyond Llama / Mistral / Qwen2 (docs/models.md),
run as real transformers training steps on CPU by hf_steps (both loops, fp32 and bf16, with and
without gradient checkpointing).

Each keeps what makes its family different: Qwen3's and Gemma 3's per-head QK norms, OLMo 2's
post-norms and full-width QK norms, Phi-3's fused projections, Gemma 2's eager soft-capped
attention, sliding layers and capped logits, Gemma 3's sliding layers (the sequence reaches the
window, so transformers passes SDPA a mask), DeepSeek's multi-head latent attention with shared
and routed experts after a dense first layer, Llama 4's chunked attention, NoPE layers and
interleaved MoE.
"""

from __future__ import annotations

import dataclasses

from hf_steps import Case

TINY = dict(hidden=128, heads=4, kv_heads=2, ffn=344, vocab=2000, batch=2, seq=128, layers=2)
_MLA = (("kv_lora_rank", 32), ("qk_nope_head_dim", 32), ("qk_rope_head_dim", 16), ("v_head_dim", 32))
_DEEPSEEK_MOE = (
    ("n_routed_experts", 4),
    ("n_shared_experts", 1),
    ("num_experts_per_tok", 2),
    ("moe_intermediate_size", 64),
    ("first_k_dense_replace", 1),
)
_GEMMA = (("head_dim", 32), ("sliding_window", 64), ("query_pre_attn_scalar", 32))

BASE = [
    Case("qwen3", arch="qwen3", **TINY, extra=(("head_dim", 32),)),
    Case("olmo2", arch="olmo2", **TINY),
    Case("phi3", arch="phi3", **TINY, extra=(("pad_token_id", 0),)),  # its default pad id 32000 is outside the vocab
    # transformers refuses SDPA for Gemma 2 (soft-capped scores): eager
    Case("gemma2", arch="gemma2", attention="eager", **TINY, extra=_GEMMA),
    Case("gemma3", arch="gemma3", **TINY, extra=_GEMMA),
    # MLA gives every head its own key and value; DeepSeek's head_dim is the RoPE part
    Case(
        "deepseek-v2",
        arch="deepseek_v2",
        **{**TINY, "kv_heads": 4},
        extra=(("q_lora_rank", None), *_MLA, *_DEEPSEEK_MOE, ("head_dim", 16)),
    ),
    Case(
        "deepseek-v3",
        arch="deepseek_v3",
        **{**TINY, "kv_heads": 4},
        extra=(("q_lora_rank", 48), *_MLA, *_DEEPSEEK_MOE, ("n_group", 1), ("topk_group", 1), ("head_dim", 16)),
    ),
    Case(
        "llama4",
        arch="llama4",
        **TINY,
        extra=(
            ("head_dim", 32),
            ("num_local_experts", 4),
            ("intermediate_size_mlp", 344),
            ("interleave_moe_layer_step", 2),
            ("attention_chunk_size", 64),
        ),
    ),
]


def variants(case: Case) -> list[Case]:
    """fp32 and bf16, with and without checkpointing, each through both loops."""
    out = []
    for dtype, ckpt in (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)):
        tag = ("fp32" if dtype == "float32" else "bf16") + ("-ckpt" if ckpt else "")
        for loop in ("hand", "trainer"):
            name = f"{'trainer-' if loop == 'trainer' else ''}{case.name}-{tag}"
            # the default suite keeps four per family (both loops, both dtypes, checkpointing on and off:
            # hand fp32, Trainer bf16, hand bf16 checkpointed, Trainer fp32 checkpointed); -m slow the rest
            slow = (
                (loop == "trainer") == (dtype == "float32") if not ckpt else (loop == "trainer") != (dtype == "float32")
            )
            out.append(dataclasses.replace(case, name=name, dtype=dtype, checkpointing=ckpt, loop=loop, slow=slow))
    return out


# bf16-mixed (autocast over fp32, the Trainer's bf16=True) for each family, and two shapes that move
# the masks: Phi-3 with a window the sequence reaches (its fused k / v repeated under the mask), Gemma 3
# without GQA (the mask alone)
EXTRA = [
    *(dataclasses.replace(c, name=f"{c.name}-autocast", autocast=True) for c in BASE),
    Case("phi3-window", arch="phi3", **TINY, extra=(("pad_token_id", 0), ("sliding_window", 64))),
    Case("gemma3-mha", arch="gemma3", **{**TINY, "kv_heads": 4}, extra=_GEMMA),
]
CASES = [v for c in BASE for v in variants(c)] + [
    dataclasses.replace(
        c,
        name=f"{'trainer-' if loop == 'trainer' else ''}{c.name}",
        loop=loop,
        slow=loop == "trainer" or "autocast" in c.name,
    )
    for c in EXTRA
    for loop in ("hand", "trainer")
]
