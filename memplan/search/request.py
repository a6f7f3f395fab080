"""What ``memplan tune`` is asked, from its flags (or :func:`memplan.tune`'s arguments, the same
names) to a :class:`TuneRequest`: the search space, the GPUs, the calibration, the validation
settings. Errors name the flag (``--gpus``), as the command line prints them. Light to import
(no optuna): ``memplan.search.tune`` runs the request.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from memplan.costmodel.time import Efficiency
from memplan.errors import MemplanError
from memplan.search.calibration import calibration_path, load_calibration
from memplan.search.evaluate import Context
from memplan.search.space import SpaceOptions, activation_offloads, global_batch_range
from memplan.search.tuning import STUDY_FILE, TuneRequest, sqlite_url, work_dir
from memplan.search.validation import ValidationSettings
from memplan.specs.detect import AutoGPU
from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.job import check_lora, suspicious
from memplan.specs.loader import short, validation_error
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan, PrecisionName
from memplan.specs.resolve import (
    CLI,
    TRAINER_PRECISION,
    TRANSFORMERS_RUNTIMES,
    alloc_conf_text,
    blame_flags,
    plan_from_flags,
    resolve_allocator,
)
from memplan.specs.values import gpu_and_count, host_memory_bytes, memory_limit_bytes, name_list
from memplan.specs.workload import TrainingWorkload
from memplan.units import parse_bytes

DEFAULT_PRECISION: str = Plan.model_fields["precision"].default  # as memplan estimate and plan files


def parse_global_batch(text: str | None) -> tuple[int, ...] | None:
    """``512`` -> (512,); ``256-1024`` -> its ends and the powers of two between them."""
    if text is None:
        return None
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high) if sep else int(low)
    except ValueError:
        raise MemplanError(
            f"{text!r} is not a number or a range like 256-1024", source=CLI, field="--global-batch"
        ) from None
    if lo <= 0 or hi < lo:
        raise MemplanError(f"{text!r}: needs 0 < low <= high", source=CLI, field="--global-batch")
    return global_batch_range(lo, hi) if sep else (lo,)


def parse_margin(text: str, capacity: int) -> int:
    """``5%`` of the capacity, or a size (``2GiB``), in bytes."""
    try:
        margin = round(float(text[:-1]) / 100 * capacity) if text.endswith("%") else parse_bytes(text)
    except (ValueError, OverflowError):  # OverflowError: round(inf%)
        raise MemplanError(
            f"{text!r} is neither a percentage (5%) nor a size (2GiB)", source=CLI, field="--margin"
        ) from None
    if not 0 <= margin < capacity:
        raise MemplanError(f"{text!r} must leave part of the GPU's capacity", source=CLI, field="--margin")
    return margin


def parse_precisions(text: str) -> tuple[str, ...]:
    allowed = typing.get_args(PrecisionName)
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in names if p not in allowed]
    if bad or not names:
        raise MemplanError(
            f"unknown precision {bad[0] if bad else text!r} (allowed: {', '.join(allowed)})",
            source=CLI,
            field="--precision",
        )
    return names


def _workload_bounds(
    seq_len: int, micro_batch: int | None, max_micro_batch: int, global_batches: tuple[int, ...] | None
) -> TrainingWorkload:
    """The largest workload the space holds, validated as a plan file's would be: a value beyond
    the limits is an error naming its flag (not a failure inside the search)."""
    try:
        return TrainingWorkload(
            seq_len=seq_len,
            micro_batch=micro_batch or max_micro_batch,
            global_batch=max(global_batches) if global_batches else None,
        )
    except ValidationError as exc:
        err = validation_error(exc, CLI)
        name = (err.field or "seq_len").split(".")[-1]
        flag = "--max-micro-batch" if name == "micro_batch" and micro_batch is None else "--" + name.replace("_", "-")
        raise MemplanError(err.reason, source=CLI, field=flag) from None


def _cluster(gpus: int, nodes: int | None) -> ClusterSpec:
    """Whole 8-GPU nodes when the GPUs fill them, else one node (as ``memplan estimate``)."""
    given = nodes is not None
    if nodes is None:
        nodes = gpus // 8 if gpus > 8 and gpus % 8 == 0 else 1
    if gpus % nodes:
        raise MemplanError(f"{gpus} GPUs do not split evenly over {nodes} nodes", source=CLI, field="--nodes")
    try:
        return ClusterSpec(gpus_per_node=gpus // nodes, nodes=nodes)
    except ValidationError as exc:
        err = validation_error(exc, CLI)
        reason = f"{(err.field or '').split('.')[-1].replace('_', ' ')}: {err.reason}"
        if given:
            raise MemplanError(f"{gpus // nodes} GPUs per node; {reason}", source=CLI, field="--nodes") from None
        # the nodes were derived from --gpus: blame the flag the user gave
        raise MemplanError(
            f"{gpus} GPUs make {nodes} node(s) of {gpus // nodes} (whole 8-GPU nodes, else one); {reason}",
            source=CLI,
            field="--gpus",
        ) from None


def _finetune_options(
    finetune: str,
    rank: int,
    targets: str,
    dropout: float,
    modules_to_save: str | None,
    allow_quantization: bool,
    model: ModelSpec,
    runtime: str,
) -> dict:
    """SpaceOptions' fine-tuning fields; the adapters are checked against the model here, once."""
    if finetune == "full":
        if allow_quantization:
            raise MemplanError(
                "a quantized base is frozen: needs --finetune lora or qlora", source=CLI, field="--allow-quantization"
            )
        return {}
    quants = {"lora": ("none", "int8", "nf4"), "qlora": ("nf4", "fp4", "int8")}[finetune]
    fields = dict(
        finetune=finetune,
        lora_rank=rank,
        lora_targets=name_list(targets, "--lora-targets"),
        lora_dropout=dropout,
        modules_to_save=name_list(modules_to_save, "--modules-to-save") or (),
    )
    plan = plan_from_flags(fields)
    try:
        check_lora(model, plan, runtime)  # the adapters alone: each plan of the space is checked whole
    except MemplanError as err:
        raise blame_flags(err, set(fields)) from None
    return {**fields, "quants": quants if allow_quantization else quants[:1]}


