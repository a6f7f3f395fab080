"""The GPU checks in one command: tests, attention benchmark, ``memplan validate`` plans, fits boundary.

On whatever NVIDIA GPU this machine has, step by step:

1. ``pytest``: the tests marked ``gpu`` and ``kernels`` (``python -m pytest -m "gpu or kernels"``);
2. ``bench``: ``benchmarks/bench_attention.py --format json`` (memplan's Triton kernel against each
   SDPA backend);
3. ``validate``: ``memplan validate --format json`` on a plan list spanning Llama 1B / 8B / 70B
   shapes, FSDP2 / TP (+ sequence parallel) / PP, every recompute mode, fp32 / bf16 / bf16-mixed,
   both caching-allocator modes, one rank of the large plans simulated; plus transformers
   training steps measured against ``memplan estimate --runtime hf-loop`` (validate runs the bundled
   trainer only, so the suite measures the ``hf`` runtime with a worker of its own);
4. ``sweep``: for one or two plans, micro-batch 1, 2, 4, ... until the first out-of-memory:
   the estimate's fits against whether the run ran.

Then it writes a Markdown report (``--out``, default docs/accuracy-gpu.md) and a JSON with the
same data beside it (same stem, ``.json``). Every finished unit (the test run, the benchmark, one
plan, one micro-batch of a sweep) is recorded in a state JSON at once (default beside the report,
``<stem>.state.json``); a rerun skips what is recorded there (``--fresh`` starts over).

    python benchmarks/gpu_suite.py [--quick] [--dry-run] [--out docs/accuracy-gpu.md] [--state PATH]
                                   [--fresh] [--steps pytest,bench,validate,sweep] [--plans GLOB,...]
                                   [--time-limit S] [--spent S] [--list]

``--quick`` runs a subset of the plans in one command of at most 8 minutes on one H100 or H200, install
included (``benchmarks/gpu_quick.sh``): the memory-only units (simulated ranks, the tests) side by
side on the one GPU as separate processes, the step-time, out-of-memory-boundary and benchmark
units alone, in the schedule ``gpu_schedule.py`` makes of their budgets and predicted reserved
peaks (``--list`` and ``--dry-run`` print it); what would not fit is left for a rerun.
``--dry-run`` rehearses everything on CPU: each plan runs ``memplan validate --device cpu`` on a
tiny model of the same layout, the tests are only collected and the benchmark is skipped. Without a
GPU and without ``--dry-run`` it prints one line and exits 0. torch is imported only where needed
(never at module import).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import functools
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_schedule beside this file, however it is loaded
import gpu_schedule  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# A Llama-3.2-1B-shaped HF config (16 layers, hidden 2048, GQA 32/8, tied 128k vocabulary)
LLAMA1B_CONFIG = REPO.parent / "shared" / "gpu-traces" / "llama1b.config.json"
LLAMA1B_CONFIG_COPY = REPO / "tests" / "data" / "gpu-traces" / "llama1b.config.json"  # the same file, in the repo
LLAMA1B_PROFILE = "llama3.2-1b"  # a bundled profile, used when neither config is here
MODELS = {"1b": None, "8b": "llama3-8b", "70b": "llama3-70b"}  # 1b: resolved by llama1b_model()
DEFAULT_OUT = REPO / "docs" / "accuracy-gpu.md"
DRY_RUN_OUT = Path(tempfile.gettempdir()) / "gpu-suite-dry-run" / "accuracy-gpu.md"  # a dry run's default --out
STEPS = ("pytest", "bench", "validate", "sweep")
QUICK_LIMIT_S = 8 * 60  # --quick: one command, install included, on one H100 or H200
# The command's fixed costs, in the schedule. INSTALL_S: benchmarks/gpu_quick.sh's two pip installs (the
# carried pydantic wheels into a folder, then `pip install --no-deps --no-build-isolation -e .`) took
# 1.1 s and 1.9 s on the two-core machine here (2026-11-27); 15 s held. PROBE_S: the GPU probe (a child
# importing torch, 1.3 s here, and creating a CUDA context), the import preflight and the predictions
# (0.01-1 s a plan here): a guess. REPORT_S: the header (torch imported) and the report: a guess.
INSTALL_S = 15
PROBE_S = 15
REPORT_S = 10
# A unit's budget is its start-up plus its GPU phase. STARTUP_S: the process chain (estimate, validate,
# its worker importing torch) took 3.8-4.3 s a unit in the CPU dry run here, then the CUDA context: 20 s,
# a guess. The GPU phase, first CUDA allocation to exit, is the trace's span where a trace of the same
# plan exists (TRACE_SPANS), else 3 predicted steps (a warm-up, two measured) and BUILD_S: on the six H100
# traces the span less 3 predicted steps was 0.2-2.8 s. Beside others the GPU phase counts
# gpu_schedule.MAX_LANES times (the worst case: the lanes' GPU work one after another).
STARTUP_S = 20
BUILD_S = 3
# plan -> (trace in ../shared/gpu-traces of the same command, seconds from its first CUDA event to its last)
TRACE_SPANS: dict[str, tuple[str, float]] = {
    "v-8b-fsdp8-z3-full-bf16": ("t8_z3_bf16", 6.6),  # H100
    "v-8b-fsdp8-z3-selective": ("t8_sel", 3.3),  # H100
    "v-8b-tp2sp-fsdp4-z3-full-exp": ("t8_tp2_x", 5.1),  # H100
    "v-70b-fsdp64-z3-full": ("t70_z3", 16.3),  # H100
    "v-1b-full-fp32-exp": ("h200_a_fp32full", 8.9),  # H200 (shared with other processes then)
    "s-1b-none-bf16mixed/mb2": ("t1b_none", 3.0),  # H100
    "s-8b-fsdp8-z3-full-bf16/mb2": ("t8_z3_bf16", 6.6),  # H100
}
STATE_VERSION = 1
RESULT_TAG = "GPU_SUITE_RESULT "  # the hf worker's result line on stdout
Log = Callable[[str], None]


# --- the plan list ------------------------------------------------------------------------


@dataclass(frozen=True)
class SuitePlan:
    """One measured configuration: a ``memplan validate`` run, or (runner ``hf``) transformers
    steps, the hand loop against ``memplan estimate --runtime hf-loop`` or (``loop="trainer"``) the
    HF Trainer's step against ``--runtime hf``. ``budget_s`` is the wall time one run is
    expected to take on an H100, start-up included; its timeout is a multiple of it."""

    id: str
    model: str  # 1b, 8b or 70b
    runner: str = "validate"  # validate or hf
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    recompute: str = "none"
    precision: str = "bf16-mixed"
    allocator: str = "default"
    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int | None = None  # None: micro_batch x dp (no gradient accumulation)
    budget_s: int = 90
    quick: bool = False
    loop: str = "hand"  # hf runner: hand (outputs kept, foreach AdamW) or trainer (the Trainer's training_step)

    @property
    def timed(self) -> bool:
        """Its step time is judged (one real GPU: the hf steps, one-rank plans), so it runs alone; a
        simulated rank's step time has no communication in it, so only its memory is judged."""
        return not self.simulated

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def simulated(self) -> bool:
        """More than one rank: validate runs the most-loaded one alone (fake process group)."""
        return self.runner == "validate" and self.world_size > 1

    @property
    def batch(self) -> int:
        return self.global_batch if self.global_batch is not None else self.micro_batch * self.dp

    @property
    def parallel(self) -> str:
        parts = []
        if self.dp > 1:
            parts.append(f"FSDP2 dp{self.dp} z{self.zero}" if self.zero >= 2 else f"DDP dp{self.dp} z{self.zero}")
        if self.tp > 1:
            parts.append(f"TP{self.tp}" + ("+SP" if self.sequence_parallel else ""))
        if self.pp > 1:
            sched = f"interleaved x{self.virtual_stages}" if self.pp_schedule == "interleaved" else self.pp_schedule
            parts.append(f"PP{self.pp} {sched}")
        return ", ".join(parts) or "1 GPU"

    def flags(self) -> list[str]:
        """The plan and workload flags ``memplan validate`` / ``memplan estimate`` take."""
        out = ["--dp", str(self.dp), "--precision", self.precision, "--recompute", self.recompute]
        out += ["--seq-len", str(self.seq_len), "--micro-batch", str(self.micro_batch)]
        out += ["--global-batch", str(self.batch), "--allocator", self.allocator]
        if self.runner == "hf":
            return out
        if self.tp > 1:
            out += ["--tp", str(self.tp), "--sequence-parallel" if self.sequence_parallel else "--no-sequence-parallel"]
        if self.pp > 1:
            out += ["--pp", str(self.pp), "--pp-schedule", self.pp_schedule]
            if self.virtual_stages > 1:
                out += ["--virtual-stages", str(self.virtual_stages)]
        if self.zero:
            out += ["--zero", str(self.zero)]
        return out


