"""Activation bytes one rank holds for one micro-batch, term by term.

Each function returns bytes for one micro-batch of ``b`` sequences of ``s`` tokens on this
rank (``s`` is already divided by context parallelism). Notation as in Korthikanti et al.
2022 (arXiv 2205.05198): h hidden, a heads, t tensor-parallel size, d bytes per activation
element; q = a * head_dim and kv = kv_heads * head_dim generalise their 3h for GQA, and f the
FFN size their 4h. The runtime profiles (``runtimes.py``) compose these terms.
"""

from __future__ import annotations

from functools import lru_cache

from memplan.costmodel.attention import math_compute_bytes, total_saved_bytes
from memplan.records import record
from memplan.specs.model import ModelSpec


@record(slots=True)
class Shape:
    """What activation sizes depend on, resolved for one rank."""

    model: ModelSpec
    b: int  # micro-batch (sequences)
    s: int  # tokens per sequence on this rank (seq_len / cp)
    span: int  # keys each query attends to (the full sequence)
    t: int  # tensor-parallel size
    sp: bool  # sequence parallel: the non-TP regions are sharded by t too
    d: int  # bytes per activation element (compute dtype)
    eager: bool  # eager attention (s x s scores kept) or flash
    dropout: bool  # dropout masks (1 byte per element) kept
    autocast: bool = False  # fp32 model under torch.autocast: fp32 residual stream, d-wide matmuls
    # the kernel scaled_dot_product_attention runs (attention.sdpa_backend): flash, efficient,
    # cudnn or math; ``eager`` attention does not call SDPA
    sdpa: str = "flash"

    def __init__(
        self,
        model: ModelSpec,
        b: int,
        s: int,
        span: int,
        t: int,
        sp: bool,
        d: int,
        eager: bool,
        dropout: bool,
        autocast: bool = False,
        sdpa: str = "flash",
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "model", model)
        _set(self, "b", b)
        _set(self, "s", s)
        _set(self, "span", span)
        _set(self, "t", t)
        _set(self, "sp", sp)
        _set(self, "d", d)
        _set(self, "eager", eager)
        _set(self, "dropout", dropout)
        _set(self, "autocast", autocast)
        _set(self, "sdpa", sdpa)

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def rep(self) -> int:
        """Divisor of the regions outside TP (norms, residuals): t with SP, else 1."""
        return self.t if self.sp else 1


def korthikanti_replicated(x: Shape) -> int:
    """Norm inputs 2dh, QKV input dh, MLP input dh, two dropout masks 2h: 10sbh at d=2.

    Korthikanti Sec. 4.1: the part not split by TP (split by t under sequence parallelism).
    """
    h = x.model.hidden_size
    masks = 2 * h if x.dropout else 0
    return x.tokens * (4 * x.d * h + masks) // x.rep


def korthikanti_parallel(x: Shape) -> int:
    """Q, K, V, projection input, MLP internals, split by t: 24sbh/t for MHA with f = 4h.

    Q d*q, K and V d*kv each, projection input d*q; MLP plain: activation input and fc2 input
    2df; gated (SwiGLU): fc1 output (gate and up) 2df plus fc2 input df.
    """
    m = x.model
    mlp = (3 if m.mlp == "gated" else 2) * m.ffn_size
    return x.tokens * x.d * (2 * m.q_size + 2 * m.kv_size + mlp) // x.t


def korthikanti_attention_core(x: Shape) -> int:
    """Eager: softmax output d*a*s, dropout mask a*s and output d*a*s per token, split by t (5as
    at d=2). Flash: only the fp32 log-sum-exp, 4 bytes per head per token (Dao 2022).
    """
    a = x.model.num_attention_heads
    if not x.eager:
        return x.tokens * 4 * a // x.t
    per_score = x.d + (x.d + 1 if x.dropout else 0)
    return x.tokens * a * x.span * per_score // x.t


