"""LoRA adapters (Hu et al. 2021, arXiv 2106.09685) as PEFT builds them: parameters and the
activations a transformers layer keeps when its base weights are frozen.

Pure formulas (no torch). Every term was found by measuring PEFT 0.21.2 over transformers 5.23
on CPU (``torch.autograd.graph.saved_tensors_hooks`` per module, MemTracker for the step;
tests/accuracy/peft_steps.py, docs/cost-model.md "Fine-tuning: LoRA and QLoRA").

What decides what a layer saves is which tensors require grad: autograd saves an input of an
op only for a gradient it will compute. A frozen linear computes no weight gradient, so it
keeps neither its input nor (under autocast) its input's cast, only the weight (for the input
gradient, a parameter, or under autocast its d-byte copy); a frozen norm weight likewise does
not keep the normalised value. Without gradient checkpointing nothing before the first
adapter requires grad: layer 0's first norm keeps nothing, and its MLP keeps only what its
adapters need.
"""

from __future__ import annotations

from memplan.records import record
from memplan.specs.model import ModelSpec

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# the bundled trainer's module name -> transformers' (memplan.train.lora wraps by it; timeline.lora models it)
HF_NAMES = {
    "attention.wq": "q_proj",
    "attention.wk": "k_proj",
    "attention.wv": "v_proj",
    "attention.wo": "o_proj",
    "feed_forward.w1": "gate_proj",
    "feed_forward.w3": "up_proj",
    "feed_forward.w2": "down_proj",
}
MLP = ("gate_proj", "up_proj", "down_proj")
# DeepSeek-V3's MLA linears beside o_proj (and q_proj without q_lora_rank): transformers' names, which PEFT targets
MLA_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
LINEARS = ATTENTION + MLP  # transformers' Llama / Mistral / Qwen2 decoder-layer linears
# Phi-3's (and Phi-4's) decoder-layer linears (modeling_phi3.py: q, k, v in one qkv_proj, gate and up in one
# gate_up_proj): PEFT matches target_modules by these names, so a plan's q_proj or gate_proj matches nothing there
FUSED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SAVABLE = ("lm_head", "embed_tokens")  # modules_to_save memplan models (trained in full)
ALL_LINEAR = "all-linear"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # architectures whose linears are named as above
# dense families whose LoRA only the op-level runs of transformers' Trainer and of the hand-written loop follow
# (timeline/hf_lora.py over hf_families.py, under hf_trainer.py's or hf_loop.py's step): the phase model's LoRA
# layer (hf_layer) is Llama's
RUN_FAMILIES = ("phi3", "olmo2", "gemma2", "gemma3")

# PEFT's get_peft_model(autocast_adapter_dtype=True) keeps adapters in fp32 under a bf16 / fp16
# base (measured: lora_A / lora_B fp32 over a bf16 Llama), and the adapter casts its input to
# the adapter's dtype (LoraLayer._cast_input_dtype).
ADAPTER_BYTES = 4


def resolve_targets(targets: tuple[str, ...], names: tuple[str, ...] = LINEARS) -> tuple[str, ...]:
    """PEFT's target_modules for a decoder layer whose linears are ``names`` (Llama's, or
    :data:`FUSED_LINEARS` for Phi-3): ``all-linear`` is every linear of the decoder layers (PEFT
    excludes the output head); a name the layer does not have matches nothing."""
    if ALL_LINEAR in targets:
        return names
    return tuple(name for name in names if name in targets)


def layer_linears(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear of a dense decoder layer, by transformers' name (Phi-3's
    fused ``qkv_proj`` and ``gate_up_proj`` where the spec fuses them)."""
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_size
    split = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv)}
    attention = {"qkv_proj": (h, q + 2 * kv)} if model.fused_qkv else split
    mlp = {"gate_up_proj": (h, 2 * f)} if model.fused_gate_up else {"gate_proj": (h, f), "up_proj": (h, f)}
    return {**attention, "o_proj": (q, h), **mlp, "down_proj": (f, h)}


def model_targets(model: ModelSpec, targets: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`resolve_targets` over ``model``'s own linears (:func:`layer_linears`)."""
    return resolve_targets(targets, tuple(layer_linears(model)))


def adapter_params(in_features: int, out_features: int, rank: int) -> int:
    """One LoRA adapter: lora_A r x in and lora_B out x r (no biases; PEFT ``LoraLayer``)."""
    return rank * (in_features + out_features)


def layer_adapter_params(model: ModelSpec, targets: tuple[str, ...], rank: int) -> int:
    """Adapter parameters of one decoder layer: the sum over its targeted linears."""
    linears = layer_linears(model)
    return sum(adapter_params(*linears[name], rank) for name in model_targets(model, targets))