@dataclass(frozen=True)
class Sweep:
    """Micro-batch 1, 2, 4, ... of one plan until the first run that does not run (OOM)."""

    id: str
    base: SuitePlan
    micro_batches: tuple[int, ...]
    quick: bool = False
    per_micro_batch_s: float = 0.0  # budget added per sequence of the micro-batch (the steps grow with it)
    quick_micro_batches: tuple[int, ...] = ()  # --quick's points: the predicted boundary, last fit and first not

    def plans(self, quick: bool = False) -> list[SuitePlan]:
        mbs = self.quick_micro_batches if quick and self.quick_micro_batches else self.micro_batches
        return [
            replace(
                self.base,
                id=f"{self.id}/mb{m}",
                micro_batch=m,
                global_batch=m * self.base.dp,
                budget_s=int(self.base.budget_s + self.per_micro_batch_s * m),
            )
            for m in mbs
        ]


# Budgets: the estimate's step times on h100-sxm are 0.1 s (1B) to 5.4 s (70B FSDP, full recompute)
# a step and validate runs a warm-up step and two measured ones, so start-up dominates: the worker's
# imports and CUDA context (~15 s), the model built on the meta device and materialised, the first
# Triton compilations (cached across runs). 60-90 s a 1B/8B run, 120-180 s a 70B one.
# fmt: off
PLANS: tuple[SuitePlan, ...] = (
    # Llama 1B (one GPU, or one simulated rank)
    SuitePlan("v-1b-none-bf16mixed", "1b", recompute="none", budget_s=60, quick=True),
    SuitePlan("v-1b-selective-fp32-exp", "1b", precision="fp32", recompute="selective", seq_len=2048,
              micro_batch=2, allocator="expandable", budget_s=90, quick=True),
    SuitePlan("v-1b-full-fp32-exp", "1b", precision="fp32", recompute="full", micro_batch=2,
              allocator="expandable", budget_s=90),
    SuitePlan("v-1b-selective-bf16", "1b", precision="bf16", recompute="selective", micro_batch=2, budget_s=60),
    SuitePlan("v-1b-selop-bf16mixed-exp", "1b", recompute="selective-op", allocator="expandable", budget_s=60),
    SuitePlan("v-1b-tp2sp-full", "1b", tp=2, sequence_parallel=True, recompute="full", micro_batch=2, budget_s=60),
    SuitePlan("v-1b-pp2-none", "1b", pp=2, seq_len=2048, global_batch=4, budget_s=60),
    SuitePlan("v-1b-pp2-interleaved-selective-bf16", "1b", pp=2, pp_schedule="interleaved", virtual_stages=2,
              precision="bf16", recompute="selective", seq_len=2048, global_batch=4, budget_s=60),
    SuitePlan("v-1b-fsdp8-z2-selective", "1b", dp=8, zero=2, recompute="selective", budget_s=60),
    # Llama 3 8B
    SuitePlan("v-8b-fsdp8-z3-full-bf16", "8b", dp=8, zero=3, precision="bf16", recompute="full", micro_batch=2,
              budget_s=120, quick=True),
    SuitePlan("v-8b-fsdp8-z3-selective", "8b", dp=8, zero=3, recompute="selective", budget_s=120),
    SuitePlan("v-8b-fsdp8-z3-none-fp32", "8b", dp=8, zero=3, precision="fp32", recompute="none", seq_len=1024,
              budget_s=120),
    SuitePlan("v-8b-tp2sp-fsdp4-z3-full-exp", "8b", dp=4, tp=2, sequence_parallel=True, zero=3, recompute="full",
              seq_len=8192, allocator="expandable", budget_s=120),
    SuitePlan("v-8b-tp4sp-dp2-z2-selop", "8b", dp=2, tp=4, sequence_parallel=True, zero=2,
              recompute="selective-op", budget_s=90),
    SuitePlan("v-8b-pp4-dp2-z3-selective", "8b", dp=2, pp=4, zero=3, recompute="selective", global_batch=16,
              budget_s=120),
    # Llama 3 70B
    SuitePlan("v-70b-fsdp64-z3-full", "70b", dp=64, zero=3, recompute="full", budget_s=180),
    SuitePlan("v-70b-tp8sp-fsdp8-z3-selective", "70b", dp=8, tp=8, sequence_parallel=True, zero=3,
              recompute="selective", seq_len=8192, budget_s=150),
    SuitePlan("v-70b-tp8sp-pp4-dp2-z3-selop-exp", "70b", dp=2, tp=8, sequence_parallel=True, pp=4, zero=3,
              recompute="selective-op", global_batch=8, allocator="expandable", budget_s=150, quick=True),
    # transformers training steps (the hand loop) against --runtime hf-loop: the 1B config on one GPU
    SuitePlan("hf-1b-bf16-none", "1b", runner="hf", precision="bf16", seq_len=2048, micro_batch=2, budget_s=60),
    SuitePlan("hf-1b-bf16mixed-full-exp", "1b", runner="hf", recompute="full", micro_batch=2,
              allocator="expandable", budget_s=90, quick=True),
    SuitePlan("hf-1b-fp32-none", "1b", runner="hf", precision="fp32", seq_len=1024, budget_s=60),
    # the HF Trainer's step (loss only, no cache, fused AdamW, clipping) against --runtime hf
    SuitePlan("hf-1b-bf16mixed-full-trainer", "1b", runner="hf", recompute="full", micro_batch=2, loop="trainer",
              budget_s=90),
    SuitePlan("hf-1b-bf16-none-trainer", "1b", runner="hf", precision="bf16", seq_len=2048, micro_batch=2,
              loop="trainer", budget_s=60),
)
# fmt: on

SWEEPS: tuple[Sweep, ...] = (
    # the estimate: 30 / 44 / 72 GiB allocated at micro-batch 1 / 2 / 4, 8 beyond an H100 and an H200 (141 GiB
    # reserved); --quick runs 4 and 8 (1 is v-1b-none-bf16mixed's plan)
    Sweep(
        "s-1b-none-bf16mixed",
        SuitePlan("s-1b-none-bf16mixed", "1b", budget_s=60),
        (1, 2, 4, 8),
        quick=True,
        quick_micro_batches=(4, 8),
    ),
    # 1.3 s a step at micro-batch 2: a warm-up and two steps grow by ~2 s a sequence
    Sweep(
        "s-8b-fsdp8-z3-full-bf16",
        SuitePlan("s-8b-fsdp8-z3-full-bf16", "8b", dp=8, zero=3, precision="bf16", recompute="full", budget_s=90),
        (1, 2, 4, 8, 16, 32, 64),
        per_micro_batch_s=3,
    ),
)

# The tests run in PYTEST_WORKERS pytest-xdist processes (the device image has pytest-xdist), side by
# side with the memory units: each worker's peak is bounded by the largest test, test_large_shapes_bf16's
# fp32 reference at 8 heads x 4000^2 (0.48 GiB a score matrix, about four alive in its backward): 3 GiB
# held. Never run on a GPU here: 150 s is a guess (53 tests, Triton compilations and autotuning,
# one torch.compile).
PYTEST_WORKERS = 4
PYTEST_WORKER_BYTES = 3 * 2**30
PYTEST_BUDGET_S = 150
# never run on a GPU here, guesses: --quick's 8 rows (2k and 8k sequences, head dim 128, forward and
# backward, causal and not) x 4 kernels, ~0.3 s of do_bench each, Triton's compilations and autotuning
BENCH_BUDGET_S = {True: 90, False: 300}  # quick, full (60 rows): inside one 10-minute command
BENCH_QUICK_ARGS = ["--seqlens", "2048", "8192", "--head-dims", "128", "--modes", "fwd", "bwd"]


