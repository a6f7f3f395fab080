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
A q, k or v bias (Qwen2) is not quantized: ``quantize_linear`` copies it after its weight
(``nn.Parameter(linear.bias.detach().clone())``), the original goes with the replaced linear (its
weight, then its bias), the copy is cast to fp32 with the rest, and ``Linear4bit.forward`` turns it
into the compute dtype for good at the first call (``bias.data = bias.data.to(x.dtype)``); the
add is in ``gemm_4bit``'s output (the fallback's ``F.linear(A, B_dq, bias)``, the fused kernel's
``out.add_(bias)``), frozen: no gradient (tests/unit/test_timeline_quant_compose.py).

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

The other 4-bit bases the trainer builds, from bitsandbytes 0.50.2's source (no GPU trace): fp4
allocates as nf4 does (``get_4bit_type``: a 16-entry fp32 table either way; the same kernels,
``quant_type`` picks the table). Single quantization (``compress_statistics=False``): the fp32
absmax is the state itself (``QuantState(absmax=_absmax)``), no offset, nested state or dynamic
map; the fallback and ``dequantize_4bit`` read it as it is (no temporary). Under ``precision:
fp32`` the weights are quantized from fp32 (``quant_state.dtype``), computed in fp32: the casts
around ``MatMul4Bit`` are the input itself, the dequantized weight is fp32 (4 B an element), and
``prepare_model_for_kbit_training`` casts nothing (every other parameter is fp32 already). A
trained LM head copy (``modules_to_save``) is a 16-bit parameter: it is cast to fp32 after the
original, and trained in fp32. At most 1536 rows ``gemm_4bit`` may take the fused kernel
(``costmodel.quant.gemm_4bit_kernel``: where every CUDA GPU does, and on a GPU of known SMs and
compute capability, ``QuantConfig.gpu_arch``, wherever bitsandbytes' rule picks it,
``costmodel.gemm_4bit_rule``): it allocates its output
alone (``_gemm_4bit_kernel_impl``: ``A.contiguous()`` of the contiguous cast input, the fp32
offset's ``.to(float32)`` is itself) and calls no cuBLAS. The fallback's forward temporaries run
inside the custom op, which a CPU count does not see (bitsandbytes' CPU ``gemm_4bit`` is
``_gemm_4bit_default_impl``): they are tagged :data:`CUDA_FALLBACK` so that the comparison with
the trainer on CPU leaves them out; the backward's (``MatMul4Bit.backward`` in Python) are shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.costmodel.lora import HF_NAMES
from memplan.costmodel.quant import BLOCK_4BIT, BLOCK_NESTED, CODE_4BIT, CODE_NESTED, FUSED, CudaArch, gemm_4bit_kernel
from memplan.costmodel.timeline import ops, qkv_bias
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.specs.plan import Plan

DYNAMIC_MAP = CODE_NESTED  # create_dynamic_map(): name2qmap["dynamic"], made once, and each state2.code copy
# torch's Reduce.cuh (setReduceConfig) for a full reduction of contiguous fp32 values to one: 512
# threads a block, and a grid of SMs x 2048 / 512 blocks at most (132 SMs: H100 SXM and H200)
REDUCE_THREADS, TARGET_GRID = 512, 132 * 4
# the fallback's forward temporaries (``_dequant_linear_fallback``), inside the custom op: CUDA's only
FALLBACK_ABSMAX_DQ, FALLBACK_ABSMAX, FALLBACK_WEIGHT = "fallback_absmax_dq", "fallback_absmax", "fallback_weight_dq"
CUDA_FALLBACK = frozenset({FALLBACK_ABSMAX_DQ, FALLBACK_ABSMAX, FALLBACK_WEIGHT})


@dataclass(frozen=True)
class QuantConfig:
    """The plan's 4-bit base: bitsandbytes' compute dtype and the weights' dtype when quantized,
    in bytes (the stream is fp32), and double quantization."""

    compute: int  # bnb_4bit_compute_dtype: bf16, fp32 under precision fp32
    stored: int = 2  # quant_state.dtype: the trainer's param dtype (parallel.param_dtype)
    double_quant: bool = True  # bnb_4bit_use_double_quant (compress_statistics)
    gpu_arch: CudaArch | None = None  # the GPU's SMs and compute capability: gemm_4bit's kernel (quant.cuda_arch)


def config(plan: Plan, gpu_arch: CudaArch | None = None) -> QuantConfig | None:
    """The 4-bit base of a plan (``quant``: nf4 or fp4: the same bytes), or None; ``gpu_arch``: the GPU's."""
    if plan.quant not in ("nf4", "fp4"):
        return None
    stored = 2 if plan.precision in ("bf16", "bf16-master") else 4
    return QuantConfig(4 if plan.precision == "fp32" else 2, stored, plan.double_quant, gpu_arch)


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
    dynamic_map: bool = False  # name2qmap["dynamic"] made (the first double quantization)
    weights: dict[str, Tensor] = field(default_factory=dict)  # the model's, its q, k, v biases among them

    def build(self, weights: dict[str, Tensor], before: dict[str, Tensor] | None = None) -> list[tuple[Tensor, Tensor]]:
        """``quantize_base`` over the built ``weights`` (names in module order): quantize every
        decoder linear, free their 16-bit weights last one first, cast the rest to fp32 when
        16-bit; ``before[name]``: a frozen parameter just before ``weights[name]`` in parameter
        order (the original LM head before its trained copy). Returns the (old, new) casts."""
        t, before = self.tape, before or {}
        names = [n for n in weights if is_linear(n)]
        originals = []
        for name in names:
            self._quantize(name, weights[name].numel)
            originals.append(clone_bias(t, weights, name))
        for name, bias in zip(reversed(names), reversed(originals), strict=True):
            t.free(weights.pop(name))  # the replaced nn.Linear's parameters: its weight, then its bias
            if bias is not None:
                t.free(bias)
        self.weights = weights
        return cast_to_fp32(t, weights, before)

    def _quantize(self, name: str, n: int) -> None:
        """``Params4bit._quantize`` -> ``quantize_4bit(compress_statistics=double_quant)``: the
        CUDA kernel's absmax, then the packed codes; the code table; the nested state."""
        t, blocks = self.tape, -(-n // BLOCK_4BIT)
        with t.scoped(name.removesuffix(".weight")):
            if self.cfg.double_quant:  # the absmax goes once nested
                absmax = t.new(blocks, 4, "absmax")
            else:  # QuantState(absmax=_absmax): the fp32 absmax is the state
                absmax = t.managed(blocks, 4, "absmax", Category.PARAMETERS)
            self.packed[name] = t.managed(-(-n // 2), 1, "weight_4bit", Category.PARAMETERS)
            keep = [t.managed(CODE_4BIT, 1, "code", Category.PARAMETERS)]
            t.done(t.new(CODE_4BIT, 1, "code_abs"), t.new(1, 4, "code_max"))  # data.div_(data.abs().max())
            if not self.cfg.double_quant:
                self.state += [absmax, *keep]
                return
            keep.append(t.managed(1, 4, "offset", Category.PARAMETERS))
            staging = mean_staging(blocks)
            if staging:
                buffer = t.new(staging, 1, "mean_staging")
                t.done(t.new(1, 4, "mean_semaphore"), buffer)
            centered = t.new(blocks, 4, "absmax_centered")
            if not self.dynamic_map:  # name2qmap["dynamic"], made once per process
                keep.append(t.managed(DYNAMIC_MAP, 1, "dynamic_map", Category.PARAMETERS))
                self.dynamic_map = True
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
        self._bias_to(name, cd)
        y = self._matmul(xc, n, out_features, tag)
        out = ops.to(t, y, x.itemsize, f"{tag}.output_cast")
        t.done(y, xc)  # the call's temporary, then the rebound local x
        return out

    def _bias_to(self, weight: str, itemsize: int) -> None:
        """``Linear4bit.forward``'s ``bias.data = bias.data.to(x.dtype)`` when the (fp32) bias is
        not in the compute dtype: the parameter's data replaced for good, the old one freed. Its
        add is in the matmul's output (``F.linear(A, B_dq, bias)``, the fused kernel's
        ``out.add_(bias)``): nothing more; frozen, it has no gradient (``MatMul4Bit.backward``)."""
        name = qkv_bias.bias_name(weight)
        old = self.weights.get(name) if name is not None else None
        if old is None or old.itemsize == itemsize:
            return
        with self.tape.scoped(""):  # a parameter's name, not the call's
            self.weights[name] = self.tape.managed(old.numel, itemsize, name, Category.PARAMETERS)
        self.tape.free(old)

    def _matmul(self, x: Tensor, n: int, out_features: int, tag: str) -> Tensor:
        """``MatMul4Bit`` over ``x`` (compute dtype): ``gemm_4bit``'s path for its rows
        (:func:`gemm_4bit_kernel` on the config's GPU; support.py declines the shapes where an unknown
        GPU decides), then the output; the backward dequantizes the weight whatever the forward took."""
        t, cd, blocks, x_numel = self.tape, x.itemsize, -(-n // BLOCK_4BIT), x.numel
        nested, stored = self.cfg.double_quant, self.cfg.stored
        rows = x_numel // (n // out_features)  # M: the tokens

        def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
            # F.dequantize_4bit: nested, the absmax dequantized (+= offset in place), freed at its return
            absmax = tape.new(blocks, 4, "absmax_dq") if nested else None
            w = tape.new(n, stored, "weight_dq")  # quant_state.dtype
            tape.drop(absmax)
            if stored != g[0].itemsize:  # .to(grad_output.dtype)
                w, dequantized = tape.new(n, g[0].itemsize, "weight_cast"), w
                tape.drop(dequantized)
            dx = tape.new(x_numel, g[0].itemsize, "dX")
            if tape.on_first_mm is not None:
                tape.on_first_mm()
            tape.drop(w)
            return [dx]

        node = t.node(f"{tag}.MatMul4Bit", apply, [x])
        if gemm_4bit_kernel(rows, out_features, n // out_features, cd, self.cfg.gpu_arch) == FUSED:
            return ops.result(t, rows * out_features, cd, tag, node)  # _gemm_4bit_kernel_impl: its output
        temps = []
        if nested:  # absmax_dq (a local until the return), then its sum with the offset
            temps = [t.new(blocks, 4, f"{tag}.{FALLBACK_ABSMAX_DQ}"), t.new(blocks, 4, f"{tag}.{FALLBACK_ABSMAX}")]
        temps.append(t.new(n, cd, f"{tag}.{FALLBACK_WEIGHT}"))  # B_dq in A's dtype
        out = ops.result(t, rows * out_features, cd, tag, node)
        if t.on_first_mm is not None:
            t.on_first_mm()
        t.done(*temps[1::-1], *temps[2:])  # the frame's locals as the trace frees them: sum, absmax_dq, B_dq
        return out


def is_linear(name: str) -> bool:
    """A decoder layer's linear weight (not its bias): the ones ``quantize_base`` quantizes."""
    parts = name.split(".")  # layers.{i}.{owner}.{attr}.weight
    linear = parts[0] == "layers" and ".".join(parts[2:4]) in HF_NAMES  # every decoder linear (train.quant.LINEARS)
    return linear and parts[-1] == "weight"


def cast_to_fp32(t: Tape, weights: dict[str, Tensor], before: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """``prepare_model_for_kbit_training``'s cast (``train.quant.quantize_base``'s last loop): every
    16-bit parameter left in ``weights`` (names in ``model.parameters()`` order) to fp32, each old
    one freed as its new one comes; ``before[name]``: a frozen parameter just before
    ``weights[name]`` (the original LM head before its trained copy). A tied head is the
    embedding: one parameter, one cast. Returns the (old, new) casts."""
    casts: list[tuple[Tensor, Tensor]] = []
    for name, w in list(weights.items()):
        for p in [before[name], w] if name in before else [w]:
            if p.itemsize != 4 and not any(old is p for old, _ in casts):
                casts.append((p, t.managed(p.numel, 4, name, Category.PARAMETERS)))
                t.free(p)
        weights[name] = next((new for old, new in casts if old is w), w)
    return casts


def clone_bias(t: Tape, weights: dict[str, Tensor], weight: str) -> Tensor | None:
    """``quantize_linear``'s ``layer.bias = nn.Parameter(linear.bias.detach().clone())`` once
    ``weight`` is quantized: the copy takes the bias's place in ``weights``; returns the original
    (the replaced ``nn.Linear``'s, freed with it), or None for an unbiased linear."""
    name = qkv_bias.bias_name(weight)
    original = weights.get(name) if name is not None else None
    if original is not None:
        weights[name] = t.managed(original.numel, original.itemsize, name, Category.PARAMETERS)
    return original
