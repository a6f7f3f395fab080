"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE, Qwen2-MoE) in the op-level run of ``transformers.Trainer``.

The layer is Llama's (Mixtral: ``modeling_mixtral.py``), Qwen3's (``modeling_qwen3_moe.py``) or Qwen2's
(``modeling_qwen2_moe.py``: q/k/v biases) with the MLP replaced by the sparse block, read from
transformers 5.23 (Qwen2-MoE's router, l.310-328, is Qwen3's line for line):

- the router (``MixtralTopKRouter.forward``, l.103-110; ``Qwen3MoeTopKRouter.forward``, l.257-266):
  ``F.linear(x, gate.weight)`` (an ``mm``: T x E logits, the block's local ``_`` until it returns), fp32
  probabilities (Mixtral ``softmax(logits.float())``, Qwen3 ``softmax(logits, dtype=float)``: a 16-bit
  model's fp32 copy, freed once softmax has saved its output), ``topk`` (fp32 values, int64 indices
  saved by its backward), the in-place renormalisation ``values /= values.sum(-1, keepdim=True)``
  (Mixtral always, Qwen3 with ``norm_topk_prob``: the sum and a clone of the values saved by
  ``DivBackward0``), and for Qwen3 the cast back to the logits' dtype; Mixtral keeps the scores fp32;
- the experts: 3-D parameters ``gate_up_proj`` (E, 2f, h) and ``down_proj`` (E, h, f) (l.56-66) run by
  ``config._experts_implementation``, which ``PreTrainedModel.get_correct_experts_implementation``
  (modeling_utils.py l.1883) sets to ``grouped_mm`` for every model whose experts class carries
  ``@use_experts_implementation``; ``integrations/moe.py: _can_use_grouped_mm`` (l.302-352) then takes
  ``torch.nn.functional.grouped_mm`` on CPU for torch > 2.10 and on CUDA at compute capability 8.0 or
  more. So the loop over experts with ``index_add_`` (the ``eager`` forward) does not run;
  ``grouped_mm_experts_forward`` (l.424-535) does: ``sort`` of the S = T x top_k expert ids, the rows
  ``x[perm // top_k]`` (S x h, IndexBackward0 saves the index), the scores ``w[perm]``, the offsets
  (``histc`` over the ids as fp32 on CPU, int32 on CUDA; ``cumsum`` int32, saved by both products),
  ``grouped_mm`` up (S x 2f), ``silu(gate) * up`` over its ``chunk(2)``, ``grouped_mm`` down (S x h),
  ``* scores`` (fp32 under Mixtral's fp32 scores: type promotion), the inverse permutation
  (``empty_like`` + ``arange``), the rows put back (``[inv_perm]``, S x h), ``view(T, k, h).sum(1)`` and
  ``.to(x.dtype)``.

Every tensor of the grouped path is sized by S = T x top_k, whatever the routing: the tokens each expert
receives move rows between the groups of one product, not bytes. So the estimate needs no assumption on
the routing (the eager loop's per-expert temporaries would depend on it; it is not the path transformers
takes). Backward formulas (observed on CPU with ``tests/accuracy/alloc_log.py``, read from
``derivatives.yaml``): ``_grouped_mm``'s weight gradient (E x n x k, stolen into ``.grad``) before its
input's; IndexBackward0 a ``new_zeros`` and ``index_put_`` into it, TopkBackward0 ``new_zeros`` and
``scatter_`` (``FunctionsManual.cpp``: ``index_backward``, ``value_selecting_reduction_backward``; out of
place into a second buffer when ``isTensorSubclassLike``, which any dispatch mode makes true: the CPU
tracker's, ``Tape.subclass_like``); the sum's backward an expanded view whose reshape to S x h is a copy.

Not modelled on CUDA (transient inside one op, of order S x 8 B): the CUTLASS workspace, ``sort``'s
scratch over more than 4096 ids (``SortStable.cu``: an int64 iota, cub's radix-sort storage), the sort of
``index_put_(accumulate=True)`` in the gathers' backward, ``cumsum``'s scan storage. Not modelled: the
load-balancing loss (``output_router_logits``: off in both configs' defaults and the
published Mixtral-8x7B / Qwen3-30B-A3B / Qwen1.5-MoE-A2.7B configs), router jitter (``router_jitter_noise`` 0).

Qwen2-MoE's shared expert (``Qwen2MoeSparseMoeBlock.forward``, l.339-350): ``Qwen2MoeMLP`` of
``shared_expert_intermediate_size`` first, then the router and the experts, then ``F.sigmoid(
shared_expert_gate(x)) * shared_expert_output`` and the sum with the experts' output. The Qwen families'
dense layers (``mlp_only_layers``, ``decoder_sparse_step``; Qwen2-MoE l.357-362, Qwen3-MoE l.308-313) run
the dense family's MLP of ``intermediate_size`` with its parameters (``layer_params``).

Under PEFT, the experts and the router PEFT wraps in ``lora.ParamWrapper`` (``all-linear`` on Mixtral and
Qwen3-MoE, Qwen3-MoE's MLP names) read parametrized weights (``hf_moe_lora.py``: ``activate_wrappers``,
``expert_weight``, ``wrap_router``); Qwen2-MoE's shared expert and dense MLP take ``lora.Linear`` adapters
through ``linear`` as a dense layer's do.
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.hf_families import QWEN3_PARAMS, HfQwen3, chunk2
from memplan.costmodel.timeline.hf_masks import sdpa_mask
from memplan.costmodel.timeline.hf_model import LAYER_PARAMS, HfLlama
from memplan.costmodel.timeline.hf_moe_lora import check, factors, parametrized, plus_delta, router_delta
from memplan.costmodel.timeline.hf_moe_ops import (
    INDEX,
    cutlass_args_bytes,
    grouped_mm,
    index_rows,
    renormalise,
    reshape_copy,
    row_sum,
    softmax,
    sort,
    topk,
)
from memplan.costmodel.timeline.hf_sliding import SlidingWindow

OFFSET = 4  # histc's fp32 (CPU) or int32 (CUDA) counts, cumsum's int32 offsets

# the sparse block's parameters in registration order (param_shapes appends ``.weight`` to each name)
MIXTRAL_PARAMS = (
    *LAYER_PARAMS[:4],
    ("mlp.gate", "E", "h"),
    ("mlp.experts.gate_up_proj", "E2fe", "h"),
    ("mlp.experts.down_proj", "Eh", "fe"),
    *LAYER_PARAMS[7:],
)
QWEN2_MOE_PARAMS = (  # Qwen2MoeSparseMoeBlock.__init__ (l.331-337): gate, experts, shared_expert, its gate
    *LAYER_PARAMS[:4],
    ("mlp.gate", "E", "h"),
    ("mlp.experts.gate_up_proj", "E2fe", "h"),
    ("mlp.experts.down_proj", "Eh", "fe"),
    ("mlp.shared_expert.gate_proj", "fs", "h"),
    ("mlp.shared_expert.up_proj", "fs", "h"),
    ("mlp.shared_expert.down_proj", "h", "fs"),
    ("mlp.shared_expert_gate", "1", "h"),
    *LAYER_PARAMS[7:],
)
QWEN3_MOE_PARAMS = (
    *QWEN3_PARAMS[:6],
    ("mlp.experts.gate_up_proj", "E2fe", "h"),
    ("mlp.experts.down_proj", "Eh", "fe"),
    ("mlp.gate", "E", "h"),
    *QWEN3_PARAMS[9:],
)


def moe_sizes(extra: dict | None, h: int) -> dict[str, int]:
    """The experts' dimensions for ``hf_model.param_shapes`` (none for a dense family)."""
    if not extra or "experts" not in extra:
        return {}
    e, fe = extra["experts"], extra["expert_ffn"]
    mla = extra.get("mla_sizes", {})  # DeepSeek-V3's attention widths (hf_mla.mla_config)
    return {"E": e, "E2fe": e * 2 * fe, "Eh": e * h, "fe": fe, "fs": extra.get("shared_ffn", 0), **mla}


class MoeBlock:
    """The sparse block of a MoE family (a mixin before the dense family's class): ``extra`` holds
    ``experts``, ``top_k``, ``expert_ffn``, ``norm_topk``, ``fp32_scores`` (Mixtral's), ``shared_ffn``
    (Qwen2-MoE's gated shared expert; 0: none) and ``dense`` (the layers with the dense MLP)."""

    def mlp(self: HfLlama, x: Tensor, prefix: str) -> Tensor:
        """Layer i's MLP: the dense family's where ``mlp_only_layers`` / ``decoder_sparse_step`` leave it
        dense (``Qwen2MoeDecoderLayer.__init__``, modeling_qwen2_moe.py l.357-362; Qwen3-MoE's l.308-313),
        else ``SparseMoeBlock.forward``."""
        if int(prefix.rsplit(".", 1)[1]) in self.extra.get("dense", ()):
            return super().mlp(x, prefix)  # type: ignore[misc]
        return self.sparse(x, f"{prefix}.mlp")

    def sparse(self: HfLlama, x: Tensor, name: str) -> Tensor:
        """``SparseMoeBlock.forward``: the router, then the experts (module docstring); with a shared
        expert (Qwen2-MoE, l.339-350) that MLP first, and after the experts its sigmoid gate."""
        t, cfg = self.tape, self.extra
        with t.scoped(name):
            shared = self.gated_mlp(x, f"{name}.shared_expert", cfg["shared_ffn"]) if cfg.get("shared_ffn") else None
            delta, weight = self.wrap_router(f"{name}.gate")
            logits = self.linear(x, f"{name}.gate", cfg["experts"], "router")
            scores, ids = self.route(logits)
            if delta is not None:  # the router's ParamWrapper returns: parametrize's cache, then the proxy
                t.done(self.weights.pop(f"{name}.gate.weight"), delta)
                self.weights[f"{name}.gate.weight"] = weight
            out = self.experts(x, scores, ids, f"{name}.experts")
            if shared is not None:
                out, shared = self.gate_shared(x, out, shared, name)
            # the block's locals: ``shared_expert_output``, ``_``, the scores, the ids
            t.done(*([shared] if shared is not None else []), logits, scores, ids)
        return out

    def gate_shared(self: HfLlama, x: Tensor, out: Tensor, shared: Tensor, name: str) -> tuple[Tensor, Tensor]:
        """``F.sigmoid(self.shared_expert_gate(x)) * shared_expert_output`` (a T x 1 linear, the sigmoid
        saving its output, the product saving both: the gate's gradient summed down from T x h), then
        ``expert_output + shared_expert_output`` (l.346-348); the sum and the gated shared output."""
        t = self.tape
        logit = self.linear(x, f"{name}.shared_expert_gate", 1, "shared_expert_gate")
        gate = ops.output_saved(t, logit, "sigmoid", "sigmoid_backward")
        t.done(logit)
        gated = ops.mul(t, gate, shared, "shared_gated")
        t.done(gate, shared)  # the temporary, then the rebound ``shared_expert_output``
        total = ops.add(t, out, gated, "shared_add")
        t.done(out)  # the rebound ``expert_output``
        return total, gated

    def route(self: HfLlama, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The router after its logits: fp32 probabilities, top-k, the renormalisation, Qwen3's cast."""
        t, d, cfg = self.tape, self.d, self.extra
        x32 = ops.to(t, logits, 4, "logits_fp32")
        probs = softmax(t, x32, "softmax")
        t.done(x32)
        values, ids = topk(t, probs, d.tokens, cfg["top_k"])
        t.done(probs)
        if cfg["norm_topk"]:
            values = renormalise(t, values, d.tokens)
        if cfg["fp32_scores"]:
            return values, ids
        scores = ops.to(t, values, logits.itemsize, "scores_cast")
        t.done(values)
        return scores, ids

    def experts(self: HfLlama, x: Tensor, scores: Tensor, ids: Tensor, name: str) -> Tensor:
        """``grouped_mm_experts_forward`` (integrations/moe.py l.424-535)."""
        t, d, cfg = self.tape, self.d, self.extra
        s, h, fe = d.tokens * cfg["top_k"], d.h, cfg["expert_ffn"]
        wrapped = self.activate_wrappers(name)
        ids_sorted, perm = sort(t, s)
        rows = t.new(s, INDEX, "perm_div_top_k")
        selected = index_rows(t, x, rows, s * h, "selected_hidden_states")
        t.done(rows)
        weights = index_rows(t, scores, perm, s, "sample_weights")
        counts_in = t.new(s, OFFSET, "histc_input")
        counts = t.new(cfg["experts"], OFFSET, "tokens_per_expert")
        offs = t.new(cfg["experts"], OFFSET, "offsets")
        gate_up = self.expert_weight(f"{name}.gate_up_proj", wrapped)
        # CUDA's CUTLASS path: bf16 operands on compute capability 9.x / 10.x (``_grouped_mm_cuda``:
        # ``scaled_mm_arch_allowed(sm90_only, sm100_only) && a_b_and_out_are_bf16``)
        args = cutlass_args_bytes(cfg["experts"]) if not self.cpu and cfg.get("sm90") and gate_up.itemsize == 2 else 0
        up = grouped_mm(t, selected, gate_up, offs, s * 2 * fe, "gate_up_proj", args)
        gate_half, up_half = chunk2(t, up, "chunk")
        act = ops.unary(t, gate_half, "silu", save_input=True)
        gated = ops.mul(t, act, up_half, "gated")
        t.done(act, up_half, gate_half, up)  # ``_apply_gate``'s locals, then the rebound proj_out
        down_w = self.expert_weight(f"{name}.down_proj", wrapped)
        down = grouped_mm(t, gated, down_w, offs, s * h, "down_proj", args)
        t.done(gated)
        weighted = ops.mul(t, down, weights, "weighted")
        inv_perm = t.new(s, INDEX, "inv_perm")
        t.done(t.new(s, INDEX, "arange"))
        back = index_rows(t, weighted, inv_perm, s * h, "restore_order")
        t.done(weighted)
        per_token = reshape_copy(t, back, "view")
        summed = row_sum(t, per_token, d.tokens * h, "sum_top_k")
        t.done(per_token)
        out = ops.to(t, summed, x.itemsize, "out")
        # the frame's locals at return, in the order the function names them
        t.done(ids_sorted, perm, selected, weights, counts_in, counts, offs, down, back, inv_perm, summed)
        # the innermost wrapper's parametrization removed first, then parametrize's cache, then the outer ones'
        *outer, inner = wrapped.values() or [()]
        t.done(*inner)
        t.done(*(w for w in (gate_up, down_w) if not w.st.managed))
        t.done(*(f for pair in outer for f in pair))
        return out

    def wrap_router(self: HfLlama, name: str) -> tuple[Tensor | None, Tensor]:
        """PEFT's ``ParamWrapper`` over the router's weight (``all-linear`` on Mixtral, Qwen3-MoE;
        ``hf_moe_lora.router_delta``): the delta, and the parametrized weight ``W + delta`` the router's
        ``F.linear`` reads, put in the weight's place until the router returns; (None, W) unwrapped."""
        lora, w = getattr(self.adapter, "__self__", None), self.weights[f"{name}.weight"]
        if lora is None or not lora.cfg.router:
            return None, w
        delta = router_delta(self.tape, self.weights, name, self.weight, self.cpu)
        self.weights[f"{name}.weight"] = plus_delta(self.tape, w, delta, f"{name}.parametrized")
        return delta, w

    def activate_wrappers(self: HfLlama, name: str) -> dict[str, tuple[Tensor, Tensor]]:
        """PEFT's ``ParamWrapper._activate_lora`` of each wrapped expert parameter, outermost first
        (``hf_moe_lora.py``): its factors, then the parametrization's check; the factors by parameter."""
        lora = getattr(self.adapter, "__self__", None)  # the HfLora whose ``adapt`` the model calls
        out = {}
        for param, _ in lora.cfg.experts if lora is not None else ():
            key = f"{name}.{param}"
            out[key] = factors(self.tape, self.weights, key)
            check(self.tape, self.weights[f"{key}.weight"], key, out[key])
        return out

    def expert_weight(self: HfLlama, key: str, wrapped: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        """The experts' weight ``key`` as their forward reads it: the parameter, or its parametrized
        value (``hf_moe_lora.parametrized``) where PEFT wraps it."""
        w = self.weights[f"{key}.weight"]
        if key not in wrapped:
            return w
        return parametrized(self.tape, w, *wrapped[key], f"{key}.baddbmm")


class HfMixtral(SlidingWindow, MoeBlock, HfLlama):
    """``MixtralForCausalLM``: Mistral's layer with the sparse block, under its window's mask where the config sets
    one and the sequence reaches it (``hf_sliding.py``, as Mistral's: ``MixtralModel.forward`` builds one mask with
    ``create_sliding_window_causal_mask``, modeling_mixtral.py:443)."""


class HfQwen3Moe(MoeBlock, HfQwen3):
    """``Qwen3MoeForCausalLM``: Qwen3's layer with the sparse block."""


class HfQwen2Moe(MoeBlock, HfLlama):
    """``Qwen2MoeForCausalLM``: Qwen2's layer (q/k/v biases) with the sparse block and its shared expert.

    ``Qwen2MoeModel.forward`` (l.475-488) builds both masks whatever the layers are: ``create_causal_mask``
    (skipped for SDPA: ``is_causal``) and ``create_sliding_window_causal_mask``, whose window is 0 without
    ``use_sliding_window`` (``Qwen2MoeConfig.__post_init__``, configuration_qwen2_moe.py:113), which every
    sequence reaches, so ``sdpa_mask`` builds the (s, s) bool grid (``hf_masks.sdpa_mask``). No layer reads it
    (all are ``full_attention``: each gets None); ``causal_mask_mapping`` holds it to the model's return."""

    def positions(self) -> Tensor:
        """``position_ids``, then the two masks: two packed-sequence checks, the sliding one built."""
        pos = super().positions()
        self.packed_check()
        with self.tape.scoped("model.masks"):
            self.sliding_mask = sdpa_mask(self.tape, self.d, sliding=True)
        return pos

    def head(self, x: Tensor) -> Tensor:
        """The unused mask goes with the model's forward (beside ``position_ids``), then the head."""
        self.tape.done(self.sliding_mask)
        return super().head(x)


def moe_config(model, gpu_arch=None) -> dict:
    """What the sparse block reads from the spec (``MoeBlock``); ``sm90``: on CUDA, whether the GPU
    (``gpu_arch``, a ``CudaArch``) runs the bf16 grouped GEMM's CUTLASS path (compute capability
    9.x or 10.x; an unknown GPU is taken as the H100 / H200 class)."""
    moe = model.moe
    return {
        "experts": moe.num_experts,
        "top_k": moe.top_k,
        "expert_ffn": moe.expert_ffn_size,
        "norm_topk": moe.norm_topk_prob,
        "fp32_scores": model.architecture == "mixtral",
        "sm90": gpu_arch is None or gpu_arch.major in (9, 10),
        "shared_ffn": moe.shared_ffn_size if moe.num_shared_experts else 0,
        "dense": tuple(i for i in range(model.num_layers) if not model.is_moe_layer(i)),
        # Mixtral's window (hf_sliding.SlidingWindow reads it): every layer sliding, as Mistral's
        **({"kinds": model.layer_attention_kinds, "window": model.sliding_window} if model.sliding_window else {}),
    }


MOE_FAMILIES: dict[str, tuple[type[HfLlama], tuple]] = {
    "mixtral": (HfMixtral, MIXTRAL_PARAMS),
    "qwen3-moe": (HfQwen3Moe, QWEN3_MOE_PARAMS),
    "qwen2-moe": (HfQwen2Moe, QWEN2_MOE_PARAMS),
}
DENSE_PARAMS = {"qwen3-moe": QWEN3_PARAMS, "qwen2-moe": LAYER_PARAMS}  # a dense layer's: Qwen{2,3}MoeMLP


def layer_params(arch: str, sparse: tuple, extra: dict | None) -> tuple | Callable[[int], tuple]:
    """The layers' parameters for ``hf_model.param_shapes``: ``sparse`` on every layer, or layer i's
    where some keep the dense MLP (``extra["dense"]``, ``moe_config``)."""
    if arch in ("deepseek-v2", "deepseek-v3"):  # MLA's layer, dense or sparse (hf_mla.py)
        from memplan.costmodel.timeline.hf_mla import layer_params as mla_layer_params

        return lambda i: mla_layer_params(extra, i not in extra["dense"])
    dense = (extra or {}).get("dense")
    if not dense:
        return sparse
    return lambda i: DENSE_PARAMS[arch] if i in dense else sparse
