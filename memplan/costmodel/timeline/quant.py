"""A bitsandbytes 4-bit base (``memplan/train/quant.py``, QLoRA) as ops on the byte-level tape.

The build (``quant.quantize_base``, bitsandbytes 0.50.2 ``functional.quantize_4bit``): once the
bf16 base and the adapters exist, each decoder linear in module order (wq, wk, wv, wo, w1, w2,
w3, layer by layer) is quantized by moving a ``Params4bit`` to the device. For n weights in
blocks of 64: the fp32 absmax (n/64), the packed codes (n/2, uint8, kept), the 16-entry code
(``get_4bit_type``: 64 B kept, its ``abs()`` and ``max()`` freed), and under double quantization
the offset (``absmax.mean()``: 4 B kept, with the reduction's staging buffer and semaphore when it
splits across blocks, :func:`mean_staging`), ``absmax - offset`` (freed), bitsandbytes' dynamic
map (1 KiB, the first time only), the nested fp32 absmax (one per 256 blocks), the uint8 absmax
and the nested code's copy (1 KiB), all kept; then ``del _absmax``. The bf16 weights go only once
the loop ends (``list(model.modules())`` holds the replaced ``nn.Linear``s; the list is released
last item first), then ``prepare_model_for_kbit_training``'s cast puts every other parameter
(embedding, norms, head) in fp32, in parameter order, each bf16 copy freed as its fp32 one comes:
the residual stream, q, k, v and the logits are fp32 (``support.sdpa_kernel``: the math path).

Each 4-bit linear (``Linear4bit.forward``): ``x.to(bf16)``, ``MatMul4Bit`` and ``.to(fp32)``.
Over ``_gemm_4bit_custom_max_m`` (1536) rows ``gemm_4bit`` is ``_dequant_linear_fallback``
(``backends/cuda/ops.py``): the nested absmax dequantized (fp32, n/64), plus the offset (out of
place), the bf16 weight (n x 2), ``F.linear``; at the return the sum, the dequantized absmax and
the weight go. ``MatMul4Bit`` keeps only the packed weight (``ctx.tensors = (None, B)``); its
backward (``F.dequantize_4bit``: the absmax dequantized, ``+= offset`` in place, freed at its
return; the bf16 weight) then ``grad_A = matmul(grad_output, W)`` and W goes.

Trace evidence (h200_a_qlora8b, llama3-8b nf4 + double quant, r16 all-linear, b 4 x s 4096):
wq's quantization 1014-1034 (1,048,576 absmax, 8,388,608 packed, 64 / 64 / 4, 4 / 128 / 4,
1,048,576, 1,024, 4,096, 262,144, 1,024, then the two absmaxes freed); the bf16 weights freed
from 4972 (layer 31's w3, w2, w1, wo, wv, wk, wq, ...); the fp32 embedding 5197 (2,101,346,304);
layer 0's wq forward 5367-5378 (134,217,728 input cast, 1,048,576 twice, 33,554,432 weight,
134,217,728 output, cuBLAS's 32 MiB, the three temporaries freed, 268,435,456 output cast), then
PEFT's clone (5379).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.costmodel.lora import HF_NAMES
from memplan.costmodel.quant import BLOCK_4BIT, BLOCK_NESTED, CODE_4BIT, CODE_NESTED
from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.specs.plan import Plan

DYNAMIC_MAP = CODE_NESTED  # create_dynamic_map(): name2qmap["dynamic"], made once, and each state2.code copy
# torch's Reduce.cuh (setReduceConfig) for a full reduction of contiguous fp32 values to one: 512
# threads a block, and a grid of SMs x 2048 / 512 blocks at most (132 SMs: H100 SXM and H200)
REDUCE_THREADS, TARGET_GRID = 512, 132 * 4


@dataclass(frozen=True)
class QuantConfig:
    """The plan's 4-bit base: bitsandbytes' compute dtype, in bytes (the stream is fp32)."""

    compute: int  # bnb_4bit_compute_dtype: bf16, fp32 under precision fp32


def config(plan: Plan) -> QuantConfig | None:
    """The 4-bit base of a plan (``quant``: nf4 or fp4), or None."""
    if plan.quant not in ("nf4", "fp4"):
        return None
    return QuantConfig(4 if plan.precision == "fp32" else 2)


def mean_staging(numel: int) -> int:
    """Bytes of the staging buffer ``absmax.mean()`` allocates (0: none), its semaphore apart.
    ``setReduceConfig``: each of 512 threads gets ``v = ceil(numel / 512)`` values; from 256 on
    the input splits over ``max(min(TARGET_GRID, ceil(v / 16)), ceil(v / 256))`` blocks, each
    leaving a 4 B partial. Trace h200_a_qlora8b: 65,536 values none, 262,144 128 B, 917,504 448 B."""
    v = -(-numel // REDUCE_THREADS)
    if v < 256:
        return 0
    return 4 * max(min(TARGET_GRID, -(-v // 16)), -(-v // 256))


@dataclass
class Quant:
    """The 4-bit linears on a tape: their packed weights and the ops of their forward."""

    tape: Tape
    cfg: QuantConfig
    packed: dict[str, Tensor] = field(default_factory=dict)  # weight name -> packed codes
    state: list[Tensor] = field(default_factory=list)  # QuantState tensors (kept for the run)

    def build(self, weights: dict[str, Tensor]) -> None:
        """``quantize_base`` over the built bf16 ``weights`` (names in module order): quantize
        every decoder linear, free their bf16 weights last one first, cast the rest to fp32."""
        t = self.tape
        names = [n for n in weights if _is_linear(n)]
        for name in names:
            self._quantize(name, weights[name].numel)
        for name in reversed(names):
            t.free(weights.pop(name))
        cast: dict[int, Tensor] = {}  # a tied head is the embedding: one parameter, one cast
        for name, w in list(weights.items()):  # prepare_model_for_kbit_training's fp32 cast
            if id(w) not in cast:
                cast[id(w)] = t.managed(w.numel, 4, name, Category.PARAMETERS)
                t.free(w)
            weights[name] = cast[id(w)]

    def _quantize(self, name: str, n: int) -> None:
        """``Params4bit._quantize`` -> ``quantize_4bit(compress_statistics=True)``."""
        t, blocks = self.tape, -(-n // BLOCK_4BIT)
        with t.scoped(name.removesuffix(".weight")):
            absmax = t.new(blocks, 4, "absmax")
            self.packed[name] = t.managed(-(-n // 2), 1, "weight_4bit", Category.PARAMETERS)
            keep = [t.managed(CODE_4BIT, 1, "code", Category.PARAMETERS)]
            t.done(t.new(CODE_4BIT, 1, "code_abs"), t.new(1, 4, "code_max"))  # data.div_(data.abs().max())
            keep.append(t.managed(1, 4, "offset", Category.PARAMETERS))
            staging = mean_staging(blocks)
            if staging:
                buffer = t.new(staging, 1, "mean_staging")
                t.done(t.new(1, 4, "mean_semaphore"), buffer)
            centered = t.new(blocks, 4, "absmax_centered")
            if not self.state:  # name2qmap["dynamic"], made once per process
                keep.append(t.managed(DYNAMIC_MAP, 1, "dynamic_map", Category.PARAMETERS))
            keep.append(t.managed(-(-blocks // BLOCK_NESTED), 4, "nested_absmax", Category.PARAMETERS))
            keep.append(t.managed(blocks, 1, "absmax_8bit", Category.PARAMETERS))
            keep.append(t.managed(DYNAMIC_MAP, 1, "nested_code", Category.PARAMETERS))
            t.done(centered, absmax)
        self.state += keep

    def linear(self, x: Tensor, name: str, out_features: int, tag: str) -> Tensor | None:
        """``Linear4bit.forward`` on ``x``; None when ``name`` is not a 4-bit weight."""
        packed = self.packed.get(name)
        if packed is None:
            return None
        t, cd = self.tape, self.cfg.compute
        n = packed.numel * 2
        xc = ops.to(t, x, cd, f"{tag}.input_cast")
        y = self._matmul(xc, n, x.numel // (n // out_features) * out_features, tag)
        out = ops.to(t, y, x.itemsize, f"{tag}.output_cast")
        t.done(y, xc)  # the call's temporary, then the rebound local x
        return out

    def _matmul(self, x: Tensor, n: int, out_numel: int, tag: str) -> Tensor:
        """``MatMul4Bit`` over ``x`` (compute dtype) of more than ``GEMM_4BIT_CUSTOM_MAX_M`` rows
        (``costmodel.quant``; support.py declines fewer)."""
        t, cd, blocks, x_numel = self.tape, x.itemsize, -(-n // BLOCK_4BIT), x.numel

        def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
            absmax = tape.new(blocks, 4, "absmax_dq")  # dequantize_blockwise, += offset in place
            w = tape.new(n, cd, "weight_dq")
            tape.drop(absmax)  # dequantize_4bit returns
            dx = tape.new(x_numel, cd, "dX")
            if tape.on_first_mm is not None:
                tape.on_first_mm()
            tape.drop(w)
            return [dx]

        absmax_dq, absmax = t.new(blocks, 4, f"{tag}.absmax_dq"), t.new(blocks, 4, f"{tag}.absmax")
        w = t.new(n, cd, f"{tag}.weight_dq")
        out = ops.result(t, out_numel, cd, tag, t.node(f"{tag}.MatMul4Bit", apply, [x]))
        if t.on_first_mm is not None:
            t.on_first_mm()
        t.done(absmax, absmax_dq, w)  # the fallback's frame: its locals in order
        return out


def _is_linear(name: str) -> bool:
    parts = name.split(".")  # layers.{i}.{owner}.{attr}.weight
    return parts[0] == "layers" and ".".join(parts[2:4]) in HF_NAMES  # every decoder linear (train.quant.LINEARS)
