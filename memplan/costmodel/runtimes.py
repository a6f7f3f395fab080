"""Runtime profiles: how one training code holds activations, by name.

The same model trained by different code keeps different tensors (eager vs flash attention,
fp32 norm upcasts, fp32 logits for the loss, outputs the loop keeps alive). A profile is the
set of functions the memory model asks, each for one micro-batch on one rank:

- ``layer``: what one transformer layer saves for backward (no recomputation);
- ``head``: what the last stage saves after the final norm: logits and the loss's tensors;
- ``loss_forward`` / ``loss_backward``: transients on top, at the end of the forward and at
  the start of the backward;
- ``retained``: what the training loop keeps across steps (transformers' returned outputs in a
  hand-written loop; nothing under the ``Trainer``, which keeps only the loss);
- ``grads_persistent``: gradients stay allocated across steps (contiguous grad buffers)
  instead of ``zero_grad(set_to_none=True)``;
- ``dynamic_cache``: transformers builds its DynamicCache in training (``use_cache=True``, a
  hand-written loop) and the outputs keep it through the backward;
- ``fused_adamw``: ``AdamW(fused=True)``, which updates in place (no foreach temporary).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from memplan.costmodel import activations as A
from memplan.costmodel.activations import Shape
from memplan.records import record


@record(slots=True)
class RuntimeProfile:
    name: str
    description: str
    layer: Callable[[Shape], int]
    head: Callable[[Shape], int]
    loss_forward: Callable[[Shape], int]
    loss_backward: Callable[[Shape], int]
    embedding: Callable[[Shape], int]
    retained: Callable[[Shape, int, bool], int]
    grads_persistent: bool
    master_grads_fp32: bool  # the optimizer step builds fp32 grads for the master weights
    dropout: bool  # dropout masks kept (1 byte per element)
    ddp_grad_copy: bool  # DDP buckets hold a second copy of the grads (no gradient_as_bucket_view)
    mlp_tensors: int  # f-wide tensors a gated MLP saves (MoE experts use the same count)
    autocast: bool  # bf16-mixed runs under torch.autocast (weight-cast cache, fp32 residuals)
    # PyTorch-native parallelism: ZeRO-2/3 by FSDP2, DDP grads as persistent bucket views,
    # DTensor TP (gathered SP inputs saved in full, replicated embedding grad, loss_parallel)
    pytorch_parallel: bool = False
    # what every model chunk's forward keeps once per micro-batch (None: counted in embedding)
    per_chunk: Callable[[Shape], int] | None = None
    # transformers' DynamicCache is built (use_cache=True) and kept with the outputs through the backward
    dynamic_cache: bool = False
    # AdamW(fused=True): the step updates in place, without foreach's state-sized temporary
    fused_adamw: bool = False

    def __init__(
        self,
        name: str,
        description: str,
        layer: Callable[[Shape], int],
        head: Callable[[Shape], int],
        loss_forward: Callable[[Shape], int],
        loss_backward: Callable[[Shape], int],
        embedding: Callable[[Shape], int],
        retained: Callable[[Shape, int, bool], int],
        grads_persistent: bool,
        master_grads_fp32: bool,
        dropout: bool,
        ddp_grad_copy: bool,
        mlp_tensors: int,
        autocast: bool,
        pytorch_parallel: bool = False,
        per_chunk: Callable[[Shape], int] | None = None,
        dynamic_cache: bool = False,
        fused_adamw: bool = False,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "name", name)
        _set(self, "description", description)
        _set(self, "layer", layer)
        _set(self, "head", head)
        _set(self, "loss_forward", loss_forward)
        _set(self, "loss_backward", loss_backward)
        _set(self, "embedding", embedding)
        _set(self, "retained", retained)
        _set(self, "grads_persistent", grads_persistent)
        _set(self, "master_grads_fp32", master_grads_fp32)
        _set(self, "dropout", dropout)
        _set(self, "ddp_grad_copy", ddp_grad_copy)
        _set(self, "mlp_tensors", mlp_tensors)
        _set(self, "autocast", autocast)
        _set(self, "pytorch_parallel", pytorch_parallel)
        _set(self, "per_chunk", per_chunk)
        _set(self, "dynamic_cache", dynamic_cache)
        _set(self, "fused_adamw", fused_adamw)


def _vocab(x: Shape) -> int:
    return x.model.vocab_size


# --- megatron: Korthikanti et al. 2022, Sec. 4 -------------------------------------------


def megatron_layer(x: Shape) -> int:
    """Table 2: sbh(34 + 5as/h) generalised (GQA, SwiGLU, flash), with TP / SP splits."""
    return A.korthikanti_replicated(x) + A.korthikanti_parallel(x) + A.korthikanti_attention_core(x)


def megatron_head(x: Shape) -> int:
    """Sec. 4.3: final norm input and output-layer input (2 x dh, split by t with SP),
    logits b*s*V/t in d and the cross-entropy's fp32 softmax 4sbV/t."""
    norm = 2 * x.tokens * x.d * x.model.hidden_size // x.rep
    return norm + A.logits(x, _vocab(x)) + A.fp32_logits(x, _vocab(x))