def checkpointed_core_fp32_qk(x: Shape) -> int:
    """Under autocast, what a checkpoint around the attention core (``recompute: selective``) keeps
    of q and k beyond the d-byte casts SDPA saves without one: RoPE's tables are fp32 under autocast
    (the embedding's output is), so the RoPE'd q and k are fp32, and the checkpoint holds them as its
    inputs while their casts (SDPA's ``k_cast``, ``q_cast``) are recomputed in the backward: (4 - d)
    (q + kv) per token (the bundled trainer's run: ``layers.N.attention.q_rope`` / ``k_rope``,
    ``trainer_model.Model.attention``; -335,544,320 B on the 1B config at 4,096 tokens without it)."""
    if not x.autocast:
        return 0
    return x.tokens * (4 - x.d) * (x.model.q_size + x.model.kv_size) // x.t


def layer_input(x: Shape) -> int:
    """What a fully recomputed layer keeps: its input, d*h per token (2sbh in Table 2)."""
    return x.tokens * x.d * x.model.hidden_size // x.rep


def residual_input(x: Shape) -> int:
    """:func:`layer_input` in the residual stream's dtype: fp32 under autocast, where the
    embedding's output is fp32 (``nn.Embedding`` is not autocast) and each residual add promotes
    (the bundled trainer's run: a checkpointed layer keeps ``layers.N.residual_ffn`` in 4 bytes,
    268 MB more than d on the 1B config at 4,096 tokens). The ``hf`` runtimes keep
    :func:`layer_input`: their checkpointed LoRA case under autocast (tests/accuracy, CPU) measured
    -0.5% with it and +2.4% with this, a compensation not yet traced."""
    return x.tokens * (4 if x.autocast else x.d) * x.model.hidden_size // x.rep


def layer_matmul_widths(model: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) widths of a dense layer's matmuls in execution order: q, k, v, the attention
    output projection, then gate, up, down (gated MLP, torchtitan's and memplan's
    ``w2(silu(w1(x)) * w3(x))``) or fc1, fc2 (plain MLP)."""
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_size
    mlp = [(h, f), (h, f), (f, h)] if model.mlp == "gated" else [(h, f), (f, h)]
    return [(h, q), (h, kv), (h, kv), (q, h), *mlp]


def op_sac_layer(x: Shape, attention_saved: bool = True) -> int:
    """What a layer keeps under per-op selective recomputation (torchtitan's ``op`` SAC,
    ``torchtitan/distributed/activation_checkpoint.py``): the checkpoint keeps the layer's
    input, and the save list the outputs of every odd-numbered matmul (1st, 3rd, ...: q, v,
    gate and down for a gated MLP; q, v and fc1 for a plain one), of the attention kernel
    (its output d*q and fp32 log-sum-exp) and of the sequence-parallel reduce-scatters
    (d*h/t after each of the two row-parallel matmuls). Everything else (norms, RoPE, k, the
    output projection, up, the activation) is recomputed in the backward.

    A column-parallel matmul's output is split by t; a row-parallel one (the output projection,
    down / fc2) leaves each rank a full-width partial sum, d*h per token. Under autocast the
    residual stream, and so the kept input, is fp32; the matmul outputs are in d.
    ``attention_saved`` is False for eager attention, whose batched matmuls and softmax are
    not on the save list (recomputed)."""
    m = x.model
    element = 4 if x.autocast else x.d
    kept = x.tokens * element * m.hidden_size // x.rep + op_sac_mlp(x)
    for _, out in layer_matmul_widths(m)[:4:2]:  # q and v (the 1st and 3rd)
        kept += x.tokens * x.d * out // x.t
    if attention_saved:
        kept += x.tokens * (x.d * m.q_size + 4 * m.num_attention_heads) // x.t
    if x.sp:
        kept += 2 * x.tokens * x.d * m.hidden_size // x.t
    return kept


def op_sac_mlp(x: Shape) -> int:
    """The dense MLP's part of :func:`op_sac_layer`: its odd-numbered matmuls (the layer's
    5th and 7th) keep their outputs, gate d*f/t and down d*h (a row-parallel partial sum,
    full width); a plain MLP's fc1 d*f/t (its fc2 is the 6th, recomputed)."""
    m = x.model
    widths = layer_matmul_widths(m)
    kept = 0
    for i in range(4, len(widths), 2):
        out = widths[i][1]
        kept += x.tokens * x.d * out // (1 if i == len(widths) - 1 else x.t)
    return kept


