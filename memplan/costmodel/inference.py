"""Serving memory beyond the weights and the KV cache: the prefill forward's working set.

A prefill forward over ``T`` tokens holds, besides the weights and the KV cache, the tensors of
the layer it is in and a few that live for the whole forward. Its peak is the largest of four
moments of one layer (transformers 5.23 ``LlamaDecoderLayer`` / ``LlamaAttention`` / ``LlamaMLP``
under ``torch.no_grad``, measured on CPU to the byte: tests/accuracy/test_prefill_accuracy.py):

- the MLP: the residual stream (the embedding output the model keeps as ``inputs_embeds``, the
  layer's input, the residual after attention, the post-attention norm's output: 4 h; 3 h for a
  post-norm layer, OLMo 2), and a gated MLP's ``act(gate)``, ``up`` and their product (3 f; 4 f
  when one gate_up matrix's output stays beside them, Phi-3; a plain MLP's ``up`` and ``act``: 2 f);
- attention: the stream (3 h), the RoPE'd queries and the attention output (2 q) and the fp32
  log-sum-exp (4 bytes x heads), with one qkv matrix (Phi-3) its whole output, which q, k and v
  are views of; a whole prompt's keys and values become the cache;
- the cache's growth (a contiguous cache only, chunks after the first): transformers'
  ``DynamicLayer.update`` concatenates the chunk onto the cached prefix, so for a moment one
  layer holds its old keys (or values) beside the new ones;
- the logits (last stage): the last token of each sequence only (transformers' ``generate``
  passes ``logits_to_keep=1`` and copies them to fp32; vLLM's model runner computes logits at
  ``logits_indices``, each sequence's last scheduled token, and samples in fp32).

Chunked prefill (``InferenceWorkload.prefill_chunk``, vLLM's ``max_num_batched_tokens``) runs
``T = chunk`` tokens per forward instead of batch x prompt, so these moments shrink with the
chunk while the KV cache stays whole. A chunk's queries attend to their whole cached prefix:

- a paged cache (``block_size`` set: vLLM) is written in place and read by FlashAttention's
  varlen / paged kernel with a causal offset: no chunk x prefix tensor, no copy of the prefix
  (Dao 2023; vLLM ``FlashAttentionImpl``), not measured here;
- a contiguous cache (transformers' ``DynamicCache``): a chunk's query length differs from the
  key length, so transformers builds a boolean mask (chunk x prefix, for the whole forward)
  and, with a mask, ``use_gqa_in_sdpa`` is false: ``repeat_kv`` copies the prefix's keys and
  values to every query head (2 b P q, when there are fewer KV heads than query heads) and SDPA
  converts the mask to the query's dtype (b c P); the CPU flash kernel then takes the mask and
  holds no scores. Measured on CPU; on CUDA the memory-efficient kernel takes the mask (not
  measured).

A sliding-window or chunked layer of a contiguous cache attends to ``window - 1 + chunk`` keys
per chunk, and a whole prompt that reaches its window is masked too (:func:`layer_keys`).

Not modelled: MLA's expansion of the cached latent over the prefix, Gemma 3's RoPE table per
attention kind (measured -1% to -2%), the MoE routing tensors (an MoE layer's MLP is
counted as 3 x the expert width over every token, an upper bound), RMSNorm's fp32 temporaries
(smaller than the MLP's for f >= h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memplan.specs.model import ModelSpec
from memplan.specs.workload import InferenceWorkload

Moment = Literal["mlp", "attention", "cache growth", "logits"]
GiB = 2**30


@dataclass(frozen=True, slots=True)
class PrefillForward:
    """One prefill forward: ``rows`` sequences of ``queries`` tokens each (``tokens`` in all), whose
    queries attend to ``keys`` cached tokens; ``chunked``: the prompt takes more than one forward."""

    tokens: int
    rows: int
    queries: int
    keys: int
    chunked: bool
    paged: bool


@dataclass(frozen=True, slots=True)
class PrefillPeak:
    """The prefill forward's working set at its highest moment (bytes beyond weights and KV cache)."""

    bytes: int
    moment: Moment
    forward: PrefillForward


