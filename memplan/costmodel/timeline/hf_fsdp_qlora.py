"""QLoRA under the Trainer's FSDP2 (``hf_fsdp_peft.HfFsdpPeft`` over a 4-bit base), as the documented recipe
loads it: ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=<the model's float dtype>)``, so that
FSDP shards the packed weights with the rest (transformers / peft / accelerate docs, "FSDP + QLoRA"; the
exporters write it: ``export/hf_trainer.quantization``). bitsandbytes 0.50, accelerate 1.15, torch 2.13;
file:line of those installed versions.

- The packed weight: ``quantize_4bit`` packs two 4-bit codes per byte and views the bytes as the storage dtype,
  ``packed.squeeze().view(quant_storage).unsqueeze(1)`` (bitsandbytes/backends/default/ops.py:257-258): a
  ``(numel / 2 / itemsize, 1)`` parameter of that dtype, frozen. ``fully_shard`` shards it on dim 0 as any
  parameter (padded to a multiple of the ranks); its ``QuantState`` (absmax, code) is no parameter and stays
  whole on every rank (``Linear4bit`` keeps it as ``module.quant_state`` and
  ``fix_4bit_weight_quant_state_from_module`` puts it back on the unsharded weight, bitsandbytes/nn/modules.py).
- ``fsdp2_prepare_model``'s ``original_sd = model.state_dict()`` (accelerate/utils/fsdp_utils.py:828): each
  ``Linear4bit._save_to_state_dict`` adds ``weight.quant_state.as_dict(packed=True)``
  (bitsandbytes/functional.py:545-578), whose non-tensor items (quant type, block size, dtype, shape) are
  ``pack_dict_to_tensor``'s uint8 tensor of their JSON (bitsandbytes/utils.py:166-180: 77-78 B here), held
  with the state dict until ``prepare`` returns; with double quantization ``nested_quant_map`` is
  ``state2.code.clone()`` (functional.py:563: 256 fp32, first) and the JSON adds the nested block size and
  dtype and the offset's ``repr``, a float of the data, taken at 20 characters (17 significant digits of a
  value in [0.01, 0.1); measured 18-21: a few bytes a weight, at the build).
- The step: a decoder group holds packed weights of the storage dtype beside fp32 adapters and norms
  (``prepare_model_for_kbit_training``), so without a mixed policy ``foreach_all_gather`` gathers bytes
  (``hf_fsdp_peft.HfFsdpPeft.all_gather``); each unsharded packed weight is its own dtype's copy, dequantized by
  ``gemm_4bit`` as on one rank (``hf_bnb.Bnb4bit``: its CUDA fallback's temporaries tagged as there).

Checked on CPU against the real Trainer (tests/unit/test_timeline_hf_fsdp_qlora.py); over 4-bit Mixtral and Qwen3-MoE
too (tests/unit/test_timeline_hf_quant_moe_ranks.py: each decoder layer one group, ``hf_fsdp_moe.py``, its packed
weights beside the fp32 experts, router and norms, gathered as bytes, or all as bf16 under ``bf16=True``'s policy).
"""

from __future__ import annotations

import json

from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.hf_bnb import BLOCK, CODE_8BIT, NESTED_BLOCK, Bnb4bit
from memplan.costmodel.timeline.hf_fsdp_peft import HfFsdpPeft

_DTYPE = {4: "float32", 2: "bfloat16"}  # quant_state.dtype as as_dict writes it: str(dtype).strip("torch.")
OFFSET_REPR = 20  # characters of the nested offset's repr (module docstring)