def hf_rmsnorm(x: Shape) -> int:
    """LlamaRMSNorm (transformers): upcast to fp32, x * rsqrt(mean(x^2) + eps), cast, * weight.

    Saved for backward: fp32 input (pow, mul) 4h, normalised value cast back (weight mul) dh,
    output (next matmul) dh, rsqrt 4 per token. In fp32 the upcast is the input itself, so the
    norm keeps its input (4h), the normalised value 4h and the output 4h. Measured exactly
    with MemTracker (docs/cost-model.md).
    """
    h = x.model.hidden_size
    if x.autocast:
        # fp32 residual stream: the norm keeps its input and the normalised value (4h each);
        # its output is freed once each matmul has cast its own copy
        return x.tokens * (8 * h + 4) // x.rep
    return x.tokens * (4 * h + 2 * x.d * h + 4) // x.rep


def qk_norm(x: Shape) -> int:
    """transformers' QK RMSNorm (Qwen3 and Gemma 3 per head, OLMo 2 over the full width), on the q
    and k projections' outputs: the fp32 input (the output itself in fp32) 4w and the normalised
    value cast back (the weight's gradient) d*w for w = q and kv, and an fp32 rsqrt per head (per
    token over the full width). Its output goes to RoPE, which saves only cos and sin: not kept.
    Llama 4's weightless L2 norm keeps its input and rsqrt but no normalised value (no weight).
    Measured on CPU, tests/accuracy/test_family_accuracy.py."""
    m = x.model
    if not m.qk_norm:
        return 0
    width = m.q_size + m.kv_size
    rsqrt = 4 * (m.num_attention_heads + m.kv_heads) if m.qk_norm_scope == "head" else 8
    normalised = 4 if fp32_norm_product(m) else x.d  # Gemma's and OLMo 2's multiply in fp32
    per_token = 4 * width + (normalised * width if m.qk_norm_weight else 0) + rsqrt
    return x.tokens * per_token // x.t


def fp32_norm_product(model: ModelSpec) -> bool:
    """Norms that multiply the weight in fp32 and cast afterwards: Gemma's RMSNorm
    (``(x.float() * rsqrt) * (1 + weight.float())``, then ``type_as``; sandwich norms) and OLMo 2's
    (``(weight * x.float() * rsqrt).to(dtype)``; post-norms). Llama's casts first
    (``weight * x.to(dtype)``), so below fp32 it keeps the normalised value in d."""
    return model.layer_norms in ("sandwich", "post")


def fp32_rmsnorm(x: Shape, output_saved: bool) -> int:
    """A norm of :func:`fp32_norm_product` (transformers Gemma2RMSNorm / Gemma3RMSNorm / Olmo2RMSNorm).
    Saved: the fp32 input (the input itself in fp32, an upcast otherwise) 4h, the fp32 normalised
    value (the weight's gradient) 4h and the rsqrt 4; a pre-norm's output is saved by the matmuls it
    feeds (``output_saved``): d*h (4h in fp32, the product itself), none under autocast (each matmul
    casts its own copy). A post-norm's output only joins the residual. Measured on CPU,
    tests/accuracy/test_family_accuracy.py."""
    h = x.model.hidden_size
    out = x.d * h if output_saved and not x.autocast else 0
    return x.tokens * (8 * h + 4 + out) // x.rep


