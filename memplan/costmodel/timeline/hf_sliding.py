"""Sliding-window layers whose window the sequence reaches, in the op-level run of ``transformers.Trainer``.

transformers 5.23 builds the mask of a sliding layer with ``create_sliding_window_causal_mask``
(masking_utils.py:1128): for SDPA, ``sdpa_mask`` returns None (``is_causal``) only while the keys do not reach
the window (``_ignore_causal_mask_sdpa``: ``kv_length >= local_size`` keeps the mask, masking_utils.py:301);
past it, the (s, s) bool grid ``hf_masks.sdpa_mask`` follows, expanded over the batch (a view). One mask a
model forward, whatever the number of sliding layers (``causal_mask_mapping``: one entry per layer type; the
full layers' entry skipped for ``is_causal``), built after its packed-sequence check and held by the model's
forward to its return (after ``position_ids``). Which model builds it:

- Mistral (``sliding_window`` set: config.json's, 4096 where absent, ``specs.hf._mistral``) and Phi-3
  (``sliding_window`` set): ``create_sliding_window_causal_mask`` instead of ``create_causal_mask``
  (modeling_mistral.py:353, modeling_phi3.py:384), one packed check;
- Qwen2 with ``use_sliding_window`` (its layers from ``max_window_layers`` on sliding): the full mask's
  packed check, then the sliding one's (``has_sliding_layers``, modeling_qwen2.py:373);
- Gemma 3: both masks whatever the layers are (modeling_gemma3.py:541), so the sliding grid is built where
  the window is reached even if no layer reads it (``hf_gemma.HfGemma3.positions``: both packed checks).

A sliding layer calls ``sdpa_attention_forward`` (integrations/sdpa_attention.py) with the mask: no
``enable_gqa`` (``use_gqa_in_sdpa`` needs no mask), so grouped k and v go through ``repeat_kv`` (each a copy
of q's size, or over one KV head a stride-0 view; backward the sum over the groups: ``hf_eager.repeat_kv``),
and ``is_causal=False``. Inside
``scaled_dot_product_attention`` (aten/src/ATen/native/transformers/attention.cpp) the bool mask becomes a
float one of the query's dtype, ``where(mask, 0, -inf)`` over two scalar tensors, materialized at (b, 1, s, s)
in every layer that calls it; CPU's flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` takes
``attn_mask``) saves that float mask beside k, q, v, the log-sum-exp and the output, and releases it first
(CPU log). With gradient checkpointing the bool grid is an argument of every checkpointed sliding layer
(held by the checkpoint to its recompute, ``hf_trainer``) and the float one is remade by the recompute.
Under ``bf16=True`` autocast casts q and the repeated k and v to bf16 before the call, so the float mask is
bf16. Checked on CPU against the real Trainer (tests/unit/test_timeline_hf_sliding.py).

On CUDA (from source, torch 2.11-2.13; **no GPU run**) transformers builds the same masks (masking_utils has
no CUDA branch) and a masked call leaves the flash kernel (``check_for_attn_mask``); with K
and V repeated it takes cuDNN in 16 bits on compute capability 9.0 / 10.0 over heads of 128 or less (cuDNN first
there from torch 2.11, a mask accepted; its own mask conversion, ``convert_boolean_attn_mask_cudnn``: not
followed), else the memory-efficient kernel, fp32 included (:func:`cuda_masked_kernel`, ``attention.sdpa_backend``;
Gemma 3's 256-wide heads: memory-efficient on every GPU). For the memory-efficient kernel the composite
converts the mask as on CPU (``convert_boolean_attn_mask_``: ``where(mask, 0.0, scalar_tensor(-inf))`` in the
query's dtype), then ``preprocess_mask``: unless every stride but the last is a multiple of 8 (``aligned_tensor``:
the keys a multiple of 8) ``pad_bias`` copies it to the next multiple of 8 columns and slices it back, and the
result is expanded over the heads (a view); ``_scaled_dot_product_efficient_attention`` saves that bias beside q,
k, v, the output and the log-sum-exp (``get_bias_4d_view``: a view, no copy), and its backward computes no bias
gradient (``grad_bias`` only ``if (bias_requires_grad)``; the mask requires none): :func:`cuda_saved_mask_bytes` a
layer, :func:`cuda_masked_sdpa`. The run follows the memory-efficient kernel where ``hf_support.sliding_cuda_ok``
says (fp32 or 16 bits at any head dim, ``mem_efficient_half.py``, on compute capability 8.0 / 9.0: in 16 bits over
heads of 128 or less that is 8.0, where cuDNN is not first), under the Trainer and the hand-written loop alike (the
loop's cache hands SDPA its copies of k and v: ``hf_loop.py``); cuDNN stays on the phase model.
"""

