"""The tight band: how much headroom a "fits" needs before it is more than a coin flip.

A plan that fits with less headroom than the model's own measured error for that kind of plan
may run or may run out of memory, whatever the prediction says. The band is

    band = peak.reserved x error / (1 - error) + outside spread + capacity spread

- ``error``: the largest reserved-memory error, ``|predicted / measured - 1|`` (either sign:
  one run per mechanism does not tell a direction), measured on a GPU for the
  mechanisms the plan uses, under the model that answered (``reserved_detail.timeline``): the
  op-level run (``trainer``), or the phase model (``phases (...)``, ``serving``) per mechanism.
  A mechanism the phase model has not been measured on gets the largest phase-model error
  measured (:data:`UNMEASURED`), and says so. A prediction ``error`` below the measurement falls
  short of it by ``reserved x error / (1 - error)`` bytes: that is the band's first term.
- ``outside spread``: how far the measured memory outside the allocator went below the figure
  the model subtracts (``overhead.outside_memory``).
- ``capacity spread``: where a GPU profile's capacity is derived rather than measured, how far
  the derivation may be off (``GPUSpec.capacity_spread_bytes``).

The errors are predicted against measured ``max_memory_reserved`` of ``memplan validate`` runs on
one NVIDIA H200 (torch 2.11.0+cu130, Triton 3.6.0, transformers 5.17.0, peft 0.21.0,
bitsandbytes 0.50.2, memplan 4e861b9, 2026-11-27: ../shared/gpu-traces/README.md and
tests/data/gpu-traces/h200.json); tests/unit/test_margin.py holds each band at least as wide as
the current model's error on those runs.
"""

from __future__ import annotations

import math
from typing import Literal

from memplan.specs.plan import Plan

State = Literal["ample", "tight", "does not fit"]

OP_LEVEL = 0.0002  # six op-level plans on the H200 (1B, 8B, 70B; both allocators): reserved within 0.02%
OP_LEVEL_SOURCE = (
    "the op-level run: six H200 runs it was not built from (1B to 70B, both allocator modes) within 0.02% "
    "reserved; the mechanisms added since (DDP, ZeRO-2, CPU offload, bf16-master, fp32, selective-op, LoRA, "
    "QLoRA) replay the H200 runs they were read from within 0.006%; eight more runs on an H200 and an H100 "
    "(2026-11-28: ZeRO-1, DDP with selective-op, activation offload, a 70B TP 8 + SP x PP 4 x FSDP2 rank, the "
    "re-recorded 1F1B pipeline, LoRA and QLoRA nf4 over 8B alone, the 1B shapes whose time was profiled) "
    "within 0.01%; those checked against the bundled trainer on CPU only (accumulation under DDP, fp32 over "
    "dp > 1, LoRA variants, eager attention, also under autocast and LoRA, TP without SP, FSDP2 over tied "
    "embeddings, pipelines with TP, fp32 or bf16-master, q, k, v biases, CPU offload with accumulation or "
    "recompute, QLoRA variants, memplan's Triton attention under Triton's interpreter) and the CUDA kernels read "
    "from source only (the memory-efficient SDPA kernel, Triton's autotuning buffer) have no GPU run yet and "
    "take the same band; LLM.int8 bases (bitsandbytes' MatMul8bitLt, a GPU trace: h100_int8_1b) take their own"
)
HF_OP_LEVEL = 0.001  # six real Trainer runs on an H200 (2026-11-28): reserved within 0.09%, LLM.int8 aside
HF_OP_LEVEL_SOURCE = (
    "transformers' Trainer op by op: six real Trainer runs on an H200 with MemplanCallback (2026-11-28: full "
    "fine-tuning in bf16, autocast over fp32 with checkpointing, PEFT LoRA, QLoRA nf4, Qwen3; "
    "tests/data/gpu-runs/h200-2026-11-28.json, docs/accuracy-gpu.md) within 0.09% reserved"
)
HF_LOOP_OP_LEVEL_SOURCE = (
    "the hand-written transformers loop op by op: equal to the real loop's peak on CPU "
    "(tests/unit/test_timeline_hf_loop.py), not yet measured on a GPU, so the band is the hf phase model's "
    "measured error"
)
# op-level runs a GPU run found off, per run and mechanism: (reserved error, the run). A plan with the
# mechanism takes the larger of this and the run's own band (tests/data/gpu-runs/*.json)
OP_LEVEL_MISSES: dict[str, dict[str, tuple[float, str]]] = {
    "trainer": {
        "LLM.int8": (0.030, "v-1b-qlora-int8 (the bundled trainer over an 8-bit base, H200, 2026-11-28): +2.99%"),
    },
    "hf": {
        "LLM.int8": (0.027, "llama1b-lora-int8 (the Trainer over an 8-bit base, H200, 2026-11-28): -2.64%"),
    },
}


