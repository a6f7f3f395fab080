"""How long ``torch.distributed.pipelining``'s schedules keep what a stage sends (torch 2.13, schedules.py).

A stage sends each forward's output (every chunk but the last) and each backward's input gradient
(every chunk but the first; ``stage_backward`` takes it off the receive buffer, ``val.grad = None``).
The send's ``P2POp`` and its ``Work`` hold the tensor, and the schedule loop holds those in local
variables, so a sent tensor lives past its own backward (an output) or its backward (a gradient) for as
long as the loop keeps that variable; with gloo the ``Work`` keeps the tensor until it is dropped:

- ``ScheduleGPipe``: every send's works go into ``fwd_sends_to_wait`` / ``bwd_sends_to_wait`` until the
  step ends; ``_PipelineScheduleRuntime`` (interleaved): into ``send_ops``, until the step ends.
- ``Schedule1F1B``: four variables. ``output`` holds the latest forward's output (the last chunk's
  logits too) until the next forward returns; ``fwd_sends`` holds the latest forward's send ops; ``send_work``
  the works of the warm-up forwards but the last (the last one fired stays there until the cool-down)
  and then of the cool-down backwards; ``bwd_sends`` the latest backward's send ops.

Measured against the schedules themselves on gloo ranks, byte for byte at every action
(tests/validate/test_pipeline_replay.py).
"""

from __future__ import annotations

import torch

Action = tuple[str, int, int]


class HeldToStepEnd:
    """GPipe's and the interleaved runtime's lists of send works."""

    def __init__(self) -> None:
        self.held: list[torch.Tensor | None] = []

    def forward(self, output: torch.Tensor, sent: bool) -> None:
        if sent:
            self.held.append(output)

    def backward(self, grad: torch.Tensor | None) -> None:
        self.held.append(grad)

    def end(self) -> None:
        self.held.clear()


class Held1F1B:
    """``Schedule1F1B._step_microbatches``'s ``output``, ``fwd_sends``, ``send_work`` and ``bwd_sends``, advanced
    action by action: ``warmup`` leading forwards, then one backward one forward, then the cool-down,
    which starts at the first backward that no forward follows."""

    def __init__(self, actions: list[Action]) -> None:
        self.warmup = next((n for n, (kind, _, _) in enumerate(actions) if kind == "B"), len(actions))
        self.last_forward = max((n for n, (kind, _, _) in enumerate(actions) if kind == "F"), default=-1)
        self.end()

    def forward(self, output: torch.Tensor, sent: bool) -> None:
        self.output = output
        out = output if sent else None
        self.fwd_sends = out
        if self.forwards < self.warmup - 1:  # fired at once; the last warm-up send waits for the first backward
            self.send_work = out
        self.forwards += 1
        self.position += 1

    def backward(self, grad: torch.Tensor | None) -> None:
        self.bwd_sends = grad
        if self.position > self.last_forward:  # the break's leftover send, then each cool-down send
            self.send_work = grad
        self.position += 1

    def end(self) -> None:
        self.output = self.fwd_sends = self.send_work = self.bwd_sends = None
        self.forwards = self.position = 0


def send_holder(schedule: str, actions: list[Action]) -> HeldToStepEnd | Held1F1B:
    return Held1F1B(actions) if schedule == "1f1b" else HeldToStepEnd()
