"""The Trainer's FSDP2 build over a model loaded on the CPU (``model_build: to_device`` under FSDP), as
FSDP users load it and as memplan's exports write it (``fsdp_config["cpu_ram_efficient_loading"]``,
``export/hf_trainer.py`` / ``accelerate.py`` / ``axolotl.py``): ``from_pretrained`` without a
``device_map``, rank 0 on the CPU, the other ranks on the meta device (transformers 5.23, accelerate 1.15,
torch 2.13; file:line of those installed versions).

What the GPU sees, in order (``fsdp2_prepare_model``, accelerate/utils/fsdp_utils.py:751-917):

- nothing before ``prepare``: under FSDP the Trainer leaves the model where it was loaded
  (``place_model_on_device`` False, transformers/trainer.py:480-494); the optimizer's placeholders are
  made on ``p.device`` (accelerate/accelerator.py:1723: the CPU, or meta), the upcast of the trained
  parameters to fp32 under ``bf16=True`` runs where they are (fsdp_utils.py:815-825), and
  ``original_sd = model.state_dict()`` (828) holds the host copies;
- the non-persistent buffers are deep-copied (fsdp_utils.py:839-841, on the host) and the model moved to
  the meta device (843), so every ``fully_shard`` (850-885) shards meta parameters:
  ``_move_states_to_device`` keeps meta tensors there (torch/distributed/fsdp/_fully_shard/_fsdp_init.py:
  383-385) and ``FSDPParam._init_sharded_param``'s ``new_zeros`` of the padded shard is a meta tensor
  (_fsdp_param.py:307). Without ``cpu_ram_efficient_loading`` ``_move_states_to_device`` would move each
  group's parameters to the GPU full-size (``tensor.data = tensor.to(device)``, _fsdp_init.py:401) and
  chunk them there, a group at a time: that build is not modelled;
- ``fsdp2_load_full_state_dict`` (fsdp_utils.py:574-666), over the sharded model's ``state_dict()`` keys
  (the parameters in ``model.parameters()`` order; a tied ``lm_head.weight`` again after the rest):
  rank 0 copies the full parameter to the GPU (``full_param.detach().to(device_mesh.device_type)``, 629;
  fp32 where upcast), broadcasts it, and ``distribute_tensor`` keeps its chunk:
  ``Shard._shard_tensor`` splits it (torch/distributed/tensor/placement_types.py:441: ``torch.chunk``,
  a chunk shorter than the first padded into a new tensor, ``_split_tensor_helper`` 227-229) and
  scatters into ``torch.empty_like`` of the first chunk (452: rank 0's shard, dim 0 padded to a multiple
  of the ranks, FSDP2's padded size); ``_cast_and_contiguous`` casts to the meta parameter's dtype, the
  same (637-642). The full copy goes when ``full_param`` is rebound for the next key (627). The other
  ranks receive into ``torch.empty`` of the full size (651) allocated before the previous one is let go:
  one full parameter more than rank 0, the rank this run follows;
- ``model.load_state_dict(sharded_sd, assign=True)`` (665): each ``FSDPParam.reset_sharded_param`` (the
  load's post-hook, _fsdp_param.py:223, 995-1048) keeps the loaded shard as its padded one (same size);
  a tied model's second embedding shard goes as ``sharded_sd`` does;
- the buffers return: ``buffer_tensor.to(accelerator.device)`` (fsdp_utils.py:890-900).

So the build's GPU peak is every shard plus one full parameter (the largest: the embedding or the head,
fp32 under ``bf16=True``), not the whole model. On CPU the device is the host: the full parameters are
the loaded model itself (``.to("cpu")`` returns it), so the CPU measurement of the real Trainer with
``cpu_ram_efficient_loading`` (tests/unit/test_timeline_hf_fsdp_load.py) checks the deep-copied
buffers, the meshes, the shards' order and sizes (LoRA's adapters among them), the tied model's extra
shard and the steps; the full copies on the GPU (tagged ``.full``) are from the source above only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.events import Category

if TYPE_CHECKING:
    from memplan.costmodel.timeline.hf_fsdp import HfFsdp

TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def load(fsdp: HfFsdp, weights: dict[str, Tensor]) -> None:
    """From ``original_sd`` on: the buffers' host copies, the meta ``fully_shard`` calls, the load,
    the full parameters let go (on CPU, where they were the device's), the buffers on the GPU."""
    t = fsdp.tape
    buffers = [name for name, _ in fsdp.model.buffers()]
    if not fsdp.cuda:  # copy.deepcopy of the buffers, then model.to("meta") frees the originals
        for name in buffers:
            old, weights[name] = weights[name], t.managed(weights[name].numel, fsdp.loaded, name, Category.PARAMETERS)
            t.free(old)
        for group in fsdp.shard_order():  # each group's DeviceMesh (hf_fsdp.HfFsdp.build)
            t.managed(fsdp.dp, 4, f"{group.tag}.device_mesh", Category.COMM)
    with t.scoped("fsdp2_load_full_state_dict"):
        extra = [_load(fsdp, name) for name in _keys(fsdp)][len(fsdp.shapes) :]
    for shard in extra:  # a tied head's own shard: sharded_sd's, let go
        t.free(shard)
    for name in fsdp.shapes:
        t.free(weights.pop(name))
    if fsdp.cuda:
        for name in buffers:
            t.free(weights[name])
            weights[name] = t.managed(weights[name].numel, fsdp.loaded, name, Category.PARAMETERS)


def _keys(fsdp: HfFsdp) -> list[str]:
    """The sharded model's ``state_dict()`` keys: the parameters, then a tied head under its own key."""
    return [*fsdp.shapes, *([TIED_HEAD] if fsdp.tied and TIED_HEAD not in fsdp.shapes else [])]


def _load(fsdp: HfFsdp, key: str) -> Tensor:
    """One key: its full copy on the GPU (CUDA's alone), the padded copies of the short chunks, rank 0's
    shard; the copies let go."""
    t = fsdp.tape
    name = EMBEDDING if key == TIED_HEAD and key not in fsdp.shapes else key
    rows, cols = fsdp.split(name)  # dim 0: the experts of a MoE layer's 3-D parameters
    itemsize = fsdp.itemsize(name)
    full = t.new(rows * cols, itemsize, f"{key}.full") if fsdp.cuda else None
    chunk = -(-rows // fsdp.dp)
    short = [i for i in range(fsdp.dp) if min(chunk, max(0, rows - i * chunk)) < chunk]
    pads = [t.new(chunk * cols, itemsize, f"{key}.chunk_pad") for _ in short]
    shard = t.managed(chunk * cols, itemsize, f"{key}.shard", Category.PARAMETERS)
    t.done(*pads, full)
    return shard
