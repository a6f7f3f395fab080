"""Print docs/accuracy.md's trainer table: each plan of tests/validate run by the bundled
trainer under rank simulation, measured against ``--runtime memplan``.

    python benchmarks/trainer_table.py > /tmp/table.md
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "validate"))

from trainer_cases import CASES  # noqa: E402

from memplan.train.runner import run  # noqa: E402


def main() -> None:
    print("| case | plan | world | predicted (B) | measured (B) | error | phase |")
    print("|---|---|---:|---:|---:|---:|---|")
    for case in CASES:
        spec, predicted = case.spec()
        record = run(spec)
        if record.status != "ok":
            print(f"| {case.name} | {record.status}: {record.reason} | | | | | |")
            continue
        measured = record.peak_allocated
        plan = ", ".join(f"{k}={v}" for k, v in case.plan.items())
        model = "" if case.model.name == "tiny-gqa" else f" ({case.model.name})"
        error = 100 * (predicted - measured) / measured
        print(
            f"| {case.name} | {plan}{model} | {spec.plan.world_size} | {predicted:,} | {measured:,} "
            f"| {error:+.3f}% | {record.peak_phase} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