def plan_list(quick: bool = False) -> list[SuitePlan]:
    """The validate step's plans (``--quick``: the subset marked quick)."""
    return [p for p in PLANS if p.quick or not quick]


def sweep_list(quick: bool = False) -> list[Sweep]:
    return [s for s in SWEEPS if s.quick or not quick]


# --- units, state and the step runner -----------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One thing the suite runs and records: the test run, the benchmark, one plan, one sweep point.
    Units of one ``group`` run in order, and the group stops at the first that did not run.
    ``alone``: nothing else may run on the GPU beside it (step time, out-of-memory boundary,
    benchmark); else ``predicted_bytes`` (the predicted reserved peak of all its ``processes``)
    sizes it beside others. ``note``: where its budget comes from."""

    step: str
    id: str
    budget_s: float
    plan: SuitePlan | None = None
    group: str | None = None
    alone: bool = True
    predicted_bytes: int = 0
    processes: int = 1
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.step}/{self.id}"


def build_units(quick: bool = False, steps: Iterable[str] = STEPS, plans: list[str] | None = None) -> list[Unit]:
    """The suite in order; ``plans`` (glob patterns on plan / sweep ids) narrows steps 3 and 4."""
    steps = set(steps)

    def wanted(plan_id: str) -> bool:
        return plans is None or any(fnmatch.fnmatchcase(plan_id, pat) for pat in plans)

    units: list[Unit] = []
    if "pytest" in steps:
        units.append(
            Unit(
                "pytest",
                "gpu-and-kernels-tests",
                PYTEST_BUDGET_S,
                alone=False,
                predicted_bytes=PYTEST_WORKERS * PYTEST_WORKER_BYTES,
                processes=PYTEST_WORKERS,
                note="guess; memory: the largest test's bound",
            )
        )
    if "bench" in steps:
        units.append(Unit("bench", "bench_attention", BENCH_BUDGET_S[quick], note="guess"))
    if "validate" in steps:
        units += [
            Unit("validate", p.id, p.budget_s, plan=p, alone=p.timed, note="static")
            for p in plan_list(quick)
            if wanted(p.id)
        ]
    if "sweep" in steps:
        for sweep in sweep_list(quick):
            if wanted(sweep.id):
                units += [
                    Unit("sweep", p.id, p.budget_s, plan=p, group=sweep.id, note="static") for p in sweep.plans(quick)
                ]
    return units


@functools.cache  # the schedule, the listing and the dry run size the same plans: each estimated once
def predict_plan(plan: SuitePlan, gpu: str) -> tuple[int, float | None]:
    """memplan's own estimate of the plan on ``gpu``: (predicted reserved peak in bytes, predicted
    step time in seconds or None). In process: the library imports no torch; a plan
    and GPU are estimated once a process."""
    from memplan.estimation import estimate
    from memplan.specs.resolve import resolve_job

    runtime = ("hf" if plan.loop == "trainer" else "hf-loop") if plan.runner == "hf" else "memplan"
    overrides = dict(
        dp=plan.dp, tp=plan.tp, sequence_parallel=plan.sequence_parallel, pp=plan.pp, pp_schedule=plan.pp_schedule,
        virtual_stages=plan.virtual_stages, zero=plan.zero, recompute=plan.recompute, precision=plan.precision,
        micro_batch=plan.micro_batch, global_batch=plan.batch, seq_len=plan.seq_len, gpu=gpu, runtime=runtime,
        allocator=plan.allocator,
    )  # fmt: skip
    result = estimate(resolve_job(model_arg(plan.model), None, overrides, inference=False), with_suggestions=False)
    return result.memory.peak.reserved, result.time.step_time_s if result.time else None


def size_unit(
    unit: Unit, gpu: str, predict: Callable[[SuitePlan, str], tuple[int, float | None]] = predict_plan
) -> Unit:
    """A plan unit with its predicted reserved peak and its budget from the GPU phase (see STARTUP_S);
    other units as they are. A unit whose plan the estimate cannot size keeps its static budget and
    runs alone (unknown memory is never put beside others)."""
    if unit.plan is None:
        return unit
    try:
        reserved, step_s = predict(unit.plan, gpu)
    except Exception as err:  # noqa: BLE001 - a plan memplan cannot estimate still runs, alone
        return replace(unit, alone=True, note=f"static (estimate failed: {type(err).__name__})")
    trace = TRACE_SPANS.get(unit.plan.id)
    if trace is not None:
        gpu_s, source = trace[1], f"GPU {trace[1]:.1f} s measured ({trace[0]})"
    elif step_s is not None:
        gpu_s, source = 3 * step_s + BUILD_S, f"GPU 3 x {step_s:.2f} s predicted + {BUILD_S} s"
    else:
        return replace(unit, predicted_bytes=reserved, alone=True, note="static (no predicted step time)")
    factor = 1 if unit.alone else gpu_schedule.MAX_LANES
    budget = STARTUP_S + factor * gpu_s
    shared = "" if unit.alone else f" x {factor} beside others"
    return replace(
        unit,
        budget_s=round(budget, 1),
        predicted_bytes=reserved,
        note=f"start-up {STARTUP_S} s (guess) + {source}{shared}",
    )


def jobs_of(units: list[Unit]) -> list[gpu_schedule.Job]:
    return [gpu_schedule.Job(u.key, u.budget_s, u.predicted_bytes, u.alone, u.group, u.processes) for u in units]


def suite_schedule(
    units: list[Unit], capacity_bytes: int, limit_s: float | None, spent_s: float = INSTALL_S
) -> gpu_schedule.Schedule:
    """The units' schedule: ``spent_s`` (the install) and the probe before the first unit, the report
    after. The benchmark comes last of the alone units: where time runs short, it is what a rerun does."""
    ordered = sorted(units, key=lambda u: u.step == "bench")
    return gpu_schedule.make_schedule(
        jobs_of(ordered), capacity_bytes, limit_s, setup_s=spent_s + PROBE_S, report_s=REPORT_S
    )


def profile_capacity(gpu: str) -> int:
    """The capacity PyTorch sees on a bundled GPU profile (its measured figure where it has one)."""
    from memplan.specs.loader import load_gpu

    return load_gpu(gpu).capacity_bytes


def quick_schedule(gpu: str = "h100-sxm") -> gpu_schedule.Schedule:
    """``--quick``'s schedule on one GPU of a bundled profile, limited to QUICK_LIMIT_S."""
    units = [size_unit(u, gpu) for u in build_units(quick=True)]
    return suite_schedule(units, profile_capacity(gpu), QUICK_LIMIT_S)


def timeout_for(unit: Unit) -> float:
    """Per-unit timeout: twice the budget, at least two minutes."""
    return max(2 * unit.budget_s, 120.0)


def load_state(path: Path, mode: str, fresh: bool = False, log: Log | None = None) -> dict:
    """The recorded units of an earlier run in the same mode (``gpu`` or ``dry-run``), or a new state."""
    new = {"version": STATE_VERSION, "mode": mode, "units": {}}
    if fresh or not path.exists():
        return new
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        if log:
            log(f"state {path} is unreadable: starting over")
        return new
    if state.get("version") != STATE_VERSION or state.get("mode") != mode or not isinstance(state.get("units"), dict):
        if log:
            log(f"state {path} is from another mode or version ({state.get('mode')}): starting over")
        return new
    return state


