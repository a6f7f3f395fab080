"""One rank's run as a timeline: the model built, a first step, then steady steps.

The phase model (``memory._stage_phases``) gives, for each moment of a steady step, the bytes
live in each category. This module turns those moments into tensors an allocator can serve:
each category is cut into tensors of the sizes the step really allocates (a layer's weights,
one hidden-width activation, one fp32 logits tensor, ...), allocated in execution order
(forward layer by layer, then the loss, the backward, the optimizer step) and freed when the
next moment holds fewer of them. Between two moments the frees come first, so every moment
is a local maximum and the timeline's peak is the phase model's (tested on a plan grid).

A run is what a trace records: parameters at build; a first step that creates gradients and,
at its optimizer step, the optimizer states; then steady steps. What the first step's
transients cut stays cached, which is why reserved memory needs the whole run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from memplan.costmodel.timeline.events import Builder, Category, Moment, Stream, Timeline

STEADY_STEPS = 2  # the traces' measured steps, after one warm-up step


@dataclass(frozen=True, slots=True)
class Granularity:
    """Sizes of the tensors each category is made of, on one rank.

    ``layer_params``: one layer's parameter tensors in bytes, in build order (its
    gradients and optimizer states have the same shapes, scaled by their bytes per element);
    ``hidden``: one hidden-width activation (b s h d / rep); ``logits``: one fp32 b s V / t
    tensor; ``layers``: layer-activation units the forward allocates in turn.
    """

    layer_params: tuple[int, ...]
    hidden: int
    logits: int
    layers: int
    fsdp: bool  # collectives on their own streams (FSDP2 all-gather / reduce-scatter)
    gather: int = 0  # one layer group's all-gather output (FSDP2), bytes
    gathered: tuple[int, ...] = ()  # one layer's unsharded weights in the all-gather dtype (ZeRO-3)


def pieces(total: int, pattern: Sequence[int]) -> list[int]:
    """``total`` bytes cut into tensors by cycling ``pattern`` (the remainder is the last)."""
    if total <= 0:
        return []
    sizes = [p for p in pattern if p > 0] or [total]
    cycles, left = divmod(total, sum(sizes))
    out = sizes * cycles  # whole passes over the pattern, then its start while bytes are left
    for size in sizes:
        if left <= 0:
            break
        out.append(min(size, left))
        left -= size
    return out


MIN_TENSOR = 512  # kMinBlockSize: the allocator rounds every request up to it


def _scaled(pattern: Sequence[int], total: int, reference: int) -> list[int]:
    """``pattern`` scaled by total / reference (a layer's tensors in another dtype or count),
    none below the allocator's 512 B block (a sharded norm weight is smaller, but no category
    is cut into pieces the allocator would not tell apart; ``reference`` > 0: :meth:`_Run.pattern`)."""
    return [max(MIN_TENSOR, p * total // reference) for p in pattern]


class _Run:
    """Live tensors per category, allocated and freed to reach each moment's bytes."""

    def __init__(self, g: Granularity, params_total: int):
        self.g = g
        self.b = Builder()
        self.by_cat: dict[Category, list[tuple[int, int]]] = {c: [] for c in Category}
        self.totals: dict[Category, int] = dict.fromkeys(Category, 0)
        layer_param_bytes = sum(g.layer_params)
        self.patterns: dict[Category, list[int]] = {
            Category.ACTIVATIONS: [g.hidden],
            Category.LOGITS: [g.logits],
            Category.RETAINED: [g.logits],
        }
        self._layer_param_bytes = layer_param_bytes
        self._params_total = params_total

    def pattern(self, cat: Category, total: int) -> list[int]:
        if cat in self.patterns:
            return self.patterns[cat]
        if cat == Category.GATHERED and self.g.gathered:
            return list(self.g.gathered)  # whole layers' weights, all-gathered
        # weight-shaped: parameters, gradients, states, their temporaries, gathered copies
        per_layer = self._layer_param_bytes
        if self._params_total and per_layer:
            # this category's bytes for one layer, in the proportion of the parameters
            scale_total = total * per_layer // max(self._params_total, 1)
            if scale_total > 0:
                return _scaled(self.g.layer_params, scale_total, per_layer)
        return [total]

    def stream(self, cat: Category) -> Stream:
        """FSDP2's reduce-scatter outputs are the sharded gradients, on its stream; the rest
        (copy-outs, reduce-scatter inputs) is on the compute stream."""
        if self.g.fsdp and cat == Category.GRADIENTS:
            return Stream.REDUCE_SCATTER
        return Stream.COMPUTE

    def live(self, cat: Category) -> int:
        return self.totals[cat]

    def free_to(self, cat: Category, target: int) -> None:
        """Free the newest tensors of ``cat`` until at most ``target`` bytes are live."""
        tensors, live, free = self.by_cat[cat], self.totals[cat], self.b.free
        while tensors and live > target:
            tensor, size = tensors.pop()
            live -= size
            free(tensor)
        self.totals[cat] = live

    def alloc_to(self, cat: Category, target: int) -> None:
        """Allocate tensors of ``cat`` until ``target`` bytes are live."""
        need = target - self.live(cat)
        if need <= 0:
            return
        stream, tag, alloc, live = self.stream(cat), cat.value, self.b.alloc, self.by_cat[cat]
        for size in pieces(need, self.pattern(cat, target)):
            live.append((alloc(size, cat, tag, stream), size))
        self.totals[cat] += need

    def reach(self, target: dict[str, int], moment: str) -> None:
        """Frees first, then allocations, then the mark: ``target`` live exactly."""
        for cat in Category:
            self.free_to(cat, target.get(cat.value, 0))
        for cat in Category:
            self.alloc_to(cat, target.get(cat.value, 0))
        self.b.mark(moment)

    def layered(self, target: dict[str, int], moment: str, layered: Sequence[Category], gather: bool = False) -> None:
        """Reach ``target`` layer by layer: per layer unit, the ``layered`` categories move a
        layer's share of the way (frees before allocations), the FSDP2 all-gather buffer of
        the next group is allocated on its stream and the one before freed (two live at most,
        as FSDP2's copy-out frees the previous group's); then the rest, then the mark.

        In the backward the phase model already counts the prefetched group (``gathered``),
        so only the forward (``gather``) adds all-gather buffers of its own."""
        units = max(self.g.layers, 1)
        start = {cat: self.live(cat) for cat in Category}
        others = [cat for cat in Category if cat not in layered]
        for cat in others:
            self.free_to(cat, target.get(cat.value, 0))
        gathers: list[int] = []
        for unit in range(1, units + 1):
            share = {cat: start[cat] + (target.get(cat.value, 0) - start[cat]) * unit // units for cat in layered}
            for cat in layered:
                self.free_to(cat, share[cat])
            if gather and self.g.gather:
                gathers.append(self.b.alloc(self.g.gather, Category.COMM, "all_gather", Stream.ALL_GATHER))
                if len(gathers) > 2:
                    self.b.free(gathers.pop(0))
            for cat in layered:
                self.alloc_to(cat, share[cat])
        for tensor in gathers:
            self.b.free(tensor)
        for cat in Category:
            self.free_to(cat, target.get(cat.value, 0))
        for cat in Category:
            self.alloc_to(cat, target.get(cat.value, 0))
        self.b.mark(moment)


FORWARD_LAYERED = (Category.ACTIVATIONS, Category.AUTOCAST, Category.GATHERED)
BACKWARD_LAYERED = (Category.ACTIVATIONS, Category.AUTOCAST, Category.GATHERED, Category.GRADIENTS)


def _first_step(moment: dict[str, int], states: bool, grads: int) -> dict[str, int]:
    """A moment of the first step: no optimizer states until its optimizer step, no
    gradients or outputs kept from a step before it (``grads``: what exists regardless)."""
    out = dict(moment)
    if not states:
        out[Category.OPTIMIZER_STATES.value] = 0
    out[Category.RETAINED.value] = 0
    out[Category.GRADIENTS.value] = min(out.get(Category.GRADIENTS.value, 0), grads)
    return out


MAX_LIVE = 65536
"""The most tensors of one activation-shaped category (``hidden``- or ``logits``-sized) a moment
holds in the phase model's run. Real plans hold far fewer (Llama-3-70B, ZeRO-3 over 64, full
recomputation: 80; the most found, Llama-3-8B under GPipe over 8 stages with 512 micro-batches in
flight: 50,242 tensors of 16 MB, 785 GiB); an absurd model found by tests/cli/test_bad_input.py's
fuzzing (3,972 heads of width 3,972 over a hidden size of 768, tp 4: 4.6 TB of activations in 3 MB
tensors) held 1.5 million, and replaying them through the allocator model took many minutes."""


def _coarsened(moments: dict[str, dict[str, int]], g: Granularity) -> Granularity:
    """``g`` with its activation-shaped tensors grown by a whole factor where a moment would hold
    more than :data:`MAX_LIVE` of them. Such a plan is hundreds of times beyond any GPU: its
    verdict does not hang on how its terabytes are cut, and the run stays a few hundred thousand
    events."""

    def most(categories: tuple[Category, ...]) -> int:
        return max(sum(m.get(c.value, 0) for c in categories) for m in moments.values())

    acts = most((Category.ACTIVATIONS,))
    logits = most((Category.LOGITS, Category.RETAINED))
    grow_hidden = -(-acts // (MAX_LIVE * g.hidden)) if g.hidden > 0 else 1
    grow_logits = -(-logits // (MAX_LIVE * g.logits)) if g.logits > 0 else 1
    if grow_hidden <= 1 and grow_logits <= 1:
        return g
    return replace(g, hidden=g.hidden * max(grow_hidden, 1), logits=g.logits * max(grow_logits, 1))


def build_run(moments: dict[str, dict[str, int]], g: Granularity, build_grads: int) -> Timeline:
    """Build (parameters, and ``build_grads`` of gradient buffers allocated up front), a first
    step, then :data:`STEADY_STEPS` steps, each reaching the moments in order."""
    fwd = moments[Moment.FORWARD]
    params_total = fwd.get(Category.PARAMETERS.value, 0)
    run = _Run(_coarsened(moments, g), params_total)
    run.alloc_to(Category.PARAMETERS, params_total)
    run.alloc_to(Category.GRADIENTS, build_grads)
    run.b.mark("build")
    order = (Moment.FORWARD, Moment.BACKWARD_START, Moment.BACKWARD, Moment.OPTIMIZER)
    for step in range(STEADY_STEPS + 1):
        for moment in order:
            target = moments[moment]
            if step == 0:
                target = _first_step(target, moment == Moment.OPTIMIZER, build_grads)
                if moment != Moment.FORWARD:
                    # backward makes gradients; they stay until the step's end
                    target[Category.GRADIENTS.value] = moments[moment].get(Category.GRADIENTS.value, 0)
            if moment == Moment.FORWARD:
                run.layered(target, moment, FORWARD_LAYERED, gather=g.fsdp)
            elif moment == Moment.BACKWARD:
                run.layered(target, moment, BACKWARD_LAYERED)
            else:
                run.reach(target, moment)
        run.b.mark(f"step{step}")
    return run.b.build()


SERVING_BATCHES = 2  # prefills in a serving run: the second finds the first's cached blocks


def build_serving_run(weights: Sequence[int], kv_tensors: Sequence[int], work: Sequence[int], layers: int) -> Timeline:
    """Serving: the weights (one tensor each), the KV cache (a key and a value tensor per layer,
    for the whole context), then :data:`SERVING_BATCHES` prefills, each layer's working set ``work``
    allocated and freed in turn (the last stage's last-token logits in it). Peaks at weights +
    cache + one layer's working set, as ``memory.estimate_inference``."""
    b = Builder()
    for size in weights:
        b.alloc(size, Category.PARAMETERS, "weight")
    for size in kv_tensors:
        b.alloc(size, Category.KV_CACHE, "kv_cache")
    b.mark("build")
    for batch in range(SERVING_BATCHES):
        for _ in range(max(layers, 1)):
            tensors = [b.alloc(size, Category.ACTIVATIONS, "prefill") for size in work]
            for tensor in reversed(tensors):
                b.free(tensor)
        b.mark(f"step{batch}")
    return b.build()
