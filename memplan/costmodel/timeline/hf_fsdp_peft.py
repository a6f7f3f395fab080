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

``modules_to_save=["lm_head"]`` (``ModulesToSaveWrapper``: ``original_module``, frozen, then
``modules_to_save.default``, the trained copy): accelerate's ``get_output_embeddings`` is the wrapper, so the
tail group ``[lm_head]`` holds both; both are all-gathered and unsharded though the forward reads the copy
alone, only the copy reduce-scatters. Under ``bf16=True`` accelerate upcasts the copy (it requires grad) to
fp32 before sharding.
"""

from __future__ import annotations

from memplan.costmodel.lora import ADAPTER_BYTES
from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.hf_fsdp import HfFsdp, peft_shapes

HEAD, ORIGINAL = "lm_head.weight", "lm_head.original_module.weight"  # the trained copy and its frozen original
EMBED, EMBED_ORIGINAL = "model.embed_tokens.weight", "model.embed_tokens.original_module.weight"  # likewise
COPIES = {EMBED: EMBED_ORIGINAL, HEAD: ORIGINAL}


def peft_params(shapes: dict[str, tuple[int, int]], lora, weights: dict[str, Tensor]) -> tuple[dict, frozenset]:  # noqa: ANN001 - an HfLora
    """The ``PeftModel``'s parameters in ``named_parameters()`` order and the frozen ones: the base, each
    targeted linear's adapters after its weight; a trained copy (``lm_head``, ``embed_tokens``) right after its
    original (``ModulesToSaveWrapper``: ``original_module``, then ``modules_to_save.default``), which
    ``weights`` gets back under its own name (the copy took the module's)."""
    out = peft_shapes(shapes, lora)
    copies = {copy: original for copy, original in COPIES.items() if copy in lora.originals}
    if not copies:
        return out, frozenset(shapes)
    ordered: dict[str, tuple[int, int]] = {}
    for name, shape in out.items():
        if name in copies:
            weights[copies[name]] = lora.originals[name]
            ordered[copies[name]] = shape
        ordered[name] = shape
    return ordered, frozenset(ordered) - set(copies) - {n for n in ordered if ".lora_" in n}


class HfFsdpPeft(HfFsdp):
    """``HfFsdp`` over a ``PeftModel``: the frozen base in its loaded dtype, the adapters in fp32."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - HfFsdp's
        super().__init__(*args, **kwargs)
        self.rd = 2 if self.mixed else ADAPTER_BYTES  # the reduce dtype: the policy's, else the adapters'
        if ORIGINAL in self.shapes:  # the tail [lm_head] is the wrapper: its original, then the copy
            self.groups[-1].names.insert(0, ORIGINAL)
        if EMBED_ORIGINAL in self.shapes:  # get_input_embeddings is the wrapper too: the embedding's group
            self.groups[0].names.insert(0, EMBED_ORIGINAL)

    def itemsize(self, name: str) -> int:
        """The frozen base as loaded; an adapter fp32; a trained copy as loaded, fp32 under the mixed policy."""
        if name in self.frozen:
            return self.loaded
        return self.d.pd if name in COPIES else ADAPTER_BYTES

    def prepare_params(self, weights: dict[str, Tensor], optimizer_order: list[str]) -> list[Tensor]:
        """The optimizer's placeholders, each in its parameter's dtype, then under the mixed policy a
        16-bit trained copy upcast (``param.data.to(float32)``); the adapters, fp32 already, are not."""
        t = self.tape
        if self.host and self.cuda:
            return []
        with t.scoped("accelerate.prepare"):
            dtype = {n: self.loaded if n in COPIES else ADAPTER_BYTES for n in optimizer_order}
            holders = [t.new(1, dtype[n], f"{n}.optimizer_placeholder") for n in optimizer_order]
            for copy in self.upcast(dtype):  # in named_parameters() order
                rows, cols = self.shapes[copy]
                old, weights[copy] = weights[copy], t.managed(rows * cols, 4, f"{copy}.fp32", Category.PARAMETERS)
                t.free(old)
        return holders

    def upcast(self, dtype: dict[str, int]) -> list[str]:
        """The trained copies ``fsdp2_prepare_model`` upcasts to fp32 (16-bit ones under the mixed policy)."""
        return [n for n in self.shapes if n in COPIES and n in dtype and dtype[n] != self.itemsize(n)]

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

    def unsharded_itemsize(self, name: str) -> int:
        """Each unsharded parameter in its own all-gather dtype: the policy's bf16, else the parameter's."""
        return self.d.cd if self.mixed else self.itemsize(name)

    def post_backward(self, g: int) -> None:
        """``HfFsdp.post_backward`` in the group's reduce dtype: the policy's bf16, else its trained
        parameters' own (``FSDPParamGroup._init_mp_dtypes``: a bf16 copy's bf16, the adapters' fp32)."""
        if not self.mixed:
            trained = [n for n in self.groups[g].names if n not in self.frozen]
            self.rd = self.itemsize(trained[0]) if trained else ADAPTER_BYTES
        super().post_backward(g)

    def _to_orig_dtype(self, out: Tensor) -> Tensor:
        """The bf16 reduce-scatter output cast to the trained parameters' fp32 (``foreach_reduce``);
        without a policy the reduce dtype is theirs."""
        if not self.mixed:
            return out
        with self.tape.scoped(""):
            cast = self.tape.managed(out.numel, ADAPTER_BYTES, "reduce_scatter_output.fp32", Category.GRADIENTS)
        self.tape.free(out)
        return cast
