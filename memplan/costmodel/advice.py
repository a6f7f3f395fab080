"""What would make a plan fit: single changes to the plan, each estimated, ranked by memory saved.

The world size is kept: more TP or PP takes ranks from data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.costmodel.memory import estimate_memory
from memplan.errors import MemplanError
from memplan.specs.job import check_compatible
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload


@dataclass(frozen=True, slots=True)
class Suggestion:
    change: str
    reserved: int
    saved: int
    fits: bool


def _candidates(plan: Plan, workload: TrainingWorkload | InferenceWorkload) -> list[tuple[str, dict, dict]]:
    """(description, plan update, workload update) for each single change worth trying."""
    out: list[tuple[str, dict, dict]] = []
    training = isinstance(workload, TrainingWorkload)
    if training and plan.zero < 3 and plan.dp * plan.cp > 1:
        out.append((f"ZeRO stage {plan.zero + 1}", {"zero": plan.zero + 1}, {}))
    if training and plan.zero < 3 and plan.dp * plan.cp > 1:
        out.append(("ZeRO stage 3", {"zero": 3}, {}))
    if training and plan.attention == "eager":
        out.append(("flash attention", {"attention": "flash"}, {}))
    if training and plan.recompute == "none":
        out.append(("selective recomputation", {"recompute": "selective"}, {}))
    if training and plan.recompute in ("none", "selective"):
        out.append(("per-op selective recomputation", {"recompute": "selective-op"}, {}))
    if training and plan.recompute != "full":
        out.append(("full recomputation", {"recompute": "full", "recompute_layers": None}, {}))
    if training and workload.micro_batch > 1:
        out.append((f"micro-batch {workload.micro_batch // 2}", {}, {"micro_batch": workload.micro_batch // 2}))
    if plan.dp % 2 == 0:
        out.append((f"tp {plan.tp * 2} (dp {plan.dp // 2})", {"tp": plan.tp * 2, "dp": plan.dp // 2}, {}))
        out.append((f"pp {plan.pp * 2} (dp {plan.dp // 2})", {"pp": plan.pp * 2, "dp": plan.dp // 2}, {}))
    if plan.tp > 1 and not plan.sequence_parallel and training:
        out.append(("sequence parallelism", {"sequence_parallel": True}, {}))
    if training and plan.offload_optimizer == "none" and plan.zero >= 1:
        out.append(("offload optimizer to CPU", {"offload_optimizer": "cpu"}, {}))
    if training and plan.offload_params == "none" and plan.zero == 3:
        out.append(("offload parameters to CPU", {"offload_params": "cpu"}, {}))
    if plan.precision in ("fp32", "bf16-mixed"):
        out.append(("precision bf16-master", {"precision": "bf16-master"}, {}))
    if training and plan.optimizer == "adamw":
        out.append(("8-bit AdamW", {"optimizer": "adamw-8bit"}, {}))
    if not training and workload.kv_dtype in ("bf16", "fp16", "fp32"):
        out.append(("fp8 KV cache", {}, {"kv_dtype": "fp8"}))
    return out


def suggest(
    model: ModelSpec,
    workload: TrainingWorkload | InferenceWorkload,
    plan: Plan,
    runtime: str,
    capacity_bytes: int,
    current_reserved: int,
    device: str = "cuda",
) -> list[Suggestion]:
    """Single changes that lower the reserved peak, those that fit first, then by bytes saved."""
    results = []
    for change, plan_update, workload_update in _candidates(plan, workload):
        try:
            new_plan = Plan.model_validate({**plan.model_dump(), **plan_update})
            new_workload = workload.model_copy(update=workload_update)
            check_compatible(model, new_workload, new_plan)
        except (MemplanError, ValueError):
            continue
        reserved = estimate_memory(model, new_workload, new_plan, runtime, device).peak.reserved
        if reserved < current_reserved:
            results.append(Suggestion(change, reserved, current_reserved - reserved, reserved <= capacity_bytes))
    return sorted(results, key=lambda s: (not s.fits, -s.saved))
