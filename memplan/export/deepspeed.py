"""DeepSpeed: a ``ds_config.json`` for ``deepspeed.initialize`` (or the HF Trainer's ``deepspeed=``).

Keys from the DeepSpeed configuration reference (https://www.deepspeed.ai/docs/config-json/)
and checked against DeepSpeed 0.19.8's own models: ``DeepSpeedZeroConfig``
(runtime/zero/config.py), ``DeepSpeedBF16Config`` / ``DeepSpeedFP16Config``
(runtime/precision_config.py), ``torch_autocast`` and ``data_types`` (runtime/config.py). Bucket
sizes are in elements, as DeepSpeed counts them.

What the JSON cannot carry: pipeline parallelism (``deepspeed.pipe.PipelineModule(num_stages=)``
is code), Ulysses sequence parallelism and MoE expert parallelism (code), tensor parallelism other
than AutoTP (whose sharding of HF modules memplan does not model), fp8 (Transformer Engine),
selective recomputation (HF models checkpoint whole layers). Recomputation and the optimizer are
set in the training code; the export says how in its notes.
"""

from __future__ import annotations

import json
from typing import Any

from memplan.errors import MemplanError
from memplan.export.common import (
    GRADIENT_CLIPPING,
    Exported,
    fields,
    layer_elements,
    layers_per_chunk,
    refuse,
    zero3_live_elements,
)
from memplan.specs.resolve import Job

TARGET = "deepspeed"
# what the JSON's own keys carry back (parse); the rest is code (notes) or refused
CARRIES = frozenset(
    {"dp", "zero", "offload_optimizer", "offload_params", "precision", "micro_batch", "global_batch", "tp", "pp", "cp"}
)
# fp16 dynamic loss scaling: DeepSpeed's documented defaults (DeepSpeedFP16Config), written out
FP16_LOSS_SCALING = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
# ZeRO-Offload runs these optimizers on the host (deepspeed.ops: DeepSpeedCPUAdam, CPUAdagrad, CPULion)
CPU_OPTIMIZERS = {"adamw": "deepspeed.ops.adam.DeepSpeedCPUAdam(model.parameters(), adamw_mode=True)"}
CLIENT_OPTIMIZERS = {
    "adamw": "torch.optim.AdamW(model.parameters(), ...)",
    "sgd": "torch.optim.SGD(model.parameters(), momentum=..., ...)",
    "adafactor": "torch.optim.Adafactor(model.parameters(), ...)",
    "adamw-8bit": "bitsandbytes.optim.AdamW8bit(model.parameters(), ...)",
    "paged-adamw-8bit": "bitsandbytes.optim.PagedAdamW8bit(model.parameters(), ...)",
    "paged-adamw-32bit": "bitsandbytes.optim.PagedAdamW32bit(model.parameters(), ...)",
    "paged-lion-8bit": "bitsandbytes.optim.PagedLion8bit(model.parameters(), ...)",
    "paged-lion-32bit": "bitsandbytes.optim.PagedLion32bit(model.parameters(), ...)",
}


def _check(job: Job) -> None:
    """Refuse what the JSON cannot carry (see the module docstring)."""
    p = job.plan
    if p.pp > 1:
        raise refuse("pp", TARGET, f"pp={p.pp}", "pipeline stages are built in code with deepspeed.pipe.PipelineModule")
    if p.tp > 1:
        raise refuse(
            "tp",
            TARGET,
            f"tp={p.tp}",
            "its JSON carries tensor parallelism only as AutoTP (tensor_parallel.autotp_size), whose sharding of "
            "HF modules memplan does not model; export to megatron or torchtitan",
        )
    if p.cp > 1:
        raise refuse("cp", TARGET, f"cp={p.cp}", "Ulysses sequence parallelism is set up in code, not in the JSON")
    if p.ep > 1:
        raise refuse("ep", TARGET, f"ep={p.ep}", "MoE expert parallelism is set in code (deepspeed.moe.layer.MoE)")
    if p.precision == "fp8":
        raise refuse("precision", TARGET, "precision fp8", "FP8 matmuls need Transformer Engine in the model code")
    if p.precision == "bf16" and p.zero == 0:
        raise refuse(
            "precision",
            TARGET,
            "precision bf16 with zero 0",
            "bf16 without fp32 master weights (bf16_master_weights_and_grads) needs ZeRO stage >= 1",
        )
    if p.recompute in ("selective", "selective-op"):
        raise refuse(
            "recompute",
            TARGET,
            f"recompute {p.recompute}",
            "HF models checkpoint whole decoder layers (gradient_checkpointing_enable); use none or full",
        )
    if p.recompute_layers is not None and p.recompute_layers < layers_per_chunk(job):
        raise refuse(
            "recompute_layers",
            TARGET,
            f"recompute_layers={p.recompute_layers}",
            "HF gradient checkpointing recomputes every decoder layer",
        )
    if p.offload_optimizer != "none" and p.optimizer not in CPU_OPTIMIZERS:
        raise refuse(
            "offload_optimizer",
            TARGET,
            f"offload_optimizer={p.offload_optimizer} with optimizer {p.optimizer}",
            "ZeRO-Offload steps the optimizer on the host with DeepSpeed's CPU optimizers (Adam/AdamW)",
        )


