"""FSDP2 ZeRO-3 and ZeRO-2 as the bundled trainer applies them (``parallel.apply_fsdp``), on one rank.

Groups, in the order the forward runs them: ``tok_embeddings``; each layer; ``(norm, output)``
(``reshard_after_forward=False``); the root holds nothing else (untied models). Under ZeRO-2
every group keeps its parameters from its forward to its post-backward, and the backward's
prefetch finds them unsharded: no all-gather in the backward (h200_b_z2_8b). What a group
allocates (sizes from the local parameter shapes; FSDP2 pads dim 0 to a multiple of dp):

- all-gather (its own stream): under ``MixedPrecisionPolicy(bf16, fp32)`` the bf16 copy of
  the fp32 shard (freed at once), then the output, dp x the padded shard in bf16;
- copy-out (compute stream): each unsharded parameter in bf16, freed at reshard
  (``storage.resize_(0)``, whatever still refers to it), its storage the padded shard x dp
  (``FSDPParam.init_all_gather_outputs``; checked on CPU at dp 3); a small metadata tensor. In the
  forward a group's all-gather output lives until the next group's copy-out, in the backward
  until its own; the backward prefetches the next group's all-gather in its pre-backward;
- post-backward: reshard, then the reduce-scatter input (compute stream, reduce dtype: fp32
  under the mixed policy), the previous one freed just before; the unsharded gradients go,
  the last-registered parameter's after the output (the sharded gradient, reduce-scatter
  stream) is allocated, which lives until ``zero_grad``. Under gradient accumulation (no
  ``no_sync`` on an FSDP2 module: every micro-batch reduce-scatters) a later micro-batch's
  output is added into the sharded gradient and freed as ``foreach_reduce`` returns, after
  its loop's last unsharded gradient (``_fsdp_collectives.foreach_reduce``).

Order and sizes: tests/data/gpu-traces (t8_z3_bf16, t8_sel, t70_z3, t8_tp2_x). In fp32 (no
policy: ``MixedPrecisionPolicy()``) the all-gather takes the fp32 shard itself (no cast copy),
its output, the unsharded parameters and the reduce-scatter are fp32 (``FSDPParam``'s
``param_dtype``/``reduce_dtype`` default to the parameter's): no GPU trace, held against the
trainer on CPU with recompute and TP + SP (tests/unit/test_timeline_zero1.py).

With ``CPUOffloadPolicy`` (``offload_params: cpu``, which the trainer pairs with the optimizer
on the host) the shards live in host memory (``to_empty(device="cpu")``): nothing is built on
the device. Each all-gather copies the group's shards to the device one parameter at a time on
its stream (``FSDPParam.all_gather_inputs``: ``sharded_param_data.to(device)``), each cast to
bf16 at once under the mixed policy (the fp32 copy freed), then the output, then the inputs go in
reverse order; the reduce-scatter output is copied to the host and freed on its stream right
after the last unsharded gradient goes (``foreach_reduce``: ``new_sharded_grad.to(cpu)``), so
no gradient and no optimizer state stays on the device. Order and sizes: h200_b_off8b. Under
gradient accumulation every micro-batch does the same on the device; a later one's host copy is
added into the host gradient (``sharded_param.grad._local_tensor += new_sharded_grad``; the copy
then blocks instead of overlapping: torch 2.13 ``_fsdp_collectives.foreach_reduce``), nothing more
on the device (held against the trainer on CPU with selective-op and partial recompute too:
tests/unit/test_timeline_fsdp_variants.py). In fp32 (no ``param_dtype``) each copy is the
all-gather input itself (``_to_dtype_if_needed`` returns it; ``_get_param_all_gather_inputs``
takes this per-parameter path under offload either way): held against the trainer on CPU, where
the copies are no-ops (tests/unit/test_timeline_fp32_corners.py).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category, Stream, root_stream
from memplan.costmodel.timeline.trainer_model import Dims, Model, layer_param_names

# Small metadata tensors of the copy-out (split sizes) and the reduce-scatter copy-in (chunk
# offsets), in the small pool either way: per layer group / per embedding or head group, as
# in the dp = 8 traces (7.8 to 32 KB and 0.2 to 1 MB elsewhere); the copy-in's doubles in fp32.
COPY_OUT_META = (30760, 32104, 32144)  # layer, embedding, head
COPY_IN_META = (213456, 513088, 513144)
# Their tags. Both are CUDA's alone (``timeline.cpu``): FSDP2's ``fsdp::split_with_sizes_copy`` and
# ``fsdp::chunk_cat`` (torch 2.13 ``_fsdp_collectives.py``) call ``split_with_sizes_copy_out_cuda``
# and ``_chunk_cat_out_cuda`` (aten/src/ATen/native/cuda/TensorShape.cu), whose fast paths pack
# their addresses and block maps into one int64 device tensor (``detail::pack_vecs``:
# ``packed.to(device, non_blocking=True)``; ``get_chunk_cat_metadata``). On CPU the ops are the
# composite ``split_with_sizes_copy_out`` and ``_chunk_cat_out`` (views of the inputs, ``cat_out``
# into the reduce-scatter input): nothing allocated where dim 0 divides by dp (a dispatch-level
# record of the trainer's ZeRO-3 step on CPU: only the all-gather outputs, the unsharded
# parameters and the reduce-scatter buffers under ``_fully_shard``; docs/cost-model.md).
COPY_OUT, COPY_IN = "copy_out_meta", "copy_in_meta"


class _Group:
    def __init__(self, names: list[str], reshard_after_forward: bool) -> None:
        self.names = names
        self.tag = "fsdp." + names[0].rsplit(".", 2)[0]  # fsdp.layers.5, fsdp.tok_embeddings, fsdp.norm
        self.reshard_after_forward = reshard_after_forward
        self.unsharded: dict[str, Tensor] = {}
        self.gathered: Tensor | None = None  # its all-gather output, prefetched or in flight
        self.sharded_grad: Tensor | None = None


class Fsdp:
    """The groups of one rank; drives unshard / reshard / reduce-scatter."""

    metadata = True  # the copy-out's and copy-in's small metadata tensors (CUDA's; hf_fsdp.py: not on CPU)
    frozen: frozenset[str] = frozenset()  # parameters without gradients (hf_fsdp.py: a PEFT model's base)

    def __init__(
        self,
        tape: Tape,
        d: Dims,
        dp: int,
        shapes: dict,
        model: Model,
        grads: dict,
        reshard: bool = True,
        offload: bool = False,
        first: bool = True,
        last: bool = True,
        tied: bool = False,
    ) -> None:
        self.tape, self.d, self.dp, self.shapes, self.model, self.grads = tape, d, dp, shapes, model, grads
        self.offload = offload  # CPUOffloadPolicy: shards, gradients and the optimizer on the host
        self.ag, self.rs = Stream.ALL_GATHER, Stream.REDUCE_SCATTER  # the root's streams (``on_root``)
        self.mixed = d.pd == 4 and d.cd == 2  # MixedPrecisionPolicy(param bf16, reduce fp32)
        self.rd = d.pd  # reduce dtype: fp32 under the mixed policy, else the parameters' own
        layers = [[f"layers.{i}.{name}" for name in layer_param_names(d)] for i in range(d.layers)]
        self.first, self.last = first, last  # a pipeline chunk holds the embedding or the head (pipeline.py)
        # a tied model: the root group holds the embedding (the head's matrix too) and the final norm
        self.tied = tied and first and last
        root = ["tok_embeddings.weight", "norm.weight"] if self.tied else ["tok_embeddings.weight"]
        self.groups = [_Group(root, False if self.tied else reshard)] if first else []
        self.groups += [_Group(names, reshard) for names in layers]
        if last and not self.tied:
            self.groups.append(_Group(["norm.weight", "output.weight"], False))
        self.sync = True  # under pipelining off for every micro-batch's backward (``keep_unsharded``)
        self.accumulated: dict[str, Tensor] = {}  # ``unsharded_accumulated_grad`` (reduce dtype)
        self.leaves = {name: ops.leaf(grads, name) for name in shapes}
        self.kept: Tensor | None = None  # forward: the last group's all-gather output
        self.reduce_input: Tensor | None = None
        self.reduced: set[int] = set()  # the groups reduce-scattered in this backward
        self._build()

    # --- sizes ---------------------------------------------------------------------------------------
    def on_root(self, root: int) -> None:
        """This ``fully_shard`` root is the rank's ``root``-th: its collectives run on streams of
        its own (``events.root_stream``)."""
        self.ag, self.rs = root_stream(Stream.ALL_GATHER, root), root_stream(Stream.REDUCE_SCATTER, root)

    def shard(self, name: str) -> int:
        """Elements of one rank's shard: dim 0 padded to a multiple of dp."""
        rows, cols = self.shapes[name]
        return -(-rows // self.dp) * cols

    def shard_numels(self) -> list[tuple[str, int]]:
        """What the optimizer steps on the device: nothing when the shards live on the host."""
        return [] if self.offload else [(name, self.shard(name)) for name in self.shapes]

    def _build(self) -> None:
        """Process group init (a 4-byte tensor), then ``to_empty`` of the shards in module order
        (both on the host under offload)."""
        t = self.tape
        if self.offload:
            return
        t.done(t.new(1, 4, "process_group_init"))
        for name in self.shapes:
            t.managed(self.shard(name), self.d.pd, name, Category.PARAMETERS)

    def _kind(self, g: int) -> int:
        return 1 if self.first and g == 0 else 2 if self.last and g == len(self.groups) - 1 else 0

    # --- unshard / reshard ----------------------------------------------------------------------------
    def all_gather(self, g: int) -> None:
        """The group's all-gather on its stream: the bf16 copy of the fp32 shard under the
        mixed policy (the input), then the output."""
        group, t = self.groups[g], self.tape
        numel = sum(self.shard(n) for n in group.names)
        if self.offload:
            self._all_gather_from_host(group, numel)
            return
        with t.scoped(group.tag):
            cast = t.new(numel, 2, "all_gather_input", Category.COMM, self.ag) if self.mixed else None
            group.gathered = t.managed(numel * self.dp, self.d.cd, "all_gather_output", Category.COMM, self.ag)
            t.drop(cast)

    def _all_gather_from_host(self, group: _Group, numel: int) -> None:
        """Offload: each shard copied to the device (and cast to bf16 under the mixed policy,
        the copy freed), the output, then the inputs freed last to first."""
        t, ag, pd = self.tape, self.ag, self.d.pd
        inputs = []
        with t.scoped(group.tag):
            for name in group.names:
                copy = t.new(self.shard(name), pd, f"{name}.h2d", Category.COMM, ag)
                if self.mixed:
                    inputs.append(t.new(self.shard(name), 2, f"{name}.all_gather_input", Category.COMM, ag))
                    t.drop(copy)
                else:
                    inputs.append(copy)
            group.gathered = t.managed(numel * self.dp, self.d.cd, "all_gather_output", Category.COMM, ag)
            t.done(*reversed(inputs))

    def unsharded_itemsize(self, name: str) -> int:
        """An unsharded parameter's dtype: the compute dtype (the all-gather's)."""
        return self.d.cd

    def unshard(self, g: int, forward: bool) -> None:
        """Wait for the group's all-gather, copy out its parameters (bf16, compute stream)."""
        group, t = self.groups[g], self.tape
        if group.unsharded:
            return
        if group.gathered is None:
            self.all_gather(g)
        with t.scoped(""):
            for name in group.names:
                # a view of its own padded all-gather output (``FSDPParam.init_all_gather_outputs``:
                # the padded shard's numel x world size), rows x cols of it (dim 0 padded to dp)
                size = self.unsharded_itemsize(name)
                p = t.managed(self.shard(name) * self.dp, size, f"{name}.unsharded", Category.GATHERED)
                p.st.gathered = True
                rows, cols = self.shapes[name]
                p.numel = rows * cols
                p.fn = self.leaves.get(name)
                group.unsharded[name] = self.model.weights[name] = p
                if self.tied and name == "tok_embeddings.weight":
                    self.model.weights["output.weight"] = p
            if self.metadata:
                t.done(t.new(COPY_OUT_META[self._kind(g)], 1, f"{group.tag}.{COPY_OUT}"))
        if forward:
            if self.kept is not None:
                t.free(self.kept)
            self.kept = group.gathered
        else:
            t.free(group.gathered)
        group.gathered = None

    def reshard(self, g: int) -> None:
        group = self.groups[g]
        for p in group.unsharded.values():
            self.tape.free(p)
        group.unsharded = {}

    def pre_forward(self, g: int, x: Tensor | None = None) -> Tensor | None:
        """Unshard; wrap the group's input in the post-backward hook (``RegisterPostBackwardFunction``).
        A tied model's head is the root's: unsharded since the root's pre-forward, its input the
        root's (the ids: no post-backward hook there)."""
        if self.tied and g == len(self.groups):
            return self.tape.alias(x) if x is not None else None
        self.unshard(g, forward=True)
        if x is None:
            return None

        def apply(tape: Tape, node: Node, grads: list[Tensor], saved: list) -> list:
            self.post_backward(g)
            return [tape.hold(grads[0])]

        out = self.tape.alias(x)
        out.fn = self.tape.node("fsdp.post_backward", apply, [x])
        return out

    def post_forward(self, g: int, out: Tensor) -> None:
        """Reshard (unless the group keeps its parameters); the pre-backward hook on the output.
        A tied model's root runs its post-forward after the head: its hook goes on the logits."""
        if self.tied and g in (0, len(self.groups)):
            if g == 0:
                return
            g = 0
        if self.groups[g].reshard_after_forward:
            self.reshard(g)
        if out.fn is not None:
            out.fn.pre = lambda: self.pre_backward(g)

    def end_forward(self) -> None:
        """The root's post-forward lets go of the last all-gather output."""
        if self.kept is not None:
            self.tape.free(self.kept)
            self.kept = None

    # --- backward -------------------------------------------------------------------------------------
    def pre_backward(self, g: int) -> None:
        """Unshard (its all-gather was prefetched), then prefetch the next group's unless it
        kept its parameters (``reshard_after_forward=False``: ``unshard`` is a no-op)."""
        self.unshard(g, forward=False)
        prior = len(self.groups) - 1 if self.tied and g == 0 else g - 1  # the post-forward order, backwards
        if prior >= 0 and not self.groups[prior].unsharded:
            self.all_gather(prior)

    def post_backward(self, g: int) -> None:
        """Reshard, then reduce-scatter the unsharded gradients into the sharded one."""
        group, t = self.groups[g], self.tape
        if not self.sync:
            self._keep_unsharded(group)
            self.reduced.add(g)
            return
        for name in reversed(group.names):  # the list of them goes last first (``foreach_reduce``)
            if name in self.accumulated:
                self.grads[name] = self.accumulated.pop(name)
        if self.d.tp > 1 and self.d.sp:
            self._replicate_norm_grads(group)
            self._shard_vocab_grad(group)
        self.reshard(g)
        names = [n for n in group.names if n not in self.frozen]
        if not names:  # nothing to reduce: FSDPParamGroup.post_backward returns after resharding
            self.reduced.add(g)
            return
        if self.reduce_input is not None:
            t.free(self.reduce_input)
        numel = sum(self.shard(n) for n in names)
        with t.scoped(group.tag):
            self.reduce_input = t.managed(numel * self.dp, self.rd, "reduce_scatter_input", Category.COMM)
            if self.metadata:
                t.done(t.new(COPY_IN_META[self._kind(g)] * self.rd // 2, 1, COPY_IN))
            last = names[-1]
            for name in [n for n in self.grads if n in names and n != last]:  # in the order produced
                t.drop(self.grads.pop(name))
            rs = self.rs
            out = t.managed(numel, self.rd, "reduce_scatter_output", Category.GRADIENTS, rs)
            out = self._to_orig_dtype(out)
            t.drop(self.grads.pop(last, None))
            if self.offload:  # copied to the host (added there under accumulation): the device copy goes
                t.free(out)
            elif group.sharded_grad is None:
                group.sharded_grad = out
            else:  # a later micro-batch: ``sharded_param.grad._local_tensor += new_sharded_grad``
                t.free(out)
        self.reduced.add(g)

    def _to_orig_dtype(self, out: Tensor) -> Tensor:
        """The reduce-scatter output as the sharded gradient: in the reduce dtype here (the bundled
        trainer's policy reduces in the parameters' dtype; ``hf_fsdp.py`` casts)."""
        return out

    def _keep_unsharded(self, group: _Group) -> None:
        """``post_backward`` without gradient sync or resharding (pipelining, ``StageReplay``):
        ``accumulate_unsharded_grad_if_needed`` (a later micro-batch's gradient added in place
        into the accumulated one and freed), then ``to_accumulated_grad_if_needed``: under the
        mixed policy each new bf16 gradient becomes an fp32 copy, the bf16 one freed
        (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)."""
        t = self.tape
        for name in group.names:
            if name in self.accumulated and name in self.grads:
                t.drop(self.grads.pop(name))
        if not self.mixed:
            return
        for name in group.names:
            if name in self.grads:
                grad = self.grads.pop(name)
                with t.scoped(""):
                    self.accumulated[name] = t.new(grad.numel, self.rd, f"{name}.accumulated_grad", Category.GRADIENTS)
                t.drop(grad)

    def reduce_all(self) -> None:
        """``StageReplay``'s ``_reduce_grads`` after the last micro-batch: every group's
        ``post_backward`` with sync and resharding on, in ``all_states`` order (module order),
        then the root's final callback."""
        self.sync = True
        for g in range(len(self.groups)):
            self.post_backward(g)
        self.reduced = set()
        if self.reduce_input is not None:
            self.tape.free(self.reduce_input)
            self.reduce_input = None

    def _replicate_norm_grads(self, group: _Group) -> None:
        """Sequence-parallel norm weights get Partial gradients: redistributed to Replicate
        (an all-reduce into a new tensor) before the reduce-scatter."""
        t = self.tape
        for name in group.names:
            if name.endswith("norm.weight") and name in self.grads:
                old = self.grads[name]
                with t.scoped(""):
                    self.grads[name] = t.new(old.numel, old.itemsize, f"{name}.grad", Category.GRADIENTS)
                t.drop(old)

    def _shard_vocab_grad(self, group: _Group) -> None:
        """The vocabulary-parallel embedding's ``Replicate`` gradient (``ops.embedding``) taken
        to the weight's ``Shard(0)`` (``FSDPParam._get_grad_inner_tensor``: a copy of this
        rank's rows), then ``unsharded_param.grad = None`` frees the whole one."""
        t, name = self.tape, "tok_embeddings.weight"
        if name in group.names and name in self.grads:
            rows, cols = self.shapes[name]
            old = self.grads[name]
            with t.scoped(""):
                self.grads[name] = t.new(rows * cols, old.itemsize, f"{name}.grad_shard", Category.GRADIENTS)
            t.drop(old)

    def finish_backward(self) -> None:
        """The root's final callback: post-backward of the groups whose inputs need no
        gradient (the embedding), then the last reduce-scatter input goes."""
        if self.first and 0 not in self.reduced:
            self.post_backward(0)
        self.reduced = set()
        if self.reduce_input is not None:
            self.tape.free(self.reduce_input)
            self.reduce_input = None

    def zero_grad(self) -> None:
        """Each parameter's sharded gradient is a view of its group's reduce-scatter output."""
        for group in self.groups:
            if group.sharded_grad is not None:
                self.tape.free(group.sharded_grad)
                group.sharded_grad = None
