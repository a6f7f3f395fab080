"""transformers 5.x's ``LlamaForCausalLM`` as ops on a byte-level tape.

Each method mirrors ``transformers/models/llama/modeling_llama.py`` (and the loss of
``loss/loss_utils.py: ForCausalLMLoss``) line by line, including when Python drops a reference:
a temporary goes when its statement ends, a rebound local at the store, the other locals when
the frame exits (CPython clears them in the order the function first names them). The graph's
backward formulas are those of ``ops.py``; what differs from the bundled trainer's model
(``trainer_model.py``) is written here:

- ``LlamaRMSNorm`` keeps ``variance`` as a local until it returns and frees the fp32 product
  after the weight multiply (the bundled trainer frees ``mean + eps`` first);
- the rotary tables are computed once per forward in fp32 on ``(1, s, head_dim)`` and cast to
  the hidden states' dtype; a bf16 model's ``inv_freq`` buffer is bf16 and is upcast first;
- ``LlamaModel.forward`` keeps ``inputs_embeds`` and ``position_ids`` until it returns, and
  computes ``cache_position`` and the packed-sequence check of ``masking_utils`` (int64 and bool
  temporaries over b x s);
- SDPA is called with ``is_causal=True`` and no mask, so ``enable_gqa=True`` for grouped heads
  (``integrations/sdpa_attention.py: use_gqa_in_sdpa``). On CPU that is
  ``_scaled_dot_product_flash_attention_for_cpu`` (output and fp32 log-sum-exp; its backward
  allocates dq, dk, dv); on CUDA the kernel ``attention.sdpa_backend`` picks (flash: ``ops.sdpa``;
  math: ``precision.math_sdpa``; fp32 without GQA the memory-efficient kernel, ``mem_efficient.sdpa``:
  transformers passes no ``enable_gqa`` when ``num_key_value_groups`` is 1), not yet checked on a GPU
  against transformers;
- the loss is ``logits.float()``, labels padded by one (int64), ``labels[..., 1:].contiguous()``
  (a copy when b > 1, else the view itself, s labels at offset 1: TRL's offload clones it, ``hf_offload``; saved by
  ``nll_loss``), ``cross_entropy(reduction="sum") / num_items``.

On CPU the embedding's backward allocates the weight's gradient alone
(``embedding_dense_backward_cpu``); on CUDA it is ``ops.embedding`` (sort buffers, traces).
Measured on CPU by ``tests/accuracy/alloc_log.py`` (the sequence of storages, per op).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from memplan.costmodel.timeline import mem_efficient, ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import FIRST, Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.trainer_model import Dims

LAYER_PARAMS = (
    ("self_attn.q_proj", "q", "h"),
    ("self_attn.k_proj", "kv", "h"),
    ("self_attn.v_proj", "kv", "h"),
    ("self_attn.o_proj", "h", "q"),
    ("mlp.gate_proj", "f", "h"),
    ("mlp.up_proj", "f", "h"),
    ("mlp.down_proj", "h", "f"),
    ("input_layernorm", "h", "1"),
    ("post_attention_layernorm", "h", "1"),
)


QKV_BIAS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # Qwen2's attention biases


def param_shapes(
    d: Dims,
    tied: bool,
    qkv_bias: bool = False,
    layer_params: tuple | Callable[[int], tuple] = LAYER_PARAMS,
    sizes: dict | None = None,
) -> dict[str, tuple[int, int]]:
    """``model.parameters()`` in order (a tied ``lm_head`` is the embedding, left out); with
    ``qkv_bias`` (Qwen2) each of q, k, v has its bias after its weight; ``layer_params``: a
    family's layer (``hf_families.py``), or layer i's (a MoE model's dense layers: ``hf_moe.layer_params``),
    whose further dimensions ``sizes`` gives."""
    size = {"h": d.h, "q": d.q, "kv": d.kv, "f": d.f, "1": 1, "hd": d.head_dim, "qkv": d.q + 2 * d.kv, "2f": 2 * d.f}
    size.update(sizes or {})  # a MoE family's experts (hf_moe.moe_sizes)
    out = {"model.embed_tokens.weight": (d.vocab, d.h)}
    for i in range(d.layers):
        for name, rows, cols in layer_params(i) if callable(layer_params) else layer_params:
            out[f"model.layers.{i}.{name}.weight"] = (size[rows], size[cols])
            if qkv_bias and name in QKV_BIAS:
                out[f"model.layers.{i}.{name}.bias"] = (size[rows], 1)
    out["model.norm.weight"] = (d.h, 1)
    if not tied:
        out["lm_head.weight"] = (d.vocab, d.h)
    return out


NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def is_norm(name: str) -> bool:
    """The Trainer's no-decay group: ``get_decay_parameter_names`` leaves out the parameters whose
    lower-cased name matches its ``forbidden_name_patterns`` (norm weights, q/k norms, biases)."""
    return NO_DECAY.search(name.lower()) is not None


def cpu_flash_sdpa(
    tape: Tape,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse_numel: int,
    tag: str,
    mask: Tensor | None = None,
    lse_strided: bool = True,
) -> Tensor:
    """``_scaled_dot_product_flash_attention_for_cpu`` (GQA native): the output, then the fp32
    log-sum-exp (b x heads x s). Saves k, q, v, lse and out (released in that order, CPU log), and
    ``attn_mask`` first where one is given (a sliding window: hf_sliding.py). Backward: dq, dk, dv (its
    scratch is not a tensor). Layouts (``_scaled_dot_product_flash_attention_cpu``, aten/src/ATen/native/
    transformers/attention.cpp; its meta, ``meta__scaled_dot_product_flash_attention_for_cpu`` in
    torch/_meta_registrations.py, torch 2.13): the output is ``empty_like(query)``, q's strides (token-major after
    RoPE of a heads view: not contiguous); the log-sum-exp is ``empty({b, s, heads}).transpose(1, 2)``, not
    contiguous unless one head or one position (``lse_strided``). TRL's offload clones both (hf_offload.py)."""
    qn, kn, vn = q.numel, k.numel, v.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(n, q.itemsize, name) for n, name in ((qn, "dq"), (kn, "dk"), (vn, "dv"))]

    node = tape.node(tag, apply, [q, k, v])
    if node is not None:
        for t in (mask, k, q, v) if mask is not None else (k, q, v):
            tape.save(node, t)
    out = ops.result(tape, qn, q.itemsize, f"{tag}.out", node)
    out.transposed = q.transposed  # empty_like(query)
    lse = tape.new(lse_numel, 4, f"{tag}.lse")
    lse.transposed = lse_strided  # empty({b, s, heads}).transpose(1, 2)
    try:
        if node is not None:
            for t in (lse, out):
                tape.save(node, t)
    finally:
        tape.done(lse)
    return out


