"""LoRA adapters over a frozen base (``memplan/train/lora.py``) as ops on the byte-level tape.

What the bundled trainer does (``lora.apply_lora`` / ``init_adapters``, PEFT ``lora.Linear``):
every base parameter is frozen (``requires_grad_(False)``): no ``AccumulateGrad``, no gradient,
no optimizer state, and a frozen matmul keeps no input for a weight gradient
(``ops.linear``). Each targeted linear of each layer becomes a ``LoraLinear``: ``lora_A``
(r x in) and ``lora_B`` (out x r), fp32 whatever the base, made after the base weight by
``to_empty`` (``Module._apply`` visits children first). Its forward::

    out = self.base(x)                       # (b, s, out) in the base dtype
    a = x.to(fp32)                           # (b, s, in): a cast per adapter, not shared
    delta = F.linear(F.linear(a, A), B) * s  # (b, s, r) then (b, s, out) fp32, then the scaling
    return (out + delta).to(out.dtype)       # fp32 sum, cast back

Under full recompute ``enable_input_require_grads`` makes the frozen embedding's output a
leaf that requires grad: its ``AccumulateGrad`` holds it and its ``.grad`` until ``del loss``
frees the graph. The optimizer (foreach AdamW) steps the adapters only, in
``model.parameters()`` order (A, then B, per linear).

Trace evidence (h200_a_lora8b, llama3-8b r16 all-linear, b 4 x s 4096): the build allocates
per linear the bf16 base, then A, then B (e.g. 33,554,432 / 262,144 / 262,144 for wq); the
forward of wq allocates the base output 134,217,728, the fp32 input 268,435,456, A's output
1,048,576, B's output 268,435,456, the scaled one, the sum, its bf16 cast 134,217,728; the
end of the backward frees 4 B (the loss), two 134,217,728 (the embedding output and its
grad), 4 B; the first optimizer step allocates 2 x 262,144 per 4096 x 16 adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.costmodel.lora import ADAPTER_BYTES, HF_NAMES, resolve_targets
from memplan.costmodel.quant import CudaArch
from memplan.costmodel.timeline import ops, qkv_bias
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.ddp import Ddp
from memplan.costmodel.timeline.dropout import dropout
from memplan.costmodel.timeline.events import Builder, Category
from memplan.costmodel.timeline.quant import QuantConfig
from memplan.costmodel.timeline.quant import config as quant_config
from memplan.costmodel.timeline.quant import is_linear as _is_4bit
from memplan.costmodel.timeline.trainer_model import Dims, Model
from memplan.specs.plan import Plan


@dataclass(frozen=True)
class LoraConfig:
    """The adapters a plan asks for: rank, and the trainer's module names they wrap."""

    rank: int
    modules: frozenset[str]
    input_grad: bool  # full recompute: the embedding's output requires grad (enable_input_require_grads)
    quant: QuantConfig | None = None  # a 4-bit base (quant.py): PEFT's lora.Linear4bit clones its output
    save_head: bool = False  # modules_to_save: lm_head (a trained copy of the LM head)
    dropout: bool = False  # lora_dropout > 0: nn.Dropout over the adapters' fp32 input (dropout.py)
    cuda: bool = True  # dropout's kernel: CUDA's fused one, else CPU's composite
    int8: bool = False  # an LLM.int8 base (int8.py): MatMul8bitLt on CUDA, MatMul8bitFp on CPU


def config(plan: Plan, cuda: bool = True, gpu_arch: CudaArch | None = None) -> LoraConfig | None:
    """The plan's adapters (``finetune: lora``), or None for full training; ``cuda``: the device
    whose kernels run (dropout's differ); ``gpu_arch``: the GPU's (a 4-bit base's kernel)."""
    if plan.finetune == "full":
        return None
    chosen = set(resolve_targets(plan.lora_targets))
    modules = frozenset(path for path, hf in HF_NAMES.items() if hf in chosen)
    input_grad, save_head = plan.recompute == "full", "lm_head" in plan.modules_to_save
    quant, dropout = quant_config(plan, gpu_arch), plan.lora_dropout > 0
    return LoraConfig(plan.lora_rank, modules, input_grad, quant, save_head, dropout, cuda, plan.quant == "int8")