def check_export(target: str | None) -> None:
    """An export target tune can write (``memplan.export.TARGETS``), or none."""
    if target is None:
        return
    from memplan.export import TARGETS

    if target not in TARGETS:
        raise MemplanError(
            f"unknown target {short(repr(target), 60)} ({', '.join(TARGETS)})", source=CLI, field="--export"
        )


@dataclass(frozen=True)
class TuneSetup:
    """A request ready to run, with what the command shows or writes beside its result."""

    request: TuneRequest
    folder: Path  # the working directory: the plan file's and the default study's folder
    gpu_note: str  # --gpu auto or --gpus not given: what NVML detected and what was used ("" when nothing was)
    warnings: tuple[str, ...]  # legal but suspicious inputs (specs.job.suspicious)


def _chosen(gpu: str | GPUSpec, gpus: int | None) -> tuple[AutoGPU, int]:
    """The GPU and the GPU count: a profile name, YAML or ``auto`` (``gpu_and_count``), or a GPU spec."""
    if not isinstance(gpu, GPUSpec):
        return gpu_and_count(gpu, gpus)
    if gpus is None:
        raise MemplanError("a GPU spec is given without the number of GPUs: give the total", source=CLI, field="--gpus")
    return AutoGPU(gpu, 0, "", gpu.name), gpus


def tune_request(
    spec: ModelSpec,
    model_ref: str,
    *,
    gpus: int | None = None,
    nodes: int | None = None,
    gpu: str | GPUSpec = "auto",
    seq_len: int = 2048,
    global_batch: str | None = None,
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
    workdir: str | Path | None = None,
) -> TuneSetup:
    """The request ``memplan tune`` runs for these flags (each keyword is the flag of that name;
    the defaults are the command's) and ``spec``, the model ``model_ref`` names."""
    runtime = runtime or ("hf" if finetune != "full" else "memplan")  # as estimate resolves a fine-tuning plan
    if precision is None:  # as estimate: transformers' loops keep no fp32 masters (specs.resolve)
        default = TRAINER_PRECISION if runtime in TRANSFORMERS_RUNTIMES else DEFAULT_PRECISION
        precision = "bf16-mixed,bf16-master" if export is not None else default
    batches = parse_global_batch(global_batch)
    warnings = tuple(suspicious(spec, _workload_bounds(seq_len, micro_batch, max_micro_batch, batches)))
    chosen, gpus = _chosen(gpu, gpus)
    card = chosen.spec
    folder = Path(workdir) if workdir is not None else work_dir(spec.name, gpus, card.name)
    cluster = _cluster(gpus, nodes)
    limit = memory_limit_bytes(memory_limit)
    host_bytes, host_source = host_memory_bytes(host_memory, chosen.note)
    options = SpaceOptions(
        gpus=gpus,
        gpus_per_node=cluster.gpus_per_node,
        seq_len=seq_len,
        global_batches=batches,
        micro_batch=micro_batch,
        max_micro_batch=max_micro_batch,
        precisions=parse_precisions(precision),
        allow_offload=allow_offload,
        offload_activations=activation_offloads(allow_offload, runtime),
        offload_runtime=runtime,
        max_cp=max_cp,
        sequence_parallel=sequence_parallel,
        optimizer=optimizer,
        **_finetune_options(
            finetune, lora_rank, lora_targets, lora_dropout, modules_to_save, allow_quantization, spec, runtime
        ),
    )
    cal_path = calibration_path()
    profile = load_calibration(cal_path).profiles.get(card.name) if calibration else None
    ctx = Context(
        model=spec,
        gpu=card,
        cluster=cluster,
        runtime=runtime,
        margin_bytes=parse_margin(margin, card.memory_bytes),
        efficiency=Efficiency.for_gpu(card, calibration=(profile and profile.step_time_ratio) or 1.0),
        peak_ratio=(profile and profile.peak_ratio) or 1.0,
        allocator=resolve_allocator(allocator),
        device=device,
        allow_tight=allow_tight,
    )
    settings = ValidationSettings(
        steps=validate_steps,
        timeout_s=validate_timeout,
        device=validate_device,  # type: ignore[arg-type]
        memory_limit=limit,
        alloc_conf=alloc_conf_text("expandable" if ctx.allocator.expandable_segments else "default"),
    )
    request = TuneRequest(
        model_ref=model_ref, gpu_ref=chosen.ref, ctx=ctx, options=options, objective=objective,  # type: ignore[arg-type]
        trials=trials, exhaustive=exhaustive, seed=seed, study=study,
        storage=storage or sqlite_url(folder / STUDY_FILE), top=top, validate=validate, validation=settings,
        calibration_path=cal_path, export_target=export, work_dir=folder if storage is None else None,
        host_memory_bytes=host_bytes, host_memory_source=host_source,
    )  # fmt: skip
    return TuneSetup(request, folder, chosen.note, warnings)