def packed_shapes(shapes: dict[str, tuple[int, int]], quant: Bnb4bit) -> dict[str, tuple[int, int]]:
    """The parameters as ``fully_shard`` sees them: a quantized weight as its packed ``(rows, 1)``."""
    out = dict(shapes)
    for name, (rows, cols) in shapes.items():
        if quant.quantized(name.removesuffix(".weight")):
            out[name] = (-(-rows * cols // (2 * quant.storage)), 1)
    return out


def packed_state_bytes(quant: Bnb4bit, rows: int, cols: int) -> int:
    """``pack_dict_to_tensor``'s bytes for one weight: the JSON of ``as_dict``'s non-tensor items."""
    items = {"quant_type": quant.quant_type, "blocksize": BLOCK, "dtype": _DTYPE[quant.stored], "shape": [rows, cols]}
    if not quant.double_quant:
        return len(json.dumps(items).encode())
    items.update(nested_blocksize=NESTED_BLOCK, nested_dtype="float32", nested_offset=0)
    return len(json.dumps(items).encode()) - 1 + OFFSET_REPR


class HfFsdpQlora(HfFsdpPeft):
    """``HfFsdpPeft`` whose quantized weights are packed parameters of the storage dtype."""

    def __init__(self, *args, quant: Bnb4bit, full: dict, **kwargs) -> None:  # noqa: ANN002, ANN003
        """``full``: the parameters' logical shapes (``shapes``, the third argument, holds the packed ones)."""
        self.quant, self.full = quant, full  # itemsize reads them
        self.recast: dict[str, Tensor] = {}  # the 4-bit linears' biases recast in the forward (recast_biases)
        super().__init__(*args, **kwargs)

    def unshard(self, g: int, forward: bool) -> None:
        """``fsdp.Fsdp.unshard``; at a forward, each 4-bit linear's bias (Qwen2's q, k, v) gathered in a dtype
        other than the compute dtype is recast the first time (:meth:`recast_biases`)."""
        super().unshard(g, forward)
        if forward:
            self.recast_biases(g)

    def recast_biases(self, g: int) -> None:
        """``Linear4bit.forward``'s ``bias.data = bias.data.to(x.dtype)`` (bitsandbytes 0.50 ``nn/modules.py``) on
        the unsharded bias: fp32 after ``prepare_model_for_kbit_training``, gathered so without a policy, it gets
        a compute-dtype copy for its ``.data``. ``FSDPParam.init_unsharded_param`` returns early for a plain
        parameter once its ``_unsharded_param`` exists, and the reshard frees the all-gather outputs, not that
        ``.data``: the copy stays for the rest of the run, the gathered bias beside it at each unshard, and the
        bias reads as the compute dtype from then on (no second recast). Under ``bf16=True``'s policy the bias is
        gathered in bf16 already: nothing. Allocated at the group's first forward unshard (the q, k, v projections
        are the layer's first linears)."""
        t = self.tape
        for name in self.groups[g].names:
            module = name.removesuffix(".bias")
            if name == module or not self.quant.quantized(module) or name in self.recast:
                continue
            if self.unsharded_itemsize(name) != self.quant.compute:
                rows, cols = self.shapes[name]
                self.recast[name] = t.managed(rows * cols, self.quant.compute, f"{name}.recast", Category.PARAMETERS)

    def packed(self, name: str) -> bool:
        return name in self.frozen and self.quant.quantized(name.removesuffix(".weight"))

    def itemsize(self, name: str) -> int:
        """A packed weight: its storage dtype's; the rest as ``HfFsdpPeft``'s."""
        return self.quant.storage if self.packed(name) else super().itemsize(name)

    def prepare_params(self, weights: dict[str, Tensor], optimizer_order: list[str]) -> list[Tensor]:
        """``HfFsdpPeft``'s placeholders, then ``model.state_dict()``'s packed quantization states (held
        with the state dict: let go with the placeholders)."""
        holders = super().prepare_params(weights, optimizer_order)
        t = self.tape
        with t.scoped("accelerate.state_dict"):
            for name in self.shapes:
                if self.packed(name):
                    rows, cols = self.full[name]
                    if self.quant.double_quant:  # nested_quant_map: state2.code.clone()
                        holders.append(t.new(CODE_8BIT, 4, f"{name}.quant_state.nested_quant_map"))
                    n = packed_state_bytes(self.quant, rows, cols)
                    holders.append(t.new(n, 1, f"{name}.quant_state.packed", Category.PARAMETERS))
        return holders

    def all_gather(self, g: int) -> None:
        """Without a policy a group of one dtype gathers in that dtype, the parameters' (an fp32 embedding or
        head after ``prepare_model_for_kbit_training``), not the plan's compute dtype; of several, bytes
        (``HfFsdpPeft``'s). Under the policy, ``HfFsdpPeft``'s."""
        group, t = self.groups[g], self.tape
        sizes = {self.itemsize(n) for n in group.names}
        if self.mixed or len(sizes) > 1:
            super().all_gather(g)
            return
        (itemsize,) = sizes
        numel = sum(self.shard(n) for n in group.names)
        with t.scoped(group.tag):
            group.gathered = t.managed(numel * self.dp, itemsize, "all_gather_output", Category.COMM, self.ag)
