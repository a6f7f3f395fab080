"""Per-rank memory of a training step or an inference batch: the peak over phases.

A steady-state training step peaks in one of three phases (DESIGN.md, "Phases"):

- forward end: model states, every in-flight micro-batch's saved activations, the logits and
  the loss's tensors, and what the loop still holds from the previous step;
- backward start: the same minus the forward-only transients, plus the loss gradients (and,
  with recomputation, one layer's activations rebuilt); backward end: gradients complete;
- optimizer step: parameters, gradients, states and the step's temporaries.

Pipeline stages differ, so the first and the last stage are both evaluated and the report
is for the one with the higher peak (the most-loaded rank).

A function whose docstring ends "Also in the op-level run: ``timeline/...``" sums the bytes of a
mechanism that the op-level run (``costmodel/timeline``) replays op by op. These sums stay for three
callers: the search's fast form (``training_peak`` with a :class:`MemoryMemo`, ``search/evaluate.py``),
which scores full-training plans with them because the run costs some 380 times the sums a plan
(docs/cost-model.md, "The search's fast form against the run", "A derivation tried and not kept");
advice's screen of a changed plan and ``tune``'s host check; and a plan the run declines for another
feature (MoE, CP, EP, fp8, ...), which takes the phase model's whole account. docs/cost-model.md, "What
the op-level run does not reach yet", lists those plans.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from heapq import heapreplace
from operator import attrgetter
from typing import NamedTuple

from memplan.costmodel import activations as A
from memplan.costmodel import fp8 as F8
from memplan.costmodel import inference as I
from memplan.costmodel import lora as L
from memplan.costmodel import overhead as O
from memplan.costmodel import params as P
from memplan.costmodel import trainer_offload as TO
from memplan.costmodel.build_blocks import parameter_block_excess
from memplan.costmodel.layout import StageLayout, stage_layer_indices, stage_layout, vocab_shard_params
from memplan.costmodel.precision import KV_BYTES, POLICIES, PrecisionPolicy
from memplan.costmodel.rank import (
    Device,
    device_states,
    factored_share,
    gradient_accumulation,
    model_states,
    sdpa_kind,
    stage_role,
)
from memplan.costmodel.rank import States as _States
from memplan.costmodel.report import Activations, MemoryReport, ModelStates, Offload, Peak
from memplan.costmodel.report import Prefill as PrefillReport
from memplan.costmodel.runtimes import RUNTIMES, RuntimeProfile
from memplan.costmodel.timeline.events import Moment, Timeline
from memplan.costmodel.timeline.schedule import (
    backward_first,
    chunks_in_flight,
    last_chunk_outputs,
    schedule_actions,
    sends_held,
)
from memplan.costmodel.timeline.step import Granularity, build_serving_run, pieces
from memplan.errors import MemplanError
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

ZERO3_PREFETCH_LAYERS = 2  # FSDP / ZeRO-3: the current layer and the one prefetched


def inflight_layers(plan: Plan, stage: int, accumulation: int, layers: int) -> float:
    """Layers' worth of one micro-batch's activations held at once on pipeline rank ``stage``:
    without a pipeline, one micro-batch; with one, the chunks in flight in the run's schedule
    (``timeline.schedule.chunks_in_flight``) of L/(p v) layers each.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    if plan.pp == 1:
        return layers
    v = plan.virtual_stages
    return chunks_in_flight(plan.pp_schedule, plan.pp, v, stage, accumulation) * layers / v


def inflight_microbatches(plan: Plan, stage: int, accumulation: int) -> int:
    """Micro-batches whose forward has run but not their backward, on pipeline rank ``stage``.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    if plan.pp == 1:
        return 1
    if plan.pp_schedule == "gpipe":
        return accumulation
    return min(plan.pp - stage, accumulation)


_CUBLAS_WORKSPACES = O.cublas_workspaces("memplan", "cuda")  # read once: the search's cost (``_stage_phases``)


def zero1_shard(model: ModelSpec, plan: Plan, rt: RuntimeProfile) -> int | None:
    """The elements the most-loaded rank's optimizer steps under the bundled trainer's ZeRO-1
    (``ZeroRedundancyOptimizer`` over DDP, one stage, no TP, a dense model: the plans its run
    models), or None where the partition is the even ``1 / dp`` of :func:`model_states`.
    ``ZeroRedundancyOptimizer._partition_parameters`` (torch/distributed/optim/zero_redundancy_optimizer.py)
    gives whole parameters, largest first, to the rank holding the fewest elements so far
    (``timeline/zero1.py``, the run's), so one rank holds the embedding's states, another the LM head's:
    at dp 8 on a 1B Llama the most-loaded rank holds 1.7 times the even share (the run's states at
    its peak: docs/cost-model.md, "The search's fast form against the run").

    Also in the op-level run: ``timeline/zero1.py`` (kept: module docstring)."""
    if rt.name != "memplan" or plan.zero != 1 or plan.dp == 1 or plan.pp * plan.tp * plan.cp * plan.ep > 1:
        return None
    if model.moe:
        return None
    shape = (model.hidden_size, model.q_size, model.kv_size, model.ffn_size, model.vocab_size, model.num_layers)
    return _zero1_most_loaded(shape, model.qkv_bias, model.tied_embeddings, plan.dp)


@lru_cache(maxsize=64)
def _zero1_most_loaded(shape: tuple[int, ...], qkv_bias: bool, tied: bool, dp: int) -> int:
    """:func:`zero1_shard` of a dense Llama's parameters (``timeline.trainer_model.param_shapes`` at
    TP 1), once per shape and degree: ``timeline.zero1.partition``'s greedy walk (largest first, to the
    rank of the fewest elements, the lowest of equals) over a heap of (elements, rank), the same
    choice each time (tests/search/test_fast_form_grid.py holds the two equal)."""
    h, q, kv, f, vocab, layers = shape
    layer = [h, q * h, kv * h, kv * h, h * q, h, f * h, h * f, f * h] + ([q, kv, kv] if qkv_bias else [])
    numels = sorted([vocab * h, h, *layer * layers, *([] if tied else [vocab * h])], reverse=True)
    loads = [(0, rank) for rank in range(dp)]
    for n in numels:
        heapreplace(loads, (loads[0][0] + n, loads[0][1]))
    return max(loads)[0]


def lora_extra(x: A.Shape, plan: Plan) -> int:
    """Per layer, what the adapters add to a full-training layer term (runtimes other than
    ``hf``): each adapter's rank-r fp32 intermediate, kept for lora_B's gradient.

    Also in the op-level run: ``timeline/lora.py, hf_lora.py`` (kept: module docstring)."""
    return x.tokens * len(L.resolve_targets(plan.lora_targets)) * plan.lora_rank * L.ADAPTER_BYTES


def _transformers_layers(rt: RuntimeProfile) -> bool:
    """Runtimes that run transformers' own decoder layers (the Trainer step and the loop)."""
    return rt.name in ("hf", "hf-loop")


def _lora_layers(rt: RuntimeProfile) -> bool:
    """Runtimes whose LoRA layers ``lora_activations`` describes: transformers' with PEFT, and the
    bundled trainer's (``memplan``: the transformers Llama graph, ``memplan_layer``, with
    memplan.train.lora's PEFT-like adapters). Until 2026-11-24 the ``memplan`` runtime counted a
    full-training layer plus ``lora_extra``: measured on its own trainer (CPU, tiny GQA Llama,
    2 x 160 tokens) 17-19% too much with q/v targets in fp32, as the frozen linears and norms
    keep no input for a weight gradient, and 10% too little with all-linear in bf16-master, where
    each adapter keeps its own fp32 cast of its input (docs/cost-model.md)."""
    return _transformers_layers(rt) or rt.name == "memplan"


@dataclass(frozen=True, slots=True)
class _LoraActs:
    stored: int  # every layer of one micro-batch
    per_layer: int  # a layer whose input requires grad (as stored)
    live_layer: int  # the last layer in its backward, everything back
    head_delta: int  # to add to the runtime's head term (the frozen LM head keeps less)
    weight_copies: int  # autocast: d-byte weight casts the matmuls keep (replaces autocast_weights)
    # (checkpointed: the LM head's only; the recomputed layer's are in ``temp``)
    earlier: int  # at the last layer's backward, what the other layers still keep
    temp: int  # the last layer's gradient temporaries at its backward's peak (in its MLP)
    retained: int  # the previous step's int8 linear inputs its kept graph holds (hf-loop)