def save_state(path: Path, state: dict) -> None:
    """Written whole to a temporary file and renamed, so an interrupted write never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    os.replace(tmp, path)


def ran(result: dict) -> bool:
    return result.get("status") in ("ok", "passed", "collected")


def run_units(
    units: list[Unit],
    state: dict,
    runner: Callable[[Unit, float], dict],
    save: Callable[[dict], None],
    jobs: int = 1,
    deadline: float | None = None,
    log: Log | None = None,
    gate: MemoryGate | None = None,
    numbering: dict[str, int] | None = None,
) -> dict:
    """Run every unit not yet recorded in ``state["units"]``, recording each result as it ends.

    ``runner(unit, timeout_s)`` returns the unit's result (a dict with ``status``); an exception
    is recorded as ``status: error``. Units of a group run in order and the group stops after a
    unit that did not run (an out-of-memory ends a sweep). A unit whose budget no longer fits
    before ``deadline`` (``time.monotonic()`` seconds) is left unrecorded, for a rerun. With
    ``jobs > 1`` independent units (and whole groups) run side by side, each, with a ``gate``, only
    once the memory it holds is free; its result then names the units it started beside (``beside``).
    ``numbering``: each unit's number in the whole run, for the log (default: its place in ``units``).
    """
    log = log or (lambda line: None)
    lock = threading.Lock()
    recorded = state.setdefault("units", {})
    position = numbering or {u.key: i + 1 for i, u in enumerate(units)}
    total = len(position)
    already = sum(1 for u in units if u.key in recorded)
    pending = [sum(u.budget_s for u in units if u.key not in recorded)]  # an upper bound: sweeps stop early
    if already:
        log(f"resuming: {already} of {total} units already recorded, skipped")

    def tag(unit: Unit) -> str:
        return f"[{position[unit.key]}/{total}] {unit.key}"

    def run_one(unit: Unit) -> dict | None:
        if gate is None:
            return run_held(unit, [])
        with gate.hold(unit) as beside:
            return run_held(unit, beside)

    def run_held(unit: Unit, beside: list[str]) -> dict | None:
        if deadline is not None and time.monotonic() + unit.budget_s > deadline:
            with lock:
                log(f"{tag(unit)}: left for a rerun: its budget ({unit.budget_s:.0f} s) exceeds the time left")
            return None
        timeout = timeout_for(unit)
        if deadline is not None:
            timeout = max(30.0, min(timeout, deadline - time.monotonic()))
        with lock:
            near = f"; beside {', '.join(beside)}" if beside else ""
            log(
                f"{tag(unit)}: running (budget {unit.budget_s:.0f} s, timeout {timeout:.0f} s; "
                f"at most {pending[0] / 60:.0f} min of budget left{near})"
            )
        start = time.monotonic()
        try:
            result = runner(unit, timeout)
        except Exception as err:  # noqa: BLE001 - one unit's failure is a result, never the suite's end
            result = {"status": "error", "reason": f"{type(err).__name__}: {err}"}
        result = {**result, "duration_s": round(time.monotonic() - start, 2)}
        if gate is not None:
            result["beside"] = sorted(beside)  # by now also those that started while it ran
        with lock:
            recorded[unit.key] = result
            save(state)
            pending[0] -= unit.budget_s
            reason = f" ({str(result.get('reason'))[:160]})" if result.get("reason") and not ran(result) else ""
            log(f"{tag(unit)}: {result['status']} in {result['duration_s']:.1f} s{reason}")
        return result

    def run_group(group: list[Unit]) -> None:
        for unit in group:
            result = recorded.get(unit.key)
            if result is None:
                result = run_one(unit)
                if result is None:
                    return
            if unit.group is not None and not ran(result):
                rest = group[group.index(unit) + 1 :]
                if rest:
                    with lock:
                        log(f"[{unit.group}] stops at {unit.id} ({result['status']}): {len(rest)} larger runs skipped")
                return

    tasks: list[list[Unit]] = []
    groups: dict[str, list[Unit]] = {}
    for unit in units:
        if unit.group is None:
            if unit.key not in recorded:
                tasks.append([unit])
        elif unit.group not in groups:
            groups[unit.group] = [unit]
            tasks.append(groups[unit.group])
        else:
            groups[unit.group].append(unit)
    if jobs <= 1:
        for task in tasks:
            run_group(task)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for future in [pool.submit(run_group, task) for task in tasks]:
                future.result()
    return state


class MemoryGate:
    """Units side by side on one GPU: ``hold(unit)`` waits until the unit's share of the device
    (``gpu_schedule.hold_bytes``) is free beside the units holding theirs, then holds it while the
    unit runs, and yields the list of the units it runs beside: those holding theirs when it starts,
    then each that starts while it runs. A unit larger than the capacity waits until it has the
    device to itself."""

    def __init__(self, capacity_bytes: int, outside_bytes: int = gpu_schedule.OUTSIDE_BYTES) -> None:
        self.capacity = capacity_bytes
        self.outside = outside_bytes
        self.held: dict[str, int] = {}
        self.beside: dict[str, list[str]] = {}  # each held unit's companions so far
        self.peak = 0  # the most held at once: what the tests check
        self._cond = threading.Condition()

    def size(self, unit: Unit) -> int:
        job = gpu_schedule.Job(unit.key, unit.budget_s, unit.predicted_bytes, unit.alone, unit.group, unit.processes)
        return gpu_schedule.hold_bytes(job, self.outside)

    @contextlib.contextmanager
    def hold(self, unit: Unit):
        need = self.size(unit)
        with self._cond:
            self._cond.wait_for(lambda: not self.held or sum(self.held.values()) + need <= self.capacity)
            for key in self.held:
                self.beside[key].append(unit.key)
            self.beside[unit.key] = sorted(self.held)
            self.held[unit.key] = need
            self.peak = max(self.peak, sum(self.held.values()))
        try:
            yield self.beside[unit.key]
        finally:
            with self._cond:
                del self.held[unit.key]
                del self.beside[unit.key]
                self._cond.notify_all()


def run_schedule(
    schedule: gpu_schedule.Schedule,
    units: list[Unit],
    state: dict,
    runner: Callable[[Unit, float], dict],
    save: Callable[[dict], None],
    deadline: float | None = None,
    log: Log | None = None,
    lanes: int = gpu_schedule.MAX_LANES,
) -> dict:
    """Run the units wave by wave as ``schedule`` orders them: a side-by-side wave in up to ``lanes``
    processes, each let in by a ``MemoryGate`` of the schedule's capacity (its units start as memory
    frees, whatever their real durations); an alone wave by itself. A unit that ran out of memory
    beside others has no verdict: it runs again, alone, at the end (its first result is kept under
    ``beside_oom``). Units the schedule dropped are left for a rerun."""
    log = log or (lambda line: None)
    by_key = {u.key: u for u in units}
    recorded = state.setdefault("units", {})
    for key in schedule.dropped:
        if key not in recorded:
            log(f"{key}: left for a rerun: no time for it in this run's schedule")
    gate = MemoryGate(schedule.capacity_bytes)
    numbers = {s.key: i + 1 for i, s in enumerate(schedule.slots)}
    shared: list[Unit] = []
    for wave in schedule.waves:
        wave_units = [by_key[s.key] for s in wave.slots]
        if wave.alone:
            run_units(wave_units, state, runner, save, 1, deadline, log, numbering=numbers)
        else:
            shared += wave_units
            run_units(wave_units, state, runner, save, lanes, deadline, log, gate, numbers)
    again = [u for u in shared if (recorded.get(u.key) or {}).get("status") == "oom" and recorded[u.key].get("beside")]
    for unit in again:
        first = recorded.pop(unit.key)
        log(f"{unit.key}: out of memory beside {', '.join(first['beside'])}: running it again alone")
        run_units([unit], state, runner, save, 1, deadline, log, numbering=numbers)
        if unit.key in recorded:
            recorded[unit.key]["beside_oom"] = first
        else:
            recorded[unit.key] = first  # no time to run it again: the first result stands, marked by beside
        save(state)
    return state


# --- the runners ----------------------------------------------------------------------------


def llama1b_model() -> str | None:
    """The 1B model argument: the shared Llama-3.2-1B-shaped config, its copy in the repo, or the
    bundled ``llama3.2-1b`` profile; None where there is none of them."""
    for path in (LLAMA1B_CONFIG, LLAMA1B_CONFIG_COPY):
        if path.is_file():
            return str(path)
    if (REPO / "profiles" / "models" / f"{LLAMA1B_PROFILE}.yaml").is_file():
        return LLAMA1B_PROFILE
    return None


def model_arg(key: str) -> str | None:
    return llama1b_model() if key == "1b" else MODELS[key]


def tiny_config(plan: SuitePlan) -> dict:
    """A Llama-shaped HF config small enough for a CPU run in seconds, with the plan's layout:
    layers split evenly into its pipeline chunks, heads, K/V heads, ffn and vocabulary divisible by tp."""
    stages = plan.pp * plan.virtual_stages
    heads = max(4, plan.tp)
    kv_heads = max(2, plan.tp)
    head_dim = 16
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "intermediate_size": 2 * heads * head_dim,
        "num_hidden_layers": 2 * stages,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": 512,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }


DRY_SEQ_LEN = 64


def tiny_plan(plan: SuitePlan) -> SuitePlan:
    """The plan at a dry run's shape: the same layout and settings, sequences of 64 tokens, the
    micro-batch kept (so a sweep still grows), the same gradient accumulation."""
    accumulation = max(1, plan.batch // (plan.micro_batch * plan.dp))
    return replace(plan, seq_len=DRY_SEQ_LEN, global_batch=plan.micro_batch * plan.dp * accumulation)


# --memory-limit of a dry run's sweeps: the tiny 1B-layout sweep stops at micro-batch 8 (4: 4.6 MiB predicted)
DRY_SWEEP_LIMIT = 6 * 2**20


def gpu_profile_for(device_name: str) -> str:
    """The bundled GPU profile of a CUDA device name (default h100-sxm)."""
    name = device_name.lower()
    if "h200" in name:
        return "h200"
    if "b200" in name:
        return "b200"
    if "h100" in name:
        return "h100-pcie" if "pcie" in name else "h100-sxm"
    if "a100" in name:
        return "a100-40gb" if "40gb" in name.replace(" ", "") else "a100-80gb"
    if "l40s" in name:
        return "l40s"
    if "4090" in name:
        return "rtx-4090"
    return "h100-sxm"


def _json_from(stdout: str) -> dict | None:
    start = stdout.find("{")
    if start < 0:
        return None
    try:
        return json.loads(stdout[start:])
    except ValueError:
        return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    """Run a child in its own session; on timeout end it and its children. (returncode or None, out, err)."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        return None, out, err
    except BaseException:  # Ctrl-C: the child is in a session of its own and did not get it
        _kill(proc)
        raise


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The children's environment: the repo importable (a copy with pip-installed deps runs too)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    env.update(extra or {})
    return env


