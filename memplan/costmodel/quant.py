"""Bytes of a bitsandbytes-quantized frozen base: the stored weights and their scales.

Pure formulas (no torch). Measured against bitsandbytes 0.50.2's own storage on CPU
(tests/unit/test_lora_quant.py): ``Params4bit`` and its ``QuantState``, ``Int8Params`` and its
``SCB``. transformers quantizes every ``nn.Linear`` of the decoder layers and keeps the LM head
(and the embedding, norms) unquantized; ``peft.prepare_model_for_kbit_training`` then casts
every non-quantized parameter to fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from memplan.specs.hardware import GPUSpec

BLOCK_4BIT = 64  # bitsandbytes' 4-bit blocksize (Params4bit(blocksize=None) -> 64 in 0.50)
BLOCK_NESTED = 256  # double quantization: one fp32 scale per 256 first-level absmaxes
CODE_4BIT = 16 * 4  # QuantState.code: the 16-entry NF4 / FP4 table, fp32
CODE_NESTED = 256 * 4  # state2.code: the 8-bit dynamic map of the nested absmax, fp32
OFFSET_NESTED = 4  # QuantState.offset: mean of the absmaxes subtracted before nesting, fp32 scalar
# bitsandbytes 0.50.2 backends/cuda/ops.py ``_gemm_4bit_custom_max_m``: over this many rows (tokens)
# CUDA's gemm_4bit dequantizes the weight and calls F.linear; at or under it a fused kernel may run
GEMM_4BIT_CUSTOM_MAX_M = 1536
GEMM_4BIT_CUSTOM_FLOOR_M = 4  # ``_GEMM_4BIT_CUSTOM_FLOOR_M``: at or under it the fused kernel, on every GPU
SMALL_WEIGHT = 4 * 1024 * 1024  # ``_gemm_4bit_use_custom_cuda``'s small-weight path: N x K under this
FUSED_MAX_M = 512  # its cap for other weights: over it dequantize + F.linear on every architecture
FP32_FUSED_BELOW_M = 8  # fp32 (no MMA kernel): the fused SIMT kernel only under 8 rows
DEQUANTIZE, FUSED = "dequantize", "fused"


class CudaArch(NamedTuple):
    """What ``_gpu_dispatch_props`` returns: (``multi_processor_count``, ``major``, ``minor``): what
    ``gemm_4bit_rule.use_custom_cuda`` decides by. Here, not there, so that a plan without a 4-bit
    base does not import the rule (every estimate reads its GPU's, :func:`cuda_arch`)."""

    sms: int
    major: int
    minor: int


def cuda_arch(gpu: GPUSpec | None) -> CudaArch | None:
    """What bitsandbytes reads of the GPU (``_gpu_dispatch_props``) from its profile: the SMs and
    the compute capability; None for no profile, or one without them (not CUDA: a ROCm build of
    bitsandbytes decides by the gfx architecture, ``_gemm_4bit_use_custom_rocm``, not followed)."""
    if gpu is None or gpu.compute_capability is None or gpu.sm_count is None:
        return None
    return CudaArch(gpu.sm_count, *gpu.compute_capability)


def gemm_4bit_kernel(
    tokens: int, out_features: int, in_features: int, compute_bytes: int, arch: CudaArch | None = None
) -> str | None:
    """Which path CUDA's ``bitsandbytes::gemm_4bit`` (bitsandbytes 0.50.2 ``backends/cuda/ops.py``)
    takes for ``tokens`` rows (M) of a 4-bit weight N x K in the compute dtype (2 B: bf16, the
    16-bit compute dtype memplan's plans run; 4 B: fp32) on the GPU ``arch``: :data:`DEQUANTIZE`
    (``_dequant_linear_fallback``) or :data:`FUSED` (``_gemm_4bit_kernel_impl``). Over
    ``_gemm_4bit_custom_max_m`` rows, or K not a multiple of the blocksize, the fallback; at most
    ``_GEMM_4BIT_CUSTOM_FLOOR_M`` rows the fused kernel; between, ``_gemm_4bit_use_custom_cuda``
    (``gemm_4bit_rule.use_custom_cuda``). Without ``arch`` the rule is followed as far as it holds
    on every CUDA GPU (fp32: ``dtype == torch.float32 or major < 7: return M < 8``; past the
    small-weight path the fallback over 512 rows, ``if M > 512: return False``, after the sm100 /
    sm87 / pre-sm75 exits, which all refuse it), and None where the GPU decides."""
    if tokens > GEMM_4BIT_CUSTOM_MAX_M or in_features % BLOCK_4BIT:
        return DEQUANTIZE
    if tokens <= GEMM_4BIT_CUSTOM_FLOOR_M:
        return FUSED
    if arch is not None:
        from memplan.costmodel.gemm_4bit_rule import use_custom_cuda  # the rule on a known GPU

        dtype = "fp32" if compute_bytes == 4 else "bf16"
        return FUSED if use_custom_cuda(tokens, out_features, in_features, dtype, arch) else DEQUANTIZE
    if compute_bytes == 4:
        return FUSED if tokens < FP32_FUSED_BELOW_M else DEQUANTIZE
    if out_features * in_features >= SMALL_WEIGHT and tokens > FUSED_MAX_M:
        return DEQUANTIZE
    return None


def packed_4bit_bytes(elements: int) -> int:
    """``Params4bit`` data: two 4-bit codes per uint8, ceil(n / 2) bytes (bitsandbytes
    ``quantize_4bit`` returns a (ceil(n/2), 1) uint8 tensor)."""
    return -(-elements // 2)


def absmax_4bit_bytes(elements: int, double_quant: bool) -> int:
    """The quantization state of one 4-bit weight: one absmax per 64-weight block, in fp32
    (4 B), or with double quantization (``bnb_4bit_use_double_quant``, Dettmers et al. 2023
    Sec. 3) as uint8 (1 B) plus, per 256 of those, an fp32 second-level scale, the nested
    state's 256-entry fp32 code and the fp32 offset; and the 16-entry fp32 NF4/FP4 code.
    Measured on bitsandbytes 0.50.2 (``QuantState.absmax``, ``.code``, ``.state2``)."""
    blocks = -(-elements // BLOCK_4BIT)
    if not double_quant:
        return 4 * blocks + CODE_4BIT
    return blocks + 4 * -(-blocks // BLOCK_NESTED) + CODE_NESTED + OFFSET_NESTED + CODE_4BIT


def weight_4bit_bytes(out_features: int, in_features: int, double_quant: bool) -> int:
    """One ``Linear4bit`` weight, packed codes and quantization state."""
    n = out_features * in_features
    return packed_4bit_bytes(n) + absmax_4bit_bytes(n, double_quant)


def weight_int8_bytes(out_features: int, in_features: int) -> int:
    """One LLM.int8 ``Linear8bitLt`` weight (Dettmers et al. 2022): an int8 per weight and
    one fp32 absmax scale per output row. Measured on bitsandbytes 0.50.2 on CPU
    (tests/unit/test_lora_quant.py): ``Int8Params._quantize`` keeps ``CB`` as the parameter's own
    data (one storage) and ``SCB`` beside it, moved to ``MatmulLtState.CB`` / ``.SCB`` by the
    first forward (``init_8bit_state``); no fp16 or fp32 copy of the weight stays. The
    matmul's own tensors are activations, not states (``memory.int8_layer_inputs``): in
    training ``MatMul8bitFp`` (CPU) keeps its input as ``ctx.A`` and dequantizes the weight
    to an fp32 transient (``dequantized_weight_bytes``) in the forward and the input-gradient;
    with a frozen weight no ``CAt`` / ``SCAt`` / outlier ``subA`` (threshold 6.0) is kept."""
    return out_features * in_features + 4 * out_features


def quantized_weight_bytes(out_features: int, in_features: int, quant: str, double_quant: bool = False) -> int:
    """Stored bytes of one quantized linear weight: ``quant`` is int8, nf4 or fp4."""
    if quant == "int8":
        return weight_int8_bytes(out_features, in_features)
    if quant in ("nf4", "fp4"):
        return weight_4bit_bytes(out_features, in_features, double_quant)
    raise ValueError(f"unknown quantization {quant!r}")


def dequantized_weight_bytes(out_features: int, in_features: int, compute_bytes: int) -> int:
    """The transient a 4-bit matmul makes in its forward and again in its backward:
    ``dequantize_4bit`` rebuilds the whole weight in the compute dtype (bitsandbytes
    ``MatMul4Bit``; freed when the matmul returns). LLM.int8 in training does the same in the
    input's dtype (``MatMul8bitFp``: ``CB.to(A.dtype) * SCB / 127``)."""
    return out_features * in_features * compute_bytes
