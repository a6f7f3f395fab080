"""Tensor parallel (``parallel.apply_tp``) on one rank, as tape ops.

With sequence parallel the residual stream and the norms hold ``s / tp`` tokens.
``PrepareModuleInput`` gathers the sequence before the column-parallel matmuls and
``RowwiseParallel(output_layouts=Shard(1))`` reduce-scatters after the row-parallel ones, both
through funcol on the compute stream. The embedding is vocabulary-parallel and the loss runs under
``loss_parallel()``. Order and sizes: the t8_tp2_x trace (tests/data/gpu-traces).

Without sequence parallel (``Replicate()`` layouts) the stream is whole on every rank: no gather,
the row-parallel outputs and the embedding's partial lookup are all-reduced instead
(:func:`all_reduce`), and the norms run on plain tensors: without FSDP2 their weights are plain
too, a parameter group of their own (:func:`optimizer_groups`), and a pipeline's receive buffers
hold the whole sequence (``runner._train``'s ``s_local``). No GPU trace: checked against the
trainer on CPU (tests/unit/test_timeline_tensor_parallel.py under FSDP2,
test_timeline_tp_nosp.py on one data rank and under a pipeline).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category


def reduce_scatter(tape: Tape, x: Tensor, tp: int, tag: str, node: Node | None = None) -> Tensor:
    """funcol ``reduce_scatter_tensor`` over dim 1: ``torch.cat`` of the sequence chunks (a
    copy of x), then the output (1 / tp of x). A selective checkpoint's policy may keep the
    output (``parallel._OP_SAC_SAVED``) and hand it back in the re-run; the copy is remade."""
    copy = tape.new(x.numel, x.itemsize, f"{tag}_input")
    kept = tape.cached("reduce_scatter")
    if kept is not None:
        out = kept[0]
        out.fn = node
    else:
        out = ops.result(tape, x.numel // tp, x.itemsize, tag, node)
        tape.keep("reduce_scatter", [out])
    tape.drop(copy)
    return out


def gather_seq(tape: Tape, x: Tensor, tp: int, batch: int, tag: str) -> Tensor:
    """Sequence all-gather (Shard(1) -> Replicate): funcol ``all_gather_into_tensor``, a view
    when b = 1 (``_maybe_view_chunk_cat``), else a ``cat`` copy. Backward: a reduce-scatter."""
    if tp == 1:
        return tape.alias(x)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [reduce_scatter(tape, g[0], tp, "grad")]

    node = tape.node(f"{tag}.all_gather", apply, [x])
    out = ops.result(tape, x.numel * tp, x.itemsize, f"{tag}.all_gather", node)
    if batch > 1:
        cat = ops.result(tape, x.numel * tp, x.itemsize, f"{tag}.all_gather_cat", node)
        tape.done(out)
        out = cat
    return out


def scatter_seq(tape: Tape, x: Tensor, tp: int, tag: str) -> Tensor:
    """A row-parallel output to the sequence shard (reduce-scatter). Backward: an all-gather."""
    if tp == 1:
        return tape.alias(x)
    numel, itemsize = x.numel, x.itemsize

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.new(numel, itemsize, "grad_all_gather")]

    return reduce_scatter(tape, x, tp, f"{tag}.reduce_scatter", tape.node(f"{tag}.reduce_scatter", apply, [x]))


def vocab_embedding(tape: Tape, ids: Tensor, w: Tensor, tokens: int, h: int, tp: int, sp: bool = True) -> Tensor:
    """``RowwiseParallel`` on ``nn.Embedding``: three bool masks of the ids outside this rank's
    vocabulary range, the shifted ids (int64, twice), the partial (b, s, h) lookup, then the
    reduce-scatter to the sequence shard. Its gradient covers the whole vocabulary
    (``ops.embedding``'s ``vocab_shards``)."""
    masks = [tape.new(tokens, 1, f"vocab_mask{i}") for i in range(3)]
    tape.done(masks[0], masks[1])
    shifted = [tape.new(tokens, 8, f"shifted_ids{i}") for i in range(2)]
    tape.done(shifted[0])
    full = ops.embedding(tape, ids, w, tokens * h, "embedding", vocab_shards=tp)
    tape.done(shifted[1], masks[2])
    out = scatter_seq(tape, full, tp, "embedding") if sp else all_reduce(tape, full, tp, "embedding")
    tape.done(full)
    return out


def all_reduce(tape: Tape, x: Tensor, tp: int, tag: str) -> Tensor:
    """A row-parallel output to Replicate without sequence parallel: funcol ``all_reduce`` (a
    copy of x, reduced in place). Backward: the gradient passes."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.hold(g[0])]

    return ops.result(tape, x.numel, x.itemsize, f"{tag}.all_reduce", tape.node(f"{tag}.all_reduce", apply, [x]))


def optimizer_groups(params: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """``parallel.build_optimizer_from`` under TP without SP or FSDP2: foreach kernels take no mix
    of DTensors and plain tensors, so the optimizer gets two parameter groups, the DTensors (every
    matrix, the q, k, v biases), then the plain norms (``apply_tp`` gives them no layout without
    SP), each stepped in turn (``AdamW.step`` / ``MasterAdamW.step``: ``for group in
    self.param_groups``): the second group's states and temporaries come after the first's are
    freed. ``params``: (name, elements) in ``model.parameters()`` order."""
    groups: tuple[list, list] = ([], [])
    for p in params:
        groups[p[0].endswith("norm.weight")].append(p)
    return [g for g in groups if g]


# A run of allocations ("+name:size") and frees ("-name") transcribed from the t8_tp2_x trace;
# sizes per token row: b = bool, i = int64, r = fp32, V = fp32 x the local vocabulary; or bytes.
_LOG_SOFTMAX = (
    "+max_local:r +max:r -max_local +shifted:V +exp:V +sum_exp_local:r -exp +sum_exp:r -sum_exp_local "
    "+log_sum_exp:r +log_softmax:V -shifted -max -sum_exp -log_sum_exp"
)
_NLL = (
    "+mask1:b +scalar1:8 +index1:i -scalar1 -mask1 +mask2:b +mask3:b +mask4:b -mask2 -mask3 +index2:i "
    "+index3:i -index2 +row1:r -mask4 +row2:r +row3:r +mask5:b +count1:4 +row4:r -count1 -mask5 -row3 "
    "+mask6:b +scalar2:8 +index4:i -index4 -mask6 +weight:4 -scalar2 +count3:4 +nll:4 -count3 -row4 "
    "-index1 -index3 -row1 -row2"
)
_BACKWARD = (
    "+grad_scalar1:4 +mask7:b +scalar3:8 +index5:i -scalar3 -mask7 +nll_grad:V +mask8:b +mask9:b "
    "+mask10:b -mask8 -mask9 +index6:i +index7:i -index6 +row5:r +row6:r -row5 +index8:i +mask11:b "
    "+count5:4 +row7:r -count5 -mask11 -grad_scalar1 +grad_tmp0:V +grad_tmp1:V -grad_tmp0 +grad:V "
    "-grad_tmp1 -row7 -index5 -nll_grad -mask10 -index7 -row6 -index8"
)


def _run(tape: Tape, script: str, rows: int, vocab: int, live: dict[str, Tensor]) -> None:
    sizes = {"b": (rows, 1), "i": (rows, 8), "r": (rows, 4), "V": (rows * vocab, 4), "8": (1, 8), "4": (1, 4)}
    for word in script.split():
        if word[0] == "+":
            name, code = word[1:].split(":")
            numel, itemsize = sizes[code]
            live[name] = tape.new(numel, itemsize, name, Category.LOGITS if code == "V" else None)
        else:
            tape.done(live.pop(word[1:]))


def loss_parallel(tape: Tape, logits: Tensor, tokens: int, vocab: int) -> tuple[Tensor, Tensor]:
    """``loss_fn`` under ``loss_parallel()`` on (b s, V/tp) logits: the fp32 copy, a
    vocabulary-parallel log_softmax (max and sum all-reduced; the result saved), nll over the
    local targets (masks, gathers, all-reduce). Backward: the zeroed gradient, two fp32
    temporaries and the log_softmax gradient. Returns the loss before ``/ m`` and total_weight."""
    f = ops.to(tape, logits, 4, "logits_fp32", Category.LOGITS)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        inner: dict[str, Tensor] = {}
        _run(tape, _BACKWARD, tokens, vocab, inner)
        return [inner.pop("grad")]

    node = tape.node("cross_entropy", apply, [f])
    live: dict[str, Tensor] = {}
    _run(tape, _LOG_SOFTMAX + " " + _NLL, tokens, vocab, live)
    if node is not None:
        tape.save(node, live["log_softmax"])
        tape.save(node, live["weight"])
    tape.done(live.pop("log_softmax"), f, logits)
    nll = live.pop("nll")
    nll.fn = node
    return nll, live.pop("weight")