def layer_norms(x: Shape) -> int:
    """The hidden-width norms of one transformers layer: two Llama RMSNorms (pre-norms); Gemma's four
    sandwich norms (two pre, two post); OLMo 2's two post-norms, whose layer input and mid-layer
    residual the q/k/v and gate/up matmuls save (d*h each, none under autocast: they cast), the
    bytes of a pre-norm's saved output."""
    m = x.model
    if m.layer_norms == "sandwich":
        return 2 * fp32_rmsnorm(x, output_saved=True) + 2 * fp32_rmsnorm(x, output_saved=False)
    if m.layer_norms == "post":
        return 2 * fp32_rmsnorm(x, output_saved=True)
    return 2 * hf_rmsnorm(x)


def final_norm(x: Shape) -> int:
    """The final norm before the LM head (its output saved by the head)."""
    return fp32_rmsnorm(x, output_saved=True) if fp32_norm_product(x.model) else hf_rmsnorm(x)


def softcapped_logits(x: Shape, vocab: int) -> int:
    """Gemma 2's final logit soft-capping, ``tanh(logits / cap) * cap``: tanh keeps its output for
    the backward, one more b*s*V/t in d beside the returned logits (the head's output and the
    quotient are freed as the forward rebinds ``logits``)."""
    return logits(x, vocab) if x.model.final_logit_softcapping is not None else 0


def fused_qkv(x: Shape) -> int:
    """Phi-3's fused qkv_proj: q, k and v are views of one (q + 2kv)-wide output, and the v view
    SDPA saves keeps the whole storage alive: (q + kv) d per token beyond v itself. (Its fused
    gate_up output is 2f wide, the same bytes as separate gate and up outputs.)"""
    m = x.model
    if not m.fused_qkv:
        return 0
    return x.tokens * x.d * (m.q_size + m.kv_size) // x.t


def autocast_input_casts(x: Shape, matmuls: int) -> int:
    """Under autocast each matmul casts its fp32 input to d itself (no cache for activations)
    and keeps the copy for its backward: ``matmuls`` x d*h per token (3 for q/k/v, 2 for
    gate/up, 1 for the LM head). Measured with MemTracker, transformers 5.23. Under sequence
    parallel each cast is of the all-gathered input, the whole sequence (the bundled trainer's
    run: ``layers.N.attention.wq.input_cast`` ... ``feed_forward.w3.input_cast``,
    ``trainer_model.Model.linear`` after ``gather_seq``; 402,653,184 B more than 1 / t of them
    on the 1B config at TP 2, 4,096 tokens), so no division by t."""
    if not x.autocast:
        return 0
    return matmuls * x.tokens * x.d * x.model.hidden_size


def hf_sdpa_attention(x: Shape, dynamic_cache: bool = True) -> int:
    """transformers' Llama attention with SDPA (flash / memory-efficient backend).

    Kept: RoPE'd q (d*q) and k (d*kv) and v (d*kv) for SDPA, the output (d*q, the same storage
    o_proj keeps) and the log-sum-exp (4 bytes x heads). GQA goes to SDPA unrepeated. The
    pre-RoPE q and k are freed: q*cos and rotate_half(q)*sin save only cos and sin.

    On SDPA's math path (``sdpa_math_attention``) SDPA keeps its own copies instead, and the
    DynamicCache (``dynamic_cache``) keeps k and v alive, 2 d kv (measured on CPU, math forced).
    Under autocast transformers' DynamicCache adds 2 x 4kv (``dynamic_cache``): cos / sin are
    fp32, so RoPE promotes the keys to fp32, and the cache keeps keys and values in fp32 beside
    the bf16 copies SDPA saves (measured on two shapes). The bundled trainer has no cache: its
    fp32 RoPE'd keys are freed once SDPA has cast them (measured: the trainer's autocast runs
    were over-predicted by exactly 8kv per token and layer with it, 512 B for tiny-gqa).
    """
    m = x.model
    cache = 0
    if dynamic_cache and (x.autocast or x.sdpa == "math"):
        # the cache's keys and values: fp32 under autocast, beside the bf16 copies SDPA saves; on
        # the math path, which keeps only its own copies, the cache still holds k and v
        cache = x.tokens * 2 * (4 if x.autocast else x.d) * m.kv_size // x.t
    if x.sdpa == "math":
        return sdpa_math_attention(x) + cache
    per_token = x.d * (2 * m.q_size + 2 * m.kv_size) + 4 * m.num_attention_heads
    return x.tokens * per_token // x.t + cache


