"""Eager attention (``attn_implementation="eager"``) in the op-level run of ``transformers.Trainer`` and the
hand-written loop.

transformers 5.23 writes one ``eager_attention_forward`` per family (``modeling_llama.py:180``, and the same lines
in Mistral's, Qwen2's, Qwen3's, Phi-3's, OLMo 2's, Mixtral's, Qwen3-MoE's and Qwen2-MoE's; Gemma 2's and 3's add
the scores' soft-cap, ``modeling_gemma3.py:262``), the ops :meth:`EagerAttention.eager_attention` follows:

- ``repeat_kv`` of k and v (``[:, :, None].expand(...).reshape(...)``: a copy of q's size with grouped heads, a
  stride-0 view over one KV head, k and v themselves without groups);
- ``torch.matmul(query, key_states.transpose(2, 3)) * scaling``: ``matmul`` folds the 4-D operands to ``bmm``
  (q, laid out heads-major by RoPE's strides, cloned contiguous; the transposed keys cloned unless
  ``repeat_kv`` copied them), the (b, heads, s, s) scores, then their scaled copy;
- Gemma 2's soft-cap (``/ cap``, ``tanh``, ``* cap``), then ``+ attention_mask``: the 4-D float mask, in
  ``inputs_embeds``' dtype, built by ``masking_utils.create_causal_mask`` (or
  ``create_sliding_window_causal_mask``) for eager attention at every length (``eager_mask``: ``sdpa_mask`` with
  ``allow_is_causal_skip=False``, ``hf_masks.sdpa_mask``, then ``torch.where(mask, 0, min)`` over the batch);
- ``softmax(dim=-1, dtype=torch.float32)`` (the input cast to fp32 where it is not, the fp32 result saved; on CUDA
  its backward's ``grad * output`` temporary, from source, as the bundled trainer's ``eager.py``),
  ``.to(query.dtype)`` (the probabilities returned as ``attn_weights``), ``dropout`` at ``p=0.0`` (the
  input itself: ``at::dropout``);
- ``torch.matmul(attn_weights, value_states)`` (v cloned contiguous unless ``repeat_kv`` copied it), its
  ``_unsafe_view`` and ``transpose(1, 2).contiguous()``, a copy token-major, so the heads' merge after it is a
  view.

Under ``bf16=True`` (autocast) both matmuls cast their fp32 operands to bf16; the mask (fp32 over an fp32 model)
promotes the masked scores to fp32. The decoder layer's ``hidden_states, _ = self.self_attn(...)`` keeps the
probabilities until the layer returns. The masks the model's forward builds, in order (each after its packed-
sequence check), ``extra["eager_masks"]`` (``hf_families.family_config``): Llama, OLMo 2: the causal one;
Mistral, Phi-3: the sliding one where the config has a window, else the causal one; Qwen2, Qwen3: the causal
one, and the sliding one where a layer is sliding (``has_sliding_layers``); Gemma 2 and 3: both. A layer reads
its kind's (``extra["kinds"]``), or the one mask built. Checked on CPU against the real Trainer and the
hand-written loop (tests/unit/test_timeline_hf_eager.py, tests/unit/test_timeline_hf_families.py for Gemma 2).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.eager import _softmax as _cuda_softmax
from memplan.costmodel.timeline.hf_masks import sdpa_mask
from memplan.costmodel.timeline.hf_model import HfLlama


def scaled(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``x / c`` or ``x * c`` for a Python scalar: saves nothing; backward a new gradient."""
    return prec._scaled(tape, x, x.numel, tag)


def tanh(tape: Tape, x: Tensor, tag: str) -> Tensor:
    """``torch.tanh``: saves its result; backward (``tanh_backward``) allocates the gradient."""
    return ops.output_saved(tape, x, tag)


def softcap(tape: Tape, x: Tensor) -> Tensor:
    """Gemma 2's soft-cap, ``tanh(x / cap) * cap``: three ``x``-sized tensors in turn, each op's input released as
    the next takes its result (the attention scores' and the final logits')."""
    a = scaled(tape, x, "softcap_div")
    tape.done(x)
    b = tanh(tape, a, "softcap_tanh")
    tape.done(a)
    out = scaled(tape, b, "softcap_mul")
    tape.done(b)
    return out


def repeat_kv(tape: Tape, x: Tensor, numel: int, kv_heads: int, tag: str) -> Tensor:
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


def softmax(tape: Tape, x: Tensor, tag: str, cuda: bool = False) -> Tensor:
    """``softmax(x, -1, dtype=float32)``: saves its fp32 result; backward allocates the gradient (on ``cuda`` then
    ``softmax_backward_cuda_out``'s ``grad * output`` temporary, freed: the bundled trainer's ``eager._softmax``,
    from source)."""
    x32 = ops.to(tape, x, 4, f"{tag}_input")
    out = _cuda_softmax(tape, x32, tag) if cuda else ops.output_saved(tape, x32, tag)
    tape.done(x32)
    return out


