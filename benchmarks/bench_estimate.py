"""Speed of the estimate path (a benchmark, not a timed test).

Targets: a cold ``memplan estimate`` (which replays the step through the caching allocator
model) within 1.5x the import floor of its own stack (``import typer, rich.console, pydantic,
yaml``) and 0.3 s on a CI machine; the search's in-process fast form at >= 20,000 plan
evaluations per second (the tuner evaluates millions; the plans it reports are replayed).

    python benchmarks/bench_estimate.py [--runs 10] [--seconds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def cold_cli_seconds(runs: int) -> list[float]:
    """Wall time of a fresh ``memplan estimate`` process (interpreter start included)."""
    exe = shutil.which("memplan")
    cmd = [exe] if exe else [sys.executable, "-m", "memplan.cli"]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(
            [*cmd, "estimate", "llama3-8b", "--gpus", "8", "--zero", "3"], check=True, stdout=subprocess.DEVNULL
        )
        times.append(time.perf_counter() - start)
    return times


def import_floor_seconds(runs: int) -> list[float]:
    """Wall time of a fresh interpreter importing only what the CLI stands on."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import typer, rich.console, pydantic, yaml"], check=True)
        times.append(time.perf_counter() - start)
    return times


def replay_seconds(model_name: str, **plan: object) -> float:
    """One plan's run built and replayed through the allocator model, in-process (best of 3)."""
    from memplan.costmodel.allocator import AllocatorConfig
    from memplan.costmodel.reserve import plan_verdict
    from memplan.specs.loader import load_model
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    model, p = load_model(model_name), Plan(**plan)
    workload = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=p.dp)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        plan_verdict(model, workload, p, "memplan", AllocatorConfig(), 80 * 2**30)
        best = min(best, time.perf_counter() - start)
    return best


def evaluations_per_second(seconds: float, search: bool = False) -> tuple[float, int]:
    """Plans of Llama-3-70B evaluated per second in-process, over a grid of 768 plans: the
    full ``estimate_memory`` report, or (``search``) what the search computes per plan,
    ``search.evaluate.evaluate`` (memory and step time, the fast form), each pass a new search
    context. Process CPU time, not wall time: the cores may be shared."""
    from memplan.costmodel.memory import estimate_memory
    from memplan.search.evaluate import Context, evaluate
    from memplan.search.space import Candidate
    from memplan.specs.hardware import ClusterSpec
    from memplan.specs.loader import load_gpu, load_model
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    model, gpu = load_model("llama3-70b"), load_gpu("h100-sxm")
    workload = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=512)
    plans = [
        Plan(dp=dp, tp=tp, pp=pp, zero=z, recompute=r)
        for dp in (1, 2, 4, 8)
        for tp in (1, 2, 4, 8)
        for pp in (1, 2, 4, 8)
        for z in range(4)
        for r in ("none", "selective", "full")
    ]
    candidates = [Candidate(plan, workload) for plan in plans]
    count, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        if search:
            ctx = Context(model, gpu, ClusterSpec(gpus_per_node=8, nodes=64), margin_bytes=4 * 2**30)
            for candidate in candidates:
                evaluate(candidate, ctx)
        else:
            for plan in plans:
                estimate_memory(model, workload, plan, "memplan")
        count += len(plans)
    return count / (time.process_time() - start), len(plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    floor = statistics.median(import_floor_seconds(args.runs))
    cold = cold_cli_seconds(args.runs)
    rate, grid = evaluations_per_second(args.seconds)
    search_rate, _ = evaluations_per_second(args.seconds, search=True)
    print(f"import floor (typer, rich.console, pydantic, yaml): median {floor:.3f} s")
    print(
        f"cold memplan estimate: median {statistics.median(cold):.3f} s, max {max(cold):.3f} s "
        f"over {args.runs} runs, {statistics.median(cold) / floor:.2f}x the floor (target <= 1.5x, <= 0.3 s)"
    )
    for name, plan in (("llama3-8b", dict(dp=8, zero=3)), ("llama3-70b", dict(dp=64, zero=3, recompute="full"))):
        print(f"replay of one {name} run {plan}: {replay_seconds(name, **plan):.3f} s")
    print(f"in-process: {rate:,.0f} estimate_memory reports/s over a {grid}-plan grid")
    print(f"in-process: {search_rate:,.0f} search evaluations/s (evaluate: memory + time) (target >= 20,000)")


if __name__ == "__main__":
    main()