def prefill_forward(workload: InferenceWorkload) -> PrefillForward:
    """The largest prefill forward: the whole batch's prompts (``prefill_chunk`` None, or as large as
    batch x prompt), else a chunk. A paged cache (vLLM) fills the chunk's token budget across
    sequences; a contiguous one (transformers) runs every row alike, ceil(chunk / batch) tokens each.
    The worst chunk attends to the whole prompt."""
    b, prompt, chunk = workload.batch, workload.prompt_tokens, workload.prefill_chunk
    paged = workload.block_size is not None
    if chunk is None or chunk >= b * prompt:
        return PrefillForward(b * prompt, b, prompt, prompt, False, paged)
    if paged:
        rows = min(b, chunk)
        return PrefillForward(chunk, rows, -(-chunk // rows), prompt, True, paged)
    queries = min(-(-chunk // b), prompt)
    return PrefillForward(b * queries, b, queries, prompt, queries < prompt, paged)


def kv_per_rank(model: ModelSpec, t: int) -> int:
    """Key (or value) width per TP rank: kv_heads / t x head_dim, KV heads replicated below t."""
    return max(model.kv_heads // t, 1) * model.head_size


def layer_keys(model: ModelSpec, x: PrefillForward, index: int) -> tuple[int, bool]:
    """(keys a query of layer ``index`` attends to, whether transformers masks its attention). A
    sliding-window or chunked layer of a contiguous cache (``DynamicSlidingWindowLayer``) returns
    its last ``window - 1`` cached tokens with the chunk; its mask is explicit once the keys reach
    the window (``masking_utils``), a full layer's once the queries are a chunk of the keys."""
    window = model.attention_window(index)
    if window is None or x.paged:
        return x.keys, x.chunked and not x.paged
    if not x.chunked:
        return x.keys, x.keys >= window
    return min(x.keys, window - 1 + x.queries), True


def forward_wide_bytes(model: ModelSpec, x: PrefillForward, d: int) -> int:
    """Tensors the model keeps for the whole forward: RoPE's cos and sin (1, queries, head_dim) in
    the compute dtype, ``cache_position`` (int64 per query), and each attention kind's boolean
    (queries x keys) mask where transformers builds one (:func:`layer_keys`)."""
    masks = {}
    for i in range(model.num_layers):
        keys, masked = layer_keys(model, x, i)
        if masked:
            masks[model.attention_kind(i)] = x.queries * keys
    return 2 * x.queries * model.head_size * d + 8 * x.queries + sum(masks.values())


def stream(model: ModelSpec, moment: Moment, first: bool) -> int:
    """Hidden-wide tensors alive in a layer: the embedding output the model keeps, the layer's input,
    and at the MLP the residual after attention; a pre-norm (or sandwich) layer also holds the norm's
    output its attention or MLP reads, a post-norm one (OLMo 2) reads the stream itself. In the first
    layer the input is the embedding output (Gemma's scaled copy of it)."""
    held = {"attention": 2, "cache growth": 2, "mlp": 3}[moment] + (model.layer_norms != "post")
    return held - first


def mlp_moment(model: ModelSpec, x: PrefillForward, d: int, t: int, ffn: int, first: bool = False) -> int:
    """At the MLP's product: the stream (:func:`stream`) and a gated MLP's act(gate), up and product
    (3 f; with one gate_up matrix, Phi-3, its 2 f output stays beside act and product: 4 f), a plain
    MLP's up and act (2 f); f split by TP."""
    wide = (4 if model.fused_gate_up else 3) if model.mlp == "gated" else 2
    return x.tokens * d * (stream(model, "mlp", first) * model.hidden_size + wide * ffn // t)


def attention_moment(model: ModelSpec, x: PrefillForward, d: int, t: int, first: bool = False, index: int = 0) -> int:
    """At SDPA in layer ``index``: the stream, RoPE'd queries and the output (2 q / t), the fp32
    log-sum-exp per head; with one qkv matrix (Phi-3) its output, which q, k and v are views of
    (q + 2 kv); a masked layer (:func:`layer_keys`) adds the masked path's copies (module docstring)."""
    q = model.q_size // t
    heads = max(model.num_attention_heads // t, 1)
    fused = q + 2 * kv_per_rank(model, t) if model.fused_qkv else 0
    held = x.tokens * (d * (stream(model, "attention", first) * model.hidden_size + 2 * q + fused) + 4 * heads)
    keys, masked = layer_keys(model, x, index)
    if masked:
        repeated = 2 * x.rows * keys * q if model.kv_heads < model.num_attention_heads else 0
        held += d * (repeated + x.rows * x.queries * keys)
    return held


def cache_growth_moment(
    model: ModelSpec, x: PrefillForward, d: int, t: int, kv_bytes: int, first: bool = False, index: int = 0
) -> int:
    """``DynamicLayer.update`` concatenating a chunk onto a contiguous cache's prefix in layer
    ``index``: the stream, the RoPE'd queries, the chunk's keys and values (with one qkv matrix, its
    whole output instead of the values), and the layer's old values beside the new ones: the
    prefix (keys - queries tokens), or for a windowed layer the storage of its previous
    concatenation (at most window - 1 + queries). Zero for a paged cache or a single forward."""
    if not x.chunked or x.paged:
        return 0
    q, kv = model.q_size // t, kv_per_rank(model, t)
    chunk = q + 2 * kv + (q + 2 * kv if model.fused_qkv else 0) - (kv if model.fused_qkv else 0)
    held = x.tokens * d * (stream(model, "cache growth", first) * model.hidden_size + chunk)
    old = min(x.keys - x.queries, layer_keys(model, x, index)[0])
    return held + x.rows * old * kv * kv_bytes


def logits_moment(model: ModelSpec, x: PrefillForward, d: int, t: int) -> int:
    """The LM head on each sequence's last token: the final norm's output (the model has returned)
    and ``rows`` x vocab logits in the compute dtype, then the logits and their fp32 copy."""
    vocab = model.vocab_size // t
    return max(x.tokens * d * model.hidden_size + x.rows * vocab * d, x.rows * vocab * (d + 4))


def prefill_peak(
    model: ModelSpec,
    workload: InferenceWorkload,
    d: int,
    t: int,
    kv_bytes: int,
    indices: tuple[int, ...],
    is_last: bool,
) -> PrefillPeak:
    """The largest moment of the prefill forward on a stage holding layers ``indices`` (module
    docstring). ``d``: bytes of the compute dtype; ``kv_bytes``: of the cache's element."""
    x = prefill_forward(workload)
    ffn = max((_mlp_width(model, i) for i in indices), default=0)
    first = len(indices) == 1  # a stage of one layer: its input is the embedding output
    wide = forward_wide_bytes(model, x, d) if indices else 0  # freed when the model's forward returns
    kinds = {model.attention_kind(i): i for i in indices}.values()  # one layer of each kind on the stage
    moments: dict[Moment, int] = {
        "mlp": mlp_moment(model, x, d, t, ffn, first) + wide if indices else 0,
        "attention": max((attention_moment(model, x, d, t, first, i) for i in kinds), default=0) + wide,
        "cache growth": max((cache_growth_moment(model, x, d, t, kv_bytes, first, i) for i in kinds), default=0) + wide,
        "logits": logits_moment(model, x, d, t) if is_last else 0,
    }
    moment = max(moments, key=lambda k: moments[k])
    return PrefillPeak(moments[moment], moment, x)


def _mlp_width(model: ModelSpec, index: int) -> int:
    """A layer's MLP width: the dense ffn, or an MoE layer's expert width (see the module docstring)."""
    if model.moe is not None and model.is_moe_layer(index):
        return model.moe.expert_ffn_size
    return model.ffn_size


def vllm_default_chunk(capacity_bytes: int, gpu_name: str) -> int:
    """vLLM V1's ``max_num_batched_tokens`` for its OpenAI API server when the user gives none
    (chunked prefill is on for generative models): 8192 on GPUs of at least 70 GiB other than the
    A100, 2048 on others (vllm-project/vllm ``vllm/engine/arg_utils.py``,
    ``EngineArgs._set_default_args``, commit 99d7eb5; its ``LLM`` class takes 16384 and 8192,
    which no command asks for)."""
    return 8192 if capacity_bytes >= 70 * GiB and "a100" not in gpu_name.lower() else 2048