from __future__ import annotations

from memplan.costmodel.attention import sdpa_backend
from memplan.costmodel.timeline import mem_efficient, ops
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.hf_eager import repeat_kv as _repeat_kv
from memplan.costmodel.timeline.hf_masks import sdpa_mask
from memplan.costmodel.timeline.hf_model import HfLlama, cpu_flash_sdpa

MEM_EFF_ALIGNMENT = 8  # attention.cpp preprocess_mask: mem_eff_alignment, the bias strides' multiple


def reached(window: int | None, seq_len: int) -> bool:
    """Whether ``sdpa_mask`` materializes a sliding mask: the keys (the sequence) reach the window."""
    return window is not None and seq_len >= window


class SlidingWindow:
    """A mixin before the family's class (``HfLlama`` or one of its subclasses): where the sequence reaches
    the window (``extra["window"]``), the forward builds the sliding mask and the sliding layers (``extra
    ["kinds"]``) run SDPA with it; elsewhere the family's run as it is."""

    def _window(self: HfLlama) -> int | None:
        window = (self.extra or {}).get("window")
        return window if reached(window, self.d.s) else None

    def _kind(self: HfLlama, i: int) -> str:
        kinds = (self.extra or {}).get("kinds") or ()
        return kinds[i] if kinds else "full"

    def positions(self) -> Tensor:
        """The family's ``position_ids`` and packed checks; Qwen2's second check (its sliding layers'
        mask); then the sliding grid where the window is reached."""
        pos = super().positions()
        self.sliding_mask = None
        if (self.extra or {}).get("second_check"):
            self.packed_check()
        if self._window() is not None:
            with self.tape.scoped("model.masks"):
                self.sliding_mask = sdpa_mask(self.tape, self.d, sliding=True)
        return pos

    def _mask(self, i: int) -> Tensor | None:
        return self.sliding_mask if self._kind(i) == "sliding" else None

    def layer_inputs(self, i: int) -> list[Tensor]:
        mask = self._mask(i)
        return [*super().layer_inputs(i), *([mask] if mask is not None else [])]

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """The family's attention, its SDPA under the layer's mask (set again by a checkpoint's recompute). On
        CUDA a masked layer runs the memory-efficient kernel whatever the unmasked layers run (flash, or math in
        fp32 with GQA): its output is token-major, so the heads' merge is a view and v's gradient arrives as
        flash's does (the layer read under ``kernel`` "efficient", as MLA's)."""
        self.layer_mask = self._mask(int(prefix.rsplit(".", 1)[1]))
        if self.layer_mask is None or self.cpu:
            return super().attention(x, cos, sin, prefix)
        kernel, self.kernel = self.kernel, "efficient"
        try:
            return super().attention(x, cos, sin, prefix)
        finally:
            self.kernel = kernel

    def head(self, x: Tensor) -> Tensor:
        """The mask goes with the model's forward (after ``position_ids``), then the family's head."""
        if getattr(self, "sliding_mask", None) is not None:
            self.tape.done(self.sliding_mask)  # the handle stays: a checkpoint's recompute reads it
        return super().head(x)

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        mask = getattr(self, "layer_mask", None)
        if mask is None:
            return super().core(q, k, v)
        if self.cpu:
            return masked_sdpa(self, q, k, v)
        return cuda_masked_sdpa(self, q, k, v)


