"""Speed of the estimate path (a benchmark, not a timed test).

Targets: a cold ``memplan estimate`` (which replays the step through the caching allocator
model) within 1.5x the import floor of its own stack (``import typer, rich.console, pydantic,
yaml``) and 0.3 s on a CI machine; ``--timeline`` adding at most 0.5 s to it; the search's
in-process fast form at >= 20,000 plan evaluations per second (the tuner evaluates millions;
the plans it reports are replayed).

The floor and the estimate are started one after the other in each round, so that other work on
a shared machine weighs on both alike; the ratio reported is the median of the rounds' ratios.
CPU seconds (user + system of the child) are printed beside wall seconds: on a loaded machine
they move less. A second floor, the stack with one pydantic model built and validated, shows
what pydantic's model machinery (imported on the first model class) costs by itself.

    python benchmarks/bench_estimate.py [--runs 10] [--seconds 3] [--timeline-runs 5]
    python benchmarks/bench_estimate.py --instructions
    cd OTHER && .venv/bin/python THIS/benchmarks/bench_estimate.py --instructions --cold-only

``--instructions`` counts instructions instead of seconds, under valgrind's callgrind (``Ir``,
every instruction the process executes): a count does not move with what else the machine runs,
so on a shared 2-core machine it compares two versions where timings cannot. It prints the cold
estimate and the pydantic floor against the import floor, and the search's instructions per plan
(two passes over the grid less the set-up, so that imports and profiles do not count). The
processes it starts import the memplan of the current directory (``python -c`` and ``-m`` put it
first on ``sys.path``, before ``PYTHONPATH``): to compare two versions, run this file from each
checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STACK = "import typer, rich.console, pydantic, yaml"
# the stack, then pydantic's model machinery: one model class built and one instance validated
PYDANTIC = STACK + "\nfrom pydantic import BaseModel\nclass A(BaseModel):\n    x: int = 1\nA(x=2)"
ESTIMATE = ["estimate", "llama3-8b", "--gpus", "8", "--zero", "3"]


def _cli() -> list[str]:
    exe = shutil.which("memplan")
    return [exe] if exe else [sys.executable, "-m", "memplan.cli"]


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process running ``cmd`` (interpreter start included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def rounds(commands: dict[str, list[str]], runs: int) -> dict[str, list[tuple[float, float]]]:
    """Each command once per round, in order, ``runs`` rounds."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, cmd in commands.items():
            out[name].append(timed(cmd))
    return out


def _median(samples: list[tuple[float, float]], i: int) -> float:
    return statistics.median(s[i] for s in samples)


def _ratio(samples: list[tuple[float, float]], floor: list[tuple[float, float]], i: int) -> float:
    return statistics.median(s[i] / f[i] for s, f in zip(samples, floor, strict=True))


def cold_start(runs: int) -> None:
    """The cold estimate against the two floors, alternating in each round."""
    got = rounds(
        {
            "floor": [sys.executable, "-c", STACK],
            "estimate": [*_cli(), *ESTIMATE],
            "pydantic": [sys.executable, "-c", PYDANTIC],
        },
        runs,
    )
    floor, cold, pyd = got["floor"], got["estimate"], got["pydantic"]
    print(f"import floor ({STACK}): median {_median(floor, 0):.3f} s wall, {_median(floor, 1):.3f} s CPU")
    print(
        f"the floor with one pydantic model built: median {_median(pyd, 0):.3f} s wall "
        f"({_ratio(pyd, floor, 0):.2f}x the floor), {_median(pyd, 1):.3f} s CPU ({_ratio(pyd, floor, 1):.2f}x)"
    )
    print(
        f"cold memplan {' '.join(ESTIMATE)}: median {_median(cold, 0):.3f} s wall "
        f"(max {max(s[0] for s in cold):.3f} s), {_median(cold, 1):.3f} s CPU over {runs} runs; "
        f"{_ratio(cold, floor, 0):.2f}x the floor wall, "
        f"{_ratio(cold, floor, 1):.2f}x CPU (target <= 1.5x, <= 0.3 s)"
    )


def timeline_cost(runs: int) -> None:
    """What ``--timeline`` adds to the cold estimate, per format (.png only with Pillow)."""
    kinds = ["html", "pickle", "svg"] + (["png"] if importlib.util.find_spec("PIL") else [])
    with tempfile.TemporaryDirectory() as tmp:
        commands = {"none": [*_cli(), *ESTIMATE]}
        commands.update({k: [*_cli(), *ESTIMATE, "--timeline", str(Path(tmp) / f"t.{k}")] for k in kinds})
        got = rounds(commands, runs)
    base = got["none"]
    for kind in kinds:
        wall = statistics.median(s[0] - b[0] for s, b in zip(got[kind], base, strict=True))
        cpu = statistics.median(s[1] - b[1] for s, b in zip(got[kind], base, strict=True))
        print(f"--timeline t.{kind} adds {wall:+.3f} s wall, {cpu:+.3f} s CPU (median of {runs}; target <= 0.5 s)")


def replay_seconds(model_name: str, **plan: object) -> tuple[float, float]:
    """One plan's run built, and replayed through the allocator model, in-process (best of 5 each)."""
    from memplan.costmodel.allocator import AllocatorConfig
    from memplan.costmodel.reserve import plan_run, replay
    from memplan.specs.loader import load_model
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    model, p = load_model(model_name), Plan(**plan)
    workload = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=p.dp)
    build = replayed = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run, _ = plan_run(model, workload, p, "memplan")
        middle = time.perf_counter()
        replay(run, AllocatorConfig(), 80 * 2**30)
        build, replayed = min(build, middle - start), min(replayed, time.perf_counter() - middle)
    return build, replayed


