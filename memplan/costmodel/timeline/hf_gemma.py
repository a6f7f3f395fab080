"""Gemma 2 and Gemma 3 in the op-level run of ``transformers.Trainer`` (``hf_families.py`` picks them).

As in ``hf_families.py``, each is :class:`~memplan.costmodel.timeline.hf_model.HfLlama` with the methods
its ``modeling_gemma3.py`` / ``modeling_gemma2.py`` (transformers 5.x) writes differently, checked on CPU
against the real Trainer (tests/unit/test_timeline_hf_families.py):

- Gemma 3: the embedding times ``embed_scale``; ``Gemma3RMSNorm`` in fp32 as
  ``_norm(x.float()) * (1.0 + weight.float())``, cast back; four norms per layer; q/k norms over
  ``head_dim`` after the transpose; GeGLU; one pair of rotary tables per layer type present; two
  masks built (two packed-sequence checks; SDPA gets none while the sequence is shorter than the
  window: ``masking_utils._ignore_causal_mask_sdpa``); final logit soft-capping;
- Gemma 2: Gemma 3's layer without q/k norms, one pair of rotary tables, and the eager attention
  transformers gives it (``_supports_sdpa = False``): both float masks, ``repeat_kv``, ``matmul``'s
  clones, soft-capped scores, the fp32 softmax; under autocast each matmul's bf16 casts (``hf_eager.py``'s
  ``EagerAttention``, which the other families run under ``attn_implementation="eager"``).

Under the Trainer's FSDP2 with ``bf16=True`` (``hf_fsdp.py``: bf16 all-gathers, no autocast) the fp32
``embed_scale`` buffer is copied to the bf16 weight's dtype, so the embedding, the residual stream and
Gemma 2's masks are bf16 as in a bf16 model (tests/unit/test_timeline_hf_fsdp.py).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.hf_eager import EagerAttention, softcap
from memplan.costmodel.timeline.hf_model import LAYER_PARAMS, HfLlama

GEMMA_PARAMS = (
    *LAYER_PARAMS[:4],
    ("self_attn.q_norm", "hd", "1"),
    ("self_attn.k_norm", "hd", "1"),
    *LAYER_PARAMS[4:7],
    ("input_layernorm", "h", "1"),
    ("post_attention_layernorm", "h", "1"),
    ("pre_feedforward_layernorm", "h", "1"),
    ("post_feedforward_layernorm", "h", "1"),
)


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

    def buffer_bytes(self, name: str, pd: int) -> int:
        """``embed_scale`` is ``torch.tensor(scale)``, made in the default dtype ``from_pretrained`` sets (the
        dtype it loads in), and ``prepare_model_for_kbit_training`` casts parameters to fp32, never buffers:
        over a 4-bit or an LLM.int8 base it stays in the loaded dtype (``Bnb4bit.stored``, ``Bnb8bit.stored``; the
        rotary ``inv_freq`` are made in fp32 explicitly). Found by tests/unit/test_timeline_hf_peft_families.py
        (2 B over a bf16 base) and test_timeline_hf_int8_families.py (the same over an 8-bit one)."""
        stored = getattr(self.quant, "stored", None)
        return stored if name.endswith("embed_scale") and stored is not None else pd

    def embed(self, ids: Tensor) -> Tensor:
        """``Gemma3TextScaledWordEmbedding.forward``: ``super().forward(input_ids) *
        self.embed_scale.to(self.weight.dtype)``. The buffer is in the model's dtype; under FSDP2's
        bf16 policy over an fp32 model the weight is the bf16 all-gather (buffers are not cast:
        ``MixedPrecisionPolicy`` casts parameters only), so the scalar is copied to bf16 and the
        product (a 0-dim tensor does not promote) is bf16, as the rest of the residual stream."""
        t = self.tape
        e = super().embed(ids)
        with t.scoped("model.embed_tokens"):
            w = self.weights["model.embed_tokens.weight"]
            scale = ops.to(t, self.weights["model.embed_tokens.embed_scale"], w.itemsize, "embed_scale_cast")
            out = ops.mul(t, e, scale, "embed_scale")
            t.done(scale)
        t.done(e)
        self.embeds_itemsize = out.itemsize  # ``inputs_embeds.dtype``: the eager masks' (HfGemma2)
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
            # laid out as x (TensorIterator: the first operand not broadcast; hf_model.HfLlama.rope): over the q / k
            # heads view (token-major memory) neither is contiguous, nor are the saves of the two products
            y.transposed = x32.transposed
            t.done(r, x32)
            w32 = ops.to(t, self.weights[f"{name}.weight"], 4, "weight_fp32")
            wp = ops.unary(t, w32, "one_plus", temps=-1)
            t.done(w32)
            o = ops.mul(t, wp, y, "scaled", over_rows=True)  # output * (1 + w): same bytes either order
            o.transposed = y.transposed
            t.done(wp, y)  # the temporary, then the rebound output
            out = ops.to(t, o, x.itemsize, "out")
            t.done(o)
        return out

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``Gemma3Attention.forward`` with ``sdpa_attention_forward`` (no mask: the window is not reached)."""
        t, d = self.tape, self.d
        name = f"{prefix}.self_attn"
        with t.scoped(name):
            q = self.projection(x, f"{name}.q_proj", d.q, "q_proj", self.grad_copy("q"))
            k = self.projection(x, f"{name}.k_proj", d.kv, "k_proj", self.grad_copy("k"))
            v = self.projection(x, f"{name}.v_proj", d.kv, "v_proj", self.grad_copy("v"))
            qn = self.rms_norm(q, f"{name}.q_norm", rows=d.tokens * d.q // d.head_dim)
            t.done(q)  # query_states rebound to its norm
            kn = self.rms_norm(k, f"{name}.k_norm", rows=d.tokens * d.kv // d.head_dim)
            t.done(k)
            qr, kr = self.rope(qn, cos, sin, "q_rope"), self.rope(kn, cos, sin, "k_rope")
            t.done(qn, kn)
            kr, v = self.cached(kr, v)
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
            return softcap(t, logits)


GEMMA2_PARAMS = (*LAYER_PARAMS[:7], *GEMMA_PARAMS[9:])


class HfGemma2(EagerAttention, HfGemma3):
    """``Gemma2ForCausalLM``: Gemma 3's layer without q/k norms, one pair of rotary tables, and
    eager attention (transformers refuses SDPA with soft-capped scores) over two float masks
    (``hf_eager.EagerAttention``: ``family_config`` gives it both, ``eager_masks``)."""

    def buffers(self) -> list[tuple[str, int]]:
        return [("model.embed_tokens.embed_scale", 1), *HfLlama.buffers(self)]

    def rope_tables(self, x: Tensor) -> tuple[Tensor, Tensor]:
        self.pairs = {}
        return HfLlama.rope_tables(self, x)

    def tables_for(self, i: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return cos, sin

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``Gemma2Attention.forward`` with ``eager_attention_forward``."""
        t, d = self.tape, self.d
        name = f"{prefix}.self_attn"
        i = int(prefix.rsplit(".", 1)[1])
        with t.scoped(name):
            q = self.projection(x, f"{name}.q_proj", d.q, "q_proj", self.grad_copy("q"))
            k = self.projection(x, f"{name}.k_proj", d.kv, "k_proj", self.grad_copy("k"))
            v = self.projection(x, f"{name}.v_proj", d.kv, "v_proj", self.grad_copy("v"))
            qr, kr = self.rope(q, cos, sin, "q_rope"), self.rope(k, cos, sin, "k_rope")
            t.done(q, k)
            kr, v = self.cached(kr, v)
            out, weights = self.eager_attention(qr, kr, v, self.layer_mask(i))
            y = self.linear(out, f"{name}.o_proj", d.h, "o_proj")
            t.done(out, qr, kr, v)  # attn_output rebound, then the frame's locals
        self.attn_weights = weights  # returned: the layer's `_` holds it until the layer returns
        return y