def precision_keys(precision: str, zero: int) -> dict[str, Any]:
    """Precision sections. bf16-master: bf16 params and grads, fp32 master in the optimizer
    (``bf16.enabled``, ``data_types.grad_accum_dtype`` bf16); fp16-master: the same in fp16 with
    dynamic loss scaling; bf16: no fp32 copy (``bf16_master_weights_and_grads``,
    ``bf16_optimizer_states``, ZeRO >= 1); bf16-mixed: fp32 params under ``torch_autocast``."""
    if precision == "bf16-master":
        return {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
    if precision == "fp16-master":
        return {"fp16": {"enabled": True, **FP16_LOSS_SCALING}, "data_types": {"grad_accum_dtype": "fp16"}}
    if precision == "bf16":
        bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
        return {"bf16": bf16, "data_types": {"grad_accum_dtype": "bf16"}}
    if precision == "bf16-mixed":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    return {}  # fp32: no section


def zero_keys(job: Job, nvme_path: str | None) -> dict[str, Any]:
    """``zero_optimization``, sized as the estimate assumes (memplan/costmodel/memory.py):

    - ``reduce_bucket_size`` = one layer's parameters: the reduce buffer holds one layer's
      unsharded gradients; ``allgather_bucket_size`` the same for ZeRO-1/2's parameter all-gather;
    - ``overlap_comm`` false: one bucket at a time (overlapping double-buffers them; DeepSpeed's
      docs put ZeRO-2's footprint at 4.5x the bucket sizes);
    - ZeRO-3: ``stage3_prefetch_bucket_size`` one layer (the prefetched one),
      ``stage3_max_live_parameters`` what the estimate holds gathered (max(2 layers, embedding or
      head + 1 layer)), ``stage3_param_persistence_threshold`` 0 (every parameter sharded, as estimated);
    - ``offload_optimizer`` / ``offload_param`` {device, pin_memory} (``nvme_path`` for NVMe).
    """
    p = job.plan
    if p.zero == 0:
        return {"stage": 0}
    layer = layer_elements(job)
    zero: dict[str, Any] = {
        "stage": p.zero,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "reduce_bucket_size": layer,
    }
    if p.zero < 3:
        zero["allgather_bucket_size"] = layer
    else:
        zero.update(
            stage3_prefetch_bucket_size=layer,
            stage3_max_live_parameters=zero3_live_elements(job),
            stage3_param_persistence_threshold=0,
        )
    for key, device in (("offload_optimizer", p.offload_optimizer), ("offload_param", p.offload_params)):
        if device != "none":
            zero[key] = _offload(device, nvme_path, "offload_params" if key == "offload_param" else key)
    return zero


def _offload(device: str, nvme_path: str | None, field: str) -> dict[str, Any]:
    if device == "nvme" and not nvme_path:
        raise MemplanError(f"plan.{field} is nvme: give the NVMe mount with --nvme-path", field="--nvme-path")
    out: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def notes(job: Job) -> tuple[str, ...]:
    """What the JSON leaves to the training code: recomputation, the optimizer, attention."""
    p = job.plan
    out = []
    if p.recompute == "full":
        out.append(
            "recompute full: call model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False}) on the HF model (Trainer: TrainingArguments(gradient_checkpointing=True))"
        )
    else:
        out.append("recompute none: leave HF gradient checkpointing off")
    if p.offload_optimizer != "none":
        out.append(
            f"optimizer {p.optimizer} on the host: deepspeed.initialize(optimizer={CPU_OPTIMIZERS[p.optimizer]})"
        )
    else:
        out.append(f"optimizer {p.optimizer}: deepspeed.initialize(optimizer={CLIENT_OPTIMIZERS[p.optimizer]})")
    attn = "flash_attention_2" if p.attention == "flash" else "eager"
    out.append(f"attention {p.attention}: from_pretrained(..., attn_implementation='{attn}')")
    out.append(f"sequence length {fields(job)['seq_len']}: the data pipeline's block size")
    return tuple(out)


def export(job: Job, gradient_clipping: float = GRADIENT_CLIPPING, nvme_path: str | None = None) -> Exported:
    """The DeepSpeed JSON of a training job (batch keys: train_batch_size = micro x accumulation x dp)."""
    _check(job)
    f = fields(job)
    p = job.plan
    config: dict[str, Any] = {
        "train_batch_size": f["global_batch"],
        "train_micro_batch_size_per_gpu": f["micro_batch"],
        "gradient_accumulation_steps": f["gradient_accumulation"],
        **precision_keys(p.precision, p.zero),
        "zero_optimization": zero_keys(job, nvme_path),
        "gradient_clipping": gradient_clipping,
    }
    if p.zero > 0 and p.optimizer != "adamw":
        config["zero_allow_untested_optimizer"] = True  # ZeRO checks client optimizers against a list
    return Exported(target=TARGET, text=json.dumps(config, indent=2) + "\n", suffix=".json", notes=notes(job))


def parse(text: str) -> dict[str, Any]:
    """The plan fields a DeepSpeed JSON carries, read back (the inverse of :func:`export`)."""
    cfg = json.loads(text)
    zero = cfg.get("zero_optimization", {})
    micro, accumulation = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    bf16, fp16 = cfg.get("bf16", {}), cfg.get("fp16", {})
    if bf16.get("enabled"):
        precision = "bf16" if bf16.get("bf16_master_weights_and_grads") else "bf16-master"
    elif fp16.get("enabled"):
        precision = "fp16-master"
    elif cfg.get("torch_autocast", {}).get("enabled"):
        precision = "bf16-mixed"
    else:
        precision = "fp32"
    return {
        "dp": cfg["train_batch_size"] // (micro * accumulation),
        "tp": cfg.get("tensor_parallel", {}).get("autotp_size", 0) or 1,
        "pp": 1,
        "cp": cfg.get("sequence_parallel_size", 1),
        "zero": zero.get("stage", 0),
        "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none"),
        "offload_params": zero.get("offload_param", {}).get("device", "none"),
        "precision": precision,
        "micro_batch": micro,
        "global_batch": cfg["train_batch_size"],
    }
