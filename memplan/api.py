"""The public Python API: :func:`estimate` and :func:`tune`, what ``memplan estimate`` and
``memplan tune`` answer, as the frozen results their ``--format json`` prints.

Both resolve their inputs through the commands' own paths (``specs.resolve.job_from`` and
``search.request.tune_request``), so a call and the command given the same inputs return the
same result and refuse bad input with the same :class:`~memplan.errors.MemplanError` reason.
:func:`estimate` reads ``plan``, ``workload`` and the keywords as a plan file's sections and
fields (an error names ``plan.tp``, ``workload.seq_len``, ``gpus``: a plan file's field path,
without a file name); the model as a profile name or path (an error names it, as the command
does) or, from a mapping or a transformers config, ``model`` and the field. :func:`tune`'s
keywords are the command's flags: an error names the keyword (``gpus`` for ``--gpus``).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from memplan.errors import MemplanError
from memplan.estimation import EstimateResult, report_job
from memplan.specs.detect import AUTO
from memplan.specs.hardware import GPUSpec
from memplan.specs.job import AllocatorName, PlanFile, RuntimeName
from memplan.specs.loader import describe_value, load_model, model_from_data, validate
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Finetune, OptimizerName
from memplan.specs.resolve import CLI, job_from
from memplan.specs.values import host_memory_bytes

if TYPE_CHECKING:
    from memplan.search.tuning import TuneResult
    from memplan.specs.plan import Plan
    from memplan.specs.workload import InferenceWorkload, TrainingWorkload

ModelRef = str | os.PathLike | Mapping[str, Any] | ModelSpec | Any  # Any: a transformers PretrainedConfig


def model_spec(model: ModelRef) -> tuple[ModelSpec, str]:
    """The model an argument names, and how a plan file names it: a bundled profile name or a
    path (memplan model YAML, HF config.json or its folder), read as the commands read them; a
    mapping of a model YAML's or a config.json's fields; a transformers ``PretrainedConfig``
    (its ``to_dict()``: every field, defaults included); or a :class:`ModelSpec`."""
    if isinstance(model, ModelSpec):
        return model, model.name
    if isinstance(model, str | os.PathLike):
        ref = os.fspath(model)
        return load_model(str(ref)), str(ref)
    if isinstance(model, Mapping):
        spec = model_from_data(dict(model), "model", "model")
    elif callable(getattr(model, "to_dict", None)):  # transformers' PretrainedConfig, without importing it
        data = model.to_dict()
        default = str(getattr(model, "name_or_path", "") or data.get("model_type") or "model")
        spec = model_from_data(data, "model", default)
    else:
        raise MemplanError(
            f"expected a profile name, a path, a mapping of fields or a transformers config, got "
            f"{describe_value(model)}",
            field="model",
        )
    return spec, spec.name


def _fields(value: Any, name: str, kinds: str) -> dict[str, Any] | None:
    """A plan or workload argument as a plan file's section: a mapping as given, a spec object as
    the fields it was given (so that, as in a file, what is left out is derived: ``dp`` from ``gpus``)."""
    if value is None:
        return None
    if isinstance(value, BaseModel):
        data = value.model_dump(exclude_unset=True)
        kind = getattr(value, "kind", None)
        return {"kind": kind, **data} if kind is not None else data
    if isinstance(value, Mapping):
        return dict(value)
    raise MemplanError(f"expected a mapping of fields or {kinds}, got {describe_value(value)}", field=name)


def _as_argument(err: MemplanError) -> MemplanError:
    """An error the command would blame on a flag (``--gpus``), blamed on the keyword (``gpus``)."""
    if err.source == CLI and (err.field or "").startswith("--"):
        return MemplanError(err.reason, field=(err.field or "")[2:].replace("-", "_"))
    return err


def _host_memory(value: int | str | None, gpu_note: str) -> tuple[int | None, str]:
    """``host_memory``: bytes, or a size as ``--host-memory`` takes it (``64GiB``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise MemplanError("must be a positive size, e.g. 2GiB", field="host_memory")
        return value, "--host-memory"
    if value is not None and not isinstance(value, str):
        raise MemplanError(f"expected bytes or a size such as 64GiB, got {describe_value(value)}", field="host_memory")
    return host_memory_bytes(value, gpu_note)


def estimate(
    model: ModelRef,
    plan: Plan | Mapping[str, Any] | None = None,
    workload: TrainingWorkload | InferenceWorkload | Mapping[str, Any] | None = None,
    gpu: str | GPUSpec | None = None,
    *,
    gpus: int | None = None,
    nodes: int | None = None,
    runtime: str | None = None,
    allocator: str | None = None,
    device: Literal["cuda", "cpu"] = "cuda",
    host_memory: int | str | None = None,
    calibration: bool = True,
) -> EstimateResult:
    """Per-GPU memory of one configuration (and its step time, training), as ``memplan estimate
    MODEL --plan FILE --format json`` prints it, for a plan file holding ``plan``, ``workload``,
    ``gpu``, ``gpus``, ``nodes``, ``runtime`` and ``allocator`` (each optional; the command's
    defaults otherwise: the GPU NVML detects, h100-sxm when none). ``device``, ``host_memory``
    (bytes or ``64GiB``) and ``calibration`` are the command's ``--device``, ``--host-memory`` and
    ``--calibration``. Bad input raises :class:`MemplanError`."""
    try:
        return _estimate(model, plan, workload, gpu, gpus, nodes, runtime, allocator, device, host_memory, calibration)
    except MemplanError as err:
        raise _as_argument(err) from None


def _estimate(
    model: ModelRef,
    plan: Any,
    workload: Any,
    gpu: Any,
    gpus: int | None,
    nodes: int | None,
    runtime: str | None,
    allocator: str | None,
    device: str,
    host_memory: int | str | None,
    calibration: bool,
) -> EstimateResult:
    if device not in ("cuda", "cpu"):
        raise MemplanError(f"unknown device {describe_value(device)} (cuda, cpu)", field="device")
    spec, _ = model_spec(model)
    if gpu is not None and not isinstance(gpu, str | GPUSpec):
        raise MemplanError(f"expected a GPU profile name, a path or a GPUSpec, got {describe_value(gpu)}", field="gpu")
    data = {
        "plan": _fields(plan, "plan", "a memplan.specs.plan.Plan"),
        "workload": _fields(workload, "workload", "a TrainingWorkload or InferenceWorkload"),
        "gpu": gpu if isinstance(gpu, str) else None,
        "gpus": gpus,
        "nodes": nodes,
        "runtime": runtime,
        "allocator": allocator,
    }
    pf = validate(PlanFile, {k: v for k, v in data.items() if v is not None}, "")
    job = job_from(spec, pf, "", {}, default_gpu=AUTO, gpu_spec=gpu if isinstance(gpu, GPUSpec) else None)
    host_bytes, host_source = _host_memory(host_memory, job.gpu_note)
    return report_job(job, calibration, device, host_bytes, host_source)[0]  # type: ignore[arg-type]


_POSITIVE = ("gpus", "nodes", "seq_len", "micro_batch", "max_micro_batch", "lora_rank", "max_cp", "trials", "top")
_CHOICES = {
    "optimizer": typing.get_args(OptimizerName),
    "finetune": typing.get_args(Finetune),
    "runtime": typing.get_args(RuntimeName),
    "allocator": typing.get_args(AllocatorName),
    "objective": ("throughput", "memory", "pareto"),  # search.evaluate.Objective (imported with the search)
    "validate_device": ("auto", "cpu", "cuda"),  # search.validation.ValidationSettings.device
    "device": ("cuda", "cpu"),
}


def _check_tune_arguments(args: dict[str, Any]) -> None:
    """What ``memplan tune``'s option types check before it runs (``min=1``, the choices), for the
    keywords, which do not pass through them."""
    for name in _POSITIVE:
        value = args[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise MemplanError(f"must be a whole number >= 1, got {describe_value(value)}", field=name)
    for name in ("validate", "validate_steps"):
        low = 0 if name == "validate" else 1
        if not isinstance(args[name], int) or isinstance(args[name], bool) or args[name] < low:
            raise MemplanError(f"must be a whole number >= {low}, got {describe_value(args[name])}", field=name)
    for name, allowed in _CHOICES.items():
        value = args[name]
        if value is not None and value not in allowed:
            raise MemplanError(f"unknown {describe_value(value)} (allowed: {', '.join(allowed)})", field=name)
    if not isinstance(args["lora_dropout"], int | float) or args["lora_dropout"] < 0:
        raise MemplanError(f"must be >= 0, got {describe_value(args['lora_dropout'])}", field="lora_dropout")
    if not isinstance(args["validate_timeout"], int | float) or args["validate_timeout"] < 1:
        raise MemplanError(f"must be >= 1, got {describe_value(args['validate_timeout'])}", field="validate_timeout")


def tune(
    model: ModelRef,
    gpus: int | None = None,
    *,
    nodes: int | None = None,
    gpu: str | GPUSpec = "auto",
    seq_len: int = 2048,
    global_batch: int | str | None = None,
    micro_batch: int | None = None,
    max_micro_batch: int = 16,
    precision: str | None = None,
    optimizer: str = "adamw",
    allow_offload: bool = False,
    host_memory: str | None = None,
    finetune: str = "full",
    lora_rank: int = 16,
    lora_targets: str = "q_proj,v_proj",
    lora_dropout: float = 0.0,
    modules_to_save: str | None = None,
    allow_quantization: bool = False,
    max_cp: int | None = None,
    sequence_parallel: bool = True,
    runtime: str | None = None,
    allocator: str | None = None,
    margin: str = "5%",
    allow_tight: bool = False,
    objective: str = "throughput",
    trials: int = 300,
    exhaustive: bool | None = None,
    seed: int = 0,
    study: str | None = None,
    storage: str | None = None,
    calibration: bool = True,
    validate: int = 0,
    validate_steps: int = 2,
    validate_timeout: float = 600,
    validate_device: str = "auto",
    memory_limit: str | None = None,
    device: str = "cuda",
    top: int = 10,
    export: str | None = None,
    workdir: str | os.PathLike | None = None,
) -> TuneResult:
    """The fastest plan that fits, as ``memplan tune MODEL --format json`` prints it: each keyword
    is the command's flag of that name, with its default (``global_batch`` a number or a range
    such as ``"256-1024"``; ``precision``, ``lora_targets`` and ``modules_to_save`` comma-separated
    as the flags take them). Nothing is written but the Optuna study of a non-exhaustive search
    (``storage``, default ``study.db`` in ``workdir``, default ``memplan-tune/MODEL-GPUSxGPU``),
    as the command keeps it; the plan file the command writes is ``plan_path`` None here (no
    file). ``result.recommended`` is the plan the command recommends (None: nothing fits; then
    ``result.closest`` and ``result.fixes`` say what would). Bad input raises :class:`MemplanError`."""
    args = dict(locals())
    try:
        _check_tune_arguments(args)
        return _tune(args)
    except MemplanError as err:
        raise _as_argument(err) from None


def _tune(args: dict[str, Any]) -> TuneResult:
    import warnings

    import optuna

    from memplan.search.request import check_export, tune_request
    from memplan.search.tune import tune as run_tune

    check_export(args["export"])
    spec, ref = model_spec(args.pop("model"))
    if args["global_batch"] is not None:
        args["global_batch"] = str(args["global_batch"])
    setup = tune_request(spec, ref, **args)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # library code never prints: no line per trial
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            result = run_tune(setup.request)
    finally:
        optuna.logging.set_verbosity(verbosity)
    if setup.gpu_note:  # the GPU or the count was detected here: which and why, as the command's JSON says
        result = result.model_copy(update={"gpu_auto": setup.gpu_note})
    return result


__all__ = ["estimate", "model_spec", "tune"]
