"""``transformers.Trainer`` over a PEFT model on CPU, measured by live storages (issue 28 item 2).

The case is a :class:`peft_steps.PeftCase` (the tiny configurations and LoRA configs of the hand-loop
suite); the loop is the real ``Trainer.train()`` with its defaults (fused AdamW over the trainable
parameters, ``max_grad_norm=1.0``, ``model.zero_grad()``), ``bf16=True`` for autocast cases, and its
own gradient checkpointing (``gradient_checkpointing=True``: ``activation_checkpointing_enable`` with
``use_reentrant=False``, which also calls ``enable_input_require_grads``). Counted by
:class:`StorageTracker` (no reference kept), over the model's parameters and buffers.

    python tests/accuracy/hf_peft_steps.py NAME   # prints the allocation sequence of one case
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile

import hf_steps
import peft_steps
import torch
import transformers
from storage_tracker import StorageTracker


def build(case: peft_steps.PeftCase):
    """The PEFT model of a case as a user builds it for the Trainer: the base (``to(dtype)``), then
    ``get_peft_model``; checkpointing is left to the Trainer's argument."""
    if case.quant != "none":
        return peft_steps.build(case)
    return peft_steps.build(dataclasses.replace(case, checkpointing=False))


# measured peaks by (case less its name, ga, steps), as hf_steps._MEASURED: the op-level run's tests
# (test_timeline_hf_peft.py, test_timeline_int8.py, test_cpu_estimate.py) measure some of the same shapes
_MEASURED: dict[tuple[str, int, int], int] = {}


def measure(case: peft_steps.PeftCase, ga: int = 1, steps: int = 3, tracker: StorageTracker | None = None) -> int:
    """Peak live bytes of ``Trainer.train()`` over ``steps`` optimizer steps of ``ga`` micro-batches;
    without a ``tracker`` of the caller's, measured once per shape in a session (:data:`_MEASURED`)."""
    if tracker is not None:
        return _measure(case, ga, steps, tracker)
    key = (repr(dataclasses.replace(case, name="")), ga, steps)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(case, ga, steps, StorageTracker())
    return _MEASURED[key]


def _measure(case: peft_steps.PeftCase, ga: int, steps: int, tracker: StorageTracker) -> int:
    return train_peak(case, build(case), ga, steps, tracker)


def train_peak(case: peft_steps.PeftCase, model, ga: int, steps: int, tracker: StorageTracker, configure=None) -> int:  # noqa: ANN001
    """``Trainer.train()`` over ``model`` (the case's PEFT model) for ``steps`` steps of ``ga`` micro-batches, the
    tracker's peak; ``configure(args)`` edits the ``TrainingArguments`` first."""
    torch.manual_seed(1)
    ids = torch.randint(0, case.vocab, (case.batch * ga * steps, case.seq))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as out:
        args = hf_steps.training_args(out, case, steps, ga)
        if configure is not None:
            configure(args)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        tracker.track_module(model)
        tracker.track(*peft_steps.quant_state_tensors(model))
        with tracker:
            trainer.train()
    return tracker.peak


def main(name: str, ga: int = 1) -> None:
    """Print the allocation sequence of one case of ``peft_steps.CASES`` and its peak."""
    from alloc_log import AllocLog

    case = next(c for c in peft_steps.CASES if c.name == name)
    log = AllocLog()
    peak = measure(case, ga=ga, tracker=log)
    for i, (sign, size, op, live) in enumerate(log.events):
        print(f"{i:6d} {sign} {size:12d} {op:40s} {live:12d}")
    print("peak", peak)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
