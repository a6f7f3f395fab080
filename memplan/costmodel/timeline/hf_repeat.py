"""transformers' Trainer's last steady step emitted from the one before, not rebuilt op by op.

``repeat.py`` does it for the bundled trainer, whose carry-ins (what a step frees of the steps before)
pair with its own carry-outs. The Trainer keeps its data two steps: ``get_batch_samples`` fetches the next
update's batches and one more, so step ``k`` frees the batches step ``k - 2`` fetched
(``_HfRun.step``), and every batch's tag carries its index (``batch5.input_ids``). Here each carry-in of
step 1 maps to the tensor of the same *role* live when step 2 begins: the live tensors of one size,
category, stream and tag (the batch's index left out) at step 1's start and at step 2's, oldest first,
pair in order (step 1 frees ``batch0`` of ``batch0, batch1``; step 2 frees ``batch1`` of ``batch1,
batch2``); the copy's allocations take the tensor ids one step on and their batch's index ``ga`` on.

Where it is exact: the plans whose step 2 makes step 1's requests, renumbered so (checked event for event
against the op-by-op run over a grid of plans, tests/unit/test_timeline_hf_repeat.py): one rank and
accelerate's FSDP2 (ZeRO-2/3, either build), full training with AdamW, in every precision and
recomputation, over the families. Not DDP (its second and third steps differ: 10,384 and 10,330 events on
the 1B Llama at dp 8), adapters, quantized bases, TRL's activation offload or the other optimizers
(:func:`repeats`): those runs are built op by op. The search's whole runs take it
(``fast_run._whole_hf_peak``); ``memplan estimate`` builds every step.
"""

from __future__ import annotations

import re
from collections import defaultdict

from memplan.costmodel.timeline.events import ALLOC, FREE, Builder

_BATCH = re.compile(r"(?<=batch)(\d+)")


def repeats(dp: int, zero: int, lora, quant, offload: bool, optimizer: str, reentrant: bool) -> bool:
    """Whether the run's last step is emitted from the one before (module docstring; checked over the
    non-reentrant checkpoint only)."""
    plain = lora is None and quant is None and not offload and not reentrant
    return (dp == 1 or zero >= 2) and plain and optimizer == "adamw"


def _role(e: tuple) -> tuple:
    """Size, category, stream and tag without the batch's index (only the batches' tags carry one)."""
    tag = e[5]
    return e[2], e[3], e[4], _BATCH.sub("", tag) if tag.startswith("batch") else tag


def _roles(b: Builder, block: list[tuple], made: set[int]) -> dict[int, int] | None:
    """Each tensor the ``block`` (the builder's last; ``made``: the tensors it allocates) frees of those
    before it -> the tensor of its role live at the block's end (module docstring); None where the roles do
    not pair."""
    carried = [e for e in block if e[0] == FREE and e[1] not in made]
    roles = {_role(e) for e in carried}
    before: dict[tuple, list[int]] = defaultdict(list)  # the live set at the block's start, by role
    after: dict[tuple, list[int]] = defaultdict(list)  # and at its end: of the carried roles alone
    for e in carried:
        before[_role(e)].append(e[1])
    for t, e in b.live.items():
        if (role := _role(e)) in roles:
            after[role].append(t)
            if t not in made:
                before[role].append(t)
    pairs: dict[int, int] = {}
    for e in carried:
        old, new = sorted(before[_role(e)]), sorted(after[_role(e)])
        if len(old) != len(new):
            return None
        pairs[e[1]] = new[old.index(e[1])]
    return pairs


def _next_batch(tag: str, ga: int) -> str:
    """``tag`` with its batch's index ``ga`` on (``batch3.labels`` -> ``batch5.labels`` at ``ga`` 2)."""
    return _BATCH.sub(lambda m: str(int(m.group(1)) + ga), tag, count=1) if tag.startswith("batch") else tag


def repeat_step(b: Builder, start: tuple[int, int, int], end: tuple[int, int, int], ga: int) -> bool:
    """Append the builder's last step (``start``..``end``, no mark after it yet) again: its allocations one
    step's tensor ids on, their batch's index ``ga`` on, its carry-ins' frees on the tensors of their roles
    (``_roles``), its marks as :meth:`Builder.mark` makes them. False, nothing appended, where the roles do
    not pair."""
    block = b.events[start[0] : end[0]]
    made = {e[1] for e in block if e[0] == ALLOC}
    pairs = _roles(b, block, made)
    if pairs is None:
        return False
    shift, base = end[1] - start[1], b._next
    events, live = b.events, b.live
    append, pop = events.append, live.pop
    marks = iter(b.mark_ids[start[2] : end[2]])
    for e in block:
        op, tensor = e[0], e[1]
        if op == ALLOC:
            tensor += shift
            new = (ALLOC, tensor, e[2], e[3], e[4], _next_batch(e[5], ga))
            append(new)
            live[tensor] = new
        elif op == FREE:
            tensor = tensor + shift if tensor in made else pairs[tensor]
            _, _, size, category, stream, tag = pop(tensor)
            append((FREE, tensor, size, category, stream, tag))
        else:
            b._next = next(marks) + shift
            b.mark(e[5])
    b._next = base + shift
    return True
