"""FSDP2 as ``transformers.Trainer`` applies it through accelerate (``fsdp=True``, ``fsdp_config={"version": 2}``),
on one rank: full fine-tuning in fp32, of a bf16 model without ``bf16=True``, or under ``bf16=True``
(transformers 5.23, accelerate 1.15, torch 2.13; file:line below are of those installed versions).

The Trainer turns ``fsdp_config`` into accelerate's ``FullyShardedDataParallelPlugin``
(``TrainingArguments._process_fsdp_args``, transformers/training_args.py:2775-2885: version 2 by
default; ``reshard_after_forward`` True unless set, the legacy ``fsdp="shard_grad_op"`` False,
``"full_shard"`` True, training_args.py:2914-2925; the transformer auto-wrap policy over the model's
``_no_split_modules``; ``cpu_ram_efficient_loading`` off unless set, 2847-2850). Under FSDP the Trainer
leaves the model where it was loaded (``place_model_on_device`` False, trainer.py:480-494) and creates
the optimizer before ``accelerator.prepare(model, optimizer)`` (trainer.py:1717-1722, 1765).
accelerate's ``_prepare_fsdp2`` (accelerate/accelerator.py:1674-1767) then replaces each optimizer
parameter by ``torch.empty(1, dtype=p.dtype)`` (1718-1727; kept until the optimizer is pointed at the
sharded parameters), and ``fsdp2_prepare_model`` (accelerate/utils/fsdp_utils.py:751-917) upcasts the
trained parameters to fp32 when mixed precision is on (815-825: ``param.data = param.data.to(float32)``),
holds ``model.state_dict()`` (828) while it calls ``fully_shard`` on each decoder layer (850-855,
bottom-up: layer 0 first), on the input embedding (865-866), on ``[final norm, lm_head]`` with
``reshard_after_forward=False`` (868-879; a tied model: ``[final norm, embedding, lm_head]``, the
embedding not on its own), then on the model (881-885: the root, no parameters of its own left). Each
``fully_shard`` allocates its parameters' padded shards (``FSDPParam._init_sharded_param``: ``new_zeros``
of dim 0 padded to a multiple of dp); the full parameters go when ``prepare`` returns. So the build holds
the whole model and its shards at once (with ``cpu_ram_efficient_loading`` the model goes to the meta
device first, but the state dict still holds the device copies: the same peak, measured on CPU). That is
the build of a model loaded onto the GPU (``model_build: from_pretrained``); one loaded on the CPU, the
default for these plans, is ``hf_fsdp_load.py``'s.

From there the groups run as the bundled trainer's (``fsdp.Fsdp``: the same groups, all-gather,
copy-out, reshard, reduce-scatter). Without mixed precision the policy is ``MixedPrecisionPolicy()``
(no cast copies, everything in the parameters' dtype). Under ``bf16=True`` accelerate does not autocast
an FSDP2 model (``prepare_model``, where its autocast wrapper lives, is not called on that path) but
sets ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)``
(``FullyShardedDataParallelPlugin.set_mixed_precision``, accelerate/utils/dataclasses.py:2109-2143):
each all-gather casts the fp32 shards to bf16 (``fsdp.Fsdp``'s mixed path), the model computes in bf16
as a bf16 model does (its buffers stay fp32: Gemma's ``embed_scale`` is cast to the weight's dtype,
``hf_gemma.py``), the unsharded gradients are bf16 and accumulate so (``to_accumulated_grad_if_needed``
returns when the gradient's dtype is the reduce dtype, torch/distributed/fsdp/_fully_shard/_fsdp_param.py:802-810),
the bf16 reduce-scatter output is cast whole to fp32 before the last unsharded gradient goes
(``foreach_reduce``: ``_to_dtype_if_needed(reduce_output, orig_dtype)``, _fsdp_collectives.py:696); the
root's ``cast_forward_inputs`` casts the ``num_items_in_batch`` kwarg to bf16 (kept by the loss's
division for its backward) and its ``output_dtype`` casts the fp32 loss to bf16 (_fsdp_state.py:312-344).
Around the groups, the Trainer's step:

- ``clip_grad_norm_``: accelerate's ``_clip_grad_norm_dtensor_aware`` (accelerator.py:2957-2987) hands
  one mesh's gradients to ``torch.nn.utils.clip_grad_norm_`` over the DTensor gradients: the same
  scalars per parameter as on one rank;
- fused AdamW over the DTensor parameters: its states are shard-sized (``zeros_like`` of the local
  shard, fp32 under the mixed policy); ``zero_grad`` frees each group's sharded gradients (views of its
  reduce-scatter output);
- ``num_items_in_batch`` gathered over the ranks as under DDP (``hf_ddp.HfDdp.gather_count``);
- gradient accumulation: every micro-batch but the last under ``accelerator.no_sync``, which on an
  FSDP2 model is ``set_requires_gradient_sync(False)`` (accelerator.py:1166-1171): each group reshards
  after its backward but keeps its unsharded gradients (``FSDPParamGroup.post_backward`` returns before
  the reduce-scatter, _fsdp_param_group.py:607-612), the next micro-batch's added into them; the last
  micro-batch reduce-scatters;
- PEFT LoRA over an fp32 base (the Trainer creates the optimizer first under FSDP2, so accelerate's
  ``update_fsdp_plugin_peft`` is not called, trainer.py:1751-1754): the frozen base is sharded and
  gathered like the rest, only the adapters reduce-scatter (``FSDPParamGroup.post_backward`` reshards
  and returns for a group without gradients); ``_find_final_norm`` (fsdp_utils.py:733-748) scans the
  ``PeftModel``'s own children, finds no norm, so the final norm stays with the root's group (gathered
  at the model's forward, ``reshard_after_forward=None`` keeps it to the final callback) and the tail is
  ``[lm_head]``; a frozen embedding's all-gather, prefetched by layer 0's pre-backward and never used,
  goes at ``finalize_backward``; layer 0's input, the frozen embedding's output, needs no gradient, so
  FSDP2 registers no post-backward hook on it and layer 0 reshards and reduce-scatters in the root's final
  callback (:meth:`HfFsdp.finish_backward`).

Checked against the real Trainer on CPU, rank 0 of two or four under the fake process group
(tests/unit/test_timeline_hf_fsdp.py). The copy-out's and copy-in's metadata tensors
(``fsdp.COPY_OUT_META``, from the GPU traces) are CUDA's: not on CPU. On CPU each group's ``DeviceMesh``
(``fully_shard`` without a mesh builds the default one: ``torch.arange(world, dtype=torch.int)``,
torch/distributed/device_mesh.py:1582) is counted, as the host's, with its rank's coordinate
(``(mesh == rank).nonzero()``, freed once read) and the root's, made and dropped after the last shard
(``HfFsdp._mesh``); on a GPU they are host memory.
"""

