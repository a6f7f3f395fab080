"""One pipeline rank of the bundled trainer (``memplan/train/pipeline.py``'s ``StageReplay``) as ops.

``runner._train`` builds the rank's chunks (``chunk_layers``: chunk ``c p + stage`` of ``p v``; the
first holds the embedding, the last the final norm and the LM head; a tied head is its own matrix
there, ``tie_weights`` finding one side only) and runs its schedule's actions (``schedule.py``'s
``schedule_actions``: GPipe, 1F1B, interleaved) over all ``m`` micro-batches of the step. What it
keeps, in the order the allocator sees it (``StageReplay``, equal byte for byte to
``torch.distributed.pipelining`` on gloo ranks: tests/validate/test_pipeline_replay.py):

- at the first step, before any action, the receive buffers: per chunk, ``m`` activation buffers
  (``b x s x h`` in the compute dtype, fp32 under autocast; every chunk but the first), then ``m``
  gradient buffers (every chunk but the last), zeroed, kept for the run;
- a forward: the batch (ids on the first chunk, then labels on the last, int64), the chunk's
  ``Transformer.forward`` (the embedding or the received buffer, RoPE tables, its layers, on the
  last chunk the norm and head), the send holder's update, then on the last chunk the schedule's
  loss ``cross_entropy(logits.float(), labels)``, unscaled; the output stays in ``fwd_cache`` (the
  logits too) and the loss in ``_internal_losses`` until the step's actions end;
- a backward: ``loss.backward()`` on the last chunk (the logits detached after), else
  ``backward(out, recv_grad[i])``; the received activation's gradient is taken off its buffer
  (``val.grad = None``) and handed to the send holder (``sends.py``'s lifetimes: :class:`_HeldToStepEnd`
  for GPipe and interleaved, :class:`_Held1F1B` for 1F1B, whose ``output`` keeps the latest forward's
  output, the logits too, until the next forward);
- after the actions: the losses go (``list.clear``: last first), the gradients are divided in place
  (``scale_grads``: nothing allocated), the sends go. Gradients add up over the micro-batches in
  place (``AccumulateGrad``) as without pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memplan.costmodel.timeline import ops, recompute
from memplan.costmodel.timeline import tensor_parallel as tpar
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.fsdp import Fsdp
from memplan.costmodel.timeline.schedule import Action, chunk_layers, schedule_actions
from memplan.costmodel.timeline.trainer_model import Dims, Model, param_shapes
from memplan.specs.plan import Plan


class _HeldToStepEnd:
    """GPipe's ``fwd_sends_to_wait``/``bwd_sends_to_wait`` and the interleaved runtime's ``send_ops``."""

    def __init__(self, tape: Tape) -> None:
        self.t, self.held = tape, []

    def forward(self, output: Tensor, sent: bool) -> None:
        if sent:
            self.held.append(self.t.hold(output))

    def backward(self, grad: Tensor | None) -> None:
        if grad is not None:
            self.held.append(self.t.hold(grad))

    def end(self) -> None:
        for t in reversed(self.held):  # list.clear drops its items last first
            self.t.drop(t)
        self.held = []


class _Held1F1B:
    """``Schedule1F1B``'s ``output``, ``fwd_sends``, ``send_work``, ``bwd_sends`` (``sends.Held1F1B``)."""

    SLOTS = ("output", "fwd_sends", "send_work", "bwd_sends")

    def __init__(self, tape: Tape, actions: list[Action]) -> None:
        self.t = tape
        self.warmup = next((n for n, (kind, _, _) in enumerate(actions) if kind == "B"), len(actions))
        self.last_forward = max((n for n, (kind, _, _) in enumerate(actions) if kind == "F"), default=-1)
        self.slots: dict[str, Tensor | None] = dict.fromkeys(self.SLOTS)
        self.forwards = self.position = 0

    def _set(self, slot: str, t: Tensor | None) -> None:
        old, self.slots[slot] = self.slots[slot], (None if t is None else self.t.hold(t))
        self.t.drop(old)  # the attribute rebound: the new reference first, then the old one goes

    def forward(self, output: Tensor, sent: bool) -> None:
        self._set("output", output)
        out = output if sent else None
        self._set("fwd_sends", out)
        if self.forwards < self.warmup - 1:
            self._set("send_work", out)
        self.forwards += 1
        self.position += 1

    def backward(self, grad: Tensor | None) -> None:
        self._set("bwd_sends", grad)
        if self.position > self.last_forward:
            self._set("send_work", grad)
        self.position += 1

    def end(self) -> None:
        for slot in self.SLOTS:  # ``a = b = c = d = None`` assigns left to right
            self._set(slot, None)
        self.forwards = self.position = 0


