"""Step-time terms of a LoRA / QLoRA micro-batch: the frozen base and its adapters.

What runs differently from full training, as the bundled trainer (``memplan.train.lora``,
``memplan.train.quant``) and PEFT over transformers run it (peft 0.21, bitsandbytes 0.50.2):

- **Frozen weights get no weight gradient.** A linear whose weight has ``requires_grad=False``
  runs its forward and its input-gradient GEMM only: autograd skips ``mm``'s ``mat2`` gradient
  when its ``grad_input_mask`` is false (``tools/autograd/derivatives.yaml``, ``mm``: ``mat2:
  mat1.t().mm(grad)`` guarded by ``grad_input_mask[1]``). A frozen linear costs 4 N FLOPs per
  token (2 N forward, 2 N backward), not full training's 6 N; recomputation adds its forward.
- **A quantized base runs its residual stream in fp32.** ``prepare_model_for_kbit_training``
  casts every non-quantized parameter to fp32 (embedding, norms, LM head), so the hidden states,
  q, k, v and the attention run in fp32 (``memory._activation_bytes``); SDPA then takes the
  memory-efficient kernel, or the math path with GQA (flash needs fp16 / bf16), and the LM head
  is an fp32 GEMM on CUDA cores. Each ``Linear4bit`` casts its fp32 input to the compute dtype
  and its output back (``bitsandbytes.nn.Linear4bit.forward``: ``x.to(compute_dtype)``,
  ``.to(inp_dtype)``).
- **bitsandbytes dequantizes.** 4-bit (``MatMul4Bit``): for more than ``_gemm_4bit_custom_max_m``
  rows the forward's ``gemm_4bit`` is ``dequantize_4bit`` then ``F.linear`` in the compute dtype
  (``backends/cuda/ops.py``, ``_dequant_linear_fallback``), and the backward dequantizes again for
  the input gradient (``grad_A = torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state)``).
  LLM.int8 (``MatMul8bitLt``): the forward quantizes its input to int8 (``int8_vectorwise_quant``
  of ``A.to(float16)``) and multiplies in int8 (``int8_scaled_mm``); the backward dequantizes the
  weight into the input's dtype (``state.CB.to(ctx.dtype_A, copy=True).mul_(SCB / 127)``) and
  multiplies in that dtype.

Every function is O(1) per plan (sums over one layer's linears, the model's shape only).
"""

from __future__ import annotations

from functools import lru_cache

from memplan.costmodel.activations import layer_matmul_widths
from memplan.costmodel.lora import layer_linears, model_targets
from memplan.costmodel.quant import BLOCK_4BIT
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan


def cast_bytes(src: int, dst: int) -> int:
    """Bytes one element's dtype conversion moves: read ``src``, write ``dst`` (none when equal)."""
    return 0 if src == dst else src + dst


def gemm_passes(trained: bool) -> int:
    """GEMMs of one linear per micro-batch, in units of its forward (2 x in x out FLOPs a token):
    forward and input gradient, and the weight gradient only when the weight is trained."""
    return 3 if trained else 2


def head_trained(plan: Plan) -> bool:
    """Whether the LM head gets a weight gradient: in full training, or as a ``modules_to_save``
    copy (PEFT's ``ModulesToSaveWrapper`` trains a copy of it)."""
    return plan.finetune == "full" or "lm_head" in plan.modules_to_save


def quantized_stream(plan: Plan, autocast: bool) -> bool:
    """The residual stream runs in fp32 over a quantized base (``memory._activation_bytes``),
    unless autocast keeps the activations in the compute dtype."""
    return plan.quant != "none" and not autocast


@lru_cache(maxsize=4096)
def adapted_widths(model: ModelSpec, targets: tuple[str, ...]) -> tuple[int, int]:
    """(sum of in, sum of out) over one layer's linears that carry a LoRA adapter
    (``lora.layer_linears``, PEFT's names)."""
    linears = layer_linears(model)
    chosen = [linears[name] for name in model_targets(model, targets)]
    return sum(i for i, _ in chosen), sum(o for _, o in chosen)


@lru_cache(maxsize=512)
def layer_linear_widths(model: ModelSpec) -> tuple[int, int, int]:
    """(sum of in, sum of out, weights) over every linear of one layer (transformers quantizes
    them all: ``quant.LINEARS``)."""
    widths = layer_matmul_widths(model)
    return sum(i for i, _ in widths), sum(o for _, o in widths), sum(i * o for i, o in widths)


ADAPTER_BYTES = 4
"""The adapters' dtype: fp32 whatever the base. PEFT's ``get_peft_model(autocast_adapter_dtype=True)``
(its default) upcasts fp16 / bf16 adapter weights to fp32 (peft 0.21 ``tuners/tuners_utils.py``,
``cast_adapter_dtype``: ``dtypes_to_convert_to_fp32 = {torch.float16, torch.bfloat16}``), and the
bundled trainer's ``LoraLinear`` builds them in fp32. Under ``torch.autocast`` the adapters' GEMMs
and what follows them run in the autocast dtype instead (not profiled: priced at the activations'
dtype, ``a = d``)."""


