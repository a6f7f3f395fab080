"""``MemplanCallback``: memplan's estimate at the start of ``Trainer.train()``, and the first
steps' measured peaks beside it.

At ``on_train_begin`` the plan is read from the live objects (no YAML to write):

- the model's ``config`` (a PEFT model forwards it to its base), its parameters' dtype and
  device, ``config._attn_implementation`` (``sdpa`` / ``flash_attention_2``: memplan's flash,
  ``eager``), and ``config.quantization_config`` (bitsandbytes' 4-bit nf4 / fp4 with or without
  double quantization, 8-bit);
- PEFT's ``peft_config`` (LoRA only: ``r``, ``target_modules``, ``lora_dropout``,
  ``modules_to_save``, ``use_dora`` (the plan's ``lora_dora``), and ``target_parameters`` where PEFT 0.21
  moved Mixtral's and Qwen3-MoE's experts and router there: read back as the MLP names or ``all-linear``,
  :func:`_parameter_targets`);
- ``TrainingArguments``: ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
  ``world_size``, ``bf16`` / ``fp16`` (the plan's ``autocast`` over a 16-bit model),
  ``gradient_checkpointing`` and its ``gradient_checkpointing_kwargs``' ``use_reentrant`` (:func:`_checkpointing`;
  without it, the model's own: PEFT's ``prepare_model_for_kbit_training`` checkpoints reentrantly; over DDP a PEFT
  model under it with ``ddp_find_unused_parameters=False``: :func:`_check_ddp_reentrant`),
  ``optim``, ``deepspeed``
  (ZeRO stage and offload) and ``fsdp`` (``full_shard``: ZeRO-3, ``shard_grad_op``: ZeRO-2,
  ``offload``);
- the sequence length: the callback's ``seq_len``, else TRL's ``max_length`` on the arguments;
- over an 8-bit base, whether the weights are still their random initialisation (every norm weight at
  its initial one or zero, :func:`_random_init`: the rule of :mod:`memplan.specs.checkpoint`): LLM.int8's
  outlier columns follow the weights' values.

It estimates with ``--runtime hf`` (the Trainer's step) and, when the plan will not fit, logs
one warning with memplan's ranked changes that would. Over the first ``measure_steps`` steps
it measures the peaks: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` on CUDA
(reset after the first step: the first step allocates the optimizer states), on the CPU the
live tensor bytes counted at the dispatcher (:mod:`memplan.integrations.live_bytes`) from
``on_step_begin`` to ``on_step_end``. The step's batches are fetched before ``on_step_begin``
(``Trainer._inner_training_loop``), so the CPU figure leaves them out: a few
``batch x seq x 8`` bytes. It then logs predicted against measured, keeps them as
:attr:`MemplanCallback.comparison`, and stops measuring: later steps run untouched.

Anything the callback cannot read (a custom model memplan has no description of, a PEFT method
other than LoRA, an unknown quantization or optimizer) is one warning line naming the field,
and training goes on without the estimate; nothing raises inside the user's training.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from transformers import TrainerCallback

from memplan.errors import MemplanError
from memplan.estimation import EstimateResult

logger = logging.getLogger("memplan")

# TrainingArguments.optim (transformers' OptimizerNames) -> memplan's optimizer
OPTIM = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
    "paged_adamw_8bit": "paged-adamw-8bit",
    "paged_adamw_32bit": "paged-adamw-32bit",
    "paged_lion_8bit": "paged-lion-8bit",
    "paged_lion_32bit": "paged-lion-32bit",
    "adafactor": "adafactor",
    "sgd": "sgd",
}
ATTENTION = {"sdpa": "flash", "flash_attention_2": "flash", "flash_attention_3": "flash", "eager": "eager"}


class Comparison(BaseModel):
    """Predicted against measured over the measured steps (``steps``). ``*_reserved`` is None
    on the CPU, which has no caching allocator."""

    model_config = ConfigDict(frozen=True)

    device: str
    steps: tuple[int, ...]
    predicted_allocated: int
    measured_allocated: int
    predicted_reserved: int | None = None
    measured_reserved: int | None = None

    @property
    def allocated_error(self) -> float:
        """(predicted - measured) / measured: positive over-predicts."""
        return self.predicted_allocated / self.measured_allocated - 1

    @property
    def reserved_error(self) -> float | None:
        if self.predicted_reserved is None or not self.measured_reserved:
            return None
        return self.predicted_reserved / self.measured_reserved - 1

    def line(self) -> str:
        text = (
            f"memplan: steps {self.steps[0]}-{self.steps[-1]} on {self.device}: allocated predicted "
            f"{_gib(self.predicted_allocated)}, measured {_gib(self.measured_allocated)} ({self.allocated_error:+.1%})"
        )
        if (err := self.reserved_error) is not None:
            text += (
                f"; reserved predicted {_gib(self.predicted_reserved or 0)}, measured "
                f"{_gib(self.measured_reserved or 0)} ({err:+.1%})"
            )
        return text


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # transformers' and PEFT's enums


def _dominant_dtype(model: torch.nn.Module) -> torch.dtype:
    """The floating dtype holding most parameter elements (a 4-bit base's packed uint8 aside)."""
    count: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    if not count:
        raise MemplanError("the model has no floating-point parameters", field="model")
    return max(count, key=count.__getitem__)


def _quantization(config: Any) -> dict[str, Any] | None:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    data = q.to_dict() if callable(getattr(q, "to_dict", None)) else dict(q)
    method = str(_value(data.get("quant_method", "bitsandbytes")))
    if method != "bitsandbytes" or not (data.get("load_in_4bit") or data.get("load_in_8bit")):
        raise MemplanError(
            f"quantization {method!r} is not one memplan models (bitsandbytes 4-bit or 8-bit)",
            field="config.quantization_config",
        )
    return data


def _finetune(model: Any, quant: dict[str, Any] | None) -> dict[str, Any]:
    """LoRA / QLoRA fields from PEFT's config and the quantization config
    (``export.hf_trainer.parse_finetune``, the reader of an exported Trainer YAML)."""
    from memplan.export.hf_trainer import parse_finetune

    peft = getattr(model, "peft_config", None) or {}
    cfg = peft.get(getattr(model, "active_adapter", "default")) or next(iter(peft.values()), None)
    lora = None
    if cfg is not None:
        kind = str(_value(getattr(cfg, "peft_type", "")))
        if kind != "LORA":
            method = kind or type(cfg).__name__
            raise MemplanError(f"PEFT method {method} is not one memplan models (LoRA)", field="peft")
        targets = cfg.target_modules
        leaves = targets if isinstance(targets, str) else _leaf_targets(model, targets)
        if getattr(cfg, "target_parameters", None):
            leaves = _parameter_targets(cfg, getattr(model.config, "model_type", ""), leaves)
        lora = {
            "r": cfg.r,
            "target_modules": leaves,
            "lora_dropout": float(cfg.lora_dropout),
            "modules_to_save": sorted(cfg.modules_to_save or ()),
            "use_dora": bool(getattr(cfg, "use_dora", False)),  # DoRA: timeline/hf_dora.py
        }
    return parse_finetune(lora, quant)


# the experts' parameters PEFT 0.21 wraps on the MoE families whose targets it converts
# (utils/transformers_weight_conversion.py, ``_convert_peft_config_moe``; timeline/hf_moe_lora.py): the MLP
# names they stand for, and the router's 2-D weight, which only ``all-linear`` adds
EXPERT_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROUTER_PARAMETER = "gate.weight"
CONVERTED = ("mixtral", "qwen3_moe")


def _parameter_targets(cfg: Any, model_type: str, leaves: Any) -> Any:
    """The plan's ``lora_targets`` for a PEFT config with ``target_parameters`` (``lora.ParamWrapper``), as
    PEFT 0.21's conversion leaves it on Mixtral and Qwen3-MoE: the router's ``gate.weight`` with both experts'
    parameters beside the four attention linears is ``all-linear``; ``gate_up_proj`` / ``down_proj`` alone are
    the MLP names they were converted from (the run follows them: ``hf_support.MOE_LORA_TARGETS``,
    ``specs.job.check_moe_lora`` refuses the rest), ``gate_up_proj`` at twice the rank, as the conversion's
    ``rank_pattern`` sets it."""
    from memplan.costmodel.lora import ALL_LINEAR, ATTENTION

    wrapped = set(cfg.target_parameters)
    unknown = sorted(wrapped - {*EXPERT_PARAMETERS, ROUTER_PARAMETER})
    if model_type not in CONVERTED or unknown or isinstance(leaves, str):
        raise MemplanError(
            f"adapters on parameters ({', '.join(sorted(wrapped))}, PEFT's ParamWrapper) are not followed "
            f"on {model_type or 'this model'}: memplan follows those PEFT converts on Mixtral and Qwen3-MoE "
            f"({', '.join([*EXPERT_PARAMETERS, ROUTER_PARAMETER])})",
            field="peft.target_parameters",
        )
    _check_rank_pattern(cfg, wrapped)
    if ROUTER_PARAMETER in wrapped:
        if wrapped != {*EXPERT_PARAMETERS, ROUTER_PARAMETER} or set(leaves) != set(ATTENTION):
            raise MemplanError(
                f"an adapter on the router ({ROUTER_PARAMETER}) is followed under all-linear alone (the attention "
                f"linears, the experts and the router); this config wraps {', '.join(sorted({*leaves, *wrapped}))}",
                field="peft.target_parameters",
            )
        return ALL_LINEAR
    return sorted({*leaves, *(name for p in wrapped for name in EXPERT_PARAMETERS[p])})


def _check_rank_pattern(cfg: Any, wrapped: set[str]) -> None:
    """PEFT's conversion gives ``gate_up_proj`` (gate and up fused) twice the rank; the run builds that rank
    (``hf_moe_lora.wrapped_experts``), and every other module ``r``."""
    expected = {r".*\.gate_up_proj": 2 * cfg.r} if "gate_up_proj" in wrapped else {}
    pattern = dict(getattr(cfg, "rank_pattern", None) or {})
    if pattern != expected:
        raise MemplanError(
            f"rank_pattern {pattern} is not followed: memplan follows rank r on every adapter, "
            f"and twice r on gate_up_proj (PEFT's conversion)",
            field="peft.rank_pattern",
        )


def _leaf_targets(model: Any, targets: Any) -> list[str]:
    """PEFT's target names as memplan's (``q_proj``): PEFT resolves ``"all-linear"`` to every
    adapted module's full name (``model.layers.0.self_attn.q_proj``, peft ``tuners_utils``'
    ``_maybe_include_all_linear_layers``); a name matches a module whose name ends with it. memplan
    adapts a kind of layer in every block, so each leaf name must cover all the modules it names."""
    names = [n for n, _ in model.named_modules()] if hasattr(model, "named_modules") else []
    leaves: set[str] = set()
    for target in targets:
        leaf = str(target).rsplit(".", 1)[-1]
        if "." in str(target):
            same = {n for n in names if n.rsplit(".", 1)[-1] == leaf and "lora_" not in n}
            covered = {n for n in same if any(n == t or n.endswith("." + t) for t in targets)}
            if covered != same:
                raise MemplanError(
                    f"targets some {leaf} layers and not others ({target}); memplan adapts a layer kind in every block",
                    field="peft.target_modules",
                )
        leaves.add(leaf)
    return sorted(leaves)


def _precision(args: Any, model: torch.nn.Module, quant: dict[str, Any] | None) -> dict[str, Any]:
    """memplan's precision for the Trainer's, and its ``autocast``: ``bf16=True`` / ``fp16=True``
    (accelerate's autocast, the same bytes) over an fp32 model is bf16-mixed; a bf16 or fp16 model
    trains in bf16, under autocast as the arguments say (``autocast`` off without them: a 16-bit
    model trained as it is); a quantized base computes in its ``bnb_4bit_compute_dtype`` (4-bit) or
    the model's dtype (8-bit), likewise."""
    autocast = bool(args.bf16 or args.fp16)
    if quant is not None and quant.get("load_in_4bit"):
        compute = str(quant.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch.")
        wide = compute == "float32"
    else:
        wide = _dominant_dtype(model) == torch.float32
    if wide:
        return {"precision": "bf16-mixed" if autocast else "fp32"}
    return {"precision": "bf16", "autocast": autocast}


def _sharding(args: Any) -> dict[str, Any]:
    """ZeRO and offload from ``deepspeed`` (a dict or a JSON file) or ``fsdp``."""
    ds = args.deepspeed
    if ds:
        import json

        cfg = ds if isinstance(ds, dict) else json.loads(Path(ds).read_text())
        zero = cfg.get("zero_optimization") or {}
        return {
            "zero": int(zero.get("stage", 0)),
            "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none"),
            "offload_params": (zero.get("offload_param") or {}).get("device", "none"),
        }
    fsdp = args.fsdp if isinstance(args.fsdp, str) else " ".join(str(_value(o)) for o in args.fsdp or ())
    if not fsdp:
        return {"zero": 0}
    offload = "cpu" if "offload" in fsdp else "none"
    zero = 2 if "shard_grad_op" in fsdp else 3
    return {"zero": zero, "offload_optimizer": offload, "offload_params": offload if zero == 3 else "none"}


def _checkpointing(args: Any, model: Any = None) -> dict[str, Any]:
    """``gradient_checkpointing`` and the ``use_reentrant`` the Trainer hands ``torch.utils.checkpoint``: its
    ``gradient_checkpointing_kwargs`` (5.x: ``activation_checkpointing_kwargs``, the old name mirrored by
    ``TrainingArguments.__post_init__``) less ``every_n_layers`` and ``offload``, ``or None``; None is
    transformers' ``{"use_reentrant": False}``, a dict without the key leaves torch its default, True
    (``Trainer.train``, ``modeling_utils._activation_checkpointing_enable``)."""
    on = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    if not on:
        return _model_checkpointing(model)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", 0)
    popped = ("every_n_layers", "offload")  # the Trainer's own keys
    rest = {k: v for k, v in (kwargs if isinstance(kwargs, dict) else {}).items() if k not in popped}
    return {"recompute": "full", "use_reentrant": bool(rest.get("use_reentrant", True)) if rest else False}


def _model_checkpointing(model: Any) -> dict[str, Any]:
    """Checkpointing the Trainer's arguments leave off but the model has on: PEFT's
    ``prepare_model_for_kbit_training(model)`` enables it before the Trainer (the QLoRA recipe without
    ``gradient_checkpointing=True``), each layer's ``_gradient_checkpointing_func`` a ``functools.partial`` of
    torch's checkpoint whose keywords are the kwargs it was enabled with (no ``use_reentrant``: torch's True)."""
    for module in model.modules() if model is not None else ():
        if getattr(module, "gradient_checkpointing", False) is True:
            keywords = getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", None) or {}
            return {"recompute": "full", "use_reentrant": bool(keywords.get("use_reentrant", True))}
    return {"recompute": "none"}


def _check_ddp_reentrant(args: Any, plan: dict[str, Any]) -> None:
    """A PEFT model under DDP and torch's reentrant checkpoint: the Trainer's ``find_unused_parameters=True`` (its
    default over a model that is no ``PreTrainedModel``) fails in the first backward ("Expected to mark a variable
    ready only once"; tests/unit/test_timeline_hf_reentrant_ranks.py), and ``ddp_static_graph`` is not followed: the
    run estimates ``ddp_find_unused_parameters=False`` (``timeline/hf_ddp.wrap``), one line otherwise."""
    ddp = plan["dp"] > 1 and not args.deepspeed and plan.get("zero", 0) == 0
    if not (ddp and plan.get("use_reentrant") and plan.get("finetune", "full") != "full"):
        return
    if getattr(args, "ddp_static_graph", None):
        raise MemplanError("ddp_static_graph under the reentrant checkpoint is not followed", field="ddp_static_graph")
    if getattr(args, "ddp_find_unused_parameters", None) is not False:
        raise MemplanError(
            "a PEFT model under DDP and the reentrant checkpoint needs ddp_find_unused_parameters=False (the "
            "Trainer's True fails in the first backward)",
            field="ddp_find_unused_parameters",
        )


def _random_init(model: Any, config: Any) -> float | None:
    """``config.initializer_range`` when the live model's norm weights (the first four and the
    last) each hold one value, 1 or 0, as transformers' ``_init_weights`` leaves them and no training
    does (:mod:`memplan.specs.checkpoint`); else None. A sharded (DTensor) weight is read as its shard."""
    from memplan.specs.checkpoint import init_range

    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    if not norms:
        return None
    for p in (*norms[:4], norms[-1]):
        w = p.detach()
        w = w.to_local() if callable(getattr(w, "to_local", None)) else w
        if w.numel() == 0 or not (bool((w == 1).all()) or bool((w == 0).all())):
            return None
    return init_range(getattr(config, "initializer_range", None))


def trainer_plan(model: Any, args: Any, seq_len: int | None = None) -> dict[str, Any]:
    """The estimate's inputs for a live model and its ``TrainingArguments``: ``config``,
    ``plan``, ``workload``, ``device`` (module docstring)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        raise MemplanError(f"{type(model).__name__} has no transformers config to describe it", field="model")
    seq = seq_len or getattr(args, "max_length", None) or getattr(args, "max_seq_length", None)
    if not isinstance(seq, int) or seq < 1:
        raise MemplanError("no sequence length: pass MemplanCallback(seq_len=...)", field="seq_len")
    optim = str(_value(args.optim))
    if optim not in OPTIM:
        raise MemplanError(f"optimizer {optim!r} is not one memplan models ({', '.join(OPTIM)})", field="optim")
    attn = str(getattr(config, "_attn_implementation", None) or "sdpa")
    quant = _quantization(config)
    dp, micro = int(args.world_size), int(args.per_device_train_batch_size)
    plan = {
        "dp": dp,
        **_sharding(args),
        **_checkpointing(args, model),
        **_precision(args, model, quant),
        "optimizer": OPTIM[optim],
        "attention": ATTENTION.get(attn, "flash"),
        **_finetune(model, quant),
    }
    _check_ddp_reentrant(args, plan)
    accumulation = int(args.gradient_accumulation_steps)
    workload = {"seq_len": seq, "micro_batch": micro, "global_batch": micro * dp * accumulation}
    device = "cuda" if next(model.parameters()).is_cuda else "cpu"
    std = _random_init(model, config) if quant is not None and quant.get("load_in_8bit") else None
    return {"config": config, "plan": plan, "workload": workload, "device": device, "gpus": dp, "random_init": std}


class MemplanCallback(TrainerCallback):
    """Estimate at ``on_train_begin``; measure the first ``measure_steps`` steps (module docstring).

    ``seq_len``: tokens per sequence (default: TRL's ``max_length`` on the arguments); ``gpu``: a
    GPU profile name or :class:`~memplan.specs.hardware.GPUSpec` (default: the one NVML detects);
    ``snapshot``: on CUDA, a path to dump the measured steps' allocator snapshot to, for
    ``memplan explain``. After training: :attr:`result` (the estimate), :attr:`comparison`
    (predicted against measured) and :attr:`seconds` (what the estimate took)."""

    def __init__(
        self,
        seq_len: int | None = None,
        gpu: Any = None,
        measure_steps: int = 3,
        snapshot: str | Path | None = None,
    ) -> None:
        if not isinstance(measure_steps, int) or measure_steps < 2:
            raise MemplanError(f"must be a whole number >= 2, got {measure_steps!r}", field="measure_steps")
        self.seq_len, self.gpu, self.measure_steps = seq_len, gpu, measure_steps
        self.snapshot = Path(snapshot) if snapshot is not None else None
        self.result: EstimateResult | None = None
        self.comparison: Comparison | None = None
        self.seconds = 0.0
        self._device = "cpu"
        self._meter: Any = None
        self._peaks: list[tuple[int, int | None]] = []

    # --- the estimate ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        start = time.perf_counter()
        try:
            self.result = self._estimate(model, args)
        except MemplanError as err:
            where = f"{err.field}: " if err.field else ""
            logger.warning("memplan: no estimate for this run (%s%s); training goes on", where, err.reason)
        except Exception as err:  # noqa: BLE001 - never a traceback inside the user's training
            logger.warning("memplan: no estimate for this run (%s: %s); training goes on", type(err).__name__, err)
        self.seconds = time.perf_counter() - start
        if self.result is not None:
            self._report_fit(self.result)
            if self._device == "cuda":
                self._start_cuda()

    def _estimate(self, model: Any, args: Any) -> EstimateResult:
        from memplan.api import estimate, model_spec

        if model is None:
            raise MemplanError("the Trainer passed no model", field="model")
        inputs = trainer_plan(model, args, self.seq_len)
        self._device = inputs["device"]
        spec, _ = model_spec(inputs["config"])
        if inputs["random_init"] is not None:
            spec = spec.model_copy(update={"random_init": inputs["random_init"]})
        return estimate(
            spec,
            plan=inputs["plan"],
            workload=inputs["workload"],
            gpu=self.gpu,
            gpus=inputs["gpus"],
            runtime="hf",
            device=inputs["device"],
        )

    def _report_fit(self, result: EstimateResult) -> None:
        peak = result.memory.peak
        if result.fits:
            logger.info(
                "memplan: fits on %s: %s allocated, %s reserved predicted (%s)",
                result.gpu.get("name"), _gib(peak.allocated), _gib(peak.reserved), result.memory.model,
            )  # fmt: skip
            return
        changes = [f"{s.change} ({_gib(s.reserved_bytes)} reserved)" for s in result.suggestions if s.fits]
        advice = "; changes that fit: " + ", ".join(changes[:5]) if changes else "; no single change makes it fit"
        logger.warning("memplan: this run will not fit on %s: %s%s", result.gpu.get("name"), result.fits_reason, advice)

    # --- the measurement -----------------------------------------------------------------------------
    def _start_cuda(self) -> None:
        if self.snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        step = state.global_step + 1  # the step beginning, from 1
        if self.result is None or self.comparison is not None or self._device == "cuda" or step < 2:
            return  # the first step allocates the optimizer states: measured from the second
        from memplan.integrations.live_bytes import LiveBytes

        meter = LiveBytes()
        meter.track(model.parameters() if model is not None else ())
        meter.track(model.buffers() if model is not None else ())
        meter.track(p.grad for p in (model.parameters() if model is not None else ()) if p.grad is not None)
        if optimizer is not None:
            meter.track(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        self._meter = meter
        meter.__enter__()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if self.result is None or self.comparison is not None:
            return
        step = state.global_step  # this step's number, from 1
        if self._device == "cuda":
            measured: tuple[int, int | None] = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        elif self._meter is None:  # the first step: not metered
            return
        else:
            meter, self._meter = self._meter, None
            meter.__exit__(None, None, None)
            measured = (meter.peak, None)
        if step > 1:  # the first step allocates the optimizer states (and, on CUDA, warms the caches)
            self._peaks.append(measured)
        if step >= self.measure_steps:
            self._compare(step)

    def _compare(self, last: int) -> None:
        assert self.result is not None
        peak = self.result.memory.peak
        cuda = self._device == "cuda"
        self.comparison = Comparison(
            device=self._device,
            steps=tuple(range(2, last + 1)),
            predicted_allocated=peak.allocated,
            measured_allocated=max(a for a, _ in self._peaks),
            predicted_reserved=peak.reserved if cuda else None,
            measured_reserved=max(r or 0 for _, r in self._peaks) if cuda else None,
        )
        logger.info("%s", self.comparison.line())
        if cuda and self.snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(self.snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
