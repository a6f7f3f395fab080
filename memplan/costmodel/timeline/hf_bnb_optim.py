"""bitsandbytes' ``AdamW`` and ``Lion`` as the Trainer builds them (``adamw_bnb_8bit``, ``paged_adamw_8bit``,
``paged_adamw_32bit``, ``paged_lion_8bit``, ``paged_lion_32bit``), as the ops of their step.

transformers 5.23 ``trainer_optimizer._get_bitsandbytes_optimizer`` passes ``optim_bits`` (8 or 32) and
``is_paged``; ``Trainer.create_optimizer`` registers every ``nn.Embedding``'s weight for 32-bit states
under an 8-bit optimizer (``GlobalOptimManager.register_module_override``). bitsandbytes 0.50.2
(``optim/optimizer.py``) then, at the first ``step()``, per parameter in group order
(``Optimizer8bit.step``: ``init_state``, ``prefetch_state``, ``update_step``):

- ``__init__``: an 8-bit optimizer's quantization maps, on the host (:meth:`BnbOptimizer.create`);
- ``init_state``: 32-bit states where the optimizer is 32-bit, the weight is overridden, or the parameter
  has fewer than ``min_8bit_size`` (4,096) elements; else uint8 states, each with an fp32 ``absmax`` per
  block of 256 (``torch.zeros``), and the signed (AdamW and Lion) and unsigned (AdamW) quantization maps
  (256 fp32 each) moved to the device once, at the first 8-bit parameter;
- ``get_state_buffer``: ``torch.zeros_like`` in the caching allocator, but under a paged optimizer on CUDA
  a parameter of at least 1e5 elements gets ``F.get_paged`` (``cudaMallocManaged``: CUDA managed memory,
  outside the allocator; :attr:`BnbOptimizer.managed` counts it; ``costmodel.optimizer.PAGED_MIN_ELEMENTS``).
  On CPU nothing is paged (bitsandbytes warns and falls back to ``zeros_like``);
- ``update_step``: on CUDA one kernel (``optimizer_update_32bit`` / ``optimizer_update_8bit_blockwise``,
  ``backends/cuda/ops.py``) updates in place and allocates nothing; on CPU bitsandbytes' CPU backend
  (``backends/cpu/ops.py``) runs the update in PyTorch ops, whose temporaries :meth:`BnbOptimizer._cpu_update`
  follows.
"""

from __future__ import annotations

from memplan.costmodel.optimizer import BNB_BLOCK, PAGED_MIN_ELEMENTS, bnb_states, is_paged
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.hf_optimizers import FP32, STATE, TEMP, Param, _Optimizer

MIN_8BIT_SIZE = 4096  # Optimizer2State / Optimizer1State ``min_8bit_size`` default
QMAP = 256  # F.create_dynamic_map: 256 fp32 values


