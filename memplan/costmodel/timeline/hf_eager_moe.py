"""Mixtral, Qwen3-MoE and Qwen2-MoE under eager attention (``hf_eager.py``) in the op-level run.

Their ``eager_attention_forward`` is Llama's line for line (``modeling_mixtral.py:251``, ``modeling_qwen3_moe.py:101``,
``modeling_qwen2_moe.py:189``), so each is its SDPA class with :class:`~memplan.costmodel.timeline.hf_eager.
EagerAttention` before it. The masks (``hf_families.eager_masks``): Mixtral's and Qwen3-MoE's one, the sliding one
where the config has a window (``modeling_mixtral.py:443``); Qwen2-MoE's both whatever the layers
(``modeling_qwen2_moe.py:485``; its window 0 without ``use_sliding_window``, the grid's ops the same), which the
mixin builds in place of ``HfQwen2Moe``'s SDPA-only sliding grid. Checked on CPU against the real Trainer
(tests/unit/test_timeline_hf_eager.py).
"""

from __future__ import annotations

from memplan.costmodel.timeline.hf_eager import EagerAttention
from memplan.costmodel.timeline.hf_families import HfQwen3
from memplan.costmodel.timeline.hf_model import HfLlama
from memplan.costmodel.timeline.hf_moe import MOE_FAMILIES, MoeBlock


class EagerMixtral(EagerAttention, MoeBlock, HfLlama):
    """``MixtralForCausalLM`` under eager attention."""


class EagerQwen3Moe(EagerAttention, MoeBlock, HfQwen3):
    """``Qwen3MoeForCausalLM`` under eager attention."""


class EagerQwen2Moe(EagerAttention, MoeBlock, HfLlama):
    """``Qwen2MoeForCausalLM`` under eager attention: both masks built by the mixin (``HfQwen2Moe``'s ``positions``
    and ``head`` are SDPA's), the q/k/v biases and the shared expert as under SDPA."""


EAGER_MOE_FAMILIES: dict[str, tuple[type[HfLlama], tuple]] = {
    "mixtral": (EagerMixtral, MOE_FAMILIES["mixtral"][1]),
    "qwen3-moe": (EagerQwen3Moe, MOE_FAMILIES["qwen3-moe"][1]),
    "qwen2-moe": (EagerQwen2Moe, MOE_FAMILIES["qwen2-moe"][1]),
}
