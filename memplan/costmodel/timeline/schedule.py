"""A pipeline rank's chunks and its schedule's actions, as the bundled trainer runs them
(``memplan/train/runner.py`` ``_train``, ``memplan/train/pipeline.py`` ``StageReplay``): shared by the
op-level run (``timeline/pipeline.py``) and the phase model's sums (``costmodel/memory.py``), which
count what the run keeps per micro-batch in flight (:func:`in_flight`, and its closed forms).
Pure Python: ``memplan estimate`` imports it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

Action = tuple[str, int, int]  # ("F" | "B", local chunk index, micro-batch)


def chunk_layers(num_layers: int, pp: int, virtual_stages: int, stage: int) -> list[tuple[int, list[int]]]:
    """(global chunk index, layer ids) of each chunk on pipeline rank ``stage``: chunk
    c * pp + stage holds layers [k L / (p v), (k + 1) L / (p v))."""
    per = num_layers // (pp * virtual_stages)
    out = []
    for c in range(virtual_stages):
        k = c * pp + stage
        out.append((k, list(range(k * per, (k + 1) * per))))
    return out


def schedule_actions(schedule: str, pp: int, virtual_stages: int, stage: int, microbatches: int) -> list[Action]:
    """This rank's forward / backward order.

    GPipe: all forwards, then all backwards. 1F1B (Narayanan et al. 2021): min(p - s - 1, m)
    warm-up forwards, then one forward one backward, then the remaining backwards.
    Interleaved (Megatron-LM's schedule): virtual micro-batch k runs chunk (k // p) mod v
    forward and chunk v - 1 - (k // p) mod v backward, micro-batch (k // (p v)) p + k mod p,
    after min(2 (p - s - 1) + (v - 1) p, m v) warm-up forwards.
    """
    p, v, m = pp, virtual_stages, microbatches
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - stage - 1, m)
        actions: list[Action] = [("F", 0, i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            actions += [("F", 0, f), ("B", 0, b)]
            f, b = f + 1, b + 1
        actions += [("B", 0, i) for i in range(b, m)]
        return actions

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    total = m * v
    warm = min(2 * (p - stage - 1) + (v - 1) * p, total)
    actions = [("F", (k // p) % v, micro(k)) for k in range(warm)]
    for k in range(warm, total):
        j = k - warm
        actions += [("F", (k // p) % v, micro(k)), ("B", v - 1 - (j // p) % v, micro(j))]
    for j in range(total - warm, total):
        actions.append(("B", v - 1 - (j // p) % v, micro(j)))
    return actions


class InFlight(NamedTuple):
    """What a rank's schedule keeps in flight (:func:`in_flight`)."""

    most: int  # the most (chunk, micro-batch) forwards whose backward has not run, at a backward
    per_chunk: tuple[int, ...]  # each local chunk's most, at one of its own backwards
    backward_first: bool  # a backward runs before the rank's last forward


def in_flight(actions: list[Action], virtual_stages: int) -> InFlight:
    """The micro-batches in flight over a rank's ``actions`` (:func:`schedule_actions`), the order the
    run follows: a forward's output (the last chunk's logits too) and its saved activations stay from
    its forward until its backward is done (``StageReplay``; ``timeline/pipeline.py``
    ``Pipeline._forward`` / ``_backward``). A walk over every action: the phase model's sums take the
    closed forms below, held equal to it (tests/unit/test_schedule_counts.py)."""
    held, most = [0] * virtual_stages, [0] * virtual_stages
    total = peak = 0
    last_forward, first_backward = -1, None
    for n, (kind, c, _) in enumerate(actions):
        if kind == "F":
            held[c] += 1
            total += 1
            last_forward = n
            continue
        most[c], peak = max(most[c], held[c]), max(peak, total)
        held[c] -= 1
        total -= 1
        first_backward = n if first_backward is None else first_backward
    return InFlight(peak, tuple(most), first_backward is not None and first_backward < last_forward)


def chunks_in_flight(schedule: str, pp: int, virtual_stages: int, stage: int, microbatches: int) -> int:
    """:func:`in_flight`'s ``most`` in closed form. 1F1B (Narayanan et al. 2021): min(p - s, m)
    micro-batches; interleaved (Megatron-LM's warm-up): min(2 (p - s - 1) + (v - 1) p + 1, m v) chunks,
    for rank 0 a share 1 + (p - 1) / (p v) of its layers (Korthikanti et al. 2022, Sec. 4.2.3); GPipe: m."""
    p, v, m = pp, virtual_stages, microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


def backward_first(schedule: str, microbatches: int, virtual_stages: int, chunks: int) -> bool:
    """:func:`in_flight`'s ``backward_first`` in closed form, from the rank's :func:`chunks_in_flight`:
    a backward runs before the last forward when the rank has more chunk-micro-batches than it holds
    in flight (never under GPipe)."""
    return schedule != "gpipe" and microbatches * virtual_stages > chunks


def last_chunk_outputs(schedule: str, microbatches: int) -> int:
    """:func:`in_flight`'s ``per_chunk`` of the global last chunk (the last rank's last) in closed
    form: the logits ``fwd_cache`` holds at once, at one of its losses' backwards (its own among
    them): every micro-batch's under GPipe (all forwards first), one under 1F1B and the interleaved
    schedule, whose last chunk runs each micro-batch's backward right after its forward."""
    return microbatches if schedule == "gpipe" else 1


@lru_cache(maxsize=1024)
def sends_held(schedule: str, pp: int, virtual_stages: int, stage: int, microbatches: int) -> tuple[int, int]:
    """The tensors GPipe's and the interleaved schedule's sends hold to the step's end on pipeline
    rank ``stage`` (``timeline/pipeline.py`` ``_HeldToStepEnd``: every forward's output of a chunk but
    the global last, every input gradient of a chunk but the global first), counted over
    :func:`schedule_actions`: at the rank's last forward (its output included), and at its last
    backward with the most chunks in flight (:func:`in_flight`'s ``most``), where its layers'
    activations peak and the sends are the most they are beside them. A walk over the actions, each
    rank's once (``lru_cache``); not 1F1B's, whose sends hold the latest only."""
    last = pp * virtual_stages - 1
    actions = schedule_actions(schedule, pp, virtual_stages, stage, microbatches)
    most = in_flight(actions, virtual_stages).most
    sent = total = at_forward = at_backward = 0
    for kind, c, _ in actions:
        k = c * pp + stage
        if kind == "F":
            total += 1
            sent += k != last
            at_forward = sent
            continue
        if total == most:
            at_backward = sent
        total -= 1
        sent += k != 0
    return at_forward, at_backward
