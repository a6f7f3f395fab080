"""bitsandbytes 4-bit bases (nf4 / fp4, double quantization; bitsandbytes 0.50) in the Trainer's op-level run.

``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` replaces each
decoder-layer linear by ``bnb.nn.Linear4bit`` (``lm_head`` and the embedding stay as they are): its
weight is ``Params4bit``, two 4-bit codes per byte, with a ``QuantState`` beside it (per 64-element
block an fp32 ``absmax``, and the 16-entry fp32 ``code``; with double quantization the absmax is
uint8, with an fp32 absmax per 256 of them, a 256-entry fp32 ``code`` and an fp32 ``offset``).
``prepare_model_for_kbit_training`` freezes everything and casts the other 16-bit parameters to fp32.

``Linear4bit.forward`` (``bitsandbytes/nn/modules.py``): ``x.to(compute_dtype)``, then
``MatMul4Bit`` (``autograd/_functions.py``), whose forward calls ``bitsandbytes::gemm_4bit`` under no
grad and saves no activation; the result is cast back to the input's dtype. ``gemm_4bit``:

- CPU (``backends/default/ops.py: _gemm_4bit_default_impl``): with double quantization the
  dequantized absmax (fp32) plus the offset, the dequantized weight in the compute dtype, ``F.linear``;
  these run inside the custom op, below a dispatch-level count, which sees the output alone;
- CUDA, where ``_gemm_4bit_use_custom_cuda`` refuses the fused kernel (always over 1536 tokens; up to
  it by the weight's shape and the GPU's SMs and compute capability: ``costmodel.quant.gemm_4bit_kernel``,
  ``gemm_4bit_rule``), ``_dequant_linear_fallback`` (``backends/cuda/ops.py`` l. 904-917, from the source,
  not checked on a GPU): the dequantized absmax kept as a local beside its sum with the offset, the
  dequantized weight, ``F.linear``;
- CUDA's fused kernel (``_gemm_4bit_kernel_impl``, l. 846-901): its output alone (``A.contiguous()`` of
  the contiguous cast input and the fp32 offset's ``.to(float32)`` are the tensors themselves; the
  kernel, called through ctypes with data pointers, takes no memory of PyTorch's allocator).

``MatMul4Bit.backward``: ``matmul(grad, F.dequantize_4bit(W, state).to(grad.dtype))``: with double
quantization the absmax dequantized first (fp32, offset added in place), the weight dequantized in the
dtype it was loaded in (``quant_state.dtype``), cast to the gradient's dtype when they differ, then
the input's gradient. Checked on CPU against the real Trainer (tests/unit/test_timeline_hf_peft.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from memplan.costmodel.quant import FUSED, CudaArch, gemm_4bit_kernel
from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.int8 import OUTLIER_COLUMNS, Int8
from memplan.costmodel.timeline.int8_outliers import RandomInit

BLOCK = 64  # bnb_4bit's blocksize (transformers' BitsAndBytesConfig: 64)
NESTED_BLOCK = 256  # double quantization's blocksize for the absmax (bitsandbytes.functional.quantize_4bit)
CODE_4BIT = 16  # entries of the nf4 / fp4 code (fp32)
CODE_8BIT = 256  # entries of the dynamic map of the nested absmax (fp32)


@dataclass(frozen=True)
class Bnb4bit:
    """A 4-bit base: double quantization, the compute dtype's bytes and the dtype it was loaded in."""

    double_quant: bool
    compute: int  # bnb_4bit_compute_dtype: 2 (bf16) or 4 (fp32)
    stored: int = 4  # quant_state.dtype: the weights' dtype when quantized (from_pretrained's dtype)
    gpu_arch: CudaArch | None = None  # the GPU's SMs and compute capability: gemm_4bit's kernel on CUDA
    quant_type: str = "nf4"  # bnb_4bit_quant_type
    storage: int = 1  # bnb_4bit_quant_storage's bytes: uint8, or the model's float dtype under FSDP (hf_fsdp_qlora.py)
    clones: ClassVar[bool] = True  # PEFT's lora.Linear4bit clones the base's result

    @classmethod
    def of(cls, plan, gpu_arch: CudaArch | None = None) -> Bnb4bit | None:
        """A plan's 4-bit base (``quant: nf4 | fp4``), loaded in its compute dtype (``precision``: fp32,
        or bf16 with or without ``bf16=True``, the usual QLoRA recipe), or None; ``gpu_arch``: the GPU's."""
        if plan.quant not in ("nf4", "fp4"):
            return None
        compute = 4 if plan.precision == "fp32" else 2
        storage = compute if plan.dp > 1 and plan.zero >= 2 else 1  # the FSDP recipe stores as the model's dtype
        kind = dict(quant_type=plan.quant, storage=storage)
        return cls(plan.double_quant, compute, stored=compute, gpu_arch=gpu_arch, **kind)

    @staticmethod
    def quantized(name: str) -> bool:
        """A decoder layer's ``nn.Linear`` (``model.layers.{i}.{self_attn|mlp}.{proj}``), the ones
        ``integrations/bitsandbytes.replace_with_bnb_linear`` replaces: MLA's ``kv_a_proj_with_mqa`` too, and
        over an MoE base Qwen2-MoE's ``shared_expert_gate`` (an ``nn.Linear(h, 1)``); never the router
        (``*TopkRouter``, a module of its own whose weight stays in the loaded dtype) nor the experts' 3-D
        ``gate_up_proj`` / ``down_proj`` parameters (no ``nn.Linear``: loaded, then cast to fp32 by
        ``prepare_model_for_kbit_training``, as the norms). Checked on tiny Mixtral, Qwen3-MoE, Qwen2-MoE and
        DeepSeek-V2 / V3 (tests/unit/test_timeline_hf_quant_moe.py)."""
        linear = name.endswith(("_proj", ".kv_a_proj_with_mqa", ".shared_expert_gate"))
        return name.startswith("model.layers.") and linear and ".experts." not in name

    def build(self, tape: Tape, name: str, rows: int, cols: int) -> Tensor:
        """The packed weight, then its quantization state (``quant_state_tensors`` order)."""
        numel = rows * cols
        w = tape.managed(numel // 2, 1, name, Category.PARAMETERS)
        blocks = -(-numel // BLOCK)
        if self.double_quant:
            state = [(blocks, 1), (CODE_4BIT, 4), (1, 4), (-(-blocks // NESTED_BLOCK), 4), (CODE_8BIT, 4)]
        else:
            state = [(blocks, 4), (CODE_4BIT, 4)]
        for i, (n, itemsize) in enumerate(state):
            tape.managed(n, itemsize, f"{name}.quant_state{i}", Category.PARAMETERS)
        return w

    def linear(self, model, x: Tensor, name: str, out_features: int, tag: str) -> Tensor:
        """``Linear4bit.forward``: the compute-dtype cast, ``MatMul4Bit``, the cast back."""
        t, d = model.tape, model.d
        rows, cols = out_features, x.numel // d.tokens
        xc = ops.to(t, x, self.compute, f"{tag}.compute_cast")
        out = self._matmul(t, xc, rows, cols, d.tokens, model.cpu, tag)
        y = ops.to(t, out, x.itemsize, f"{tag}.out_cast")
        t.done(out, xc)  # the temporary, then the frame's cast input
        return y

    def _matmul(self, t: Tape, x: Tensor, rows: int, cols: int, tokens: int, cpu: bool, tag: str) -> Tensor:
        """``MatMul4Bit.apply``: ``gemm_4bit``'s temporaries, its output; the backward's dequantization."""
        numel, stored, nested = rows * cols, self.stored, self.double_quant

        def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
            absmax = tape.new(-(-numel // BLOCK), 4, "absmax_dequant") if nested else None
            w = tape.new(numel, stored, "weight_dequant")
            tape.drop(absmax)
            if stored != g[0].itemsize:
                w, old = tape.new(numel, g[0].itemsize, "weight_cast"), w
                tape.drop(old)
            dx = tape.new(tokens * cols, g[0].itemsize, "dX")
            tape.drop(w)
            return [dx]

        node = t.node(tag, apply, [x])
        if not cpu:
            path = gemm_4bit_kernel(tokens, rows, cols, x.itemsize, self.gpu_arch)
            if path is None:
                raise ValueError(f"{tokens} tokens: CUDA's gemm_4bit picks its kernel by the GPU, not given")
            if path == FUSED:  # _gemm_4bit_kernel_impl: its output alone
                return ops.result(t, tokens * rows, x.itemsize, tag, node)
        blocks = -(-numel // BLOCK)
        temps = []
        if nested:
            raw = t.new(blocks, 4, f"{tag}.absmax_dequant")
            temps.append(t.new(blocks, 4, f"{tag}.absmax"))
            if cpu:
                t.done(raw)  # a temporary of the sum
            else:
                temps.append(raw)  # absmax_dq stays a local until the fallback returns
        temps.append(t.new(numel, x.itemsize, f"{tag}.weight_dequant"))
        out = ops.result(t, tokens * rows, x.itemsize, tag, node)
        t.done(*reversed(temps))
        return out


@dataclass
class Bnb8bit:
    """An LLM.int8 base (``BitsAndBytesConfig(load_in_8bit=True)``: ``Linear8bitLt(has_fp16_weights=False,
    threshold=6.0)`` in every decoder-layer linear), its matmuls ``int8.py``'s on the run's tape.

    ``prepare_model_for_kbit_training`` casts every other parameter to fp32, so the stream is fp32 and
    ``Linear8bitLt.forward`` takes it as is. Each weight: ``CB`` (int8, the parameter's storage) and
    ``SCB`` (fp32 per output row; ``quant_state_tensors``). PEFT's ``lora.bnb.Linear8bitLt.forward``
    is ``lora.Linear4bit``'s without the clone. The load's fp16 copy per weight (CUDA) is
    ``hf_build.quantize_8bit``'s (``model_build: from_pretrained``); the CPU count starts once the model is built."""

    # per linear call, CUDA's MatMul8bitLt: none over a trained checkpoint; a random one's (the model's
    # ``random_init``) down projections keep thousands: int8_outliers.RandomInit, tests/unit/test_timeline_int8_cuda.py
    outliers: int | RandomInit = OUTLIER_COLUMNS
    int8: Int8 | None = field(default=None, repr=False)  # the run's linears, made on its tape
    stored: int = 4  # the dtype from_pretrained loaded it in: what Gemma's embed_scale keeps (hf_gemma.py)
    clones: ClassVar[bool] = False

    @classmethod
    def of(cls, plan, model=None) -> Bnb8bit | None:
        """A plan's int8 base (``quant: int8``), loaded in fp32 or bf16 as ``precision`` says, or None;
        its outlier columns :class:`RandomInit`'s where ``model``'s checkpoint is random (``random_init``)."""
        if plan.quant != "int8":
            return None
        stored = 4 if plan.precision == "fp32" else 2
        if model is None or model.random_init is None:
            return cls(stored=stored)
        return cls(outliers=RandomInit(model.hidden_size, model.random_init), stored=stored)

    quantized = staticmethod(Bnb4bit.quantized)

    def build(self, tape: Tape, name: str, rows: int, cols: int) -> Tensor:
        """``CB`` (rows x cols int8), then ``SCB``."""
        cb = tape.managed(rows * cols, 1, name, Category.PARAMETERS)
        self.adopt(tape, name, cb, tape.managed(rows, 4, f"{name}.SCB", Category.PARAMETERS), rows)
        return cb

    def adopt(self, tape: Tape, name: str, cb: Tensor, scb: Tensor, rows: int) -> None:
        """A quantized weight's ``CB`` and ``SCB`` (``rows`` outputs) as the run's linear ``name``'s."""
        if self.int8 is None:
            self.int8 = Int8(tape, outliers=self.outliers)
        self.int8.state.append(scb)
        self.int8.weights[name.removesuffix(".weight")] = (cb, rows)

    def linear(self, model, x: Tensor, name: str, out_features: int, tag: str) -> Tensor:
        """``Linear8bitLt.forward``: ``MatMul8bitFp`` on CPU (under ``bf16=True`` its ``F.linear``
        in bf16), ``MatMul8bitLt`` on CUDA."""
        assert self.int8 is not None
        self.int8.cuda = not model.cpu
        autocast = model.cpu and model.cache is not None
        out = self.int8.linear(x, name, out_features, tag, autocast=autocast, input_cast=model.input_cast)
        assert out is not None
        return out

    def free_graph(self) -> None:
        """``training_step`` returns: the graph goes, each int8 linear's ``ctx.A`` with it."""
        if self.int8 is not None:
            self.int8.free_graph()
