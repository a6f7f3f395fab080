"""What would make a plan fit: changes to the plan, each estimated, and combinations of them
when no single change is enough.

The world size is kept: more TP or PP takes ranks from data parallelism. On one data-parallel
rank (dp x cp = 1) ZeRO shards nothing, so the changes there are the ones people run on one GPU:
ZeRO-Offload (ZeRO with the optimizer step and its states on the CPU, as DeepSpeed's ZeRO-Offload
tutorial runs a model on a single GPU), ZeRO-3 with parameters offloaded too (ZeRO-Infinity,
FSDP2's CPUOffloadPolicy) and ZeRO-Infinity's NVMe tier (the optimizer states on NVMe).

When the device fits and the node's host memory does not hold what the plan offloads
(``costmodel.host``), :func:`host_suggestions` proposes moving that share to NVMe or back.

When no single change fits, combinations of up to ``MAX_COMBINED`` changes that touch different
fields are estimated; those that fit, and contain no smaller combination that fits, are kept,
cheapest in step time first (when the GPU is given; else smallest peak first).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from memplan.costmodel.host import host_memory
from memplan.costmodel.inference import prefill_forward
from memplan.costmodel.memory import estimate_memory
from memplan.costmodel.reserve import plan_verdict, run_only
from memplan.costmodel.time import estimate_time
from memplan.errors import MemplanError
from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.job import check_compatible
from memplan.specs.model import ModelSpec
from memplan.specs.plan import TRANSFORMERS_RUNTIMES, Plan, changed_plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

MAX_COMBINED = 3  # changes in one combination
MAX_PARTS = 12  # single changes a combination is drawn from: at most C(12,2) + C(12,3) = 286 estimates (~0.1 s)
SHOWN_COMBINATIONS = 3


@dataclass(frozen=True, slots=True)
class Suggestion:
    change: str
    reserved: int
    saved: int
    fits: bool
    step_time_s: float | None = None  # predicted step time of the changed plan (training, GPU given)
    plan_update: tuple[tuple[str, object], ...] = ()  # the change itself, to estimate it in full
    workload_update: tuple[tuple[str, object], ...] = ()


Change = tuple[str, dict, dict]  # description, plan update, workload update
SERVER_CHUNK = 8192  # vLLM V1's max_num_batched_tokens for its API server on an H100 (inference.vllm_default_chunk)
# What transformers' Trainer (``hf``) and the hand-written loop over a transformers model (``hf-loop``) cannot
# change to: no tensor, pipeline or sequence parallelism, and checkpointing of whole decoder layers only
# (``gradient_checkpointing``); the hf-trainer exporter refuses the same (``export.hf_trainer.check``)
_NOT_IN_TRANSFORMERS_LOOPS = frozenset(
    {"tp", "pp", "sequence_parallel", "recompute=selective", "recompute=selective-op"}
)


def _runnable(change: Change, runtime: str) -> bool:
    """Whether the loop ``runtime`` names can run the change: under transformers' loops, none of
    ``_NOT_IN_TRANSFORMERS_LOOPS``."""
    if runtime not in TRANSFORMERS_RUNTIMES:
        return True
    keys = {f"recompute={v}" if k == "recompute" else k for k, v in change[1].items()}
    return not keys & _NOT_IN_TRANSFORMERS_LOOPS


def _candidates(plan: Plan, workload: TrainingWorkload | InferenceWorkload, runtime: str) -> list[Change]:
    """(description, plan update, workload update) for each single change worth trying that the
    loop ``runtime`` names can run (:func:`_runnable`)."""
    out: list[Change] = []
    training = isinstance(workload, TrainingWorkload)
    sharded = plan.dp * plan.cp > 1
    if training and plan.zero < 3 and sharded:
        out.append((f"ZeRO stage {plan.zero + 1}", {"zero": plan.zero + 1}, {}))
        if plan.zero < 2:
            out.append(("ZeRO stage 3", {"zero": 3}, {}))
    if training and not sharded and plan.offload_optimizer == "none":
        # one data-parallel rank: ZeRO only helps with the optimizer (and parameters) on the CPU
        out.append(
            ("ZeRO-Offload (zero 1, optimizer on the CPU)", {"zero": max(plan.zero, 1), "offload_optimizer": "cpu"}, {})
        )
        out.append(
            ("ZeRO-3 with parameters and optimizer on the CPU",
             {"zero": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}, {})
        )  # fmt: skip
        # ZeRO-Infinity's NVMe tier (DeepSpeed: NVMe under stage 3 only): the host keeps the fp32
        # gradients, the parameters and buffers, not the optimizer states
        out.append(
            ("ZeRO-Infinity (zero 3, optimizer on NVMe, parameters on the CPU)",
             {"zero": 3, "offload_optimizer": "nvme", "offload_params": "cpu"}, {})
        )  # fmt: skip
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
        if workload.micro_batch > 2:  # one sequence a micro-batch, the global batch by accumulation
            out.append(("micro-batch 1", {}, {"micro_batch": 1}))
    if plan.dp % 2 == 0:
        out.append((f"tp {plan.tp * 2} (dp {plan.dp // 2})", {"tp": plan.tp * 2, "dp": plan.dp // 2}, {}))
        out.append((f"pp {plan.pp * 2} (dp {plan.dp // 2})", {"pp": plan.pp * 2, "dp": plan.dp // 2}, {}))
    if plan.tp > 1 and not plan.sequence_parallel and training:
        out.append(("sequence parallelism", {"sequence_parallel": True}, {}))
    if training and plan.offload_optimizer == "none" and plan.zero >= 1:
        out.append(("offload optimizer to CPU", {"offload_optimizer": "cpu"}, {}))
    if training and plan.offload_params == "none" and plan.zero == 3:
        out.append(("offload parameters to CPU", {"offload_params": "cpu", "offload_optimizer": "cpu"}, {}))
    if plan.precision in ("fp32", "bf16-mixed"):
        out.append(("precision bf16-master", {"precision": "bf16-master"}, {}))
    if training and plan.optimizer == "adamw":
        out.append(("8-bit AdamW", {"optimizer": "adamw-8bit"}, {}))
    if training and plan.optimizer in ("adamw", "adamw-8bit") and plan.offload_optimizer == "none":
        # the states leave the allocator for CUDA unified memory (optimizer.paged_state_bytes); the
        # step time charges what pages to the host and back (time.paged_optimizer_s)
        out.append(("paged 8-bit AdamW", {"optimizer": "paged-adamw-8bit"}, {}))
    if not training and workload.kv_dtype in ("bf16", "fp16", "fp32"):
        out.append(("fp8 KV cache", {}, {"kv_dtype": "fp8"}))
    chunked = not training and workload.prefill_chunk is not None and workload.prefill_chunk <= SERVER_CHUNK
    if not training and not chunked and prefill_forward(workload).tokens > SERVER_CHUNK:
        # with a paged cache (vLLM): chunks over transformers' DynamicCache copy the prefix (inference.py)
        paged = {"prefill_chunk": SERVER_CHUNK, "block_size": workload.block_size or 16}
        out.append((f"chunked prefill, {SERVER_CHUNK} tokens per forward (vLLM, paged KV cache)", {}, paged))
    return [change for change in out if _runnable(change, runtime)]


@dataclass(frozen=True)
class _Estimator:
    """Estimates a changed plan: its reserved peak (the fast form) and, given a GPU, its step time."""

    model: ModelSpec
    workload: TrainingWorkload | InferenceWorkload
    plan: Plan
    runtime: str
    capacity_bytes: int
    current_reserved: int
    device: str
    gpu: GPUSpec | None
    cluster: ClusterSpec | None

    def __call__(self, change: str, plan_update: dict, workload_update: dict) -> Suggestion | None:
        try:
            new_plan = changed_plan(self.plan, plan_update, self.runtime, self.model)
            new_workload = self.workload.model_copy(update=workload_update)
            check_compatible(self.model, new_workload, new_plan, self.runtime)
            reserved = self.reserved(new_workload, new_plan)  # a run_only plan the GPU's kernels decline: none
        except (MemplanError, ValueError):
            return None
        fits = reserved <= self.capacity_bytes
        step = None
        if fits and self.gpu is not None and self.cluster is not None and isinstance(new_workload, TrainingWorkload):
            step = estimate_time(self.model, new_workload, new_plan, self.gpu, self.cluster, self.runtime).step_time_s
        return Suggestion(
            change,
            reserved,
            self.current_reserved - reserved,
            fits,
            step,
            tuple(plan_update.items()),
            tuple(workload_update.items()),
        )

    def reserved(self, workload: TrainingWorkload | InferenceWorkload, plan: Plan) -> int:
        """The changed plan's reserved peak: the phase model's (the fast form), or where the op-level
        run alone answers the plan (``reserve.run_only``: LoRA over an MoE model) that run replayed
        through the default caching allocator (the estimate of the change, ``estimation._verified``,
        replays it again under the job's allocator)."""
        if isinstance(workload, TrainingWorkload) and run_only(self.model, plan):
            from memplan.costmodel.allocator import AllocatorConfig

            config, limit = AllocatorConfig(), self.capacity_bytes
            return plan_verdict(self.model, workload, plan, self.runtime, config, limit, self.device, self.gpu).reserved
        return estimate_memory(self.model, workload, plan, self.runtime, self.device).peak.reserved


def suggest(
    model: ModelSpec,
    workload: TrainingWorkload | InferenceWorkload,
    plan: Plan,
    runtime: str,
    capacity_bytes: int,
    current_reserved: int,
    device: str = "cuda",
    gpu: GPUSpec | None = None,
    cluster: ClusterSpec | None = None,
    combine: bool = False,
) -> list[Suggestion]:
    """Changes that lower the reserved peak: those that fit first (cheapest step first when
    ``gpu`` and ``cluster`` are given), then by bytes saved. When no single change fits (or
    ``combine``: a single change the screen said fits did not, estimated in full), the smallest
    combinations that do (module docstring) come first."""
    estimate = _Estimator(model, workload, plan, runtime, capacity_bytes, current_reserved, device, gpu, cluster)
    singles: list[tuple[Change, Suggestion]] = []
    for change in _candidates(plan, workload, runtime):
        found = estimate(*change)
        if found is not None:
            singles.append((change, found))
    results = [s for _, s in singles if s.saved > 0]
    if singles and (combine or not any(s.fits for s in results)):
        # a change that saves nothing alone (recomputation while the optimizer step peaks) may
        # matter once another has moved the peak: every valid change takes part
        results = [*_combined(singles, estimate), *results]
    return sorted(results, key=rank_key)


def rank_key(s: Suggestion) -> tuple:
    """Fitting changes first, the cheapest in step time (then the smallest); then the largest savers."""
    if s.fits:
        return (0, s.step_time_s if s.step_time_s is not None else 0.0, s.reserved)
    return (1, -s.saved, 0.0)


def _combined(singles: list[tuple[Change, Suggestion]], estimate: _Estimator) -> list[Suggestion]:
    """The smallest combinations of single changes (different fields each) that fit, cheapest first."""
    parts = [c for c, _ in sorted(singles, key=lambda cs: -cs[1].saved)[:MAX_PARTS]]
    fitting: list[tuple[frozenset[int], Suggestion]] = []
    for size in range(2, MAX_COMBINED + 1):
        for chosen in combinations(range(len(parts)), size):
            if any(ids <= set(chosen) for ids, _ in fitting):
                continue  # a smaller combination inside it fits already
            merged = _merge([parts[i] for i in chosen])
            if merged is None:
                continue
            found = estimate(*merged)
            if found is not None and found.fits and found.saved > 0:
                fitting.append((frozenset(chosen), found))
    return sorted((s for _, s in fitting), key=rank_key)[:SHOWN_COMBINATIONS]


def _merge(changes: list[Change]) -> Change | None:
    """One change made of several, or None when two set the same field (differently) or one only
    repeats another (ZeRO-Offload already offloads the optimizer)."""
    plan: dict = {}
    workload: dict = {}
    for _, plan_update, workload_update in changes:
        for target, update in ((plan, plan_update), (workload, workload_update)):
            for key, value in update.items():
                if key in target:
                    return None
                target[key] = value
    return " + ".join(name for name, _, _ in changes), plan, workload


def _host_candidates(plan: Plan) -> list[Change]:
    """Changes that take the plan's host share elsewhere: optimizer states (and parameters) to NVMe
    (ZeRO-Infinity; DeepSpeed offloads to NVMe under ZeRO-3 only: docs/_pages/config-json.md,
    "NVMe offloading is available only with ZeRO stage 3"), activations kept on the GPU."""
    out: list[Change] = []
    if plan.offload_optimizer == "cpu":
        out.append(("optimizer states to NVMe (ZeRO-3)", {"zero": 3, "offload_optimizer": "nvme"}, {}))
        out.append(
            ("optimizer states and parameters to NVMe (ZeRO-3)",
             {"zero": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}, {})
        )  # fmt: skip
    if plan.offload_params == "cpu" and plan.offload_optimizer != "cpu":
        out.append(("parameters to NVMe", {"offload_params": "nvme"}, {}))
    if plan.offload_activations != "none":
        out.append(("activations kept on the GPU", {"offload_activations": "none"}, {}))
    return out


def host_suggestions(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    runtime: str,
    limit_bytes: int,
    current_reserved: int,
    ranks_per_node: int,
    host_bytes: int,
    device: str = "cuda",
) -> list[Suggestion]:
    """When the device fits and the node's host memory does not (``costmodel.host``): the changes
    of :func:`_host_candidates`, each estimated; ``fits`` when the device still fits (fast form)
    and the node's host bytes are within ``host_bytes``. Those that fit first, then the smallest
    device peak."""
    out = []
    for change, plan_update, _ in _host_candidates(plan):
        try:
            new_plan = changed_plan(plan, plan_update, runtime, model)
            check_compatible(model, workload, new_plan, runtime)
        except (MemplanError, ValueError):
            continue
        report = estimate_memory(model, workload, new_plan, runtime, device)
        reserved = report.peak.reserved
        host = host_memory(report, ranks_per_node, limit_bytes - reserved, host_bytes, "")
        fits = reserved <= limit_bytes and host.fits
        out.append(Suggestion(change, reserved, current_reserved - reserved, fits, None, tuple(plan_update.items())))
    return sorted(out, key=lambda s: (not s.fits, s.reserved))
