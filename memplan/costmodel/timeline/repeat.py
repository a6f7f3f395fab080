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
"""

from __future__ import annotations

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