def _op_level(which: str, plan: Plan | None, error: float, basis: str) -> tuple[float, str]:
    """The op-level band, widened by the GPU misses of the plan's mechanisms (:data:`OP_LEVEL_MISSES`)."""
    if plan is None:
        return error, basis
    misses = OP_LEVEL_MISSES.get(which, {})
    uses = {"LLM.int8": plan.quant == "int8"}
    for name, (miss, run) in misses.items():
        if uses[name]:
            error, basis = max(error, miss), f"{basis}; but {name} measured off: {run}"
    return error, basis


# (error, what measured it): the phase model's reserved error on the H200, per mechanism, rounded up
# to 0.1% (the runs' exact errors: tests/unit/test_capacity_margin.py recomputes them)
PHASE_MEASURED: dict[str, tuple[float, str]] = {
    "pipeline": (0.156, "h200_b_pp4 (PP 4 x DP 2, ZeRO-2, 1F1B): -15.6%"),
    "DDP or ZeRO-2": (0.082, "h200_a_ddp1b (DDP): +3.4%; h200_b_z2_8b (ZeRO-2): -8.2%"),
    "offload": (0.255, "h200_b_off8b (FSDP2 CPU offload of parameters and optimizer): -25.5%"),
    "fp32": (0.222, "h200_a_fp32full (fp32, full recompute): -22.2%"),
    "bf16-master": (0.133, "h200_a_master1b (bf16-master): +13.2%"),
    "selective-op": (0.060, "h200_a_selop1b (selective-op): -6.0%"),
    "LoRA": (0.096, "h200_a_lora8b (LoRA r16 all-linear over bf16): -9.6%"),
    "QLoRA": (0.359, "h200_a_qlora8b (QLoRA nf4, bitsandbytes' CUDA kernels): -35.8%"),
    "hf": (0.11, "seven transformers Trainer runs (issue 28, H200, transformers 5.17): reserved to -11%"),
}
UNMEASURED = max(e for e, _ in PHASE_MEASURED.values())  # the largest phase-model error measured


class Band:
    """The headroom a plan needs to be more than a coin flip, and what it is made of: ``error``,
    the fraction measured; ``model``, which model answered ("op-level run" or "phase model");
    ``basis``, the mechanisms and the runs their error was measured on. A plain class: a frozen
    dataclass costs ~3.7 M instructions to build on ``memplan estimate``'s cold start."""

    __slots__ = ("bytes", "error", "model", "basis")

    def __init__(self, size: int, error: float, model: str, basis: str) -> None:
        self.bytes, self.error, self.model, self.basis = size, error, model, basis