class EagerAttention:
    """A mixin before the family's class (``HfLlama`` or a subclass): the model's forward builds the eager masks
    and every layer's attention core is ``eager_attention_forward`` (module docstring)."""

    eager = True  # HfLlama.grad_copy: the head views' gradients as the eager matmuls return them

    def mask_kinds(self: HfLlama) -> tuple[str, ...]:
        """The masks the model's forward builds, in order (``extra["eager_masks"]``)."""
        return tuple((self.extra or {}).get("eager_masks") or ("full",))

    def layer_kind(self: HfLlama, i: int) -> str:
        kinds = (self.extra or {}).get("kinds") or ()
        return kinds[i] if kinds else "full"

    def layer_mask(self, i: int) -> Tensor:
        """Layer ``i``'s mask: its kind's, or the one mask the model builds (Mistral's, Phi-3's)."""
        mask = self.masks.get(self.layer_kind(i))
        return mask if mask is not None else next(iter(self.masks.values()))

    def embed(self: HfLlama, ids: Tensor) -> Tensor:
        out = super().embed(ids)  # type: ignore[misc]
        self.embeds_itemsize = out.itemsize  # ``inputs_embeds.dtype``: the masks'
        return out

    def positions(self: HfLlama) -> Tensor:
        """``position_ids`` (with the first mask's packed-sequence check), then each mask, the next ones after
        their own checks."""
        pos = HfLlama.positions(self)
        self.masks = {}
        for j, kind in enumerate(self.mask_kinds()):
            if j:
                self.packed_check()
            self.masks[kind] = self.eager_mask(kind == "sliding")
        return pos

    def eager_mask(self: HfLlama, sliding: bool) -> Tensor:
        """``sdpa_mask`` (bool, (s, s) broadcast over the batch: ``hf_masks.sdpa_mask``), then
        ``eager_mask``'s ``where(mask, 0, min)`` in ``inputs_embeds.dtype`` (two scalar tensors;
        masking_utils.py:632, the dtype from 975 / 1208): the model's, but bf16 under FSDP2's bf16
        policy over an fp32 model (the embedding computed from the bf16 all-gather)."""
        t, d = self.tape, self.d
        with t.scoped("model.masks"):
            allowed = sdpa_mask(t, d, sliding)
            dtype = self.embeds_itemsize
            zero, low = t.new(1, dtype, "zeros"), t.new(1, dtype, "scalar_tensor")
            mask = t.new(d.b * d.s * d.s, dtype, "sliding" if sliding else "full")
            t.done(low, zero, allowed)
        return mask

    def layer_inputs(self, i: int) -> list[Tensor]:
        return [self.layer_mask(i)]

    def head(self: HfLlama, x: Tensor) -> Tensor:
        """The masks go with the model's forward, then the family's head."""
        self.tape.done(*self.masks.values())  # the handles stay: a checkpoint's re-run reads them
        return super().head(x)  # type: ignore[misc]

    def attention(self: HfLlama, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """The family's attention, its core eager under the layer's mask (set again by a checkpoint's re-run)."""
        self.layer_index = int(prefix.rsplit(".", 1)[1])
        return super().attention(x, cos, sin, prefix)  # type: ignore[misc]

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, self.attn_weights = self.eager_attention(q, k, v, self.layer_mask(self.layer_index))
        return out

    def layer(self: HfLlama, x: Tensor, cos: Tensor, sin: Tensor, i: int) -> Tensor:
        """The family's layer; ``hidden_states, _ = self.self_attn(...)`` keeps the probabilities to its return."""
        out = super().layer(x, cos, sin, i)  # type: ignore[misc]
        self.tape.done(self.attn_weights)
        return out

    def autocast(self: HfLlama, x: Tensor, tag: str) -> Tensor:
        """A matmul's operand under ``bf16=True`` (autocast): cast to bf16 (x itself when it is)."""
        return ops.to(self.tape, x, 2, tag) if self.cache is not None else self.tape.alias(x)

    def eager_attention(self: HfLlama, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``eager_attention_forward``: ``repeat_kv`` copies of k and v, ``matmul(q, k^T)`` (q cloned
        contiguous), ``* scaling``, soft-capping (``/ cap``, ``tanh``, ``* cap``), ``+ mask``, the
        fp32 softmax (cast back to q's dtype), ``matmul(probs, v)``, ``transpose(1, 2).contiguous()``;
        returns the output and the probabilities (``attn_weights``, kept by the caller's frame)."""
        t, d = self.tape, self.d
        n, scores = q.numel, d.b * d.heads * d.s * d.s
        kv_heads = d.heads * k.numel // n
        k_exp, v_exp = (repeat_kv(t, x, n, kv_heads, f"{p}_exp") for x, p in ((k, "k"), (v, "v")))
        grouped = 1 < kv_heads < d.heads  # repeat_kv's copy, contiguous; else k and v as they are
        # matmul's reshapes to 3-D: q (heads-major RoPE layout) is cloned; k^T too unless repeat_kv copied it
        qa, ka = self.autocast(q, "q_cast"), self.autocast(k_exp, "k_cast")  # bf16=True: matmul's casts
        qc = prec._contiguous(t, qa, "query_contiguous", copy_grad=False)
        kc = t.alias(ka) if grouped else prec._contiguous(t, ka, "key_contiguous", copy_grad=False)
        raw = prec._bmm(t, qc, kc, scores, "scores")
        t.done(qc, kc, qa, ka)
        w = scaled(t, raw, "scaled")
        t.done(raw)
        cap = (self.extra or {}).get("attn_softcap")
        if cap is not None:
            w = softcap(t, w)
        masked = ops.add(t, w, mask, "mask")
        t.done(w)
        probs = softmax(t, masked, "softmax", cuda=not self.cpu)
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
