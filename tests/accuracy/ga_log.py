"""A ``Trainer`` run with gradient accumulation, measured like hf_steps.py's (``measure``), or logged
storage by storage like alloc_log.py (``python tests/accuracy/ga_log.py 2``: two micro-batches)."""

from __future__ import annotations

import sys
import tempfile

import hf_steps
import torch
import transformers
from alloc_log import AllocLog


def measure(case: hf_steps.Case, ga: int, steps: int = 3, log: AllocLog | None = None) -> int:
    """``Trainer.train()`` with ``gradient_accumulation_steps=ga`` over ``steps`` optimizer steps."""
    model = hf_steps._model(case)
    ids = torch.randint(0, case.vocab, (case.batch * ga * steps, case.seq))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    tracker = log or hf_steps.StorageTracker()
    with tempfile.TemporaryDirectory() as out:
        args = hf_steps.training_args(out, case, steps, ga)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        tracker.track_module(model)
        with tracker:
            trainer.train()
    return tracker.peak


if __name__ == "__main__":
    log = AllocLog()
    peak = measure(hf_steps.Case("ga", loop="trainer"), int(sys.argv[1]), log=log)
    for i, (sign, size, op, live) in enumerate(log.events):
        print(f"{i:6d} {sign} {size:12d} {op:40s} {live:12d}")
    print("peak", peak)
