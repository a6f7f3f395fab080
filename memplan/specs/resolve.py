"""Resolve a model reference, an optional plan file and command-line overrides into one job.

Precedence: command-line flags, then the plan file, then defaults. Errors name the flag
(``--tp``) when a flag set the value, else the plan file and the field path (``plan.tp``).
"""

from __future__ import annotations

import os
from dataclasses import field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memplan.costmodel.allocator import AllocatorConfig, parse_alloc_conf
from memplan.errors import MemplanError
from memplan.records import record
from memplan.specs.detect import AUTO, DEFAULT_GPU, auto_gpu
from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.job import PlanFile, RuntimeName, check_compatible, dora_time, suspicious
from memplan.specs.loader import load_gpu, load_model, read_data, short, validate, validation_error
from memplan.specs.model import ModelSpec
from memplan.specs.plan import TRANSFORMERS_RUNTIMES, Plan, fsdp_build
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

CLI = "command line"
# transformers' loops keep no fp32 master weights (``bf16-master``, Plan's default, is DeepSpeed's):
# their default precision is the Trainer's usual recipe, a bfloat16 model under ``bf16=True``
# (``export/hf_trainer.py``'s ``bf16``; the hand loop trains the bfloat16 model as it is)
TRAINER_PRECISION = "bf16"
PLAN_FIELDS = set(Plan.model_fields)
TRAINING_FIELDS = {"seq_len", "micro_batch", "global_batch"}
INFERENCE_FIELDS = {"batch", "prompt_tokens", "generated_tokens", "kv_dtype", "block_size", "prefill_chunk"}
# plan fields serving memory does not depend on (estimate_inference reads tp, pp, ep, dp and the
# precision): given as flags with --inference they would be ignored without a word
TRAINING_PLAN_FIELDS = {
    "zero", "offload_optimizer", "offload_params", "recompute", "recompute_layers", "optimizer", "sequence_parallel",
    "cp", "pp_schedule", "virtual_stages", "attention", "finetune", "lora_rank", "lora_targets", "lora_dropout",
    "modules_to_save", "lora_dora", "quant", "double_quant", "offload_activations", "fp8_recipe", "fp8_all_gather",
    "model_build", "autocast", "use_reentrant",
}  # fmt: skip