def memplan_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "memplan.cli", *args]


_ESTIMATE_DEVICE: list[bool] = []


def estimate_takes_device() -> bool:
    """Whether this memplan's ``estimate`` has ``--device`` (cpu: what a CPU run of the trainer keeps)."""
    if not _ESTIMATE_DEVICE:
        code, out, _ = _run(memplan_cmd("estimate", "--help"), 60, child_env({"COLUMNS": "200"}))
        _ESTIMATE_DEVICE.append(code == 0 and "--device" in out)
    return _ESTIMATE_DEVICE[0]


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """Signed error of the prediction, percent of the measurement (memplan validate's convention)."""
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def triple(predicted: float | None, measured: float | None) -> dict:
    return {"predicted": predicted, "measured": measured, "error_pct": error_pct(predicted, measured)}


@dataclass
class SuiteRunner:
    """The real runner: ``runner(unit, timeout_s) -> result``; CPU and tiny shapes when ``dry_run``."""

    dry_run: bool
    quick: bool
    workdir: Path
    gpu: str = "h100-sxm"

    def __call__(self, unit: Unit, timeout: float) -> dict:
        if unit.step == "pytest":
            return self.pytest(timeout)
        if unit.step == "bench":
            return self.bench(timeout)
        assert unit.plan is not None
        limit = DRY_SWEEP_LIMIT if self.dry_run and unit.step == "sweep" else None
        if unit.plan.runner == "hf":
            return self.hf(unit.plan, timeout)
        return self.validate(unit.plan, timeout, memory_limit=limit)

    # step 1
    def pytest(self, timeout: float) -> dict:
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu or kernels", "-q", "-p", "no:cacheprovider", "-rfE"]
        if self.dry_run:
            cmd.append("--collect-only")
        elif importlib.util.find_spec("xdist") is not None:  # the memory bound is per worker: PYTEST_WORKERS
            cmd += ["-n", str(PYTEST_WORKERS)]
        code, out, err = _run(cmd, timeout, child_env())
        return pytest_result(code, out + err, shlex.join(["python", *cmd[1:]]), self.dry_run)

    # step 2
    def bench(self, timeout: float) -> dict:
        if self.dry_run:
            return {"status": "skipped", "reason": "dry run: the benchmark times CUDA kernels, nothing to time on CPU"}
        cmd = [sys.executable, str(REPO / "benchmarks" / "bench_attention.py"), "--format", "json"]
        cmd += BENCH_QUICK_ARGS if self.quick else []
        code, out, err = _run(cmd, timeout, child_env())
        data = _json_from(out)
        command = shlex.join(["python", "benchmarks/bench_attention.py", *cmd[2:]])
        if code is None:
            return {"status": "timeout", "reason": f"no result within {timeout:.0f} s", "command": command}
        if code != 0 or data is None:
            return {"status": "error", "reason": _last_line(err) or f"exit code {code}", "command": command}
        return {"status": "ok", "command": command, "rows": data.get("results", []), "unit": data.get("unit")}

    def _model(self, plan: SuitePlan) -> str | None:
        if not self.dry_run:
            return model_arg(plan.model)
        config = tiny_config(plan)
        text = json.dumps(config, sort_keys=True)
        shape = f"l{config['num_hidden_layers']}-h{config['num_attention_heads']}-kv{config['num_key_value_heads']}"
        path = self.workdir / f"tiny-{plan.model}-{shape}.json"
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        return str(path)

    def estimate(self, model: str, plan: SuitePlan, timeout: float) -> tuple[dict | None, str | None]:
        """``memplan estimate --format json`` of the plan: (its JSON, None) or (None, why not)."""
        args = ["estimate", model, *plan.flags(), "--gpu", self.gpu, "--format", "json"]
        if plan.runner == "hf":
            args += ["--runtime", "hf" if plan.loop == "trainer" else "hf-loop"]  # the loop the worker runs
        if self.dry_run and estimate_takes_device():
            args += ["--device", "cpu"]
        code, out, err = _run(memplan_cmd(*args), max(10.0, timeout), child_env())
        data = _json_from(out) if code == 0 else None
        if data is None:
            return None, _last_line(err) or ("timed out" if code is None else f"exit code {code}")
        return data, None

    # step 3 and 4: the bundled trainer
    def validate(self, plan: SuitePlan, timeout: float, memory_limit: int | None = None) -> dict:
        run_plan = tiny_plan(plan) if self.dry_run else plan
        model = self._model(run_plan)
        row = plan_row(plan, run_plan, model, self.dry_run)
        if model is None:
            return {**row, "status": "skipped", "reason": "no 1B model: neither llama1b.config.json nor a profile"}
        end = time.monotonic() + timeout
        steps = "1" if self.dry_run else "2"
        args = ["validate", model, *run_plan.flags(), "--device", "cpu" if self.dry_run else "cuda"]
        args += ["--gpu", self.gpu, "--steps", steps, "--format", "json"]
        if memory_limit is not None:
            args += ["--memory-limit", f"{memory_limit}B"]
        est, est_error = self.estimate(model, run_plan, min(120.0, timeout / 4))
        row["estimate_error"] = est_error
        left = max(30.0, end - time.monotonic())
        args += ["--timeout", str(int(max(15.0, left - 30)))]  # validate ends its ranks, then reports
        row["command"] = shlex.join(["memplan", *args])
        code, out, err = _run(memplan_cmd(*args), left, child_env())
        data = _json_from(out)
        if data is None or "status" not in data:
            status = "timeout" if code is None else "error"
            return {**row, "status": status, "reason": _last_line(err) or f"exit code {code}", "ran": False}
        predicted_fits = est.get("fits") if est else None
        if memory_limit is not None:  # a CPU sweep: the simulated capacity decides
            predicted_fits = data["predicted_bytes"] <= memory_limit
        oom = (data.get("record") or {}).get("oom")
        return {
            **row,
            "status": data["status"],
            "reason": data.get("reason"),
            "ran": data["status"] == "ok",
            "predicted_fits": predicted_fits,
            "fits_reason": est.get("fits_reason") if est else None,
            "memory_limit": memory_limit,
            "allocated": triple(data.get("predicted_bytes"), data.get("measured_bytes")),
            "reserved": triple(data.get("predicted_reserved_bytes"), data.get("measured_reserved_bytes")),
            "step_time_s": triple(data.get("predicted_step_time_s"), data.get("step_time_s")),
            "predicted_phase": data.get("predicted_phase"),
            "measured_phase": data.get("measured_phase"),
            "mfu": data.get("mfu"),
            "oom": {k: oom.get(k) for k in ("phase", "requested_bytes", "peak_bytes")} if oom else None,
            "device_name": data.get("device_name"),
        }

    # step 3: transformers steps against --runtime hf
    def hf(self, plan: SuitePlan, timeout: float) -> dict:
        from memplan.specs.resolve import alloc_conf_text

        run_plan = tiny_plan(plan) if self.dry_run else plan
        model = self._model(run_plan)
        row = plan_row(plan, run_plan, model, self.dry_run)
        if model is None or not model.endswith(".json"):
            return {**row, "status": "skipped", "reason": "the hf runner needs an HF config.json for the 1B model"}
        spec = {
            "config": model,
            "precision": run_plan.precision,
            "recompute": run_plan.recompute,
            "seq_len": run_plan.seq_len,
            "micro_batch": run_plan.micro_batch,
            "steps": 1 if self.dry_run else 2,
            "device": "cpu" if self.dry_run else "cuda",
            "loop": plan.loop,
        }
        cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", json.dumps(spec)]
        row["command"] = shlex.join(["python", "benchmarks/gpu_suite.py", "--hf-worker", json.dumps(spec)])
        end = time.monotonic() + timeout
        est, est_error = self.estimate(model, run_plan, min(120.0, timeout / 4))
        row["estimate_error"] = est_error
        env = child_env({"PYTORCH_CUDA_ALLOC_CONF": alloc_conf_text(run_plan.allocator)})
        code, out, err = _run(cmd, max(30.0, end - time.monotonic()), env)
        data = next((json.loads(ln[len(RESULT_TAG) :]) for ln in out.splitlines() if ln.startswith(RESULT_TAG)), None)
        if data is None:
            status = "timeout" if code is None else "error"
            return {**row, "status": status, "reason": _last_line(err) or f"exit code {code}", "ran": False}
        peak = (est or {}).get("memory", {}).get("peak", {})
        predicted_time = ((est or {}).get("time") or {}).get("step_time_s")
        return {
            **row,
            "status": data["status"],
            "reason": data.get("reason"),
            "ran": data["status"] == "ok",
            "predicted_fits": est.get("fits") if est else None,
            "fits_reason": est.get("fits_reason") if est else None,
            "allocated": triple(peak.get("allocated"), data.get("allocated")),
            "reserved": triple(peak.get("reserved"), data.get("reserved")),
            "step_time_s": triple(predicted_time, data.get("step_time_s")),
            "predicted_phase": peak.get("phase"),
            "device_name": data.get("device_name"),
        }


