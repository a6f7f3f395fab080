"""Print the HF accuracy table for docs/accuracy.md: memplan ``--runtime hf`` (the Trainer's step) and
``--runtime hf-loop`` (the hand loop) vs MemTracker, case by case (each case names its loop).

python benchmarks/accuracy_table.py > /tmp/table.md
"""

from __future__ import annotations

import platform
import subprocess
import sys
import warnings
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "accuracy"))


def main() -> None:
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    from hf_steps import CASES, measure_peak, predict_peak

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"Measured {date.today().isoformat()} at commit {commit} on {platform.processor() or platform.machine()} "
        f"CPU, Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}."
    )
    print()
    print(
        "| case | arch | precision | attention | ckpt | tied | b x s | layers | h | V | predicted (B) | measured (B) "
        "| error | phase |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---:|---:|---:|---|")
    worst = 0.0
    for case in CASES:
        predicted, phase = predict_peak(case)
        measured = measure_peak(case)
        error = 100 * (predicted - measured) / measured
        worst = max(worst, abs(error))
        print(
            f"| {case.name} | {case.arch} | {case.precision} | {case.attention} "
            f"| {'yes' if case.checkpointing else 'no'} "
            f"| {'yes' if case.tied else 'no'} | {case.batch} x {case.seq} | {case.layers} | {case.hidden} "
            f"| {case.vocab} | {predicted:,} | {measured:,} | {error:+.3f}% | {phase} |"
        )
    print()
    print(f"Worst absolute error: {worst:.3f}% over {len(CASES)} cases (bound: 3%).")


if __name__ == "__main__":
    main()
