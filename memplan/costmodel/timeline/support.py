"""Which plans the bundled trainer's op-by-op run (``trainer.py``) models.

Apart from that run so that the estimate path asks the question without importing the run's
model (``trainer_model``, ``autograd``, ``fsdp``): a plan it does not model is replayed from the
phase model's moments (``step.py``), and the trainer's modules stay unimported.
"""

from __future__ import annotations

from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload


def supported(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> str | None:
    """What keeps the timeline from following this plan faithfully, or None.

    Modelled (the six traces cover each mechanism): one pipeline stage; a dense Llama-family
    decoder (RMSNorm, RoPE, gated SiLU MLP, no biases, no QK-norm) with flash SDPA; AdamW
    (foreach) without offload; one micro-batch per step; recompute none, full (every layer)
    or selective; either one data rank without sharding in bf16 or bf16-mixed (autocast), or
    FSDP2 ZeRO-3 over dp > 1 in bf16 or bf16-mixed (MixedPrecisionPolicy) with an untied LM
    head, optionally with tensor and sequence parallel. LoRA adapters (``lora.py``) over a
    frozen bf16 base on one rank, without dropout or ``modules_to_save`` (h200_a_lora8b).

    Not modelled: QLoRA and LLM.int8 bases; LoRA with dropout, modules_to_save, autocast or
    over a sharded base; pipeline, context or expert parallelism; MoE; a plain MLP, LayerNorm,
    biases, QK-norm; eager attention; fp32 (SDPA leaves the flash kernel) and bf16-master
    (another optimizer); offload; DDP and ZeRO-1/2 (dp > 1); tensor parallel without FSDP2 or
    without sequence parallel; partial recompute and selective-op; gradient accumulation;
    FSDP2 over a tied embedding (one root group holding it)."""
    checks = [
        (model.moe is None, "MoE models"),
        (model.mlp == "gated" and model.activation == "silu", "a non-gated or non-SiLU MLP"),
        (model.norm == "rmsnorm" and model.position_embedding == "rope", "LayerNorm or non-RoPE models"),
        (not (model.qkv_bias or model.attn_out_bias or model.mlp_bias or model.qk_norm), "biases or QK-norm"),
        (plan.attention == "flash", f"{plan.attention} attention"),
        (plan.finetune != "qlora", "QLoRA (a quantized base)"),
        (plan.finetune == "full" or _plain_lora(plan), "LoRA other than adapters over a bf16 base on one rank"),
        (plan.offload_activations == "none", "activation offload"),
        (plan.pp == 1 and plan.cp == 1 and plan.ep == 1, "pipeline, context or expert parallelism"),
        (plan.offload_params == "none" and plan.offload_optimizer == "none", "offload"),
        (plan.optimizer == "adamw" and plan.precision in ("bf16", "bf16-mixed"), "this optimizer or precision"),
        (plan.recompute in ("none", "full", "selective") and plan.recompute_layers is None, "this recompute"),
        (_accumulation(workload, plan) == 1, "gradient accumulation"),
        (plan.dp == 1 or plan.zero == 3, "DDP or ZeRO-1/2"),
        (plan.tp == 1 or plan.dp > 1, "tensor parallel without FSDP2"),
        (plan.tp == 1 or plan.sequence_parallel, "tensor parallel without sequence parallel"),
        (plan.dp == 1 or not model.tied_embeddings, "FSDP2 over tied embeddings"),
        (_divides(model, workload, plan), "dimensions that tensor parallel does not divide"),
    ]
    for ok, what in checks:
        if not ok:
            return what
    return None


def _accumulation(workload: TrainingWorkload, plan: Plan) -> int:
    total = workload.global_batch or workload.micro_batch * plan.dp
    return max(1, total // (workload.micro_batch * plan.dp))


def _divides(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> bool:
    tp = plan.tp
    sizes = (model.q_size, model.kv_size, model.ffn_size, model.vocab_size, model.num_attention_heads, model.kv_heads)
    return all(n % tp == 0 for n in sizes) and workload.seq_len % tp == 0


def _plain_lora(plan: Plan) -> bool:
    """LoRA as h200_a_lora8b ran it: one rank, an unquantized bf16 base, no dropout (its masks),
    no trained copy of a module (``modules_to_save``)."""
    return (
        plan.quant == "none"
        and plan.lora_dropout == 0
        and not plan.modules_to_save
        and plan.dp == 1
        and plan.tp == 1
        and plan.precision == "bf16"
    )
