"""PEFT DoRA (``LoraConfig(use_dora=True)``, peft 0.21) over transformers' model in the op-level runs of the Trainer
(one rank or DDP, any of its optimizers) and of the hand-written loop (``hf_lora.HfLora.adapt`` calls :func:`adapt`).

DoRA is LoRA with a trained magnitude per output feature (``lora_magnitude_vector``: ``out`` fp32 elements,
made after ``lora_B``; the norm of ``W + scaling * B @ A`` per row at ``get_peft_model``), and a forward that
forms the adapters' whole weight. ``lora.Linear.forward`` runs the base, casts ``x`` to the adapters' fp32
(``_cast_input_dtype``), then ``DoraLinearVariant.forward`` (``peft/tuners/lora/variants.py``)::

    if isinstance(dropout, nn.Identity) or not module.training:
        base_result = result                    # the base's output, reused
    else:
        x = dropout(x)                          # the dropped-out input feeds the base again (below)
        base_result = None
    result = result + lora_magnitude_vector(x, ..., base_result=base_result)

and ``DoraLinearLayer.forward`` (``peft/tuners/lora/dora.py``)::

    lora_weight = lora_B(lora_A(eye(in))).T     # get_lora_weight: the in x in identity, in x r, in x out
    lora_weight = lora_weight.to(x.dtype)
    weight = dequantize_module_weight(base_layer).to(x.dtype)   # the frozen W, cast to fp32 over a bf16 base
    weight_norm = get_weight_norm(weight, lora_weight.detach(), scaling)
        # (W + scaling * lora_weight): two out x in temporaries; torch.linalg.norm(., dim=1): out
    mag_norm_scale = (magnitude / weight_norm.detach()).view(1, -1)   # saves weight_norm
    lora_result = lora_B(lora_A(x))             # as LoRA's: x and lora_A's output saved
    if base_result is None:
        base_result = F.linear(x, weight)       # dropout > 0: the frozen W saved for dX
    elif bias is not None:
        base_result = base_result - bias        # Qwen2's q/k/v biases
    return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling

The two products save ``base_result`` and ``lora_result`` (tokens x out each, their dtypes) with
``mag_norm_scale - 1`` and ``mag_norm_scale``; the sum is fp32 (the magnitude's dtype promotes a bf16
operand). ``lora_weight`` is only read detached: its graph (``lora_A``'s product saving the identity, or
its bf16 cast under autocast; ``lora_B``'s saving ``lora_A``'s output and ``B.t()``) never reaches the loss
and goes with ``lora_weight`` when the forward returns (:class:`DeadSaves`). The magnitude's gradient comes
through the division (``grad / weight_norm``), summed down from the two products (``validate_outputs``).
Over a 4-bit base (QDoRA) ``lora.bnb.Linear4bit.forward`` clones the base's result first and ``W`` is
dequantized in each forward (:func:`_dequantize`). Under the Trainer's FSDP2 the magnitude is one more parameter of
its layer's group (``hf_fsdp.peft_shapes``) and ``W`` the group's unsharded weight. Over the MoE and MLA families the
same adapters wrap the ``nn.Linear`` the LoRA runs follow (PEFT gives its ``ParamWrapper`` no DoRA). Not followed
(``hf_support._dora_reason``): an LLM.int8 base (PEFT's own run fails on CPU), activation offload beyond one rank of
the dense families, and TRL's under the Trainer's autocast over a bf16 or 4-bit base outside a non-reentrant
checkpoint. Under saved-tensor hooks (TRL's ``OffloadActivations``, ``save_on_cpu``) every save above is packed as
torch makes it, and ``lora_weight``'s dead graph's too (:class:`DeadSaves`). Checked on CPU against the real Trainer
and loop, to the byte: tests/unit/test_timeline_hf_dora.py, test_timeline_hf_dora_fsdp.py,
test_timeline_hf_dora_moe.py, test_timeline_hf_dora_offload.py.
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.act_offload import Packed
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.hf_bnb import BLOCK
from memplan.costmodel.timeline.hf_offload import TrlPacked

MAGNITUDE = "lora_magnitude_vector"  # PEFT's ModuleDict of DoraLinearLayer, its ``weight`` the magnitude


class DeadSaves:
    """Saves of a graph that never reaches the loss (``lora_weight``'s, read detached). Outside a checkpoint
    they are held until the graph goes (:meth:`release`); under saved-tensor hooks they are packed as any save and
    never unpacked: ``save_on_cpu``'s host copies go with the graph, TRL's stay in its tracker (a kept save the
    tensor itself, ``TrlOffload.orphans``) until the next step's ``__enter__``. Inside a non-reentrant checkpoint
    each is packed into a holder that nothing unpacks (``torch/utils/checkpoint.py`` ``_checkpoint_hook.pack_hook``): it
    counts among the frame's saves, so the recompute's early stop comes after it, but the frame keeps no
    tensor for it and the backward unpacks none (it counts as unpacked at once). In the recompute its holder
    is dead (``_recomputation_hook.pack_hook``: ``holder is None``), so the frame stores nothing, but that
    hook returns the tensor itself: the recompute's own graph holds it until ``lora_weight`` goes, or the
    early stop unwinds the frames."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.graph = tape.grad_enabled  # made where the graph is (not under a reentrant checkpoint's no_grad)
        self.held: list[Tensor] = []
        self.packed: list[Packed] = []  # host copies of the saves the hooks offloaded

    def save(self, t: Tensor) -> None:
        tape = self.tape
        if not self.graph:
            return
        if tape.recomputing and not t.st.managed:  # the recompute's pack returns the tensor: its graph holds it
            self.held.append(tape.alias(t))
        if tape.dead_save():
            return
        hooks = tape.hooks
        if hooks is None:
            if not t.st.managed:  # outside a checkpoint; a parameter's view holds nothing
                self.held.append(tape.hold(t))
            return
        packed = hooks.pack(tape, t)  # outside a checkpoint the saved-tensor hooks pack it as any save
        if packed is t:  # kept on the device by TRL's hooks (a parameter's view, under 1024 B, a key it holds)
            if not t.st.managed:  # the hold pack took: TRL's tracker's, never unpacked, to the next step
                hooks.orphans.append(t)
        else:
            self.packed.append(packed)

    def release(self) -> None:
        """The graph goes: each node its saves, then the node it points to (``lora_B``'s, then ``lora_A``'s)."""
        for t in reversed(self.held):
            self.tape.done(t)
        self.held = []
        for packed in self.packed:
            if not isinstance(packed, TrlPacked):
                packed.hooks.release(packed)
        self.packed = []


def adapt(lora, model, x: Tensor, out: Tensor, name: str) -> Tensor:
    """``lora.Linear.forward`` (over a 4-bit base ``lora.bnb.Linear4bit.forward``) with the DoRA variant after
    ``self.base_layer(x)`` returned ``out``. ``lora``: the ``hf_lora.HfLora`` whose adapters these are;
    ``model``: the ``HfLlama`` that runs them. Over a 4-bit base the result is cloned first, and the input's
    cast to fp32 and the result's back run unless ``torch.is_autocast_enabled()`` (CUDA's: on CPU always)."""
    t = lora.tape
    quant = model.quant if model.quant is not None and model.quant.quantized(name) else None
    with t.scoped(f"{name}.dora"):
        result, cast = out, quant is None or model.cache is None or model.cpu
        if quant is not None:  # result.clone(): CloneBackward passes the gradient on
            result = ops.unary(t, out, "clone", temps=-1)
            t.done(out)
        a = ops.to(t, x, lora.read_bytes, "input_fp32") if cast else t.alias(x)
        if lora.cfg.dropout:  # the variant's x: dropped out, and the base runs again on it
            dropped, base = lora._dropout(a), None
        else:
            dropped, base = t.alias(a), result
        dora = _dora_layer(lora, model, dropped, base, name, result.numel // lora.tokens, quant)
        total = ops.add(t, result, dora, "sum")  # result + result_dora: fp32 over a 16-bit base
        t.done(dora, dropped, result)  # the temporary, the variant's x at return, then the rebound `result`
        y = ops.to(t, total, result.itemsize, "out_cast") if cast else t.alias(total)
        t.done(total, a)
    return y


def _dora_layer(lora, model, x: Tensor, base: Tensor | None, name: str, rows: int, quant=None) -> Tensor:  # noqa: ANN001
    """``DoraLinearLayer.forward`` over ``x`` (fp32: the adapters' dtype), ``base`` the base's output or
    None (dropout > 0); ``rows``: the linear's out features; ``quant``: a 4-bit base (``hf_bnb.Bnb4bit``)."""
    t, r, cols = lora.tape, lora.cfg.rank, x.numel // lora.tokens
    dead = DeadSaves(t)
    weight = _lora_weight(lora, model, dead, name, rows, cols, x.itemsize)
    w = model.weights[f"{name}.weight"] if quant is None else _dequantize(t, quant, rows * cols)
    if w.itemsize != x.itemsize:  # .to(x.dtype): frozen, no node
        w, old = ops.to(t, w, x.itemsize, "weight_cast"), w
        if quant is not None:
            t.done(old)  # the rebound dequantized weight
    elif quant is None:
        w = t.alias(w)
    with t.no_grad():  # get_weight_norm over the detached lora_weight and the frozen W
        scaled = t.new(rows * cols, x.itemsize, "scaled_lora_weight")
        summed = t.new(rows * cols, x.itemsize, "weight_sum")
        t.done(scaled)
        norm = t.new(rows, x.itemsize, "weight_norm")
        t.done(summed)
    magnitude = model.weights[f"{name}.{MAGNITUDE}.weight"]
    scale = ops.mul(t, magnitude, norm, "mag_norm_scale")  # magnitude / weight_norm: saves weight_norm
    ya = model.dense(x, f"{name}.lora_A", r, "lora_A")
    lora_result = model.dense(ya, f"{name}.lora_B", rows, "lora_B")
    t.done(ya)
    bias = model.weights.get(f"{name}.bias")
    if base is None:  # F.linear(x, weight): the base again on the dropped-out input, without its bias
        base = _frozen_linear(model, x, w, rows * lora.tokens, "base_again")
    elif bias is not None:
        base = ops.add(t, base, bias, "minus_bias")
    else:
        base = t.alias(base)
    minus_one = ops.unary(t, scale, "minus_one", temps=-1)  # mag_norm_scale - 1: passes the gradient
    first = ops.mul(t, minus_one, base, "scaled_base")
    t.done(minus_one)
    second = ops.mul(t, scale, lora_result, "scaled_lora")
    third = ops.unary(t, second, "scaling")  # * scaling: a Python scalar, nothing saved
    t.done(second)
    out = ops.add(t, first, third, "result_dora")
    t.done(third, first)
    # the frame's locals at return: base_result, then lora_weight (its dead graph first), the cast W, ...
    t.done(base)
    dead.release()
    t.done(weight, w, norm, scale, lora_result)
    return out


def _lora_weight(lora, model, dead: DeadSaves, name: str, rows: int, cols: int, itemsize: int) -> Tensor:
    """``get_lora_weight``: ``lora_B(lora_A(eye(in))).T`` cast to ``x``'s dtype, its graph's saves in ``dead``.
    Under autocast the weights' bf16 casts are autocast's cached ones (made here, the forward's first use)."""
    t, r = lora.tape, lora.cfg.rank
    eye = t.new(cols * cols, lora.read_bytes, "eye")
    # each ``nn.Linear`` as ``HfLlama.linear`` runs it (under autocast the weight's cast, then the input's); the node's
    # saves are packed before its output is made (``VariableType``: ``grad_fn->self_ = SavedVariable(...)`` before the
    # kernel), so TRL's forward stash is trimmed first
    wa = model.weight(f"{name}.lora_A.weight")
    with t.no_grad():  # the products' graph is followed by ``dead``: it never reaches the loss
        ein = model.input_cast(eye, "eye")
        dead.save(ein)  # mm saves the identity (its cast) for lora_A's weight gradient
        ya = ops.linear(t, ein, wa, cols * r, "eye_lora_A")
        t.done(ein, wa)
    wb = model.weight(f"{name}.lora_B.weight")
    with t.no_grad():
        dead.save(ops._transpose(wb))  # B.t() for the gradient of lora_A's output, then that output for B's
        dead.save(ya)
        yb = ops.linear(t, ya, wb, cols * rows, "eye_lora_B")
        t.done(ya, wb)
        t.done(eye)  # get_lora_weight returns
        weight = ops.to(t, yb, itemsize, "lora_weight_cast")  # .to(x.dtype): under autocast bf16 -> fp32
        t.done(yb)
    return weight


def _dequantize(t: Tape, quant, numel: int) -> Tensor:  # noqa: ANN001
    """``dequantize_module_weight`` over ``Linear4bit`` (``peft/utils/integrations.py`` ->
    ``bnb.functional.dequantize_4bit``): with double quantization the absmax dequantized first (fp32, the offset
    added in place), then the weight in the dtype it was loaded in (``quant_state.dtype``), as ``MatMul4Bit``'s
    backward dequantizes it (``hf_bnb.Bnb4bit._matmul``)."""
    absmax = t.new(-(-numel // BLOCK), 4, "absmax_dequant") if quant.double_quant else None
    w = t.new(numel, quant.stored, "weight_dequant")
    t.done(absmax)
    return w


def _frozen_linear(model, x: Tensor, w: Tensor, numel: int, tag: str) -> Tensor:
    """``F.linear(x, w)`` over a frozen weight that is no parameter (the cast W): under autocast the weight
    cast anew (no cache: not a leaf that requires grad), then the input."""
    t = model.tape
    wc = ops.to(t, w, 2, f"{tag}.weight_autocast", Category.AUTOCAST) if model.cache is not None else t.alias(w)
    xin = model.input_cast(x, tag)
    out = ops.linear(t, xin, wc, numel, tag)
    t.done(xin, wc)
    return out