def megatron_loss_backward(x: Shape) -> int:
    """The vocab-parallel cross-entropy writes its fp32 gradient into the saved softmax; the
    cast of that gradient to the compute dtype for the output layer's backward is extra."""
    return A.logits(x, _vocab(x))


def megatron_embedding(x: Shape) -> int:
    """Embedding dropout mask, 1 byte per element (Sec. 4.3), split by t with SP."""
    return x.tokens * x.model.hidden_size // x.rep if x.dropout else 0


def _nothing(x: Shape) -> int:
    return 0


def _nothing_retained(x: Shape, layers: int, recompute: bool) -> int:
    return 0


MEGATRON = RuntimeProfile(
    name="megatron",
    description="Megatron-LM: Korthikanti et al. 2022 per-layer activations, dropout masks, "
    "fp32 vocab-parallel cross-entropy, contiguous fp32-free grad buffers",
    layer=megatron_layer,
    head=megatron_head,
    loss_forward=_nothing,
    loss_backward=megatron_loss_backward,
    embedding=megatron_embedding,
    retained=_nothing_retained,
    grads_persistent=True,
    master_grads_fp32=True,
    dropout=True,
    ddp_grad_copy=False,
    mlp_tensors=3,
    autocast=False,
)


# --- hf-loop: a hand-written transformers training loop of the Llama family -------------


def hf_layer(x: Shape, dynamic_cache: bool = True) -> int:
    """LlamaDecoderLayer: two RMSNorms, attention (SDPA or eager), gated MLP.

    The residual stream needs no extra term: in fp32 each norm keeps its input (the layer
    input, then the mid-layer residual); below fp32 the norms keep fp32 copies and the bf16
    residuals are freed once added. ``dynamic_cache``: transformers' key/value cache, which the
    bundled trainer and the transformers ``Trainer`` (``use_cache=False``) do not build
    (:func:`activations.hf_sdpa_attention`).
    """
    if x.model.mla is not None:
        attention = A.mla_attention(x, dynamic_cache)
    elif x.eager:
        attention = A.hf_eager_attention(x)
    else:
        attention = A.hf_sdpa_attention(x, dynamic_cache)
    casts = A.autocast_input_casts(x, 3 + 2)  # q, k, v and gate, up
    family = A.qk_norm(x) + A.fused_qkv(x)
    masked = A.masked_layers(x) if not x.eager else 0
    if masked:  # the layers' mean: sliding / chunked layers beside full ones
        family += masked * A.sdpa_mask_extra(x, dynamic_cache) // x.model.num_layers
    return A.layer_norms(x) + attention + A.hf_mlp(x) + casts + family


def hf_head(x: Shape) -> int:
    """Final norm, logits (kept by the returned ``out``) in d, the fp32 log_softmax output
    that cross_entropy saves, and the shifted int64 labels (2 x 8 bytes per token)."""
    labels = 16 * x.tokens
    casts = A.autocast_input_casts(x, 1)
    softcap = A.softcapped_logits(x, _vocab(x))
    return A.final_norm(x) + casts + A.logits(x, _vocab(x)) + softcap + A.fp32_logits(x, _vocab(x)) + labels


