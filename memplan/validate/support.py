"""What the bundled trainer can run, checked before anything is launched (no torch import).

Each refusal is a ``TrainerUnsupported`` whose message starts with the field it blames
(``"tp: ..."``), so the CLI can print it as a one-line error.
"""

from __future__ import annotations

from memplan.costmodel.trainer_offload import unmodelled, unmodelled_accumulation
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.validate.spec import RunSpec


class TrainerUnsupported(ValueError):
    """The model or plan is valid but the bundled trainer cannot run it (one-line reason)."""

    @property
    def field(self) -> str:
        return str(self).split(":", 1)[0]

    @property
    def reason(self) -> str:
        return str(self).split(":", 1)[1].strip()


def check_model(spec: ModelSpec) -> None:
    """The trainer builds Llama-family decoders only: say which field is outside that."""
    if spec.moe is not None:
        raise TrainerUnsupported("moe: the bundled trainer builds dense models only (MoE is estimate-only)")
    checks = {
        "norm": (spec.norm, "rmsnorm"),
        "position_embedding": (spec.position_embedding, "rope"),
        "mlp": (spec.mlp, "gated"),
        "activation": (spec.activation, "silu"),
    }
    for field, (value, wanted) in checks.items():
        if value != wanted:
            raise TrainerUnsupported(f"{field}: the bundled trainer builds {wanted} models (got {value})")
    for field in ("attn_out_bias", "mlp_bias", "qk_norm"):
        if getattr(spec, field):
            raise TrainerUnsupported(f"{field}: not supported by the bundled trainer")


def check_plan(plan: Plan) -> None:
    """Reject, with a one-line reason, what the trainer cannot apply faithfully."""
    if plan.finetune != "full":
        check_lora(plan)
    if plan.offload_activations != "none":
        check_offload(plan)
    if plan.autocast is not None:
        raise TrainerUnsupported(
            "autocast: the transformers Trainer's bf16=True; the bundled trainer runs its precision's recipe"
        )
    if plan.lora_dora:
        raise TrainerUnsupported(
            "lora_dora: PEFT's DoRA; the bundled trainer builds plain LoRA adapters (memplan.train.lora)"
        )
    if plan.use_reentrant:
        raise TrainerUnsupported(
            "use_reentrant: transformers' gradient checkpointing; the bundled trainer checkpoints non-reentrantly"
        )
    if plan.cp > 1:
        raise TrainerUnsupported("cp: context parallelism is not implemented by the bundled trainer")
    if plan.ep > 1:
        raise TrainerUnsupported("ep: expert parallelism needs an MoE model; the bundled trainer builds dense ones")
    if plan.precision in ("fp8", "fp16-master"):
        raise TrainerUnsupported(f"precision: {plan.precision} is not implemented by the bundled trainer")
    if plan.optimizer != "adamw":
        raise TrainerUnsupported(f"optimizer: the bundled trainer runs adamw (got {plan.optimizer})")
    if plan.tp > 1 and plan.dp > 1 and plan.zero < 2:
        raise TrainerUnsupported(
            f"zero: DDP does not compose with tensor parallel (DTensor) parameters; use zero 2 or 3 with tp={plan.tp}"
        )
    if "nvme" in (plan.offload_params, plan.offload_optimizer):
        raise TrainerUnsupported("offload: NVMe offload is DeepSpeed's; the trainer offloads to CPU only")
    offload = (plan.offload_params, plan.offload_optimizer)
    if offload != ("none", "none") and offload != ("cpu", "cpu"):
        raise TrainerUnsupported(
            "offload_params: FSDP2's CPUOffloadPolicy offloads parameters, gradients and the optimizer "
            "step together; set offload_params and offload_optimizer both to cpu"
        )
    if offload == ("cpu", "cpu") and plan.dp == 1:  # parallel.uses_fsdp: FSDP2 over dp > 1 only
        raise TrainerUnsupported(
            "offload_params: the trainer offloads through FSDP2's CPUOffloadPolicy, which it applies over dp > 1 "
            "(on one rank it would train without offload); use dp 2 or more, or no offload"
        )
    if plan.pp > 1 and plan.dp > 1 and plan.zero in (0, 1):
        raise TrainerUnsupported(
            "zero: with pipeline parallel the trainer shards data parallel with FSDP2; use zero 2 or 3"
        )