def saved_module_params(model: ModelSpec, modules_to_save: tuple[str, ...]) -> dict[str, int]:
    """Elements of each trainable copy PEFT's ``ModulesToSaveWrapper`` makes (the original
    stays, frozen): lm_head V x h, embed_tokens V x h (tied or not: the copy is untied)."""
    v, h = model.vocab_size, model.hidden_size
    return {name: v * h for name in modules_to_save if name in SAVABLE}


def trainable_params(model: ModelSpec, targets: tuple[str, ...], rank: int, modules_to_save: tuple[str, ...]) -> int:
    """Parameters a LoRA / QLoRA step trains, whole model: every decoder layer's adapters and the
    ``modules_to_save`` copies (PEFT's ``print_trainable_parameters``); the base stays frozen."""
    adapters = model.num_layers * layer_adapter_params(model, targets, rank)
    return adapters + sum(saved_module_params(model, modules_to_save).values())


@record(slots=True)
class LoraLayer:
    """What one decoder layer keeps for its backward under LoRA, for one micro-batch:
    ``per_token`` bytes per token and, under autocast, ``weight_copies`` elements of weights
    whose d-byte casts the matmuls keep (frozen weights whose input requires grad, and the
    adapters)."""

    per_token: int
    weight_copies: int
    grad_out: bool  # the layer's output requires grad
    attention_kept: bool  # q, k or v requires grad: SDPA keeps its inputs and output

    def __init__(
        self,
        per_token: int,
        weight_copies: int,
        grad_out: bool,
        attention_kept: bool,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "per_token", per_token)
        _set(self, "weight_copies", weight_copies)
        _set(self, "grad_out", grad_out)
        _set(self, "attention_kept", attention_kept)


def hf_layer(
    model: ModelSpec,
    *,
    d: int,
    autocast: bool,
    attention: int,
    targets: tuple[str, ...],
    rank: int,
    dropout: bool,
    mask_bytes: int,
    grad_in: bool,
    adapter_bytes: int = ADAPTER_BYTES,
) -> LoraLayer:
    """Saved bytes per token of a transformers Llama-family decoder layer with PEFT LoRA on
    ``targets``, its base frozen (measured term by term, docs/cost-model.md):

    - each RMSNorm whose input requires grad: its fp32 input (the upcast, or the input itself
      in fp32 and under autocast) and rsqrt, ``4h + 4`` (no normalised value: frozen weight);
    - attention, when q, k or v requires grad: SDPA's q, k, v, output and log-sum-exp
      (``attention``, the runtime's term);
    - gated MLP: gate output and up output when the gate output requires grad (SiLU and the
      product's gradient for the activation), the SiLU output when the up output does: up to
      ``3df`` (the product feeds a frozen down_proj: not kept unless adapted);
    - each adapter: its input, the rank-r intermediate (``r x adapter bytes``; 2 under
      autocast). The input is shared with the tensor it reads when PEFT's cast to the adapter
      dtype is a no-op (fp32), else each adapter keeps its own cast (``adapter bytes x in``,
      or ``2 x in`` under autocast, which casts again for the matmul); with dropout each adapter
      keeps its dropout output and, if its input requires grad, the mask (CPU:
      ``input * bernoulli noise``, the noise in the input's dtype; CUDA: ``native_dropout``'s
      bool mask, 1 byte). The attention output an o_proj adapter reads is SDPA's (free when
      SDPA kept it); the product a down_proj adapter reads is kept for it alone.

    ``d``: bytes of the matmul outputs (the compute dtype); the norm outputs are fp32 under
    autocast. ``grad_in``: the layer's input requires grad (every layer but the first without
    checkpointing; all of them with ``enable_input_require_grads``)."""
    h, f = model.hidden_size, model.ffn_size
    linears = layer_linears(model)
    chosen = set(resolve_targets(targets))
    res = 4 if autocast else d  # the norms' outputs: fp32 under autocast
    inner = 2 if autocast else adapter_bytes  # the adapter's matmul inputs and outputs
    per_token = 0
    copies = 0
    saved_sources: set[str] = set()

    def adapt(name: str, source: str, source_bytes: int, grad: bool) -> int:
        """Bytes per token one adapter keeps, given the tensor it reads and whether that
        tensor requires grad; adds its weights' autocast copies."""
        nonlocal copies
        n_in, n_out = linears[name]
        if autocast:
            copies += n_out * rank + (rank * n_in if grad else 0)
        kept = rank * inner
        if dropout:
            mask = n_in * (mask_bytes or adapter_bytes) if grad else 0
            return kept + mask + n_in * inner
        if autocast or adapter_bytes != source_bytes:
            return kept + n_in * inner
        if source in saved_sources:
            return kept
        saved_sources.add(source)
        return kept + n_in * source_bytes

    def frozen(name: str, grad: bool) -> None:
        nonlocal copies
        if autocast and grad:
            copies += linears[name][0] * linears[name][1]

    norm = 4 * h + 4
    g = grad_in
    if g:
        per_token += norm
    for name in ("q_proj", "k_proj", "v_proj"):
        frozen(name, g)
        if name in chosen:
            per_token += adapt(name, "x1", res, g)
    qkv = g or bool(chosen & {"q_proj", "k_proj", "v_proj"})
    if qkv:
        per_token += attention
        saved_sources.add("attn")  # SDPA keeps its output, the tensor o_proj reads
    frozen("o_proj", qkv)
    if "o_proj" in chosen:
        per_token += adapt("o_proj", "attn", d, qkv)
    mid = g or qkv or "o_proj" in chosen
    if mid:
        per_token += norm
    for name in ("gate_proj", "up_proj"):
        frozen(name, mid)
        if name in chosen:
            per_token += adapt(name, "x2", res, mid)
    gate = mid or "gate_proj" in chosen
    up = mid or "up_proj" in chosen
    per_token += (2 * d * f if gate else 0) + (d * f if up else 0)
    mlp = gate or up
    frozen("down_proj", mlp)
    if "down_proj" in chosen:
        per_token += adapt("down_proj", "product", d, mlp)
    return LoraLayer(per_token, copies, mlp or "down_proj" in chosen, qkv)