def int8_layer_inputs(model: ModelSpec, x: A.Shape, plan: Plan) -> int:
    """What an LLM.int8 base keeps per layer beyond a 4-bit one (bitsandbytes 0.50.2, training).

    ``bnb.matmul`` in training on CPU runs ``MatMul8bitFp``, which stores its input as a ctx
    attribute (``ctx.A = A``, not ``save_for_backward``) whether or not the frozen int8 weight
    needs a gradient; on CUDA ``MatMul8bitLt`` does the same (``ctx.tensors = (CAt, subA, A)``,
    ``CAt`` / ``subA`` empty for a frozen weight). Of the seven linears' inputs, the q/k/v input
    (kept by lora_A under q/v targets) and the o_proj input (SDPA's saved output) are kept
    anyway; the new ones are the post-attention norm's output (gate/up input, ``h``) and the
    down_proj input (``f``), in the activation dtype (with adapters off q/v the q/k/v input
    would be new too: not measured). Measured with MemTracker on the tiny
    Llama (qlora-int8): 2 x 128 x 4 x (64 + 160) = 229,376 B, exactly the within-step excess
    over the same model on an nf4 base. Holding them as attributes also means they outlive the
    backward while the step's graph lives (``out`` kept, ``hf-loop``): not modelled.

    Also in the op-level run: ``timeline/int8.py`` (kept: module docstring)."""
    if plan.quant != "int8":
        return 0
    return x.tokens * x.d * (model.hidden_size // x.rep + model.ffn_size // x.t)


def checkpointed_int8_inputs(model: ModelSpec, x: A.Shape, plan: Plan, rt: RuntimeProfile) -> int:
    """Per layer, under ``recompute: full`` over an LLM.int8 base, the linear inputs that the
    checkpointed forward's own int8 nodes keep (the bundled trainer: ``memplan`` runtime).

    A non-reentrant checkpoint runs the layer's forward with grad on and takes over only what
    ops save for backward (its ``saved_tensors_hooks``); bitsandbytes' ``MatMul8bitFp`` stores
    its input as ``ctx.A``, an attribute no hook sees, so each frozen int8 linear whose input
    requires grad (all of them: ``enable_input_require_grads``) keeps it until the step's graph
    dies (``lora.int8_ctx_inputs`` with ``grad_in``: ``h + q + h + f`` per token). Measured on
    the bundled trainer (CPU, tiny GQA Llama, q/v adapters, fp32, 2 x 160 tokens): 4 layers x
    320 x 4 x 1,088 = 5,570,560 B, the whole of the forward's and backward's -26% / -22%.
    transformers checkpoints the same way (``use_reentrant=False`` by default) but the ``hf``
    runtimes were not measured under it: not counted there.

    Also in the op-level run: ``timeline/int8.py`` (kept: module docstring)."""
    if plan.quant != "int8" or rt.name != "memplan":
        return 0
    return x.tokens * L.int8_ctx_inputs(model, d=x.d, targets=plan.lora_targets, grad_in=True) // x.t


def lora_activations(
    model: ModelSpec, x: A.Shape, plan: Plan, rt: RuntimeProfile, layout: StageLayout, device: Device
) -> _LoraActs:
    """Activations of one micro-batch under LoRA. ``hf`` runtime: ``lora.hf_layer`` (what a
    transformers layer keeps when its base is frozen, by which tensors require grad) and
    ``lora.hf_head_saved``; layer 0 of the first stage keeps less unless its input requires
    grad (gradient checkpointing with ``enable_input_require_grads``, or a trained
    embed_tokens). Other runtimes: their full-training layer (an upper bound: it keeps what
    the frozen weights' gradients would need) plus each adapter's rank-r fp32 intermediate
    (``lora_extra``). Selective recomputation is not modelled under LoRA: counted as none.

    Also in the op-level run: ``timeline/lora.py, hf_lora.py`` (kept: module docstring)."""
    tokens = x.tokens
    layers = layout.layers
    # transformers' DynamicCache, built in training and kept with the outputs (the runtime says)
    kept = getattr(rt, "dynamic_cache", getattr(rt, "outputs_kept", rt.name == "hf"))
    if x.eager:
        attention = A.hf_eager_attention(x)
        cache = 0
    else:
        attention = A.hf_sdpa_attention(x, dynamic_cache=False)
        cache = A.hf_sdpa_attention(x, dynamic_cache=True) - attention if kept else 0
    first_grad = plan.recompute == "full" or "embed_tokens" in plan.modules_to_save or not layout.is_first

    def layer(grad_in: bool) -> L.LoraLayer:
        return L.hf_layer(
            model,
            d=x.d,
            autocast=x.autocast,
            attention=attention // tokens,
            targets=plan.lora_targets,
            rank=plan.lora_rank,
            dropout=plan.lora_dropout > 0,
            mask_bytes=1 if device == "cuda" else 0,
            grad_in=grad_in,
        )

    rest, first = layer(True), layer(first_grad)
    rest_b = rest.per_token * tokens + cache + int8_layer_inputs(model, x, plan)
    first_b = first.per_token * tokens + cache + int8_layer_inputs(model, x, plan)
    if kept and not first.attention_kept and not x.eager and not x.autocast and x.sdpa != "math":
        # SDPA keeps nothing of a layer no gradient reaches before its attention, but the
        # DynamicCache still holds that layer's RoPE'd keys and values (measured)
        first_b += tokens * 2 * x.d * model.kv_size // x.t
    if plan.recompute == "full":
        per_layer = A.layer_input(x) + checkpointed_int8_inputs(model, x, plan, rt)
        stored = layers * per_layer
    else:
        stored = first_b + (layers - 1) * rest_b if layers else 0
        per_layer = rest_b
    live = rest_b if layers > 1 or first_grad else first_b
    # checkpointed, every layer's input stays (the last one's too, held by its checkpoint);
    # otherwise every layer but the last keeps what it saved
    earlier = stored if plan.recompute == "full" else max(stored - live, 0)
    if plan.recompute == "full":  # the recomputed layer's peak beside its saved tensors
        mask_bytes = 1 if device == "cuda" else 0
        temp = tokens * L.checkpointed_layer_temp(
            model, d=x.d, autocast=x.autocast, targets=plan.lora_targets, dropout=plan.lora_dropout > 0,
            mask_bytes=mask_bytes,
        ) // x.t  # fmt: skip
    else:
        temp = layer_temp(x)
    copies = 0
    if x.autocast and plan.recompute == "full":
        # checkpointed, the layers' forwards keep no cast; the recomputed layer's casts are
        # alive in its backward (with its other saved tensors, in ``temp``)
        temp += rest.weight_copies * x.d if layers else 0
    elif x.autocast:
        copies = (first.weight_copies + max(layers - 1, 0) * rest.weight_copies) * x.d if layers else 0
    if x.autocast and layout.is_last:
        copies += vocab_shard_params(model, plan.tp) * x.d  # the LM head's, tied or not
    head_delta = 0
    if layout.is_last:
        saved = L.hf_head_saved(model, d=x.d, autocast=x.autocast, head_trained="lm_head" in plan.modules_to_save)
        head_delta = saved * tokens - A.hf_rmsnorm(x) - A.autocast_input_casts(x, 1)
    retained = 0
    if plan.quant == "int8" and kept and plan.recompute != "full" and layers:
        # checkpointed, the recomputed nodes die with the backward; otherwise ``out`` keeps them
        retained = tokens * (
            L.int8_ctx_inputs(model, d=x.d, targets=plan.lora_targets, grad_in=first_grad)
            + (layers - 1) * L.int8_ctx_inputs(model, d=x.d, targets=plan.lora_targets, grad_in=True)
        )
    return _LoraActs(stored, per_layer, live, head_delta, copies, earlier, temp, retained)


# --- activation offload to CPU (plan.offload_activations) --------------------------------

TRL_MIN_OFFLOAD_BYTES = 1024  # TRL's / torchtune's OffloadActivations(min_offload_size=1024)
# what each loop runs for offload_activations: cpu (the bundled trainer: memplan.train.offload)
OFFLOAD_MECHANISM = {"hf": "trl", "hf-loop": "save_on_cpu", "memplan": "save_on_cpu"}


@dataclass(frozen=True, slots=True)
class _ActOffload:
    kept: int  # of one micro-batch's layer activations, what stays on the device through the forward
    last: int  # of those, the last layer's
    node: int  # brought back at a layer's backward peak (its MLP product's node), beyond ``last``
    head_kept: int  # the head's saved tensors left on the device at the end of the forward
    copies_kept: int  # autocast weight copies left on the device once the forward has returned
    host: int  # pinned host bytes of one micro-batch's offloaded tensors
    head_back: int  # on the device at the start of the backward beyond the head's term
    stash: int  # on the device when the loss runs at the end of the forward, beyond the kept ones
    mlp_forward: int  # the last layer's MLP forward at its product: SiLU output, up output, product
    mechanism: str
    # the bundled trainer's (``memplan``) only: what the loss's backward holds of the head (None:
    # the head's term), and at the embedding's backward beside every gradient (0: not a moment)
    bwd_head: int | None = None
    embedding_backward: int = 0
    # and the first layer's MLP backward: (its weight gradients made, bytes held) at its widest node;
    # the first layer's first norm's backward beside every gradient but the embedding's
    mlp_backward: tuple[int, int] | None = None
    norm_backward: int = 0


def offload_mechanism(plan: Plan, rt: RuntimeProfile) -> str:
    """Which saved-tensor hooks ``offload_activations: cpu`` stands for in this loop, or a
    :class:`MemplanError` naming the field where the plan cannot run it:

    - ``hf`` (the Trainer): TRL's ``OffloadActivations`` (``SFTConfig(activation_offloading=True)``,
      axolotl's ``activation_offloading: true``), streamed;
    - ``hf-loop`` (a hand-written loop): ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
      around the forward and backward, synchronous;
    - ``memplan`` (the bundled trainer): ``save_on_cpu(pin_memory=True)`` around each
      micro-batch's forward and loss (:func:`memplan_offload`).

    Megatron-LM's fine-grained offload is not modelled.

    Also in the op-level run: ``timeline/act_offload.py, hf_offload.py`` (kept: module docstring)."""
    if rt.name not in OFFLOAD_MECHANISM:
        raise MemplanError(
            f"activation offload is modelled for the hf runtime (TRL's activation_offloading), hf-loop "
            f"(save_on_cpu) and the bundled trainer (memplan), not runtime {rt.name}: use --runtime hf, "
            "hf-loop or memplan",
            field="plan.offload_activations",
        )
    if rt.name == "memplan" and (reason := TO.unmodelled(plan)) is not None:
        raise MemplanError(reason, field="plan.offload_activations")
    return OFFLOAD_MECHANISM[rt.name]


def trl_kept_layer(model: ModelSpec, x: A.Shape, plan: Plan, grad_in: bool) -> int:
    """What TRL's ``OffloadActivations`` leaves on the device of one transformers decoder layer
    (no recomputation), for one micro-batch. Its pack hook offloads every saved tensor but
    parameters, tensors under 1024 bytes and a storage it has already offloaded in this forward
    (same address and dtype: the second save keeps the tensor itself). So what two ops save
    stays (measured on CPU, tests/accuracy/offload_steps.py):

    - each RMSNorm whose input requires grad: its fp32 input (or upcast), saved by ``pow`` and
      by the ``mul`` with rsqrt, 4h; the rsqrt itself (4 bytes a token) when under 1024 bytes;
    - full training: the norm output q, k and v all save, and the one gate and up save, d*h
      each (under autocast each matmul saves its own cast: none); o_proj's input, which is the
      fused SDPA kernel's output storage, d*q;
    - LoRA: an input two adapters read without a cast of their own (fp32, no dropout): the
      q/k/v input and the gate/up input (d*h), SDPA's output for an o_proj adapter (d*q);
    - the fused kernel's log-sum-exp (4 bytes a head a token) when under 1024 bytes.

    Also in the op-level run: ``timeline/hf_offload.py`` (kept: module docstring)."""
    m, tokens, d = model, x.tokens, x.d
    h = m.hidden_size // x.rep
    small = 4 * tokens < TRL_MIN_OFFLOAD_BYTES
    fused = not x.eager and x.sdpa != "math"
    if plan.finetune == "full":
        norms, attn_kept = 2, True
        shared = 0 if x.autocast else 2 * d * h + (d * m.q_size // x.t if fused else 0)
    else:
        chosen = set(L.resolve_targets(plan.lora_targets))
        qkv = grad_in or bool(chosen & {"q_proj", "k_proj", "v_proj"})
        mid = grad_in or qkv or "o_proj" in chosen
        norms, attn_kept = int(grad_in) + int(mid), qkv
        plain = not x.autocast and d == L.ADAPTER_BYTES and plan.lora_dropout == 0
        shared = 0
        if plain:
            shared += d * h if len(chosen & {"q_proj", "k_proj", "v_proj"}) >= 2 else 0
            shared += d * h if {"gate_proj", "up_proj"} <= chosen else 0
            shared += d * m.q_size // x.t if fused and qkv and "o_proj" in chosen else 0
    kept = tokens * (norms * (4 * h + (4 if small else 0)) + shared)
    lse = tokens * 4 * m.num_attention_heads // x.t
    if attn_kept and fused and lse < TRL_MIN_OFFLOAD_BYTES:
        kept += lse
    return kept


def saved_weight_bytes(
    model: ModelSpec, layout: StageLayout, plan: Plan, x: A.Shape, lora_acts: _LoraActs | None
) -> int:
    """The weights a stage's forward saves for its backward, which ``save_on_cpu`` copies to the
    host like any saved tensor: every linear and norm weight in full training (the LM head's on
    the last stage), under LoRA the frozen linears whose input requires grad and the adapters
    (``lora.hf_layer``'s autocast count), in the parameter dtype; none under autocast, whose
    matmuls save the d-byte copies (counted with the autocast weight copies) and no gradient
    checkpointing (the recomputed layers save theirs in the backward).

    Also in the op-level run: ``timeline/act_offload.py, hf_offload.py`` (kept: module docstring)."""
    if x.autocast or plan.recompute == "full":
        return 0
    pb = POLICIES[plan.precision].param_bytes if plan.quant == "none" else 4
    head = vocab_shard_params(model, plan.tp) if layout.is_last else 0
    if lora_acts is None:
        return (layout.layer_params + head) * pb
    layer = L.hf_layer(
        model, d=x.d, autocast=True, attention=0, targets=plan.lora_targets, rank=plan.lora_rank,
        dropout=plan.lora_dropout > 0, mask_bytes=0, grad_in=True,
    )  # fmt: skip
    return (layout.layers * layer.weight_copies + head) * pb


def activation_offload(
    model: ModelSpec,
    x: A.Shape,
    plan: Plan,
    rt: RuntimeProfile,
    layout: StageLayout,
    stored: int,
    head: int,
    weight_copies: int,
    lora_acts: _LoraActs | None,
) -> _ActOffload:
    """What ``offload_activations: cpu`` moves off the device for one micro-batch (``stored``:
    its layers' saved activations, ``head``: the head's term), by :func:`offload_mechanism`.

    Gradient checkpointing: transformers checkpoints each layer without reentrance, and the
    checkpoint holds the layer's inputs itself (its recomputation closes over them) while its
    own saved-tensor hooks take the layer's saves, so neither mechanism moves anything of the
    layers (measured: the same peak as without offload); only what the head saves goes.

    ``save_on_cpu`` copies every saved tensor to the host, parameters included, and leaves
    nothing. TRL's hooks leave what :func:`trl_kept_layer` counts, the LM head's saves (a no-op
    hook pair around ``lm_head``) and the loss's log_softmax output (nll_loss saves it again);
    the final norm's normalised value and the int64 labels go.

    Also in the op-level run: ``timeline/act_offload.py, hf_offload.py`` (kept: module docstring)."""
    mechanism = offload_mechanism(plan, rt)
    if rt.name == "memplan":
        return memplan_offload(model, x, plan, layout, weight_copies)
    tokens, layers = x.tokens, layout.layers
    checkpointed = plan.recompute == "full"
    normalised = tokens * (4 if x.autocast else x.d) * model.hidden_size // x.rep if plan.finetune == "full" else 0
    labels = 8 * tokens if 8 * tokens >= TRL_MIN_OFFLOAD_BYTES else 0
    head_moved = normalised + labels if layout.is_last else 0
    if mechanism == "save_on_cpu":
        kept = last = stored if checkpointed else 0
        if rt.dynamic_cache and not checkpointed:
            # the loop's DynamicCache keeps every layer's keys and values on the device (outputs,
            # not saved tensors: the hooks never see them; under autocast the keys in fp32)
            # (at the last layers' backward the loop's retained outputs count them)
            cache = layers * tokens * 2 * (4 if x.autocast else x.d) * model.kv_size // x.t
            kept, last = cache, 0
        # the returned ``out`` holds the logits (an output, not a saved tensor)
        head_kept = min(A.logits(x, model.vocab_size), head) if layout.is_last else 0
        copies_kept = 0
    else:
        last = trl_kept_layer(model, x, plan, lora_acts is None or layers > 1 or not layout.is_first)
        if checkpointed or not layers:
            kept = stored
        elif lora_acts is None:
            kept = layers * last
        else:
            first_grad = "embed_tokens" in plan.modules_to_save or not layout.is_first
            kept = trl_kept_layer(model, x, plan, first_grad) + (layers - 1) * last
        kept = min(kept, stored)
        head_kept = max(head - head_moved, 0)
        copies_kept = vocab_shard_params(model, plan.tp) * x.d if x.autocast and layout.is_last else 0
    # the host holds a copy of every tensor offloaded, checkpointed layers' inputs included (the
    # device keeps its own); save_on_cpu copies a tensor once per save and the weights it saves
    host = stored + head + max(weight_copies - copies_kept, 0)
    if mechanism == "save_on_cpu":
        dup = last if checkpointed else trl_kept_layer(model, x, plan, True)
        host += (0 if checkpointed else layers * dup) + saved_weight_bytes(model, layout, plan, x, lora_acts)
    if checkpointed:
        last = stored // layers if layers else 0
    # in the backward the tensors come back node by node, each freed once its node has run; at
    # the MLP's backward peak (the product and SiLU nodes) 3 d f of them are back, 4 d f under
    # TRL's streams, which hold the previous node's until the next has run, and under
    # save_on_cpu an adapted MLP's inputs come back as copies of their own, d f more (fitted to
    # the CPU measurements of tests/accuracy/test_offload_accuracy.py, not derived node by node)
    widths = 3 if mechanism == "save_on_cpu" else 4
    if mechanism == "save_on_cpu" and lora_acts is not None:
        widths += bool(set(L.resolve_targets(plan.lora_targets)) & set(L.MLP))
    node = tokens * x.d * widths * model.ffn_size // x.t
    head_back = stash = 0
    if layout.is_last and mechanism == "trl":
        # TRL's forward stash (the originals of the offloaded tensors among the last five saved,
        # purged only when another is offloaded) still holds, when the loss runs, the final
        # norm's fp32 input and the last MLP's SiLU output and up output (and, trained, the
        # product down_proj saves); in the backward, until the first node has run, the final
        # norm's input and the labels (measured on CPU)
        h4 = tokens * 4 * model.hidden_size // x.rep
        head_back = h4 + labels
        mlp = tokens * x.d * (3 if lora_acts is None else 2) * model.ffn_size // x.t
        stash = h4 + (mlp if layers and not checkpointed else 0)
    mlp_forward = tokens * x.d * 3 * model.ffn_size // x.t if layers and not checkpointed else 0
    return _ActOffload(kept, last, node, head_kept, copies_kept, host, head_back, stash, mlp_forward, mechanism)


def memplan_offload(model: ModelSpec, x: A.Shape, plan: Plan, layout: StageLayout, weight_copies: int) -> _ActOffload:
    """``save_on_cpu`` in the bundled trainer, one micro-batch (costmodel.trainer_offload):

    - forward: nothing of the layers stays (recomputed or not: the checkpoint's saved inputs go
      too); at the loss the logits (``loss_forward``), log_softmax's fp32 output and the labels
      are alive; inside the last layer its MLP's moment (:func:`trainer_offload.mlp_forward_bytes`);
    - backward: the loss's backward (the labels, log_softmax's output back from the host, the
      loss's two fp32 gradients); the first layer's MLP backward walked node by node
      (:func:`trainer_offload.mlp_backward`, beside its incoming gradient and the labels, and
      recomputed, the checkpoint's inputs back); its first norm's backward
      (:func:`trainer_offload.norm_backward_bytes`); the embedding's backward
      (:func:`trainer_offload.embedding_backward_bytes`);
    - host: :func:`trainer_offload.host_bytes`.

    Measured on CPU within 0.02% per phase, the host bytes exact (docs/cost-model.md).

    Also in the op-level run: ``timeline/act_offload.py`` (kept: module docstring)."""
    tokens = x.tokens
    kept_head = A.fp32_logits(x, model.vocab_size) + 8 * tokens  # log_softmax output, labels
    policy = POLICIES[plan.precision]
    host = TO.host_bytes(x, model.vocab_size, layout.layers, policy.param_bytes, plan.recompute)
    # autocast's cache of weight casts, but the LM head's (cast after the layers)
    layer_copies = weight_copies - (vocab_shard_params(model, plan.tp) * x.d if layout.is_last and x.autocast else 0)
    mlp = TO.mlp_forward_bytes(x, layer_copies) + 8 * tokens if layout.layers else 0  # with the labels
    embedding = TO.embedding_backward_bytes(x) + 8 * tokens if layout.is_first else 0
    checkpointed = plan.recompute == "full"
    copy = model.hidden_size * model.ffn_size * (x.d if x.autocast else policy.param_bytes)  # a weight back
    made, held = TO.mlp_backward(x, copy, policy.grad_bytes, checkpointed)
    r = TO.residual_bytes(x)
    # beside it: the layer's incoming gradient and the labels; recomputed, the checkpoint's
    # inputs back from the host (RoPE's cos and sin, and the layer input where its norm saves
    # it: in fp32; below, the norm saves its upcast and the input's copy dies with the recompute)
    held += tokens * (r * model.hidden_size + 8)
    if checkpointed:
        held += TO.checkpoint_input_saves(x) - (tokens * r * model.hidden_size if x.d < 4 else 0)
    return _ActOffload(
        kept=0,
        last=0,
        node=0,  # the walk (mlp_backward) stands for the hf loops' node estimate
        head_kept=kept_head,
        copies_kept=0,
        host=host,
        head_back=0,
        stash=0,
        mlp_forward=mlp,
        mechanism="save_on_cpu",
        bwd_head=kept_head,
        embedding_backward=embedding,
        mlp_backward=(made, held) if layout.layers else None,
        norm_backward=TO.norm_backward_bytes(x) + 8 * tokens if layout.layers else 0,  # with the labels
    )


def _shape(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    policy: PrecisionPolicy,
    rt: RuntimeProfile,
    device: Device = "cuda",
) -> A.Shape:
    s = workload.seq_len // plan.cp
    autocast = rt.autocast and policy.param_bytes > policy.compute_bytes and not _fsdp2(rt, plan)
    return A.Shape(
        model=model,
        b=workload.micro_batch,
        s=s,
        span=s,
        t=plan.tp,
        sp=plan.sequence_parallel and plan.tp > 1,
        d=_activation_bytes(plan, policy, autocast),
        # transformers runs Gemma 2's soft-capped attention eagerly (its SDPA path refuses it)
        eager=plan.attention == "eager" or (model.attn_logit_softcapping is not None and _transformers_layers(rt)),
        dropout=rt.dropout,
        autocast=autocast,
        sdpa=sdpa_kind(model, plan, policy, device),
    )


def _activation_bytes(plan: Plan, policy: PrecisionPolicy, autocast: bool) -> int:
    """Bytes per activation element: the compute dtype's, but over a quantized base fp32 unless
    under autocast. ``prepare_model_for_kbit_training`` casts the embedding, norms and head to
    fp32, so the residual stream is fp32, and bitsandbytes' 4-bit and 8-bit linears cast their
    output back to their input's dtype (``Linear4bit.forward``): the compute dtype
    (``bnb_4bit_compute_dtype``) lives only inside the matmul (measured: the same peak with a bf16
    or an fp32 compute dtype, docs/cost-model.md)."""
    if plan.quant != "none" and not autocast:
        return 4
    return policy.compute_bytes


def _fsdp2(rt: RuntimeProfile, plan: Plan) -> bool:
    """ZeRO-2/3 run by FSDP2 over more than one rank (its mixed precision casts the params)."""
    return rt.pytorch_parallel and plan.zero >= 2 and plan.dp * plan.cp > 1


class _Fsdp2(NamedTuple):
    """FSDP2's parameter bytes at each moment of the step, on top of the sharded params."""

    forward: int
    backward_start: int
    backward_end: int
    # for ``fsdp2_short_moments``, once a stage (``MemoryMemo.fsdp2_unsharded``): a layer group's
    # all-gather, the head group's unsharded and reduce-dtype bytes (0 off the last stage), and
    # the unsharded bytes at the last layer's backward (ZeRO-2: the later groups resharded)
    layer: int = 0
    head: int = 0
    head_reduced: int = 0
    zero2_end: int = 0


_NO_FSDP2 = _Fsdp2(0, 0, 0)  # outside FSDP2


def fsdp2_unsharded(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, fp8_gather: bool = False
) -> _Fsdp2:
    """Unsharded (all-gathered) parameters FSDP2 holds, in the mixed-precision param dtype.

    One FSDP group per layer, one for the embedding, one for the final norm and LM head (the
    root's with tied embeddings), which is never resharded between forward and backward
    (torch/distributed/fsdp/_fully_shard). ZeRO-2 (``reshard_after_forward=False``): every
    group stays unsharded from its forward to its backward. ZeRO-3: at the end of the forward
    only the head group; in the last layer's backward that layer, the prefetched next group
    (the embedding on the first stage) and the head group until the root's final callback.
    Measured with FSDPMemTracker (docs/cost-model.md); an untied head group is resharded after
    its own backward (the bundled trainer's run, ``timeline/fsdp.py``). ``fp8_gather``: the layers' linear weights
    are gathered in fp8 (``fp8.fsdp_gathered_bytes``); the head group and the embedding stay bf16.
    Also in the op-level run: ``timeline/fsdp.py`` (kept: module docstring).
    """
    unsharded = min(policy.param_bytes, policy.compute_bytes)
    head = P.norm_params(model) + vocab_shard_params(model, plan.tp) if layout.is_last else 0
    linears = F8.linear_elements(model, layout)
    layer = fsdp2_layer_gather(model, layout, policy, fp8_gather)
    embed = (
        vocab_shard_params(model, plan.tp) if layout.is_first and not (layout.is_last and model.tied_embeddings) else 0
    )
    if plan.zero == 2:
        every = F8.fsdp_gathered_bytes(linears, layout.params - linears, unsharded, fp8_gather)
        end = layer + embed * unsharded  # the last layer's backward: the later groups resharded
        return _Fsdp2(every, every, every, layer, head * unsharded, head * policy.grad_bytes, end)
    prefetched = embed * unsharded if layout.is_first else layer
    # an untied head group is resharded after its own backward (``Fsdp.post_backward``), before the
    # layers' (the run: no ``output.weight.unsharded`` at the first layer's backward); a tied one is
    # the root's, kept to the final callback
    kept = head * unsharded if model.tied_embeddings else 0
    end = kept + layer + prefetched
    return _Fsdp2(head * unsharded, head * unsharded, end, layer, head * unsharded, head * policy.grad_bytes, end)


@lru_cache(maxsize=1024)
def pipelined_unsharded_chunks(schedule: str, pp: int, virtual_stages: int, stage: int, m: int) -> tuple[int, int]:
    """The rank's chunks whose layer groups FSDP2 ZeRO-3 holds unsharded at a backward's start with
    the most micro-batches in flight (the moment the sums take: :func:`chunks_in_flight`), and
    those of them other than the backward's own chunk. Pipelining runs every backward without
    resharding (``StageReplay``: ``set_reshard_after_backward(False)``, ``timeline/pipeline.py``
    ``Pipeline.step``; ``Fsdp._keep_unsharded``), and a chunk's next forward reshards each group
    after it (``reshard_after_forward=True``, ``Fsdp.post_forward``): a chunk whose latest action
    is a backward keeps all its groups unsharded. Only the interleaved schedule reaches a backward
    so (its last rank: the first chunk's, beside the loss's backward; 487 MB on the 1B config at
    dp 2, pp 2, v 2). A walk over :func:`schedule_actions`, each rank's once (``lru_cache``); the
    most of those moments.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    latest: dict[int, str] = {}
    total = most = 0
    best = (0, 0)
    for kind, c, _ in schedule_actions(schedule, pp, virtual_stages, stage, m):
        if kind == "B":
            if total >= most:
                kept = [k for k, done in latest.items() if done == "B"]
                found = (len(kept), sum(k != c for k in kept))
                best = max(best, found) if total == most else found
                most = total
            total -= 1
        else:
            total += 1
        latest[c] = kind
    return best


@lru_cache(maxsize=1024)
def chunks_without_gradients(pp: int, virtual_stages: int, stage: int, m: int) -> tuple[tuple[int, ...], ...]:
    """The rank's local chunks that no backward has reached yet under the interleaved schedule, at
    its last forward and at its latest backward with the most chunks in flight (the moments the
    sums take: :func:`chunks_in_flight`). Pipelining makes a chunk's gradients in its first
    backward and keeps them, unreduced, to the step's end (``timeline/pipeline.py``
    ``Pipeline.step``; FSDP2's accumulated unsharded gradients, ``Fsdp._keep_unsharded``); so
    where the warm-up fills the rank before any backward of its first chunks, those chunks have
    none: with as many micro-batches as ranks (m = p) the last rank runs every backward of its
    last chunk, each beside the loss's, before its first chunk's first (the 1B config at dp 2,
    pp 4, v 2, m 4: 243,286,016 B of ``layers.N.*.grad`` fewer than every chunk's). A walk over
    :func:`schedule_actions`, each rank's once (``lru_cache``).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    most = chunks_in_flight("interleaved", pp, virtual_stages, stage, m)
    done: set[int] = set()
    total = 0
    at_forward: tuple[int, ...] = ()
    at_backward: tuple[int, ...] = ()
    for kind, c, _ in schedule_actions("interleaved", pp, virtual_stages, stage, m):
        if kind == "F":
            total += 1
            at_forward = tuple(k for k in range(virtual_stages) if k not in done)
            continue
        if total == most:
            at_backward = tuple(k for k in range(virtual_stages) if k not in done)
        total -= 1
        done.add(c)
    return at_forward, at_backward


def pipelined_gradients(model: ModelSpec, layout: StageLayout, plan: Plan, m: int, grads: int) -> tuple[int, int]:
    """An interleaved pipeline rank's ``grads`` (every chunk's) less those of the chunks
    :func:`chunks_without_gradients` finds, at its last forward and at its backward with the most
    in flight. A chunk's share is its layers' parameters (``stage_layout`` of that chunk alone),
    with the embedding in the global first chunk and the final norm and LM head in the last.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    at_forward, at_backward = chunks_without_gradients(plan.pp, plan.virtual_stages, layout.stage, m)
    return grads - _chunks_share(model, layout, plan, at_forward, grads), grads - _chunks_share(
        model, layout, plan, at_backward, grads
    )


def _chunks_share(model: ModelSpec, layout: StageLayout, plan: Plan, chunks: tuple[int, ...], grads: int) -> int:
    """The part of the rank's ``grads`` that its local ``chunks`` hold (:func:`pipelined_gradients`)."""
    v, stage = plan.virtual_stages, layout.stage
    extra = layout.params - layout.layer_params  # the embedding (first rank) or the head (last)
    n = 0
    for c in chunks:
        n += stage_layout(model, plan.tp, plan.ep, plan.pp * v, 1, c * plan.pp + stage).layer_params
        n += extra if (c == 0 and layout.is_first) or (c == v - 1 and layout.is_last) else 0
    return grads * n // layout.params


@lru_cache(maxsize=1024)
def chunks_without_gradients_after(pp: int, virtual_stages: int, stage: int, m: int) -> tuple[int, ...]:
    """The rank's local chunks that no backward has reached yet under the interleaved schedule at the
    end of its latest backward with the most chunks in flight (:func:`chunks_without_gradients`'
    second, less that backward's own chunk, whose gradients it has made). A walk over
    :func:`schedule_actions` (``lru_cache``).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    most = chunks_in_flight("interleaved", pp, virtual_stages, stage, m)
    done: set[int] = set()
    total = 0
    after: tuple[int, ...] = ()
    for kind, c, _ in schedule_actions("interleaved", pp, virtual_stages, stage, m):
        if kind == "F":
            total += 1
            continue
        done.add(c)
        if total == most:
            after = tuple(k for k in range(virtual_stages) if k not in done)
        total -= 1
    return after


@lru_cache(maxsize=1024)
def chunks_kept_at_last_forward(pp: int, virtual_stages: int, stage: int, m: int) -> tuple[int, ...]:
    """The rank's local chunks whose latest action is a backward at its last forward under the
    interleaved schedule: FSDP2 ZeRO-3 keeps their groups unsharded there (no reshard after a
    pipelined backward, :func:`pipelined_unsharded_chunks`). A walk over
    :func:`schedule_actions`, each rank's once (``lru_cache``).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    latest: dict[int, str] = {}
    kept: tuple[int, ...] = ()
    for kind, c, _ in schedule_actions("interleaved", pp, virtual_stages, stage, m):
        if kind == "F":
            kept = tuple(k for k, done in latest.items() if done == "B" and k != c)
        latest[c] = kind
    return kept


def pipelined_forward_gathered(
    layout: StageLayout, plan: Plan, policy: PrecisionPolicy, m: int, gather: int
) -> tuple[int, int]:
    """FSDP2 ZeRO-3 on an interleaved pipeline rank at its last forward: (the unsharded groups of
    the chunks :func:`chunks_kept_at_last_forward` finds, the embedding's with the global first
    chunk; the last layer's own unsharded parameters, whose all-gather output
    ``Fsdp.unshard`` keeps as well until the next group's copy-out). On the last rank the moment
    is the loss's, after the layers' reshard (the head's group is ``fsdp2_unsharded``'s): no layer
    of its own. The run's forward peak on llama3-8b at dp 2, pp 2, v 2, 4 micro-batches, stage 0
    (``layers.7.residual_ffn``): 4,976,689,152 B of ``*.unsharded`` and the 436,224,000 B of
    ``fsdp.layers.7.all_gather_output``; ``gather``: one layer group's (:func:`fsdp2_layer_gather`).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    v = plan.virtual_stages
    chunk = gather * layout.layers // v
    kept = chunks_kept_at_last_forward(plan.pp, v, layout.stage, m)
    embedding = (layout.params - layout.layer_params) * min(policy.param_bytes, policy.compute_bytes)
    kept_bytes = len(kept) * chunk + (embedding if layout.is_first and 0 in kept else 0)
    return kept_bytes, 0 if layout.is_last else gather


def pipelined_last_backward(
    layout: StageLayout,
    plan: Plan,
    policy: PrecisionPolicy,
    bwd_end: dict[str, int],
    gather: int,
    stored: int,
    live: int,
) -> dict[str, int]:
    """An interleaved pipeline rank's last backward under FSDP2 ZeRO-3, at its first layer (the
    chunk's last): every chunk's groups unsharded, none resharded since its backward
    (:func:`pipelined_unsharded_chunks`; the embedding's or the head's group too), every gradient,
    and one micro-batch in flight: the chunk's saved activations (``stored``, the rank's per
    micro-batch, over ``v`` chunks) with the layer's own backward (``live``). The run's peak on
    llama3-8b at dp 2, pp 2, v 2, 2 micro-batches, full recompute (``layers.7.feed_forward.w2.dX``
    beside 8,030,265,344 B of ``*.unsharded``); ``gather``: one layer group's unsharded bytes
    (:func:`fsdp2_layer_gather`).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    unsharded = min(policy.param_bytes, policy.compute_bytes)
    every = layout.layers * gather + (layout.params - layout.layer_params) * unsharded
    return {**bwd_end, "activations": stored // plan.virtual_stages + live, "gathered_params": every}


def pipelined_last_down_projection(
    model: ModelSpec, plan: Plan, policy: PrecisionPolicy, last: dict[str, int], x: A.Shape, chunk_inputs: int,
    embed: int, persistent: int, stage: int,
) -> dict[str, int]:  # fmt: skip
    """An interleaved pipeline rank's last backward under FSDP2 ZeRO-3 with every layer recomputed,
    at its chunk's last layer's down projection (``w2``'s input gradient, the run's
    ``layers.N.feed_forward.w2.dX``, b s f d): :func:`pipelined_last_backward`'s groups and
    gradients with the projection's new weight gradient beside the accumulated one (h f in the
    unsharded dtype, ``w2.dW``, added to it after the node, ``Fsdp._keep_unsharded``); the chunk's
    checkpointed inputs (``chunk_inputs``; on ranks but the first the chunk's first is its receive
    buffer, counted there), the layer rebuilt (``TO.recomputed_layer_saves``) and
    what its micro-batch alone holds beside (``embed``: the ids, RoPE's tables, cuBLAS's
    workspaces); and every send of the step so far, held to its end (``_HeldToStepEnd``: each
    forward's output of a chunk but the global last, each earlier backward's input gradient of a
    chunk but the global first; this backward's chunk is the rank's first, global chunk
    ``stage``, whose own input gradient is not made yet) beside the receive buffers
    (``persistent``: m per chunk but the global first or last, as many as the sends).
    The run's peak on llama3-8b at dp 2, pp 2, v 2, 2 micro-batches of 4,096 tokens, bf16, stage 0
    (``layers.7.feed_forward.w2.dX``): the sums 0.55% under it without this moment.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    f = model.ffn_size // plan.tp
    received = pipeline_activation_bytes(x) if stage else 0  # the chunk's input, its receive buffer
    return {
        **last,
        "gradients": last["gradients"] + model.hidden_size * f * min(policy.param_bytes, policy.compute_bytes),
        "activations": chunk_inputs - received + embed + TO.recomputed_layer_saves(x) + x.tokens * f * x.d,
        "comm_buffers": 2 * persistent - received,
    }


@lru_cache(maxsize=1024)
def embedding_backwards(pp: int, virtual_stages: int, m: int) -> tuple[tuple[int, int, int], ...]:
    """The first rank's backwards of its first chunk under the interleaved schedule, at the
    embedding's backward (the chunk's last node), each as (the chunk-micro-batches still in flight
    but that one; the sends held: every earlier forward's output of a chunk but the global last,
    every earlier backward's input gradient of a chunk but the global first, ``_HeldToStepEnd``; the
    other chunks whose latest action is a backward, whose groups FSDP2 ZeRO-3 keeps unsharded,
    :func:`chunks_kept_at_last_forward`): the first, then of the later ones those no other exceeds in
    all three. The first chunk is the last a backward reaches, so every chunk has its gradients
    there. A walk over :func:`schedule_actions` of rank 0 (``lru_cache``).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    last = pp * virtual_stages - 1
    total = sent = 0
    latest: dict[int, str] = {}
    found: list[tuple[int, int, int]] = []
    for kind, c, _ in schedule_actions("interleaved", pp, virtual_stages, 0, m):
        k = c * pp
        if kind == "F":
            total, sent = total + 1, sent + (k != last)
        else:
            if k == 0:
                found.append((total - 1, sent, sum(done == "B" for j, done in latest.items() if j != c)))
            total, sent = total - 1, sent + (k != 0)
        latest[c] = kind
    later = set(found[1:])
    exceeded = {t for t in later for o in later if o != t and o[0] >= t[0] and o[1] >= t[1] and o[2] >= t[2]}
    return (found[0], *sorted(later - exceeded))


def pipelined_embedding_backward(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, bwd_end: dict[str, int],
    x: A.Shape, m: int, grads: int, gather: int, chunk_saves: int, embed: int, persistent: int,
) -> list[dict[str, int]]:  # fmt: skip
    """The first rank's embedding backward under FSDP2 and the interleaved schedule, in its first
    chunk's backwards (:func:`embedding_backwards`), every other gradient accumulated
    unreduced (``grads``: every one, the embedding's in the reduce dtype). The kernel's new gradient,
    V x h in the unsharded dtype (``ops.embedding``: ``tok_embeddings.embedding.grad_weight``,
    ``embedding_dense_backward_cuda``), with its int64 index buffers and fp32 partial sums
    (``N + N // 10`` segments x h) and the incoming gradient of the lookup (b s h d): in the first
    backward it is the embedding's gradient (under the mixed policy then copied, with the kernel's
    buffers and the incoming gradient gone, to the fp32 accumulated one beside it,
    ``Fsdp._keep_unsharded``: ``tok_embeddings.weight.accumulated_grad``),
    in a later one it is made beside the accumulated one. The unsharded groups: ZeRO-2 every one
    (``bwd_end``'s); ZeRO-3 the first chunk's, the embedding's and those of the chunks a backward left
    so (``gather`` a layer's). The other in-flight chunk-micro-batches' saves (``chunk_saves`` each),
    the sends held (``timeline/pipeline.py`` ``_HeldToStepEnd``) beside the receive buffers
    (``persistent``). The run's peak on llama3-8b at dp 2, v 2, m = p, 2,048 tokens, stage 0: pp 4,
    bf16, full recompute (``tok_embeddings.embedding.grad_weight_per_segment``, the second backward;
    the sums 4.72% under it without it; pp 2, m 4: the last, every chunk unsharded, 2.4% under) and
    pp 4, bf16-mixed, no recompute (the first's
    ``tok_embeddings.weight.accumulated_grad``, 2.76% under).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    n, h = x.tokens, model.hidden_size
    segments = n + n // 10
    kernel = segments * h * 4 + 40 * n + 16 + 8 * segments + n * x.d * h
    vocab = vocab_shard_params(model, plan.tp)
    new = vocab * min(policy.param_bytes, policy.compute_bytes)
    own = vocab * policy.grad_bytes  # the embedding's accumulated gradient
    moments = []
    for j, (inflight, sent, kept) in enumerate(embedding_backwards(plan.pp, plan.virtual_stages, m)):
        gathered = bwd_end["gathered_params"]
        if plan.zero == 3:
            gathered = (1 + kept) * (gather * layout.layers // plan.virtual_stages) + new
        at = {
            **bwd_end,
            "gradients": grads - own + new if j == 0 else grads + new,
            "activations": embed + inflight * chunk_saves + kernel,
            "comm_buffers": persistent + sent * pipeline_activation_bytes(x),
            "gathered_params": gathered,
        }
        moments.append(at)
        if j == 0 and own > new:  # the fp32 copy beside the new gradient, the kernel's buffers gone
            moments.append({**at, "gradients": grads + new, "activations": at["activations"] - kernel})
    return moments


def pipelined_reduce_scatter(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, bwd_end: dict[str, int],
    grads: int, gather: int, workspaces: int, persistent: int,
) -> dict[str, int]:  # fmt: skip
    """The first rank's step-end reduce-scatter under FSDP2 and the interleaved schedule, at its
    first group, the embedding's (``Pipeline.step``: ``reduce_all`` over the chunks' roots in order,
    each group's ``post_backward`` in module order, ``timeline/fsdp.py``): the embedding group
    resharded, every other group still unsharded (ZeRO-2: ``bwd_end``'s; ZeRO-3: every layer group,
    ``gather`` each, none resharded since its chunk's last backward), every accumulated gradient
    (``grads``), the reduce-scatter input (V x h in the reduce dtype) and its output (over
    ``dp``), beside the receive buffers and every send, held to ``sent.end()`` after the reduce
    (``persistent`` each: m per chunk but the global first or last), and cuBLAS's workspaces. Above
    the embedding's backward under bf16-mixed (the fp32 ``tok_embeddings.weight.accumulated_grad``):
    the run's peak on llama3-8b at dp 2, pp 2, v 2, m 2, full recompute, 4,096 tokens
    (``fsdp.tok_embeddings.reduce_scatter_output``), 2.01% above the sums without it.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    vocab = vocab_shard_params(model, plan.tp)
    rd = policy.grad_bytes
    unsharded = vocab * min(policy.param_bytes, policy.compute_bytes)
    layers = gather * layout.layers if plan.zero == 3 else bwd_end["gathered_params"] - unsharded
    return {
        **bwd_end,
        "gradients": grads + vocab * rd // (plan.dp * plan.cp),
        "activations": workspaces,
        "comm_buffers": vocab * rd + 2 * persistent,
        "gathered_params": layers,
    }


def pipelined_down_projection(
    model: ModelSpec, plan: Plan, policy: PrecisionPolicy, bwd_start: dict[str, int], x: A.Shape
) -> dict[str, int]:
    """An interleaved pipeline rank's backward with the most in flight under FSDP2, at its chunk's
    last layer's down projection (``w2``'s input gradient, the run's ``layers.N.feed_forward.w2.dX``,
    b s f d): every activation still saved (``bwd_start``'s), and the projection's new weight
    gradient (h f in the unsharded dtype, ``w2.dW``) beside the gradients there: beside the
    accumulated one where the chunk had a backward already (pipelining accumulates it after the node,
    ``Fsdp._keep_unsharded``), else the chunk's first. The run's peak on llama3-8b at dp 2, pp 2, v 2,
    ZeRO-2, m 4, no recompute, stage 0: the sums 0.39% under it without this moment.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    f = model.ffn_size // plan.tp
    unsharded = min(policy.param_bytes, policy.compute_bytes)
    return {
        **bwd_start,
        "gradients": bwd_start["gradients"] + model.hidden_size * f * unsharded,
        "activations": bwd_start["activations"] + x.tokens * f * x.d,
    }


def pipelined_mlp_weight_grads_kept(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, bwd_start: dict[str, int],
    x: A.Shape, layer_saves: int,
) -> dict[str, int]:  # fmt: skip
    """:func:`pipelined_down_projection`'s backward under FSDP2's mixed policy (bf16 parameters,
    fp32 reduce), the layer's saves its own (no full recomputation), at the widest of its later
    nodes. Autograd hands each new bf16 weight gradient to the unsharded parameter's ``.grad``,
    which the mixed policy emptied when it made the fp32 accumulated one, so each stays until the
    layer group's ``post_backward`` (``Fsdp._keep_unsharded``: ``to_accumulated_grad_if_needed``,
    the bf16 one dropped): ``w2.dW`` beside the product's backward (``gate.grad_other``,
    ``gate.grad_self``, b s f d each, the product's save gone, ``w2.dX`` alive), then ``w3.dW`` with
    the up projection's input gradient (b s h d; SiLU's output, the up output and ``w2.dX`` gone),
    then ``w1.dW`` with the gate's (the gate's output and the product's gradient gone); without
    recomputation (``layer_saves``: the layer's saves, ``_MicroBatchTerms.full_layer``; 0 under
    selective, whose attention is rebuilt) the layer's every new gradient at its first norm's
    backward (``attention_norm.pow.grad``): the layer's saves gone but the norm's fp32 input, beside
    five more fp32 b s h (the mean's, the square's two temporaries and its gradient, the normalised
    value's) and the residual's gradient (b s h d). Under bf16 alone each new gradient is added
    into the accumulated one and freed after its node. The run's peak on llama3-8b at dp 2, pp 2,
    v 2, ZeRO-2, 4 micro-batches, bf16-mixed, no recompute, stage 0: at 4,096 tokens
    ``layers.7.feed_forward.gate.grad_self`` (the sums 0.14% under it without this moment), at 512
    and 1,024 ``layers.7.attention_norm.pow.grad`` (0.14% and 0.10% under).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    f, h = model.ffn_size // plan.tp, model.hidden_size
    unsharded = min(policy.param_bytes, policy.compute_bytes)
    w = h * f * unsharded  # each of the MLP's new weight gradients
    a, xb = x.tokens * f * x.d, x.tokens * h * x.d
    nodes = [(w + 2 * a, w), (2 * w - a + xb, 2 * w), (3 * w - 3 * a + 2 * xb, 3 * w)]
    if layer_saves and layout.layers:
        layer = layout.layer_params // layout.layers * unsharded
        nodes.append((layer + 6 * x.tokens * h * 4 + xb - layer_saves, layer))
    widest, made = max(nodes)
    return {
        **bwd_start,
        "gradients": bwd_start["gradients"] + made,
        "activations": bwd_start["activations"] + widest - made,
    }


def pipelined_next_group_gather(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, bwd_start: dict[str, int],
    x: A.Shape, m: int, gather: int, layer_saves: int,
) -> dict[str, int] | None:  # fmt: skip
    """An interleaved pipeline rank's backward with the most in flight under FSDP2 ZeRO-3 without
    recomputation, where its chunk's groups are sharded at its start (no backward of the chunk since
    its forward: :func:`pipelined_unsharded_chunks`), at the end of its chunk's last layer's
    backward: the next layer group's all-gather copied out (``Fsdp.unshard``:
    ``fsdp.layers.N.copy_out_meta``) beside its ``all_gather_output``, prefetched at the layer's
    start, and the layer's own unsharded parameters, kept (no reshard after a pipelined backward);
    the layer's saves gone (``layer_saves``) but its input gradient (b s h d); the layer's new
    gradients in the reduce dtype where its chunk had none yet (:func:`chunks_without_gradients`;
    else added into the accumulated ones and freed). ``gather``: one layer group's unsharded bytes
    (:func:`fsdp2_layer_gather`); None where the chunk has one layer or its groups are unsharded
    already. The run's peak on llama3-8b at dp 2, pp 8, v 2, 8 micro-batches of 2,048 tokens, bf16,
    no recompute, stage 0 (``fsdp.layers.0.copy_out_meta``, its first backward, every
    chunk-micro-batch in flight): the sums 1.56% under it without this moment.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    v, stage = plan.virtual_stages, layout.stage
    at_start, others = pipelined_unsharded_chunks(plan.pp_schedule, plan.pp, v, stage, m)
    if layout.layers < 2 * v or at_start > others:  # one layer a chunk, or its groups unsharded
        return None
    before = chunks_without_gradients(plan.pp, v, stage, m)[1]
    new = set(before) - set(chunks_without_gradients_after(plan.pp, v, stage, m))  # its own chunk had none
    grads = layout.layer_params // layout.layers * policy.grad_bytes if new else 0
    return {
        **bwd_start,
        "gradients": bwd_start["gradients"] + grads,
        "activations": bwd_start["activations"] - layer_saves + x.tokens * model.hidden_size * x.d,
        "comm_buffers": bwd_start["comm_buffers"] + gather,
        "gathered_params": bwd_start["gathered_params"] + 2 * gather,
    }


@lru_cache(maxsize=1024)
def loss_chunk_backward(pp: int, virtual_stages: int, m: int) -> tuple[int, int] | None:
    """The last rank's latest backward with the most chunk-micro-batches in flight under the
    interleaved schedule, where it is a backward of the loss chunk (the rank's last) and every
    chunk has had a backward and every other chunk's latest action is one (its groups unsharded,
    its gradients made): (the chunk-micro-batches in flight, the sends held before it, as
    :func:`sends_held` counts them); None otherwise. A walk over :func:`schedule_actions`
    (``lru_cache``).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    v = virtual_stages
    stage, last = pp - 1, pp * v - 1
    most = chunks_in_flight("interleaved", pp, v, stage, m)
    total = sent = 0
    found = None
    latest: dict[int, str] = {}
    done: set[int] = set()
    for kind, c, _ in schedule_actions("interleaved", pp, v, stage, m):
        k = c * pp + stage
        if kind == "F":
            total, sent = total + 1, sent + (k != last)
        else:
            if total == most:
                others = all(latest.get(j) == "B" for j in range(v) if j != c)
                found = (total, sent) if c == v - 1 and others and c in done else None
            total, sent = total - 1, sent + (k != 0)
            done.add(c)
        latest[c] = kind
    return found


def pipelined_loss_chunk_regather(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, last: dict[str, int],
    x: A.Shape, m: int, gather: int, chunk_saves: int, alone: int, per_chunk: int, logits: int,
    persistent: int,
) -> dict[str, int] | None:  # fmt: skip
    """The last rank's backward with the most in flight under FSDP2 ZeRO-3 and full recomputation,
    where it is the loss chunk's and every other chunk's groups and gradients are there
    (:func:`loss_chunk_backward`), at that chunk's second layer's down projection
    (``layers.1.feed_forward.w2.dX``): the chunk's forward resharded its layer groups
    (``reshard_after_forward``), so its backward gathers them again and keeps them (no reshard after
    a pipelined backward): every group unsharded but the chunk's first layer's, whose
    ``all_gather_output`` is in flight (``gather`` a layer group); every gradient with the new
    ``w2.dW`` (h f, unsharded dtype) beside; the other chunk-micro-batches in flight, each its
    checkpointed inputs (``chunk_saves``) less its first, its receive buffer, and RoPE's tables
    (``per_chunk``); the sends held; the loss chunk's cached logits (``fwd_cache``, b s V / t,
    ``output.logits``); of its own the residual's gradient and the second layer's input (b s h d
    each), the layer rebuilt and ``w2.dX`` (b s f d); ``alone``: its ids, tables and cuBLAS's
    workspaces. The run's peak on llama3-8b at dp 2, pp 2, v 2, 4 micro-batches of 2,048 tokens,
    bf16, full recompute, rank 1: the sums 2.17% under it without this moment.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    found = loss_chunk_backward(plan.pp, plan.virtual_stages, m)
    if found is None or layout.layers < 2 * plan.virtual_stages or not layout.is_last:
        return None
    inflight, sent = found
    a, f = pipeline_activation_bytes(x), model.ffn_size // plan.tp
    others = (inflight - 1) * (chunk_saves - a + per_chunk)
    own = 2 * a + TO.recomputed_layer_saves(x) + x.tokens * f * x.d
    return {
        **last,
        "gradients": last["gradients"] + model.hidden_size * f * min(policy.param_bytes, policy.compute_bytes),
        "activations": alone + others + sent * a + logits + own,
        "comm_buffers": persistent + gather,
        "gathered_params": last["gathered_params"] - gather,
    }


def interleaved_fsdp2_backwards(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, x: A.Shape, m: int,
    bwd_start: dict[str, int], bwd_end: dict[str, int], grads: int, chunk_saves: int, embed: int,
    persistent: int, workspaces: int, fp8_gather: bool, finetune: bool, layer_saves: int,
) -> tuple[dict[str, int], list[dict[str, int]]]:  # fmt: skip
    """An interleaved pipeline rank's backward moments under FSDP2 beyond the phases': (its backward
    end with the gradients of the chunks reached by then alone, :func:`chunks_without_gradients_after`;
    the first rank's embedding backwards, :func:`pipelined_embedding_backward`, and its step-end
    reduce-scatter, :func:`pipelined_reduce_scatter`, and on ranks but the last the first backward
    layer's down projection, :func:`pipelined_down_projection`, its later nodes under the mixed
    policy, :func:`pipelined_mlp_weight_grads_kept`, and under ZeRO-3 without recomputation the next
    group's all-gather, :func:`pipelined_next_group_gather`). ``grads``: every chunk's gradients;
    ``layer_saves``: a layer's saves (``_MicroBatchTerms.full_layer``).

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    missing = chunks_without_gradients_after(plan.pp, plan.virtual_stages, layout.stage, m)
    if missing:
        held = grads - _chunks_share(model, layout, plan, missing, grads)
        bwd_end = {**bwd_end, "gradients": min(held, bwd_end["gradients"])}
    extra: list[dict[str, int]] = []
    if layout.is_first and not (layout.is_last and model.tied_embeddings) and not finetune:
        gather = fsdp2_layer_gather(model, layout, policy, fp8_gather)
        extra += pipelined_embedding_backward(
            model, layout, plan, policy, bwd_end, x, m, grads, gather, chunk_saves, embed, persistent
        )
        extra.append(
            pipelined_reduce_scatter(model, layout, plan, policy, bwd_end, grads, gather, workspaces, persistent)
        )
    if not layout.is_last and model.moe is None and not finetune:  # a frozen base makes no w2.dW
        extra.append(pipelined_down_projection(model, plan, policy, bwd_start, x))
        mixed = policy.grad_bytes > min(policy.param_bytes, policy.compute_bytes)
        if mixed and model.mlp == "gated" and plan.recompute in ("none", "selective"):
            saves = layer_saves if plan.recompute == "none" else 0
            extra.append(pipelined_mlp_weight_grads_kept(model, layout, plan, policy, bwd_start, x, saves))
        if plan.zero == 3 and plan.recompute == "none" and plan.tp == 1:
            gather = fsdp2_layer_gather(model, layout, policy, fp8_gather)
            found = pipelined_next_group_gather(model, layout, plan, policy, bwd_start, x, m, gather, layer_saves)
            if found is not None:
                extra.append(found)
    return bwd_end, extra


def fp8_first_backward_layer(
    bwd_start: dict[str, int], fp8: F8.Fp8Step, acts: int, x: A.Shape, head_grads: int, retained: int, gathered: int
) -> dict[str, int]:
    """The first layer's backward under eager fp8 (the last layer of the forward): every
    activation still saved (``acts``, the layer's recomputed parts back), the loss's tensors gone
    but what the loop ``retained``, the LM head's gradients made, FSDP2's ``gathered`` groups of
    a layer's backward, and the layer's gradient temporaries with its down projection's fp8 casts
    (``fp8.torchao_linear_backward_extra``) on top. Measured on CPU with torchao 0.18
    (tests/accuracy/test_fp8_accuracy.py)."""
    return {
        **bwd_start,
        "gradients": bwd_start["gradients"] + head_grads,
        "activations": acts + layer_temp(x) + fp8.backward_extra,
        "logits_and_loss": retained,
        "gathered_params": gathered,
    }


def fsdp2_layer_gather(model: ModelSpec, layout: StageLayout, policy: PrecisionPolicy, fp8_gather: bool) -> int:
    """One layer group's all-gathered parameters (the largest layer's), in the mixed-precision param
    dtype; under ``fp8_gather`` its linear weights in fp8 (``fp8.fsdp_gathered_bytes``).

    Also in the op-level run: ``timeline/fsdp.py`` (kept: module docstring)."""
    unsharded = min(policy.param_bytes, policy.compute_bytes)
    linear = max(layout.largest_layer_params - P.layer_norm_params(model) - P.qk_norm_params(model), 0)
    return F8.fsdp_gathered_bytes(linear, layout.largest_layer_params - linear, unsharded, fp8_gather)


def autocast_weight_copies(model: ModelSpec, layout: StageLayout, plan: Plan, d: int) -> int:
    """torch.autocast caches a d-byte copy of every weight a matmul uses (the layers' linear
    weights and, on the last stage, the LM head's V x h / t, tied or not; not the embedding
    lookup or the norms) until the autocast region ends, and each matmul keeps its copy for
    its backward: alive from the forward until the layer's backward (measured: q_proj holds
    input cast + weight copy + output).

    Also in the op-level run: the autocast cache of ``timeline/trainer_model.py`` (kept: module docstring)."""
    linear = layout.layer_params - layout.layers * (P.layer_norm_params(model) + P.qk_norm_params(model))
    if layout.is_last:
        linear += vocab_shard_params(model, plan.tp)
    return linear * d


def checkpointed_layer_casts(model: ModelSpec, layout: StageLayout, plan: Plan, d: int, recomputed: int) -> int:
    """The bundled trainer under autocast: the weight casts of the layers its forward runs under a
    checkpoint (``recompute.layer``: full, the ``recomputed`` ones; selective-op, every layer), of
    :func:`autocast_weight_copies`. The checkpoint keeps only its inputs (selective-op also its
    policy's matmul and attention outputs, not the casts), so these casts live in autocast's cache
    alone (``trainer_model.Model.cache``), which ``Transformer.forward`` lets go before the loss
    (``t.done(*m.cache.values())``): at the loss and in the backward only the other layers' and the
    LM head's (``output.weight.autocast``) remain; a re-run casts its own (a fresh cache, freed with
    it). Without this the sums kept 1,946 MB of casts too many at the backward's start on the 1B
    config under DDP (+6.1%).

    Also in the op-level run: the autocast cache of ``timeline/trainer_model.py`` (kept: module docstring)."""
    layers = layout.layers if plan.recompute == "selective-op" else recomputed
    if not layout.layers or not layers:
        return 0
    linear = layout.layer_params - layout.layers * (P.layer_norm_params(model) + P.qk_norm_params(model))
    return layers * (linear // layout.layers) * d


def embedding_grad_pending(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, rt: RuntimeProfile
) -> int:
    """Gradient bytes of the input embedding on the first stage, which its backward creates
    after every layer's: V h / t (V h under DTensor TP, whose embedding backward yields a
    replicated gradient). Zero when the LM head shares the matrix on this stage (its
    backward made the gradient first) and under FSDP2 without pipelining, whose sharded
    gradients the estimate does not follow per group. Measured on the bundled trainer only
    (the ``memplan`` runtime).

    Also in the op-level run: ``timeline/trainer.py, ops.py`` (kept: module docstring)."""
    if not layout.is_first or (layout.is_last and model.tied_embeddings):
        return 0
    fsdp2 = _fsdp2(rt, plan)
    if fsdp2 and plan.pp == 1:
        return 0
    elements = vocab_shard_params(model, plan.tp)
    if rt.pytorch_parallel and plan.tp > 1 and not fsdp2:
        elements = model.vocab_size * model.hidden_size
    return elements * policy.grad_bytes


def fsdp2_first_layer_backward(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, st: _States
) -> tuple[int, int]:
    """FSDP2 ZeRO-3 at the first layer's backward (the bundled trainer, untied, one stage): (the
    previous layer group's reduce-scatter input, still alive, and the sharded gradient bytes not
    made yet). ``Fsdp.post_backward`` frees a group's reduce-scatter input only when the next
    group's is allocated (``fsdp.layers.1.reduce_scatter_input``, 436,224,000 B on llama3-8b at
    dp 8), and the first layer's and the embedding's shards come after this layer's backward
    (FSDP2's ``foreach_reduce`` at each group's post-backward).

    Also in the op-level run: ``timeline/fsdp.py`` (kept: module docstring)."""
    layer = layout.largest_layer_params
    shards = (layer + vocab_shard_params(model, plan.tp)) * policy.grad_bytes // (plan.dp * plan.cp)
    return layer * policy.grad_bytes, min(shards, st.grads)


def fsdp2_short_moments(
    plan: Plan, fsdp: _Fsdp2, fwd: dict[str, int], bwd_start: dict[str, int], x: A.Shape
) -> tuple[dict[str, int], dict[str, int] | None, int]:
    """FSDP2 (the bundled trainer, untied, one stage, no TP) at short sequences: (the forward's moment,
    a further backward moment or None, the unsharded bytes at the last layer's backward). Each moment
    replaces ``fwd`` / joins the backward's only where it is the wider, a difference of a few terms
    (the search's instructions a plan, docs/cost-model.md). Measured on
    llama3-8b at dp 8, 512 tokens, where FSDP2's buffers outgrow the activations: the sums were
    -2.6% (bf16) to +5.3% (bf16-mixed, full recompute) off the run under ZeRO-2 without these, and
    -5.0% under ZeRO-3, bf16-mixed, four micro-batches; within 0.015% and 0.001% with.

    - the head group's copy-out, at the forward's end: the last layer group's all-gather output
      still held (a forward's lives until the next group's copy-out, ``Fsdp.unshard``'s ``kept``)
      beside the head group's own ((norm, output): ``fsdp.norm.all_gather_output``, (V h + h) in the
      unsharded dtype, ``Fsdp.all_gather``), the last layer's output alive, the loss not begun;
    - the head group's post-backward: the group resharded, its reduce-scatter input ((V h + h) in
      the reduce dtype, ``fsdp.norm.reduce_scatter_input``) and output (its shard) allocated before
      its unsharded gradients go (``Fsdp.post_backward``): the head's weight gradient
      (``output.logits.dW``, V h unsharded) is still there, the loss's tensors are gone; under
      ZeRO-3 the last layer's all-gather, prefetched in the head group's pre-backward, beside them;
    - ZeRO-2 (``reshard_after_forward=False``), the last layer's backward: every later group
      resharded by its post-backward, so only this layer's group and the embedding's are unsharded
      (not every group, as at the backward's start); under ZeRO-3 ``fsdp2_unsharded``'s.
    Also in the op-level run: ``timeline/fsdp.py`` (kept: module docstring).
    """
    layer, head, reduced = fsdp.layer, fsdp.head, fsdp.head_reduced
    residual = A.residual_input(x)
    if residual + layer + head > fwd["logits_and_loss"]:
        fwd = {
            **fwd,
            "activations": fwd["activations"] + residual,
            "logits_and_loss": 0,
            "comm_buffers": fwd["comm_buffers"] + layer + head,
        }
    made = head + reduced // plan.dp  # the head's weight gradient (its norm's, h, counted with it) and the shard
    if made + residual + reduced + layer - head <= bwd_start["logits_and_loss"]:
        return fwd, None, fsdp.zero2_end
    post_backward = {
        **bwd_start,
        "gradients": bwd_start["gradients"] + made,
        "activations": bwd_start["activations"] + residual,
        "logits_and_loss": 0,
        # ZeRO-3: the head group's pre-backward has prefetched the last layer's all-gather
        "comm_buffers": bwd_start["comm_buffers"] + reduced + (layer if plan.zero == 3 else 0),
        "gathered_params": bwd_start["gathered_params"] - head,
    }
    return fwd, post_backward, fsdp.zero2_end


def fsdp2_head_backward(
    model: ModelSpec, layout: StageLayout, policy: PrecisionPolicy, base: dict[str, int], x: A.Shape,
    acts: int, grads: int, fp8_gather: bool = False,
) -> dict[str, int]:  # fmt: skip
    """FSDP2 ZeRO-3 in the LM head's backward (the bundled trainer, untied, one stage, no TP), at its
    input gradient (the run's ``output.logits.dX``): the loss's fp32 tensors are gone but for the
    logits' gradient cast to d (``loss.logits_fp32.grad``, b s V d); the head's weight gradient, made
    first, is unsharded (``output.logits.dW``, V h in the unsharded dtype) beside the unsharded head
    group, and the head group's pre-backward has prefetched the last layer's all-gather
    (``Fsdp.pre_backward``). ``acts``: the layers' kept inputs and the batch's tensors; the final
    norm's saved tensors and the labels are there too. On llama3-8b at dp 64, 1,024 tokens, full
    recompute, this is the run's peak: the sums were 4.8% under it without this moment.

    Also in the op-level run: ``timeline/fsdp.py`` (kept: module docstring)."""
    unsharded = min(policy.param_bytes, policy.compute_bytes)
    vocab = vocab_shard_params(model, 1)
    dx = x.tokens * x.d * model.hidden_size
    return {
        **base,
        "gradients": grads + vocab * unsharded,
        "activations": acts + A.hf_rmsnorm(x) + 8 * x.tokens + A.logits(x, model.vocab_size) + dx,
        "comm_buffers": fsdp2_layer_gather(model, layout, policy, fp8_gather),
        "gathered_params": (vocab + P.norm_params(model)) * unsharded,
    }


def fsdp2_tp_embedding_backward(
    model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, st: _States, base: dict[str, int],
    workspaces: int, x: A.Shape, accumulated: bool,
) -> list[dict[str, int]]:  # fmt: skip
    """The embedding's backward under FSDP2 with TP (the bundled trainer, untied, one stage), the
    step's last node, at its two widest moments. DTensor's vocabulary-parallel embedding backward
    yields a ``Replicate`` gradient of every row, V x h (``ops.embedding`` with ``vocab_shards``:
    torch 2.13's ``embedding_dense_backward`` over ``num_weights`` V), in the unsharded dtype, while
    the embedding group is still unsharded (V h / t) and the last layer group's reduce-scatter input is
    alive; every other group's gradient is reduce-scattered by then (the sharded gradients less the
    embedding's, whose shard is there too when an earlier micro-batch of the step made it:
    ``accumulated``), and the batch's ids and labels and cuBLAS's workspaces are the other activations.

    - inside the kernel: its fp32 partial sums of ``N + N // 10`` segments x h beside its int64 index
      buffers (``ops.embedding``: 40 N + 16 + 8 (N + N // 10) bytes over N ids) and the incoming
      gradient of the (b, s, h) lookup (sequence-gathered under SP);
    - under SP, FSDP2 then copies this rank's rows to the weight's ``Shard(0)`` before the replicated
      gradient goes (``fsdp.Fsdp._shard_vocab_grad``, ``FSDPParam._get_grad_inner_tensor``:
      ``tok_embeddings.weight.grad_shard``, V h / t); without SP the gradient is reduce-scattered as is.

    Measured against the run on llama3-8b, dp 8, TP 8, full recompute, 2,048 tokens: the sums 35.8%
    (SP) and 12.0% (no SP) under its peak without these moments, equal to its requested bytes with
    them (docs/cost-model.md).

    Also in the op-level run: ``timeline/fsdp.py, tensor_parallel.py`` (kept: module docstring)."""
    unsharded = min(policy.param_bytes, policy.compute_bytes)
    vocab = vocab_shard_params(model, plan.tp)
    h, n = model.hidden_size, x.tokens
    shard = int(vocab / (plan.dp * plan.cp) * policy.grad_bytes)
    others = st.grads if accumulated else st.grads - shard
    moment = {
        **base,
        "gradients": others + model.vocab_size * h * unsharded,
        "activations": workspaces + 16 * n,  # ids and labels (int64)
        "comm_buffers": layout.largest_layer_params * policy.grad_bytes,
        "gathered_params": vocab * unsharded,
    }
    segments = n + n // 10
    kernel = segments * h * 4 + 40 * n + 16 + 8 * segments + n * x.d * h
    moments = [{**moment, "activations": moment["activations"] + kernel}]
    if plan.sequence_parallel:
        moments.append({**moment, "gradients": moment["gradients"] + vocab * unsharded})
    return moments


def layer_activation_bytes(x: A.Shape, rt: RuntimeProfile, recompute: str, moe_fraction: float, ep: int) -> int:
    """One layer, one micro-batch, stored under a recomputation policy (none, selective or
    selective-op; a fully recomputed layer keeps only its input)."""
    if recompute == "selective-op":
        per_layer = A.op_sac_layer(x, attention_saved=not x.eager)
        if moe_fraction and x.model.moe is not None:
            # the MoE block replaces the dense MLP; its own tensors are counted as kept
            # (conservative: routed matmuls are not plain mm ops, and which of their outputs
            # the policy saves is not modelled)
            moe = A.moe_extra(x, ep, rt.mlp_tensors, _transformers_layers(rt))
            per_layer += int(moe_fraction * (moe - A.op_sac_mlp(x)))
        return per_layer
    if recompute == "selective":
        # Korthikanti Sec. 5: the attention core (scores, softmax, dropout; with flash its
        # log-sum-exp; on SDPA's math path its scaled copies and probabilities) is recomputed,
        # so none of it is stored: the checkpoint keeps q, k and v, whichever kernel runs
        x = replace(x, eager=False, sdpa="flash")
        per_layer = rt.layer(x) - A.korthikanti_attention_core(x) + A.checkpointed_core_fp32_qk(x)
    else:
        per_layer = rt.layer(x)
    if moe_fraction and x.model.moe is not None:
        # the MoE block replaces the dense MLP the runtime's layer term counted
        moe = A.moe_extra(x, ep, rt.mlp_tensors, _transformers_layers(rt))
        per_layer += int(moe_fraction * (moe - A.mlp(x, rt.mlp_tensors)))
    return per_layer


def layer_temp(x: A.Shape) -> int:
    """Gradient temporaries of a layer's backward at its peak: the gradient of the layer's
    output (b*s*h) and of the MLP's activation (b*s*f/t), in d (measured with MemTracker
    on transformers' Llama)."""
    ffn = x.model.moe.expert_ffn_size if x.model.moe else x.model.ffn_size
    return x.tokens * x.d * (ffn // x.t + x.model.hidden_size // x.rep)


def llama4_moe_temp(x: A.Shape) -> int:
    """transformers' Llama 4 MoE layer at its backward's peak (``Llama4TextExperts``: batched matmuls
    over every expert's copy of every token): the gradients of the experts' up and activation outputs,
    2 f per copy, num_experts copies per token, beside the layer output's gradient (measured on CPU
    with checkpointing, tests/accuracy/test_family_accuracy.py; the dense layer's f + h does not hold)."""
    moe = x.model.moe
    assert moe is not None
    return x.tokens * x.d * (2 * moe.num_experts * moe.expert_ffn_size // x.t + x.model.hidden_size // x.rep)


def pipeline_activation_bytes(x: A.Shape) -> int:
    """One activation torch.distributed.pipelining sends between stages: b*s*h/(t if SP) in
    the residual dtype (fp32 under autocast)."""
    element = 4 if x.autocast else x.d
    return x.tokens * element * x.model.hidden_size // x.rep


def pipeline_buffers(
    x: A.Shape, plan: Plan, stage: int, accumulation: int, layers: int
) -> tuple[int, int, int, int, int]:
    """The bundled trainer's pipeline buffers at forward end, backward start, backward end and the
    optimizer step (``timeline/pipeline.py``, the run: ``StageReplay``, byte for byte
    torch.distributed.pipelining's, tests/validate/test_pipeline_replay.py), and the receive buffers
    of the chunks in flight, which a first layer saving its input as is (fp32's first norm, a
    checkpoint) keeps as that input (the caller leaves them out of the first two then).

    One activation of b*s*h/(t if SP) in the stage's dtype is A. Each chunk but the global
    first keeps m receive buffers (allocated once), each chunk but the last m gradient receive
    buffers; a chunk's output waits in ``fwd_cache`` until its backward (in-flight
    micro-batches of non-last chunks). Each received activation's gradient is taken off its
    buffer and handed to the sends (``Pipeline._backward``): GPipe and the interleaved schedule
    hold every one to the step's end, with every sent output (``_HeldToStepEnd``), 1F1B only the
    latest (``_Held1F1B``'s ``bwd_sends``); all go before the optimizer's step (``sent.end()``).
    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring).
    """
    a = pipeline_activation_bytes(x)
    m, v = accumulation, plan.virtual_stages
    chunks = [c * plan.pp + stage for c in range(v)]
    not_first = sum(k != 0 for k in chunks)
    not_last = sum(k != plan.stages - 1 for k in chunks)
    persistent = m * (not_first + not_last) * a
    inflight = round(inflight_layers(plan, stage, accumulation, layers) * v / layers) if layers else 0
    shared = inflight * not_first // v * a
    held = 1 if plan.pp_schedule == "1f1b" else m  # the received gradients the sends hold at most
    end = persistent + max(min(m * not_first, held) * a - a, 0)
    if plan.pp_schedule != "1f1b":
        # every sent output and input gradient held to the step's end (the in-flight outputs among
        # them), counted over the run's schedule at its last forward and at its backward's peak
        at_forward, at_backward = sends_held(plan.pp_schedule, plan.pp, v, stage, m)
        return persistent + at_forward * a, persistent + at_backward * a, end, persistent, shared
    # the forward peak is the schedule's last forward: the backwards done before it have left
    # their input gradients, non-first chunks' only
    done = max(m * v - inflight, 0)
    fwd = persistent + inflight * not_last // v * a + min(done * not_first // v, held) * a
    return fwd, fwd, end, persistent, shared


def cached_logits(plan: Plan, accumulation: int, logits: int) -> tuple[int, int]:
    """The last pipeline rank's ``logits`` (b s V / t in the compute dtype) that ``fwd_cache`` holds
    beyond the loss's own at its last forward's loss, and in all at its loss's backward: each
    micro-batch's from its forward to its backward (``timeline/pipeline.py`` ``Pipeline._forward``;
    ``loss_fn`` returns only the loss, the logits stay the stage's output), as many as the run's
    schedule holds (``timeline.schedule.last_chunk_outputs``: all ``m`` under GPipe, one under
    1F1B). Without a pipeline the loss frees them.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    held = last_chunk_outputs(plan.pp_schedule, accumulation)
    return (held - 1) * logits, held * logits


def _moe_fraction(model: ModelSpec, layout: StageLayout, plan: Plan) -> float:
    if model.moe is None or layout.layers == 0:
        return 0.0
    indices = stage_layer_indices(model.num_layers, plan.pp, plan.virtual_stages, layout.stage)
    return sum(model.is_moe_layer(i) for i in indices) / len(indices)


class StageMoments(NamedTuple):
    """One pipeline stage's step: each phase's breakdown, the moments of the step the
    timeline reaches (``backward_start`` beside the chosen ``backward``), and the sizes of
    the tensors each category is made of."""

    phases: dict[str, dict[str, int]]
    totals: dict[str, int]  # each phase's allocated bytes (the sum of its breakdown)
    moments: dict[str, dict[str, int]]
    granularity: Granularity | None  # filled in by stage_moments (the search's phase sums skip it)
    build_grads: int  # gradient buffers allocated with the model (DDP buckets, contiguous buffers)
    states: _States
    per_layer: int
    total_acts: int
    offload_host: int = 0  # activation offload: host bytes of one micro-batch's offloaded tensors


def _granularity(
    model: ModelSpec,
    layout: StageLayout,
    plan: Plan,
    policy: PrecisionPolicy,
    x: A.Shape,
    fsdp: bool,
    fp8_gather: bool = False,
) -> Granularity:
    """One layer's weights (matmuls split by t, norms replicated; sharded over dp x cp under
    ZeRO-3), one hidden-width activation and one fp32 logits tensor, in bytes."""
    widths = [i * o // plan.tp for i, o in A.layer_matmul_widths(model)]
    norms = [P.norm_params(model)] * 2
    elements = [norms[0], *widths[:4], norms[1], *widths[4:]]
    weights = [n * policy.param_bytes for n in elements]
    gathered: tuple[int, ...] = ()
    if plan.zero >= 3 and plan.dp * plan.cp > 1:
        weights = [max(w // (plan.dp * plan.cp), 1) for w in weights]
        unsharded = min(policy.param_bytes, policy.compute_bytes)
        linear = 1 if fp8_gather else unsharded  # torchao's fp8 all-gather of the linear weights
        gathered = tuple(n * (unsharded if k in (0, 5) else linear) for k, n in enumerate(elements))
    units = round(inflight_layers(plan, layout.stage, 1, layout.layers)) if layout.layers else 0
    return Granularity(
        layer_params=tuple(weights),
        hidden=max(A.layer_input(x), 1),
        logits=max(A.fp32_logits(x, model.vocab_size), 1),
        layers=max(units, layout.layers),
        fsdp=fsdp,
        gather=fsdp2_layer_gather(model, layout, policy, fp8_gather) if fsdp else 0,
        gathered=gathered,
    )


@dataclass(frozen=True, slots=True)
class _MicroBatchTerms:
    """One micro-batch's activation terms that depend on the rank's shape, the runtime and the
    recomputation only (not on the stage, the ZeRO stage or the data-parallel degree)."""

    full_layer: int  # a layer as stored under the plan's recomputation (layer_activation_bytes)
    live_layer: int  # a layer in its backward, everything back (recomputation "none")
    layer_input: int
    embedding: int  # rt.embedding
    per_chunk: int  # rt.per_chunk (0 without)
    head: int
    loss_forward: int
    loss_backward: int
    temp: int  # layer_temp
    logits: int  # the LM head's output in the compute dtype (a pipeline's last stage keeps them: cached_logits)


@lru_cache(maxsize=8192)
def _micro_batch_terms(
    x: A.Shape, rt: RuntimeProfile, recompute: str, moe_fraction: float, ep: int
) -> _MicroBatchTerms:
    """The runtime's terms for one micro-batch of shape ``x``, computed once per distinct
    shape, runtime, recomputation, MoE share and ep: a search meets the same few thousands of
    times (its plans differ in dp, ZeRO, offload and the schedule more than in these)."""
    full_layer = layer_activation_bytes(x, rt, recompute, moe_fraction, ep)
    # in its backward a layer has everything back, recomputed parts included
    live_layer = full_layer if recompute == "none" else layer_activation_bytes(x, rt, "none", moe_fraction, ep)
    return _MicroBatchTerms(
        full_layer,
        live_layer,
        A.residual_input(x) if rt.name == "memplan" else A.layer_input(x),
        rt.embedding(x),
        rt.per_chunk(x) if rt.per_chunk is not None else 0,
        rt.head(x),
        rt.loss_forward(x),
        rt.loss_backward(x),
        layer_temp(x),
        A.logits(x, x.model.vocab_size),
    )


SHAPE_FIELDS = ("cp", "tp", "sequence_parallel", "attention", "precision", "quant")
"""The plan fields ``_shape`` reads besides ZeRO and dp, which it reads only through ``_fsdp2``
(tests/search/test_fast_form.py checks it by recording what the function reads)."""
_shape_fields = attrgetter(*SHAPE_FIELDS)
LAYOUT_FIELDS = ("tp", "ep", "pp", "virtual_stages")  # stage_layout's arguments; _moe_fraction reads pp and v
_layout_fields = attrgetter(*LAYOUT_FIELDS)
PIPELINE_FIELDS = ("pp", "virtual_stages", "pp_schedule")  # pipeline_buffers reads these (and stages = pp v)
_pipeline_fields = attrgetter(*PIPELINE_FIELDS)
STATE_FIELDS = ("dp", "cp", "ep", "zero", "optimizer", "offload_optimizer", "offload_params", "precision")
"""What ``model_states`` (full training) reads of the plan, with the stage's layout."""
_state_fields = attrgetter(*STATE_FIELDS)
BUILD_FIELDS = ("finetune", "pp", "cp", "ep", "offload_params", "precision", "tp", "dp", "zero")
"""What ``build_blocks.parameter_block_excess`` reads of the plan."""
_build_fields = attrgetter(*BUILD_FIELDS)


@dataclass(frozen=True, slots=True)
class MemoryMemo:
    """What the plans of one search share in the memory model, for one model, runtime and
    device (``search.evaluate.Context`` owns one; without one, each estimate starts its own):
    the rank's shape by the plan fields it reads, each stage's layout and MoE share by the
    layout, one micro-batch's activation terms by the shape and what else they read, and the
    pipeline's buffers, and a stage's model states by the layout and what they read, and the
    checkpointed forward's MLP moment by the shape and autocast's cached casts, and the stages
    examined (``_stages_to_examine``) by the pipeline's size."""

    shapes: dict[tuple, A.Shape] = field(default_factory=dict)
    layouts: dict[tuple, tuple[StageLayout, float, tuple]] = field(default_factory=dict)
    terms: dict[tuple, _MicroBatchTerms] = field(default_factory=dict)
    buffers: dict[tuple, tuple[int, int, int, int]] = field(default_factory=dict)
    states: dict[tuple, _States] = field(default_factory=dict)
    unsharded: dict[tuple, _Fsdp2] = field(default_factory=dict)
    mlp_moments: dict[tuple, int] = field(default_factory=dict)
    rebuilds: dict[tuple, tuple[int, int]] = field(default_factory=dict)  # first_backward_rebuild
    embeddings: dict[tuple, tuple[int, int, int]] = field(default_factory=dict)  # embedding_backward
    stages: dict[int, list[int]] = field(default_factory=dict)  # _stages_to_examine by pp
    builds: dict[tuple, int] = field(default_factory=dict)  # parameter_blocks by what it reads

    def shape(
        self, model: ModelSpec, workload: TrainingWorkload, plan: Plan, rt: RuntimeProfile, device: Device
    ) -> tuple[A.Shape, tuple]:
        """(``_shape``, its key)."""
        key = (workload.seq_len, workload.micro_batch, _shape_fields(plan), _fsdp2(rt, plan))
        if (x := self.shapes.get(key)) is None:
            x = self.shapes[key] = _shape(model, workload, plan, POLICIES[plan.precision], rt, device)
        return x, key

    def layout(self, model: ModelSpec, plan: Plan, stage: int) -> tuple[StageLayout, float, tuple]:
        """(``stage_layout``, ``_moe_fraction``, the key the stage's other memos extend) of
        pipeline rank ``stage``."""
        key = (*_layout_fields(plan), stage)
        if (found := self.layouts.get(key)) is None:
            layout = stage_layout(model, *key)
            found = self.layouts[key] = (layout, _moe_fraction(model, layout, plan), key)
        return found

    def model_states(
        self, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, model: ModelSpec, layout_key: tuple,
        optimizer_shard: int | None = None,
    ) -> _States:  # fmt: skip
        """``model_states`` of a stage (full training) of ``model``; ``layout_key``: :meth:`layout`'s."""
        key = (layout_key, _state_fields(plan), optimizer_shard)
        if (found := self.states.get(key)) is None:
            factored = factored_share(model)
            found = self.states[key] = model_states(layout, plan, policy, factored, optimizer_shard)
        return found

    def fsdp2_unsharded(
        self, model: ModelSpec, layout: StageLayout, plan: Plan, policy: PrecisionPolicy, fp8_gather: bool,
        layout_key: tuple,
    ) -> _Fsdp2:  # fmt: skip
        """``fsdp2_unsharded`` of a stage (it reads the layout, ZeRO and the precision)."""
        key = (layout_key, plan.zero, plan.precision, fp8_gather)
        if (found := self.unsharded.get(key)) is None:
            found = self.unsharded[key] = fsdp2_unsharded(model, layout, plan, policy, fp8_gather)
        return found

    def micro_batch(
        self, x: A.Shape, shape_key: tuple, rt: RuntimeProfile, recompute: str, moe_fraction: float, ep: int
    ) -> _MicroBatchTerms:
        """``_micro_batch_terms`` of the shape ``shape_key`` names."""
        key = (shape_key, recompute, moe_fraction, ep)
        if (found := self.terms.get(key)) is None:
            found = self.terms[key] = _micro_batch_terms(x, rt, recompute, moe_fraction, ep)
        return found

    def checkpointed_mlp_forward(self, x: A.Shape, shape_key: tuple, layer_copies: int, op_sac: bool = False) -> int:
        """``_checkpointed_mlp_forward`` (``op_sac``: ``op_sac_mlp_forward``) of the shape ``shape_key``
        names (they read nothing else)."""
        key = (shape_key, -1 - layer_copies) if op_sac else (shape_key, layer_copies)  # copies >= 0
        if (found := self.mlp_moments.get(key)) is None:
            moment = op_sac_mlp_forward if op_sac else _checkpointed_mlp_forward
            found = self.mlp_moments[key] = moment(x, layer_copies)
        return found

    def first_backward(self, x: A.Shape, shape_key: tuple, op_sac: bool, grad_bytes: int) -> tuple[int, int]:
        """``first_backward_rebuild`` of the shape ``shape_key`` names (the precision, in it, sets
        ``grad_bytes``)."""
        key = (shape_key, op_sac)
        if (found := self.rebuilds.get(key)) is None:
            found = self.rebuilds[key] = first_backward_rebuild(x, op_sac, grad_bytes)
        return found

    def embedding_backward(
        self, key: tuple, model: ModelSpec, x: A.Shape, layout: StageLayout, plan: Plan, policy: PrecisionPolicy,
        rt: RuntimeProfile, m: int, mbs: int,
    ) -> tuple[int, int, int]:  # fmt: skip
        """(``embedding_grad_pending``, ``embedding_backward_beside_grad``'s two) of the first stage
        without FSDP2; ``key``: the shape's and the layout's keys, the schedule and ``m`` (what they read)."""
        if (found := self.embeddings.get(key)) is None:
            held, outputs = embedding_backward_beside_grad(x, plan, layout.stage, m, mbs)
            found = self.embeddings[key] = (embedding_grad_pending(model, layout, plan, policy, rt), held, outputs)
        return found

    def parameter_blocks(self, model: ModelSpec, plan: Plan) -> int:
        """``build_blocks.parameter_block_excess``: what the bundled trainer's parameters' blocks
        hold beyond their bytes in the default caching allocator, by the plan fields it reads."""
        key = _build_fields(plan)
        if (found := self.builds.get(key)) is None:
            found = self.builds[key] = parameter_block_excess(model, plan)
        return found

    def pipeline(
        self, x: A.Shape, shape_key: tuple, plan: Plan, stage: int, accumulation: int, layers: int
    ) -> tuple[int, int, int, int, int]:
        """``pipeline_buffers`` (which reads the schedule and the activation's size)."""
        key = (shape_key, _pipeline_fields(plan), stage, accumulation, layers)
        if (found := self.buffers.get(key)) is None:
            found = self.buffers[key] = pipeline_buffers(x, plan, stage, accumulation, layers)
        return found


def _checkpointed_mlp_forward(x: A.Shape, layer_copies: int = 0) -> int:
    """The bundled trainer's forward inside the last checkpointed layer, beyond the layer inputs
    the checkpoints keep and RoPE's tables (both counted already): :func:`_last_mlp_moment` with
    nothing saved. A layer run under ``torch.utils.checkpoint`` saves nothing, but its attention
    residual, the MLP's normalised input and the product's moment (SiLU output, up output,
    product: 3 d f / t a token) are alive at once; with a wide MLP and a small vocabulary this
    outgrows the loss's tensors (measured on CPU: ffn 1024, hidden 128, vocabulary 256, fp32, 128
    tokens: the forward 9.4% above the loss's moment). ``layer_copies``: autocast's cache of the
    layers' weight casts (the last down projection's from its own moment). At one tensor rank this
    is :func:`trainer_offload.mlp_forward_bytes` less the layer's input and the tables.

    Also in the op-level run: ``timeline/recompute.py, trainer_model.py`` (kept: module docstring)."""
    return _last_mlp_moment(x, layer_copies, op_sac=False)


def op_sac_mlp_forward(x: A.Shape, layer_copies: int) -> int:
    """The bundled trainer's forward inside the last layer of a stage under per-op SAC
    (selective-op), beyond what the in-flight layers store (:func:`A.op_sac_layer` each, the
    current one counted whole): :func:`_last_mlp_moment` with the save list's outputs kept.
    Autocast's cache holds every layer's weight casts there (``layer_copies``): the save list keeps
    matmul outputs, not the casts, which live in the cache alone until the forward ends
    (:func:`checkpointed_layer_casts`). The op-level run (``trainer_run``, the 1B config of the
    H200 traces, pp 4, 8 micro-batches of 4,096 tokens, stage 0, the fourth micro-batch at
    ``layers.3.feed_forward.gate``): bf16-mixed 704,643,328 B beyond the in-flight saves, bf16
    218,104,064 B; this gives 704,643,072 B and 218,103,808 B (tests/unit/test_op_sac_forward.py).

    Also in the op-level run: ``timeline/recompute.py, trainer_model.py`` (kept: module docstring)."""
    return _last_mlp_moment(x, layer_copies, op_sac=True)


def _last_mlp_moment(x: A.Shape, layer_copies: int, op_sac: bool) -> int:
    """What a checkpointed layer's MLP holds at its widest forward moment beyond the layer's saves,
    per the bundled trainer's ops (``trainer_model``; ``tensor_parallel.py`` under TP): the
    attention residual and the MLP's normalised input (r h each, split by t under SP, where the
    MLP all-gathers the latter: r h more), autocast's cache (``layer_copies``; the last matmul's
    cast from its own moment), and the widest of the MLP's two moments. Gated: SiLU's output, the
    up output and the product (3 d f / t; per-op SAC keeps the gate's output, counted in the layer,
    and the down projection's output and its reduce-scatter's, not made yet), or the product beside
    the down projection's full-width partial sum (d h, per-op SAC's save) and its all-reduce
    output (d h, TP) or the reduce-scatter's contiguous input copy (d h) and output (d h / t, SP;
    per-op SAC's save). Plain (fc1, activation, fc2; no run to check it: the trainer refuses a
    plain MLP): the activation's output beside fc1's (freed after it; per-op SAC keeps fc1's), or
    beside fc2's output and its collective's.
    The run at TP 2, pp 4, stage 1, 4,096 tokens, bf16-mixed: SiLU, up and product 33,554,432 B
    each; under SP the all-gathered input 33,554,432 B (fp32) beside the split residuals.

    Also in the op-level run: ``timeline/recompute.py, trainer_model.py`` (kept: module docstring)."""
    m = x.model
    r, d, h, t, tokens = TO.residual_bytes(x), x.d, m.hidden_size, x.t, x.tokens
    f = m.ffn_size // t
    alive = tokens * (2 * r * h // x.rep + (r * h if x.sp else 0))
    # the row-parallel output's reduce-scatter (SP): its contiguous input copy (d h, transient) and
    # its output (d h / t)
    scatter_input, scattered = (d * h, d * h // t) if x.sp else (0, 0)
    reduced = d * h if t > 1 and not x.sp else 0  # or its all-reduce (TP without SP)
    last_copy = h * f * d if layer_copies else 0
    if m.mlp == "gated":
        first = 3 * d * f - (d * h + scattered if op_sac else 0)
        last = d * f + reduced + scatter_input + (0 if op_sac else d * h + scattered)
    else:
        first = d * f if op_sac else 2 * d * f
        last = d * f + d * h + reduced + scatter_input + (0 if op_sac else scattered)
    return alive + max(tokens * first + layer_copies - last_copy, tokens * last + layer_copies)


def first_backward_rebuild(x: A.Shape, op_sac: bool, grad_bytes: int) -> tuple[int, int]:
    """(weight gradients made, bytes held) beyond the layers' saves when a checkpointed layer's
    backward (a pipeline stage's first: its last layer) has run its recomputation and reached
    the widest node of its MLP's backward, at one tensor rank with flash or cuDNN SDPA and a gated MLP:
    :func:`trainer_offload.mlp_backward` recomputed (the rebuilt layer, ``recomputed_layer_saves``,
    and the node's gradients: ``w2.dX``, ``gate.grad_other``, ``gate.grad_self``). Under autocast
    the recomputation runs in a fresh autocast cache, which holds the layer's seven weight casts
    again (d h (q + 2 kv) + d q h + 3 d h f).
    Under per-op SAC (``timeline/recompute.py``) the save list's outputs are not rebuilt: the
    layer's kept tensors but its input and the down projection's output (q, v, SDPA's output and
    log-sum-exp, the gate's output) are in the in-flight saves, and the saved q goes once RoPE
    has run again. The run (``trainer_run``, the 1B config of the H200 traces, pp 4, 8
    micro-batches of 4,096 tokens, stage 1, bf16): full 579,371,024 B allocated after the
    backward's mark (this: 16 B less, SDPA's philox seed and offset), selective-op 473,989,120 B
    net (this, to the byte); the stage's backward peak in the sums, bf16 and bf16-mixed alike:
    full -1,024 B, selective-op -12,288 B (tests/search/test_fast_form_grid.py, ``STAGES``).

    Also in the op-level run: ``timeline/recompute.py, trainer_model.py`` (kept: module docstring)."""
    m = x.model
    made, held = TO.mlp_backward(x, 0, grad_bytes, True)
    if x.autocast:
        held += sum(i * o for i, o in A.layer_matmul_widths(m)) * x.d
    if op_sac:
        held -= A.op_sac_layer(x) - x.tokens * (TO.residual_bytes(x) + x.d) * m.hidden_size
    return made, held


def warmup_output_held(plan: Plan, stage: int, m: int) -> int:
    """How many stage outputs ``Schedule1F1B``'s ``send_work`` holds beyond the in-flight ones at a
    backward that starts with the warm-up's micro-batches in flight (``timeline/pipeline.py``,
    ``_Held1F1B``): the warm-up sets it to each of its first ``w - 1`` forwards' outputs (``w``,
    the warm-up's forwards: ``inflight_microbatches``), and only a backward after the last forward
    rebinds it, so from backward ``w - 1`` (that micro-batch's own) to backward ``m - w`` (the
    first after the last forward, whose start still has ``w`` in flight) it holds an output whose
    micro-batch is done: one, where ``m >= 2 w - 1`` and ``w >= 2``.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    w = min(plan.pp - stage, m)
    return int(plan.pp_schedule == "1f1b" and plan.pp > 1 and w >= 2 and m >= 2 * w - 1)


def embedding_backward_beside_grad(x: A.Shape, plan: Plan, stage: int, m: int, mbs: int) -> tuple[int, int]:
    """(activations, stage outputs) at the first pipeline stage's embedding backward in 1F1B's
    steady state, beyond the other in-flight micro-batches' saves and the gradients (the one an
    earlier backward left and the fresh one ``embedding_dense_backward`` makes beside it, added
    after: ``ops.embedding``, a replicated V h under DTensor TP). Activations: the gradient of the
    embedding's output (r h a token) and the kernel's buffers at its widest node
    (:func:`embedding_backward_temp`). Outputs: every in-flight micro-batch's stage output, this
    one's too (the stage's backward holds it until it returns), and the one ``send_work`` holds
    (:func:`warmup_output_held`). The run (``trainer_run``, the 1B config of the H200 traces, pp 4,
    8 micro-batches, stage 0): TP 2 bf16-mixed at 512 tokens, the live bytes at the peak to the
    byte (the allocator's blocks 1,049,688 B more); one tensor rank, bf16 selective-op at 2,048
    tokens, to 192 B.

    Also in the op-level run: ``timeline/pipeline.py`` (kept: module docstring)."""
    r, h = TO.residual_bytes(x), x.model.hidden_size
    outputs = (mbs + warmup_output_held(plan, stage, m)) * pipeline_activation_bytes(x)
    return x.tokens * r * h + embedding_backward_temp(x), outputs


def other_micro_batches_casts(casts_each: int, mbs: int) -> int:
    """Autocast's weight casts the other in-flight micro-batches' graphs still save at a backward's
    embedding backward (the stage's last node, :func:`embedding_backward_beside_grad`): each
    micro-batch's forward casts in its own cache (``trainer_model.Model.cache``), its graph keeps
    them to its backward, and this micro-batch's backward has freed its own by then
    (``layers.N.*.weight.autocast``, ``casts_each`` a micro-batch; 0 where checkpoints keep none).
    The run's peak (``trainer_run``, the 1B config of the H200 traces, pp 4, 8 micro-batches of
    512 tokens, bf16-mixed, no recompute, stage 0, ``tok_embeddings.embedding.grad_weight_per_segment``
    beside a second ``tok_embeddings.embedding.grad_weight``): three micro-batches' casts,
    1,459,617,792 B; the sums without them 2.71% under the run.

    Also in the op-level run: the autocast cache of ``timeline/trainer_model.py`` (kept: module docstring)."""
    return casts_each * (mbs - 1)


def embedding_backward_temp(x: A.Shape) -> int:
    """``ops.embedding``'s backward (``embedding_dense_backward_cuda``) at its widest node, beside
    the weight gradient it makes: over N ids the int64 sorted ids, sort order, segment offsets,
    partials per segment and partial offsets (5 x 8 N), the two counts (2 x 8), the partials'
    segment offsets (8 P) and their fp32 partial sums (4 P h), P = N + N // 10 segments.

    Also in the op-level run: ``timeline/trainer.py, ops.py`` (kept: module docstring)."""
    n = x.tokens
    parts = n + n // 10
    return 8 * (5 * n + 2 + parts) + 4 * parts * x.model.hidden_size


# the moments' keys, read once: an enum member looked up on its class costs a Python call (3.11)
_FORWARD, _BACKWARD_START = Moment.FORWARD, Moment.BACKWARD_START
_BACKWARD, _OPTIMIZER = Moment.BACKWARD, Moment.OPTIMIZER


def _largest(candidates: list[dict[str, int]]) -> tuple[dict[str, int], int]:
    """The candidate breakdown with the largest sum (the first of equals), and that sum."""
    best, total = candidates[0], sum(candidates[0].values())
    for phase in candidates[1:]:
        s = sum(phase.values())
        if s > total:
            best, total = phase, s
    return best, total


def _rebuilds_first_backward(
    model: ModelSpec, x: A.Shape, plan: Plan, fsdp2: bool, plain: bool, moe_fraction: float, every_layer: bool
) -> bool:
    """Whether :func:`first_backward_rebuild` is the run's first backward layer on a non-last
    pipeline stage: every layer checkpointed, one tensor rank, flash or cuDNN SDPA (whose saves, the
    output and the fp32 log-sum-exp, are the ones it counts), a dense gated MLP, no
    FSDP2, LoRA, fp8 or activation offload (where the run has other tensors there)."""
    if not every_layer or not plain or fsdp2 or moe_fraction or x.t > 1 or x.eager or x.sdpa not in ("flash", "cudnn"):
        return False
    return model.mlp == "gated" and plan.offload_activations == "none" and plan.precision != "fp8"


def _states(
    model: ModelSpec, plan: Plan, layout: StageLayout, layout_key: tuple, policy: PrecisionPolicy, device: Device,
    memo: MemoryMemo, optimizer_shard: int | None = None,
) -> _States:  # fmt: skip
    """:func:`stage_states` of a stage whose layout the caller has (``_stage_phases``; ``optimizer_shard``:
    :func:`zero1_shard`'s)."""
    # the factored share only where the memo has no states yet (a model's attribute read is slow)
    full = None
    if plan.finetune == "full":
        full = memo.model_states(layout, plan, policy, model, layout_key, optimizer_shard)
    return device_states(model, plan, layout, policy, device, full)


def _stage_phases(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    rt: RuntimeProfile,
    stage: int,
    accumulation: int,
    device: Device = "cuda",
    memo: MemoryMemo | None = None,
    shape: tuple[A.Shape, tuple] | None = None,
) -> StageMoments:
    """Breakdowns of each phase for one pipeline stage, plus states, per-layer and total
    activations. ``memo``: the search's (see :class:`MemoryMemo`); ``shape``: its
    :meth:`MemoryMemo.shape` of this plan, which every stage shares (``training_peak``)."""
    memo = MemoryMemo() if memo is None else memo
    policy = POLICIES[plan.precision]
    fsdp2 = _fsdp2(rt, plan)
    layout, moe_fraction, layout_key = memo.layout(model, plan, stage)
    finetune = plan.finetune != "full"
    zero1 = zero1_shard(model, plan, rt) if plan.zero == 1 and plan.pp == 1 and plan.finetune == "full" else None
    st = _states(model, plan, layout, layout_key, policy, device, memo, zero1)
    x, shape_key = memo.shape(model, workload, plan, rt, device) if shape is None else shape
    terms = memo.micro_batch(x, shape_key, rt, plan.recompute, moe_fraction, plan.ep)
    full_layer, live_layer = terms.full_layer, terms.live_layer
    fp8 = F8.fp8_step(layout, plan, rt.name, x, fsdp2, moe_fraction)
    op_sac = plan.recompute == "selective-op"  # per-op SAC: every layer under a checkpoint
    # TE's fp8 keeps the linears' saved inputs (the norms' outputs, fc2's input) in fp8: per-op SAC
    # keeps none of them (its layer input and matmul outputs, A.op_sac_layer), only the layer its
    # backward rebuilds has them
    if fp8.layer_delta:
        full_layer += 0 if op_sac else fp8.layer_delta
        live_layer += fp8.layer_delta
    if finetune and not _lora_layers(rt):
        full_layer += lora_extra(x, plan)
        live_layer += lora_extra(x, plan)
    layers = layout.layers
    recomputed = 0
    if plan.recompute == "full":
        recomputed = layers if plan.recompute_layers is None else min(plan.recompute_layers, layers)
    stored = (layers - recomputed) * full_layer + recomputed * terms.layer_input
    per_layer = terms.layer_input if recomputed else full_layer
    lora_acts = lora_activations(model, x, plan, rt, layout, device) if finetune and _lora_layers(rt) else None
    if lora_acts is not None:
        stored, per_layer, live_layer = lora_acts.stored, lora_acts.per_layer, lora_acts.live_layer
    mbs = inflight_microbatches(plan, stage, accumulation)
    chunks = chunks_in_flight(plan.pp_schedule, plan.pp, plan.virtual_stages, stage, accumulation) if plan.pp > 1 else 0
    inflight = chunks * layers / plan.virtual_stages if chunks else layers  # inflight_layers
    layer_acts = int(stored * inflight / layers) if layers else 0
    embed = terms.embedding * mbs if layout.is_first else 0
    if rt.per_chunk is not None and layers:
        # chunk-micro-batches in flight on this rank
        embed += terms.per_chunk * round(inflight * plan.virtual_stages / layers)
    head = terms.head * mbs if layout.is_last else 0
    cached_fwd = cached = 0
    if plan.pp > 1 and layout.is_last and rt.pytorch_parallel:
        cached_fwd, cached = cached_logits(plan, accumulation, terms.logits)
    if lora_acts is not None and layout.is_last:
        head += lora_acts.head_delta * mbs
    loss_fwd = terms.loss_forward if layout.is_last else 0
    loss_bwd = terms.loss_backward if layout.is_last else 0
    retained = rt.retained(x, layers, plan.recompute == "full") if layout.is_last else 0
    if lora_acts is not None:
        retained += lora_acts.retained

    # communication buffers
    gathered = 0
    rs_buffer = end_shards = 0
    unsharded = _NO_FSDP2
    sharded = plan.dp * plan.cp > 1
    if fsdp2:
        # FSDP2 keeps the sharded params as the parameters and gathers the rest per group
        shard = int(st.optimizer_elements * policy.param_bytes) if plan.offload_params == "none" else 0
        st = st._replace(params=shard)
        unsharded = memo.fsdp2_unsharded(model, layout, plan, policy, fp8.gather_fp8, layout_key)
        if plan.pp > 1 and plan.zero == 3 and plan.pp_schedule == "interleaved" and layers:
            at_start, others = pipelined_unsharded_chunks(
                plan.pp_schedule, plan.pp, plan.virtual_stages, stage, accumulation
            )
            chunk = fsdp2_layer_gather(model, layout, policy, fp8.gather_fp8) * layers // plan.virtual_stages
            unsharded = unsharded._replace(
                backward_start=unsharded.backward_start + at_start * chunk,
                backward_end=unsharded.backward_end + others * chunk,
            )
        if plan.offload_params != "none":
            st = st._replace(grads=0)  # CPUOffloadPolicy moves the sharded grads to the host too
        if plan.zero == 3 and plan.pp == 1 and layers and not finetune and not model.tied_embeddings:
            rs_buffer, end_shards = fsdp2_first_layer_backward(model, layout, plan, policy, st)
    elif plan.zero >= 3 and sharded:
        # the current layer and the prefetched one; on the first / last stage the gathered
        # embedding or LM head with one prefetched layer, whichever is larger
        layer = layout.largest_layer_params
        vocab = vocab_shard_params(model, plan.tp) if layout.is_first or layout.is_last else 0
        gathered_n = max(ZERO3_PREFETCH_LAYERS * layer, vocab + layer)
        gathered = gathered_n * min(policy.param_bytes, policy.compute_bytes)
        rs_buffer = layout.largest_layer_params * policy.grad_bytes
    elif plan.zero == 2 and sharded:
        rs_buffer = layout.largest_layer_params * policy.grad_bytes
    ddp_copy = st.grads if plan.zero == 0 and plan.dp * plan.cp > 1 and rt.ddp_grad_copy else 0
    ddp_buckets = rt.pytorch_parallel and plan.zero < 2 and plan.dp * plan.cp > 1  # gradient_as_bucket_view
    p2p_fwd = p2p_bwd_start = p2p_bwd_end = p2p_opt = 0
    if rt.pytorch_parallel and plan.pp > 1:
        p2p_fwd, p2p_bwd_start, p2p_bwd_end, p2p_opt, shared = memo.pipeline(
            x, shape_key, plan, stage, accumulation, layers
        )
        # the first layer's input, counted in its layer: a checkpoint's (full, or per-op SAC's, which
        # keeps the layer's input as is) or fp32's first norm's
        if recomputed or op_sac or (x.d == 4 and not x.autocast):
            p2p_fwd, p2p_bwd_start = p2p_fwd - shared, p2p_bwd_start - shared
    elif plan.pp > 1:
        p2p_fwd = p2p_bwd_start = p2p_bwd_end = p2p_opt = 2 * x.tokens * x.d * model.hidden_size // x.rep
    # gradients exist during forward / early backward only if kept across steps or accumulated
    grads_in_step = st.grads if (rt.grads_persistent or accumulation > 1 or ddp_buckets) else 0
    early_backward = bool(chunks and layers) and backward_first(
        plan.pp_schedule, accumulation, plan.virtual_stages, chunks
    )
    if plan.pp > 1 and not (rt.grads_persistent or ddp_buckets) and not early_backward:
        grads_in_step = 0  # every forward runs before the first backward creates a gradient
    grads_full = st.grads
    if fsdp2 and plan.pp > 1:
        # pipelining runs every micro-batch's backward without gradient sync or resharding
        # and reduce-scatters once after the last (stage.py backward_maybe_with_nosync):
        # each group's unsharded gradients stay, accumulated in the reduce dtype
        # (FSDPParam.to_accumulated_grad_if_needed), from its first backward to the step end
        grads_full = layout.params * policy.grad_bytes
        grads_in_step = grads_full if early_backward else 0
    if ddp_buckets and accumulation > 1:
        # under no_sync the accumulated grads are plain tensors beside the buckets; the last
        # micro-batch's reduction copies them in and re-points .grad at the buckets
        ddp_copy = st.grads
    master_grads = 0
    if rt.master_grads_fp32 and policy.master_bytes and plan.offload_optimizer == "none":
        masters = st.optimizer_elements if st.master_elements is None else st.master_elements
        master_grads = int(masters * 4)  # fp32 gradients for the master weights

    tied_here = layout.is_first and layout.is_last and model.tied_embeddings and not finetune
    if rt.pytorch_parallel and plan.tp > 1 and layout.is_first and not fsdp2 and not tied_here and not finetune:
        # DTensor's embedding backward under RowwiseParallel yields a replicated V x h grad
        # (tied, it is summed into the LM head's vocab-sharded one)
        replicated = model.vocab_size * model.hidden_size - vocab_shard_params(model, plan.tp)
        grads_full += replicated * policy.grad_bytes
        if grads_in_step:  # an earlier backward's, beside the forwards and backwards after it
            grads_in_step += replicated * policy.grad_bytes
        if master_grads:  # and MasterAdamW's fp32 cast of it is as wide (tok_embeddings.weight.grad_fp32)
            master_grads += replicated * 4
    weight_copies = autocast_weight_copies(model, layout, plan, x.d) if x.autocast else 0
    if lora_acts is not None:
        weight_copies = lora_acts.weight_copies
    kept_copies = weight_copies
    casts_each = 0  # one in-flight micro-batch's casts where each keeps its own (1F1B, GPipe)
    if rt.name == "memplan" and x.autocast and lora_acts is None:
        kept_copies -= checkpointed_layer_casts(model, layout, plan, x.d, recomputed)
        if plan.pp > 1 and plan.virtual_stages == 1 and plan.offload_activations == "none":
            # each micro-batch's forward casts in its own autocast cache (``trainer_model.Model.cache``,
            # let go at its forward's end), and its graph saves them to its backward: every in-flight
            # micro-batch's casts (pp 4, 8 x 512 tokens, bf16-mixed, stage 1: 1,459,617,792 B in the
            # run's forward, three sets; the sums had one, -16.2% at the stage's peak, GPipe -37.8%)
            casts_each, kept_copies = kept_copies, kept_copies * mbs
    fwd_acts, fwd_head, bwd_copies, others_kept, head_back = layer_acts, head, kept_copies, None, 0
    offload_host = mlp_peak = 0
    fwd_copies, bwd_head, embedding_backward, mlp_backward, norm_backward = kept_copies, head, 0, None, 0
    if plan.offload_activations != "none":
        off = activation_offload(model, x, plan, rt, layout, stored, head, weight_copies, lora_acts)
        share = inflight / layers if layers else 1
        fwd_acts, fwd_head, bwd_copies, head_back = int(off.kept * share), off.head_kept, off.copies_kept, off.head_back
        fwd_head += off.stash
        if off.bwd_head is not None:  # the bundled trainer (memplan_offload)
            # RoPE's tables die with the forward (their saves are on the host), and so does
            # autocast's cache of weight casts, which the loss (outside autocast) does not see
            # (the last layer's MLP moment counts them)
            embed -= terms.per_chunk * round(inflight * plan.virtual_stages / layers) if layers else 0
            fwd_copies, bwd_head, embedding_backward = 0, off.bwd_head, off.embedding_backward
            mlp_backward, norm_backward = off.mlp_backward, off.norm_backward
        # with the layers' tensors gone, the forward may peak inside the last layer's MLP instead
        mlp_peak = max(0, off.mlp_forward - fwd_head - terms.loss_forward)
        offload_host = off.host
        st = st._replace(cpu=st.cpu + off.host * mbs)  # pinned host memory, beside offloaded states
        if plan.recompute != "full":
            others_kept = fwd_acts - off.last if off.mechanism == "trl" else 0
            live_layer = min(live_layer, off.last + off.node)
    # the build's parameters hold their allocator blocks (unsplit rests of their segments) at every moment
    params = st.params
    if plan.pp == 1 and device == "cuda" and rt.name == "memplan":  # build_blocks: one stage's build only
        params += memo.parameter_blocks(model, plan)
    base = {"parameters": params, "optimizer_states": st.optimizer, "fp8_weights": fp8.weights}
    # eager fp8 casts: the last layer's down projection may outgrow the loss's tensors at the
    # forward's end; in the layer's forward its input and mid-layer residual are alive, unsaved
    fp8_forward = max(0, fp8.forward_extra + 2 * A.layer_input(x) - fwd_head - loss_fwd) if fp8.forward_extra else 0
    checkpointed = recomputed or (op_sac and layers)
    if rt.name == "memplan" and checkpointed and plan.offload_activations == "none" and lora_acts is None:
        # autocast's cache at that moment: every layer's casts but the LM head's (cast after the
        # layers); the forward counts the ones kept past it as autocast_weights
        head_cast = vocab_shard_params(model, plan.tp) * x.d if layout.is_last and weight_copies else 0
        # under per-op SAC the last layer's MLP beside every in-flight layer's saves (op_sac_mlp_forward)
        moment = memo.checkpointed_mlp_forward(x, shape_key, weight_copies - head_cast, not recomputed) - fwd_copies
        mlp_peak = max(0, moment - fwd_head - loss_fwd)
    if fwd_copies < weight_copies and layout.is_last and plan.offload_activations == "none":
        # the LM head's output, before the loss: autocast's cache still holds every cast, the head's
        # saves and the final norm's fp32 output (``Model.head``'s ``n``, dropped after the matmul)
        # are there, the loss's fp32 tensors not yet (the run's ``output.logits``)
        head_part = fwd_head - A.fp32_logits(x, model.vocab_size) + A.residual_input(x) + terms.logits
        at_logits = weight_copies - fwd_copies + head_part
        mlp_peak = max(mlp_peak, at_logits - fwd_head - loss_fwd)
    # cuBLAS's workspaces beside every moment, as activations (the run's): each moment's activations
    # below count ``embed``, and the optimizer step's and a tied embedding's backward's get them alone
    workspaces = _CUBLAS_WORKSPACES if device == "cuda" and rt.name == "memplan" else 0  # overhead.cublas_workspaces
    embed += workspaces
    fwd = {
        **base,
        "gradients": grads_in_step,
        "autocast_weights": fwd_copies,
        "activations": fwd_acts + embed + max(mlp_peak, fp8_forward),
        "logits_and_loss": fwd_head + loss_fwd + cached_fwd,
        "comm_buffers": gathered + p2p_fwd + ddp_copy,
        "gathered_params": unsharded.forward,
        "retained_outputs": retained,
    }
    bwd_start = {  # the loss's gradients appear; every activation is still saved
        **base,
        "gradients": grads_in_step,
        "autocast_weights": bwd_copies,
        "activations": fwd_acts + embed,
        "logits_and_loss": bwd_head + loss_bwd + head_back + cached,
        "comm_buffers": gathered + p2p_bwd_start + ddp_copy,
        "gathered_params": unsharded.backward_start,
    }  # no reduce-scatter buffer yet: no layer has produced gradients
    # the last layer's backward: the other in-flight micro-batches' activations, this
    # layer's (rebuilt when recomputed) and its gradient temporaries, gradients nearly
    # complete; the loop may still hold the logits
    others = layer_acts - stored if layers else 0
    layer_part = live_layer + terms.temp
    if _transformers_layers(rt) and A.every_expert_runs(model) and layout.layers:
        last = stage_layer_indices(model.num_layers, plan.pp, plan.virtual_stages, layout.stage)[-1]
        if model.is_moe_layer(last):
            layer_part = live_layer + llama4_moe_temp(x)
    if lora_acts is not None:
        earlier = lora_acts.earlier if others_kept is None else others_kept
        layer_part = earlier + live_layer + lora_acts.temp
    if A.attention_backward_transient(x) and layers:
        # SDPA's math path: later in the layer's backward, with its MLP's tensors freed, the
        # softmax backward holds the core's s x s gradients beside the probabilities
        cache = rt.dynamic_cache and plan.recompute != "full"  # use_cache is off under checkpointing
        layer_part = max(layer_part, A.math_attention_backward(x, dynamic_cache=cache))
    end_grads, end_acts = grads_full - end_shards, others + embed + layer_part
    pending = 0
    # the input embedding's gradient comes after the last layer's backward, in every PyTorch loop
    if not grads_in_step and layers and not finetune:
        pending = min(embedding_grad_pending(model, layout, plan, policy, rt), grads_full)
    if pending:
        # the first backward on this rank reaches its last layer before the embedding's
        # backward, with every in-flight micro-batch's activations still kept; later
        # backwards have the embedding's gradient and one micro-batch fewer in flight
        second = grads_full + end_acts - stored if mbs > 1 else 0
        if grads_full - pending + end_acts >= second:
            end_grads = grads_full - pending
        else:
            end_acts -= stored
    end_gathered, zero2_backward = unsharded.backward_end, None
    if fsdp2 and plan.pp == 1 and plan.tp == 1 and layers and not model.tied_embeddings:
        if not finetune and plan.offload_params == "none" and plan.offload_activations == "none":
            fwd, zero2_backward, end_gathered = fsdp2_short_moments(plan, unsharded, fwd, bwd_start, x)
    bwd_end = {
        **base,
        "gradients": end_grads,
        "activations": end_acts,
        "logits_and_loss": retained,
        "comm_buffers": gathered + rs_buffer + p2p_bwd_end + ddp_copy,
        "gathered_params": end_gathered,
    }
    opt = {
        **base,
        "gradients": st.grads if fsdp2 else grads_full,
        # fused AdamW (the HF Trainer's default) updates in place: no foreach temporaries
        "optimizer_temp": (0 if rt.fused_adamw and plan.optimizer == "adamw" else st.optimizer_temp) + master_grads,
        "comm_buffers": (0 if ddp_buckets else ddp_copy) + p2p_opt,
        "retained_outputs": retained,
    }
    if workspaces:
        opt["activations"] = workspaces
    candidates = [bwd_start, bwd_end]
    if plan.pp_schedule == "interleaved" and plan.pp > 1 and layers:
        if grads_in_step and rt.pytorch_parallel and not (rt.grads_persistent or ddp_buckets):
            # only the chunks a backward has reached hold gradients
            fwd["gradients"], bwd_start["gradients"] = pipelined_gradients(
                model, layout, plan, accumulation, grads_in_step
            )
        if fsdp2 and plan.zero == 3:  # the chunks a backward left unsharded, and the last forward's own layer
            gather = fsdp2_layer_gather(model, layout, policy, fp8.gather_fp8)
            kept, current = pipelined_forward_gathered(layout, plan, policy, accumulation, gather)
            fwd["gathered_params"] += kept + current
            fwd["comm_buffers"] += current
            if current and plan.recompute != "full":  # inside that layer: its input, mid-layer residual, MLP output
                fwd["activations"] += 2 * A.residual_input(x) + A.layer_input(x)
            last = pipelined_last_backward(layout, plan, policy, bwd_end, gather, stored, embed + layer_part)
            candidates.append(last)
            plain = lora_acts is None
            if recomputed == layers and _rebuilds_first_backward(model, x, plan, False, plain, moe_fraction, True):
                # one chunk-micro-batch in flight: its ids (the first rank's), RoPE's tables, cuBLAS's workspaces
                alone = (terms.embedding if layout.is_first else 0) + terms.per_chunk + workspaces
                candidates.append(
                    pipelined_last_down_projection(
                        model, plan, policy, last, x, stored // plan.virtual_stages, alone, p2p_opt, stage
                    )
                )
                regather = pipelined_loss_chunk_regather(
                    model, layout, plan, policy, last, x, accumulation, gather, stored // plan.virtual_stages,
                    alone, terms.per_chunk, terms.logits, p2p_opt,
                )  # fmt: skip
                if regather is not None:
                    candidates.append(regather)
        if fsdp2:  # the first rank's embedding backward and reduce-scatter; the most in flight's gradients
            candidates[1], extra = interleaved_fsdp2_backwards(
                model, layout, plan, policy, x, accumulation, bwd_start, bwd_end, grads_full,
                stored // plan.virtual_stages, embed, p2p_opt, workspaces, fp8.gather_fp8, finetune, full_layer,
            )  # fmt: skip
            candidates += extra
    if mlp_backward is not None:
        # the bundled trainer offloading: the first layer's backward walked node by node
        # (memplan_offload) stands for the estimate of its end
        made, held = mlp_backward
        before = grads_full
        if not grads_in_step:  # the layer's own gradients and the embedding's are still to come
            layer_grads = layout.largest_layer_params * policy.grad_bytes
            before = grads_full - embedding_grad_pending(model, layout, plan, policy, rt) - layer_grads
        else:
            made = 0  # accumulated in place: each new gradient is a temporary of its node
        candidates[1] = {**bwd_end, "gradients": before + made, "activations": embed + held}
        if norm_backward:
            before = grads_full
            if not grads_in_step:
                before -= embedding_grad_pending(model, layout, plan, policy, rt)
            candidates.append({**bwd_end, "gradients": before, "activations": embed + norm_backward})
    if embedding_backward:
        # offloaded, the embedding's backward may be the widest: every gradient, its own
        # being made, beside its incoming gradient and the ids' copy (memplan_offload)
        candidates.append(
            {
                **base,
                "gradients": grads_full,
                "activations": embed + embedding_backward,
                "comm_buffers": gathered + rs_buffer + ddp_copy,
            }
        )
    if rt.pytorch_parallel and tied_here:
        # the embedding's backward of a tied model: the LM head's gradient of the shared
        # matrix (V h / t) waits in autograd's input buffer, the embedding's own arrives, and
        # the two are summed (V h / t); every other gradient exists, no activation is left.
        # Under DTensor TP the embedding's gradient is replicated (V h) and redistributing it
        # to the head's vocab-sharded placement copies its shard (V h / t) before the sum:
        # measured 5 V h / t at t = 2 and 7 V h / t at t = 4 (docs/cost-model.md)
        tied = vocab_shard_params(model, plan.tp)
        own = model.vocab_size * model.hidden_size if plan.tp > 1 else tied  # DTensor: replicated
        shard_copy = tied if plan.tp > 1 else 0  # DTensor's redistribution of the replicated gradient
        summing = tied + own + shard_copy + tied  # head's gradient, embedding's, the copy, the sum
        bytes_ = min(policy.param_bytes, policy.compute_bytes) if fsdp2 else policy.grad_bytes
        share = tied * st.grads // layout.params if layout.params else 0
        candidates.append(
            {
                **base,
                "gradients": grads_full - share,
                "optimizer_temp": summing * bytes_,
                # FSDP2: only the root group (embedding and norm) is unsharded, and the
                # last layer group's reduce-scatter input is still alive
                "comm_buffers": layout.largest_layer_params * policy.grad_bytes if fsdp2 else 0,
                "gathered_params": (tied + P.norm_params(model)) * bytes_ if fsdp2 else 0,
            }
        )
        if workspaces:
            candidates[-1]["activations"] = workspaces
    if rt.pytorch_parallel and fsdp2 and plan.pp == 1 and not finetune and not model.tied_embeddings:
        if plan.offload_params == "none" and layout.is_first:
            candidates += fsdp2_tp_embedding_backward(
                model, layout, plan, policy, st, base, workspaces, x, bool(grads_in_step)
            )
    if fsdp2 and plan.zero == 3 and plan.pp == 1 and plan.tp == 1 and layout.is_last and layers and not finetune:
        if not model.tied_embeddings and plan.offload_params == "none" and plan.offload_activations == "none":
            candidates.append(
                fsdp2_head_backward(model, layout, policy, base, x, fwd_acts + embed, grads_in_step, fp8.gather_fp8)
            )
    if zero2_backward is not None:
        candidates.append(zero2_backward)
    if fp8.backward_extra and layers and lora_acts is None and plan.offload_activations == "none":
        acts = fwd_acts + embed + live_layer - per_layer
        head_grads = 0
        if layout.is_last and not grads_in_step:  # the LM head's and final norm's, before any layer's
            head_grads = (vocab_shard_params(model, plan.tp) + P.norm_params(model)) * policy.grad_bytes
        first = fp8_first_backward_layer(bwd_start, fp8, acts, x, head_grads, retained, unsharded.backward_end)
        # the last layer's backward at its down projection: that layer's gradients not made yet
        layer_grads = st.grads * layout.largest_layer_params // layout.params if layout.params else 0
        last = {**bwd_end, "gradients": max(end_grads - layer_grads, 0), "activations": end_acts + fp8.backward_extra}
        candidates += [first, last]
    every_layer = op_sac or recomputed == layers
    if checkpointed and plan.pp > 1 and not layout.is_last and rt.name == "memplan" and rt.pytorch_parallel:
        if _rebuilds_first_backward(model, x, plan, fsdp2, lora_acts is None, moe_fraction, every_layer):
            # the stage's first backward layer rebuilt beside every in-flight micro-batch's saves
            made, held = memo.first_backward(x, shape_key, op_sac, policy.grad_bytes)
            sent = warmup_output_held(plan, stage, accumulation) * pipeline_activation_bytes(x)
            candidates.append(
                {
                    **bwd_start,
                    "gradients": bwd_start["gradients"] or made,
                    "activations": bwd_start["activations"] + held,
                    "comm_buffers": bwd_start["comm_buffers"] + sent,
                }
            )
    if layout.is_first and grads_in_step and layers and plan.pp > 1 and plan.pp_schedule == "1f1b" and not fsdp2:
        if rt.name == "memplan" and not finetune and lora_acts is None and plan.offload_activations == "none":
            # a later backward's embedding backward beside the gradient an earlier one left (V h under
            # DTensor TP), with every other in-flight micro-batch's saves; this one's RoPE tables are gone
            key = (shape_key, layout_key, plan.pp_schedule, accumulation)
            if (found := memo.embeddings.get(key)) is None:  # the search's cost: a call only on a miss
                found = memo.embedding_backward(key, model, x, layout, plan, policy, rt, accumulation, mbs)
            made, held, outputs = found
            candidates.append(
                {
                    **bwd_end,
                    "gradients": grads_full + made,
                    "autocast_weights": other_micro_batches_casts(casts_each, mbs),
                    "activations": others + embed - terms.per_chunk + held,
                    "comm_buffers": bwd_end["comm_buffers"] + outputs,
                }
            )
    bwd, bwd_total = _largest(candidates)
    phases = {"forward": fwd, "backward": bwd, "optimizer": opt}
    totals = {"forward": sum(fwd.values()), "backward": bwd_total, "optimizer": sum(opt.values())}
    total_acts = layer_acts + embed - workspaces + head
    moments = {_FORWARD: fwd, _BACKWARD_START: bwd_start, _BACKWARD: bwd, _OPTIMIZER: opt}
    build_grads = st.grads if (rt.grads_persistent or ddp_buckets) else 0
    return StageMoments(phases, totals, moments, None, build_grads, st, per_layer, total_acts, offload_host)


class TrainingPeak(NamedTuple):
    """The most-loaded rank's allocated peak of a training step, without a report: what the
    search's fast form reads of each plan (``search.evaluate``), and what ``estimate_training``
    reports. ``reserved`` is the fast form (``overhead.fast_reserved_bytes``), not a replay."""

    allocated: int
    stage: int
    phase: str
    rank: int
    overhead: int  # fixed bytes outside the allocator
    gradient_accumulation: int
    moments: StageMoments  # the peak stage's phases
    totals: dict[str, int]  # the peak stage's allocated peak of each phase
    stage_peaks: dict[int, int]

    @property
    def reserved(self) -> int:
        return O.fast_reserved_bytes(self.allocated)


def training_peak(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    runtime: str = "memplan",
    device: Device = "cuda",
    memo: MemoryMemo | None = None,
) -> TrainingPeak:
    """Peak per-rank memory of a steady-state training step, over phases and pipeline stages,
    on ``device`` (which attention kernel runs: ``sdpa_kind``): the stage whose highest phase
    is the highest (the first of equals). ``memo``: what a search's plans share
    (:class:`MemoryMemo`, for this model, runtime and device)."""
    rt = RUNTIMES[runtime]
    accumulation = gradient_accumulation(workload, plan)
    if plan.offload_activations != "none":
        offload_mechanism(plan, rt)  # refuses, by field, what no loop runs
        if rt.name == "memplan" and (reason := TO.unmodelled_accumulation(plan, accumulation)) is not None:
            raise MemplanError(reason, field="plan.offload_activations")
    memo = MemoryMemo() if memo is None else memo  # the stages share the rank's shape
    best = None
    stage_peaks: dict[int, int] = {}
    shape = memo.shape(model, workload, plan, rt, device)
    if (stages := memo.stages.get(plan.pp)) is None:  # it reads the plan's pp alone
        stages = memo.stages[plan.pp] = _stages_to_examine(model, plan, rt)
    for stage in stages:
        sm = _stage_phases(model, workload, plan, rt, stage, accumulation, device, memo, shape)
        totals = sm.totals
        peak_phase, peak = _highest(totals)
        stage_peaks[stage] = peak
        if best is None or peak > best[0]:
            best = (peak, stage, peak_phase, sm, totals)
    assert best is not None
    allocated, stage, phase, sm, totals = best
    overhead = O.fixed_overhead_bytes(O.communicators(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep))
    rank = stage * plan.tp * plan.cp * plan.dp
    return TrainingPeak(allocated, stage, phase, rank, overhead, accumulation, sm, totals, stage_peaks)


def _highest(totals: dict[str, int]) -> tuple[str, int]:
    """The phase with the most bytes (the first of equals, in the step's order) and its bytes."""
    items = iter(totals.items())
    phase, peak = next(items)
    for name, total in items:
        if total > peak:
            phase, peak = name, total
    return phase, peak


def estimate_training(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str = "memplan", device: Device = "cuda"
) -> MemoryReport:
    """Peak per-rank memory of a steady-state training step (:func:`training_peak`) as a report."""
    peak = training_peak(model, workload, plan, runtime, device)
    sm, st = peak.moments, peak.moments.states
    breakdown = {k: v for k, v in sm.phases[peak.phase].items() if v}
    return MemoryReport.model_construct(
        model_states=ModelStates.model_construct(
            parameters=st.params, gradients=st.grads, optimizer_states=st.optimizer
        ),
        activations=Activations.model_construct(per_layer=sm.per_layer, total=sm.total_acts),
        kv_cache=0,
        peak=Peak.model_construct(
            allocated=peak.allocated,
            reserved=peak.reserved,
            phase=peak.phase,
            rank=peak.rank,
            stage=peak.stage,
            rank_role=stage_role(peak.stage, plan.pp),
            breakdown=breakdown,
        ),
        offload=Offload.model_construct(cpu=st.cpu, nvme=st.nvme),
        paged_optimizer_states=st.paged,
        phases=peak.totals,
        stage_peaks=peak.stage_peaks,
        overhead=peak.overhead,
        outside=O.outside_memory(O.communicators(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep)).detail(),
        gradient_accumulation=peak.gradient_accumulation,
    )


def activation_offload_bytes(model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str) -> tuple[str, int]:
    """(mechanism, bytes) of ``offload_activations: cpu``: the saved-tensor hooks the runtime's
    loop runs (:func:`offload_mechanism`) and the bytes one micro-batch copies to the host in
    its forward and back in its backward (the last stage's: the only one, without a pipeline)."""
    rt = RUNTIMES[runtime]
    mechanism = offload_mechanism(plan, rt)
    sm = _stage_phases(model, workload, plan, rt, plan.pp - 1, gradient_accumulation(workload, plan))
    return mechanism, sm.offload_host


def _stages_to_examine(model: ModelSpec, plan: Plan, rt: RuntimeProfile) -> list[int]:
    """The first stage holds the most activations and the embedding, the last the head and
    logits; middle stages hold less of both and the same layers, unless an MoE model mixes
    dense and MoE layers unevenly, when every stage is examined. Under torch.distributed.pipelining
    a middle stage also keeps the buffers of both directions, 3m activations where the first
    keeps m and the last 2m (``pipeline_buffers``; torch/distributed/pipelining/stage.py): with
    many micro-batches the second stage, the middle one with the most in flight, can hold the
    most, so it is examined too (measured on the bundled trainer, docs/cost-model.md)."""
    uneven = model.moe is not None and (model.moe.dense_layers or model.moe.layer_freq > 1)
    if uneven:
        return list(range(plan.pp))
    middle = {1} if rt.pytorch_parallel and plan.pp > 2 else set()
    return sorted({0, plan.pp - 1} | middle)


def kv_cache_bytes(model: ModelSpec, workload: InferenceWorkload, tp: int, indices: Sequence[int]) -> int:
    """The KV cache at its largest: per layer, tokens x the layer's cache width x kv bytes x batch.

    Width (``ModelSpec.kv_cache_width``): K and V, 2 x kv_heads/tp x head_dim (KV heads split by TP,
    replicated when fewer than tp); MLA (DeepSeek) caches its compressed latent and the RoPE key,
    kv_lora_rank + qk_rope_head_dim, whole on every TP rank (transformers 5.23
    ``DeepseekV3Attention`` updates the cache with ``kv_nope`` and ``k_rot``; vLLM's MLA cache is the
    same latent). Tokens: the context for full attention; a sliding-window or chunked layer
    (transformers' ``DynamicSlidingWindowLayer``) keeps the last ``window - 1`` tokens as a view of
    the states it was given, so after the prefill it holds the prompt's storage and, once decoding
    has concatenated a token, ``min(context, window)``; the cache is at its largest after the prefill
    or at the end, whichever holds more; after a chunked prefill a windowed layer holds the storage
    of its last concatenation, ``window - 1 + chunk`` tokens (``inference.layer_keys``). With a
    paged cache (vLLM, Kwon et al. 2023) each sequence's tokens are rounded up to whole blocks.
    ``indices``: the layers on this rank."""
    if model.mla is not None:
        width = model.kv_cache_width
    else:
        width = 2 * max(model.kv_heads // tp, 1) * model.head_size

    def blocks(tokens: int) -> int:
        size = workload.block_size
        return -(-tokens // size) * size if size else tokens

    context, prompt = workload.context, workload.prompt_tokens
    x = I.prefill_forward(workload)
    end = prefill = 0
    for i in indices:
        window = model.attention_window(i)
        decoded = context > prompt
        stored = I.layer_keys(model, x, i)[0]  # after the prefill (a chunked one's windowed layer keeps less)
        end += blocks(context if window is None else min(context, window) if decoded else stored)
        prefill += blocks(stored)
    return max(end, prefill) * width * workload.batch * KV_BYTES[workload.kv_dtype]


def estimate_inference(model: ModelSpec, workload: InferenceWorkload, plan: Plan) -> MemoryReport:
    """Serving memory: weights in the compute dtype, the KV cache for the whole context, and the
    prefill forward's working set at its highest moment (``inference.prefill_peak``: one layer's
    tensors and the forward-wide ones for the prompts, or for one chunk with ``prefill_chunk``;
    the last stage's last-token logits)."""
    if plan.offload_activations != "none":
        raise MemplanError(
            "activation offload moves what a training step saves for its backward; serving saves nothing: "
            "use offload_activations: none",
            field="plan.offload_activations",
        )
    policy = POLICIES[plan.precision]
    best = None
    stage_peaks: dict[int, int] = {}
    for stage in sorted({0, plan.pp - 1}):
        layout = stage_layout(model, plan.tp, plan.ep, plan.pp, plan.virtual_stages, stage)
        weights = layout.params * (1 if policy.fp8_matmuls else policy.compute_bytes)
        indices = tuple(stage_layer_indices(model.num_layers, plan.pp, plan.virtual_stages, stage))
        kv = kv_cache_bytes(model, workload, plan.tp, indices)
        prefill = I.prefill_peak(
            model, workload, policy.compute_bytes, plan.tp, KV_BYTES[workload.kv_dtype], indices, layout.is_last
        )
        work = prefill.bytes
        allocated = weights + kv + work
        stage_peaks[stage] = allocated
        if best is None or allocated > best[0]:
            best = (allocated, stage, weights, kv, work, prefill)
    assert best is not None
    allocated, stage, weights, kv, work, prefill = best
    x = prefill.forward
    overhead = O.fixed_overhead_bytes(O.communicators(1, plan.tp, plan.pp, 1, plan.ep))
    return MemoryReport.model_construct(
        model_states=ModelStates.model_construct(parameters=weights, gradients=0, optimizer_states=0),
        activations=Activations.model_construct(per_layer=work, total=work),
        kv_cache=kv,
        peak=Peak.model_construct(
            allocated=allocated,
            reserved=O.fast_reserved_bytes(allocated),
            phase="prefill",
            rank=stage * plan.tp,
            stage=stage,
            rank_role=stage_role(stage, plan.pp),
            breakdown={k: v for k, v in {"parameters": weights, "kv_cache": kv, "activations": work}.items() if v},
        ),
        offload=Offload.model_construct(cpu=0, nvme=0),
        phases={"prefill": allocated},
        stage_peaks=stage_peaks,
        overhead=overhead,
        outside=O.outside_memory(O.communicators(1, plan.tp, plan.pp, 1, plan.ep)).detail(),
        gradient_accumulation=1,
        prefill=PrefillReport.model_construct(
            tokens=x.tokens,
            rows=x.rows,
            queries=x.queries,
            keys=x.keys,
            moment=prefill.moment,
        ),
    )


def estimate_memory(
    model: ModelSpec,
    workload: TrainingWorkload | InferenceWorkload,
    plan: Plan,
    runtime: str = "memplan",
    device: Device = "cuda",
) -> MemoryReport:
    """Per-rank memory of one configuration on ``device``: training step or inference batch."""
    if isinstance(workload, InferenceWorkload):
        return estimate_inference(model, workload, plan)
    return estimate_training(model, workload, plan, runtime, device)


def serving_run(model: ModelSpec, workload: InferenceWorkload, plan: Plan) -> Timeline:
    """The most-loaded stage's serving run (``timeline.step.build_serving_run``) with the
    tensors ``estimate_inference`` sums: each weight in the compute dtype (split by t), a key
    and a value cache tensor per layer, and the prefill's working set cut into hidden-, q-,
    kv- and ffn-wide tensors of the prompt."""
    report = estimate_inference(model, workload, plan)
    stage = report.peak.stage
    layout = stage_layout(model, plan.tp, plan.ep, plan.pp, plan.virtual_stages, stage)
    policy = POLICIES[plan.precision]
    element = 1 if policy.fp8_matmuls else policy.compute_bytes
    widths = [i * o // plan.tp for i, o in A.layer_matmul_widths(model)]
    layer = [P.norm_params(model), *widths[:4], P.norm_params(model), *widths[4:]]
    weights = pieces(report.model_states.parameters, [n * element for n in layer if n])
    kv = report.kv_cache // max(2 * layout.layers, 1)
    kv_tensors = [kv] * (2 * layout.layers) if kv else []
    tokens, d, t = I.prefill_forward(workload).tokens, policy.compute_bytes, plan.tp
    ffn = model.moe.expert_ffn_size if model.moe else model.ffn_size
    wide = [model.hidden_size, model.hidden_size, model.q_size // t, model.kv_size // t, model.kv_size // t]
    wide += [model.q_size // t, ffn // t, ffn // t, ffn // t]
    work = pieces(report.activations.total, [tokens * d * w for w in wide if w])
    return build_serving_run(weights, kv_tensors, work, layout.layers)


def stage_moments(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    runtime: str = "memplan",
    device: Device = "cuda",
) -> StageMoments:
    """The step of the most-loaded pipeline stage as moments."""
    rt = RUNTIMES[runtime]
    accumulation = gradient_accumulation(workload, plan)
    stage = estimate_training(model, workload, plan, runtime, device).peak.stage
    sm = _stage_phases(model, workload, plan, rt, stage, accumulation, device)
    policy = POLICIES[plan.precision]
    layout = stage_layout(model, plan.tp, plan.ep, plan.pp, plan.virtual_stages, stage)
    x = _shape(model, workload, plan, policy, rt, device)
    fp8_gather = plan.precision == "fp8" and plan.fp8_all_gather
    return sm._replace(granularity=_granularity(model, layout, plan, policy, x, _fsdp2(rt, plan), fp8_gather))