def adapter_bytes_per_token(
    model: ModelSpec, plan: Plan, layers: int, d: int, recompute: float, a: int = ADAPTER_BYTES
) -> float:
    """HBM traffic of the LoRA adapters' memory-bound kernels, one token on a stage (PEFT's
    ``lora.Linear.forward``: ``result = base(x)``, ``x = _cast_input_dtype(x, lora_A.weight.dtype)``,
    ``result = result + lora_B(lora_A(dropout(x))) * scaling``, ``result.to(torch_result_dtype)``;
    the bundled trainer's ``LoraLinear`` the same). ``d``: the activations' bytes an element, ``a``:
    the adapters' (:data:`ADAPTER_BYTES`). The r-wide GEMMs (r = 16) move far more bytes than they
    compute, so they run at HBM speed. Per adapted linear and token:

    forward: the input cast to the adapter dtype (cast_bytes(d, a) per in element), A reads it
    (a in), B writes the delta (a out), the scaling reads and writes it (2 a out), the add reads
    the base output and the delta and writes in the promoted dtype (d + 2 a out: ``d <= a``), and
    the cast back to the base's dtype (cast_bytes(a, d) out): cast(d, a) + a in, 4 a + d + a +
    cast(a, d) out. Backward: the final cast's and the add's gradient casts (cast(d, a) + cast(a,
    d) out), the scaling's (2 a out), B's two GEMMs read the gradient (2 a out), A's write the input
    gradient and read x (2 a in), the input cast's gradient back to d (cast(a, d) in) and the sum
    with the base's input gradient (3 d in). With d = a (a quantized base's fp32 stream) that is d
    in + 6 d out forward and 5 d in + 4 d out backward; with a bf16 stream (d = 2) the casts and
    the fp32 add make it 10 in + 28 out and 20 in + 28 out bytes (the H200 profile of the bf16 LoRA
    step: ``bfloat16_copy`` and ``direct_copy`` kernels and fp32 ``CUDAFunctor_add``, 549 of 2553 ms,
    docs/cost-model.md). With ``lora_dropout`` > 0, ``nn.Dropout`` on the cast input writes its
    output and a 1-byte mask (2 a + 1 per in element) and its backward reads the gradient and the
    mask and writes (2 a + 1). ``recompute``: the share of the forward run again (full
    recomputation: 1). Split over TP like the linears."""
    if plan.finetune == "full":
        return 0.0
    ins, outs = adapted_widths(model, plan.lora_targets)
    down, up = cast_bytes(d, a), cast_bytes(a, d)
    dropout = (2 * a + 1) * ins if plan.lora_dropout > 0 else 0
    forward = (down + a) * ins + (5 * a + d + up) * outs + dropout
    backward = (2 * a + up + 3 * d) * ins + (down + up + 4 * a) * outs + dropout
    return (forward * (1 + recompute) + backward) * layers / plan.tp


def quant_cast_bytes_per_token(
    model: ModelSpec, plan: Plan, layers: int, act: int, compute: int, recompute: float
) -> float:
    """HBM traffic bitsandbytes' layers add around their matmuls, one token on a stage.

    4-bit (``Linear4bit.forward``): the input cast to the compute dtype and the output cast back
    to the input's (cast_bytes(act, compute) per element each; their backward casts the
    gradients the other way, the same bytes), and PEFT's ``lora.Linear4bit`` clones the base's
    output (``result = result.clone()``, 2 act per out element, forward only).
    int8 (``MatMul8bitLt.forward``): ``A.to(float16)`` (cast_bytes(act, 2)), then
    ``int8_vectorwise_quant`` reads it and writes int8 codes (2 + 1 per in element); the
    output comes in the input's dtype; the backward's ``grad_output.to(ctx.dtype_A)`` is a no-op.
    ``recompute``: the share of the forward run again."""
    if plan.quant == "none":
        return 0.0
    ins, outs, _ = layer_linear_widths(model)
    if plan.quant == "int8":
        forward = (cast_bytes(act, 2) + 3) * ins
        backward = 0.0
    else:
        casts = cast_bytes(act, compute) * (ins + outs)
        clone = 2 * act * adapted_widths(model, plan.lora_targets)[1] if plan.finetune != "full" else 0
        forward, backward = casts + clone, casts
    return (forward * (1 + recompute) + backward) * layers / plan.tp


def dequant_bytes_per_weight(quant: str, double_quant: bool, out_bytes: int) -> float:
    """HBM bytes one weight's dequantization moves.

    4-bit (``functional.dequantize_4bit``): the kernel reads the packed code (0.5 B) and its
    block's fp32 absmax (4 B per 64 weights) and writes the weight in ``out_bytes`` (the dtype it
    was quantized from). Double quantization first rebuilds the absmaxes
    (``dequantize_blockwise(absmax, state2)``: read 1 B, write 4 B per block) and adds the offset
    in place (read and write 4 B per block): 13 B per 64 weights more.
    int8 (``MatMul8bitLt.backward``): ``CB.to(dtype_A, copy=True)`` reads the int8 code and
    writes ``out_bytes``, ``.mul_(SCB / 127)`` reads and writes it again: 1 + 3 ``out_bytes``."""
    if quant == "int8":
        return 1 + 3 * out_bytes
    per_block = 4 + (13 if double_quant else 0)
    return 0.5 + per_block / BLOCK_4BIT + out_bytes


def dequant_passes(quant: str, recompute: float) -> float:
    """Dequantizations of each weight per micro-batch: 4-bit in the forward, the recomputed
    forward and the backward; int8 in the backward only (its forward multiplies the int8 codes)."""
    return 1.0 if quant == "int8" else 2.0 + recompute


def dequant_bytes(model: ModelSpec, plan: Plan, layers: int, out_bytes: int, recompute: float) -> float:
    """HBM bytes of one micro-batch's dequantizations on a stage (per rank: TP splits the
    weights). ``out_bytes``: the dequantized weight's dtype (the param dtype for 4-bit, the input's
    for int8). Independent of the tokens: it weighs on small micro-batches."""
    if plan.quant == "none":
        return 0.0
    weights = layer_linear_widths(model)[2] * layers / plan.tp
    return (
        weights
        * dequant_bytes_per_weight(plan.quant, plan.double_quant, out_bytes)
        * dequant_passes(plan.quant, recompute)
    )