def trained_params(cfg: LoraConfig, d: Dims, shapes: dict[str, tuple[int, int]]) -> list[tuple[str, int]]:
    """(name, elements) of what the trainer's optimizer steps (``lora.trainable``: the parameters
    that require grad, in ``model.parameters()`` order), without a run: :meth:`Lora.build` over the
    base's ``shapes`` on a scratch tape. Under ZeRO-1 ``ZeroRedundancyOptimizer`` partitions this
    list, not the base (``trainer.followed_rank``)."""
    tape = Tape(Builder())
    lora = Lora(tape, cfg, d.tokens, Model(tape, d, {}))
    for name, (rows, cols) in shapes.items():
        lora.build(tape.new(rows * cols, d.pd, name), name, rows, cols)
    return lora.params()


@dataclass
class Lora:
    """The adapters on a tape: their parameters (with ``AccumulateGrad`` leaves), their ops."""

    tape: Tape
    cfg: LoraConfig
    tokens: int
    model: Model | None = None  # the adapters' matmuls go through its ``linear`` (autocast's casts)
    adapters: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # base weight -> (A, B)
    trained: list[tuple[str, Tensor]] = field(default_factory=list)  # model.parameters() order
    grads: dict[str, Tensor] = field(default_factory=dict)
    held: list[Tensor] = field(default_factory=list)  # what the graph keeps until ``del loss``
    pending: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # bias -> its weight's adapters
    originals: dict[str, Tensor] = field(default_factory=dict)  # a trained copy's name -> its frozen original

    def _targeted(self, weight: str) -> bool:
        parts = weight.split(".")  # layers.{i}.{owner}.{attr}.weight
        return parts[0] == "layers" and parts[-1] == "weight" and ".".join(parts[2:4]) in self.cfg.modules

    def build(self, base: Tensor, weight: str, rows: int, cols: int) -> Tensor:
        """``to_empty`` after the base weight (and its bias: ``qkv_bias.py``), for a base of out
        ``rows`` x in ``cols``: A (r x in), B (out x r); after the LM head's, under
        ``modules_to_save``, its trained copy (``SavedModule``: the frozen original, then the copy,
        in the base's dtype). Returns what the forward reads."""
        if weight == "output.weight" and self.cfg.save_head:
            self.originals[weight] = base
            return self._param("output.trained.weight", rows * cols, base.itemsize)
        if weight in self.pending:  # a biased base (qkv_bias.py): its adapters after its bias
            self._adapters(*self.pending.pop(weight))
        elif self._targeted(weight):
            bias = qkv_bias.bias_name(weight) if self.model is not None and self.model.d.qkv_bias else None
            if bias is None:
                self._adapters(weight, rows, cols)
            else:
                self.pending[bias] = (weight, rows, cols)
        return base

    def _adapters(self, weight: str, rows: int, cols: int) -> None:
        r, prefix = self.cfg.rank, weight.removesuffix(".weight")
        a = self._param(f"{prefix}.lora_A", r * cols, ADAPTER_BYTES)
        self.adapters[weight] = (a, self._param(f"{prefix}.lora_B", rows * r, ADAPTER_BYTES))

    def _param(self, name: str, numel: int, itemsize: int) -> Tensor:
        p = self.tape.managed(numel, itemsize, name, Category.PARAMETERS)
        p.fn = ops.leaf(self.grads, name)
        self.trained.append((name, p))
        return p

    def retarget(self, casts: list[tuple[Tensor, Tensor]]) -> None:
        """A 4-bit base's fp32 cast (``quant.Quant.build``) of a trained 16-bit parameter (the head
        copy): the optimizer, the reducer and the gradient see the fp32 one, a leaf as it was."""
        for i, (name, p) in enumerate(self.trained):
            new = next((new for old, new in casts if old is p), None)
            if new is not None:
                new.fn, self.trained[i] = p.fn, (name, new)

    def params(self) -> list[tuple[str, int]]:
        """(name, elements) of the trainable parameters in ``model.parameters()`` order."""
        return [(name, p.numel) for name, p in self.trained]

    def fp32(self) -> frozenset[str]:
        """The trainable parameters already fp32 (the adapters): MasterAdamW's own masters."""
        return frozenset(name for name, p in self.trained if p.itemsize == ADAPTER_BYTES)

    def itemsize(self, name: str) -> int:
        """A trainable parameter's bytes per element: 4 (an adapter), the base's (a head copy)."""
        return dict(self.trained)[name].itemsize

    def ddp(self, dp: int, shapes: dict[str, tuple[int, int]], itemsize: int) -> Ddp:
        """``DistributedDataParallel`` over the adapted model: the reducer over the adapters (the
        parameters that require grad, ``_build_params_for_reducer``), the broadcast over every
        parameter (``_sync_module_states``: ``named_parameters()``, the frozen base included)."""
        trained = dict(self.trained)
        reducer = {name: (p.numel, 1) for name, p in trained.items()}
        itemsizes = {name: p.itemsize for name, p in trained.items()}  # a 16-bit head copy: its own bucket
        return Ddp(self.tape, dp, reducer, trained, ADAPTER_BYTES, self._states(shapes, itemsize), itemsizes)

    def _states(self, shapes: dict[str, tuple[int, int]], itemsize: int) -> list[tuple[int, int]]:
        """(bytes, itemsize) of every parameter in ``named_parameters()`` order (``named_modules``
        is pre-order: a ``LoraLinear``'s adapters before its base's weight; the head's copy after
        the original); ``shapes``: the base's, of dtype ``itemsize``. Over a 4-bit base a decoder
        linear is its packed uint8 codes (``Params4bit``), over an int8 one its int8 ``CB``
        (``Int8Params``: n bytes, ``SCB`` is no parameter), the rest fp32, the copy too."""
        out, quantized = [], self.cfg.quant is not None or self.cfg.int8
        for name, (rows, cols) in shapes.items():
            out += [(p.numel * p.itemsize, p.itemsize) for p in self.adapters.get(name, ())]
            n, size = rows * cols, 4 if quantized else itemsize
            if quantized and _is_4bit(name):  # a quantized decoder linear (quant.is_linear)
                out.append((-(-n // 2) if self.cfg.quant is not None else n, 1))
            else:
                out.append((n * size, size))
            if name == "output.weight" and self.cfg.save_head:
                out.append((n * size, size))
        return out

    def adapt(self, x: Tensor, out: Tensor, weight: str) -> Tensor:
        """``LoraLinear.forward`` after ``self.base(x)`` returned ``out`` (over a 4-bit base
        cloned first); ``out`` itself when the linear is not targeted. The frame's locals (out,
        a, delta) go at the return."""
        pair = self.adapters.get(weight)
        if pair is None:
            return out
        t, (a_w, b_w), prefix = self.tape, pair, weight.removesuffix(".weight")
        rows = b_w.numel // self.cfg.rank
        with t.scoped(f"{prefix}.lora"):
            if self.cfg.quant is not None:  # ``result = result.clone()``: CloneBackward passes the gradient
                c = ops.unary(t, out, "base_clone", temps=-1)
                t.done(out)
                out = c
            a = ops.to(t, x, ADAPTER_BYTES, "input_fp32")
            if self.cfg.dropout:  # ``self.dropout(x.to(fp32))``: the cast is the call's temporary
                cast, a = a, dropout(t, a, self.cfg.cuda)
                t.done(cast)
            ya = self._mm(a, a_w, f"{prefix}.lora_A", self.cfg.rank, "A")
            yb = self._mm(ya, b_w, f"{prefix}.lora_B", rows, "B")
            t.done(ya)
            delta = ops.unary(t, yb, "scaling")  # * alpha / r: a Python scalar, nothing saved
            t.done(yb)
            total = ops.add(t, out, delta, "sum")  # promoted to fp32 (bf16 + bf16 under autocast)
            y = ops.to(t, total, out.itemsize, "out_cast")
            t.done(total)
            t.done(out, a, delta)
        return y

    def _mm(self, x: Tensor, w: Tensor, name: str, out_features: int, tag: str) -> Tensor:
        """``F.linear(x, w)``; under autocast (bf16-mixed) as the model's (``Model.linear``): the
        fp32 adapter's bf16 cast, cached for the forward, then the input's cast, a bf16 output."""
        t, m = self.tape, self.model
        if m is None or m.cache is None:
            return ops.linear(t, x, w, self.tokens * out_features, tag)
        wc = m.weight(name, w)
        xin = ops.to(t, x, 2, f"{tag}.input_cast")
        y = ops.linear(t, xin, wc, self.tokens * out_features, tag)
        t.done(xin, wc)
        return y

    def require_input_grad(self, x: Tensor) -> None:
        """``enable_input_require_grads`` (full recompute): ``x`` becomes a leaf whose
        ``AccumulateGrad`` holds it (and later its gradient) until the graph goes."""
        if not self.cfg.input_grad:
            return
        x.fn = ops.leaf(self.grads, "input")
        self.held.append(self.tape.hold(x))

    def free_graph(self) -> None:
        """``del loss`` frees the graph: the embedding output, then its ``.grad``."""
        for x in self.held:
            self.tape.drop(x)
        self.held = []
        g = self.grads.pop("input", None)
        if g is not None:
            self.tape.drop(g)

    def zero_grad(self) -> None:
        """``zero_grad(set_to_none=True)`` over the adapters, in parameter order."""
        for name, _ in self.params():
            g = self.grads.pop(name, None)
            if g is not None:
                self.tape.drop(g)
