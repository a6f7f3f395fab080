"""Which ``--runtime hf`` plans the op-level run of ``transformers.Trainer`` (``hf_trainer.py``) models.

Apart from the run so that asking does not build it. Modelled (tests/unit/test_timeline_hf.py, every
case equal to the real Trainer's peak on CPU): full fine-tuning on one rank of a dense Llama-layout
decoder (Llama, Mistral without a sliding window, Qwen2 with its q/k/v biases) under SDPA; fp32, bf16,
or ``bf16=True`` over fp32 (``bf16-mixed``); the default fused AdamW; gradient checkpointing of every
layer or none; any gradient accumulation; PEFT LoRA over the frozen base (tests/unit/test_timeline_hf_peft.py:
any of the decoder layers' linears, any rank, dropout, ``modules_to_save`` lm_head or an untied
embed_tokens). On CUDA the kernels are those of the bundled trainer's traces (``support.sdpa_kernel``),
and LoRA's dropout is ``native_dropout`` from its source: not yet checked on a GPU against transformers.
Quantized bases (QLoRA, LLM.int8) stay on the phase model (see ``hf_supported``).
"""

from __future__ import annotations

from memplan.costmodel.lora import SAVABLE
from memplan.costmodel.timeline.support import sdpa_kernel
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

FAMILIES = ("llama", "mistral", "qwen2")  # Llama's decoder layer (Qwen2: with q/k/v biases)


def hf_supported(model: ModelSpec, plan: Plan) -> str | None:
    """What keeps the op-level run from following this ``hf`` plan, or None."""
    checks = [
        (model.architecture in FAMILIES, f"the {model.architecture} family"),
        (model.moe is None and model.mla is None, "MoE or MLA models"),
        (model.mlp == "gated" and model.activation == "silu", "a non-gated or non-SiLU MLP"),
        (model.norm == "rmsnorm" and model.position_embedding == "rope", "LayerNorm or non-RoPE models"),
        (not (model.attn_out_bias or model.mlp_bias or model.qk_norm), "these biases or QK-norm"),
        (not model.qkv_bias or model.architecture == "qwen2", "Q/K/V biases outside Qwen2"),
        (set(model.attention_pattern) <= {"full"}, "sliding or chunked attention"),
        (plan.attention == "flash", f"{plan.attention} attention"),
        (plan.finetune != "qlora" and plan.quant == "none", "a quantized base (bitsandbytes)"),
        (set(plan.modules_to_save) <= set(SAVABLE), f"modules_to_save {list(plan.modules_to_save)}"),
        (not (model.tied_embeddings and "embed_tokens" in plan.modules_to_save), "a trained copy of tied embeddings"),
        (plan.offload_activations == "none", "activation offload"),
        (plan.offload_params == "none" and plan.offload_optimizer == "none", "offload"),
        (plan.dp == plan.tp == plan.pp == plan.cp == plan.ep == 1, "more than one rank"),
        (plan.optimizer == "adamw" and plan.precision in ("fp32", "bf16", "bf16-mixed"), "this optimizer or precision"),
        (plan.recompute in ("none", "full") and plan.recompute_layers is None, "this recompute"),
        (plan.precision != "fp32" or sdpa_kernel(model, plan) == "math", "fp32 SDPA on the memory-efficient kernel"),
    ]
    for ok, what in checks:
        if not ok:
            return what
    return None


def accumulation(workload: TrainingWorkload, plan: Plan) -> int:
    """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
    total = workload.global_batch or workload.micro_batch * plan.dp
    return max(1, total // (workload.micro_batch * plan.dp))