@dataclass
class _Chunk:
    index: int  # global chunk index
    first: bool
    last: bool
    model: Model
    names: dict[str, str]  # the chunk module's parameter name -> the run's (``c{index}.`` prefixed)
    fsdp: Fsdp | None = None  # FSDP2 over this chunk, its own root (``sharded``)


class _ShardedChunks:
    """FSDP2 over each chunk of the rank (``_build_chunks``: ``apply_fsdp`` per chunk, each its
    own root), as the run and the schedule see them: the optimizer steps the chunks' shards in
    chunk order (``runner._train``'s ``params``), ``zero_grad`` and ``StageReplay``'s flags and
    ``_reduce_grads`` go over the chunks in order."""

    def __init__(self, roots: list[Fsdp]) -> None:
        self.roots = roots

    def shard_numels(self) -> list[tuple[str, int]]:
        return [(f"c{c}.{name}", n) for c, root in enumerate(self.roots) for name, n in root.shard_numels()]

    def no_sync(self) -> None:
        for root in self.roots:
            root.sync = False

    def reduce_all(self) -> None:
        for root in self.roots:
            root.reduce_all()

    def zero_grad(self) -> None:
        for root in self.roots:
            root.zero_grad()


class Pipeline:
    """One pipeline rank's chunks and schedule over the run's tape; parameters and their
    gradients live in the run's ``weights``/``grads`` under ``c{chunk}.``-prefixed names."""

    def __init__(
        self, tape: Tape, d: Dims, grads: dict, pp: int, virtual_stages: int, stage: int, schedule: str
    ) -> None:
        self.t, self.d, self.grads, self.schedule = tape, d, grads, schedule
        self.pp, self.v, self.stage = pp, virtual_stages, stage
        self.chunks = [
            _Chunk(k, k == 0, k == pp * virtual_stages - 1, Model(tape, replace(d, layers=len(ids)), {}), {})
            for k, ids in chunk_layers(d.layers, pp, virtual_stages, stage)
        ]
        self.act_itemsize = 4 if d.autocast else d.cd  # runner: fp32 under autocast, else the compute dtype
        self.recv_act: dict[int, list[Tensor]] = {}
        self.recv_grad: dict[int, list[Tensor]] = {}
        self.recv_grads: dict[str, Tensor] = {}  # the received activations' ``.grad`` (AccumulateGrad)
        self.fsdp: _ShardedChunks | None = None  # FSDP2 over each chunk (``sharded``)

    def sharded(self, make: Callable[[dict, Model, dict, bool, bool], Fsdp]) -> tuple[dict, Model]:
        """FSDP2 on each chunk (``apply_fsdp``), chunk after chunk: ``make(shapes, model, grads,
        first, last)`` builds one chunk's shards, its gradients in ``grads`` under its module's
        names; the first chunk's shapes and model for the run."""
        for root, ch in enumerate(self.chunks):  # each chunk its own root, with streams of its own
            ch.fsdp = make(_chunk_shapes(ch.model.d, ch.first, ch.last), ch.model, {}, ch.first, ch.last)
            ch.fsdp.on_root(root)
        self.fsdp = _ShardedChunks([ch.fsdp for ch in self.chunks])
        first = self.chunks[0]
        return _chunk_shapes(first.model.d, first.first, first.last), first.model

    def build(self) -> dict[str, tuple[int, int]]:
        """Each chunk's ``to_empty`` in module order, chunk after chunk (``_build_chunks``)."""
        shapes: dict[str, tuple[int, int]] = {}
        for ch in self.chunks:
            for local, (rows, cols) in _chunk_shapes(ch.model.d, ch.first, ch.last).items():
                name = f"c{ch.index}.{local}"
                p = self.t.managed(rows * cols, self.d.pd, name, Category.PARAMETERS)
                p.fn = ops.leaf(self.grads, name)
                ch.model.weights[local] = p
                ch.names[local], shapes[name] = name, (rows, cols)
        return shapes

    def _buffers(self, m: int) -> None:
        """``StageReplay._buffers``: zeroed once, at the first step."""
        if self.recv_act or self.recv_grad:
            return
        t, numel = self.t, self.d.tokens // (self.d.tp if self.d.sp else 1) * self.d.h  # runner: s_local
        for c, ch in enumerate(self.chunks):
            if not ch.first:
                self.recv_act[c] = []
                for i in range(m):
                    buf = t.managed(numel, self.act_itemsize, f"c{ch.index}.recv_act{i}", Category.COMM)
                    buf.fn = ops.leaf(self.recv_grads, f"{c}.{i}")
                    self.recv_act[c].append(buf)
            if not ch.last:
                self.recv_grad[c] = [
                    t.managed(numel, self.act_itemsize, f"c{ch.index}.recv_grad{i}", Category.COMM) for i in range(m)
                ]

    def step(self, m: int, first: bool, workspace) -> None:  # noqa: ANN001
        """``StageReplay.step``: the actions in order; then the losses and the sends go.
        ``workspace(thread)``: cuBLAS's lazily allocated workspaces of the first step."""
        t = self.t
        self._buffers(m)
        actions = schedule_actions(self.schedule, self.pp, self.v, self.stage, m)
        sent = _Held1F1B(t, actions) if self.schedule == "1f1b" else _HeldToStepEnd(t)
        cache: dict[tuple[int, int], tuple[Tensor, Tensor | None]] = {}
        losses: list[Tensor] = []
        backward_seen = False
        if self.fsdp is not None:  # set_requires_gradient_sync(False), set_reshard_after_backward(False)
            self.fsdp.no_sync()
        if first:
            t.on_first_mm = workspace("forward")
        for kind, c, i in actions:
            t.b.mark("phase:forward" if kind == "F" else "phase:backward")  # the runner's on_phase
            if kind == "F":
                self._forward(c, i, cache, losses, sent)
            else:
                if first and not backward_seen:
                    t.on_first_mm = workspace("backward")
                backward_seen = True
                self._backward(c, i, cache, sent)
        for loss in reversed(losses):
            t.drop(loss)
        if self.fsdp is not None:
            self.fsdp.reduce_all()
        sent.end()

    def _forward(self, c: int, i: int, cache: dict, losses: list, sent) -> None:  # noqa: ANN001
        t, ch = self.t, self.chunks[c]
        with t.scoped("batch"):
            ids = t.new(self.d.tokens, 8, "ids") if ch.first else None
            labels = t.new(self.d.tokens, 8, "labels") if ch.last else None
        x = ids if ch.first else t.alias(self.recv_act[c][i])
        with t.scoped(f"c{ch.index}"):
            out = chunk_forward(t, ch.model, x, ch.first, ch.last, ch.fsdp)
        t.done(x)
        sent.forward(out, not ch.last)
        loss = None
        if ch.last:
            loss = _loss(t, out, labels, self.d)
            losses.append(t.hold(loss))
        cache[(c, i)] = (out, loss)
        t.done(labels, loss)

    def _backward(self, c: int, i: int, cache: dict, sent) -> None:  # noqa: ANN001
        t, ch = self.t, self.chunks[c]
        out, loss = cache.pop((c, i))
        if loss is not None:
            with t.scoped("loss"):
                seed = t.new(1, 4, "grad_seed")
            t.backward(loss, seed)
        else:
            t.backward(out, t.hold(self.recv_grad[c][i]))
        if ch.fsdp is not None:
            ch.fsdp.finish_backward()  # the chunk's root's final callback
        t.done(out, loss)
        grad = self.recv_grads.pop(f"{c}.{i}", None) if not ch.first else None
        sent.backward(grad)
        t.done(grad)


