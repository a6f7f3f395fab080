"""A study for issue 27, item 2: one decoder layer of the bundled trainer's op-level run, each event's bytes
solved as a polynomial in the plan's sizes, held against the run at other sizes (a measurement, not a test).

The layer is the run's own template (``timeline/layer_repeat.py``): layer 2's forward and layer ``L - 2``'s
backward of a model cut to 6 layers, warm-up step only (its events equal the steady step's on every key of
the 768-plan grid). Built at three sizes ``(b, s)`` = (1, 512), (1, 1024), (2, 512), the events are matched
one to one (op, category, stream, tag) and each event's bytes solved exactly (integer Cramer's rule) in the
basis ``1, b*s, b*s^2``. A fourth build at the largest size a search asks (``LARGEST``) finds where an event
stops growing: one with fewer bytes there than its polynomial says is taken as ``min(polynomial, those
bytes)``. Then, at sizes never built for it, every derived event is held to the run's to the byte, with
the fourth build's caps and without them; the tags that miss are printed. The live bytes after each event (from the
layer's start) are the running sums; the *envelope* counts the events whose running sum is the layer's
highest at some sampled size (``ENVELOPE_TOKENS``), the only ones a fast form would keep.

docs/cost-model.md, "Deriving the search's fast form from the run: one layer's template (2026-11-28)",
holds the figures and what they decide.

    python benchmarks/derived_layer.py [--model llama3-70b]
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

from memplan.costmodel.timeline.events import ALLOC, Event
from memplan.costmodel.timeline.layer_repeat import BACKWARD
from memplan.costmodel.timeline.trainer import _Run, dims, steps
from memplan.specs.loader import load_model
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

DEPTH = 6  # the shallowest model whose run has a template layer: layer_repeat.span(6) == range(3, 4)
SIZES = ((1, 512), (1, 1024), (2, 512))  # 1, b*s and b*s^2 independent across these
LARGEST = (8, 32768)  # a fourth build, at the largest size a search would ask: where an event's bytes stop growing
HELD_OUT = ((1, 4096), (2, 2048), (4, 8192), (1, 256), (3, 1536), (1, 1000), (3, 777), (5, 4099))
# sequence parallel: the gathered input's batch-major copy exists only for b > 1, so each branch on its own
BRANCHES = (
    (((1, 512), (1, 1024), (1, 2048)), tuple(x for x in HELD_OUT if x[0] == 1), (1, 262144)),
    (((2, 512), (2, 1024), (4, 512)), tuple(x for x in HELD_OUT if x[0] > 1), LARGEST),
)
ENVELOPE_TOKENS = tuple((b, s) for b in (1, 2, 4) for s in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768))


def template(model: ModelSpec, plan: Plan, b: int, s: int) -> tuple[list[Event], list[Event]]:
    """(forward, backward) events of the run's template layer at micro-batch ``b``, sequence ``s``."""
    cut = model.model_copy(update={"num_layers": DEPTH})
    wl = TrainingWorkload(seq_len=s, micro_batch=b, global_batch=b * plan.dp)
    run = _Run(dims(cut, wl, plan), plan.dp, cut.tied_embeddings, plan.zero, master=plan.precision == "bf16-master")
    run.layers = run.layer_repeat()
    if run.layers is None:
        raise ValueError(f"no template layer for {plan}")
    run.b.mark("build")
    steps(run.b, run.step, 0, False)
    layers, events = run.layers, list(map(Event._make, run.b.events))  # the builder keeps plain tuples
    start, end = layers.template_forward
    starts = {(kind, layer): event for _, _, kind, layer, event in layers.blocks}
    return events[start[0] : end[0]], events[starts[BACKWARD, DEPTH - 2] : starts[BACKWARD, DEPTH - 3]]


def basis(b: int, s: int) -> tuple[int, int, int]:
    return 1, b * s, b * s * s


def _det(m: list[tuple[int, ...]]) -> int:
    (a, b, c), (d, e, f), (g, h, i) = m
    return a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)


def solve(rows: list[tuple[int, int, int]], ys: list[int]) -> tuple[Fraction, ...]:
    """The exact coefficients of ``rows @ c == ys`` (Cramer's rule over ints)."""
    det = _det(rows)
    cols = [[r[:k] + (y,) + r[k + 1 :] for r, y in zip(rows, ys, strict=True)] for k in range(3)]
    return tuple(Fraction(_det(c), det) for c in cols)


# per event: (op, category, stream, tag), coefficients, and the bytes it stops at (None: a polynomial)
Derived = list[tuple[tuple, tuple[Fraction, ...], int | None]]


def derive(model: ModelSpec, plan: Plan, sizes: tuple = SIZES, largest: tuple | None = None) -> tuple[Derived, Derived]:
    """Each template event's bytes as a polynomial (``basis``); ValueError where the builds' events do not
    pair one to one (the layer's structure changes with the sizes). With ``largest``, a fourth build there:
    an event with fewer bytes than its polynomial says is taken as ``min(polynomial, those bytes)``."""
    builds = [template(model, plan, b, s) for b, s in (*sizes, *([largest] if largest else []))]
    rows = [basis(b, s) for b, s in sizes]
    out = []
    for part in (0, 1):
        runs = [build[part] for build in builds]
        if len({len(r) for r in runs}) != 1:
            raise ValueError(f"event counts {[len(r) for r in runs]} at {sizes}")
        derived: Derived = []
        for same in zip(*runs, strict=True):
            keys = {(e.op, e.category, e.stream, e.tag) for e in same}
            if len(keys) != 1:
                raise ValueError(f"events do not pair: {sorted(map(str, keys))}")
            coeffs = solve(rows, [e.size for e in same[:3]])
            cap = None
            if largest is not None and same[3].size < _at(coeffs, *largest):
                cap = same[3].size
            derived.append((keys.pop(), coeffs, cap))
        out.append(derived)
    return out[0], out[1]


