"""PEFT LoRA under the Trainer's FSDP2 (``hf_fsdp.HfFsdp``) where a group's parameters differ in dtype.

``get_peft_model`` makes the adapters fp32 whatever the base (``autocast_adapter_dtype=True``), so over a
bf16 model a decoder layer's ``fully_shard`` group holds bf16 frozen weights beside fp32 trainable
adapters. accelerate's ``fsdp2_prepare_model`` upcasts only parameters that require grad under a mixed
policy (fsdp_utils.py:815-825: the adapters, fp32 already, stay as they are: no copy), and its optimizer
placeholders take each trained parameter's dtype (accelerator.py:1718-1727: fp32). FSDP2 then
(torch/distributed/fsdp/_fully_shard, measured on CPU by tests/unit/test_timeline_hf_fsdp.py):

- each parameter's shard keeps its own dtype (``FSDPParam._init_sharded_param``);
- under ``bf16=True`` (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``) a parameter is cast
  for the all-gather only where its dtype differs (``FSDPParam.init_dtype_attrs``: ``param_dtype`` is None
  when equal to the original): the group's ``all_gather_input`` holds the adapters' bf16 copies alone (over
  an fp32 base, every shard as before), the output and the unsharded parameters are bf16, so PEFT's
  ``_cast_input_dtype`` finds bf16 adapters and the adapters run in bf16 on the bf16 input
  (``hf_lora.HfLora.read_bytes``); the bf16 reduce-scatter output is cast to the adapters' fp32;
- without a policy (a bf16 model, ``bf16`` off) the group's dtypes differ, so ``foreach_all_gather``
  gathers bytes (``_get_all_gather_input_metadatas`` returns ``torch.uint8``: the output is the shards'
  bytes times the ranks, no input copy), each unsharded parameter is a copy in its own dtype (the
  adapters fp32: PEFT casts the bf16 input to fp32 as on one rank), and the adapters' gradients
  reduce-scatter in their fp32.
"""

from __future__ import annotations

from memplan.costmodel.lora import ADAPTER_BYTES
from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.fsdp import COPY_OUT, COPY_OUT_META
from memplan.costmodel.timeline.hf_fsdp import HfFsdp


class HfFsdpPeft(HfFsdp):
    """``HfFsdp`` over a ``PeftModel``: the frozen base in its loaded dtype, the adapters in fp32."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - HfFsdp's
        super().__init__(*args, **kwargs)
        self.rd = 2 if self.mixed else ADAPTER_BYTES  # the reduce dtype: the policy's, else the adapters'

    def itemsize(self, name: str) -> int:
        """The frozen base as loaded; an adapter fp32."""
        return self.loaded if name in self.frozen else ADAPTER_BYTES

    def prepare_params(self, weights: dict[str, Tensor], optimizer_order: list[str]) -> list[Tensor]:
        """The optimizer's placeholders in the adapters' fp32; no upcast (they are fp32 already)."""
        if self.host and self.cuda:
            return []
        with self.tape.scoped("accelerate.prepare"):
            return [self.tape.new(1, self.itemsize(n), f"{n}.optimizer_placeholder") for n in optimizer_order]

    def all_gather(self, g: int) -> None:
        """Under the mixed policy the bf16 copies of the shards not bf16 already, then a bf16 output;
        without it the shards' bytes (one dtype: ``fsdp.Fsdp``'s)."""
        group, t = self.groups[g], self.tape
        sizes = {n: self.itemsize(n) for n in group.names}
        if not self.mixed and len(set(sizes.values())) == 1:
            super().all_gather(g)
            return
        with t.scoped(group.tag):
            if self.mixed:
                cast = sum(self.shard(n) for n in group.names if sizes[n] != self.d.cd)
                copy = t.new(cast, self.d.cd, "all_gather_input", Category.COMM, self.ag) if cast else None
                numel = sum(self.shard(n) for n in group.names)
                group.gathered = t.managed(numel * self.dp, self.d.cd, "all_gather_output", Category.COMM, self.ag)
                t.drop(copy)
                return
            nbytes = sum(self.shard(n) * sizes[n] for n in group.names)
            group.gathered = t.managed(nbytes * self.dp, 1, "all_gather_output", Category.COMM, self.ag)

    def unshard(self, g: int, forward: bool) -> None:
        """``fsdp.Fsdp.unshard`` with each unsharded parameter in its own all-gather dtype: the
        policy's bf16, else the parameter's."""
        group, t = self.groups[g], self.tape
        if group.unsharded:
            return
        if group.gathered is None:
            self.all_gather(g)
        with t.scoped(""):
            for name in group.names:
                itemsize = self.d.cd if self.mixed else self.itemsize(name)
                p = t.managed(self.shard(name) * self.dp, itemsize, f"{name}.unsharded", Category.GATHERED)
                rows, cols = self.shapes[name]
                p.numel = rows * cols
                p.fn = self.leaves.get(name)
                group.unsharded[name] = self.model.weights[name] = p
            if self.metadata:
                t.done(t.new(COPY_OUT_META[self._kind(g)], 1, f"{group.tag}.{COPY_OUT}"))
        if forward:
            if self.kept is not None:
                t.free(self.kept)
            self.kept = group.gathered
        else:
            t.free(group.gathered)
        group.gathered = None

    def _to_orig_dtype(self, out: Tensor) -> Tensor:
        """The bf16 reduce-scatter output cast to the adapters' fp32 (``foreach_reduce``); fp32 as is."""
        if self.rd == ADAPTER_BYTES:
            return out
        with self.tape.scoped(""):
            cast = self.tape.managed(out.numel, ADAPTER_BYTES, "reduce_scatter_output.fp32", Category.GRADIENTS)
        self.tape.free(out)
        return cast
