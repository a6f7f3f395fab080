"""Resolve a model reference, an optional plan file and command-line overrides into one job.

Precedence: command-line flags, then the plan file, then defaults. Errors name the flag
(``--tp``) when a flag set the value, else the plan file and the field path (``plan.tp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.job import PlanFile, RuntimeName, check_compatible
from memplan.specs.loader import load_gpu, load_model, read_data, validate
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

CLI = "command line"
PLAN_FIELDS = set(Plan.model_fields)
TRAINING_FIELDS = {"seq_len", "micro_batch", "global_batch"}
INFERENCE_FIELDS = {"batch", "prompt_tokens", "generated_tokens", "kv_dtype", "block_size"}


@dataclass(frozen=True)
class Job:
    """Everything one estimate needs, validated and mutually consistent."""

    model: ModelSpec
    workload: TrainingWorkload | InferenceWorkload
    plan: Plan
    gpu: GPUSpec
    cluster: ClusterSpec
    runtime: RuntimeName


def _flag(field: str) -> str:
    return "--" + field.split(".")[-1].replace("_", "-")


def _validate_section(cls: type, data: dict, flags: set[str], source: str, prefix: str) -> Any:
    """Validate one section; blame the flag when the faulty field came from the command line."""
    try:
        return validate(cls, data, source, prefix)
    except MemplanError as err:
        name = (err.field or "").split(".")[-1]
        if name in flags:
            raise MemplanError(err.reason, source=CLI, field=_flag(name)) from None
        raise


def resolve_job(model_ref: str, plan_path: str | None, overrides: dict[str, Any], inference: bool = False) -> Job:
    """Build a :class:`Job` from a model, an optional plan YAML and flag values (None = unset)."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    source = plan_path or CLI
    pf = PlanFile()
    if plan_path:
        pf = validate(PlanFile, read_data(Path(plan_path)), plan_path)
    model = load_model(model_ref)

    plan_data = {**(pf.plan or {}), **{k: v for k, v in flags.items() if k in PLAN_FIELDS}}
    gpus = flags.get("gpus", pf.gpus)
    nodes = flags.get("nodes", pf.nodes) or 1
    if gpus is not None and "dp" not in plan_data:
        per_replica = (plan_data.get("tp", 1) or 1) * (plan_data.get("pp", 1) or 1) * (plan_data.get("cp", 1) or 1)
        if not isinstance(per_replica, int) or per_replica <= 0 or gpus % per_replica:
            raise MemplanError(f"{gpus} GPUs is not a multiple of tp x pp x cp = {per_replica}", source=CLI,
                               field="--gpus")
        plan_data["dp"] = gpus // per_replica
    plan = _validate_section(Plan, plan_data, set(flags), source, "plan")
    if gpus is not None and plan.world_size != gpus:
        raise MemplanError(f"dp x tp x pp x cp = {plan.world_size} but --gpus is {gpus}", source=CLI, field="--gpus")
    world = gpus or plan.world_size
    if world % nodes:
        raise MemplanError(f"{world} GPUs do not split evenly over {nodes} nodes", source=CLI, field="--nodes")

    workload = _workload(pf, flags, inference, source)
    gpu = load_gpu(flags.get("gpu") or pf.gpu or "h100-sxm")
    cluster = ClusterSpec(gpus_per_node=max(world // nodes, 1), nodes=nodes)
    try:
        check_compatible(model, workload, plan)
    except MemplanError as err:
        name = (err.field or "").split(".")[-1]
        blame = CLI if name in flags or name == "dp" or not plan_path else plan_path
        field = _flag(name) if blame == CLI else err.field
        raise MemplanError(err.reason, source=blame, field=field) from None
    runtime = flags.get("runtime") or pf.runtime or "memplan"
    if runtime not in ("memplan", "hf", "megatron"):
        raise MemplanError(f"unknown runtime {runtime!r} (memplan, hf, megatron)", source=CLI, field="--runtime")
    return Job(model, workload, plan, gpu, cluster, runtime)


def _workload(pf: PlanFile, flags: dict[str, Any], inference: bool, source: str) -> TrainingWorkload | InferenceWorkload:
    base = dict(pf.workload or {})
    kind = base.pop("kind", "training")
    if kind not in ("training", "inference"):
        raise MemplanError(f"unknown kind {kind!r} (training, inference)", source=source, field="workload.kind")
    unknown = sorted(set(base) - TRAINING_FIELDS - INFERENCE_FIELDS)
    if unknown:
        raise MemplanError("unknown field", source=source, field=f"workload.{unknown[0]}")
    if inference or kind == "inference":
        if "context" in flags:
            flags = {**flags, "prompt_tokens": flags["context"], "generated_tokens": 0}
        data = {k: v for k, v in base.items() if k in INFERENCE_FIELDS}
        data.update({k: v for k, v in flags.items() if k in INFERENCE_FIELDS})
        return _validate_section(InferenceWorkload, data, set(flags), source, "workload")
    data = {k: v for k, v in base.items() if k in TRAINING_FIELDS}
    data.update({k: v for k, v in flags.items() if k in TRAINING_FIELDS})
    return _validate_section(TrainingWorkload, data, set(flags), source, "workload")