def check_offload(plan: Plan) -> None:
    """Activation offload as the trainer runs it (memplan.train.offload: ``save_on_cpu`` around
    each micro-batch's forward and loss) where it is measured and modelled
    (``costmodel.trainer_offload.unmodelled``)."""
    if (reason := unmodelled(plan)) is not None:
        raise TrainerUnsupported(f"offload_activations: {reason}")


def check_lora(plan: Plan) -> None:
    """LoRA as the trainer builds it (memplan.train.lora): adapters over an unquantized base or
    a bitsandbytes one (memplan.train.quant: nf4 / fp4, double quant or not, int8) computing in
    fp32 or bf16, on one tensor-parallel rank, without FSDP (its groups would mix frozen and
    trained dtypes)."""
    if plan.quant != "none" and plan.precision == "bf16-mixed":
        raise TrainerUnsupported(
            f"precision: bf16-mixed (autocast) over a {plan.quant} base is estimate-only in the bundled trainer; "
            "use bf16 (bitsandbytes' bf16 compute dtype) or fp32"
        )
    if set(plan.modules_to_save) - {"lm_head"}:
        raise TrainerUnsupported(
            "modules_to_save: the bundled trainer trains a copy of lm_head only (embed_tokens is estimate-only)"
        )
    if plan.tp > 1:
        raise TrainerUnsupported("tp: the bundled trainer's LoRA adapters are not tensor-parallel; use tp 1")
    if plan.pp > 1:
        raise TrainerUnsupported("pp: the bundled trainer runs LoRA without pipeline parallel; use pp 1")
    if plan.zero >= 2 and plan.dp > 1 or plan.offload_params != "none":
        raise TrainerUnsupported("zero: the bundled trainer runs LoRA with DDP or ZeRO-1 (no FSDP); use zero 0 or 1")
    if _sixteen_bit_copy_under_zero1(plan):
        raise TrainerUnsupported(
            "modules_to_save: a bf16 lm_head copy beside fp32 adapters under zero 1 fails in ZeroRedundancyOptimizer "
            "(one dtype for all parameters); use zero 0, or precision fp32 or bf16-mixed"
        )


def _sixteen_bit_copy_under_zero1(plan: Plan) -> bool:
    """A trained head copy in bf16 (bf16, bf16-master over an unquantized base; over a quantized one
    ``prepare_model_for_kbit_training`` casts it to fp32) beside the fp32 adapters under ZeRO-1:
    ``ZeroRedundancyOptimizer`` raises "only supports using the same dense type for all parameters"
    (measured on CPU, torch 2.13, 2026-11-28)."""
    zero1 = plan.dp > 1 and plan.zero == 1
    sixteen_bit = plan.quant == "none" and plan.precision in ("bf16", "bf16-master")
    return zero1 and bool(plan.modules_to_save) and sixteen_bit


def check_workload(spec: RunSpec) -> None:
    plan, model = spec.plan, spec.model
    if model.num_layers % plan.stages:
        raise TrainerUnsupported(
            f"pp: {model.num_layers} layers do not split evenly into pp x virtual_stages = {plan.stages} chunks"
        )
    if plan.sequence_parallel and plan.tp > 1 and spec.workload.seq_len % plan.tp:
        raise TrainerUnsupported(f"seq_len: sequence parallel needs seq_len divisible by tp={plan.tp}")
    for name, heads in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", model.kv_heads)):
        if heads % plan.tp:
            raise TrainerUnsupported(f"tp: {name} ({heads}) is not divisible by tp={plan.tp}")
    if model.ffn_size % plan.tp or model.vocab_size % plan.tp:
        raise TrainerUnsupported(f"tp: ffn_size and vocab_size must be divisible by tp={plan.tp}")
    if plan.pp_schedule == "interleaved" and spec.accumulation % plan.pp:
        raise TrainerUnsupported(
            f"global_batch: the interleaved schedule needs micro-batches ({spec.accumulation}) "
            f"divisible by pp={plan.pp}"
        )
    if "lm_head" in plan.modules_to_save and model.tied_embeddings:
        raise TrainerUnsupported(
            "modules_to_save: a trained lm_head copy over tied embeddings is estimate-only in the bundled trainer"
        )
    if plan.offload_activations != "none" and (reason := unmodelled_accumulation(plan, spec.accumulation)):
        raise TrainerUnsupported(f"offload_activations: {reason}")
    if plan.offload_params != "none" and plan.pp > 1:
        raise TrainerUnsupported("offload_params: CPU offload with pipeline parallel is not implemented by the trainer")
