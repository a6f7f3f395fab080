"""Hugging Face Accelerate: a config YAML for ``accelerate launch --config_file`` with FSDP2.

Keys from Accelerate's ``ClusterConfig`` (accelerate/commands/config/config_args.py) and the
``fsdp_config`` / ``parallelism_config`` questions of ``accelerate config``
(commands/config/cluster.py), as ``accelerate launch`` turns them into the FSDP plugin's
environment (utils/launch.py ``prepare_multi_gpu_env``); checked with Accelerate 1.15.

Mapping: ZeRO-3 / ZeRO-2 = FSDP2 with ``fsdp_reshard_after_forward`` true / false (FSDP2 keeps
the sharded parameters as the parameters, the estimate's ``memplan`` runtime); CPU offload =
``fsdp_offload_params`` (FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer
step together); full recomputation = ``fsdp_activation_checkpointing`` on every decoder layer;
bf16-mixed = ``mixed_precision: bf16`` (fp32 sharded parameters, bf16 compute); context
parallelism = ``parallelism_config_cp_size`` (FSDP over dp x cp, as the estimate shards ZeRO state).

Not expressible: pipeline parallelism, expert parallelism, ZeRO-0/1 (FSDP always shards
gradients), tensor parallelism (transformers' tp_plan, whose layout memplan does not model),
offloading only one of parameters / optimizer, NVMe, selective or partial recomputation,
bf16 / fp16 parameters with fp32 master weights, fp8.
"""

from __future__ import annotations

from typing import Any

import yaml

from memplan.export.common import (
    Exported,
    comment_block,
    fields,
    fsdp_cpu_load,
    hf_layer_class,
    layers_per_chunk,
    preamble,
    refuse,
)
from memplan.specs.resolve import Job

TARGET = "accelerate"
CARRIES = frozenset(
    {"gpus", "nodes", "dp", "cp", "tp", "pp", "zero", "offload_optimizer", "offload_params", "recompute", "precision"}
)
MIXED_PRECISION = {"fp32": "no", "bf16-mixed": "bf16"}


def _check(job: Job) -> None:
    p = job.plan
    lost = {
        "pp": (p.pp > 1, f"pp={p.pp}", "Accelerate's FSDP has no pipeline stages"),
        "ep": (p.ep > 1, f"ep={p.ep}", "Accelerate's FSDP has no expert parallelism"),
        "tp": (
            p.tp > 1,
            f"tp={p.tp}",
            "Accelerate's tensor parallelism applies transformers' tp_plan, whose layout (the embedding stays "
            "replicated) memplan does not model; export to torchtitan or megatron",
        ),
        "zero": (
            p.zero < 2,
            f"zero={p.zero}",
            "FSDP always shards gradients (ZeRO-2) or gradients and parameters (ZeRO-3); use zero 2 or 3, or export "
            "to deepspeed",
        ),
        "precision": (
            p.precision not in MIXED_PRECISION,
            f"precision {p.precision}",
            "Accelerate's FSDP keeps fp32 sharded parameters: fp32 (mixed_precision no) or bf16-mixed (bf16)",
        ),
        "recompute": (
            p.recompute in ("selective", "selective-op"),
            f"recompute {p.recompute}",
            "fsdp_activation_checkpointing recomputes whole decoder layers; use none or full",
        ),
    }
    for field, (bad, what, why) in lost.items():
        if bad:
            raise refuse(field, TARGET, what, why)
    if p.recompute_layers is not None and p.recompute_layers < layers_per_chunk(job):
        raise refuse(
            "recompute_layers",
            TARGET,
            f"recompute_layers={p.recompute_layers}",
            "fsdp_activation_checkpointing checkpoints every decoder layer",
        )
    if "nvme" in (p.offload_params, p.offload_optimizer):
        field = "offload_params" if p.offload_params == "nvme" else "offload_optimizer"
        raise refuse(field, TARGET, "NVMe offload", "FSDP2 offloads to CPU memory only")
    if p.offload_params != p.offload_optimizer:
        field = "offload_params" if p.offload_params == "none" else "offload_optimizer"
        raise refuse(
            field,
            TARGET,
            f"offload_params={p.offload_params} with offload_optimizer={p.offload_optimizer}",
            "FSDP2's CPUOffloadPolicy (fsdp_offload_params) moves parameters, gradients and the optimizer step "
            "together; set both to cpu or both to none",
        )


def config(job: Job) -> dict[str, Any]:
    """The YAML's mapping (every key one ``accelerate config`` writes for FSDP2)."""
    _check(job)
    p, f = job.plan, fields(job)
    fsdp = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": p.zero == 3,
        "fsdp_offload_params": p.offload_params == "cpu",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": hf_layer_class(job, TARGET),
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": fsdp_cpu_load(job),
        # accelerate launch requires it with cpu_ram_efficient_loading
        "fsdp_sync_module_states": fsdp_cpu_load(job),
        "fsdp_activation_checkpointing": p.recompute == "full",
    }
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "FSDP",
        "downcast_bf16": "no",
        "fsdp_config": fsdp,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": MIXED_PRECISION[p.precision],
        "num_machines": f["nodes"],
        "num_processes": f["gpus"],
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if p.cp > 1:
        out["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": p.dp,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": p.cp,
            "parallelism_config_cp_backend": "torch",
        }
    return out


def notes(job: Job) -> tuple[str, ...]:
    f = fields(job)
    p = job.plan
    attn = "flash_attention_2" if p.attention == "flash" else "eager"
    return (
        f"micro-batch {f['micro_batch']} sequences of {f['seq_len']} tokens per process: the DataLoader's batch_size",
        f"gradient accumulation {f['gradient_accumulation']}: Accelerator(gradient_accumulation_steps="
        f"{f['gradient_accumulation']}) (global batch {f['global_batch']})",
        f"optimizer {p.optimizer}: created in the training script (the config has no optimizer key)",
        f"attention {p.attention}: from_pretrained(..., attn_implementation='{attn}')",
    )


def export(job: Job) -> Exported:
    text = comment_block(preamble(job, TARGET, notes(job))) + yaml.safe_dump(config(job), sort_keys=True)
    return Exported(target=TARGET, text=text, suffix=".yaml", notes=notes(job))


def parse(text: str) -> dict[str, Any]:
    """The plan fields an Accelerate FSDP2 config carries, read back."""
    cfg = yaml.safe_load(text)
    fsdp = cfg["fsdp_config"]
    par = cfg.get("parallelism_config") or {}
    cp = par.get("parallelism_config_cp_size", 1)
    offload = "cpu" if fsdp.get("fsdp_offload_params") else "none"
    return {
        "gpus": cfg["num_processes"],
        "nodes": cfg["num_machines"],
        "dp": par.get("parallelism_config_dp_shard_size", cfg["num_processes"] // cp),
        "cp": cp,
        "tp": par.get("parallelism_config_tp_size", 1),
        "pp": 1,
        "zero": 3 if fsdp["fsdp_reshard_after_forward"] else 2,
        "offload_params": offload,
        "offload_optimizer": offload,
        "recompute": "full" if fsdp.get("fsdp_activation_checkpointing") else "none",
        "precision": {v: k for k, v in MIXED_PRECISION.items()}[cfg["mixed_precision"]],
    }
