"""Search quality of ``memplan tune`` (a benchmark, not a timed test).

Targets (issue: search): for Llama-3-8B on 8 x H100, Llama-3-70B on 64 x H100 and
Llama-3.1-405B on 512 x H100 with fixed global batches, the Optuna study's best plan within 1%
of the exhaustive optimum's predicted throughput in <= 300 trials, and the exhaustive search
of each within 30 s on a CI machine.

Workloads: sequences of 8192 tokens (Llama 3's pre-training length) and global batches of
128 (1M tokens), 512 (4M) and 2048 (16M, the Llama 3 paper's batch for 405B) sequences; the
default search space (``memplan tune``'s defaults: bf16-mixed, no offload, no CP at 8192).

For each seed the study runs as ``memplan tune`` does (seeded multivariate TPE, known-good
plans enqueued first), in memory; ``seed evals`` counts the plans the seeding (templates and
greedy) predicted before the first trial (outside the trial count); "trials to within 1%"
counts from 0, so 0 means the first enqueued plan was already there. The ablation columns run
TPE alone (nothing enqueued). ``--wide`` adds a ~40k-plan space beyond the targets.

    python benchmarks/bench_tune.py [--seeds 5] [--trials 300] [--wide]
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import optuna

from memplan.search import study as S
from memplan.search.evaluate import Context, evaluate_all, rank
from memplan.search.seeds import seeds
from memplan.search.space import SpaceOptions, enumerate_space
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model

SEQ_LEN = 8192
CASES = [  # (model, GPUs, SpaceOptions fields beyond the GPUs)
    ("llama3-8b", 8, {"seq_len": SEQ_LEN, "global_batches": (128,)}),
    ("llama3-70b", 64, {"seq_len": SEQ_LEN, "global_batches": (512,)}),
    ("llama3.1-405b", 512, {"seq_len": SEQ_LEN, "global_batches": (2048,)}),
]
# beyond the targets: a wider space (CP offered at 32k, two batches, two precisions, offload)
WIDE = ("llama3-70b", 64, {"seq_len": 32768, "global_batches": (64, 128), "precisions": ("bf16-mixed", "bf16"),
                           "allow_offload": True})  # fmt: skip
MARGIN = 0.05  # memplan tune's default --margin


def context(name: str, gpus: int) -> Context:
    gpu = load_gpu("h100-sxm")
    cluster = ClusterSpec(gpus_per_node=8, nodes=max(1, gpus // 8))
    return Context(load_model(name), gpu, cluster, margin_bytes=round(MARGIN * gpu.memory_bytes))


def exhaustive(ctx: Context, options: SpaceOptions) -> tuple[float, int, int, float]:
    """(best tokens/s, plans, fitting plans, seconds for enumeration and prediction)."""
    start = time.perf_counter()
    space = enumerate_space(ctx.model, options)
    evaluations = evaluate_all(space.candidates, ctx)
    seconds = time.perf_counter() - start
    best = rank(evaluations, "throughput")[0]
    return best.tokens_per_s, len(space), sum(ev.fits for ev in evaluations), seconds


def study_run(
    ctx: Context, options: SpaceOptions, seed: int, trials: int, enqueue: bool, optimum: float
) -> tuple[float, int, int]:
    """(best fitting tokens/s, first trial within 1% of the optimum or -1, seeding evaluations)."""
    space = enumerate_space(ctx.model, options)
    objective = S.SearchObjective(space, ctx, "throughput")
    study = optuna.create_study(direction="maximize", sampler=S.make_sampler("throughput", seed))
    seeding = 0
    if enqueue:
        S.enqueue_seeds(study, space, seeds(space, objective.evaluate, "throughput"))
        seeding = len(objective.cache)
    S.optimize(study, objective, trials)
    values = [t.value if t.user_attrs["constraint"] <= 0 else 0.0 for t in study.trials]
    return max(values), next((i for i, v in enumerate(values) if v >= 0.99 * optimum), -1), seeding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--wide", action="store_true", help="Add the wider llama3-70b space (~40k plans).")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore")
    print(f"# memplan tune search quality ({platform.machine()}, optuna {optuna.__version__}, {args.trials} trials)")
    print()
    print(
        "| model | GPUs | space | plans (fit) | exhaustive optimum tokens/s | exhaustive s (plans/s) "
        "| study gap % per seed | trials to within 1% | seed evals | TPE alone gap % | TPE alone trials to 1% |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name, gpus, fields in [*CASES, *([WIDE] if args.wide else [])]:
        ctx = context(name, gpus)
        options = SpaceOptions(gpus=gpus, **fields)
        best, plans, fitting, seconds = exhaustive(ctx, options)
        runs = [study_run(ctx, options, seed, args.trials, True, best) for seed in range(args.seeds)]
        alone = [study_run(ctx, options, seed, args.trials, False, best) for seed in range(args.seeds)]
        batches = "/".join(map(str, options.global_batches or ()))
        space = f"{batches} x {options.seq_len}" + (" (wide)" if fields is WIDE[2] else "")
        print(
            f"| {name} | {gpus} | {space} | {plans} ({fitting}) | {best:,.0f} | {seconds:.2f} ({plans / seconds:,.0f}) "
            f"| {' / '.join(f'{100 * (1 - r[0] / best):.2f}' for r in runs)} | {' / '.join(str(r[1]) for r in runs)} "
            f"| {' / '.join(str(r[2]) for r in runs)} | {' / '.join(f'{100 * (1 - r[0] / best):.2f}' for r in alone)} "
            f"| {' / '.join(str(r[1]) for r in alone)} |"
        )


if __name__ == "__main__":
    main()
