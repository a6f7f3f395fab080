"""An LLM.int8 base (``memplan/train/quant.py``, ``quant: int8``; bitsandbytes 0.50.2) as ops on the tape.

The build (``quant.quantize_base``): each decoder linear, in module order, becomes a
``Linear8bitLt(has_fp16_weights=False, threshold=6.0)`` whose ``Int8Params`` quantizes on its move to
the device (``Int8Params._quantize``): ``B = data.contiguous().to(device, float16)`` (n x 2 B), then
``int8_vectorwise_quant(B)``, which keeps the int8 rows ``CB`` (n x 1 B) and their fp32 absmax ``SCB``
(one per output row), and ``B`` goes as ``_quantize`` returns. CUDA's kernel (``backends/cuda/ops.py``)
allocates ``row_stats`` then ``out_row`` (no threshold: no outlier pass); the default one (CPU,
``backends/default/ops.py``) computes them in PyTorch: ``A.abs()``, ``max(dim=1)`` (fp16 values,
int64 indices), ``.float()``, ``127 / row_stats``, the fp32 product, ``round``, ``.to(int8)``. The
bf16 weights go once the loop ends (``list(model.modules())`` holds the replaced linears), then
``prepare_model_for_kbit_training``'s cast makes the embedding, norms and head fp32: the residual
stream is fp32, and ``Linear8bitLt.forward`` passes it as is (no compute dtype, unlike 4-bit).
A trained LM head copy is cast with its frozen original (``quant.cast_to_fp32``); a q, k or v bias is
copied after its weight and cast as over a 4-bit base (``quant.clone_bias``), fp32 as the stream
(``Linear8bitLt.forward`` casts nothing), added in ``F.linear`` (CPU) or ``int8_mm_dequant``'s
``out.add_(bias)`` (CUDA, in place).

The forward, ``bnb.matmul(x, weight, state=state)`` in training (``autograd/_functions.py``):

- on CPU ``MatMul8bitFp`` (``matmul``: ``A.device.type in ("cpu", "xpu")``): ``CB =
  state.CB.to(A.dtype).mul_(state.SCB.unsqueeze(1).mul(1 / 127))`` (the weight dequantized, n x 4 B,
  and an fp32 row-scale temporary), ``F.linear(A, CB)``; ``CB`` goes at the return;
- on CUDA ``MatMul8bitLt`` (frozen weight: the fast path, ``int8_vectorwise_quant`` with the 6.0
  threshold): ``A.to(float16)``; in the kernel ``row_stats`` (fp32 per token), ``out_row`` (int8),
  ``A.abs() >= threshold`` (the fp16 ``abs`` freed once the bool mask exists), ``outliers.any()``
  (one byte); ``int8_mixed_scaled_mm`` then ``int8_scaled_mm``: ``int8_linear_matmul`` (int32
  output), ``int8_mm_dequant`` (fp16, then ``.to(A.dtype)``). With k outlier columns (|x| >= 6.0 in
  any token) also ``outliers.any(dim=0)`` (one byte per input feature), ``argwhere`` (k int64, kept
  in ``state.idx`` until the next call and in ``ctx.tensor_states`` while the graph lives), ``subA =
  A[:, cols]`` (tokens x k in A's dtype, kept by ``ctx.tensors``), ``CB[:, cols]`` (out x k int8),
  its dequantization (``_ops.py``: ``A * stats.view(-1, 1) * 7.874e-3``, two out x k fp32 products, the
  first freed) and ``output.addmm(subA, subB)``: a second output (tokens x out) while the first goes.

Under a selective-op checkpoint CPU's ``F.linear`` is an ``mm`` the policy counts (``MatMul8bitFp`` is
Python ops under its dispatch mode), CUDA's ``int8_scaled_mm`` a custom op it does not, but its
``addmm`` over outlier columns it does (:func:`_linear`). Both keep their input as a ctx attribute
(``ctx.A = A``; ``ctx.tensors = (CAt, subA, A)``), not through ``save_for_backward``: it lives until the
step's graph goes (``del loss``), outlives the backward, and a non-reentrant checkpoint's hooks never
see it, so a checkpointed layer's int8 linears keep their inputs through the forward
(``memory.checkpointed_int8_inputs``). A re-run's graph goes with the re-run. The backward (both): ``CB
= state.CB.to(A.dtype, copy=True).mul_(...)`` (n x 4 B and the row-scale temporary), ``grad_A =
matmul(grad_output, CB).view(...)``; ``CB`` goes.

The outlier count k comes from the activations' values, not their shapes: per call, :attr:`Int8.outliers`
(``int8_outliers.RandomInit`` over the bundled trainer's random weights: the down projection's
``silu(g) * u`` reaches 6.0 in about half its 8,192 columns at 16k tokens on a 1B Llama, each column
kept as ``subA``, 242 MB a layer in fp32, held with the graph; none over a trained checkpoint,
:data:`OUTLIER_COLUMNS`). The CPU form is held against the bundled trainer on CPU
(tests/unit/test_timeline_int8.py); the CUDA form against an H100 allocator trace of the bundled
trainer (a down projection's events one for one; with the trace's own columns the step 33 KB under
its measured peak, reserved exact) and H200 runs of it and of transformers' Trainer
(tests/unit/test_timeline_int8_cuda.py). Not modelled there: the sub-kilobyte scratch of ``any()``'s
reduction, of ``argwhere`` (``nonzero``'s count and CUB storage) and of ``out_row[:, outlier_cols] =
0``, and ``any(dim=0)``'s split-reduction buffer (34,603,008 B on the H100 at 16k x 8,192: transient).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.int8_outliers import THRESHOLD, RandomInit  # noqa: F401 (THRESHOLD re-exported)
from memplan.costmodel.timeline.quant import cast_to_fp32, clone_bias, is_linear

# Outlier columns per int8 linear call (inputs with |x| >= THRESHOLD in some token) where nothing says
# more: a trained checkpoint's come from its activations (Dettmers et al. 2022, arXiv 2208.07339,
# Sec. 4: a few feature dimensions), none here. Over random weights (the bundled trainer's, always)
# ``int8_outliers.RandomInit`` counts them per linear (the down projection's: thousands at 16k tokens).
OUTLIER_COLUMNS = 0
Cast = Callable[[Tensor, str], Tensor]  # (input, tag) -> its autocast cast


def outlier_bytes(tokens: int, rows: int, itemsize: int) -> tuple[int, int]:
    """Per outlier column of one CUDA int8 linear (``rows`` outputs, its input of ``itemsize`` B):
    (kept until the graph goes: ``subA``'s column and ``state.idx``'s int64, transient: the
    column of ``CB[:, cols]`` and of the two fp32 products of its dequantization). Any k > 0 also
    adds a second output (tokens x rows x itemsize) for the ``addmm``, transient."""
    return tokens * itemsize + 8, rows * (1 + 4 + 4)


@dataclass
class Int8:
    """The int8 linears on a tape: their ``CB`` and ``SCB``, and what their graph keeps."""

    tape: Tape
    cuda: bool = True  # MatMul8bitLt (CUDA) or MatMul8bitFp (CPU)
    outliers: int | RandomInit = OUTLIER_COLUMNS  # k of every call, or per linear (int8_outliers.py)
    weights: dict[str, tuple[Tensor, int]] = field(default_factory=dict)  # name -> (CB, output rows)
    state: list[Tensor] = field(default_factory=list)  # the SCBs
    idx: dict[str, Tensor] = field(default_factory=dict)  # each linear's state.idx when k > 0
    held: list[Tensor] = field(default_factory=list)  # ctx.A / ctx.tensors, until the graph goes
    owners: list[Node] = field(default_factory=list)  # the node whose ctx holds each of ``held``

    def build(
        self, weights: dict[str, Tensor], shapes: dict[str, tuple[int, int]], before: dict[str, Tensor] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """``quantize_base`` over the built ``weights`` (names in module order; ``shapes``:
        (out, in)): quantize every decoder linear (a bias copied after its weight), free the
        replaced linears' 16-bit parameters last one first, cast the rest to fp32 where it is
        16-bit (``quant.cast_to_fp32``: a trained LM head copy and its frozen original, ``before``,
        both). Returns the (old, new) casts."""
        t = self.tape
        names = [n for n in weights if is_linear(n)]
        originals = []
        for name in names:
            rows, cols = shapes[name]
            with t.scoped(name.removesuffix(".weight")):
                self._quantize(name, rows, cols)
            originals.append(clone_bias(t, weights, name))
        for name, bias in zip(reversed(names), reversed(originals), strict=True):
            t.free(weights.pop(name))  # the replaced nn.Linear's parameters: its weight, then its bias
            if bias is not None:
                t.free(bias)
        return cast_to_fp32(t, weights, before or {})

    def _quantize(self, name: str, rows: int, cols: int) -> None:
        """``Int8Params._quantize``: the fp16 copy, ``int8_vectorwise_quant`` (CUDA's kernel or the
        default PyTorch one), the copy freed at the return."""
        t, n = self.tape, rows * cols
        b16 = t.new(n, 2, "weight_fp16")
        if self.cuda:
            scb = t.managed(rows, 4, "SCB", Category.PARAMETERS)
            cb = t.managed(n, 1, "CB", Category.PARAMETERS)
        else:
            absolute = t.new(n, 2, "abs")
            values, indices = t.new(rows, 2, "max_values"), t.new(rows, 8, "max_indices")
            t.done(absolute)
            scb = t.managed(rows, 4, "SCB", Category.PARAMETERS)
            t.done(values, indices)
            scale = t.new(rows, 4, "scale")
            scaled = t.new(n, 4, "scaled")
            t.done(scale)
            rounded = t.new(n, 4, "rounded")
            t.done(scaled)
            cb = t.managed(n, 1, "CB", Category.PARAMETERS)
            t.done(rounded)
        t.done(b16)
        self.weights[name] = (cb, rows)
        self.state.append(scb)

    def linear(
        self, x: Tensor, name: str, out_features: int, tag: str, autocast: bool = False, input_cast: Cast | None = None
    ) -> Tensor | None:
        """``Linear8bitLt.forward`` on ``x``; None when ``name`` is not an int8 weight. ``autocast``:
        CPU's bf16 autocast around it (the Trainer's ``bf16=True``): ``MatMul8bitFp``'s ``F.linear``
        runs in bf16 (CUDA's int8 kernels are custom ops autocast leaves alone); ``input_cast``: the
        model's autocast cast of an input (``hf_model.HfLlama.input_cast``: a leaf's cached), else a new one."""
        entry = self.weights.get(name)
        if entry is None:
            return None
        cb, rows = entry
        t, tokens = self.tape, x.numel // (cb.numel // rows)
        cols = cb.numel // rows
        node = t.node(f"{tag}.MatMul8bit", _backward(rows, cols, x.itemsize), [x])
        if self.cuda:
            out = self._cuda(x, node, tokens, rows, tag, self._columns(name, tokens, cols))
        else:
            out = self._cpu(x, node, tokens, rows, cols, tag, autocast, input_cast)
        if node is not None:  # ctx.A = A: an attribute, held while the graph lives
            self._hold(x, node)
        return out

    def _hold(self, x: Tensor, node: Node) -> None:
        """A ctx attribute's reference to ``x`` (``node``'s ctx), until the graph goes; a re-run's graph goes
        with the re-run (the tape drops its Python references then)."""
        a = self.tape.alias(x)
        if not self.tape.recomputing:
            self.held.append(a)
            self.owners.append(node)

    def keep_reachable(self, reached: set[Node]) -> list[Tensor]:
        """The ctx attributes of the linears whose node is in ``reached`` (a node Python still holds, and those
        it reaches: TRL's ``curr_autograd_node``), taken out of the graph's; they go when that node does."""
        kept = [a for a, n in zip(self.held, self.owners, strict=True) if n in reached]
        rest = [(a, n) for a, n in zip(self.held, self.owners, strict=True) if n not in reached]
        self.held, self.owners = [a for a, _ in rest], [n for _, n in rest]
        return kept

    def _cpu(
        self,
        x: Tensor,
        node: Node | None,
        tokens: int,
        rows: int,
        cols: int,
        tag: str,
        autocast: bool,
        input_cast: Cast | None,
    ) -> Tensor:
        """``MatMul8bitFp.forward``: the dequantized weight, ``F.linear``, the weight freed. Under
        autocast ``F.linear`` casts the weight, then the input (arguments right to left, as
        ``Model.linear``), to bf16 (the dequantized weight is no leaf: not cached; the input is where it is
        a leaf that requires grad, ``input_cast``) and returns bf16;
        a bf16 input (an earlier autocast linear's output: the attention's, the gated product before the
        down projection) is dequantized to bf16 (``CB.to(A.dtype)``), and autocast casts neither."""
        t = self.tape
        w = _dequantize(t, rows, cols, x.itemsize, f"{tag}.weight_dq")
        casts = []
        if autocast and x.itemsize != 2:
            casts.append(t.new(rows * cols, 2, f"{tag}.weight_autocast"))
            casts.append(t.new(x.numel, 2, f"{tag}.input_cast") if input_cast is None else input_cast(x, tag))
        out = _linear(t, tokens * rows, 2 if autocast else x.itemsize, tag, node)
        t.done(*reversed(casts))
        t.done(w)
        return out

    def _columns(self, name: str, tokens: int, cols: int) -> int:
        """The outlier columns of this call of ``name``: :attr:`outliers` itself, or its count for the linear."""
        if isinstance(self.outliers, int):
            return self.outliers
        return self.outliers.columns(name, tokens, cols)

    def _cuda(self, x: Tensor, node: Node | None, tokens: int, rows: int, tag: str, k: int) -> Tensor:
        """``MatMul8bitLt.forward``, frozen weight, threshold 6.0, ``k`` outlier columns."""
        t, n_in, a = self.tape, x.numel, x.itemsize
        cols = n_in // tokens
        x16 = t.new(n_in, 2, f"{tag}.input_fp16") if a != 2 else t.alias(x)
        sca = t.new(tokens, 4, f"{tag}.row_stats")
        ca = t.new(n_in, 1, f"{tag}.int8_input")
        absolute = t.new(n_in, 2, f"{tag}.abs")
        mask = t.new(n_in, 1, f"{tag}.outlier_mask")
        t.done(absolute)
        t.done(t.new(1, 1, f"{tag}.any"))
        if k:
            columns = t.new(cols, 1, f"{tag}.any_columns")
            idx = t.new(k, 8, f"{tag}.outlier_cols", Category.ACTIVATIONS)
            t.done(columns)
        t.done(mask)  # the kernel's frame returns
        t.done(x16)  # A.to(float16), the call's temporary
        sub = []
        if k:
            self._outlier_index(tag, idx, node)
            sub_a = t.new(tokens * k, a, f"{tag}.subA")
            cb_cols = t.new(rows * k, 1, f"{tag}.CB_cols")
            scaled = t.new(rows * k, 4, f"{tag}.subB_scaled")  # int8_vectorwise_dequant: A * stats.view(-1, 1)
            sub_b = t.new(rows * k, 4, f"{tag}.subB")  # ... * 7.874015718698502e-3
            t.done(scaled)
            t.done(cb_cols)  # the dequant's argument, once it returns
            if a != 4:
                sub_b, f32 = t.new(rows * k, a, f"{tag}.subB_cast"), sub_b
                t.done(f32)
            sub = [sub_a, sub_b]
        i32 = t.new(tokens * rows, 4, f"{tag}.int32_out")
        f16 = t.new(tokens * rows, 2, f"{tag}.fp16_out")
        if a == 2:  # .to(float16) returns the dequantized output itself
            f16.fn, out = node, f16
        else:
            out = ops.result(t, tokens * rows, a, tag, node)
            t.done(f16)
        t.done(i32)
        if k:  # output.addmm(subA, subB): a new output, the first goes; an aten matmul, which a
            # selective-op policy counts as it counts CPU's F.linear (int8_mixed_scaled_mm is a custom op)
            out2 = _linear(t, tokens * rows, a, tag, node)
            t.done(out)
            out = out2
            if node is not None:  # ctx.tensors' subA
                self._hold(sub[0], node)
            t.done(*reversed(sub))
        t.done(ca, sca)  # the forward's locals
        return out

    def _outlier_index(self, tag: str, idx: Tensor, node: Node | None) -> None:
        """``state.idx = outlier_cols``, also ``ctx.tensor_states``' (while the graph lives): the
        state lets go of the linear's previous call's index."""
        self.tape.drop(self.idx.get(tag))
        self.idx[tag] = idx
        if node is not None:
            self._hold(idx, node)

    def free_graph(self) -> None:
        """``del loss``: the graph's nodes go from the loss down, each int8 linear's ctx with them."""
        for x in reversed(self.held):
            self.tape.drop(x)
        self.held, self.owners = [], []


def _linear(t: Tape, numel: int, itemsize: int, tag: str, node: Node | None) -> Tensor:
    """``MatMul8bitFp``'s ``F.linear(A, CB, bias)``: an ``mm`` (``addmm`` with a bias) that a
    selective-op checkpoint sees, ``MatMul8bitFp`` being Python ops under its dispatch mode
    (``parallel.op_sac_policy`` counts it): kept in the forward when the count is odd, handed back
    in the re-run (CUDA's ``int8_scaled_mm`` is a custom op, not a matmul to the policy; its
    ``output.addmm(subA, subB)`` over outlier columns is one, taken here too)."""
    kept = t.cached("mm")
    if kept is not None:
        kept[0].fn = node
        return kept[0]
    out = ops.result(t, numel, itemsize, tag, node)
    if t.on_first_mm is not None:
        t.on_first_mm()
    t.keep("mm", [out])
    return out


def _dequantize(t: Tape, rows: int, cols: int, itemsize: int, tag: str) -> Tensor:
    """``state.CB.to(dtype).mul_(state.SCB.unsqueeze(1).mul(1 / 127))``: the weight, the row scales' temporary."""
    w = t.new(rows * cols, itemsize, tag)
    t.done(t.new(rows, 4, f"{tag}_scale"))
    return w


def _backward(rows: int, cols: int, itemsize: int):  # noqa: ANN202 - a node's apply
    """``MatMul8bitLt.backward`` / ``MatMul8bitFp.backward`` for a frozen weight: ``grad_A`` alone."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        grad = g[0]
        tokens = grad.numel // rows
        w = _dequantize(tape, rows, cols, itemsize, "weight_dq")
        cast = tape.new(grad.numel, itemsize, "grad_cast") if grad.itemsize != itemsize else None
        dx = tape.new(tokens * cols, itemsize, "dX")
        dx.view = True  # matmul(...).view(ctx.grad_shape)
        if tape.on_first_mm is not None:
            tape.on_first_mm()
        tape.done(cast, w)  # the matmul's temporary, then the frame's CB
        return [dx]

    return apply