def hf_loss_forward(x: Shape) -> int:
    """``ForCausalLMLoss`` upcasts the logits (``logits.float()``): a fp32 copy while
    log_softmax runs (none when the logits are already fp32)."""
    return A.fp32_logits(x, _vocab(x)) if x.d < 4 else 0


def hf_loss_backward(x: Shape) -> int:
    """nll_loss's gradient and log_softmax's gradient, both fp32 b*s*V, beside the saved
    log_softmax output (measured: +2 x 4bsV at the start of the backward)."""
    return 2 * A.fp32_logits(x, _vocab(x))


def hf_embedding(x: Shape) -> int:
    """RoPE cos and sin (1, s, head_dim) in the residual dtype, shared by all layers, and
    int64 position ids."""
    d = 4 if x.autocast else x.d
    return 2 * x.s * x.model.head_size * d + 8 * x.s


def hf_retained(x: Shape, layers: int, recompute: bool) -> int:
    """The loop ``out = model(...); out.loss.backward(); opt.step()`` keeps ``out`` until
    the next forward returns: logits in d and, unless gradient checkpointing turned
    ``use_cache`` off, the DynamicCache of every layer's RoPE'd keys and values."""
    # under autocast RoPE promotes the keys to fp32 (cos / sin are fp32) and the cache keeps
    # keys and values in fp32 (measured)
    element = 4 if x.autocast else x.d
    cache = 0 if recompute else layers * 2 * x.tokens * element * x.model.kv_size // x.t
    return A.logits(x, _vocab(x)) + cache


HF_LOOP = RuntimeProfile(
    name="hf-loop",
    description="hand-written transformers Llama-family loop: out = model(input_ids, labels), "
    "out.loss.backward(), AdamW(foreach=True).step(), zero_grad(set_to_none=True), out kept until the "
    "next forward returns; SDPA or eager attention",
    layer=hf_layer,
    head=hf_head,
    loss_forward=hf_loss_forward,
    loss_backward=hf_loss_backward,
    embedding=hf_embedding,
    retained=hf_retained,
    grads_persistent=False,
    master_grads_fp32=False,
    dropout=False,
    ddp_grad_copy=True,
    mlp_tensors=4,
    autocast=True,
    dynamic_cache=True,
)


# --- hf: transformers' Trainer (transformers 5.23) --------------------------------------


def trainer_layer(x: Shape) -> int:
    """The hf-loop layer without a DynamicCache: the ``Trainer`` sets ``model.config.use_cache``
    to ``args.use_cache`` (False by default), so there are no cached fp32 keys and values under
    autocast, no cached k and v beside the math path's copies, and in eager attention with GQA
    the unrepeated k and v are freed once ``repeat_kv`` has copied them (the matmuls save the
    copies; measured on CPU, docs/cost-model.md)."""
    layer = hf_layer(x, dynamic_cache=False)
    if x.eager and x.model.kv_heads < x.model.num_attention_heads:
        layer -= x.tokens * x.d * 2 * x.model.kv_size // x.t
    return layer


def trainer_head(x: Shape) -> int:
    """The hf-loop head without the logits: ``compute_loss`` returns the loss alone, so the
    outputs holding the logits go before ``accelerator.backward(loss)``, and no backward saves
    the logits (log_softmax saves its fp32 output)."""
    return hf_head(x) - A.logits(x, _vocab(x))


def trainer_loss_forward(x: Shape) -> int:
    """Until ``compute_loss`` returns, the outputs hold the logits in d beside the fp32 upcast
    (under bf16-mixed accelerate's ``convert_outputs_to_fp32`` swaps the bf16 logits for an fp32
    copy: no more than the upcast, which is freed by then)."""
    return A.logits(x, _vocab(x)) + hf_loss_forward(x)