def plan_row(plan: SuitePlan, run_plan: SuitePlan, model: str | None, dry_run: bool) -> dict:
    """What a result says about its plan (the shape it really ran at, in a dry run the tiny one)."""
    return {
        "plan": plan.id,
        "runner": plan.runner,
        "model": plan.model.upper(),
        "model_arg": model,
        "parallel": plan.parallel,
        "world_size": plan.world_size,
        "simulated": plan.simulated,
        "recompute": plan.recompute,
        "precision": plan.precision,
        "allocator": plan.allocator,
        "seq_len": run_plan.seq_len,
        "micro_batch": run_plan.micro_batch,
        "global_batch": run_plan.batch,
        "tiny": dry_run,
    }


_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)")
_COLLECTED = re.compile(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?")


def pytest_result(code: int | None, output: str, command: str, collect_only: bool) -> dict:
    """The test step's result from pytest's exit code and output (summary line, counts, failures)."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    counts: dict[str, int] = {}
    summary = ""
    for line in reversed(lines):
        found = _COUNTS.findall(line) or _COLLECTED.findall(line)
        if found and (" in " in line or "collected" in line):
            summary = line.strip("= ").strip()
            break
    for n, what in _COUNTS.findall(summary):
        counts[what.rstrip("s") if what in ("errors", "warnings") else what] = int(n)
    collected = _COLLECTED.search(summary)
    if collected:
        counts["collected"] = int(collected.group(1))
    failures = [ln.strip()[:300] for ln in lines if ln.startswith(("FAILED ", "ERROR "))][:50]
    if code is None:
        status = "timeout"
    elif code == 0:
        status = "collected" if collect_only else "passed"
    elif code == 5:
        status = "no tests"
    else:
        status = "failed"
    return {
        "status": status,
        "returncode": code,
        "summary": summary,
        "counts": counts,
        "failures": failures,
        "command": command,
    }


# --- the hf worker (a child process) --------------------------------------------------------


def hf_worker(spec: dict) -> dict:
    """Train an HF causal LM from a config.json for a warm-up step and ``steps`` measured ones, with
    the loop the ``hf`` runtime describes; the peak over the measured steps (CUDA: the caching
    allocator's allocated and reserved; CPU: MemTracker, every step) and the median step time."""
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)  # gradient_checkpointing_enable's rename
    transformers.logging.set_verbosity_error()
    device = torch.device(spec["device"])
    data = json.loads(Path(spec["config"]).read_text())
    config = transformers.AutoConfig.for_model(**{k: v for k, v in data.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    autocast = spec["precision"] == "bf16-mixed"
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    try:
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        if spec["recompute"] == "full":
            model.gradient_checkpointing_enable()
        elif spec["recompute"] != "none":
            return {"status": "unsupported", "reason": f"recompute {spec['recompute']}: hf runs none or full only"}
        model.train()
        trainer = spec.get("loop") == "trainer"
        if trainer:  # what Trainer.__init__ / training_step set: no cache, fused AdamW (optim adamw_torch_fused)
            model.config.use_cache = False
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if trainer else {"foreach": True}))
        ids = torch.randint(0, config.vocab_size, (spec["micro_batch"], spec["seq_len"]), device=device)
        if cuda:
            torch.cuda.empty_cache()
        times: list[float] = []
        kept: list[Any] = []

        def step() -> None:
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = model(input_ids=ids, labels=ids)
            if trainer:  # training_step: the loss only; then clip_grad_norm_ (max_grad_norm 1.0), step, zero_grad
                loss = out.loss
                del out
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                kept[:] = [out]  # the last step's outputs live until this forward returns, as in the runtime's loop
                out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)

        if cuda:
            step()
            torch.cuda.reset_peak_memory_stats()
            times.clear()
            for _ in range(spec["steps"]):
                step()
            allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            tracker.track_external(model, opt)
            with tracker:
                for _ in range(1 + spec["steps"]):
                    step()
                    tracker.reset_mod_stats()
            allocated, reserved = tracker.get_tracker_snapshot("peak")[device]["Total"], None
            times = times[1:]
    except torch.OutOfMemoryError as err:
        return {"status": "oom", "reason": str(err).splitlines()[0][:300], "device_name": name}
    return {
        "status": "ok",
        "allocated": allocated,
        "reserved": reserved,
        "step_time_s": statistics.median(times) if times else None,
        "device_name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


# --- header, results and the report ---------------------------------------------------------


def gpu_available() -> tuple[bool, str, int | None]:
    """(True, device name, the capacity PyTorch sees: ``torch.cuda.mem_get_info()``'s total) on an
    NVIDIA GPU torch can use, else (False, why not, None). torch is asked in a child process, so
    this one never holds a CUDA context beside the runs it measures."""
    if shutil.which("nvidia-smi") is None:
        return False, "nvidia-smi not found", None
    probe = (
        "import torch\nif torch.cuda.is_available(): print(torch.cuda.mem_get_info()[1], torch.cuda.get_device_name())"
    )
    code, out, err = _run([sys.executable, "-c", probe], 120, child_env())
    if code != 0:
        return False, f"torch does not import: {_last_line(err)}", None
    line = out.strip().splitlines()[-1] if out.strip() else ""
    total, _, name = line.partition(" ")
    if not name or not total.isdigit():
        return False, "torch.cuda.is_available() is False", None
    return True, name, int(total)


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - missing or broken: no version to report
        return None
    return getattr(mod, "__version__", None)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def collect_header(dry_run: bool, quick: bool, device_name: str | None, gpu: str) -> dict:
    import torch

    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name or "cpu",
        "gpu_profile": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "commit": commit + ("-dirty" if dirty else ""),
        "quick": quick,
        "dry_run": dry_run,
    }


