"""Which statements of the phase model (``costmodel/memory.py``) each of its callers still reaches.

Issue 27 ("one model, not two") retires every per-feature branch of the phase model that the
op-level run also models; a branch is dead in the product when only plans the op-level run answers
reach it. This tool measures that: it sends seeded random plans through the entry points that put
questions to the phase model and records, with ``sys.settrace`` on memory.py alone, the statements
each reaches, under a label that says who takes the answer:

- ``estimate:<reason>``: ``memplan estimate`` of a plan the phase model answers (``reserve.plan_run``'s
  phases run and ``estimation.memory_verdict``'s ``estimate_memory``), with the reason the op-level run
  declines it (``timeline.support.supported``, ``timeline.hf_support.hf_supported``, or the runtime);
- ``serving``: ``memplan estimate`` of an inference plan (``estimate_inference``, ``serving_run``);
- ``search:<reason>`` / ``search-sums``: the search's fast form (``training_peak``, as ``search.evaluate``
  calls it) on a plan the phase model answers / one the op-level run answers but whose fast form is the
  sums (full training: docs/cost-model.md, "Full bf16 training: still the phase model's sums");
- ``search-cut``: the same on a plan whose allocated peak ``fast_run`` replaces (stage, rank and
  accumulation still the sums');
- ``advice``: ``estimate_memory`` on a plan the op-level run answers: what advice screens a change to
  that plan with (``advice.Screen.reserved``, ``host_suggestions``; ``tune.host_fits`` alike);
- ``stage``: ``trainer.phase_stage`` of a pipelined plan (the rank the search's cut runs follow; the
  estimate's, ``trainer.most_loaded_stage``, comes from every stage's run since 2026-11-28);
- ``report``: ``run_report``'s helpers (``stage_states``, ``gradient_accumulation``);
- ``time``: ``estimate_time`` (``activation_offload_bytes``, the paged optimizers' ``estimate_memory``).

It prints, per function of memory.py (and per ``if`` of ``_stage_phases``), how many decline reasons
reach it and which other labels do; then the statements no label reached and those reached only under
labels whose plans the op-level run answers in ``memplan estimate``. Not a test: a few minutes on one
core (``--plans 8000``: some 5 CPU minutes, 8,000 plan files and 11,680 search plans).

    python benchmarks/phase_reach.py [--plans 8000] [--seed 1] [--no-search]
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memplan.costmodel import fast_run as FR
from memplan.costmodel import memory as M
from memplan.costmodel.quant import CudaArch, cuda_arch
from memplan.costmodel.rank import stage_states
from memplan.costmodel.reserve import plan_run
from memplan.costmodel.time import estimate_time
from memplan.costmodel.timeline.hf_support import hf_supported
from memplan.costmodel.timeline.support import supported
from memplan.costmodel.timeline.trainer import phase_stage
from memplan.errors import MemplanError
from memplan.search.space import SpaceOptions, enumerate_space
from memplan.specs.job import PlanFile, check_compatible
from memplan.specs.loader import load_gpu, load_model, profile_names, validate
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import job_from
from memplan.specs.workload import TrainingWorkload

MEMORY = M.__file__
GPU = "h100-sxm"
# labels whose plans the phase model answers in memplan estimate, or whose search sums are the answer
PHASE_ANSWERS = ("estimate:", "serving", "search:", "search-sums")
# dense models the op-level runs follow, drawn more often so that they answer enough plans
FOLLOWED = ("llama3-8b", "llama2-7b", "mistral-7b", "qwen2.5-7b", "qwen3-8b", "llama3-70b")
OPTIMIZERS = ("sgd", "adafactor", "adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit", "paged-lion-8bit")


class Reach:
    """The statements of memory.py reached under each label."""

    def __init__(self) -> None:
        self.lines: dict[str, set[int]] = defaultdict(set)
        self._current: set[int] = set()

    def _local(self, frame: Any, event: str, arg: Any) -> Callable:
        if event == "line":
            self._current.add(frame.f_lineno)
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Callable | None:
        return self._local if frame.f_code.co_filename == MEMORY else None

    def call(self, label: str, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` with memory.py's statements recorded under ``label``; a refusal is None."""
        self._current = self.lines[label]
        sys.settrace(self._global)
        try:
            return fn(*args)
        except MemplanError:
            return None
        finally:
            sys.settrace(None)


