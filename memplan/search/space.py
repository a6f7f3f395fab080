"""The plans ``memplan tune`` searches: every valid layout of a model's training on the GPUs.

World size = dp x tp x pp x cp, every GPU used. One plan per combination of:

- ``tp``: divisors of the GPUs per node (TP stays inside the NVLink domain) that the attention
  and KV heads split over;
- ``cp``: divisors of the sequence up to ``max_cp``. Context parallelism pays off for long
  sequences only (ring attention's K/V passes hide behind the attention compute once s is in
  the tens of thousands; Megatron-LM and torchtitan use it from 16k-32k up), so by default it
  is offered when ``seq_len >= 16384``, up to 8;
- ``pp``: divisors of the layers that divide the GPUs left, ``dp`` the rest;
- ``ep`` (MoE only): divisors of the experts that divide dp x cp (EP lives inside the
  data x context group, as in Megatron-LM);
- ``global_batch``: fixed, or every power of two inside a range and its two ends;
- ``micro_batch``: powers of two up to a cap that divide the global batch over dp (fixed
  when given);
- ``schedule``: 1F1B, or interleaved with ``virtual_stages`` chunks when pp > 1, the layers
  split into pp x v chunks and the micro-batches per step into multiples of pp (Megatron-LM's
  conditions);
- ``zero``: 0-3 (0 only when dp x cp = 1: nothing to shard over);
- ``offload`` (only when allowed): optimizer states to CPU (ZeRO >= 1), or optimizer states
  and parameters (ZeRO-3, FSDP2's CPUOffloadPolicy);
- ``offload_activations`` (only when allowed, for the loops that run it: ``hf`` with TRL's
  ``OffloadActivations``, ``hf-loop`` with ``save_on_cpu``, the bundled trainer, ``memplan``, with
  ``save_on_cpu`` on the plans it offloads: tp = pp = cp = 1, no FSDP2, recompute none or full):
  the saved activations kept in pinned host memory, paid for by the time model's PCIe term
  (``time.activation_offload_s``);
- ``recompute``: none, selective, selective-op, full;
- ``precision``: the allowed ones (default: the plan's default, bf16-master, only);
- ``quant`` (fine-tuning only): the base weights' format, fixed unless ``--allow-quantization``
  offers the others (none, int8, nf4 for LoRA; nf4, fp4, int8 for QLoRA).

Fine-tuning (``finetune: lora | qlora``) keeps its adapter settings (rank, targets, dropout,
modules trained in full) fixed over the space. With offload allowed, one GPU (dp x cp = 1) is
also tried with ZeRO-1 and the optimizer on the CPU (ZeRO-Offload, as DeepSpeed runs it on one GPU)
and with ZeRO-3 and the optimizer and parameters on the CPU (ZeRO-Infinity's CPU offload, FSDP2's
CPUOffloadPolicy), and with ZeRO-3 and the optimizer states on NVMe, the parameters on the GPU,
the CPU or NVMe (ZeRO-Infinity's NVMe tier).

Sequence parallelism is on whenever tp > 1 (it only saves memory and costs no extra
communication: Korthikanti et al. 2022). Every plan passes ``check_compatible``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import product
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from memplan.costmodel import trainer_offload as TO
from memplan.costmodel.memory import OFFLOAD_MECHANISM
from memplan.errors import MemplanError
from memplan.specs.job import check_compatible
from memplan.specs.model import ModelSpec
from memplan.specs.plan import ActivationOffload, Finetune, OptimizerName, Plan, PrecisionName, Quant, fsdp_build
from memplan.specs.workload import TrainingWorkload

CP_FROM_SEQ_LEN = 16384  # context parallelism is offered from this sequence length up
CP_MAX = 8
RECOMPUTE = ("none", "selective", "selective-op", "full")
# what a plan offloads, as a coordinate: "none", "optimizer", "optimizer+params", with "(nvme)" after
# what goes to NVMe ("optimizer(nvme)+params", "optimizer(nvme)+params(nvme)")
Offload = str
# the order Optuna samples the dimensions in, and the order of a plan's coordinates
DIMENSIONS = (
    "tp",
    "pp",
    "cp",
    "ep",
    "schedule",
    "zero",
    "offload",
    "recompute",
    "micro_batch",
    "global_batch",
    "precision",
    "quant",
    "offload_activations",
)


class SpaceOptions(BaseModel):
    """What the search may vary, besides the model and the GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: int = Field(gt=0, description="Total GPUs; every plan uses all of them.")
    gpus_per_node: int = Field(8, gt=0, description="GPUs per node: TP stays inside one.")
    seq_len: int = Field(2048, gt=0)
    global_batches: tuple[int, ...] | None = Field(
        None, description="Global batches to try (sequences); None: no accumulation (global = micro x dp)."
    )
    micro_batch: int | None = Field(None, gt=0, description="A fixed micro-batch; None: searched.")
    max_micro_batch: int = Field(16, gt=0, description="Largest micro-batch tried.")
    precisions: tuple[PrecisionName, ...] = ("bf16-master",)  # Plan's default, as every command's
    allow_offload: bool = False
    max_cp: int | None = Field(None, gt=0, description=f"None: {CP_MAX} from seq_len {CP_FROM_SEQ_LEN} up, else 1.")
    sequence_parallel: bool = True
    virtual_stages: int = Field(2, ge=2, description="Chunks per rank of the interleaved schedule.")
    optimizer: OptimizerName = "adamw"
    finetune: Finetune = "full"
    lora_rank: int = Field(16, gt=0)
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    modules_to_save: tuple[str, ...] = ()
    quants: tuple[Quant, ...] = Field(("none",), min_length=1, description="Base weight formats tried.")
    offload_activations: tuple[ActivationOffload, ...] = Field(
        ("none",), min_length=1, description="Activation offload settings tried (activation_offloads)."
    )
    offload_runtime: str | None = Field(
        None,
        description="The loop whose activation offload is tried: for the bundled trainer (memplan), only the "
        "plans it runs and the model follows (trainer_offload.unmodelled); None: every plan.",
    )

    def finetune_fields(self, quant: str) -> dict[str, Any]:
        """The plan fields of this fine-tuning mode over a ``quant`` base (none for full training)."""
        if self.finetune == "full":
            return {}
        four_bit = quant in ("nf4", "fp4")
        return {
            "finetune": "qlora" if quant != "none" else "lora",
            "lora_rank": self.lora_rank,
            "lora_targets": self.lora_targets,
            "lora_dropout": self.lora_dropout,
            "modules_to_save": self.modules_to_save,
            "quant": quant,
            "double_quant": four_bit and self.finetune == "qlora",
        }


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the space: a plan and the workload it runs (micro and global batch)."""

    plan: Plan
    workload: TrainingWorkload

    @property
    def coordinates(self) -> dict[str, Any]:
        """The plan's value on each dimension of :data:`DIMENSIONS`."""
        p, w = self.plan, self.workload
        offload = "none"
        if p.offload_optimizer != "none":
            offload = "optimizer" + ("(nvme)" if p.offload_optimizer == "nvme" else "")
            if p.offload_params != "none":
                offload += "+params" + ("(nvme)" if p.offload_params == "nvme" else "")
        return {
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "ep": p.ep,
            "schedule": p.pp_schedule,
            "zero": p.zero,
            "offload": offload,
            "recompute": p.recompute,
            "micro_batch": w.micro_batch,
            "global_batch": w.global_batch,
            "precision": p.precision,
            "quant": p.quant,
            "offload_activations": p.offload_activations,
        }

    @property
    def offload_label(self) -> str:
        """What the plan offloads, for a table: ``none``, ``optimizer``, ``optimizer+params``, with
        ``+activations`` (or ``activations`` alone)."""
        coords = self.coordinates
        parts = [coords["offload"]] if coords["offload"] != "none" else []
        parts += ["activations"] if coords["offload_activations"] != "none" else []
        return "+".join(parts) or "none"

    @property
    def key(self) -> tuple:
        return tuple(self.coordinates.values())

    def describe(self) -> str:
        """One line, e.g. ``dp=8 tp=8 pp=2 (interleaved x2) zero=1 recompute=selective micro-batch=1``."""
        p, w = self.plan, self.workload
        parts = [f"dp={p.dp}", f"tp={p.tp}", f"pp={p.pp}"]
        if p.pp_schedule == "interleaved":
            parts[-1] += f" (interleaved x{p.virtual_stages})"
        parts += [f"{k}={getattr(p, k)}" for k in ("cp", "ep") if getattr(p, k) > 1]
        parts += [f"zero={p.zero}", f"recompute={p.recompute}", f"micro-batch={w.micro_batch}"]
        if w.global_batch is not None:
            parts.append(f"global-batch={w.global_batch}")
        if p.offload_optimizer != "none":
            parts.append("offload=" + self.coordinates["offload"])
        if p.offload_activations != "none":
            parts.append(f"offload-activations={p.offload_activations}")
        parts.append(p.precision)
        if p.finetune != "full":
            parts.append(f"{p.finetune} r={p.lora_rank}" + (f" base={p.quant}" if p.quant != "none" else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Space:
    """The enumerated plans, and the choices each dimension takes over them."""

    candidates: tuple[Candidate, ...]

    @cached_property
    def values(self) -> dict[str, tuple]:
        """Every dimension's values, in the order they first appear."""
        seen: dict[str, dict] = {dim: {} for dim in DIMENSIONS}
        for c in self.candidates:
            for dim, value in c.coordinates.items():
                seen[dim].setdefault(value, None)
        return {dim: tuple(v) for dim, v in seen.items()}

    @cached_property
    def choices(self) -> dict[str, tuple]:
        """The dimensions that vary (more than one value): what a sampler chooses."""
        return {dim: v for dim, v in self.values.items() if len(v) > 1}

    @cached_property
    def index(self) -> dict[tuple, Candidate]:
        return {c.key: c for c in self.candidates}

    def find(self, params: dict[str, Any]) -> Candidate | None:
        """The candidate at ``params`` (the varying dimensions; the rest take their one
        value), or None when that combination is not a valid plan."""
        key = tuple(params[d] if d in params else self.values[d][0] for d in DIMENSIONS)
        return self.index.get(key)

    def nearest(self, params: dict[str, Any]) -> Candidate:
        """The valid candidate closest to ``params``: the one that keeps the most leading
        dimensions of :data:`DIMENSIONS` (tp first), and on the first one it must change takes
        the nearest value (integers by their ratio). How the study maps a combination that is
        not a plan (a micro-batch too large for the data-parallel share, ZeRO without data
        parallelism) onto one that is."""
        found = self.find(params)
        if found is not None:
            return found
        wanted = tuple(params.get(d, self.values[d][0]) for d in DIMENSIONS)
        if wanted not in self._nearest:
            # the lexicographic minimum of the per-dimension distances, one dimension at a time
            pool = list(self.index)
            for i, value in enumerate(wanted):
                distances = [_distance(key[i], value) for key in pool]
                closest = min(distances)
                pool = [key for key, dist in zip(pool, distances, strict=True) if dist == closest]
                if len(pool) == 1:
                    break
            self._nearest[wanted] = self.index[pool[0]]
        return self._nearest[wanted]

    @cached_property
    def _nearest(self) -> dict[tuple, Candidate]:
        return {}

    def params(self, candidate: Candidate) -> dict[str, Any]:
        """A candidate's values on the varying dimensions (what ``enqueue_trial`` takes)."""
        coords = candidate.coordinates
        return {dim: coords[dim] for dim in self.choices}

    def __len__(self) -> int:
        return len(self.candidates)


def _distance(a: Any, b: Any) -> float:
    """0 when equal, |log2(a / b)| for two positive integers, else 1."""
    if a == b:
        return 0.0
    if isinstance(a, int) and isinstance(b, int) and a > 0 and b > 0:
        return abs(math.log2(a / b))
    return 1.0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(upto: int) -> list[int]:
    out, p = [], 1
    while p <= upto:
        out.append(p)
        p *= 2
    return out


def global_batch_range(low: int, high: int) -> tuple[int, ...]:
    """The global batches tried for a range: its ends and every power of two between them."""
    return tuple(sorted({low, high, *(p for p in powers_of_two(high) if p >= low)}))


def tp_choices(model: ModelSpec, options: SpaceOptions) -> list[int]:
    """Divisors of the node size (and of the world) that the attention and KV heads split over
    (training splits the KV heads, as Megatron-LM requires: ``check_compatible``)."""
    return [
        t
        for t in divisors(options.gpus_per_node)
        if options.gpus % t == 0 and model.num_attention_heads % t == 0 and model.kv_heads % t == 0
    ]


def cp_choices(options: SpaceOptions, ranks: int) -> list[int]:
    limit = options.max_cp or (CP_MAX if options.seq_len >= CP_FROM_SEQ_LEN else 1)
    return [c for c in divisors(ranks) if c <= limit and options.seq_len % c == 0]


def pp_choices(model: ModelSpec, ranks: int) -> list[int]:
    return [p for p in divisors(ranks) if model.num_layers % p == 0]


def ep_choices(model: ModelSpec, group: int) -> list[int]:
    if model.moe is None:
        return [1]
    return [e for e in divisors(group) if model.moe.num_experts % e == 0]


def micro_batch_choices(options: SpaceOptions, global_batch: int | None, dp: int) -> list[int]:
    if global_batch is not None and global_batch % dp:
        return []
    per_replica = global_batch // dp if global_batch is not None else None
    wanted = [options.micro_batch] if options.micro_batch else powers_of_two(options.max_micro_batch)
    return [m for m in wanted if per_replica is None or per_replica % m == 0]


def schedule_choices(model: ModelSpec, options: SpaceOptions, pp: int, accumulation: int) -> list[tuple[str, int]]:
    """(pp_schedule, virtual_stages) pairs: 1F1B, and interleaved where it applies."""
    out = [("1f1b", 1)]
    v = options.virtual_stages
    if pp > 1 and model.num_layers % (pp * v) == 0 and accumulation % pp == 0:
        out.append(("interleaved", v))
    return out


def zero_choices(dp: int, cp: int, allow_offload: bool) -> tuple[int, ...]:
    """ZeRO stages: 0-3 over several data ranks. On one, 0, and when offload is allowed 1 (the
    optimizer step on the CPU: ZeRO-Offload, which DeepSpeed runs on a single GPU) and 3 (the
    parameters on the CPU too: ZeRO-Infinity, FSDP2's CPUOffloadPolicy). Stage 2 on one rank is
    stage 1 (no gradients to shard), so it is not tried twice."""
    if dp * cp > 1:
        return (0, 1, 2, 3)
    return (0, 1, 3) if allow_offload else (0,)


# ZeRO-3 on one rank with NVMe (ZeRO-Infinity): the optimizer states on NVMe (DeepSpeed offloads
# to NVMe under stage 3 only), the parameters on the GPU, the CPU or NVMe
NVME_ONE_RANK = [("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")]


def offload_choices(zero: int, allow: bool, sharded: bool = True) -> list[tuple[str, str]]:
    """(offload_optimizer, offload_params) pairs. ZeRO on one rank runs only with offload: stage 1
    with the optimizer on the CPU, stage 3 with the optimizer and the parameters on the CPU, or
    the optimizer on NVMe (:data:`NVME_ONE_RANK`): what people run on one GPU when the host's RAM
    cannot hold the CPU tier (the time model charges the NVMe traffic, ``time._nvme``)."""
    if not sharded and zero >= 1:
        return [("cpu", "cpu"), *NVME_ONE_RANK] if zero == 3 else [("cpu", "none")]
    out = [("none", "none")]
    if allow and zero >= 1:
        out.append(("cpu", "none"))
    if allow and zero == 3:
        out.append(("cpu", "cpu"))
    return out


def activation_offloads(allow_offload: bool, runtime: str) -> tuple[ActivationOffload, ...]:
    """The activation offload settings a search tries: ``cpu`` too when offload is allowed and the
    runtime's loop runs it (``memory.OFFLOAD_MECHANISM``: TRL's hooks under the Trainer, ``save_on_cpu``
    in a hand-written loop and in the bundled trainer; Megatron-LM's is not modelled)."""
    return ("none", "cpu") if allow_offload and runtime in OFFLOAD_MECHANISM else ("none",)


def _layouts(model: ModelSpec, options: SpaceOptions) -> Iterator[tuple[int, int, int, int, int]]:
    """(tp, cp, pp, dp, ep) of every way to split the GPUs."""
    world = options.gpus
    for tp in tp_choices(model, options):
        for cp in cp_choices(options, world // tp):
            for pp in pp_choices(model, world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for ep in ep_choices(model, dp * cp):
                    yield tp, cp, pp, dp, ep


def enumerate_space(model: ModelSpec, options: SpaceOptions) -> Space:
    """Every valid plan of ``model`` on ``options.gpus`` GPUs (see the module docstring)."""
    out: list[Candidate] = []
    for tp, cp, pp, dp, ep in _layouts(model, options):
        for gb in options.global_batches or (None,):
            for mb in micro_batch_choices(options, gb, dp):
                workload = TrainingWorkload(seq_len=options.seq_len, micro_batch=mb, global_batch=gb)
                accumulation = gb // (mb * dp) if gb is not None else 1
                for schedule, v in schedule_choices(model, options, pp, accumulation):
                    for zero in zero_choices(dp, cp, options.allow_offload):
                        offloads = offload_choices(zero, options.allow_offload, dp * cp > 1)
                        for off_opt, off_params in offloads:
                            for recompute in RECOMPUTE:
                                for precision in options.precisions:
                                    for quant, act in product(options.quants, options.offload_activations):
                                        plan = _plan(
                                            dp=dp, tp=tp, sequence_parallel=options.sequence_parallel and tp > 1,
                                            pp=pp, pp_schedule=schedule, virtual_stages=v, cp=cp, ep=ep,
                                            zero=zero, offload_optimizer=off_opt, offload_params=off_params,
                                            recompute=recompute, precision=precision, optimizer=options.optimizer,
                                            offload_activations=act,
                                            **options.finetune_fields(quant),
                                        )  # fmt: skip
                                        if plan is None or not _compatible(
                                            model, workload, plan, options.offload_runtime
                                        ):
                                            continue
                                        plan = fsdp_build(plan, (), options.offload_runtime or "", model)
                                        if act != "none" and not _offloadable(plan, accumulation, options):
                                            continue
                                        out.append(Candidate(plan, workload))
    return Space(tuple(out))


def _plan(**fields: Any) -> Plan | None:
    try:
        return Plan(**fields)
    except ValueError:  # pydantic's ValidationError is a ValueError
        return None


def _offloadable(plan: Plan, accumulation: int, options: SpaceOptions) -> bool:
    """Whether the loop offloads this plan's activations: the bundled trainer on one
    tensor-parallel rank without pipeline, FSDP2 or selective recomputation (and no accumulation
    over data parallel); the hf loops, any plan."""
    if options.offload_runtime != "memplan":
        return True
    return TO.unmodelled(plan) is None and TO.unmodelled_accumulation(plan, accumulation) is None


def _compatible(model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str | None) -> bool:
    try:
        check_compatible(model, workload, plan, runtime or "memplan")
    except MemplanError:
        return False
    return True