def masked_layers(x: Shape) -> int:
    """Layers whose attention transformers runs with an explicit mask: sliding-window or chunked
    layers whose window the sequence reaches (``masking_utils._ignore_causal_mask_sdpa``: a local
    window of ``kv_length >= window`` cannot be left to SDPA's ``is_causal``)."""
    return _masked_layers(x.model, x.span)


@lru_cache(maxsize=1024)
def _masked_layers(model: ModelSpec, span: int) -> int:
    if not model.attention_pattern:
        return 0
    return sum(1 for i in range(model.num_layers) if (w := model.attention_window(i)) is not None and span >= w)


def sdpa_mask_extra(x: Shape, dynamic_cache: bool) -> int:
    """What one masked SDPA layer keeps beyond :func:`hf_sdpa_attention` (transformers 5.23
    ``sdpa_attention_forward``): with a mask it does not pass ``enable_gqa`` but repeats k and v to
    every head (``repeat_kv``, copies SDPA saves: 2 d (q - kv) more), SDPA converts the boolean
    (b, 1, s, s) mask to one in the query's dtype and saves it (d b s^2), and the DynamicCache
    (``dynamic_cache``) still holds the unrepeated k and v (2 d kv). Measured on CPU (SDPA's CPU
    flash kernel takes the mask), tests/accuracy/test_family_accuracy.py; on CUDA a mask rules out
    the flash kernel and the memory-efficient one takes it, saving the same tensors (not measured)."""
    m = x.model
    repeated = 2 * (m.q_size - m.kv_size) if m.kv_heads < m.num_attention_heads else 0
    cache = 2 * m.kv_size if dynamic_cache and repeated else 0
    return x.tokens * x.d * (repeated + cache) // x.t + x.b * x.s * x.span * x.d


def mla_attention(x: Shape, dynamic_cache: bool) -> int:
    """transformers' DeepSeek-V2 / V3 attention (multi-head latent attention, ``DeepseekV3Attention``),
    per micro-batch, measured on CPU term by term (tests/accuracy/test_family_accuracy.py):

    - queries: with ``q_lora_rank`` r_q, q_a's output and q_a_layernorm's saved tensors (an RMSNorm of
      width r_q: fp32 input 4 r_q, normalised value and output d r_q each, rsqrt 4); without it q_proj
      reads the layer norm's output, kept anyway;
    - keys and values: kv_a_proj_with_mqa's output (r_kv + r_rope wide) holds the latent the
      kv_a_layernorm reads: in fp32 that view keeps the whole output (4 (r_kv + r_rope)), below fp32
      the norm's fp32 upcast 4 r_kv; its normalised value and output d r_kv each, rsqrt 4; the
      DynamicCache (``dynamic_cache``) keeps its own copies of the latent (the one kv_b_proj then
      saves) and of the RoPE'd key d r_rope;
    - kv_b_proj expands the latent into per-head keys (nope + rope, ``head_size``) and values
      (``v_head_size``); SDPA gets q and k of ``head_size`` and v of ``v_head_size`` per head. The CPU
      flash kernel and CUDA's flash need one head dim: CPU runs the math path (scaled q and k, the
      s x s probabilities, a contiguous v, all in its compute width), CUDA the memory-efficient
      kernel (q, k, v as the expansion's storage, the output, an fp32 log-sum-exp; not measured);
    - o_proj keeps the output made contiguous, d H v_head (the fused kernels' own output, in that
      layout already).
    """
    m = x.model
    mla = m.mla
    assert mla is not None
    heads = m.num_attention_heads // x.t
    d, tokens = x.d, x.tokens
    per_token = 0
    if mla.q_lora_rank is not None:  # fp32 input (the q_a output itself in fp32), normalised, output
        per_token += 4 * mla.q_lora_rank + 2 * d * mla.q_lora_rank + 4
    r_kv, rope = mla.kv_lora_rank, mla.qk_rope_head_dim
    # below fp32 the kv_a output is freed once the norm's upcast and RoPE have read it
    per_token += 4 * r_kv if d < 4 else 4 * (r_kv + rope)
    per_token += 2 * d * r_kv + 4
    if dynamic_cache:
        per_token += d * rope
    qk, v = m.head_size, m.v_head_size
    per_token += d * heads * v  # o_proj's contiguous input
    kept = tokens * per_token
    if x.sdpa == "math":
        a = math_compute_bytes(d)
        kept += tokens * heads * (2 * qk + v) * a + x.b * heads * x.s * x.span * a
    else:  # q, k, v (a view of the expansion: its whole storage) and an fp32 log-sum-exp
        kept += tokens * heads * (d * (2 * qk + mla.qk_nope_head_dim + v) + 4)
    return kept