def declined(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, arch: CudaArch | None, device: str
) -> str | None:
    """Why ``reserve.plan_run`` hands the plan to the phase model (its first words), or None."""
    if runtime == "memplan":
        why = supported(model, workload, plan, arch)
    elif runtime in ("hf", "hf-loop"):
        why = hf_supported(model, plan, workload, runtime, arch, device)
    else:
        why = f"the {runtime} runtime"
    return None if why is None else why.split(" (")[0][:60]


def random_plan(rng: random.Random, model: ModelSpec) -> dict[str, Any]:
    """A plan file's fields: every feature the CLI takes, the plans the runs follow more often."""
    gpus, tp, pp = rng.choice([1, 1, 2, 4, 8, 16]), rng.choice([1, 1, 2, 4]), rng.choice([1, 1, 1, 2, 4])
    cp = rng.choice([1, 1, 1, 1, 2])
    if gpus % (tp * pp * cp):
        tp = pp = cp = 1
    dp = gpus // (tp * pp * cp)
    finetune = rng.choice(["full", "full", "lora", "qlora"])
    plan: dict[str, Any] = {
        "dp": dp, "tp": tp, "pp": pp, "cp": cp, "finetune": finetune,
        "sequence_parallel": tp > 1 and rng.random() < 0.7,
        "zero": rng.choice([0, 1, 2, 3]) if dp * cp > 1 else 0,
        "recompute": rng.choice(["none", "selective", "selective-op", "full"]),
        "precision": rng.choice(["fp32", "bf16-mixed", "bf16-master", "fp16-master", "bf16", "fp8"]),
        "optimizer": rng.choice(["adamw"] * 6 + list(OPTIMIZERS)),
        "attention": rng.choice(["flash", "flash", "eager", "triton"]),
    }  # fmt: skip
    if pp > 1:
        plan["pp_schedule"] = rng.choice(["1f1b", "interleaved", "gpipe"])
        plan["virtual_stages"] = 2 if plan["pp_schedule"] == "interleaved" else 1
    if model.moe is not None and rng.random() < 0.5 and dp * cp % 2 == 0:
        plan["ep"] = 2
    if rng.random() < 0.15:
        plan["recompute_layers"] = rng.choice([1, 2, 4])
    if rng.random() < 0.15:
        plan["offload_activations"] = "cpu"
    if rng.random() < 0.2:
        plan["offload_optimizer"] = rng.choice(["cpu", "nvme"])
        if plan["zero"] == 3 and rng.random() < 0.6:
            plan["offload_params"] = rng.choice(["cpu", "nvme"])
    if finetune != "full":
        plan.update(_adapters(rng, finetune))
    if rng.random() < 0.6:  # a plan the op-level runs follow, but for what the rest of the draw adds
        plan.update(attention="flash", optimizer="adamw", cp=1, dp=dp * cp, ep=1)
        plan["precision"] = rng.choice(["bf16", "bf16-master", "bf16-mixed", "fp32"])
        if plan["pp"] > 1 or plan["tp"] > 1:
            plan["zero"] = rng.choice([0, 3]) if plan["dp"] > 1 else 0
    mb, seq = rng.choice([1, 2, 4, 8]), rng.choice([512, 2048, 4096, 8192, 32768])
    workload: dict[str, Any] = {"seq_len": seq, "micro_batch": mb}
    if rng.random() < 0.4:
        workload["global_batch"] = mb * plan["dp"] * rng.choice([2, 4, 8])
    runtime = rng.choice(["memplan", "memplan", "hf", "hf", "hf-loop", "megatron"])
    return {"plan": plan, "workload": workload, "gpus": gpus, "runtime": runtime, "gpu": GPU}


