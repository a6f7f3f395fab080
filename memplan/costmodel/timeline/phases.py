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
the run, :func:`saved_activations` what its forwards keep for their backwards.
"""

from __future__ import annotations

from memplan.costmodel.timeline.events import Category, Timeline

PHASES = ("forward", "backward", "optimizer")
PHASE_MARKS = {f"phase:{p}": p for p in PHASES} | {"phase:end": None}  # the mark's tag -> the phase it opens
SETUP = "setup"  # before the first step's first mark: the model's build (``Replay.peak_phase``)
WORKSPACES = "cublas_workspace"  # cuBLAS's workspaces: activations by category, kept by no step (trainer.py)
# saved_activations' categories (the hand-written loop's ``use_cache`` copies are kv_cache)
_SAVED = (Category.ACTIVATIONS, Category.LOGITS, Category.KV_CACHE)
_STATES = {
    "parameters": (Category.PARAMETERS,),
    "gradients": (Category.GRADIENTS,),
    "optimizer_states": (Category.OPTIMIZER_STATES,),
}


def model_states(timeline: Timeline) -> dict[str, int]:
    """The rank's parameters, gradients and optimizer states as the last step's optimizer phase
    starts (every gradient reduced, every state allocated since the first step): the live bytes of
    each category there, as requested (the run's last ``phase:optimizer`` snapshot)."""
    at: dict[Category, int] = {}
    marks = [s for s in timeline.snapshots if s.tag == "phase:optimizer"]
    for _, _, size, category, _, _ in marks[-1].live if marks else ():
        at[category] = at.get(category, 0) + size
    return {k: sum(at.get(c, 0) for c in cats) for k, cats in _STATES.items()}


def saved_activations(timeline: Timeline) -> tuple[int, int]:
    """(per_layer, total): what the run's forwards keep for their backwards, read off its
    tensors of the categories ``activations``, ``logits_and_loss`` (the loss's fp32 log-softmax,
    saved for its backward) and ``kv_cache`` (the hand-written loop's ``use_cache`` copies, held
    until the next forward), cuBLAS's workspaces left out, at the ``phase:backward`` mark of the
    steady steps where most of them are live: without a pipeline one micro-batch's forward and
    loss done, before ``loss.backward()``; under a schedule, every micro-batch then in flight.
    ``total``: those bytes, as allocated. ``per_layer``: of the tensors the last forward before
    that mark allocated (one micro-batch, or one chunk of it) and still live there, the bytes
    each decoder layer's tags (``layers.<i>.``) hold, the median layer's (the lower of two): one
    layer's saves under the plan's recomputation (a checkpointed layer's kept input), without
    what a chunk's last layer holds beyond them (its output, kept for the pipeline's send)."""
    best, saved, since = 0, (), 0
    for snap in timeline.snapshots:
        if snap.tag != "phase:backward":
            continue
        kept = [e for e in snap.live if e[3] in _SAVED and not e[5].startswith(WORKSPACES)]
        total = sum(e[2] for e in kept)
        if total > best:
            best, saved, since = total, kept, snap.since
    return _median_layer(saved, since), best


def _median_layer(saved, since: int) -> int:  # noqa: ANN001 (saved_activations' events)
    """The median (low) of the bytes each decoder layer's tags hold among the ``saved`` tensors
    with an id of at least ``since``; 0 where none is a layer's."""
    layers: dict[str, int] = {}
    for _, tensor, size, _, _, tag in saved:
        if tensor >= since and (index := _layer(tag)) is not None:
            layers[index] = layers.get(index, 0) + size
    sizes = sorted(layers.values())
    return sizes[(len(sizes) - 1) // 2] if sizes else 0


def _layer(tag: str) -> str | None:
    """The decoder layer index a tag names (``layers.3.attn.q``, ``c0.layers.3...``,
    ``model.layers.3...``), or None."""
    head, sep, rest = tag.partition("layers.")
    if not sep or (head and not head.endswith(".")):
        return None
    index = rest.partition(".")[0]
    return index if index.isdigit() else None