def sdpa_math_attention(x: Shape) -> int:
    """SDPA's math path (``_scaled_dot_product_attention_math``), which CUDA runs where no fused
    kernel takes the call (fp32 with GQA: flash and cuDNN need fp16/bf16, the memory-efficient
    kernel does not take ``enable_gqa``; ``attention.sdpa_backend``): what it keeps is
    ``attention.total_saved_bytes`` (scaled copies of q and of K repeated to every head, V as the
    second matmul sees it, the (b, heads, s, s) probabilities, all in fp32 even for bf16 inputs),
    and q, k and v themselves are freed. The output's transposed copy is what ``o_proj`` saves,
    d*q. Measured on CPU with the math backend forced (tests/accuracy/hf_steps.py)."""
    m = x.model
    heads, kv = m.num_attention_heads // x.t, max(m.kv_heads // x.t, 1)
    kept = total_saved_bytes("math", x.b, x.s, heads, kv, m.head_size, x.d, enable_gqa=True, device="cuda")
    return kept + x.tokens * x.d * m.q_size // x.t


def attention_backward_transient(x: Shape) -> int:
    """The largest temporaries of the attention core's backward beyond the input gradients: on
    SDPA's math path the probabilities' gradient and the scores' gradient, two (b, heads, s, s)
    tensors in its compute width (fp32 for bf16 inputs), alive together in the softmax backward
    (measured on CPU with the math backend forced: exactly 2 b a s^2 4 for fp32). Fused kernels
    recompute the scores tile by tile: nothing of that size (0)."""
    if x.eager or x.sdpa != "math":
        return 0
    heads = x.model.num_attention_heads // x.t
    return 2 * x.b * heads * x.s * x.span * math_compute_bytes(x.d)


def math_attention_backward(x: Shape, dynamic_cache: bool) -> int:
    """One layer at its softmax backward on SDPA's math path: the first norm's saved tensors,
    what the math path keeps (``sdpa_math_attention`` less the output copy ``o_proj`` freed),
    the DynamicCache's k and v (``dynamic_cache``), the gradient of the attention output (d*q)
    and the two s x s gradients (``attention_backward_transient``). Measured on CPU with the
    math backend forced, transformers' Llama with gradient checkpointing."""
    m = x.model
    cache = x.tokens * 2 * (4 if x.autocast else x.d) * m.kv_size // x.t if dynamic_cache else 0
    grad_out = x.tokens * x.d * m.q_size // x.t
    kept = sdpa_math_attention(x) - grad_out  # less the output's copy, the same size as its gradient
    return hf_rmsnorm(x) + kept + cache + grad_out + attention_backward_transient(x)


