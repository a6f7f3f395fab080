"""Which ``--runtime hf`` plans the op-level run of ``transformers.Trainer`` (``hf_trainer.py``) models.

Apart from the run so that asking does not build it. Modelled (tests/unit/test_timeline_hf.py, every
case equal to the real Trainer's peak on CPU): full fine-tuning on one rank of a dense Llama-layout
decoder (Llama, Mistral without a sliding window, Qwen2 with its q/k/v biases) under SDPA; fp32, bf16,
or ``bf16=True`` over fp32 (``bf16-mixed``); the default fused AdamW; gradient checkpointing of every
layer or none; any gradient accumulation; PEFT LoRA over the frozen base (tests/unit/test_timeline_hf_peft.py:
any of the decoder layers' linears, any rank, dropout, ``modules_to_save`` lm_head or an untied
embed_tokens). On CUDA the kernels are those of the bundled trainer's traces (``support.sdpa_kernel``),
and LoRA's dropout is ``native_dropout`` from its source: not yet checked on a GPU against transformers.
A 4-bit base (nf4 / fp4, double quantization; ``hf_bnb.py``) over more than 1536 tokens a micro-batch
(CUDA's dequantize-then-``F.linear`` path, read from bitsandbytes' source); an 8-bit base stays on the
phase model.

``runtime="hf-loop"`` (the hand-written loop of ``hf_loop.py``; tests/unit/test_timeline_hf_loop.py, every
case equal to the real loop's peak on CPU): the same models, precisions, kernels, checkpointing, LoRA and
4-bit bases, with ``AdamW(foreach=True)``, one micro-batch a step (the loop accumulates nothing).
"""

from __future__ import annotations

from memplan.costmodel.lora import SAVABLE
from memplan.costmodel.timeline.hf_bnb import CUDA_DEQUANT_TOKENS
from memplan.costmodel.timeline.support import sdpa_kernel
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

FAMILIES = ("llama", "mistral", "qwen2")  # Llama's decoder layer (Qwen2: with q/k/v biases)


def hf_supported(
    model: ModelSpec, plan: Plan, workload: TrainingWorkload | None = None, runtime: str = "hf"
) -> str | None:
    """What keeps the op-level run from following this ``hf`` (or ``hf-loop``) plan, or None
    (``workload``: the micro-batch, whose tokens decide bitsandbytes' CUDA path)."""
    tokens = None if workload is None else workload.micro_batch * workload.seq_len
    if runtime == "hf-loop" and workload is not None and accumulation(workload, plan) > 1:
        return "gradient accumulation (the hf-loop runtime's loop has none)"
    checks = [
        (model.architecture in FAMILIES, f"the {model.architecture} family"),
        (model.moe is None and model.mla is None, "MoE or MLA models"),
        (model.mlp == "gated" and model.activation == "silu", "a non-gated or non-SiLU MLP"),
        (model.norm == "rmsnorm" and model.position_embedding == "rope", "LayerNorm or non-RoPE models"),
        (not (model.attn_out_bias or model.mlp_bias or model.qk_norm), "these biases or QK-norm"),
        (not model.qkv_bias or model.architecture == "qwen2", "Q/K/V biases outside Qwen2"),
        (set(model.attention_pattern) <= {"full"}, "sliding or chunked attention"),
        (plan.attention == "flash", f"{plan.attention} attention"),
        (plan.quant in ("none", "nf4", "fp4"), "an LLM.int8 base (bitsandbytes' 8-bit matmul is not modelled)"),
        (
            plan.quant == "none" or tokens is None or tokens > CUDA_DEQUANT_TOKENS,
            f"a 4-bit base over {CUDA_DEQUANT_TOKENS} tokens or fewer (CUDA's gemm_4bit picks a fused kernel per GPU)",
        ),
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