def collect_results(units: list[Unit], state: dict, header: dict) -> dict:
    """The report's data: the header and, per step, the recorded result of every unit in order
    (a unit with no record is listed as ``not run``)."""
    recorded = state.get("units", {})
    steps: dict[str, Any] = {}
    for unit in units:
        result = recorded.get(unit.key)
        if unit.step in ("pytest", "bench"):
            steps[unit.step] = result or {"status": "not run"}
            continue
        rows = steps.setdefault(unit.step, {"rows": []})["rows"]
        if result is None:
            if unit.group is not None and any(r.get("group") == unit.group and not ran(r) for r in rows):
                continue  # a sweep past its first failure
            assert unit.plan is not None
            result = {**plan_row(unit.plan, unit.plan, None, bool(header.get("dry_run"))), "status": "not run"}
        rows.append({**result, "group": unit.group} if unit.group else result)
    return {"header": header, "steps": steps}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1000 * s:.1f}" if s >= 0.01 else f"{1000 * s:.3g}"


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "no"


def _cells(row: dict, key: str, fmt: Callable[[Any], str]) -> list[str]:
    t = row.get(key) or {}
    return [fmt(t.get("predicted")), fmt(t.get("measured")), _pct(error_pct(t.get("predicted"), t.get("measured")))]


def _worst(rows: list[dict], key: str) -> str:
    errs = [abs(e) for r in rows if (e := error_pct(*_pair(r, key))) is not None]
    return "-" if not errs else f"{max(errs):.1f}% (median {statistics.median(errs):.1f}%, {len(errs)} plans)"


def _pair(row: dict, key: str) -> tuple[float | None, float | None]:
    t = row.get(key) or {}
    return t.get("predicted"), t.get("measured")


def with_errors(results: dict) -> dict:
    """The results with every predicted / measured pair's ``error_pct`` (re)computed from the pair."""
    out = json.loads(json.dumps(results))
    for step in out.get("steps", {}).values():
        for row in step.get("rows", []) if isinstance(step, dict) else []:
            for key in ("allocated", "reserved", "step_time_s"):
                if isinstance(row.get(key), dict):
                    row[key]["error_pct"] = error_pct(*_pair(row, key))
    return out