def masked_sdpa(model: HfLlama, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``sdpa_attention_forward`` with a mask on CPU (module docstring): ``repeat_kv`` of grouped k and v,
    autocast's bf16 casts (k, v, then q, as the mask-free call's), the float mask (two scalar tensors and
    ``where``), then the flash kernel saving it."""
    t, d = model.tape, model.d
    kr, vr, q2, k2, v2 = _inputs(model, q, k, v)
    bias = _float_mask(t, d.b, d.s, q2.itemsize)
    out = cpu_flash_sdpa(t, q2, k2, v2, d.b * d.heads * d.s, "sdpa", mask=bias, lse_strided=d.heads > 1 and d.s > 1)
    t.done(bias, k2, q2, v2, kr, vr)
    return out


def cuda_masked_sdpa(model: HfLlama, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``sdpa_attention_forward`` with a mask on CUDA under the memory-efficient kernel (module docstring; from
    source, not run on a GPU): the CPU's ``repeat_kv``, casts and float mask, then ``preprocess_mask``'s padded
    copy where the keys are not a multiple of :data:`MEM_EFF_ALIGNMENT` (the unpadded mask freed as the padded
    one replaces it), then ``mem_efficient.sdpa`` saving the bias (``hf_support.sliding_cuda_ok`` says where)."""
    t, d = model.tape, model.d
    kr, vr, q2, k2, v2 = _inputs(model, q, k, v)
    bias = _float_mask(t, d.b, d.s, q2.itemsize)
    if d.s % MEM_EFF_ALIGNMENT:
        padded = t.new(cuda_saved_mask_bytes(d.b, d.s, q2.itemsize) // q2.itemsize, q2.itemsize, "mask_padded")
        t.done(bias)  # ``attn_mask.value() = preprocess_mask(...)``: the unpadded one goes with the assignment
        bias = padded
    out = mem_efficient.sdpa(t, q2, k2, v2, d.b, d.heads, d.s, d.head_dim, bias=bias)
    t.done(bias, k2, q2, v2, kr, vr)
    return out


def _inputs(model: HfLlama, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
    """``repeat_kv`` of grouped k and v, then autocast's bf16 casts (k, v, then q, as the mask-free call's):
    (k repeated, v repeated, q, k, v as SDPA takes them)."""
    t, d = model.tape, model.d
    kv_heads = d.heads * k.numel // q.numel
    kr, vr = (_repeat_kv(t, x, q.numel, kv_heads, f"{p}_repeat") for x, p in ((k, "k"), (v, "v")))
    cast = model.cache is not None
    k2, v2, q2 = (ops.to(t, x, 2, f"{p}_cast") if cast else t.alias(x) for x, p in ((kr, "k"), (vr, "v"), (q, "q")))
    return kr, vr, q2, k2, v2


def _float_mask(t: Tape, b: int, s: int, itemsize: int) -> Tensor:
    """``convert_boolean_attn_mask_``: ``where(mask, 0.0, scalar_tensor(-inf))`` in the query's dtype, its two
    scalar tensors freed as it returns; the (b, 1, s, s) result materialized (the mask's batch is an expanded
    view). The same op on CPU and CUDA (attention.cpp, before the backend's call)."""
    zero, low = t.new(1, itemsize, "mask_zero"), t.new(1, itemsize, "mask_neg_inf")
    bias = t.new(b * s * s, itemsize, "mask_float")
    t.done(low, zero)
    return bias


def cuda_masked_kernel(
    head_dim: int,
    heads: int,
    half: bool,
    capability: tuple[int, int] = (9, 0),
    torch_version: tuple[int, int] = (2, 11),
) -> str:
    """The kernel CUDA's SDPA dispatch picks for a sliding layer's masked call (``attention.sdpa_backend``): K and V
    repeated to ``heads`` (no ``enable_gqa``), a mask, in bf16 (``half``: a bf16 model or ``bf16=True``) or fp32."""
    dtype = "bf16" if half else "fp32"
    return sdpa_backend(
        "cuda",
        dtype,
        head_dim,
        heads,
        heads,
        enable_gqa=False,
        attn_mask=True,
        capability=capability,
        torch_version=torch_version,
    )


def cuda_saved_mask_bytes(b: int, s: int, itemsize: int) -> int:
    """The float bias the memory-efficient kernel saves for a layer's backward (module docstring): (b, 1, s, s) in
    the query's dtype, padded to a multiple of :data:`MEM_EFF_ALIGNMENT` columns where s is not one
    (``pad_bias``: ``8 - s % 8`` columns more)."""
    columns = s if s % MEM_EFF_ALIGNMENT == 0 else s + MEM_EFF_ALIGNMENT - s % MEM_EFF_ALIGNMENT
    return b * s * columns * itemsize