from __future__ import annotations

import dataclasses

from memplan.costmodel.timeline import hf_fsdp_load, ops
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Category, Stream
from memplan.costmodel.timeline.fsdp import Fsdp, _Group
from memplan.costmodel.timeline.hf_ddp import HfDdp
from memplan.costmodel.timeline.hf_fsdp_moe import expert_split
from memplan.costmodel.timeline.trainer_model import Dims


class HfFsdp(Fsdp):
    """accelerate's FSDP2 groups over the Trainer's model (HF parameter names), and its build."""

    gather_count = HfDdp.gather_count  # get_batch_samples' accelerator.gather, as under DDP

    def __init__(
        self,
        tape: Tape,
        d: Dims,
        dp: int,
        shapes: dict[str, tuple[int, int]],
        model,  # noqa: ANN001 - an hf_model.HfLlama
        grads: dict,
        reshard: bool,
        tied: bool,
        cuda: bool,
        mixed: bool = False,
        frozen: frozenset[str] = frozenset(),
        host: bool = False,
    ) -> None:
        """``d``: the model as loaded (its parameters' dtype ``d.pd``); ``mixed``: ``bf16=True``
        (accelerate's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` over fp32 master
        shards: the trained parameters upcast first); ``frozen``: a PEFT model's base parameters (sharded
        and gathered, never reduced); ``host``: the model loaded on the CPU and sharded through
        ``cpu_ram_efficient_loading`` (``hf_fsdp_load.py``)."""
        self.loaded, self.host = d.pd, host
        if mixed:
            d = dataclasses.replace(d, pd=4, cd=2)
        self.tape, self.d, self.dp, self.shapes, self.model, self.grads = tape, d, dp, shapes, model, grads
        self.cuda, self.metadata = cuda, cuda
        self.offload = False
        self.ag, self.rs = Stream.ALL_GATHER, Stream.REDUCE_SCATTER  # one root: ``Fsdp``'s own streams
        self.mixed = mixed
        self.rd = 2 if mixed else d.pd
        self.first = self.last = True
        self.tied = tied
        peft = bool(frozen)  # a PeftModel: accelerate's _find_final_norm finds no norm, the root keeps it
        self.groups = _groups(shapes, d.layers, reshard, tied, peft)
        self.root = _Group(["model.norm.weight"], False) if peft else None
        self.sync = True
        self.accumulated: dict[str, Tensor] = {}
        self.frozen = frozen
        self.leaves = {name: ops.leaf(grads, name) for name in shapes if name not in frozen}
        self.kept: Tensor | None = None
        self.reduce_input: Tensor | None = None
        self.reduced: set[int] = set()

    def split(self, name: str) -> tuple[int, int]:
        """(dim 0, elements under each dim-0 index) of a parameter as ``FSDPParam`` chunks it: a MoE
        layer's 3-D experts, ``gate_up_proj`` (E, 2f, h) and ``down_proj`` (E, h, f), on their E experts
        (``hf_fsdp_moe.expert_split``), every other parameter on its rows."""
        return expert_split(name, self.shapes[name], self.model.extra)

    def shard(self, name: str) -> int:
        """Elements of rank 0's shard: dim 0 padded to a multiple of dp (``torch.chunk`` of the padded
        parameter, ``FSDPParam._init_sharded_param``)."""
        rows, cols = self.split(name)
        return -(-rows // self.dp) * cols

    def shard_numels(self) -> dict[str, tuple[int, int]]:
        """(elements, itemsize) of each parameter's local shard: what the optimizer steps."""
        return {name: (self.shard(name), self.itemsize(name)) for name in self.shapes if name not in self.frozen}

    def itemsize(self, name: str) -> int:
        """A parameter's shard dtype: a frozen base's as loaded, a trained one's (fp32 under the mixed
        policy; ``hf_fsdp_peft.HfFsdpPeft``: PEFT's fp32 adapters)."""
        return self.loaded if name in self.frozen else self.d.pd

    def build(self, weights: dict[str, Tensor], optimizer_order: list[str]) -> None:
        """``_prepare_fsdp2``: the optimizer's one-element placeholders (in its parameter groups'
        order), the shards in ``fully_shard`` order (layers, then the embedding, then the tail: the
        groups bottom-up), then the full parameters go, then the placeholders. A model loaded on the
        CPU (``host``): ``hf_fsdp_load.load`` between the same placeholders."""
        t = self.tape
        holders = self.prepare_params(weights, optimizer_order)
        if self.host:
            hf_fsdp_load.load(self, weights)
        else:
            for group in self.shard_order():
                if not self.cuda:  # the group's DeviceMesh: its ranks, an int32 arange(dp) on the host
                    self._mesh(t.managed, group.tag)
                for name in group.names:
                    t.managed(self.shard(name), self.itemsize(name), f"{name}.shard", Category.PARAMETERS)
            if not self.cuda and self.root is None:  # fully_shard(model) last: the root's mesh, no shard of its own
                t.done(self._mesh(t.new, "root"))
            for name in self.shapes:
                t.free(weights.pop(name))
        t.done(*holders)

    def _mesh(self, make, tag: str) -> Tensor:  # noqa: ANN001 - the tape's ``managed`` or ``new``
        """A ``DeviceMesh`` on the host (CPU runs only): the int32 ``arange(dp)``, then this rank's coordinate,
        ``(mesh == rank).nonzero()`` (dp bools, then one int64 index), freed once read. Under SGD, which has no
        state, the root's (the last ``fully_shard``, after every shard) is the run's peak (+18 B at dp 2)."""
        t = self.tape
        mesh = make(self.dp, 4, f"{tag}.device_mesh", Category.COMM)
        eq = t.new(self.dp, 1, f"{tag}.device_mesh.eq", Category.COMM)
        coordinate = t.new(1, 8, f"{tag}.device_mesh.nonzero", Category.COMM)
        t.done(eq)
        t.done(coordinate)
        return mesh

    def prepare_params(self, weights: dict[str, Tensor], optimizer_order: list[str]) -> list[Tensor]:
        """The optimizer's placeholders (``torch.empty(1, dtype=p.dtype, device=p.device)``,
        accelerator.py:1718-1727) and ``fsdp2_prepare_model``'s upcast of the trained parameters under
        mixed precision (fsdp_utils.py:815-825), both where the model is: none on the GPU for a model
        loaded on the CPU (``host``); the placeholders."""
        t = self.tape
        if self.host and self.cuda:
            return []
        with t.scoped("accelerate.prepare"):
            holders = [t.new(1, self.loaded, f"{name}.optimizer_placeholder") for name in optimizer_order]
            if self.loaded != self.d.pd:  # fsdp2_prepare_model's upcast: param.data = param.data.to(float32)
                for name, (rows, cols) in self.shapes.items():
                    if name in self.frozen:  # only what requires grad
                        continue
                    old, weights[name] = (
                        weights[name],
                        t.managed(rows * cols, self.d.pd, f"{name}.fp32", Category.PARAMETERS),
                    )
                    t.free(old)
        return holders

    def shard_order(self) -> list[_Group]:
        """The groups in ``fully_shard`` order: the layers bottom-up, the embedding, the tail (a tied
        model's tail first), a PEFT model's root last."""
        order = self.groups[1:-1] + [self.groups[0], self.groups[-1]] if not self.tied else self.groups
        return order + ([self.root] if self.root else [])

    def cast_inputs(self, num_items: Tensor) -> Tensor:
        """The root's pre-forward under the mixed policy (``cast_forward_inputs``): the floating
        ``num_items_in_batch`` kwarg cast to bf16 (``_cast_fp_tensor``), the model's divisor; else
        the count itself."""
        if not self.mixed:
            return self.tape.alias(num_items)
        with self.tape.scoped("fsdp"):
            return self.tape.new(1, 2, "num_items_in_batch.cast")

    def end_root_forward(self, loss: Tensor) -> Tensor:
        """The root's post-forward: under the mixed policy ``output_dtype=bf16`` casts the model's
        floating outputs (the fp32 loss to bf16; the logits are bf16 already), then the last
        all-gather output goes; the fp32 loss goes as the output holds its cast."""
        t = self.tape
        if not self.mixed:
            self.end_forward()
            return loss
        with t.scoped("fsdp"):
            cast = ops.to(t, loss, 2, "output_dtype_cast", Category.LOGITS)
        self.end_forward()
        t.done(loss)
        return cast

    def _to_orig_dtype(self, out: Tensor) -> Tensor:
        """``foreach_reduce``: a bf16 reduce-scatter output cast whole to the fp32 of the master
        shards (``_to_dtype_if_needed(reduce_output, orig_dtype)``), the bf16 one let go."""
        if self.rd == self.d.pd:
            return out
        with self.tape.scoped(""):
            cast = self.tape.managed(out.numel, self.d.pd, "reduce_scatter_output.fp32", Category.GRADIENTS)
        self.tape.free(out)
        return cast

    def finish_backward(self) -> None:
        """The root's final callback (``_root_post_backward_final_callback``, _fsdp_state.py:395-431), state by
        state in ``all_states`` (module) order: the root's own group first (a PEFT model's norm, frozen:
        resharded only), then each group, whose ``post_backward`` runs here when its hook did not (its forward
        inputs needed no gradient: the embedding's ids and, over a frozen embedding, layer 0's hidden states,
        so layer 0 reshards and reduce-scatters its adapters here), then its ``finalize_backward`` lets go
        of an all-gather prefetched for a backward that never ran (a frozen embedding's); then the last
        reduce-scatter input goes (``fsdp.Fsdp.finish_backward``, every group reduced by then)."""
        if self.root is not None:
            for p in self.root.unsharded.values():
                self.tape.free(p)
            self.root.unsharded = {}
        for g in range(len(self.groups)):
            if g not in self.reduced:
                self.post_backward(g)
            finalize_backward(self, g)
        super().finish_backward()

    def pre_forward(self, g: int, x: Tensor | None = None) -> Tensor | None:
        """``fsdp.Fsdp.pre_forward``; a PEFT model's root group unshards first, at the model's forward
        (``reshard_after_forward=None``: the root keeps it to the end of the backward)."""
        if g == 0 and self.root is not None and not self.root.unsharded:
            self.groups.append(self.root)
            try:
                self.unshard(len(self.groups) - 1, forward=True)
            finally:
                self.groups.pop()
        return super().pre_forward(g, x)

    def post_backward(self, g: int) -> None:
        """Under ``set_requires_gradient_sync(False)``: reshard, keep the unsharded gradients
        (``FSDPParamGroup.post_backward`` returns before the reduce-scatter)."""
        if self.sync:
            super().post_backward(g)
            return
        self.reshard(g)
        self.reduced.add(g)


def finalize_backward(fsdp: HfFsdp, g: int) -> None:
    """``FSDPParamGroup.finalize_backward`` (_fsdp_param_group.py:763-782): an all-gather prefetched for a
    group whose backward never ran (a frozen embedding's) is let go."""
    group = fsdp.groups[g]
    if group.gathered is not None:
        fsdp.tape.free(group.gathered)
        group.gathered = None


def _groups(shapes: dict[str, tuple[int, int]], layers: int, reshard: bool, tied: bool, peft: bool) -> list[_Group]:
    """The groups in forward order: the embedding (alone unless tied), each decoder layer, the tail
    ``[model.norm, lm_head]`` (``reshard_after_forward=False``). A tied model's tail holds the norm and
    the embedding and runs first (its pre-forward at the embedding): ``Fsdp``'s tied root group. Under
    ``peft`` the norm is the root's (``_find_final_norm`` scans ``PeftModel``'s own children)."""
    per_layer = [[n for n in shapes if n.startswith(f"model.layers.{i}.")] for i in range(layers)]
    layer_groups = [_Group(names, reshard) for names in per_layer]
    norm = [] if peft else ["model.norm.weight"]
    if tied:
        return [_Group([*norm, "model.embed_tokens.weight"], False), *layer_groups]
    tail = _Group([*norm, "lm_head.weight"], False)
    return [_Group(["model.embed_tokens.weight"], reshard), *layer_groups, tail]


def peft_shapes(shapes: dict[str, tuple[int, int]], lora) -> dict[str, tuple[int, int]]:  # noqa: ANN001 - an HfLora
    """The base's parameters with each targeted linear's ``lora_A`` (r x in) and ``lora_B`` (out x r)
    after its weight, as ``LoraLayer`` registers them after ``base_layer``, and DoRA's ``lora_magnitude_vector``
    (out, fp32: a vector sharded on its one dim) after ``lora_B``; over an MoE block's 3-D experts
    PEFT's ``ParamWrapper`` adapters (``hf_moe_lora.py``: over (E, n, k), ``lora_A`` (r E x k) and ``lora_B``
    (n x r E), 2-D parameters chunked on their own dim 0) after both experts' parameters, the innermost
    wrapper's first (``named_parameters()``: ``experts.base_layer.base_layer.down_proj``, then
    ``experts.base_layer.lora_A``), and the router's under ``all-linear`` after its weight."""
    out: dict[str, tuple[int, int]] = {}
    r, wrapped = lora.cfg.rank, dict(lora.cfg.experts)
    for name, (rows, cols) in shapes.items():
        out[name] = (rows, cols)
        module = name.removesuffix(".weight")
        if wrapped and module.endswith(".mlp.experts.down_proj"):  # the experts' last parameter
            experts = module.removesuffix(".down_proj")
            for param, rank in reversed(lora.cfg.experts):
                e, (n, k) = lora.cfg.num_experts, shapes[f"{experts}.{param}.weight"]
                out[f"{experts}.{param}.lora_A.weight"] = (rank * e, k)
                out[f"{experts}.{param}.lora_B.weight"] = (n // e, rank * e)
        elif name.endswith(".weight") and (lora.targeted(module) or (lora.cfg.router and module.endswith(".mlp.gate"))):
            out[f"{module}.lora_A.weight"] = (r, cols)
            out[f"{module}.lora_B.weight"] = (rows, r)
            if lora.cfg.dora:  # DoRA's magnitude (``lora_magnitude_vector``, registered after lora_B): a vector
                out[f"{module}.lora_magnitude_vector.weight"] = (rows, 1)
    return out