def hf_eager_attention(x: Shape) -> int:
    """transformers' ``eager_attention_forward``: scores materialised.

    Kept: RoPE'd q, k, v; K and V repeated to all heads (``repeat_kv``) when GQA; the fp32
    softmax output (4 a s per token) and, below fp32, its cast to d; the transposed output d*q.
    """
    m = x.model
    a = m.num_attention_heads
    qkv = m.q_size + 2 * m.kv_size
    repeated = 2 * m.q_size if m.kv_heads < a else 0
    probs = a * x.span * (4 + (x.d if x.d < 4 else 0))
    if m.attn_logit_softcapping is not None:
        probs += a * x.span * x.d  # tanh(scores / cap) keeps its output (Gemma 2)
    per_token = x.d * (qkv + repeated + m.q_size) + probs
    return x.tokens * per_token // x.t


def mlp(x: Shape, gated_tensors: int, ffn: int | None = None) -> int:
    """A dense MLP's saved f-wide tensors, split by t: ``gated_tensors`` of them when gated
    (transformers' LlamaMLP keeps gate out, act out, up out and their product: 4; Megatron's
    fused SwiGLU keeps fc1's output, 2 wide, and fc2's input: 3), two when plain."""
    m = x.model
    per_token = (gated_tensors if m.mlp == "gated" else 2) * x.d * (ffn or m.ffn_size)
    return x.tokens * per_token // x.t


def hf_mlp(x: Shape) -> int:
    """LlamaMLP down(act(gate(x)) * up(x)): gate out, act out, up out and product, 4df per token."""
    return mlp(x, 4)


def every_expert_runs(model: ModelSpec) -> bool:
    """transformers' Llama 4 MoE (``Llama4TextMoe``) runs every routed expert on every token, its
    router scores zeroing the unchosen."""
    return model.architecture == "llama4"


def moe_extra(x: Shape, ep: int, gated_tensors: int, transformers: bool = False) -> int:
    """Extra activations of an MoE layer over a dense one (token-choice top-k routing).

    Router logits and probabilities in fp32 (2 * 4E per token), tokens dispatched to experts
    (d*h per routed copy), expert MLPs on top_k copies of each token (balanced routing:
    each EP rank receives tokens * top_k / ep * ep), shared experts on every token; the dense
    MLP term of the layer is replaced, so it is subtracted by the caller.

    ``transformers``: its expert modules keep one more d*h per routed copy, the tensor the
    routing weights multiply (DeepSeek's experts scale each copy's down output, saved for the
    weights' gradient; Llama 4 scales the repeated input, saved the same way), and transformers'
    Llama 4 (``Llama4TextMoe``) runs every expert on every token, its router scores zeroing the
    unchosen: num_experts copies, not top_k. Measured on CPU (tests/accuracy/test_family_accuracy.py).
    """
    m = x.model
    moe = m.moe
    assert moe is not None
    tensors = gated_tensors if m.mlp == "gated" else 2
    copies = moe.num_experts if transformers and every_expert_runs(m) else moe.top_k
    routed = x.tokens * copies
    expert_mlp = tensors * x.d * moe.expert_ffn_size
    shared = moe.num_shared_experts * tensors * x.d * moe.shared_ffn_size
    router = x.tokens * 8 * moe.num_experts
    dispatched = (2 if transformers else 1) * x.d * m.hidden_size
    return router + routed * (dispatched + expert_mlp // x.t) + x.tokens * shared // x.t


def logits(x: Shape, vocab: int) -> int:
    """The LM head's output b*s*V/t in the compute dtype."""
    return x.tokens * x.d * vocab // x.t


def fp32_logits(x: Shape, vocab: int) -> int:
    """One fp32 tensor of b*s*V/t: the upcast for the loss, log_softmax's output or its gradient."""
    return x.tokens * 4 * vocab // x.t
