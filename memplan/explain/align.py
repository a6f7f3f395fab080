"""Categories for a measured run without frames, from the predicted run of the same plan.

PyTorch records no frames unless asked (``_record_memory_history(context=...)``), and then only
call sites. The predicted run lists the same step's tensors in the order the allocator sees
them, each with its category, label (layer and tensor) and phase. The two are aligned in order:
each measured allocation takes the next predicted one of the same request size within a window
(in order). When none is there it takes, without using any up, the category of a predicted
allocation of the same size anywhere in the run (by size), else that of the next one in order
(by order), so that the allocations after it can match in order again. The measured allocations
the events named themselves (``category``, frames) keep their own category.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.explain.read import UNKNOWN
from memplan.viz.track import Track

WINDOW = 64  # predicted allocations searched ahead for the same size


@dataclass(frozen=True, slots=True)
class Alignment:
    in_order: int  # measured allocations matched to the next predicted one of the same size
    by_size: int  # to a predicted one of the same size elsewhere in the run
    by_order: int  # to the next predicted one, whatever its size
    unmatched: int  # past the end of the predicted run, no size in common
    stream_names: dict[int, str]  # measured stream -> the predicted stream most of its allocations matched

    def note(self, allocations: int) -> str:
        return (
            f"{self.in_order} of {allocations} allocations matched the predicted run in order and size, "
            f"{self.by_size} by size elsewhere in it, {self.by_order} by position only, {self.unmatched} not at all"
        )


def align(measured: Track, predicted: Track, stream_names: dict[int, str]) -> Alignment:
    """Fill in ``measured``'s unknown categories, labels and phases from ``predicted`` (in place)."""
    pred = [i for i, op in enumerate(predicted.op) if op > 0]
    sizes = [predicted.requested[i] for i in pred]
    anywhere: dict[int, int] = {}
    for p in reversed(pred):
        anywhere[predicted.requested[p]] = p
    j = in_order = by_size = by_order = unmatched = 0
    votes: dict[int, dict[str, int]] = {}
    phase = ""
    measured.phase[:] = [""] * len(measured)
    for i, op in enumerate(measured.op):
        if op < 0:  # a free: as its allocation
            a = measured.tensor[i]
            measured.category[i], measured.label[i] = measured.category[a], measured.label[a]
            measured.phase[i] = phase
            continue
        want = measured.requested[i]
        k = next((k for k in range(j, min(j + WINDOW, len(sizes))) if sizes[k] == want), None)
        if k is not None:
            p, j, in_order = pred[k], k + 1, in_order + 1
            phase = predicted.phase[p]
        elif want in anywhere:
            p, by_size = anywhere[want], by_size + 1
        elif j < len(sizes):
            p, by_order = pred[j], by_order + 1
        else:
            unmatched += 1
            measured.phase[i] = phase
            continue
        measured.phase[i] = phase
        if measured.category[i] == UNKNOWN:
            measured.category[i] = predicted.category[p]
            measured.label[i] = predicted.label[p]
        name = stream_names.get(predicted.stream[p], str(predicted.stream[p]))
        tally = votes.setdefault(measured.stream[i], {})
        tally[name] = tally.get(name, 0) + 1
    names = {s: max(t, key=t.__getitem__) for s, t in votes.items()}
    return Alignment(in_order, by_size, by_order, unmatched, names)