def _chunk_shapes(d: Dims, first: bool, last: bool) -> dict[str, tuple[int, int]]:
    """The chunk module's parameters in module order: the embedding on the first chunk, the
    final norm and the head on the last (``Transformer(first=, last=)``)."""
    shapes = param_shapes(d, tied=False)
    if not first:
        del shapes["tok_embeddings.weight"]
    if not last:
        del shapes["norm.weight"], shapes["output.weight"]
    return shapes


def chunk_forward(t: Tape, m: Model, x: Tensor, first: bool, last: bool, fsdp: Fsdp | None = None) -> Tensor:
    """``Transformer.forward`` of one chunk: the embedding or the received hidden states, the
    RoPE tables in their dtype, the layers, on the last chunk the norm and the head; under
    FSDP2 each group's pre- and post-forward around its module (``trainer._Run.forward``)."""
    d, off = m.d, 1 if first else 0  # FSDP2 group of layer j: j + off

    def pre(g: int, h: Tensor) -> Tensor:
        return fsdp.pre_forward(g, h) if fsdp is not None else t.alias(h)

    m.cache = {} if d.autocast else None
    if first:
        if fsdp is not None:
            fsdp.pre_forward(0)
        h = m.embed(x)
        if fsdp is not None:
            fsdp.post_forward(0, h)
    else:
        h = t.alias(x)
    cos, sin = m.rope_tables(h.itemsize)
    for j in range(d.layers):
        xi = pre(j + off, h)
        out = recompute.layer(t, m, xi, cos, sin, j, d.recompute_layers)
        t.done(xi)
        if fsdp is not None:
            fsdp.post_forward(j + off, out)
        t.done(h)
        h = out
    if last:
        xi = pre(d.layers + off, h)
        logits = m.head(xi)
        t.done(xi, h)
        if fsdp is not None:
            fsdp.post_forward(d.layers + off, logits)
        h = logits
    if fsdp is not None:
        fsdp.end_forward()
    if m.cache is not None:
        t.done(*m.cache.values())
        m.cache = None
    t.done(cos, sin)
    return h


