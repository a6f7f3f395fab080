"""A block of a run emitted again from its events, not rebuilt op by op.

A steady step of the bundled trainer makes the same requests as the steady step before it: the
same ops on the same shapes, from the same live set (the parameters, the gradients' buffers, the
optimizer states, and what the step before kept: the batch, a DDP bucket, ...). Only the tensor
ids differ. Building it again through the autograd engine costs ~14,000 instructions an event (a
cold ``memplan estimate`` of Llama-3-8B under ZeRO-3 builds ~10,000 events a step; docs/accuracy.md,
2026-11-28); copying the previous step's events with their ids renumbered costs a tenth of that.

The renumbering: a tensor the block allocates gets its id shifted by the ids the block used
(zero-byte tensors included, which record no event); a tensor the block frees that an earlier
block allocated (the previous step's batch, say: a *carry-in*) maps to the tensor of the same
role the block itself left live (a *carry-out*): same size, category, stream and tag, paired in
allocation order. Where the carry-ins and carry-outs do not pair one to one, the block is not
repeatable from its events and :func:`repeat` says so (the caller builds it op by op). That the
copy equals the op-by-op step is checked over a grid of plans (tests/unit/test_timeline_repeat.py).

The first steady step is the warm-up step but for what only a first step makes (cuBLAS's
workspaces, the optimizer's states: spans the run records as it builds them) and the free of the
batch the step before left: :func:`derive` copies the warm-up step without those spans, that batch
freed where the step frees it, each id renumbered as the op-by-op step numbers it (the block's
shift less the spans' ids below it). Checked over the same grid, with which plans derive it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

from memplan.costmodel.timeline.events import ALLOC, FREE, Builder

Position = tuple[int, int, int]  # Builder.position(): (events, tensor ids, marks)


def _key(e: tuple) -> tuple:
    return e[2], e[3], e[4], e[5]  # size, category, stream, tag


def carry_map(b: Builder, start: Position, end: Position) -> dict[int, int] | None:
    """Each carry-in of the block ``start``..``end`` (the builder's last) to its carry-out, or
    None where they do not pair one to one by size, category, stream and tag."""
    first = start[1]
    ins: dict[tuple, list[int]] = defaultdict(list)
    for e in b.events[start[0] : end[0]]:
        if e[0] == FREE and e[1] < first:
            ins[_key(e)].append(e[1])
    outs: dict[tuple, list[int]] = defaultdict(list)
    for tensor, e in b.live.items():
        if tensor >= first:
            outs[_key(e)].append(tensor)
    if ins.keys() != outs.keys():
        return None
    pairs: dict[int, int] = {}
    for key, carried in ins.items():
        left = outs[key]
        if len(left) != len(carried):
            return None
        pairs.update(zip(sorted(carried), sorted(left), strict=True))
    return pairs


def repeat(b: Builder, start: Position, end: Position) -> bool:
    """Append the events of the builder's last block (``start``..``end``; marks may follow it)
    again, renumbered (module docstring), with the marks' snapshots as :meth:`Builder.mark` takes
    them. False, and nothing appended, where its carry-ins do not pair with its carry-outs."""
    pairs = carry_map(b, start, end)
    if pairs is None:
        return False
    first, shift = start[1], end[1] - start[1]
    base = b._next
    events, live, mark_ids = b.events, b.live, b.mark_ids
    append, pop = events.append, live.pop
    marks = iter(mark_ids[start[2] : end[2]])
    for op, tensor, size, category, stream, tag in events[start[0] : end[0]]:
        if op == ALLOC:
            tensor += shift
            new = (ALLOC, tensor, size, category, stream, tag)
            append(new)
            live[tensor] = new
        elif op == FREE:  # a carry-in pairs with a carry-out of the same size, category, stream and tag
            tensor = tensor + shift if tensor >= first else pairs[tensor]
            pop(tensor)
            append((FREE, tensor, size, category, stream, tag))
        else:
            b._next = next(marks) + shift
            b.mark(tag)
    b._next = base + shift
    return True


Span = tuple[int, int, int, int]  # (first event, end event, first tensor id, end id) of a first-step-only span


def derive(b: Builder, start: Position, end: Position, skipped: list[Span], carried: dict[int, list[int]]) -> bool:
    """Append the builder's last block (``start``..``end``: the warm-up step) again as the step after
    it: without the ``skipped`` spans (sorted; what only the first step makes: cuBLAS's workspaces, the
    optimizer's states) and with the frees ``carried`` (event index -> tensor ids live now: the
    tensors the block left that the next step frees there, before that event: the last batch).
    Ids are renumbered as the step built op by op numbers them: the block's, less the spans'. False,
    and nothing appended, where a span frees a tensor it did not allocate or holds a mark, a carried
    tensor is not live, or the block frees outside the spans a tensor it did not allocate or one a
    span allocated (then the caller builds the step op by op)."""
    first, stop = start[1], end[1]
    events, live = b.events, b.live
    ends, firsts, cum = [], [], [0]  # the spans' end and first ids; the ids skipped below each span's end
    after, after_id = start[0], first  # the spans in order, apart, inside the block
    for e0, e1, i0, i1 in skipped:
        if not (after <= e0 <= e1 <= end[0] and after_id <= i0 <= i1 <= stop):
            return False
        after, after_id = e1, i1
        for e in events[e0:e1]:
            if e[0] != ALLOC and not (e[0] == FREE and i0 <= e[1] < i1):
                return False
        ends.append(i1)
        firsts.append(i0)
        cum.append(cum[-1] + i1 - i0)
    if any(t not in live for ids in carried.values() for t in ids):
        return False
    for e0, e1, _, _ in skipped:  # a free at a span's start comes where the span would have been
        if e0 in carried and e0 != e1:
            carried = {e1 if c == e0 else c: ids for c, ids in carried.items()}
    # the pieces between the spans, cut again where a carried free goes: (first event, end event, span index)
    cuts = sorted(carried)
    pieces, at = [], start[0]
    for k, (e0, e1, _, _) in enumerate([*skipped, (end[0], end[0], stop, stop)]):
        for c in cuts:
            if at < c < e0:
                pieces.append((at, c, k))
                at = c
        pieces.append((at, e0, k))
        at = e1
    if not set(carried) <= {a for a, _, _ in pieces}:
        return False
    saved = (len(events), len(b.mark_ids), len(b.snapshots), b._next, b._since, dict(live))
    base = b._next
    marks = iter(b.mark_ids[start[2] : end[2]])
    append, pop = events.append, live.pop
    for a, z, k in pieces:
        for tensor in carried.get(a, ()):
            b.free(tensor)
        offset = base - first - cum[k]
        low = first if k == 0 else ends[k - 1]
        for op, tensor, size, category, stream, tag in events[a:z]:
            if op == ALLOC:
                tensor += offset
                new = (ALLOC, tensor, size, category, stream, tag)
                append(new)
                live[tensor] = new
            elif op == FREE:
                if tensor >= low:  # allocated since the last span
                    tensor += offset
                else:  # before it: not before the block, not by a span
                    j = bisect_right(ends, tensor)
                    if tensor < first or j < len(firsts) and tensor >= firsts[j]:
                        _undo(b, saved)
                        return False
                    tensor += base - first - cum[j]
                pop(tensor)
                append((FREE, tensor, size, category, stream, tag))
            else:
                mark = next(marks)
                b._next = mark + base - first - cum[bisect_right(ends, mark)]
                b.mark(tag)
    b._next = base + stop - first - cum[-1]
    return True


def _undo(b: Builder, saved: tuple) -> None:
    """The builder as :func:`derive` found it (``saved``: its lengths, counters and live set then)."""
    events, marks, snapshots, b._next, b._since, live = saved
    del b.events[events:], b.mark_ids[marks:], b.snapshots[snapshots:]
    b.live.clear()
    b.live.update(live)