def addmm_linear(tape: Tape, x: Tensor, w: Tensor, bias: Tensor, out_numel: int, tag: str) -> Tensor:
    """``F.linear(x, w, bias)`` (``addmm`` on the flattened input): saves x for dW and w for dX, each
    only when that gradient is needed (a frozen weight keeps no input, as ``ops.linear``). Backward
    (AddmmBackward0): the bias's gradient is the incoming one, summed to the bias by the engine
    (``validate_outputs``); dX, then dW (the reverse of ``mm``'s order; CPU log, Qwen2)."""
    x_numel, w_numel = x.numel, w.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        itemsize = g[0].itemsize
        gb = tape.hold(g[0]) if node.nexts[2] is not None else None
        dx = tape.new(x_numel, itemsize, "dX") if node.nexts[0] is not None else None
        dw = tape.new(w_numel, itemsize, "dW", ops.grad_category(w)) if node.nexts[1] is not None else None
        if dw is not None:
            dw.view = True  # grad.t() of the transposed product
            if tape.on_first_mm is not None:
                tape.on_first_mm()
        return [dx, dw, gb]

    meta = [None, None, (bias.numel, bias.itemsize, True)]
    saved = ([x] if w.fn is not None else []) + ([w] if x.fn is not None else [])
    node = tape.node(tag, apply, [x, w, bias], saved=saved, meta=meta)
    out = ops.result(tape, out_numel, x.itemsize, tag, node)
    if tape.on_first_mm is not None:
        tape.on_first_mm()
    return out


def cpu_embedding(tape: Tape, ids: Tensor, w: Tensor, numel: int, tag: str) -> Tensor:
    """``F.embedding`` on CPU: saves the ids; backward allocates the weight's gradient alone."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(w.numel, w.itemsize, "grad_weight", ops.grad_category(w))]

    return ops.result(tape, numel, w.itemsize, tag, tape.node(tag, apply, [w], saved=[ids]))


def nll_loss(tape: Tape, ls: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``nll_loss(reduction="sum")``: the loss and total_weight scalars; saves its input (log_softmax's
    result, which that node holds too), the target and total_weight (NllLossBackward0, released in that
    order; what ``save_on_cpu`` copies, act_offload.py). Backward: a zeroed (b s, V) fp32 gradient."""
    numel = ls.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, 4, "grad", Category.LOGITS)]

    node = tape.node("nll_loss", apply, [ls], saved=[ls, target])
    out = ops.result(tape, 1, 4, "nll_loss", node)
    weight = tape.new(1, 4, "total_weight")
    if node is not None:
        tape.save(node, weight)
    return out, weight