def int8_ctx_inputs(model: ModelSpec, *, d: int, targets: tuple[str, ...], grad_in: bool) -> int:
    """Per token, the linear inputs an LLM.int8 layer's autograd nodes hold as ``ctx.A``
    (bitsandbytes 0.50.2 ``MatMul8bitFp``; ``MatMul8bitLt`` on CUDA likewise), which outlive the
    backward while the step's graph lives (``out`` kept: ``hf-loop``). A node exists only where
    the linear's input requires grad (``Function.apply`` records none otherwise), by the rule of
    :func:`hf_layer`: the q/k/v input (``h``) when the layer's input does, the o_proj input
    (``q``) when q, k or v does, the gate/up input (``h``) from then on, the down_proj input
    (``f``) when the gate or up output does. Measured on the tiny Llama (qlora-int8): layer 0
    holds ``q + h + f``, layer 1 ``2h + q + f``."""
    h, f = model.hidden_size, model.ffn_size
    chosen = set(resolve_targets(targets))
    qkv = grad_in or bool(chosen & {"q_proj", "k_proj", "v_proj"})
    mid = grad_in or qkv or "o_proj" in chosen
    mlp = mid or bool(chosen & {"gate_proj", "up_proj"})
    return d * ((h if grad_in else 0) + (model.q_size if qkv else 0) + (h if mid else 0) + (f if mlp else 0))


def checkpointed_layer_temp(
    model: ModelSpec, *, d: int, autocast: bool, targets: tuple[str, ...], dropout: bool, mask_bytes: int
) -> int:
    """Per token, what a checkpointed layer holds beyond its saved tensors at its backward's peak,
    the larger of two moments (measured without MemTracker's module hooks,
    tests/accuracy/storage_tracker.py; docs/cost-model.md):

    - the MLP's backward: the gradients of the product, the SiLU output and the up output
      (``3 d f``), less what an adapted down_proj saved from the product (its input, or its
      dropout output and mask: freed by its own backward, which runs first);
    - the recomputed down_proj forward when it is adapted: PEFT's ``Linear.forward`` holds its
      input (the product, ``d f``) through the adapter path, beside the base output and the
      scaled adapter output (``2 d h``)."""
    h, f = model.hidden_size, model.ffn_size
    if "down_proj" not in resolve_targets(targets):
        return 3 * d * f
    inner = 2 if autocast else ADAPTER_BYTES
    if dropout:
        freed = f * (mask_bytes or ADAPTER_BYTES) + f * inner
    else:
        freed = f * (inner if autocast or ADAPTER_BYTES != d else d)
    return max(3 * d * f - freed, d * f + 2 * d * h)


def hf_head_saved(model: ModelSpec, *, d: int, autocast: bool, head_trained: bool) -> int:
    """Per token, what the final norm and the LM head keep under LoRA (the runtime's logits,
    log_softmax output and labels aside): the norm's fp32 input and rsqrt ``4h + 4``; the LM
    head keeps its input only when trained (``modules_to_save: lm_head``): the norm output in
    d, or under autocast its 2-byte cast."""
    h = model.hidden_size
    head_input = (2 if autocast else d) * h if head_trained else 0
    return 4 * h + 4 + head_input
