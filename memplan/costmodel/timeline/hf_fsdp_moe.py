"""The Trainer's FSDP2 (``hf_fsdp.py``) over the MoE families of ``hf_moe.py`` (Mixtral, Qwen3-MoE, Qwen2-MoE) and
``hf_mla.py`` (DeepSeek-V3 / V2): full fine-tuning and PEFT LoRA (transformers 5.23, accelerate 1.15, torch 2.13,
peft 0.21.2).

What accelerate wraps: ``fsdp2_prepare_auto_wrap_policy`` (accelerate/utils/fsdp_utils.py:921-960) takes the
model's ``_no_split_modules``, ``MixtralDecoderLayer``, ``Qwen3MoeDecoderLayer``, ``Qwen2MoeDecoderLayer``,
``DeepseekV3DecoderLayer``, ``DeepseekV2DecoderLayer`` (modeling_mixtral.py:373, modeling_qwen3_moe.py:355,
modeling_qwen2_moe.py:404, modeling_deepseek_v3.py:537, modeling_deepseek_v2.py:469), so each decoder layer is one
``fully_shard`` group, as a dense layer is: the router, the experts' fused 3-D parameters, Qwen2-MoE's shared
expert and its gate, DeepSeek's shared experts and MLA's projections, a dense layer's MLP are parameters of their
layer's group (V3's ``e_score_correction_bias`` a buffer, whole on every rank) (no module of the sparse block is
wrapped on its own). The group's all-gather holds them with the attention's, unsharded for the layer's forward
and its backward; the router's ops and the experts' ``grouped_mm`` run on the unsharded parameters exactly as on
one rank (``hf_moe.MoeBlock``); the experts' weight gradients (E x n x k, ``_grouped_mm``'s) are reduce-scattered
with the rest of the layer's.

The one difference in the bytes: ``FSDPParam`` shards a parameter on dim 0 (``Shard(0)``: ``torch.chunk`` of the
parameter padded to a multiple of the ranks, torch/distributed/fsdp/_fully_shard/_fsdp_param.py
``_init_sharded_param``), which for the experts' ``gate_up_proj`` (E, 2f, h) and ``down_proj`` (E, h, f) is the
expert axis: a rank holds whole experts, E padded to a multiple of the ranks (:func:`expert_split`).

PEFT LoRA runs as over a dense base (``hf_fsdp_peft.py``); PEFT's ``ParamWrapper`` adapters of the experts and the
router (``hf_moe_lora.py``) are 2-D parameters of the layer's group, chunked on their own dim 0
(``hf_fsdp.peft_shapes``), and the router's delta reads them as the all-gather leaves them (bf16 under
``bf16=True``: on CPU ``get_delta_weight`` multiplies fp32 copies, ``hf_moe_lora.router_delta``).

Checked against the real Trainer on CPU, rank 0 of two or four under the fake process group
(tests/unit/test_timeline_hf_fsdp_moe.py): fp32, a bf16 model, ``bf16=True`` (accelerate's bf16 policy over fp32
master shards), gradient checkpointing, ``full_shard`` and ``shard_grad_op``, gradient accumulation, dense
layers, experts not divisible by the ranks, LoRA on the linears and through ``ParamWrapper``; every case equal
to the byte. DeepSeek-V3 / V2 full, LoRA on MLA's linears and QLoRA likewise, nothing of the run changed for them
(tests/unit/test_timeline_hf_fsdp_mla.py).
"""

from __future__ import annotations

EXPERTS = (".mlp.experts.gate_up_proj.weight", ".mlp.experts.down_proj.weight")  # the 3-D parameters (hf_moe.py)


def expert_split(name: str, shape: tuple[int, int], extra: dict | None) -> tuple[int, int]:
    """(dim 0, elements under each dim-0 index) of parameter ``name``, whose ``shape`` is stored as
    (rows, cols): a MoE layer's experts (``extra["experts"]``, ``hf_moe.moe_config``) are E matrices, dim 0
    the expert; every other parameter is its rows."""
    rows, cols = shape
    experts = (extra or {}).get("experts")
    if experts and name.endswith(EXPERTS):  # not their adapters (PEFT's 2-D lora_A / lora_B)
        return experts, rows * cols // experts
    return rows, cols