def scalar_div(tape: Tape, x: Tensor, tag: str, temps: int, divisor: Tensor | None = None) -> Tensor:
    """``loss / n`` on a 0-d loss (4 bytes; 2 where FSDP2's ``output_dtype`` cast it to bf16: hf_fsdp.py);
    backward allocates ``temps`` scalars then the gradient; a tensor ``divisor`` is saved for it."""
    size = x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        ts = [tape.new(1, size, f"grad_tmp{i}") for i in range(temps)]
        out = tape.new(1, size, "grad")
        tape.done(*ts)
        return [out]

    saved = [] if divisor is None else [divisor]
    return ops.result(tape, 1, size, tag, tape.node(tag, apply, [x], saved=saved))


@dataclass
class HfLlama:
    """The tape, the dims, the parameters by name, and the SDPA kernel run (``cpu_flash``,
    ``flash`` or ``math``)."""

    tape: Tape
    d: Dims
    weights: dict[str, Tensor]
    kernel: str = "cpu_flash"
    tied: bool = False
    cache: dict[str, Tensor] | None = None  # autocast's weight casts in this forward (None: no autocast)
    adapter: Callable | None = None  # (model, x, out, name) -> out: PEFT's wrapper of a linear (hf_lora.py)
    quant: object | None = None  # a quantized base's linears (hf_bnb.Bnb4bit)
    rope_cast = True  # the rotary tables cast to the hidden states' dtype (a class attribute)
    act = "silu"  # the MLP's activation (saves its input; its backward allocates the gradient alone)
    extra: dict | None = None  # a family's further config (hf_families.family_config)
    kv_cache: Callable | None = None  # (k, v) -> (k, v): ``past_key_values.update`` (hf_loop.py)
    eager = False  # eager_attention_forward in place of SDPA (a class attribute: hf_eager.EagerAttention)

    def buffers(self) -> list[tuple[str, int]]:
        """The model's floating buffers after its parameters (name, elements), in the model's dtype."""
        return [(f"model.rotary_emb.{name}", self.d.head_dim // 2) for name in ("inv_freq", "original_inv_freq")]

    def buffer_bytes(self, name: str, pd: int) -> int:
        """A buffer's element size: the model's, ``pd`` (``HfGemma3``: its scale over a 4-bit base)."""
        return pd

    def tables_for(self, i: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The rotary tables layer ``i`` uses (one pair in Llama's layout)."""
        return cos, sin

    def layer_inputs(self, i: int) -> list[Tensor]:
        """Further tensors layer ``i`` is called with (an attention mask; none without one)."""
        return []

    def grad_copy(self, part: str) -> bool:
        """Whether the gradient reaching ``part``'s (``q``, ``k``, ``v``) head view arrives in the other layout, so
        that the view's backward copies it: SDPA's q and k always, v on the math path (the flash kernels write dv
        in v's layout); eager attention's q (its ``bmm`` gradients are heads-major), and k and v where more than
        one KV head makes the layouts differ (``hf_eager.py``)."""
        if self.eager:
            return part == "q" or self.d.kv > self.d.head_dim
        return part != "v" or self.kernel == "math"

    @property
    def cpu(self) -> bool:
        return self.kernel == "cpu_flash"

    def weight(self, name: str) -> Tensor:
        """The weight a matmul uses: under autocast its bf16 cast, cached for the forward when the
        weight is a leaf that requires grad (``cached_cast``); a frozen one's, or a computed one's (PEFT's
        parametrized weights, ``hf_moe_lora.py``), is cast at each use."""
        w = self.weights[name]
        if self.cache is None:
            return self.tape.alias(w)
        if w.fn is None or not w.st.managed:
            return ops.to(self.tape, w, 2, f"{name}.autocast", Category.AUTOCAST)
        if name not in self.cache:
            with self.tape.scoped(""):
                self.cache[name] = ops.to(self.tape, w, 2, f"{name}.autocast", Category.AUTOCAST)
        return self.tape.alias(self.cache[name])

    def input_cast(self, x: Tensor, tag: str) -> Tensor:
        """A matmul's input under autocast: its bf16 cast, cached for the forward like a weight's when the input is
        an fp32 leaf that requires grad (``cached_cast``: the frozen embedding's output under
        ``enable_input_require_grads``, which OLMo 2's first layer gives its projections unnormed), so that every
        projection and adapter of that layer reads one cast; ``x`` itself without autocast or when bf16."""
        t = self.tape
        if self.cache is None or x.itemsize == 2:
            return t.alias(x)
        if x.fn is None or x.fn.seq != FIRST:
            return ops.to(t, x, 2, f"{tag}.input_cast")
        key = f"input.{id(x.st)}"  # keyed by the tensor (autocast_mode.cpp's cached_casts)
        if key not in self.cache:
            self.cache[key] = ops.to(t, x, 2, f"{tag}.input_cast")
        return t.alias(self.cache[key])

    def linear(self, x: Tensor, name: str, out_features: int, tag: str) -> Tensor:
        """``nn.Linear`` (no bias); under autocast the weight's cast, then the input's. A quantized
        base's linear is its own module's (``hf_bnb.py``); PEFT's wrapper runs after the base."""
        if self.quant is not None and self.quant.quantized(name):
            out = self.quant.linear(self, x, name, out_features, tag)
        else:
            out = self.dense(x, name, out_features, tag)
        return out if self.adapter is None else self.adapter(self, x, out, name)

    def dense(self, x: Tensor, name: str, out_features: int, tag: str) -> Tensor:
        """``nn.Linear.forward``: ``F.linear`` with the weight (and bias) of ``name``."""
        t = self.tape
        w = self.weight(f"{name}.weight")
        xin = self.input_cast(x, tag)
        bias = self.weights.get(f"{name}.bias")
        if bias is None:
            out = ops.linear(t, xin, w, self.d.tokens * out_features, tag)
        else:
            b = self.weight(f"{name}.bias")
            out = addmm_linear(t, xin, w, b, self.d.tokens * out_features, tag)
            t.done(b)
        t.done(xin, w)
        return out

    # --- the layer -------------------------------------------------------------------------------
    def rms_norm(self, x: Tensor, name: str, rows: int | None = None) -> Tensor:
        """``LlamaRMSNorm.forward`` over ``rows`` vectors (default: one per token)."""
        t, d = self.tape, self.d
        with t.scoped(name):
            x32 = ops.to(t, x, 4, "x_fp32")
            p = ops.unary(t, x32, "pow", temps=2, save_input=True)
            var = ops.unary(t, p, "mean", out_numel=rows or d.tokens)
            t.done(p)
            e = ops.unary(t, var, "add_eps", temps=-1)
            r = ops.rsqrt(t, e, "rsqrt")
            t.done(e)
            y = ops.mul(t, x32, r, "normed")
            t.done(r, x32)  # the temporary, then the rebound local
            yd = ops.to(t, y, x.itemsize, "normed_cast")
            out = ops.mul(t, self.weights[f"{name}.weight"], yd, "out", over_rows=True)
            t.done(yd, y, var)  # the temporary, then hidden_states and variance at return
        return out

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, tag: str) -> Tensor:
        """``(x * cos) + (rotate_half(x) * sin)``; ``rotate_half``: ``cat((-x2, x1), -1)``."""
        t = self.tape
        a = ops.mul(t, x, cos, f"{tag}.cos")
        lo = ops.half_slice(t, x, f"{tag}.x1")
        hi = ops.half_slice(t, x, f"{tag}.x2")
        neg = ops.unary(t, hi, f"{tag}.neg")
        rot = ops.cat(t, neg, lo, f"{tag}.rotate_half")
        t.done(neg, lo, hi)
        b = ops.mul(t, rot, sin, f"{tag}.sin")
        t.done(rot)
        out = ops.add(t, a, b, tag)
        # TensorIterator lays the output out as its first operand that is not broadcast over a dim
        # (``reorder_dimensions``, aten/src/ATen/TensorIterator.cpp): ``x * cos`` as x, ``a + b`` as a; so RoPE of a
        # heads view (token-major memory) is not contiguous, as SDPA's query then (TRL's offload clones it)
        out.transposed = x.transposed
        t.done(a, b)
        return out

    def projection(self, x: Tensor, name: str, out_features: int, tag: str, copy_grad: bool) -> Tensor:
        """``self.q_proj(x).view(hidden_shape).transpose(1, 2)``."""
        y = self.linear(x, name, out_features, tag)
        v = ops.heads_view(self.tape, y, f"{tag}_heads", copy_grad, self.one_head(out_features))
        self.tape.done(y)
        return v

    def one_head(self, features: int) -> bool:
        """Whether ``view(b, s, -1, head_dim).transpose(1, 2)`` of ``features`` columns is contiguous: one head
        (a single KV head's key and value) or one position (``ops.heads_view``)."""
        return features == self.d.head_dim or self.d.s == 1

    def cached(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``key_states, value_states = past_key_values.update(...)`` where the forward has a cache
        (``kv_cache``: the hand-written loop's ``use_cache``, hf_loop.py); else ``k`` and ``v``."""
        return (k, v) if self.kv_cache is None else self.kv_cache(k, v)

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """SDPA; under autocast the fp32 RoPE outputs are cast to bf16 first (k, then q), and v when it
        is fp32 too (a 4-bit base's linear returns its input's dtype: CPU log, k, v, then q)."""
        t, d = self.tape, self.d
        if self.kernel == "math":
            return prec.math_sdpa(t, q, k, v, d.b, d.heads, d.s)
        cast = self.cache is not None
        k2 = ops.to(t, k, 2, "k_cast") if cast else t.alias(k)
        v2 = ops.to(t, v, 2, "v_cast") if cast else t.alias(v)
        q2 = ops.to(t, q, 2, "q_cast") if cast else t.alias(q)
        if self.kernel == "efficient":  # fp32 without GQA on CUDA: no enable_gqa, no repeat (mem_efficient.py)
            out = mem_efficient.sdpa(t, q2, k2, v2, d.b, d.heads, d.s, d.head_dim)
        else:
            lse = d.b * d.heads * d.s
            if self.kernel == "flash":
                out = ops.sdpa(t, q2, k2, v2, lse, "sdpa")
            else:
                out = cpu_flash_sdpa(t, q2, k2, v2, lse, "sdpa", lse_strided=d.heads > 1 and d.s > 1)
        t.done(k2, q2, v2)
        return out

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``LlamaAttention.forward`` with ``sdpa_attention_forward``."""
        t, d = self.tape, self.d
        name = f"{prefix}.self_attn"
        with t.scoped(name):
            q = self.projection(x, f"{name}.q_proj", d.q, "q_proj", self.grad_copy("q"))
            k = self.projection(x, f"{name}.k_proj", d.kv, "k_proj", self.grad_copy("k"))
            v = self.projection(x, f"{name}.v_proj", d.kv, "v_proj", self.grad_copy("v"))
            qr, kr = self.rope(q, cos, sin, "q_rope"), self.rope(k, cos, sin, "k_rope")
            t.done(q, k)  # `query_states, key_states = ...` stores query first
            kr, v = self.cached(kr, v)
            out = self.core(qr, kr, v)
            # transpose(1, 2).contiguous(): the fused kernels' layout already; a copy of math's
            flat = prec.merge_heads(t, out) if self.kernel == "math" else t.alias(out)
            y = self.linear(flat, f"{name}.o_proj", d.h, "o_proj")
            t.done(flat, out, qr, kr, v)
        return y

    def mlp(self, x: Tensor, prefix: str) -> Tensor:
        """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
        return self.gated_mlp(x, f"{prefix}.mlp", self.d.f)

    def gated_mlp(self, x: Tensor, name: str, width: int) -> Tensor:
        """The gated MLP ``name`` of intermediate size ``width`` (a MoE block's shared expert: its own)."""
        t, d = self.tape, self.d
        with t.scoped(name):
            g = self.linear(x, f"{name}.gate_proj", width, "gate_proj")
            s1 = ops.unary(t, g, self.act, save_input=True)
            t.done(g)
            u = self.linear(x, f"{name}.up_proj", width, "up_proj")
            m = ops.mul(t, s1, u, "gate")
            t.done(s1, u)
            y = self.linear(m, f"{name}.down_proj", d.h, "down_proj")
            t.done(m)
        return y

    def layer(self, x: Tensor, cos: Tensor, sin: Tensor, i: int) -> Tensor:
        """``LlamaDecoderLayer.forward``."""
        t, prefix = self.tape, f"model.layers.{i}"
        with t.scoped(prefix):
            n1 = self.rms_norm(x, f"{prefix}.input_layernorm")
            a = self.attention(n1, cos, sin, prefix)
            t.done(n1)
            h = ops.add(t, x, a, "residual_attention")
            t.done(a)
            n2 = self.rms_norm(h, f"{prefix}.post_attention_layernorm")
            m = self.mlp(n2, prefix)
            t.done(n2)
            out = ops.add(t, h, m, "residual_mlp")
            t.done(m, h)  # the temporary, then `residual` at return
        return out

    # --- around the layers ---------------------------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        t, d = self.tape, self.d
        w = self.weights["model.embed_tokens.weight"]
        with t.scoped("model.embed_tokens"):
            if self.cpu:
                return cpu_embedding(t, ids, w, d.tokens * d.h, "embedding")
            return ops.embedding(t, ids, w, d.tokens * d.h, "embedding")

    def positions(self) -> Tensor:
        """``cache_position = arange(s) + past_seen_tokens`` (int64, kept as ``position_ids``),
        then ``masking_utils.find_packed_sequence_indices`` on it (temporaries)."""
        t, d = self.tape, self.d
        with t.scoped("model.positions"):
            ar = t.new(d.s, 8, "arange")
            pos = t.new(d.s, 8, "cache_position")
            t.done(ar)
            self.packed_check()
        return pos

    def packed_check(self) -> None:
        """``find_packed_sequence_indices`` of a ``create_*_mask`` call: temporaries only."""
        t, d = self.tape, self.d
        with t.scoped("model.positions"):
            first = t.new(d.b, 8, "first_position")
            padded = t.new(d.b * (d.s + 1), 8, "cat")
            diff = t.new(d.tokens, 8, "diff")
            t.done(padded)
            ne = t.new(d.tokens, 1, "ne")
            starts = t.new(d.tokens, 8, "cumsum")
            t.done(ne)
            eq, every = t.new(d.b, 1, "eq"), t.new(1, 1, "all")
            t.done(eq, every, first, diff, starts)

    def rope_tables(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``LlamaRotaryEmbedding.forward``: fp32 angles on (1, s, head_dim), cos and sin cast to
        ``x``'s dtype (a bf16 model's ``inv_freq`` is upcast first)."""
        t, d = self.tape, self.d
        half, table = d.head_dim // 2, d.s * d.head_dim
        with t.scoped("model.rotary_emb"):
            pos = t.new(d.s, 4, "position_ids_float")
            inv = t.new(half, 4, "inv_freq_float") if d.pd != 4 else None
            freqs = t.new(d.s * half, 4, "freqs")
            t.done(pos, inv)
            emb = t.new(table, 4, "emb")
            tables = []
            for name in ("cos", "sin"):
                raw = t.new(table, 4, name)
                tables.append(t.new(table, 4, f"{name}_scaled"))
                t.done(raw)
            size = x.itemsize if self.rope_cast else 4  # OLMo 2 keeps them fp32
            cos, sin = (ops.to(t, x32, size, f"{n}_cast") for x32, n in zip(tables, ("cos", "sin"), strict=True))
            t.done(freqs, emb, *tables)
        return cos, sin

    def head(self, x: Tensor) -> Tensor:
        """``lm_head(hidden_states[:, slice(0, None), :])`` (a view)."""
        name = "model.embed_tokens" if self.tied else "lm_head"
        with self.tape.scoped("lm_head"):
            return self.linear(x, name, self.d.vocab, "logits")

    def loss(self, logits: Tensor, num_items: Tensor | None) -> Tensor:
        """``ForCausalLMLoss`` with ``num_items_in_batch`` (``reduction="sum"``, then the division), or
        without (None: ``reduction="mean"``, no division): returns the 4-byte loss."""
        t, d = self.tape, self.d
        with t.scoped("loss"):
            f = ops.to(t, logits, 4, "logits_fp32", Category.LOGITS)
            pad = t.new(d.b * (d.s + 1), 8, "labels_pad")
            if d.b > 1:
                target = t.new(d.tokens, 8, "shift_labels")
            else:  # ``contiguous()`` of one row's ``[1:]`` returns the view: its s labels one element into the storage
                target = t.view(pad, d.tokens)
                target.offset = 1
            ls = ops.log_softmax(t, f)
            nll, weight = nll_loss(t, ls, target)
            t.done(ls)
            if num_items is None:
                loss = t.alias(nll)
            else:
                loss = scalar_div(t, nll, "div_num_items", temps=1, divisor=num_items)
            t.done(nll, weight, f, pad, target)  # the rebound loss, then the frame's locals
        return loss