def render_markdown(results: dict) -> str:
    """The report: a header, then a table per step."""
    h = results["header"]
    steps = results["steps"]
    mode = ("quick" if h.get("quick") else "full") + (", dry run on CPU (tiny shapes)" if h.get("dry_run") else "")
    lines = [
        "# GPU suite: predicted against measured",
        "",
        f"- date: {h.get('date')}",
        f"- device: {h.get('device')} (memplan GPU profile `{h.get('gpu_profile')}`)",
        f"- torch {h.get('torch')} (CUDA {h.get('cuda') or '-'}), Triton {h.get('triton') or '-'}, "
        f"transformers {h.get('transformers') or '-'}, Python {h.get('python')}",
        f"- git commit: {h.get('commit')}",
        f"- mode: {mode}",
        "",
        "Error = 100 x (predicted - measured) / measured. Memory in GiB (MiB where marked), step time in ms. "
        "Simulated plans run their most-loaded rank alone under a fake process group: memory is real, "
        "the step time has no communication in it (the prediction is the whole job's), so their time "
        "errors are not the model's. A step time marked (shared) ran beside other processes on the one "
        "GPU: each process has its own caching allocator, so its memory is exact, its time is not.",
        "",
    ]
    if h.get("schedule"):
        lines += ["## Schedule", "", "```", *h["schedule"], "```", ""]
    if h.get("dry_run"):
        lines += [
            "A dry run checks the suite, not the model: tiny shapes (64-token sequences) on CPU, memory "
            "measured by MemTracker, CPU step times against H100 predictions, sweeps against a simulated "
            f"{DRY_SWEEP_LIMIT // 2**20} MiB device.",
            "",
        ]
    # 1. tests
    t = steps.get("pytest")
    if t is not None:
        lines += ["## 1. GPU-marked tests", "", "| status | summary | command |", "|---|---|---|"]
        lines.append(
            f"| {t.get('status')} | {t.get('summary') or t.get('reason') or '-'} | `{t.get('command', '-')}` |"
        )
        for failure in t.get("failures", []):
            lines.append(f"- {failure}")
        lines.append("")
    # 2. benchmark
    b = steps.get("bench")
    if b is not None:
        lines += ["## 2. Attention benchmark (TFLOP/s)", ""]
        rows = b.get("rows") or []
        if not rows:
            lines += [f"{b.get('status')}: {b.get('reason') or 'no rows'}", ""]
        else:
            names = [k for k in ("memplan", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient") if k in rows[0]]
            lines.append(
                "| mode | causal | head_dim | seq | batch x heads | " + " | ".join(names) + " | memplan / flash |"
            )
            lines.append("|---|---|---:|---:|---|" + "---:|" * (len(names) + 1))
            for r in rows:
                cells = ["n/a" if r.get(n) is None else f"{r[n]:.1f}" for n in names]
                ratio = f"{r['memplan'] / r['sdpa-flash']:.2f}" if r.get("memplan") and r.get("sdpa-flash") else "n/a"
                lines.append(
                    f"| {r['mode']} | {'yes' if r['causal'] else 'no'} | {r['head_dim']} | {r['seq']} | "
                    f"{r['batch']} x {r['heads']} | " + " | ".join(cells) + f" | {ratio} |"
                )
            lines += ["", f"`{b.get('command')}`", ""]
    # 3. validate
    head = (
        "| plan | runner | model | parallel | recompute | precision | allocator | b x s | status "
        "| alloc pred | alloc meas | err | reserved pred | reserved meas | err | step pred | step meas | err "
        "| fits pred | ran |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|" + "---:|" * 9 + "---|---|"
    v = steps.get("validate")
    if v is not None:
        rows = v["rows"]
        lines += ["## 3. validate and hf steps: predicted against measured", "", head, rule]
        lines += [_plan_line(r) for r in rows]
        lines += [
            "",
            f"Worst allocated error: {_worst(rows, 'allocated')}; reserved: {_worst(rows, 'reserved')}.",
            "",
        ]
        lines += _reasons(rows)
    # 4. sweep
    s = steps.get("sweep")
    if s is not None:
        rows = s["rows"]
        lines += ["## 4. Fits boundary: micro-batch 1, 2, 4, ... until the first out-of-memory", "", head, rule]
        lines += [_plan_line(r) for r in rows]
        judged = [r for r in rows if r.get("predicted_fits") is not None and r.get("status") in ("ok", "oom")]
        agree = sum(1 for r in judged if bool(r["predicted_fits"]) == bool(r.get("ran")))
        lines += ["", f"Predicted fits agreed with the run in {agree} of {len(judged)} runs.", ""]
        lines += _reasons(rows)
    return "\n".join(lines).rstrip() + "\n"


def _plan_line(r: dict) -> str:
    plan = r["plan"] + (" (sim)" if r.get("simulated") else "")
    shape = f"{r.get('micro_batch')} x {r.get('seq_len')}"
    step = _cells(r, "step_time_s", _ms)
    if r.get("beside"):  # the GPU was shared: memory is exact, the time is not this run's alone
        step = [step[0], f"{step[1]} (shared)", "-"]
    return (
        f"| {plan} | {r.get('runner')} | {r.get('model')} | {r.get('parallel')} | {r.get('recompute')} "
        f"| {r.get('precision')} | {r.get('allocator')} | {shape} | {r.get('status')} | "
        + " | ".join(_cells(r, "allocated", _gib) + _cells(r, "reserved", _gib) + step)
        + f" | {_yes(r.get('predicted_fits'))} | {_yes(r.get('ran'))} |"
    )


def _reasons(rows: list[dict]) -> list[str]:
    out = [f"- {r['plan']}: {r['status']}: {r['reason']}" for r in rows if r.get("reason") and not ran(r)]
    out += [f"- {r['plan']}: memplan estimate failed: {r['estimate_error']}" for r in rows if r.get("estimate_error")]
    return [*out, ""] if out else []


def write_report(results: dict, out: Path) -> tuple[Path, Path]:
    """The Markdown report at ``out`` and the same data as JSON beside it (same stem, .json)."""
    results = with_errors(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_markdown(results))
    data = out.with_suffix(".json")
    data.write_text(json.dumps(results, indent=2) + "\n")
    return out, data


# --- main -----------------------------------------------------------------------------------


def _stderr(line: str) -> None:
    print(f"gpu_suite {time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the subset that runs in one 8-minute command on one H100 or H200"
    )
    parser.add_argument("--dry-run", action="store_true", help="rehearse on CPU: tiny shapes, no CUDA")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the Markdown report, JSON beside it (default {DEFAULT_OUT.relative_to(REPO)}; "
        f"a dry run's: {DRY_RUN_OUT})",
    )
    parser.add_argument("--state", type=Path, default=None, help="resume state (default: <out stem>.state.json)")
    parser.add_argument("--fresh", action="store_true", help="forget the state and start over")
    parser.add_argument("--retry-failed", action="store_true", help="rerun units recorded as error or timeout")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS))
    parser.add_argument("--plans", default=None, help="comma-separated glob patterns on plan / sweep ids")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"lanes side by side at most (default: {gpu_schedule.MAX_LANES}; 2 in a dry run)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help=f"seconds the whole command may take, install included (default: {QUICK_LIMIT_S} with --quick, "
        "else none): units that would end later are left for a rerun",
    )
    parser.add_argument(
        "--spent",
        type=float,
        default=None,
        help=f"seconds the command spent before this script started, the install (default: {INSTALL_S})",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the units, their budgets and the schedule on an H100, run nothing"
    )
    parser.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = set(args.steps) - set(STEPS)
    if unknown:
        parser.error(f"--steps: unknown {sorted(unknown)}; choose from {','.join(STEPS)}")
    args.plans = [p.strip() for p in args.plans.split(",") if p.strip()] if args.plans else None
    return args


def preflight() -> str | None:
    """None when the children can run memplan (its CLI, bundled profiles and kernels), else why not."""
    probe = "import memplan.cli.app, memplan.profiles  # profiles: installed, not only on the path"
    code, _, err = _run([sys.executable, "-c", probe], 120, child_env())
    if code == 0:
        return None
    return f"{_last_line(err)}: install the repo first (pip install --no-deps --no-build-isolation -e .)"


def pending_units(units: list[Unit], recorded: dict) -> list[Unit]:
    """The units a run still has to run: not recorded, and not past a sweep's recorded stop."""
    stopped = {u.group for u in units if u.group and u.key in recorded and not ran(recorded[u.key])}
    return [u for u in units if u.key not in recorded and u.group not in stopped]


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    if args.hf_worker is not None:
        print(RESULT_TAG + json.dumps(hf_worker(json.loads(args.hf_worker))), flush=True)
        return 0
    limit = args.time_limit if args.time_limit is not None else QUICK_LIMIT_S if args.quick else None
    spent = args.spent if args.spent is not None else INSTALL_S if args.quick else 0.0
    units = build_units(args.quick, args.steps, args.plans)
    if args.list:
        units = [size_unit(u, "h100-sxm") for u in units]
        for u in units:
            where = "alone" if u.alone else "beside others"
            print(f"{u.key:50} {u.budget_s:6.1f} s  {where:13}  {u.note}")
        print(f"{len(units)} units, {sum(u.budget_s for u in units) / 60:.1f} min of budget one after another")
        schedule = suite_schedule(units, profile_capacity("h100-sxm"), limit, spent)
        print("\n".join(gpu_schedule.render(schedule)))
        return 0
    device_name, capacity = None, None
    if not args.dry_run:
        ok, what, capacity = gpu_available()
        if not ok:
            print(f"gpu_suite: no NVIDIA GPU here ({what}): nothing to run (--dry-run rehearses on CPU)")
            return 0
        device_name = what
    problem = preflight()
    if problem:
        print(f"gpu_suite: memplan does not import here: {problem}", file=sys.stderr)
        return 1
    gpu = gpu_profile_for(device_name) if device_name else "h100-sxm"
    capacity = capacity or profile_capacity(gpu)  # a dry run plans for an H100
    out = (args.out or (DRY_RUN_OUT if args.dry_run else DEFAULT_OUT)).resolve()
    state_path = (args.state or out.with_name(out.stem + ".state.json")).resolve()
    mode = "dry-run" if args.dry_run else "gpu"
    state = load_state(state_path, mode, args.fresh, _stderr)
    if args.retry_failed:
        failed = [k for k, r in state["units"].items() if r.get("status") in ("error", "timeout")]
        for key in failed:
            del state["units"][key]
        _stderr(f"--retry-failed: {len(failed)} units to run again")
    todo = [size_unit(u, gpu) for u in pending_units(units, state["units"])]
    if len(todo) < len(units):
        _stderr(f"resuming: {len(units) - len(todo)} of {len(units)} units already recorded, skipped")
    schedule = suite_schedule(todo, capacity, limit, spent)
    lines = gpu_schedule.render(schedule)
    print("\n".join(lines), flush=True)
    if args.dry_run and args.quick and (schedule.dropped or not schedule.fits()):  # --quick must fit whole
        print(
            f"gpu_suite: the --quick schedule does not fit whole in {limit:.0f} s: it would end past {limit:.0f} s "
            f"without the {len(schedule.dropped)} units it drops",
            file=sys.stderr,
        )
        return 1
    lanes = args.jobs or (2 if args.dry_run else gpu_schedule.MAX_LANES)
    # units that would not end before the limit (the install spent, the report's time kept) are left for a rerun
    deadline = None if limit is None or args.dry_run else start + limit - spent - REPORT_S
    where = "dry run on CPU" if args.dry_run else f"{device_name} (profile {gpu}, {capacity / 2**30:.2f} GiB)"
    _stderr(f"{len(units)} units on {where}; state {state_path}; report {out}")
    workdir = state_path.with_name(state_path.name.removesuffix(".json") + ".tiny")  # a dry run's tiny configs
    if args.dry_run:
        workdir.mkdir(parents=True, exist_ok=True)
    runner = SuiteRunner(dry_run=args.dry_run, quick=args.quick, workdir=workdir, gpu=gpu)
    save = lambda s: save_state(state_path, s)  # noqa: E731
    try:
        run_schedule(schedule, todo, state, runner, save, deadline, _stderr, lanes)
    except KeyboardInterrupt:
        _stderr(f"interrupted: finished units are in {state_path}; rerun to resume")
        return 130
    header = collect_header(args.dry_run, args.quick, device_name, gpu)
    header["duration_s"] = round(time.monotonic() - start, 1)
    header["capacity_bytes"] = capacity
    header["schedule"] = lines
    md, data = write_report(collect_results(units, state, header), out)
    _stderr(f"done in {header['duration_s']:.0f} s: {md} and {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