def _adapters(rng: random.Random, finetune: str) -> dict[str, Any]:
    """LoRA's fields, and a quantized base's for QLoRA (sometimes an LLM.int8 base under LoRA)."""
    out: dict[str, Any] = {
        "lora_rank": rng.choice([8, 16, 64]),
        "lora_targets": rng.choice([["q_proj", "v_proj"], ["all-linear"]]),
        "lora_dropout": 0.05 if rng.random() < 0.3 else 0.0,
        "modules_to_save": ["lm_head"] if rng.random() < 0.2 else [],
    }
    if finetune == "qlora":
        out["quant"] = rng.choice(["nf4", "nf4", "fp4", "int8"])
        out["double_quant"] = out["quant"] != "int8" and rng.random() < 0.5
    elif rng.random() < 0.2:
        out["quant"] = "int8"
    return out


def search_label(why: str | None, model: ModelSpec, plan: Plan, runtime: str, device: str) -> str:
    """The label of the search's fast form of a plan (``search.evaluate.fast_peak``)."""
    if why is not None:
        return f"search:{why}"
    cut = (plan.finetune != "full" or plan.precision == "fp32") and FR.applies(model, plan, runtime, device)
    return "search-cut" if cut else "search-sums"


def sweep_estimates(reach: Reach, plans: int, seed: int) -> dict[str, int]:
    """``plans`` random plan files through the estimate's callers of the phase model."""
    rng = random.Random(seed)
    names = profile_names("models")
    models = {name: load_model(name) for name in names}
    counts: dict[str, int] = defaultdict(int)
    for _ in range(plans):
        model = models[rng.choice([*names, *FOLLOWED, *FOLLOWED])]
        device = "cpu" if rng.random() < 0.1 else "cuda"
        try:
            job = job_from(model, validate(PlanFile, random_plan(rng, model), ""), "", {})
            why = declined(job.model, job.workload, job.plan, job.runtime, cuda_arch(job.gpu), device)
        except (MemplanError, ValueError):
            counts["refused"] += 1
            continue
        m, w, p, rt = job.model, job.workload, job.plan, job.runtime
        counts["phase" if why else "op-level"] += 1
        if why is not None:
            reach.call(f"estimate:{why}", plan_run, m, w, p, rt, device, job.gpu)
            reach.call(f"estimate:{why}", M.estimate_memory, m, w, p, rt, device)
        else:
            reach.call("advice", M.estimate_memory, m, w, p, rt, device)
            reach.call("report", stage_states, m, p, 0)
            reach.call("report", M.gradient_accumulation, w, p)
            if p.pp > 1 and rt == "memplan":
                reach.call("stage", phase_stage, m, w, p, device)
        reach.call("time", estimate_time, m, w, p, job.gpu, job.cluster, rt)
        reach.call(search_label(why, m, p, rt, device), M.training_peak, m, w, p, rt, device)
    return counts


def sweep_serving(reach: Reach, seed: int) -> None:
    """Inference plans of every model profile: ``estimate_inference`` and ``serving_run``."""
    rng = random.Random(seed)
    for name in profile_names("models"):
        model = load_model(name)
        for _ in range(6):
            tp = rng.choice([1, 2, 4, 8])
            data = {
                "plan": {"tp": tp, "pp": rng.choice([1, 1, 2]), "precision": rng.choice(["bf16", "fp8", "fp32"])},
                "workload": {
                    "kind": "inference", "batch": rng.choice([1, 8]), "prompt_tokens": rng.choice([512, 4096]),
                    "generated_tokens": 128, "kv_dtype": rng.choice(["bf16", "fp8"]),
                    "block_size": rng.choice([None, 16]),
                },
                "gpus": tp * 2,
                "gpu": GPU,
            }  # fmt: skip
            try:
                job = job_from(model, validate(PlanFile, data, ""), "", {}, inference=True)
            except (MemplanError, ValueError):
                continue
            reach.call("serving", M.estimate_memory, job.model, job.workload, job.plan, job.runtime)
            reach.call("serving", M.serving_run, job.model, job.workload, job.plan)


SPACES = (
    {"gpus": 8, "precisions": ("bf16-master", "bf16", "fp32", "fp8"), "allow_offload": True,
     "offload_activations": ("none", "cpu"), "offload_runtime": "memplan"},
    {"gpus": 16, "seq_len": 16384, "precisions": ("bf16-master",), "allow_offload": True},
    {"gpus": 1, "finetune": "lora", "quants": ("none", "nf4", "int8"), "precisions": ("bf16", "fp32"),
     "offload_activations": ("none", "cpu"), "allow_offload": True},
    {"gpus": 4, "finetune": "qlora", "quants": ("nf4", "fp4"), "precisions": ("bf16", "bf16-mixed"),
     "modules_to_save": ("lm_head",), "lora_dropout": 0.05},
    {"gpus": 8, "optimizer": "paged-adamw-8bit", "precisions": ("bf16-master", "fp16-master")},
)  # fmt: skip


