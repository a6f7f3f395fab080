"""When no plan fits: what would make one fit.

Three kinds of change, each checked with the memory model: a change to the closest plan that
the search did not try (``costmodel.advice.suggest``: offloading, another precision or
optimizer, a smaller fixed micro-batch), more GPUs of the same kind (x2, x4, x8: the whole
space searched again for its smallest peak), or a bundled GPU with more memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.advice import suggest
from memplan.search.evaluate import Context, Evaluation, peak_reserved, reserved_bound, whole_run
from memplan.search.space import Candidate, SpaceOptions, enumerate_space
from memplan.specs.loader import load_gpu, profile_names

GPU_FACTORS = (2, 4, 8)
Keep = Callable[[Candidate, Context], bool]
# the flag of memplan tune that lets the search try a change suggest() proposes
_FLAGS = {
    "offload": "--allow-offload",
    "ZeRO-Offload": "--allow-offload",
    "ZeRO-3 with parameters": "--allow-offload",
    "ZeRO-Infinity": "--allow-offload",
    "precision": "--precision",
    "8-bit AdamW": "--optimizer adamw-8bit",
    "paged 8-bit AdamW": "--optimizer paged-adamw-8bit",
    "micro-batch": "--micro-batch",
    "sequence parallelism": "--sequence-parallel",
}


class Fix(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str  # plan, gpus, gpu
    change: str
    peak_reserved_bytes: int
    limit_bytes: int


def plan_changes(closest: Evaluation, ctx: Context) -> list[Fix]:
    """Changes to the closest plan (single ones, or combined when no single one is enough) that
    bring it under the limit, with the flags that let ``memplan tune`` search them."""
    found = suggest(
        ctx.model,
        closest.workload,
        closest.plan,
        ctx.runtime,
        ctx.limit_bytes,
        closest.peak_reserved_bytes,
        ctx.device,
        gpu=ctx.gpu,
        cluster=ctx.cluster,
    )
    out = []
    for s in found:
        if not s.fits:
            continue
        flags = dict.fromkeys(f for part in s.change.split(" + ") if (f := _flag(part)))
        change = f"{s.change} ({', '.join(flags)})" if flags else s.change
        out.append(Fix(kind="plan", change=change, peak_reserved_bytes=s.reserved, limit_bytes=ctx.limit_bytes))
    return out


def _flag(change: str) -> str | None:
    """The flag of ``memplan tune`` that lets the search try one change, if one does."""
    flag = next((f for key, f in _FLAGS.items() if change.startswith(key)), None)
    if flag in ("--precision", "--micro-batch"):
        flag += " " + change.split()[-1]
    return flag


def lowest_peak(candidates: tuple[Candidate, ...], ctx: Context) -> tuple[Candidate, int] | None:
    """The candidate with the smallest reserved peak (memory model only), the first of equals. The plans
    whose peak costs a whole op-level run (``evaluate.whole_run``: ~0.6 s each for llama3-70b under FSDP2)
    come last, each first bounded from below (``evaluate.reserved_bound``: its run's first step) and left
    out where the bound already loses to the best so far (higher, or equal from a later candidate): the
    answer is the one every plan's peak gives (tests/search/test_advice_bound.py)."""
    best: tuple[int, Candidate, int] | None = None  # (index, candidate, reserved)
    later: list[tuple[int, Candidate]] = []
    for i, c in enumerate(candidates):
        if whole_run(c, ctx):
            later.append((i, c))
            continue
        reserved = peak_reserved(c, ctx)
        if best is None or reserved < best[2]:
            best = (i, c, reserved)
    for i, c in later:
        if best is not None:
            bound = reserved_bound(c, ctx)
            if bound is not None and (bound, i) > (best[2], best[0]):
                continue
        reserved = peak_reserved(c, ctx)
        if best is None or (reserved, i) < (best[2], best[0]):
            best = (i, c, reserved)
    return None if best is None else (best[1], best[2])


def more_gpus(options: SpaceOptions, ctx: Context, keep: Keep | None = None) -> Fix | None:
    """The fewest GPUs (x2, x4, x8) on which some plan fits (of those ``keep`` keeps: an export
    target's)."""
    for factor in GPU_FACTORS:
        gpus = options.gpus * factor
        per_node = ctx.cluster.gpus_per_node if ctx.cluster.nodes > 1 else min(gpus, max(8, options.gpus_per_node))
        if gpus % per_node:
            continue
        bigger = replace(
            ctx, cluster=ctx.cluster.model_copy(update={"gpus_per_node": per_node, "nodes": gpus // per_node})
        )
        space = enumerate_space(ctx.model, options.model_copy(update={"gpus": gpus, "gpus_per_node": per_node}))
        candidates = tuple(c for c in space.candidates if keep is None or keep(c, bigger))
        best = lowest_peak(candidates, bigger)
        if best is not None and best[1] <= ctx.limit_bytes:
            change = f"{gpus} x {ctx.gpu.name} ({best[0].describe()})"
            return Fix(kind="gpus", change=change, peak_reserved_bytes=best[1], limit_bytes=ctx.limit_bytes)
    return None


def bigger_gpus(closest: Evaluation, ctx: Context) -> list[Fix]:
    """Bundled GPUs with more memory that the closest plan fits (the same margin share)."""
    share = ctx.margin_bytes / ctx.gpu.memory_bytes
    out = []
    for name in profile_names("gpus"):
        gpu = load_gpu(name)
        limit = gpu.memory_bytes - round(share * gpu.memory_bytes)
        if gpu.memory_bytes > ctx.gpu.memory_bytes and closest.peak_reserved_bytes <= limit:
            change = f"--gpu {gpu.name} ({gpu.display_name}, {gpu.memory_bytes / 2**30:.0f} GiB)"
            out.append(
                Fix(kind="gpu", change=change, peak_reserved_bytes=closest.peak_reserved_bytes, limit_bytes=limit)
            )
    return sorted(out, key=lambda f: f.limit_bytes)


def what_would_fit(closest: Evaluation, options: SpaceOptions, ctx: Context, keep: Keep | None = None) -> list[Fix]:
    gpus = more_gpus(options, ctx, keep)
    return [*plan_changes(closest, ctx), *([gpus] if gpus else []), *bigger_gpus(closest, ctx)]