def _loss(t: Tape, logits: Tensor, labels: Tensor, d: Dims) -> Tensor:
    """``loss_fn``: ``cross_entropy(logits.flatten(0, 1).float(), labels.flatten())``, unscaled;
    nll_loss saves the labels and total_weight. Under TP the vocabulary-parallel loss
    (``loss_parallel()``, ``tensor_parallel.loss_parallel``) on the local logits, kept by the
    cache."""
    with t.scoped("loss"):
        if d.tp > 1:
            nll, weight = tpar.loss_parallel(t, t.hold(logits), d.tokens, d.vocab // d.tp)
            if nll.fn is not None:
                t.save(nll.fn, labels)
            t.done(weight)
            return nll
        f = ops.to(t, logits, 4, "logits_fp32", Category.LOGITS)
        ls = ops.log_softmax(t, f)
        nll, weight = ops.nll_loss(t, ls)
        if nll.fn is not None:
            t.save(nll.fn, labels)
        t.done(f, ls, weight)
    return nll


def factory(d: Dims, plan: Plan, stage: int):
    """The run's :class:`Pipeline` maker for pipeline rank ``stage`` (``trainer_run`` picks it: by
    default ``most_loaded_stage``, the rank ``memplan validate`` runs)."""

    def make(tape: Tape, grads: dict) -> Pipeline:
        return Pipeline(tape, d, grads, plan.pp, plan.virtual_stages, stage, plan.pp_schedule)

    return make