@record()
class Job:
    """Everything one estimate needs, validated and mutually consistent."""

    model: ModelSpec
    workload: TrainingWorkload | InferenceWorkload
    plan: Plan
    gpu: GPUSpec
    cluster: ClusterSpec
    runtime: RuntimeName
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    warnings: tuple[str, ...] = ()  # legal but suspicious inputs (job.suspicious): one stderr line each
    gpu_note: str = ""  # --gpu auto: which GPU and why ("gpu h100-sxm (default: no GPU detected, ...)")

    def __init__(
        self,
        model: ModelSpec,
        workload: TrainingWorkload | InferenceWorkload,
        plan: Plan,
        gpu: GPUSpec,
        cluster: ClusterSpec,
        runtime: RuntimeName,
        allocator: AllocatorConfig | None = None,
        warnings: tuple[str, ...] = (),
        gpu_note: str = "",
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "model", model)
        _set(self, "workload", workload)
        _set(self, "plan", plan)
        _set(self, "gpu", gpu)
        _set(self, "cluster", cluster)
        _set(self, "runtime", runtime)
        _set(self, "allocator", AllocatorConfig() if allocator is None else allocator)
        _set(self, "warnings", warnings)
        _set(self, "gpu_note", gpu_note)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def alloc_conf_text(name: str | None, environ: dict[str, str] | None = None) -> str:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` a run under allocator ``name`` sets: the environment's
    settings with ``expandable_segments`` as ``name`` says (unchanged when ``name`` is None)."""
    env = os.environ if environ is None else environ
    text = env.get(ALLOC_CONF, "")
    if name is None:
        return text
    kept = [part for part in text.split(",") if part.strip() and part.split(":")[0].strip() != "expandable_segments"]
    return ",".join([*kept, f"expandable_segments:{name == 'expandable'}"])


def resolve_allocator(name: str | None, environ: dict[str, str] | None = None) -> AllocatorConfig:
    """The caching allocator's settings: ``PYTORCH_CUDA_ALLOC_CONF`` as PyTorch would parse it
    (a value PyTorch rejects is an error naming the variable), with ``name`` (``default`` or
    ``expandable``, from ``--allocator`` or the plan file) setting expandable segments."""
    env = os.environ if environ is None else environ
    config = parse_alloc_conf(env.get(ALLOC_CONF, ""), source=ALLOC_CONF)
    if name is None:
        return config
    return replace(config, expandable_segments=name == "expandable")


def _flag(field: str) -> str:
    return "--" + field.split(".")[-1].replace("_", "-")


def _blame_flag(err: MemplanError, flags: set[str], from_file: bool) -> MemplanError:
    """The same error against the flag when a flag set the faulty field, or when there is no
    plan file (then only a flag can set it); else unchanged (the plan file and field path)."""
    name = (err.field or "").split(".")[-1]
    if name and (name in flags or not from_file):
        return MemplanError(err.reason, source=CLI, field=_flag(name))
    return err


def _validate_section(cls: type, data: dict, flags: set[str], source: str, prefix: str) -> Any:
    """Validate one section, blaming the flag or the plan file (see :func:`_blame_flag`)."""
    try:
        return validate(cls, data, source, prefix)
    except MemplanError as err:
        raise _blame_flag(err, flags, source != CLI) from None


def plan_from_flags(fields: dict[str, Any]) -> Plan:
    """Plan fields given as flags alone (no plan file), validated; an error names the flag."""
    return _validate_section(Plan, fields, set(fields), CLI, "plan")


def blame_flags(err: MemplanError, flags: set[str]) -> MemplanError:
    """An error about a plan field set by one of ``flags`` (no plan file), against that flag."""
    return _blame_flag(err, flags, from_file=False)


def resolve_job(
    model_ref: str,
    plan_path: str | None,
    overrides: dict[str, Any],
    inference: bool = False,
    default_gpu: str = DEFAULT_GPU,
) -> Job:
    """Build a :class:`Job` from a model, an optional plan YAML and flag values (None = unset).
    ``default_gpu`` is the GPU when neither names one: ``auto`` for the commands about this
    machine (estimate, validate); ``h100-sxm`` where the answer must not depend on it (check)."""
    pf = None
    if plan_path:
        pf = validate(PlanFile, read_data(Path(plan_path)), short(plan_path))
    model = load_model(model_ref)
    if plan_path and pf and pf.model:
        _check_plan_model(pf.model, plan_path, model_ref, model)
    return job_from(model, pf, short(plan_path) if plan_path else None, overrides, inference, default_gpu)


def job_from(
    model: ModelSpec,
    pf: PlanFile | None,
    plan_source: str | None,
    overrides: dict[str, Any],
    inference: bool = False,
    default_gpu: str = DEFAULT_GPU,
    gpu_spec: GPUSpec | None = None,
) -> Job:
    """:func:`resolve_job` for a model already read and a plan file already validated (``pf``,
    read from ``plan_source``: a file name, or ``""`` for a mapping given in Python; None when
    there is no plan). ``gpu_spec`` is the GPU itself when the caller has one (else a reference
    from the flags or the plan, else ``default_gpu``). Errors name the flag when a flag set the
    value, else ``plan_source`` and the field path."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    from_file = plan_source is not None
    source = plan_source if plan_source is not None else CLI
    pf = pf or PlanFile()
    if inference:
        serving_only(flags)

    def blame(name: str) -> tuple[str, str]:
        """Where a top-level value (gpus, nodes, gpu) came from: its flag, else the plan file."""
        return (CLI, _flag(name)) if name in flags or not from_file else (source, name)

    # --gpus / --nodes / --runtime go through the same checks as the plan file's fields
    top = {k: flags[k] for k in ("gpus", "nodes", "runtime", "allocator") if k in flags}
    sizes = _validate_section(PlanFile, top, set(flags), CLI, "")
    gpus = sizes.gpus if sizes.gpus is not None else pf.gpus
    nodes_given = sizes.nodes if sizes.nodes is not None else pf.nodes

    plan_data = {**(pf.plan or {}), **{k: v for k, v in flags.items() if k in PLAN_FIELDS}}
    # adapters over a frozen base are what transformers' Trainer runs (the bundled trainer trains
    # every weight), so a fine-tuning plan defaults to its step
    runtime = sizes.runtime or pf.runtime or ("hf" if plan_data.get("finetune", "full") != "full" else "memplan")
    if not inference and "precision" not in plan_data and runtime in TRANSFORMERS_RUNTIMES:
        plan_data["precision"] = TRAINER_PRECISION
    # the transformers runtimes' own switches: meaningless under the bundled trainer or Megatron-LM
    switches = (("autocast", "the Trainer's bf16=True"), ("use_reentrant", "transformers' gradient checkpointing"))
    for name, what in switches:
        if plan_data.get(name) is not None and runtime not in TRANSFORMERS_RUNTIMES:
            raise _blame_flag(
                MemplanError(
                    f"{what}: only meaningful under runtime hf or hf-loop (got {runtime})",
                    source=source,
                    field=f"plan.{name}",
                ),
                set(flags),
                from_file,
            )
    if gpus is not None and "dp" not in plan_data:
        degrees = {k: plan_data[k] for k in ("tp", "pp", "cp") if k in plan_data}
        partial = _validate_section(Plan, degrees, set(flags), source, "plan")
        per_replica = partial.tp * partial.pp * partial.cp
        if gpus % per_replica:
            where, field = blame("gpus")
            raise MemplanError(
                f"{gpus} GPUs is not a multiple of tp x pp x cp = {per_replica}", source=where, field=field
            )
        plan_data["dp"] = gpus // per_replica
        try:  # dp derived from gpus: a dp out of range is the GPU count's fault, named as such
            _validate_section(Plan, plan_data, set(flags), source, "plan")
        except MemplanError as err:
            if (err.field or "").split(".")[-1].lstrip("-") != "dp":
                raise
            where, field = blame("gpus")
            raise MemplanError(
                f"{gpus} GPUs make dp = {plan_data['dp']} (gpus / (tp x pp x cp)); dp: {err.reason}",
                source=where,
                field=field,
            ) from None
    plan = fsdp_build(_validate_section(Plan, plan_data, set(flags), source, "plan"), plan_data, runtime, model)
    if gpus is not None and plan.world_size != gpus:
        where, field = blame("gpus")
        raise MemplanError(f"dp x tp x pp x cp = {plan.world_size} but gpus is {gpus}", source=where, field=field)
    world = gpus or plan.world_size
    if nodes_given is None:  # whole 8-GPU nodes when the GPUs fill them, else one node
        nodes = world // 8 if world > 8 and world % 8 == 0 else 1
    else:
        nodes = nodes_given
    if world % nodes:
        where, field = blame("nodes")
        raise MemplanError(f"{world} GPUs do not split evenly over {nodes} nodes", source=where, field=field)

    workload = _workload(pf, flags, inference, source)
    gpu_ref = flags.get("gpu") or pf.gpu or default_gpu
    try:
        gpu, gpu_note = (gpu_spec, "") if gpu_spec is not None else _gpu(gpu_ref)
    except MemplanError as err:
        if err.source:
            raise
        where, field = blame("gpu")
        raise MemplanError(err.reason, source=where, field=field) from None
    try:
        cluster = ClusterSpec(gpus_per_node=world // nodes, nodes=nodes)
    except ValidationError as exc:
        where, field = blame("nodes" if nodes_given is not None else "gpus")
        reason = validation_error(exc, where).reason
        raise MemplanError(
            f"{world // nodes} GPUs per node: {reason} (give --nodes)", source=where, field=field
        ) from None
    try:
        check_compatible(model, workload, plan, runtime)
    except MemplanError as err:
        raise _blame_flag(err.located(source), set(flags), from_file) from None
    allocator = resolve_allocator(sizes.allocator or pf.allocator)
    warnings = (*suspicious(model, workload), *dora_time(plan, workload))
    return Job(model, workload, plan, gpu, cluster, runtime, allocator, warnings, gpu_note)


def _gpu(ref: str) -> tuple[GPUSpec, str]:
    """The GPU a reference names, and for ``auto`` (the default) the line saying which and why."""
    if ref.lower() != AUTO:
        return load_gpu(ref), ""
    auto = auto_gpu()
    return auto.spec, auto.note


def serving_only(flags: dict[str, Any]) -> None:
    """Refuse training-only plan flags with ``--inference``: serving memory does not depend on them."""
    # a runtime profile is one training code's activation accounting; serving memory has one model
    wrong = sorted(set(flags) & (TRAINING_PLAN_FIELDS | {"runtime"}))
    if wrong:
        raise MemplanError(
            "a training setting: --inference estimates serving memory, which does not depend on it (drop it)",
            source=CLI,
            field=_flag(wrong[0]),
        )


def _check_plan_model(named: str, plan_path: str, model_ref: str, model: ModelSpec) -> None:
    """A plan file that names another model than the command's is refused (its degrees, batch and
    recomputation were chosen for that model). The plan's model is read beside the plan file first
    (``memplan tune`` writes it relative to the file); one that cannot be read is not compared."""
    if named == model_ref:
        return
    beside = Path(plan_path).parent / named
    try:
        other = load_model(str(beside) if beside.exists() else named)
    except (MemplanError, OSError, ValueError):
        return
    if _shape(other) != _shape(model):
        raise MemplanError(
            f"the plan file is for {short(other.name, 60)}, the command names {short(model.name, 60)}: give the same "
            "model, or remove model: from the plan file",
            source=short(plan_path),
            field="model",
        )


def _shape(model: ModelSpec) -> dict[str, Any]:
    """A model's fields without its name and source (the same config read from two places)."""
    return model.model_dump(exclude={"name", "source"})


def _workload(
    pf: PlanFile, flags: dict[str, Any], inference: bool, source: str
) -> TrainingWorkload | InferenceWorkload:
    base = dict(pf.workload or {})
    kind = base.pop("kind", "training")
    if kind not in ("training", "inference"):
        raise MemplanError(f"unknown kind {kind!r} (training, inference)", source=source, field="workload.kind")
    unknown = sorted(set(base) - TRAINING_FIELDS - INFERENCE_FIELDS)
    if unknown:
        raise MemplanError("unknown field", source=source, field=f"workload.{unknown[0]}")
    own, other = (INFERENCE_FIELDS, TRAINING_FIELDS) if kind == "inference" else (TRAINING_FIELDS, INFERENCE_FIELDS)
    misplaced = sorted(set(base) & other - own)
    if misplaced:
        raise MemplanError(f"not a field of {kind} workloads", source=source, field=f"workload.{misplaced[0]}")
    serving = inference or kind == "inference"
    # a flag of the other kind of workload would be ignored without a word: refuse it
    wrong = sorted(set(flags) & (TRAINING_FIELDS if serving else INFERENCE_FIELDS | {"context"}))
    if wrong:
        needs = "training (drop --inference)" if serving else "--inference"
        raise MemplanError(f"only applies with {needs}", source=CLI, field=_flag(wrong[0]))
    if serving:
        if "context" in flags:
            flags = {**flags, "prompt_tokens": flags["context"], "generated_tokens": 0}
        data = {k: v for k, v in base.items() if k in INFERENCE_FIELDS}
        data.update({k: v for k, v in flags.items() if k in INFERENCE_FIELDS})
        try:
            return _validate_section(InferenceWorkload, data, set(flags), source, "workload")
        except MemplanError as err:
            if "context" in flags and err.field == "--prompt-tokens":  # --context set prompt_tokens
                raise MemplanError(err.reason, source=CLI, field="--context") from None
            raise
    data = {k: v for k, v in base.items() if k in TRAINING_FIELDS}
    data.update({k: v for k, v in flags.items() if k in TRAINING_FIELDS})
    return _validate_section(TrainingWorkload, data, set(flags), source, "workload")
