"""A run's per-phase peaks, as the bundled trainer's meter measures them.

``memplan/train/runner.py`` names the phase before each part of a step: ``forward`` before a
micro-batch's batch and forward, ``backward`` before ``loss.backward()``, ``optimizer`` before
``optimizer.step()`` and ``zero_grad``, none after; under a pipeline the schedule names
``forward`` or ``backward`` before each action (``memplan/train/pipeline.py``). The meter
(``memplan/train/tracker.py``) resets the peak counter at each change of phase, so a phase's peak
is the most allocated from the moment it starts, over the measured (steady) steps. The op-level
runs mark the same points (:data:`PHASE_MARKS`); ``reserve.replay`` resets the allocator model's
peak at each and keeps each phase's highest (``Replay.phase_peaks``: the allocator's block sizes,
the bytes ``torch.cuda.max_memory_allocated`` counts); :func:`model_states` reads the states off
the run.
"""

from __future__ import annotations

from memplan.costmodel.timeline.events import ALLOC, FREE, Category, Timeline

PHASES = ("forward", "backward", "optimizer")
PHASE_MARKS = {f"phase:{p}": p for p in PHASES} | {"phase:end": None}  # the mark's tag -> the phase it opens
SETUP = "setup"  # before the first step's first mark: the model's build (``Replay.peak_phase``)
STEADY = "step0"  # the warm-up step's end: the meter measures the steps after it
_STATES = {
    "parameters": (Category.PARAMETERS,),
    "gradients": (Category.GRADIENTS,),
    "optimizer_states": (Category.OPTIMIZER_STATES,),
}


def model_states(timeline: Timeline) -> dict[str, int]:
    """The rank's parameters, gradients and optimizer states as the last step's optimizer phase
    starts (every gradient reduced, every state allocated since the first step): the live bytes of
    each category there, as requested."""
    live: dict[Category, int] = {}
    at: dict[Category, int] = {}
    for op, _tensor, size, category, _stream, tag in timeline.events:
        if op == ALLOC:
            live[category] = live.get(category, 0) + size
        elif op == FREE:
            live[category] -= size
        elif tag == "phase:optimizer":
            at = dict(live)
    return {k: sum(at.get(c, 0) for c in cats) for k, cats in _STATES.items()}