def sweep_search(reach: Reach, seed: int) -> int:
    """40 plans of each search space (``search.space.enumerate_space``), model and runtime."""
    rng, arch, n = random.Random(seed), cuda_arch(load_gpu(GPU)), 0
    for options in SPACES:
        for name in profile_names("models"):
            model = load_model(name)
            candidates = enumerate_space(model, SpaceOptions(**options)).candidates
            for c in rng.sample(candidates, min(40, len(candidates))):
                for runtime in ("memplan", "hf", "hf-loop", "megatron"):
                    try:
                        check_compatible(model, c.workload, c.plan, runtime)
                        why = declined(model, c.workload, c.plan, runtime, arch, "cuda")
                    except MemplanError:
                        continue
                    n += 1
                    label = search_label(why, model, c.plan, runtime, "cuda")
                    reach.call(label, M.training_peak, model, c.workload, c.plan, runtime, "cuda")
    return n


def units(source: str) -> list[tuple[str, set[int]]]:
    """Each function of memory.py (methods too) and each ``if`` of ``_stage_phases`` with the lines of
    its statements (docstrings left out)."""
    tree, out = ast.parse(source), []

    def body(nodes: list[ast.stmt]) -> set[int]:
        return {s.lineno for n in nodes for s in ast.walk(n) if isinstance(s, ast.stmt) and not _docstring(s)}

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            out.append((node.name, body(node.body)))
        if isinstance(node, ast.FunctionDef) and node.name == "_stage_phases":
            for sub in ast.walk(node):
                if isinstance(sub, ast.If):
                    test = ast.get_source_segment(source, sub.test) or ""
                    out.append((f"  _stage_phases:{sub.lineno} if {test[:70]}", body(sub.body)))
    return out


def _docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def report(reach: Reach) -> None:
    """Per unit: the decline reasons reaching it and the other labels; then the statements no label
    reached and those reached only where the op-level run answers ``memplan estimate``."""
    source = Path(MEMORY).read_text()
    by_line: dict[int, set[str]] = defaultdict(set)
    for label, lines in reach.lines.items():
        for line in lines:
            by_line[line].add(label)
    statements = set()
    for name, lines in units(source):
        statements |= lines if not name.startswith(" ") else set()
        labels = set().union(*(by_line[n] for n in lines)) if lines else set()
        reasons = sorted(x.split(":", 1)[1] for x in labels if x.startswith("estimate:"))
        others = sorted(x for x in labels if not x.startswith(("estimate:", "search:")))
        shown = "; ".join(reasons) if len(reasons) <= 4 else f"{len(reasons)} reasons"
        print(f"{name}: estimate [{shown}] {' '.join(others)}")
    text = source.splitlines()
    never = sorted(n for n in statements if not by_line[n])
    only_op = sorted(n for n in statements if by_line[n] and not any(x.startswith(PHASE_ANSWERS) for x in by_line[n]))
    print(f"\n{len(statements)} statements; {len(never)} reached by no label:")
    for n in never:
        print(f"  {n}: {text[n - 1].strip()[:100]}")
    print(f"{len(only_op)} reached only where the op-level run answers the estimate:")
    for n in only_op:
        print(f"  {n} [{', '.join(sorted(by_line[n]))}]: {text[n - 1].strip()[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plans", type=int, default=8000, help="random plan files through the estimate's callers")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-search", action="store_true", help="leave the search's spaces out")
    args = parser.parse_args()
    reach = Reach()
    counts = sweep_estimates(reach, args.plans, args.seed)
    sweep_serving(reach, args.seed + 1)
    searched = 0 if args.no_search else sweep_search(reach, args.seed + 2)
    print(f"estimates: {dict(counts)}; search plans: {searched}\n")
    report(reach)


if __name__ == "__main__":
    main()