HF = replace(
    HF_LOOP,
    name="hf",
    description="transformers Trainer.training_step: loss = compute_loss(model, inputs) (outputs let go, "
    "use_cache=False), accelerator.backward(loss), clip_grad_norm_, AdamW(fused=True).step() (the default "
    "optim adamw_torch_fused), model.zero_grad(); SDPA or eager attention",
    layer=trainer_layer,
    head=trainer_head,
    loss_forward=trainer_loss_forward,
    retained=_nothing_retained,
    dynamic_cache=False,
    fused_adamw=True,
)

# --- memplan: the bundled trainer --------------------------------------------------------


def memplan_head(x: Shape) -> int:
    """Final norm and the fp32 log_softmax output cross_entropy saves; the logits themselves
    are freed inside the loss (nothing returns them), and the labels are one int64 tensor."""
    casts = A.autocast_input_casts(x, 1)
    return A.hf_rmsnorm(x) + casts + _sp_gathered(x) + A.fp32_logits(x, _vocab(x)) + 8 * x.tokens


def memplan_layer(x: Shape) -> int:
    """The hf layer; under sequence parallelism DTensor all-gathers each norm's output before
    the column-parallel matmuls, which save the gathered (full-sequence) copy: d*h per token
    instead of d*h/t for each of the two norms (measured, docs/cost-model.md). No
    DynamicCache: under autocast the fp32 RoPE'd keys are freed once SDPA has cast them."""
    return hf_layer(x, dynamic_cache=False) + 2 * _sp_gathered(x)


def _sp_gathered(x: Shape) -> int:
    """Extra bytes of one all-gathered norm output kept in full under SP: d*h*(1 - 1/t). None
    under autocast: the gathered output is fp32 and each matmul saves its own d-byte cast of it
    (:func:`activations.autocast_input_casts`, the whole sequence); the gathered copy dies with the
    module's forward (``trainer_model.Model.attention``, ``mlp``, ``head``: ``t.done(..., xg)``)."""
    if not x.sp or x.autocast:
        return 0
    return x.tokens * x.d * x.model.hidden_size - x.tokens * x.d * x.model.hidden_size // x.t


def memplan_loss_forward(x: Shape) -> int:
    """While log_softmax runs, the logits (in d) are alive beside its fp32 output, and below
    fp32 their fp32 upcast too; both are freed when the loss returns. Vocab-parallel
    (``loss_parallel``) log_softmax keeps one more fp32 b*s*V/t temporary."""
    upcast = A.fp32_logits(x, _vocab(x)) if x.d < 4 else 0
    parallel = A.fp32_logits(x, _vocab(x)) if x.t > 1 else 0
    return A.logits(x, _vocab(x)) + upcast + parallel


def memplan_loss_backward(x: Shape) -> int:
    """hf's two fp32 gradients, and one more fp32 b*s*V/t in the vocab-parallel backward."""
    parallel = A.fp32_logits(x, _vocab(x)) if x.t > 1 else 0
    return hf_loss_backward(x) + parallel


def memplan_embedding(x: Shape) -> int:
    """The int64 token ids (first stage)."""
    return 8 * x.tokens


def rope_tables(x: Shape) -> int:
    """RoPE's cos and sin (s, head_dim) in the residual dtype, built by every model chunk's
    forward and saved by its layers."""
    d = 4 if x.autocast else x.d
    return 2 * x.s * x.model.head_size * d


MEMPLAN = replace(
    HF_LOOP,
    name="memplan",
    description="memplan's bundled trainer: the transformers Llama layer accounting (fp32 "
    "RMSNorm, flash attention, fp32 loss) without outputs kept across steps",
    layer=memplan_layer,
    head=memplan_head,
    loss_forward=memplan_loss_forward,
    loss_backward=memplan_loss_backward,
    embedding=memplan_embedding,
    per_chunk=rope_tables,
    pytorch_parallel=True,
    retained=_nothing_retained,
    master_grads_fp32=True,
    ddp_grad_copy=False,
    dynamic_cache=False,
)

RUNTIMES: dict[str, RuntimeProfile] = {p.name: p for p in (MEGATRON, HF, HF_LOOP, MEMPLAN)}