def _grid() -> tuple:
    """(Llama-3-70B, the H100 SXM profile, 768 candidate plans: dp, tp, pp in 1-8, ZeRO 0-3,
    every recomputation), at seq 4096, micro-batch 1, global batch 512."""
    from memplan.search.space import Candidate
    from memplan.specs.loader import load_gpu, load_model
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    workload = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=512)
    plans = [
        Plan(dp=dp, tp=tp, pp=pp, zero=z, recompute=r)
        for dp in (1, 2, 4, 8)
        for tp in (1, 2, 4, 8)
        for pp in (1, 2, 4, 8)
        for z in range(4)
        for r in ("none", "selective", "full")
    ]
    return load_model("llama3-70b"), load_gpu("h100-sxm"), [Candidate(plan, workload) for plan in plans]


def evaluations_per_second(seconds: float, search: bool = False) -> tuple[float, int]:
    """Plans of Llama-3-70B evaluated per second in-process, over a grid of 768 plans: the
    full ``estimate_memory`` report, or (``search``) what the search computes per plan,
    ``search.evaluate.evaluate`` (memory and step time, the fast form), each pass a new search
    context. Process CPU time, not wall time: the cores may be shared."""
    from memplan.costmodel.memory import estimate_memory
    from memplan.search.evaluate import Context, evaluate
    from memplan.specs.hardware import ClusterSpec

    model, gpu, candidates = _grid()
    workload = candidates[0].workload
    plans = [c.plan for c in candidates]
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


def instructions(cmd: list[str]) -> int:
    """Instructions one process running ``cmd`` executes (callgrind's ``Collected``), with a fixed
    hash seed so that two counts of the same code agree to a few parts in a million. ``cmd`` runs
    once first, uncounted: it compiles and caches every module it imports, and a count of it (the
    search's set-up, say) would hold that compilation. ``PYTHONDONTWRITEBYTECODE`` is dropped for
    both runs: set (as in the helpers' shells), a checkout without ``__pycache__`` compiles every
    memplan module from source on each run, ~0.3 G of a cold estimate's count that an installed
    memplan (bytecode compiled at install) never spends."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONHASHSEED"] = "0"
    subprocess.run(cmd, capture_output=True, env=env, check=True)
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"callgrind printed no count: {out.stderr[-300:]}")
    return int(found.group(1))


SEARCH_PASSES = """
import sys
sys.path.insert(0, {here!r})
from bench_estimate import search_passes
search_passes(int(sys.argv[1]))
"""


def search_passes(passes: int) -> None:
    """``passes`` passes of ``evaluate`` over the 768-plan grid, each with a new search context."""
    from memplan.search.evaluate import Context, evaluate
    from memplan.specs.hardware import ClusterSpec

    model, gpu, candidates = _grid()
    for _ in range(passes):
        ctx = Context(model, gpu, ClusterSpec(gpus_per_node=8, nodes=64), margin_bytes=4 * 2**30)
        for candidate in candidates:
            evaluate(candidate, ctx)


def instruction_counts(cold_only: bool = False) -> None:
    """The cold start and the search's per-plan cost in instructions (module docstring); with
    ``cold_only``, the cold estimate alone: ``python -m memplan.cli`` run from the current directory
    (first on ``sys.path``) by the interpreter running this file, so that run from another checkout
    with its own virtual environment it counts that checkout with this file's method."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (callgrind) on the PATH")
    if cold_only:
        cold = instructions([sys.executable, "-m", "memplan.cli", *ESTIMATE])
        print(f"cold memplan {' '.join(ESTIMATE)}: {cold / 1e9:.3f} G ({cold:,} instructions)")
        return
    floor = instructions([sys.executable, "-c", STACK])
    pyd = instructions([sys.executable, "-c", PYDANTIC])
    cold = instructions([*_cli(), *ESTIMATE])
    print(f"import floor ({STACK}): {floor / 1e9:.3f} G instructions")
    print(f"the floor with one pydantic model built: {pyd / 1e9:.3f} G ({pyd / floor:.2f}x the floor)")
    print(f"cold memplan {' '.join(ESTIMATE)}: {cold / 1e9:.3f} G ({cold / floor:.2f}x the floor; target <= 1.5x)")
    script = SEARCH_PASSES.format(here=str(Path(__file__).resolve().parent))
    setup = instructions([sys.executable, "-c", script, "0"])
    two = instructions([sys.executable, "-c", script, "2"])
    print(f"the search's evaluate: {(two - setup) / 2 / len(_grid()[2]):,.0f} instructions per plan (768-plan grid)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--timeline-runs", type=int, default=5)
    parser.add_argument("--instructions", action="store_true", help="count instructions (valgrind) instead")
    parser.add_argument("--cold-only", action="store_true", help="with --instructions: the cold estimate alone")
    args = parser.parse_args()
    if args.instructions:
        instruction_counts(args.cold_only)
        return
    cold_start(args.runs)
    if args.timeline_runs:
        timeline_cost(args.timeline_runs)
    for name, plan in (
        ("llama3-8b", dict(dp=8, zero=3)),
        ("llama3-8b", dict(dp=8, zero=3, precision="bf16-mixed")),  # the bundled trainer's op-by-op run
        ("llama3-70b", dict(dp=64, zero=3, recompute="full")),
    ):
        build, replayed = replay_seconds(name, **plan)
        print(f"one {name} run {plan}: built in {build:.3f} s, replayed in {replayed:.3f} s")
    rate, grid = evaluations_per_second(args.seconds)
    search_rate, _ = evaluations_per_second(args.seconds, search=True)
    print(f"in-process: {rate:,.0f} estimate_memory reports/s over a {grid}-plan grid")
    print(f"in-process: {search_rate:,.0f} search evaluations/s (evaluate: memory + time) (target >= 20,000)")


if __name__ == "__main__":
    main()
