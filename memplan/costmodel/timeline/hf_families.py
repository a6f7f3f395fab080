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
  tables stay fp32, so in bf16 RoPE computes in fp32 and casts q and k back after both;
- Gemma 2 and Gemma 3: ``hf_gemma.py``.
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.hf_eager import EagerAttention
from memplan.costmodel.timeline.hf_gemma import GEMMA2_PARAMS, GEMMA_PARAMS, HfGemma2, HfGemma3
from memplan.costmodel.timeline.hf_model import LAYER_PARAMS, HfLlama
from memplan.costmodel.timeline.hf_sliding import SlidingWindow

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
        v = ops.heads_view(t, y, f"{tag}_view", copy_grad, contiguous=True)  # the view alone: the norm saves it as is
        t.done(y)
        n = self.rms_norm(v, name.replace("_proj", "_norm"), rows=self.d.tokens * out_features // self.d.head_dim)
        t.done(v)
        out = ops.heads_view(t, n, f"{tag}_heads", copy_grad=False, contiguous=self.one_head(out_features))
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


def split(tape: Tape, x: Tensor, sizes: tuple[int, ...], tag: str, strided: bool = True) -> list[Tensor]:
    """``torch.split(x, sizes, dim=-1)``: views of one ``SplitWithSizesBackward0`` (``SplitBackward0`` for
    ``chunk``), whose backward runs once every part's gradient is in and allocates their ``cat`` (x's size).
    Each view's gradient is held by a relay node (the tape's nodes take one gradient) until the split's
    apply. ``strided``: the views are marked non-contiguous (``Tensor.transposed``), as DeepSeek-V3's
    splits are taken (hf_mla.py)."""
    held: list[Tensor] = []
    numel, itemsize, width = x.numel, x.itemsize, sum(sizes)

    def whole(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        out = tape.new(numel, itemsize, "grad_cat")
        tape.done(*held)
        held.clear()
        return [out]

    def relay(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        held.append(tape.hold(g[0]))
        return [tape.new(0, itemsize, "relay")]

    handle = tape.view(x, 0)
    handle.fn = tape.node(tag, whole, [x])
    views, start = [], x.offset
    for i, size in enumerate(sizes):
        v = tape.view(x, numel // width * size)
        v.fn = tape.node(f"{tag}.{i}", relay, [handle])
        v.transposed = v.transposed or strided
        v.offset, start = start, start + size  # the first element: its column in x's first row
        views.append(v)
    tape.done(handle)
    return views


def chunk2(tape: Tape, x: Tensor, tag: str) -> tuple[Tensor, Tensor]:
    """``x.chunk(2, dim=-1)``: two views of one ``SplitBackward0`` (:func:`split` in two halves)."""
    first, second = split(tape, x, (1, 1), tag)  # each half strided over x's rows
    return first, second


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
            copies = {p: self.grad_copy(p) if self.eager else p != "v" for p in "qkv"}  # SDPA: v's in its layout
            parts = tuple((p, width, copies[p]) for p, width in (("q", d.q), ("k", d.kv), ("v", d.kv)))
            slices = [slice_view(t, qkv, d.tokens * width, f"{p}_slice") for p, width, _ in parts]
            q, k, v = (ops.heads_view(t, x, f"{p}_heads", grad) for x, (p, _, grad) in zip(slices, parts, strict=True))
            t.done(*slices)
            # q[..., :rotary_dim] (the whole width: an alias), q[..., rotary_dim:] (empty); then k's
            rot = [f(t, x, n) for x, p in ((q, "q"), (k, "k")) for f, n in ((_alias, f"{p}_rot"), (_rest, f"{p}_pass"))]
            qr = self.partial_rope(rot[0], rot[1], cos, sin, "q_rope")
            kr = self.partial_rope(rot[2], rot[3], cos, sin, "k_rope")
            t.done(q, k)
            kr, v = self.cached(kr, v)
            out = self.core(qr, kr, v)
            # RoPE's cat left q heads-major, and so SDPA's output (the flash kernels' follows q):
            # transpose(1, 2).contiguous() copies; the memory-efficient kernel writes its own token-major
            # ``res`` (B, M, heads, Kv), so there it is a view (mem_efficient.py)
            # eager attention's output is token-major already (its transpose(1, 2).contiguous(): hf_eager.py)
            flat = t.alias(out) if self.kernel == "efficient" or self.eager else prec.merge_heads(t, out)
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
            q, k = (
                ops.heads_view(t, n, f"{p}_heads", self.grad_copy(p), self.one_head(w))
                for n, p, w in zip(normed, "qk", (d.q, d.kv), strict=True)
            )
            vh = ops.heads_view(t, v, "v_heads", self.grad_copy("v"), self.one_head(d.kv))
            t.done(*normed, v)
            qe, ke = self.rope(q, cos, sin, "q_rope"), self.rope(k, cos, sin, "k_rope")
            qr, kr = ops.to(t, qe, q.itemsize, "q_rope_cast"), ops.to(t, ke, k.itemsize, "k_rope_cast")
            t.done(qe, ke, q, k)  # apply_rotary_pos_emb's locals, then the rebound query / key
            kr, vh = self.cached(kr, vh)
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


# hf_moe.py, hf_mla.py and hf_mla_v2.py, which build on this module's
MOE = ("mixtral", "qwen3-moe", "qwen2-moe", "deepseek-v2", "deepseek-v3")


def family_config(model, gpu_arch=None, attention: str = "flash") -> dict | None:
    """What a family's run reads from the spec beyond the dims: Gemma's layer kinds and soft-caps, a
    MoE family's experts (``hf_moe.moe_config``, with the GPU's ``gpu_arch``); under the plan's ``attention``
    ``eager`` (and Gemma 2's always) the masks the model builds and each layer's kind (``hf_eager.py``)."""
    config = _family_config(model, gpu_arch)
    if attention != "eager" and model.architecture != "gemma2":
        return config
    kinds = model.layer_attention_kinds
    return {
        **(config or {}),
        "kinds": kinds,
        "eager_masks": eager_masks(model.architecture, model.sliding_window, kinds),
    }


def eager_masks(arch: str, window: int | None, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The 4-D float masks the family's model forward builds for eager attention, in order (``hf_eager.py``):
    Gemma 2 and 3 (``modeling_gemma3.py:541``) and Qwen2-MoE (``modeling_qwen2_moe.py:485``) both whatever the
    layers; Mistral, Phi-3, Mixtral and Qwen3-MoE one, the sliding one where the config sets a window
    (``modeling_mistral.py:353``); Qwen2 and Qwen3 the causal one, and the sliding one where a layer is sliding
    (``has_sliding_layers``, ``modeling_qwen2.py:373``); Llama and OLMo 2 the causal one."""
    if arch in ("gemma2", "gemma3", "qwen2-moe"):
        return ("full", "sliding")
    if arch in ("mistral", "phi3", "mixtral", "qwen3-moe"):
        return ("sliding",) if window is not None else ("full",)
    if arch in ("qwen2", "qwen3") and "sliding" in kinds:
        return ("full", "sliding")
    return ("full",)


def _family_config(model, gpu_arch=None) -> dict | None:
    if model.architecture in ("deepseek-v2", "deepseek-v3"):
        from memplan.costmodel.timeline.hf_mla import mla_config

        return mla_config(model, gpu_arch)
    if model.architecture in MOE:
        from memplan.costmodel.timeline.hf_moe import moe_config

        return moe_config(model, gpu_arch)
    kinds, window = model.layer_attention_kinds, model.sliding_window
    if model.architecture in ("mistral", "qwen2", "phi3") and window is not None:  # hf_sliding.py
        return {"kinds": kinds, "window": window, "second_check": model.architecture == "qwen2"}
    if model.architecture not in ("gemma2", "gemma3"):
        return None
    return {
        "kinds": kinds,
        "window": window,
        "final_softcap": model.final_logit_softcapping,
        "attn_softcap": model.attn_logit_softcapping,
    }


# hf_sliding.py: the sliding mask and the masked SDPA over the family's layer, where the sequence reaches the window
class HfMistral(SlidingWindow, HfLlama):
    """``MistralForCausalLM`` and ``Qwen2ForCausalLM``: Llama's layer, sliding layers under the window's mask."""


class HfPhi3Window(SlidingWindow, HfPhi3):
    """``Phi3ForCausalLM`` with its window's mask."""


class HfGemma3Window(SlidingWindow, HfGemma3):
    """``Gemma3ForCausalLM`` with the sliding layers' mask."""


FAMILIES: dict[str, tuple[type[HfLlama], tuple]] = {
    "llama": (HfLlama, LAYER_PARAMS),
    "mistral": (HfMistral, LAYER_PARAMS),
    "qwen2": (HfMistral, LAYER_PARAMS),
    "qwen3": (HfQwen3, QWEN3_PARAMS),
    "phi3": (HfPhi3Window, PHI3_PARAMS),
    "olmo2": (HfOlmo2, OLMO2_PARAMS),
    "gemma3": (HfGemma3Window, GEMMA_PARAMS),
    "gemma2": (HfGemma2, GEMMA2_PARAMS),
}


class EagerLlama(EagerAttention, HfLlama):
    """``LlamaForCausalLM`` (and Mistral's, Qwen2's) under ``attn_implementation="eager"``."""


class EagerQwen3(EagerAttention, HfQwen3):
    """``Qwen3ForCausalLM`` under eager attention."""


class EagerPhi3(EagerAttention, HfPhi3):
    """``Phi3ForCausalLM`` under eager attention (the window in its mask)."""


class EagerOlmo2(EagerAttention, HfOlmo2):
    """``Olmo2ForCausalLM`` under eager attention."""


class EagerGemma3(EagerAttention, HfGemma3):
    """``Gemma3ForCausalLM`` under eager attention (both masks)."""


EAGER_FAMILIES: dict[str, type[HfLlama]] = {
    "llama": EagerLlama,
    "mistral": EagerLlama,
    "qwen2": EagerLlama,
    "qwen3": EagerQwen3,
    "phi3": EagerPhi3,
    "olmo2": EagerOlmo2,
    "gemma3": EagerGemma3,
    "gemma2": HfGemma2,
}


def family(name: str, eager: bool = False) -> tuple[type[HfLlama], tuple]:
    """The model class and the layer's parameters (name, rows, cols) of a family the run models; ``eager``: under
    ``attn_implementation="eager"`` (``EAGER_FAMILIES``, ``hf_eager.py``)."""
    if eager and name in EAGER_FAMILIES:
        return EAGER_FAMILIES[name], FAMILIES[name][1]
    if name == "deepseek-v3":
        from memplan.costmodel.timeline.hf_mla import HfDeepseekV3

        return HfDeepseekV3, ()  # its layers' parameters depend on the config (hf_moe.layer_params)
    if name == "deepseek-v2":
        from memplan.costmodel.timeline.hf_mla_v2 import HfDeepseekV2

        return HfDeepseekV2, ()
    if name in MOE and eager:
        from memplan.costmodel.timeline.hf_eager_moe import EAGER_MOE_FAMILIES

        return EAGER_MOE_FAMILIES[name]
    if name in MOE:
        from memplan.costmodel.timeline.hf_moe import MOE_FAMILIES

        return MOE_FAMILIES[name]
    return FAMILIES[name]
