"""The decoder families beyond Llama's layout in the op-level run of ``transformers.Trainer``.

Each family is :class:`~memplan.costmodel.timeline.hf_model.HfLlama` with the methods its
``transformers/models/<family>/modeling_<family>.py`` (transformers 5.x) writes differently, and its
layer's parameters in ``named_parameters()`` order (module registration order). Checked on CPU
against the real Trainer (tests/unit/test_timeline_hf_families.py):

- Qwen3 (``modeling_qwen3.py``): ``q_norm`` / ``k_norm``, a ``Qwen3RMSNorm`` over each head's
  ``head_dim`` on ``q_proj(x).view(b, s, heads, head_dim)`` before the transpose;
- Phi-3 (``modeling_phi3.py``): one ``qkv_proj`` sliced into q, k, v (each slice's backward a
  zeroed ``qkv``-sized gradient, summed into the projection's); the partial-rotary RoPE even at
  factor 1: ``q[..., :rotary_dim]`` is an alias, ``q[..., rotary_dim:]`` an empty slice whose
  backward is another zeroed q-sized gradient, and ``cat([rope(q), q_pass])`` a copy; one
  ``gate_up_proj`` chunked in two (``SplitBackward0``: one ``cat`` of both gradients); the
  residual dropouts at ``resid_pdrop=0`` return their input (``at::dropout``);
- OLMo 2 (``modeling_olmo2.py``): no pre-norms; ``post_attention_layernorm`` and
  ``post_feedforward_layernorm`` on the attention's and the MLP's outputs before each residual
  add; ``q_norm`` / ``k_norm`` over the whole projection before the head view;
  ``Olmo2RMSNorm`` returns ``(weight * x).to(input_dtype)`` (the product in fp32); the rotary
  tables stay fp32, so in bf16 RoPE computes in fp32 and casts q and k back after both.
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.hf_model import LAYER_PARAMS, HfLlama

QWEN3_PARAMS = (
    *LAYER_PARAMS[:4],
    ("self_attn.q_norm", "hd", "1"),
    ("self_attn.k_norm", "hd", "1"),
    *LAYER_PARAMS[4:],
)


class HfQwen3(HfLlama):
    """``Qwen3ForCausalLM``: Llama's layer with a per-head RMSNorm on the queries and keys."""

    def projection(self, x: Tensor, name: str, out_features: int, tag: str, copy_grad: bool) -> Tensor:
        """``self.q_norm(self.q_proj(x).view(hidden_shape)).transpose(1, 2)`` (k likewise; v as Llama)."""
        if tag == "v_proj":
            return super().projection(x, name, out_features, tag, copy_grad)
        t = self.tape
        y = self.linear(x, name, out_features, tag)
        v = ops.heads_view(t, y, f"{tag}_view", copy_grad)
        t.done(y)
        n = self.rms_norm(v, name.replace("_proj", "_norm"), rows=self.d.tokens * out_features // self.d.head_dim)
        t.done(v)
        out = ops.heads_view(t, n, f"{tag}_heads", copy_grad=False)
        t.done(n)
        return out


PHI3_PARAMS = (
    ("self_attn.o_proj", "h", "q"),
    ("self_attn.qkv_proj", "qkv", "h"),
    ("mlp.gate_up_proj", "2f", "h"),
    ("mlp.down_proj", "h", "f"),
    ("input_layernorm", "h", "1"),
    ("post_attention_layernorm", "h", "1"),
)


def slice_view(tape: Tape, x: Tensor, numel: int, tag: str) -> Tensor:
    """``x[..., a:b]`` (not the whole range): a view; backward (``slice_backward``) a zeroed tensor
    of x's size with the gradient copied in."""
    size, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(size, itemsize, "grad")]

    v = tape.view(x, numel)
    v.fn = tape.node(tag, apply, [x])
    return v