class BnbOptimizer(_Optimizer):
    """One of bitsandbytes' optimizers: ``lion`` (one state) or AdamW (two), ``bits`` 8 or 32, ``paged``,
    on ``cuda`` or the CPU."""

    def __init__(self, bits: int, lion: bool, paged: bool, cuda: bool) -> None:
        self.bits, self.lion, self.paged, self.cuda = bits, lion, paged, cuda
        self.states: list[Tensor] = []
        self.eight: dict[str, bool] = {}  # each parameter's states: 8-bit or not
        self.qmaps_on_device = False
        self.managed = 0  # bytes in CUDA managed memory (the paged state buffers)

    @classmethod
    def of(cls, optimizer: str, cuda: bool) -> BnbOptimizer:
        """memplan's name (``adamw-8bit``, ``paged-lion-32bit``...) as ``_get_bitsandbytes_optimizer`` reads
        transformers' (``"paged" in optim``, ``"8bit" in optim``, Lion or AdamW)."""
        count, size = bnb_states(optimizer)  # costmodel.optimizer's table: Lion one state, 8-bit one byte
        return cls(8 if size == 1 else 32, count == 1, is_paged(optimizer), cuda)

    def create(self, t: Tape) -> None:
        """``Optimizer8bit.__init__``: an 8-bit optimizer's ``fill_qmap`` makes the signed and unsigned maps
        (``F.create_dynamic_map``: 256 fp32 each, from a few ``linspace`` of at most 129 values freed as it
        returns, not followed) on the host: on the CPU they are the run's, on CUDA host memory until
        :meth:`_init_state` moves them."""
        if self.bits == 8 and not self.cuda:
            self.states += [t.managed(QMAP, FP32, f"bnb.qmap.{m}", STATE) for m in ("dynamic", "udynamic")]

    def step(self, t: Tape, params: list[Param], grads: dict[str, Tensor], first: bool) -> None:  # noqa: ARG002
        for p in params:
            if first:
                self._init_state(t, p)
            if not self.cuda:
                self._cpu_update(t, p)

    def _init_state(self, t: Tape, p: Param) -> None:
        eight = self.bits == 8 and not p.embedding and p.numel >= MIN_8BIT_SIZE
        self.eight[p.name] = eight
        if eight and self.cuda and not self.qmaps_on_device:  # name2qmap[...].to(p.device)
            maps = ("dynamic",) if self.lion else ("dynamic", "udynamic")
            self.states += [t.managed(QMAP, FP32, f"bnb.qmap.{m}", STATE) for m in maps]
            self.qmaps_on_device = True
        itemsize = 1 if eight else FP32
        for k in range(1 if self.lion else 2):
            self._buffer(t, p, itemsize, f"state{k + 1}")
        if eight:
            blocks = -(-p.numel // BNB_BLOCK)
            for k in range(1 if self.lion else 2):
                self.states.append(t.managed(blocks, FP32, f"{p.name}.absmax{k + 1}", STATE))

    def _buffer(self, t: Tape, p: Param, itemsize: int, tag: str) -> None:
        """``get_state_buffer``: in managed memory (paged, on CUDA, 1e5 elements or more) or the allocator."""
        if self.paged and self.cuda and p.numel >= PAGED_MIN_ELEMENTS:
            self.managed += p.numel * itemsize
            return
        self.states.append(t.managed(p.numel, itemsize, f"{p.name}.{tag}", STATE))

    def _cpu_update(self, t: Tape, p: Param) -> None:
        """The CPU backend's update (``_optimizer_update_32bit_cpu`` / ``_optimizer_update_8bit_blockwise_cpu``):
        its fp32 working copies and temporaries, its locals freed as it returns."""
        n = p.numel
        if self.eight[p.name]:  # the states dequantized to fp32 (``_dequant_blockwise_fp32_direct``)
            states = [t.new(n, FP32, f"state{k + 1}_fp32", TEMP) for k in range(1 if self.lion else 2)]
        else:
            states = []
        grad = _gradient(t, p)  # g.float() * gnorm_scale
        p32 = t.new(n, FP32, "p_fp32", TEMP) if p.itemsize != FP32 else None  # p.data.float()
        if self.lion:  # sign(state1 * beta1 + grad * (1 - beta1)) or its 32-bit form
            update = self._lion_direction(t, n, eight=self.eight[p.name])
        else:  # 8-bit: denom = (state2.sqrt() / c2).add_(eps); 32-bit: update = state1 / (state2.sqrt() + eps c2)
            sqrt = t.new(n, FP32, "sqrt", TEMP)
            update = t.new(n, FP32, "denom", TEMP)
            t.done(sqrt)
            if not self.eight[p.name]:
                quotient = t.new(n, FP32, "update", TEMP)
                t.done(update)
                update = quotient
        if self.eight[p.name]:  # _quant_blockwise_fp32_direct: the op's absmax, then its uint8 output
            for _ in states:
                absmax = t.new(-(-n // BNB_BLOCK), FP32, "absmax", TEMP)
                out = t.new(n, 1, "quantized", TEMP)
                t.done(out, absmax)
        t.done(*states, grad, p32, update)

    @staticmethod
    def _lion_direction(t: Tape, n: int, eight: bool) -> Tensor:
        """Lion's direction: 8-bit ``torch.sign(state1.mul(beta1) + grad.mul(1 - beta1))`` (the two
        products, their sum, its sign); 32-bit ``update = state1.mul(beta1).add(g, ...)`` then
        ``p.add_(update.sign(), ...)`` (the sign freed at once, ``update`` kept)."""
        if eight:
            a, b = t.new(n, FP32, "mul", TEMP), t.new(n, FP32, "mul", TEMP)
            total = t.new(n, FP32, "add", TEMP)
            t.done(a, b)
            sign = t.new(n, FP32, "sign", TEMP)
            t.done(total)
            return sign
        product = t.new(n, FP32, "mul", TEMP)
        update = t.new(n, FP32, "update", TEMP)
        t.done(product)
        t.done(t.new(n, FP32, "sign", TEMP))
        return update


def _gradient(t: Tape, p: Param) -> Tensor:
    """``g.float() * gnorm_scale``: the cast of a 16-bit gradient (freed once multiplied), the product."""
    cast = t.new(p.numel, FP32, "grad_float", TEMP) if p.itemsize != FP32 else None
    out = t.new(p.numel, FP32, "grad_scaled", TEMP)
    t.done(cast)
    return out
