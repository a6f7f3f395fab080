"""Known-good starting plans for the study (``enqueue_trial``), and a quick greedy search.

Templates are the layouts practitioners start from: FSDP / ZeRO-3 with selective
recomputation and no model parallelism (torchtitan's default for models up to ~70B), the same
with full recomputation (when activations do not fit), and Megatron-LM's TP across the node
with ZeRO-1; for long sequences each also with the largest context parallelism offered. Each
takes its best micro-batch. The greedy then walks from the best of them
one dimension at a time (coordinate descent) while the plan improves, from each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.search.evaluate import Evaluation, Objective, score
from memplan.search.space import Candidate, Space

Evaluate = Callable[[Candidate], Evaluation]


def templates(space: Space) -> list[dict[str, Any]]:
    """Partial coordinates of the template layouts (the rest as close to them as valid), each
    without context parallelism and, where it is offered (long sequences), with the most."""
    values = space.values
    out = []
    for cp in dict.fromkeys((min(values["cp"]), max(values["cp"]))):
        fsdp = {"tp": min(values["tp"]), "pp": min(values["pp"]), "cp": cp, "zero": max(values["zero"])}
        out += [
            {**fsdp, "recompute": "selective"},
            {**fsdp, "recompute": "full"},
            {"tp": max(values["tp"]), "pp": min(values["pp"]), "cp": cp, "zero": min(max(values["zero"]), 1),
             "recompute": "selective"},
        ]  # fmt: skip
    return out


def best_of(candidates: list[Candidate], evaluate: Evaluate, objective: Objective) -> Evaluation:
    return min((evaluate(c) for c in candidates), key=lambda ev: score(ev, objective))


def template_seeds(space: Space, evaluate: Evaluate, objective: Objective) -> list[Evaluation]:
    """Each template at its best micro-batch (and global batch), in the default schedule,
    without offload (of states or activations), in the first allowed precision."""
    defaults = {d: space.values[d][0] for d in ("ep", "schedule", "offload", "offload_activations", "precision")}
    out = []
    for partial in templates(space):
        base = space.nearest({**defaults, **partial}).coordinates
        batches = [
            c
            for c in space.candidates
            if all(v == base[d] for d, v in c.coordinates.items() if d not in ("micro_batch", "global_batch"))
        ]
        out.append(best_of(batches, evaluate, objective))
    return out


def greedy(
    space: Space, start: Evaluation, evaluate: Evaluate, objective: Objective, max_rounds: int = 4
) -> Evaluation:
    """Coordinate descent from ``start``: each varying dimension in turn takes its best value
    (an invalid combination moves to the nearest valid plan), until a round changes nothing."""
    best = start
    for _ in range(max_rounds):
        before = best
        for dim, values in space.choices.items():
            coords = best.candidate.coordinates
            moves = [space.nearest({**coords, dim: v}) for v in values if v != coords[dim]]
            best = best_of([best.candidate, *moves], evaluate, objective)
        if best.candidate.key == before.candidate.key:
            break
    return best


def seeds(space: Space, evaluate: Evaluate, objective: Objective) -> list[Candidate]:
    """The greedy's results from each template, then the templates' plans, best first,
    without repeats."""
    found = template_seeds(space, evaluate, objective)
    walked = [greedy(space, start, evaluate, objective) for start in found]
    ranked = sorted([*walked, *found], key=lambda ev: score(ev, objective))
    out: dict[tuple, Candidate] = {}
    for ev in ranked:
        out.setdefault(ev.candidate.key, ev.candidate)
    return list(out.values())