def chunk2(tape: Tape, x: Tensor, tag: str) -> tuple[Tensor, Tensor]:
    """``x.chunk(2, dim=-1)``: two views of one ``SplitBackward0``, whose backward runs once both
    gradients are in and allocates their ``cat``. Each view's gradient is held by a relay node
    (the tape's nodes take one gradient) until the split's apply."""
    held: list[Tensor] = []
    size, itemsize = x.numel, x.itemsize

    def split(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        out = tape.new(size, itemsize, "grad_cat")
        tape.done(*held)
        held.clear()
        return [out]

    def relay(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        held.append(tape.hold(g[0]))
        return [tape.new(0, itemsize, "relay")]

    handle = tape.view(x, 0)
    handle.fn = tape.node(tag, split, [x])
    views = []
    for i in range(2):
        v = tape.view(x, size // 2)
        v.fn = tape.node(f"{tag}.{i}", relay, [handle])
        views.append(v)
    tape.done(handle)
    return views[0], views[1]


def _alias(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``x[..., :n]`` over the whole width: ``AliasBackward0``, the gradient passed as a view."""
    return ops.heads_view(tape, x, tag, copy_grad=False)


def _rest(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``x[..., n:]`` past the end: an empty slice (its backward still a zeroed x-sized tensor)."""
    return slice_view(tape, x, 0, tag)


class HfPhi3(HfLlama):
    """``Phi3ForCausalLM``: Llama's layer with fused projections and the partial-rotary RoPE."""

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``Phi3Attention.forward`` with ``sdpa_attention_forward``."""
        t, d = self.tape, self.d
        name = f"{prefix}.self_attn"
        with t.scoped(name):
            qkv = self.linear(x, f"{name}.qkv_proj", d.q + 2 * d.kv, "qkv_proj")
            parts = (("q", d.q, True), ("k", d.kv, True), ("v", d.kv, False))
            slices = [slice_view(t, qkv, d.tokens * width, f"{p}_slice") for p, width, _ in parts]
            q, k, v = (ops.heads_view(t, x, f"{p}_heads", grad) for x, (p, _, grad) in zip(slices, parts, strict=True))
            t.done(*slices)
            # q[..., :rotary_dim] (the whole width: an alias), q[..., rotary_dim:] (empty); then k's
            rot = [f(t, x, n) for x, p in ((q, "q"), (k, "k")) for f, n in ((_alias, f"{p}_rot"), (_rest, f"{p}_pass"))]
            qr = self.partial_rope(rot[0], rot[1], cos, sin, "q_rope")
            kr = self.partial_rope(rot[2], rot[3], cos, sin, "k_rope")
            t.done(q, k)
            out = self.core(qr, kr, v)
            # RoPE's cat left q heads-major, and so SDPA's output: transpose(1, 2).contiguous() copies
            flat = prec.merge_heads(t, out)
            t.done(out)  # sdpa_attention_forward rebinds attn_output to the copy
            y = self.linear(flat, f"{name}.o_proj", d.h, "o_proj")
            t.done(flat, qkv, qr, kr, v, *rot)
        return y

    def partial_rope(self, x: Tensor, rest: Tensor, cos: Tensor, sin: Tensor, tag: str) -> Tensor:
        """``torch.cat([(x * cos) + (rotate_half(x) * sin), rest], dim=-1)``: a copy."""
        r = self.rope(x, cos, sin, tag)
        out = ops.cat(self.tape, r, rest, f"{tag}.cat")
        self.tape.done(r)
        return out

    def mlp(self, x: Tensor, prefix: str) -> Tensor:
        """``Phi3MLP.forward``: ``down_proj(up * act(gate))`` over ``gate_up_proj(x).chunk(2)``."""
        t, d = self.tape, self.d
        name = f"{prefix}.mlp"
        with t.scoped(name):
            gu = self.linear(x, f"{name}.gate_up_proj", 2 * d.f, "gate_up_proj")
            gate, up = chunk2(t, gu, "chunk")
            t.done(gu)
            s1 = ops.unary(t, gate, "silu", save_input=True)
            m = ops.mul(t, up, s1, "up_states")
            t.done(s1, up)
            y = self.linear(m, f"{name}.down_proj", d.h, "down_proj")
            t.done(m, gate)
        return y


OLMO2_PARAMS = (
    *LAYER_PARAMS[:4],
    ("self_attn.q_norm", "q", "1"),
    ("self_attn.k_norm", "kv", "1"),
    *LAYER_PARAMS[4:7],
    ("post_attention_layernorm", "h", "1"),
    ("post_feedforward_layernorm", "h", "1"),
)


class HfOlmo2(HfLlama):
    """``Olmo2ForCausalLM``: post-norms, full-width q/k norms, fp32 rotary tables."""

    rope_cast = False

    def rms_norm(self, x: Tensor, name: str, rows: int | None = None) -> Tensor:
        """``Olmo2RMSNorm.forward``: the weight multiplies the fp32 normed states, then the cast."""
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
            t.done(r, x32)
            w = ops.mul(t, self.weights[f"{name}.weight"], y, "weighted", over_rows=True)
            out = ops.to(t, w, x.itemsize, "out")
            t.done(w, y, var)
        return out

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``Olmo2Attention.forward`` with ``sdpa_attention_forward``."""
        t, d = self.tape, self.d
        name = f"{prefix}.self_attn"
        with t.scoped(name):
            normed = []
            for part, width in (("q", d.q), ("k", d.kv)):
                y = self.linear(x, f"{name}.{part}_proj", width, f"{part}_proj")
                normed.append(self.rms_norm(y, f"{name}.{part}_norm"))
                t.done(y)
            v = self.linear(x, f"{name}.v_proj", d.kv, "v_proj")
            q, k = (ops.heads_view(t, n, f"{p}_heads", True) for n, p in zip(normed, "qk", strict=True))
            vh = ops.heads_view(t, v, "v_heads", self.kernel == "math")
            t.done(*normed, v)
            qe, ke = self.rope(q, cos, sin, "q_rope"), self.rope(k, cos, sin, "k_rope")
            qr, kr = ops.to(t, qe, q.itemsize, "q_rope_cast"), ops.to(t, ke, k.itemsize, "k_rope_cast")
            t.done(qe, ke, q, k)  # apply_rotary_pos_emb's locals, then the rebound query / key
            out = self.core(qr, kr, vh)
            flat = prec.merge_heads(t, out) if self.kernel == "math" else t.alias(out)
            y = self.linear(flat, f"{name}.o_proj", d.h, "o_proj")
            t.done(flat, out, qr, kr, vh)
        return y

    def layer(self, x: Tensor, cos: Tensor, sin: Tensor, i: int) -> Tensor:
        """``Olmo2DecoderLayer.forward``: each sublayer's output normed, then added."""
        t, prefix = self.tape, f"model.layers.{i}"
        with t.scoped(prefix):
            a = self.attention(x, cos, sin, prefix)
            n1 = self.rms_norm(a, f"{prefix}.post_attention_layernorm")
            t.done(a)
            h = ops.add(t, x, n1, "residual_attention")
            t.done(n1)
            m = self.mlp(h, prefix)
            n2 = self.rms_norm(m, f"{prefix}.post_feedforward_layernorm")
            t.done(m)
            out = ops.add(t, h, n2, "residual_mlp")
            t.done(n2, h)
        return out


GEMMA_PARAMS = (
    *QWEN3_PARAMS[:9],
    ("input_layernorm", "h", "1"),
    ("post_attention_layernorm", "h", "1"),
    ("pre_feedforward_layernorm", "h", "1"),
    ("post_feedforward_layernorm", "h", "1"),
)


def _scaled(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``x / c`` or ``x * c`` for a Python scalar: saves nothing; backward a new gradient."""
    return prec._scaled(tape, x, x.numel, tag)


def _tanh(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``torch.tanh``: saves its result; backward (``tanh_backward``) allocates the gradient."""
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, "grad")]

    node = tape.node(tag, apply, [x])
    out = ops.result(tape, numel, itemsize, tag, node)
    if node is not None:
        tape.save(node, out)
    return out


class HfGemma3(HfLlama):
    """``Gemma3ForCausalLM``: the scaled embedding, ``(1 + w)`` RMSNorm in fp32, sandwich norms,
    per-head q/k norms after the transpose, GeGLU, one pair of rotary tables per layer type."""

    act = "gelu_tanh"

    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind (``full`` / ``sliding``)."""
        return tuple((self.extra or {}).get("kinds") or ("full",) * self.d.layers)

    def buffers(self) -> list[tuple[str, int]]:
        """``embed_tokens.embed_scale`` (a scalar), then per layer type present (sorted) its
        ``inv_freq`` and ``original_inv_freq``."""
        half = self.d.head_dim // 2
        names = ("inv_freq", "original_inv_freq")
        rope = [(f"model.rotary_emb.{k}_attention_{n}", half) for k in sorted(set(self.kinds())) for n in names]
        return [("model.embed_tokens.embed_scale", 1), *rope]

    def embed(self, ids: Tensor) -> Tensor:
        """``Gemma3TextScaledWordEmbedding``: the lookup times ``embed_scale`` (a buffer in the weight's dtype)."""
        t = self.tape
        e = super().embed(ids)
        with t.scoped("model.embed_tokens"):
            out = ops.mul(t, e, self.weights["model.embed_tokens.embed_scale"], "embed_scale")
        t.done(e)
        return out

    def positions(self) -> Tensor:
        """``position_ids``, then two masks built (full and sliding): two packed-sequence checks."""
        pos = super().positions()
        self.packed_check()
        return pos

    def rope_tables(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """One pair per layer type present (``position_embeddings[layer_type]``); the first pair is
        returned (held once more: all pairs go in :meth:`head`, with the model's forward)."""
        self.pairs = {kind: super(HfGemma3, self).rope_tables(x) for kind in sorted(set(self.kinds()))}
        cos, sin = next(iter(self.pairs.values()))
        return self.tape.alias(cos), self.tape.alias(sin)

    def tables_for(self, i: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return self.pairs[self.kinds()[i]]

    def rms_norm(self, x: Tensor, name: str, rows: int | None = None) -> Tensor:
        """``Gemma3RMSNorm.forward``: ``_norm(x.float()) * (1.0 + weight.float())``, cast back."""
        t, d = self.tape, self.d
        with t.scoped(name):
            x32 = ops.to(t, x, 4, "x_fp32")
            p = ops.unary(t, x32, "pow", temps=2, save_input=True)
            m = ops.unary(t, p, "mean", out_numel=rows or d.tokens)
            t.done(p)
            e = ops.unary(t, m, "add_eps", temps=-1)
            t.done(m)
            r = ops.rsqrt(t, e, "rsqrt")
            t.done(e)
            y = ops.mul(t, x32, r, "normed")
            t.done(r, x32)
            w32 = ops.to(t, self.weights[f"{name}.weight"], 4, "weight_fp32")
            wp = ops.unary(t, w32, "one_plus", temps=-1)
            t.done(w32)
            o = ops.mul(t, wp, y, "scaled", over_rows=True)  # output * (1 + w): same bytes either order
            t.done(wp, y)  # the temporary, then the rebound output
            out = ops.to(t, o, x.itemsize, "out")
            t.done(o)
        return out

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``Gemma3Attention.forward`` with ``sdpa_attention_forward`` (no mask: the window is not reached)."""
        t, d = self.tape, self.d
        name = f"{prefix}.self_attn"
        with t.scoped(name):
            q = self.projection(x, f"{name}.q_proj", d.q, "q_proj", True)
            k = self.projection(x, f"{name}.k_proj", d.kv, "k_proj", True)
            v = self.projection(x, f"{name}.v_proj", d.kv, "v_proj", self.kernel == "math")
            qn = self.rms_norm(q, f"{name}.q_norm", rows=d.tokens * d.q // d.head_dim)
            t.done(q)  # query_states rebound to its norm
            kn = self.rms_norm(k, f"{name}.k_norm", rows=d.tokens * d.kv // d.head_dim)
            t.done(k)
            qr, kr = self.rope(qn, cos, sin, "q_rope"), self.rope(kn, cos, sin, "k_rope")
            t.done(qn, kn)
            out = self.core(qr, kr, v)
            flat = prec.merge_heads(t, out) if self.kernel == "math" else t.alias(out)
            y = self.linear(flat, f"{name}.o_proj", d.h, "o_proj")
            t.done(flat, out, qr, kr, v)
        return y

    def layer(self, x: Tensor, cos: Tensor, sin: Tensor, i: int) -> Tensor:
        """``Gemma3DecoderLayer.forward``: norms before and after the attention and the MLP."""
        t, prefix = self.tape, f"model.layers.{i}"
        with t.scoped(prefix):
            n1 = self.rms_norm(x, f"{prefix}.input_layernorm")
            a = self.attention(n1, cos, sin, prefix)
            t.done(n1)
            pa = self.rms_norm(a, f"{prefix}.post_attention_layernorm")
            t.done(a)
            h = ops.add(t, x, pa, "residual_attention")
            t.done(pa)
            n2 = self.rms_norm(h, f"{prefix}.pre_feedforward_layernorm")
            m = self.mlp(n2, prefix)
            t.done(n2)
            pm = self.rms_norm(m, f"{prefix}.post_feedforward_layernorm")
            t.done(m)
            out = ops.add(t, h, pm, "residual_mlp")
            t.done(pm, h)
        return out

    def head(self, x: Tensor) -> Tensor:
        """The forward's rotary tables go, then ``lm_head``; with ``final_logit_softcapping`` the
        logits become ``tanh(logits / cap) * cap`` (each a logits-sized tensor)."""
        t = self.tape
        for pair in self.pairs.values():
            t.done(*pair)
        logits = super().head(x)
        cap = (self.extra or {}).get("final_softcap")
        if cap is None:
            return logits
        with t.scoped("lm_head"):
            a = _scaled(t, logits, "softcap_div")
            t.done(logits)
            b = _tanh(t, a, "softcap_tanh")
            t.done(a)
            out = _scaled(t, b, "softcap_mul")
            t.done(b)
        return out


GEMMA2_PARAMS = (*LAYER_PARAMS[:7], *GEMMA_PARAMS[9:])


class HfGemma2(HfGemma3):
    """``Gemma2ForCausalLM``: Gemma 3's layer without q/k norms, one pair of rotary tables, and
    eager attention (transformers refuses SDPA with soft-capped scores) over two float masks."""

    def buffers(self) -> list[tuple[str, int]]:
        return [("model.embed_tokens.embed_scale", 1), *HfLlama.buffers(self)]

    def positions(self) -> Tensor:
        """``position_ids``, then ``create_causal_mask`` and ``create_sliding_window_causal_mask``
        for eager attention: each a packed-sequence check and a (b, 1, s, s) float mask."""
        pos = HfLlama.positions(self)
        self.masks = {"full": self.eager_mask(False)}
        self.packed_check()
        self.masks["sliding"] = self.eager_mask(True)
        return pos

    def eager_mask(self, sliding: bool) -> Tensor:
        """``sdpa_mask`` (bool, (s, s) broadcast over the batch) from its index aranges, then
        ``eager_mask``'s ``where(mask, 0, min)`` in the model's dtype (two scalar tensors)."""
        t, d = self.tape, self.d
        square = d.s * d.s
        with t.scoped("model.masks"):
            batch, head = t.new(d.b, 8, "batch_arange"), t.new(1, 8, "head_arange")
            idx = []
            for name in ("kv", "q"):
                ar = t.new(d.s, 8, f"{name}_arange")
                idx.append(t.new(d.s, 8, f"{name}_idx"))
                t.done(ar)
            if sliding:
                one = t.new(1, 1, "new_ones")
                diff = t.new(d.s, 8, "sub")
                gt = t.new(square, 1, "gt")
                t.done(diff)
                window = t.new(square, 1, "and_window")
                t.done(gt, one)
                le = t.new(square, 1, "le")
                allowed = t.new(square, 1, "and_causal")
                t.done(le, window)
            else:
                allowed = t.new(square, 1, "le")
            t.done(batch, head, *idx)
            zero, low = t.new(1, d.pd, "zeros"), t.new(1, d.pd, "scalar_tensor")
            mask = t.new(d.b * square, d.pd, "sliding" if sliding else "full")
            t.done(low, zero, allowed)
        return mask

    def rope_tables(self, x: Tensor) -> tuple[Tensor, Tensor]:
        self.pairs = {}
        return HfLlama.rope_tables(self, x)

    def tables_for(self, i: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return cos, sin

    def layer_inputs(self, i: int) -> list[Tensor]:
        return [self.masks[self.kinds()[i]]]

    def head(self, x: Tensor) -> Tensor:
        """The masks go with the model's forward, then Gemma 3's head."""
        self.tape.done(*self.masks.values())  # the handles stay: a checkpoint's re-run reads them
        return super().head(x)

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``Gemma2Attention.forward`` with ``eager_attention_forward``."""
        t, d = self.tape, self.d
        name = f"{prefix}.self_attn"
        i = int(prefix.rsplit(".", 1)[1])
        with t.scoped(name):
            q = self.projection(x, f"{name}.q_proj", d.q, "q_proj", True)
            # k's and v's gradients arrive heads-major: a copy back, unless one KV head makes both layouts one
            k = self.projection(x, f"{name}.k_proj", d.kv, "k_proj", d.kv > d.head_dim)
            v = self.projection(x, f"{name}.v_proj", d.kv, "v_proj", d.kv > d.head_dim)
            qr, kr = self.rope(q, cos, sin, "q_rope"), self.rope(k, cos, sin, "k_rope")
            t.done(q, k)
            out, weights = self.eager(qr, kr, v, self.masks[self.kinds()[i]])
            y = self.linear(out, f"{name}.o_proj", d.h, "o_proj")
            t.done(out, qr, kr, v)  # attn_output rebound, then the frame's locals
        self.attn_weights = weights  # returned: the layer's `_` holds it until the layer returns
        return y

    def autocast(self, x: Tensor, tag: str) -> Tensor:
        """A matmul's operand under ``bf16=True`` (autocast): cast to bf16 (x itself when it is)."""
        return ops.to(self.tape, x, 2, tag) if self.cache is not None else self.tape.alias(x)

    def layer(self, x: Tensor, cos: Tensor, sin: Tensor, i: int) -> Tensor:
        """Gemma 3's layer; ``hidden_states, _ = self.self_attn(...)`` keeps the probabilities to its return."""
        out = super().layer(x, cos, sin, i)
        self.tape.done(self.attn_weights)
        return out

    def eager(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``eager_attention_forward``: ``repeat_kv`` copies of k and v, ``matmul(q, k^T)`` (q cloned
        contiguous), ``* scaling``, soft-capping (``/ cap``, ``tanh``, ``* cap``), ``+ mask``, the
        fp32 softmax (cast back to q's dtype), ``matmul(probs, v)``, ``transpose(1, 2).contiguous()``;
        returns the output and the probabilities (``attn_weights``, kept by the caller's frame)."""
        t, d = self.tape, self.d
        n, scores = q.numel, d.b * d.heads * d.s * d.s
        kv_heads = d.heads * k.numel // n
        k_exp, v_exp = (_repeat_kv(t, x, n, kv_heads, f"{p}_exp") for x, p in ((k, "k"), (v, "v")))
        grouped = 1 < kv_heads < d.heads  # repeat_kv's copy, contiguous; else k and v as they are
        # matmul's reshapes to 3-D: q (heads-major RoPE layout) is cloned; k^T too unless repeat_kv copied it
        qa, ka = self.autocast(q, "q_cast"), self.autocast(k_exp, "k_cast")  # bf16=True: matmul's casts
        qc = prec._contiguous(t, qa, "query_contiguous", copy_grad=False)
        kc = t.alias(ka) if grouped else prec._contiguous(t, ka, "key_contiguous", copy_grad=False)
        raw = prec._bmm(t, qc, kc, scores, "scores")
        t.done(qc, kc, qa, ka)
        w = _scaled(t, raw, "scaled")
        t.done(raw)
        cap = (self.extra or {}).get("attn_softcap")
        if cap is not None:
            a = _scaled(t, w, "softcap_div")
            t.done(w)
            b = _tanh(t, a, "softcap_tanh")
            t.done(a)
            w = _scaled(t, b, "softcap_mul")
            t.done(b)
        masked = ops.add(t, w, mask, "mask")
        t.done(w)
        probs = _softmax(t, masked, "softmax")
        pd = ops.to(t, probs, q.itemsize, "probs_cast")
        t.done(probs, masked)  # the temporary, then the rebound attn_weights
        pa, va = self.autocast(pd, "probs_autocast"), self.autocast(v_exp, "v_cast")
        vc = t.alias(va) if grouped else prec._contiguous(t, va, "value_contiguous", copy_grad=False)
        raw_out = prec._bmm(t, pa, vc, n, "out")
        t.done(vc, pa, va)
        view = prec._unsafe_view(t, raw_out, "out_view")
        out = prec._contiguous(t, view, "transpose_contiguous", copy_grad=False)
        t.done(view, k_exp, v_exp)
        return out, pd


def _repeat_kv(tape: Tape, x: Tensor, numel: int, kv_heads: int, tag: str) -> Tensor:
    """``repeat_kv``: x itself without groups; one KV head expanded is a view (stride 0: its
    reshape needs no copy); else a copy. Backward of the expand: the sum over the groups."""
    if x.numel == numel:
        return tape.alias(x)
    if kv_heads > 1:
        return prec._repeat_heads(tape, x, numel, tag)
    small = x.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(small, x.itemsize, "grad_sum_groups")]

    v = tape.view(x, numel)
    v.fn = tape.node(tag, apply, [x])
    return v


def _softmax(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``softmax(x, -1, dtype=float32)``: saves its fp32 result; backward allocates the gradient."""
    x32 = ops.to(tape, x, 4, f"{tag}_input")
    numel = x.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, 4, "grad")]

    node = tape.node(tag, apply, [x32])
    out = ops.result(tape, numel, 4, tag, node)
    if node is not None:
        tape.save(node, out)
    tape.done(x32)
    return out


def family_config(model) -> dict | None:
    """What a family's run reads from the spec beyond the dims: Gemma's layer kinds and final soft-cap."""
    if model.architecture not in ("gemma2", "gemma3"):
        return None
    return {
        "kinds": model.layer_attention_kinds,
        "final_softcap": model.final_logit_softcapping,
        "attn_softcap": model.attn_logit_softcapping,
    }


FAMILIES: dict[str, tuple[type[HfLlama], tuple]] = {
    "llama": (HfLlama, LAYER_PARAMS),
    "mistral": (HfLlama, LAYER_PARAMS),
    "qwen2": (HfLlama, LAYER_PARAMS),
    "qwen3": (HfQwen3, QWEN3_PARAMS),
    "phi3": (HfPhi3, PHI3_PARAMS),
    "olmo2": (HfOlmo2, OLMO2_PARAMS),
    "gemma3": (HfGemma3, GEMMA_PARAMS),
    "gemma2": (HfGemma2, GEMMA2_PARAMS),
}


def family(name: str) -> tuple[type[HfLlama], tuple]:
    """The model class and the layer's parameters (name, rows, cols) of a family the run models."""
    return FAMILIES[name]