def _at(coeffs: tuple[Fraction, ...], b: int, s: int) -> Fraction:
    return sum((c * v for c, v in zip(coeffs, basis(b, s), strict=True)), Fraction(0))


def sizes_at(derived: Derived, b: int, s: int) -> list[Fraction]:
    return [_at(coeffs, b, s) if cap is None else min(_at(coeffs, b, s), cap) for _, coeffs, cap in derived]


def misses(model: ModelSpec, plan: Plan, derived: tuple[Derived, Derived], held: tuple = HELD_OUT) -> list[tuple]:
    """(b, s, tag, derived bytes, the run's) of every held-out event the derivation does not give to the byte."""
    out = []
    for b, s in held:
        for part, events in zip(derived, template(model, plan, b, s), strict=True):
            if len(part) != len(events):
                out.append((b, s, "event count", len(part), len(events)))
                continue
            for (key, _, _), size, e in zip(part, sizes_at(part, b, s), events, strict=True):
                if size != e.size or key[3] != e.tag:
                    out.append((b, s, e.tag, size, e.size))
    return out


def running(events: list[Event]) -> list[int]:
    """The live bytes after each event, from the block's start (frees of carried tensors count)."""
    live, out = 0, []
    for e in events:
        live += e.size if e.op == ALLOC else -e.size
        out.append(live)
    return out


def envelope(model: ModelSpec, plan: Plan, batches: tuple[int, ...]) -> tuple[int, int]:
    """How many (forward, backward) events are the layer's highest live moment at some ``ENVELOPE_TOKENS`` size
    with a micro-batch in ``batches`` (one branch of the layer's structure), taken from the run at each size (so
    that terms that are not polynomials count as they run)."""
    tops: tuple[set, set] = (set(), set())
    for b, s in (x for x in ENVELOPE_TOKENS if x[0] in batches):
        for part, events in enumerate(template(model, plan, b, s)):
            live = running(events)
            top = max(live)
            tops[part].update(i for i, v in enumerate(live) if v == top)
    return len(tops[0]), len(tops[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-70b")
    args = parser.parse_args()
    model = load_model(args.model)
    print(
        "| tp | SP | recompute | precision | built at b | events fwd/bwd | non-integer | b*s^2 terms "
        "| missed (3 builds) | capped by the 4th | missed (4 builds) | envelope | ms (4 builds) |"
    )
    print("|---:|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for tp in (1, 2, 4, 8):
        for sp in (False, True) if tp > 1 else (False,):
            for recompute in ("none", "selective", "full"):
                for precision in ("bf16", "bf16-mixed"):
                    plan = Plan(tp=tp, sequence_parallel=sp, recompute=recompute, precision=precision)
                    row = f"| {tp} | {'yes' if sp else 'no'} | {recompute} | {precision} |"
                    for sizes, held, largest in (
                        ((SIZES, HELD_OUT, LARGEST), *BRANCHES) if sp else ((SIZES, HELD_OUT, LARGEST),)
                    ):
                        _row(model, plan, f"{row} {sizes[0][0]}..{sizes[-1][0]} |", sizes, held, largest)


def _row(model: ModelSpec, plan: Plan, row: str, sizes: tuple, held: tuple, largest: tuple) -> None:
    """One table row: the derivation from ``sizes`` (and ``largest``) held to the run at ``held``."""
    start = time.process_time()
    try:
        derived = derive(model, plan, sizes, largest)
    except ValueError as e:
        print(f"{row} {e} | | | | | | | |")
        return
    ms = (time.process_time() - start) * 1e3
    uncapped = tuple([(key, c, None) for key, c, _ in part] for part in derived)
    coeffs = [c for part in derived for _, c, _ in part]
    fractional = sum(any(v.denominator != 1 for v in c) for c in coeffs)
    squared = sum(c[2] != 0 for c in coeffs)
    capped = sum(cap is not None for part in derived for _, _, cap in part)
    if plan.sequence_parallel:  # specs.job: sequence parallel needs seq_len divisible by tp
        held = tuple(x for x in held if x[1] % plan.tp == 0)
    missed = [", ".join(sorted({str(m[2]) for m in misses(model, plan, d, held)})) or "-" for d in (uncapped, derived)]
    batches = tuple({b for b, _ in held} | {b for b, _ in sizes})
    fwd, bwd = envelope(model, plan, batches)
    counts = f"{len(derived[0])}/{len(derived[1])}"
    print(
        f"{row} {counts} | {fractional} | {squared} | {missed[0]} | {capped} | {missed[1]} | {fwd}+{bwd} | {ms:.0f} |"
    )


if __name__ == "__main__":
    main()
