"""The optimizer ``transformers.Trainer`` builds for ``args.optim``, as the ops of its step.

``Trainer.create_optimizer`` (transformers 5.23 ``trainer.py``) puts the trained parameters in two groups,
the decay group then the no-decay one (``hf_model.is_norm``), and asks ``get_optimizer_cls_and_kwargs``
(``trainer_optimizer.py``) for the class. The states are made lazily, at the first ``step()``; each class
here is one optimizer's construction (``create(tape)``) and ``step`` over those groups
(``step(tape, params, grads, first)``):

- :class:`FusedAdamW` (``adamw_torch_fused``, the default): ``torch.optim.AdamW(fused=True)``;
- :class:`Sgd` (``sgd``): ``torch.optim.SGD`` with the Trainer's kwargs alone (``lr``, each group's
  ``weight_decay``: 0.0 by default), so ``momentum=0``: no state (``SGD._init_group`` reads a
  ``momentum_buffer`` only where ``momentum != 0``) and an in-place ``add_`` (``_single_tensor_sgd`` on
  CPU, ``_foreach_add_`` on CUDA): nothing allocated;
- :class:`Adafactor` (``adafactor``): transformers' own ``optimization.Adafactor`` with
  ``scale_parameter=False, relative_step=False`` (``_get_adafactor``), ``beta1=None``: no first moment;
- bitsandbytes' ``AdamW`` / ``Lion`` (``adamw_bnb_8bit``, ``paged_*``): ``hf_bnb_optim.py``.

Each parameter is a :class:`Param` (its numel, bytes per element, its matrix shape or a vector's). The
groups' ``weight_decay`` is the Trainer's default, 0.0 (a plan names none): with one, SGD would add a
gradient-sized ``grad + wd * param`` per parameter (``_foreach_add`` on CUDA: all at once); Adafactor and
bitsandbytes decay in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Category

STATE, TEMP = Category.OPTIMIZER_STATES, Category.OPTIMIZER_TEMP
FP32 = 4


@dataclass(frozen=True)
class Param:
    """A trained parameter as the optimizer sees it: ``rows`` x ``cols`` (``cols == 0``: a vector),
    ``rows`` the product of every dimension but the last, ``lead`` of every one before the last two (an
    MoE block's 3-D experts, (E, 2f, h) and (E, h, f): ``lead`` E, ``rows`` E x 2f); ``itemsize`` its
    dtype's (and its gradient's) bytes; ``embedding``: an ``nn.Embedding``'s weight (bitsandbytes' 8-bit
    optimizers keep its states in 32 bits: ``hf_bnb_optim.py``)."""

    name: str
    numel: int
    itemsize: int
    rows: int
    cols: int = 0
    embedding: bool = False
    lead: int = 1

    @property
    def matrix(self) -> bool:
        return self.cols > 0


class _Optimizer:
    """What every optimizer here does at its construction (``Trainer.create_optimizer``): nothing on
    the device, unless it says otherwise."""

    def create(self, t: Tape) -> None:  # noqa: ARG002
        return


class FusedAdamW(_Optimizer):
    """``torch.optim.AdamW(fused=True)``: ``_init_group`` makes each parameter's states on the first step
    (a 4-byte fp32 ``step``, then ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype), in group order;
    the fused kernel (``_fused_adamw``) updates in place and allocates nothing."""

    def __init__(self) -> None:
        self.states: list[Tensor] = []

    def step(self, t: Tape, params: list[Param], grads: dict[str, Tensor], first: bool) -> None:  # noqa: ARG002
        if not first:
            return
        for p in params:
            self.states.append(t.managed(1, FP32, f"{p.name}.step", STATE))
            for state in ("exp_avg", "exp_avg_sq"):
                self.states.append(t.managed(p.numel, p.itemsize, f"{p.name}.{state}", STATE))


class Sgd(_Optimizer):
    """``torch.optim.SGD(lr=...)``, momentum 0 (the module docstring): no state, an in-place update."""

    def step(self, t: Tape, params: list[Param], grads: dict[str, Tensor], first: bool) -> None:  # noqa: ARG002
        return


class Adafactor(_Optimizer):
    """transformers' ``Adafactor.step`` (``optimization.py``) as it runs per parameter, in group order:

    - a 16-bit gradient cast to fp32 (``grad = grad.float()``), and a 16-bit parameter (``p_data_fp32``);
    - on the first step the states: a matrix's ``exp_avg_sq_row`` (``grad_shape[:-1]``: rows) and
      ``exp_avg_sq_col`` (``grad_shape[:-2] + grad_shape[-1:]``: cols, times ``lead`` for 3-D experts: the
      factored states are per expert), a vector's ``exp_avg_sq`` (numel), fp32 (``.to(grad)``); then every
      step ``state["RMS"] = self._rms(p_data_fp32)``, a 0-dim fp32 tensor replacing the previous one (the
      first step's ``0``);
    - ``update = grad**2 + eps``; a matrix's two ``mean``s, then ``_approx_sq_grad``: the row mean, the row
      factor (rows), the column factor (cols), their product (numel), the factors freed as it returns;
      a vector's ``exp_avg_sq.rsqrt()``; ``_rms(update)`` and the clip's divisor; ``-update``; over 3-D
      experts each mean and factor keeps the leading dimension (the row mean ``lead`` elements);
    - the loop's locals (``grad``, ``p_data_fp32``, ``update``) alive until the next parameter rebinds them,
      the last ones until ``step`` returns.
    """

    def __init__(self) -> None:
        self.states: list[Tensor] = []
        self.rms: dict[str, Tensor] = {}

    def step(self, t: Tape, params: list[Param], grads: dict[str, Tensor], first: bool) -> None:  # noqa: ARG002
        grad = p32 = update = None
        for p in params:
            t.done(grad)  # ``grad = p.grad`` rebinds the loop's local
            grad = t.new(p.numel, FP32, "grad_fp32", TEMP) if p.itemsize != FP32 else None
            if first:
                shapes = (p.rows, p.lead * p.cols) if p.matrix else (p.numel,)
                self.states += [t.managed(n, FP32, f"{p.name}.exp_avg_sq", STATE) for n in shapes]
            t.done(p32)
            p32 = t.new(p.numel, FP32, "p_data_fp32", TEMP) if p.itemsize != FP32 else None
            rms = _rms(t, STATE)
            t.done(self.rms.get(p.name))  # the previous step's ``state["RMS"]``
            self.rms[p.name] = rms
            update = self._update(t, p, update)
            norm = _rms(t, TEMP)  # update.div_((self._rms(update) / clip_threshold).clamp_(min=1.0))
            divisor = t.new(1, FP32, "clip_divisor", TEMP)
            t.done(norm)
            t.done(divisor)
            t.done(t.new(p.numel, FP32, "neg_update", TEMP))  # p_data_fp32.add_(-update)
        t.done(grad, p32, update)  # ``step`` returns: its frame's locals, in order

    @staticmethod
    def _update(t: Tape, p: Param, previous: Tensor | None) -> Tensor:
        """``update`` from ``grad**2 + eps`` to the approximated ``1/sqrt(v) * grad`` (the previous
        parameter's ``update`` goes at the first rebinding)."""
        square = t.new(p.numel, FP32, "grad_sq", TEMP)
        update = t.new(p.numel, FP32, "update", TEMP)
        t.done(square, previous)
        if not p.matrix:
            rsqrt = t.new(p.numel, FP32, "rsqrt", TEMP)
            t.done(update)
            return rsqrt
        for n in (p.rows, p.lead * p.cols):  # update.mean(dim=-1), update.mean(dim=-2)
            t.done(t.new(n, FP32, "mean", TEMP))
        mean = t.new(p.lead, FP32, "row_mean", TEMP)  # exp_avg_sq_row.mean(dim=-1, keepdim=True)
        r_factor = t.new(p.rows, FP32, "r_factor", TEMP)
        t.done(mean)
        c_factor = t.new(p.lead * p.cols, FP32, "c_factor", TEMP)
        approx = t.new(p.numel, FP32, "approx_sq_grad", TEMP)
        t.done(r_factor, c_factor, update)
        return approx


def _rms(t: Tape, category: Category) -> Tensor:
    """``tensor.norm(2) / tensor.numel() ** 0.5``: the norm, then the quotient it returns."""
    norm = t.new(1, FP32, "norm", TEMP)
    out = t.new(1, FP32, "rms", category)
    t.done(norm)
    return out


def trainer_optimizer(optimizer: str, cuda: bool):
    """The optimizer ``get_optimizer_cls_and_kwargs`` returns for memplan's ``optimizer`` name
    (``specs.plan.OptimizerName``: ``adamw`` is the Trainer's default ``adamw_torch_fused``), on ``cuda``
    or the CPU."""
    if optimizer == "adamw":
        return FusedAdamW()
    if optimizer == "sgd":
        return Sgd()
    if optimizer == "adafactor":
        return Adafactor()
    from memplan.costmodel.timeline.hf_bnb_optim import BnbOptimizer

    return BnbOptimizer.of(optimizer, cuda)
