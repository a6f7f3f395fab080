"""`memplan estimate`'s cold start stopped at one stage, for counting each stage's instructions.

Usage (from the tree to count, under callgrind as ``bench_estimate.py --instructions`` runs it)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind python benchmarks/cold_stages.py STAGE

STAGE: ``import`` (the interpreter and ``memplan.cli.estimate``'s import), ``prerun`` (to
``reserve.plan_run``'s entry: typer's parsing and ``resolve_job``), ``built`` (``plan_run`` returned),
``replayed`` (``reserve.replay`` returned), ``full`` (the whole command, without the interpreter's
teardown). Each stage leaves through ``os._exit``; the difference between two stages is the cost of what
runs between them (docs/accuracy.md, "the eighth pass"). The plan: ``llama3-8b --gpus 8 --zero 3``.
"""

import gc
import importlib
import os
import sys

STAGES = ("import", "prerun", "built", "replayed", "full")


def _leave_at_entry(_f):
    def wrapper(*_a, **_k):
        os._exit(0)

    return wrapper


def _leave_after(f):
    def wrapper(*a, **k):
        f(*a, **k)
        os._exit(0)

    return wrapper


def main() -> None:
    stage = sys.argv[1] if len(sys.argv) > 1 else "full"
    if stage not in STAGES:
        sys.stderr.write(f"cold_stages.py: stage {stage!r} is not one of {', '.join(STAGES)}\n")
        raise SystemExit(2)
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    sys.argv = ["memplan", "estimate", "llama3-8b", "--gpus", "8", "--zero", "3"]
    gc.disable()
    importlib.import_module("memplan.cli.estimate")
    gc.freeze()
    if stage == "import":
        os._exit(0)
    from memplan.costmodel import reserve

    if stage == "prerun":
        reserve.plan_run = _leave_at_entry(reserve.plan_run)
    elif stage == "built":
        reserve.plan_run = _leave_after(reserve.plan_run)
    elif stage == "replayed":
        reserve.replay = _leave_after(reserve.replay)
    from memplan.cli import app

    app._KEPT = []  # as main does for estimate: what the command made is held to the exit (app.keep_to_exit)
    app._leave(app.run())


if __name__ == "__main__":
    main()
