"""The steady step of a phase-model run (``timeline.step.build_run``), read by the tests (on sys.path: the
directory of tests/conftest.py)."""

from __future__ import annotations

from memplan.costmodel.timeline.events import ALLOC, FREE


def steady_peak(timeline) -> int:
    """The most bytes live in the run's last step: from the mark before it (``build`` or ``stepN``) to its own."""
    marks = [i for i, e in enumerate(timeline.raw) if e[0] == 2 and e[5].startswith(("step", "build"))]
    start, end = marks[-2], marks[-1]
    live = best = 0
    for i, e in enumerate(timeline.events):
        live += e.size if e.op == ALLOC else -e.size if e.op == FREE else 0
        if start < i <= end:
            best = max(best, live)
    return best