def mechanisms(plan: Plan, runtime: str) -> list[str]:
    """The mechanisms of ``plan`` whose phase-model error is measured per mechanism (keys of
    :data:`PHASE_MEASURED`), or named as not measured."""
    found = []
    if runtime in ("hf", "hf-loop"):
        found.append("hf")
    elif runtime != "memplan":
        found.append(f"the {runtime} runtime")
    checks = [
        (plan.pp > 1 and plan.pp_schedule == "1f1b", "pipeline"),
        (plan.pp > 1 and plan.pp_schedule != "1f1b", f"the {plan.pp_schedule} pipeline schedule"),
        (plan.dp > 1 and plan.zero in (0, 2), "DDP or ZeRO-2"),
        (plan.dp > 1 and plan.zero == 1, "ZeRO-1"),
        (plan.offload_params != "none" or plan.offload_optimizer != "none", "offload"),
        (plan.offload_activations != "none", "activation offload"),
        (plan.precision == "fp32", "fp32"),
        (plan.precision == "bf16-master", "bf16-master"),
        (plan.precision in ("fp16-master", "fp8"), plan.precision),
        (plan.recompute == "selective-op", "selective-op"),
        (plan.recompute_layers is not None, "partial recomputation"),
        (plan.finetune == "lora", "LoRA"),
        (plan.finetune == "qlora", "QLoRA"),
        (plan.cp > 1 or plan.ep > 1, "context or expert parallelism"),
        (plan.optimizer != "adamw", f"the {plan.optimizer} optimizer"),
    ]
    found += [name for ok, name in checks if ok]
    return found


def phase_error(plan: Plan, runtime: str) -> tuple[float, str]:
    """The largest measured error among the plan's mechanisms; :data:`UNMEASURED` for those the
    phase model was not measured on (and for a plan none of them names: the model, the
    attention or the workload is what took it off the op-level run)."""
    names = mechanisms(plan, runtime)
    measured = [(PHASE_MEASURED[n][0], PHASE_MEASURED[n][1]) for n in names if n in PHASE_MEASURED]
    unmeasured = [n for n in names if n not in PHASE_MEASURED] or ([] if measured else ["this plan"])
    parts = [src for _, src in measured]
    error = max((e for e, _ in measured), default=0.0)
    if unmeasured:
        error = UNMEASURED
        largest = f"the largest phase-model error ({UNMEASURED:.1%})"
        parts.append(f"{', '.join(unmeasured)}: not measured on a GPU, {largest}")
    return error, "; ".join(parts)


def band(
    which: str, plan: Plan | None, runtime: str, reserved: int, outside_spread: int, capacity_spread: int = 0
) -> Band:
    """The tight band of a plan whose run ``which`` (``trainer``, ``hf``, ``hf-loop``, ``phases (...)``, ``serving``)
    reserved ``reserved`` bytes. Serving (``plan`` None or ``which == "serving"``) has not been
    measured on a GPU: it gets :data:`UNMEASURED`."""
    if which == "trainer":
        error, basis = _op_level(which, plan, OP_LEVEL, OP_LEVEL_SOURCE)
        model = "op-level run"
    elif which == "hf" and plan is not None:
        error, basis = _op_level(which, plan, HF_OP_LEVEL, HF_OP_LEVEL_SOURCE)
        model = "op-level run"
    elif which == "hf-loop" and plan is not None:
        error, measured = phase_error(plan, runtime)  # no GPU run of it yet: the hf phase model's error
        model, basis = "op-level run", f"{HF_LOOP_OP_LEVEL_SOURCE}; {measured}"
    elif which == "serving" or plan is None:
        error, model = UNMEASURED, "phase model"
        basis = f"serving: not measured on a GPU, the largest phase-model error ({UNMEASURED:.1%})"
    else:
        error, basis = phase_error(plan, runtime)
        model = "phase model"
    size = math.ceil(reserved * error / (1 - error)) + outside_spread + capacity_spread
    return Band(size, error, model, basis)


def state(fits: bool, headroom: int, band_bytes: int) -> State:
    """``ample`` when the headroom exceeds the band, ``tight`` when it fits within it."""
    if not fits:
        return "does not fit"
    return "tight" if headroom < band_bytes else "ample"
