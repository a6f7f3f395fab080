"""Hugging Face ``Trainer`` / TRL ``SFTTrainer``: one YAML with the kwargs of every class a
fine-tuning script builds.

Sections (each the keyword arguments of one class, checked by constructing it with transformers
5.23, PEFT 0.21 and bitsandbytes 0.50 in the tests):

- ``model``: ``AutoModelForCausalLM.from_pretrained(**model, quantization_config=...)``
  (``dtype``, ``attn_implementation``: ``sdpa`` for memplan's ``flash``, whose kernel SDPA picks); the
  notes pass each rank's ``device_map`` for ``model_build: from_pretrained`` (without ZeRO, or under FSDP
  given so), none for ``to_device`` (the Trainer moves the model; under FSDP ``cpu_ram_efficient_loading``
  shards it from the CPU, ``export.common.fsdp_cpu_load``);
- ``quantization``: ``transformers.BitsAndBytesConfig`` (only with a quantized base);
- ``lora``: ``peft.LoraConfig`` (only with adapters; ``lora_alpha`` = 2r is a learning-rate
  scale, not a memory parameter);
- ``training_arguments``: ``transformers.TrainingArguments`` (batch, accumulation, gradient
  checkpointing, precision, ``optim``, ``max_grad_norm`` and, for ZeRO, the DeepSpeed config
  ``--to deepspeed`` writes, inline, or FSDP2 through ``fsdp`` / ``fsdp_config``);
- ``sft``: the keys TRL's ``SFTConfig`` adds to them (``max_length``, ``activation_offloading``,
  ``loss_type``): ``SFTConfig(**training_arguments, **sft)``;
- ``launch``: ``torchrun --nnodes --nproc-per-node``.

Sharding: ZeRO-1/2/3 and the fp32-master precisions (``bf16-master``, ``fp16-master``) go to
DeepSpeed; ``sharding="fsdp"`` writes ZeRO-2/3 as FSDP2 instead (fp32 or bf16-mixed, as
``--to accelerate``). Without ZeRO the Trainer runs DDP.

Not expressible: tensor, pipeline, context and expert parallelism (the Trainer shards only
through DeepSpeed ZeRO or FSDP), fp8, selective or partial recomputation (HF checkpoints whole
decoder layers), NVMe offload (export ``--to deepspeed --nvme-path`` and point
``training_arguments.deepspeed`` at that file), an 8-bit base under ZeRO-3 or FSDP.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from memplan.errors import MemplanError
from memplan.export import deepspeed
from memplan.export.common import (
    GRADIENT_CLIPPING,
    Exported,
    autocast_off,
    comment_block,
    finetune_fields,
    fsdp_cpu_load,
    hf_attention,
    hf_layer_class,
    hf_model_id,
    layers_per_chunk,
    lora_defaults,
    preamble,
    refuse,
    refuse_autocast_sharded,
)
from memplan.specs.plan import ALL_LINEAR, Plan, checkpoint_reentrant
from memplan.specs.resolve import Job

TARGET = "hf-trainer"
FINETUNE = True  # carries finetune / quant / offload_activations (render refuses them for other targets)
CARRIES = frozenset(
    {
        "gpus", "nodes", "dp", "tp", "pp", "cp", "ep", "zero", "offload_optimizer", "offload_params", "recompute",
        "precision", "optimizer", "attention", "micro_batch", "global_batch", "seq_len", "finetune", "lora_rank",
        "lora_targets", "lora_dropout", "modules_to_save", "lora_dora", "quant", "double_quant", "offload_activations",
        "autocast", "use_reentrant",
    }
)  # fmt: skip
SHARDING = ("deepspeed", "fsdp")
REENTRANT = "use_reentrant"
MASTER = ("bf16-master", "fp16-master")  # fp32 master weights: only DeepSpeed's optimizer wrappers keep them
# TrainingArguments.optim (transformers' OptimizerNames): bitsandbytes' paged optimizers by their own names
# (transformers/trainer_optimizer.py: "paged" in the name -> is_paged, "8bit" -> optim_bits=8)
OPTIM = {
    "adamw": "adamw_torch",
    "adamw-8bit": "adamw_bnb_8bit",
    "sgd": "sgd",
    "adafactor": "adafactor",
    "paged-adamw-8bit": "paged_adamw_8bit",
    "paged-adamw-32bit": "paged_adamw_32bit",
    "paged-lion-8bit": "paged_lion_8bit",
    "paged-lion-32bit": "paged_lion_32bit",
}
OPTIM_BACK = {**{v: k for k, v in OPTIM.items()}, "adamw_torch_fused": "adamw", "adamw_8bit": "adamw-8bit"}
ATTENTION = {"flash": "sdpa", "eager": "eager"}
ATTENTION_BACK = {"sdpa": "flash", "flash_attention_2": "flash", "eager": "eager"}
# (bf16, fp16, model dtype) per backend and precision
PRECISION = {
    "none": {
        "fp32": (False, False, "float32"),
        "bf16-mixed": (True, False, "float32"),
        "bf16": (True, False, "bfloat16"),
    },
    # bf16-mixed under DeepSpeed is its torch_autocast section: TrainingArguments(bf16=True) would make
    # Accelerate add bf16.enabled (bf16 weights with fp32 master, another plan)
    "deepspeed": {
        "fp32": (False, False, "float32"),
        "bf16-mixed": (False, False, "float32"),
        "bf16-master": (True, False, "bfloat16"),
        "fp16-master": (False, True, "float16"),
        "bf16": (True, False, "bfloat16"),
    },
    # FSDP2 under Accelerate upcasts trainable parameters to fp32 when mixed precision is on
    "fsdp": {"fp32": (False, False, "float32"), "bf16-mixed": (True, False, "float32")},
}
COMPUTE_DTYPE = {"fp32": "float32", "fp16-master": "float16"}  # the rest compute in bfloat16


def backend(job: Job, target: str, sharding: str | None) -> str:
    """How the Trainer shards the plan: ``none`` (DDP), ``deepspeed`` or ``fsdp``."""
    p = job.plan
    if sharding is not None and sharding not in SHARDING:
        raise MemplanError(f"unknown sharding {sharding!r} ({', '.join(SHARDING)})", field="--sharding")
    if sharding == "fsdp":
        if p.zero < 2:
            raise refuse(
                "zero",
                target,
                f"zero={p.zero} with FSDP",
                "FSDP shards gradients (ZeRO-2) or gradients and parameters (ZeRO-3); use zero 2 or 3, or "
                "--sharding deepspeed",
            )
        if p.precision not in PRECISION["fsdp"]:
            raise refuse(
                "precision",
                target,
                f"precision {p.precision} with FSDP",
                "FSDP2 keeps fp32 sharded parameters (fp32, or bf16-mixed); --sharding deepspeed keeps bf16 weights",
            )
        if p.offload_params != p.offload_optimizer:
            field = "offload_params" if p.offload_params == "none" else "offload_optimizer"
            raise refuse(
                field,
                target,
                f"offload_params={p.offload_params} with offload_optimizer={p.offload_optimizer} under FSDP",
                "FSDP2's CPU offload moves parameters, gradients and the optimizer step together",
            )
        return "fsdp"
    if sharding is None and p.zero == 0 and p.precision not in MASTER:
        return "none"
    return "deepspeed"


def check(job: Job, target: str, sharding: str | None) -> str:
    """Refuse what the Trainer (and the DeepSpeed or FSDP config under it) cannot say; the backend."""
    p = job.plan
    degrees = {
        "tp": "tensor parallelism (the Trainer shards through DeepSpeed ZeRO or FSDP only; export to torchtitan or "
        "megatron)",
        "pp": "pipeline stages",
        "cp": "context parallelism",
        "ep": "expert parallelism",
    }
    for field, what in degrees.items():
        if getattr(p, field) > 1:
            raise refuse(field, target, f"{field}={getattr(p, field)}", f"the Trainer has no {what}")
    if p.precision == "fp8":
        raise refuse("precision", target, "precision fp8", "the Trainer's precision flags are bf16 and fp16")
    if p.recompute in ("selective", "selective-op"):
        raise refuse(
            "recompute",
            target,
            f"recompute {p.recompute}",
            "gradient checkpointing recomputes whole decoder layers; use none or full",
        )
    if p.recompute_layers is not None and p.recompute_layers < layers_per_chunk(job):
        raise refuse(
            "recompute_layers",
            target,
            f"recompute_layers={p.recompute_layers}",
            "gradient checkpointing recomputes every decoder layer",
        )
    if "nvme" in (p.offload_params, p.offload_optimizer):
        field = "offload_params" if p.offload_params == "nvme" else "offload_optimizer"
        raise refuse(
            field,
            target,
            "NVMe offload",
            "the NVMe mount is machine-specific: export --to deepspeed --nvme-path and point the trainer's "
            "deepspeed key at that file",
        )
    refuse_autocast_sharded(p, target)
    kind = backend(job, target, sharding)
    if p.quant == "int8" and (kind == "fsdp" or p.zero == 3):
        raise refuse(
            "quant",
            target,
            f"an int8 base with {'FSDP' if kind == 'fsdp' else 'ZeRO-3'}",
            "bitsandbytes' 8-bit weights cannot be sharded; use nf4 / fp4 or zero <= 2",
        )
    if p.offload_optimizer != "none" and kind == "deepspeed" and p.optimizer != "adamw":
        raise refuse(
            "offload_optimizer",
            target,
            f"offload_optimizer={p.offload_optimizer} with optimizer {p.optimizer}",
            "ZeRO-Offload steps the optimizer on the host with DeepSpeed's CPU Adam",
        )
    return kind


def deepspeed_config(job: Job, gradient_clipping: float) -> dict[str, Any]:
    """The JSON ``--to deepspeed`` writes, as a dict; with optimizer offload, an ``optimizer``
    section so that DeepSpeed builds its CPU Adam (a Trainer-built torch AdamW is refused under
    ZeRO-Offload), its hyperparameters ``auto`` (filled from TrainingArguments)."""
    ds = json.loads(deepspeed.export(job, gradient_clipping=gradient_clipping).text)
    if job.plan.offload_optimizer != "none":
        params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
        ds["optimizer"] = {"type": "AdamW", "params": params}
    return ds


def fsdp_config(job: Job, target: str) -> dict[str, Any]:
    """FSDP2 as transformers' ``fsdp_config`` takes it (TrainingArguments._process_fsdp_args)."""
    p = job.plan
    return {
        "version": 2,
        "reshard_after_forward": p.zero == 3,
        "cpu_offload": p.offload_params == "cpu",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": [hf_layer_class(job, target)],
        "activation_checkpointing": p.recompute == "full",
        "cpu_ram_efficient_loading": fsdp_cpu_load(job),
        "state_dict_type": "SHARDED_STATE_DICT",
    }


def quantization(job: Job, kind: str, dtype: str) -> dict[str, Any] | None:
    """``transformers.BitsAndBytesConfig`` kwargs, or None for an unquantized base. Under ZeRO-3 or
    FSDP the 4-bit weights are stored as the model dtype (``bnb_4bit_quant_storage``) so that they
    shard with the rest; the bytes are the same."""
    p = job.plan
    if p.quant == "none":
        return None
    if p.quant == "int8":
        return {"load_in_8bit": True}
    out: dict[str, Any] = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": p.quant,
        "bnb_4bit_use_double_quant": p.double_quant,
        "bnb_4bit_compute_dtype": COMPUTE_DTYPE.get(p.precision, "bfloat16"),
    }
    if kind == "fsdp" or p.zero == 3:
        out["bnb_4bit_quant_storage"] = dtype
    return out


def lora(job: Job) -> dict[str, Any] | None:
    """``peft.LoraConfig`` kwargs, or None for a full fine-tune."""
    p = job.plan
    if p.finetune == "full":
        return None
    targets: str | list[str] = ALL_LINEAR if p.lora_targets == (ALL_LINEAR,) else list(p.lora_targets)
    return {
        "r": p.lora_rank,
        "lora_alpha": 2 * p.lora_rank,  # a scale on the adapters' output, not a memory parameter
        "target_modules": targets,
        "lora_dropout": p.lora_dropout,
        "modules_to_save": list(p.modules_to_save) or None,
        "use_dora": p.lora_dora,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


def unused_parameters_off(p: Plan, kind: str) -> bool:
    """Whether the export sets ``ddp_find_unused_parameters: false``: a PEFT model under DDP (``kind`` "none", more
    than one rank) and torch's reentrant checkpoint, where the Trainer's ``find_unused_parameters=True`` fails in the
    first backward; the run estimated has it off (``timeline/hf_ddp.wrap``)."""
    return kind == "none" and p.dp > 1 and p.finetune != "full" and checkpoint_reentrant(p, "hf")


def config(job: Job, sharding: str | None = None, gradient_clipping: float = GRADIENT_CLIPPING) -> dict[str, Any]:
    """The YAML's mapping, section by section (see the module docstring)."""
    kind = check(job, TARGET, sharding)
    p, f = job.plan, finetune_fields(job)
    bf16, fp16, dtype = PRECISION[kind][_precision_for(job, kind)]
    bf16 = bf16 and not autocast_off(job)  # a bfloat16 model trained as it is
    args: dict[str, Any] = {
        "per_device_train_batch_size": f["micro_batch"],
        "gradient_accumulation_steps": f["gradient_accumulation"],
        "gradient_checkpointing": p.recompute == "full" and kind != "fsdp",
        "bf16": bf16,
        "fp16": fp16,
        "optim": OPTIM[p.optimizer],
        "max_grad_norm": gradient_clipping,
    }
    if args["gradient_checkpointing"]:
        # what the plan's checkpoint is (the Trainer's default: False; specs.plan.checkpoint_reentrant)
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": checkpoint_reentrant(p, "hf")}
        if unused_parameters_off(p, kind):
            args["ddp_find_unused_parameters"] = False
    if kind == "deepspeed":
        args["deepspeed"] = deepspeed_config(job, gradient_clipping)
    elif kind == "fsdp":
        args["fsdp"] = True
        args["fsdp_config"] = fsdp_config(job, TARGET)
    model = {
        "pretrained_model_name_or_path": hf_model_id(job) or job.model.name,
        "dtype": dtype,
        "attn_implementation": hf_attention(job),
    }
    out: dict[str, Any] = {"launch": {"nnodes": f["nodes"], "nproc_per_node": f["gpus"] // f["nodes"]}}
    out["model"] = model
    quant = quantization(job, kind, dtype)
    if quant is not None:
        out["quantization"] = quant
    adapters = lora(job)
    if adapters is not None:
        out["lora"] = adapters
    out["training_arguments"] = args
    out["sft"] = {
        "max_length": f["seq_len"],
        "activation_offloading": p.offload_activations == "cpu",
        "loss_type": "nll",  # full logits, as estimated (TRL's chunked_nll keeps fewer)
    }
    return out


def _precision_for(job: Job, kind: str) -> str:
    precision = job.plan.precision
    if precision not in PRECISION[kind]:  # only "none" lacks some: master precisions go to DeepSpeed
        raise refuse("precision", TARGET, f"precision {precision}", "no Trainer flag for it without DeepSpeed")
    return precision


def notes(job: Job, kind: str) -> tuple[str, ...]:
    """What the script must do with the sections."""
    p, f = job.plan, finetune_fields(job)
    extra = ["quantization_config=BitsAndBytesConfig(**quantization)"] if p.quant != "none" else []
    on_gpu = kind == "fsdp" and not fsdp_cpu_load(job)  # FSDP over a model loaded onto each rank's GPU
    if kind == "none" and p.model_build == "from_pretrained" or on_gpu:  # ZeRO-3 / FSDP load without one
        extra.append("device_map={'': int(os.environ.get('LOCAL_RANK', 0))}")
    out = [
        f"model: AutoModelForCausalLM.from_pretrained({', '.join(['**model', *extra])})"
        + ("" if hf_model_id(job) else f" (replace {job.model.name!r} with the model's Hub id or path)"),
    ]
    if kind == "none" and p.model_build == "to_device":
        out.append(
            "model_build to_device: load without a device map; the Trainer moves the model to the GPU (model.to), one "
            "allocation per parameter, as estimated"
        )
    elif kind == "none":
        out.append(
            "model_build from_pretrained: the device_map makes transformers warm the caching allocator with one "
            "segment the size of the weights and load them into it, as estimated"
        )
    elif kind == "fsdp" and fsdp_cpu_load(job):
        out.append(
            "FSDP: load without a device map (rank 0 on the CPU, the others on the meta device under "
            "cpu_ram_efficient_loading); accelerate's prepare shards it onto the GPUs one parameter at a time"
        )
    elif kind == "fsdp":
        out.append(
            "model_build from_pretrained under FSDP: each rank loads the whole model onto its GPU (the device_map) "
            "and fully_shard shards it there, as estimated (cpu_ram_efficient_loading off)"
        )
    if p.quant != "none":
        out.append(
            "quantized base: model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing="
            f"{p.recompute == 'full'}, gradient_checkpointing_kwargs="
            f"{{'{REENTRANT}': {checkpoint_reentrant(p, 'hf')}}}) "
            "before get_peft_model (it calls model.enable_input_require_grads() and casts the unquantized weights, "
            "embeddings, norms and head, to fp32, as estimated)"
        )
    elif p.finetune != "full" and p.recompute == "full":
        out.append(
            "frozen base with gradient checkpointing: model.enable_input_require_grads() before get_peft_model "
            "(the checkpointed layers need an input that requires grad)"
        )
    if p.finetune != "full":
        out.append(
            "adapters: model = peft.get_peft_model(model, LoraConfig(**lora)) (PEFT's default "
            "autocast_adapter_dtype=True keeps them fp32, as estimated)"
        )
    out.append(
        "trainer: SFTTrainer(model, args=SFTConfig(**training_arguments, **sft), ...) (TRL), or "
        f"Trainer(model, args=TrainingArguments(**training_arguments), ...) with sequences of {f['seq_len']} tokens "
        "(sft.max_length) from the data collator"
    )
    if p.offload_activations == "cpu":
        out.append(
            "offload_activations cpu: SFTConfig(activation_offloading=True); a plain Trainer has no such argument: "
            "run its loss under torch.autograd.graph.save_on_cpu(pin_memory=True)"
        )
    out.append(
        f"launch: torchrun --nnodes {f['nodes']} --nproc-per-node {f['gpus'] // f['nodes']} train.py "
        f"(global batch {f['global_batch']} = {f['micro_batch']} x {p.dp} ranks x {f['gradient_accumulation']} "
        "accumulation steps)"
    )
    return tuple(out)


def export(job: Job, sharding: str | None = None, gradient_clipping: float = GRADIENT_CLIPPING) -> Exported:
    cfg = config(job, sharding, gradient_clipping)
    kind = check(job, TARGET, sharding)
    text = comment_block(preamble(job, TARGET, notes(job, kind))) + yaml.safe_dump(cfg, sort_keys=False)
    return Exported(target=TARGET, text=text, suffix=".yaml", notes=notes(job, kind))


def parse(text: str) -> dict[str, Any]:
    """The plan fields the YAML carries, read back (the inverse of :func:`export`)."""
    cfg = yaml.safe_load(text)
    args = cfg["training_arguments"]
    launch = cfg.get("launch") or {}
    nodes = launch.get("nnodes", 1)
    gpus = nodes * launch.get("nproc_per_node", 1)
    micro, accumulation = args["per_device_train_batch_size"], args.get("gradient_accumulation_steps", 1)
    zero, offload_opt, offload_par = 0, "none", "none"
    ds = args.get("deepspeed")
    fsdp = args.get("fsdp_config") if args.get("fsdp") else None
    recompute = bool(args.get("gradient_checkpointing"))
    dtype = cfg["model"].get("dtype", "float32")
    if isinstance(ds, dict):
        back = deepspeed.parse(json.dumps(ds))
        zero, offload_opt, offload_par = back["zero"], back["offload_optimizer"], back["offload_params"]
        precision = back["precision"]
    elif fsdp is not None:
        zero = 3 if fsdp.get("reshard_after_forward", True) else 2
        offload_opt = offload_par = "cpu" if fsdp.get("cpu_offload") else "none"
        recompute = recompute or bool(fsdp.get("activation_checkpointing"))
        precision = "bf16-mixed" if args.get("bf16") else "fp32"
    else:
        precision = "bf16" if dtype == "bfloat16" else ("bf16-mixed" if args.get("bf16") else "fp32")
    dp = gpus
    out = {
        "gpus": gpus,
        "nodes": nodes,
        "dp": dp,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "zero": zero,
        "offload_optimizer": offload_opt,
        "offload_params": offload_par,
        "recompute": "full" if recompute else "none",
        "precision": precision,
        # a bfloat16 model without bf16=True: the plain Trainer runs no autocast
        "autocast": False if precision == "bf16" and not (ds or fsdp is not None or args.get("bf16")) else None,
        "optimizer": OPTIM_BACK[args.get("optim", "adamw_torch")],
        "attention": ATTENTION_BACK[cfg["model"].get("attn_implementation", "sdpa")],
        "micro_batch": micro,
        "global_batch": micro * dp * accumulation,
        "seq_len": (cfg.get("sft") or {}).get("max_length"),
        "offload_activations": "cpu" if (cfg.get("sft") or {}).get("activation_offloading") else "none",
        # the Trainer's default (False) reads back as the plan's (None)
        "use_reentrant": True
        if recompute and (args.get("gradient_checkpointing_kwargs") or {}).get(REENTRANT)
        else None,
    }
    out.update(parse_finetune(cfg.get("lora"), cfg.get("quantization")))
    return out


def parse_finetune(lora_cfg: dict[str, Any] | None, quant_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """Fine-tuning fields from LoraConfig and BitsAndBytesConfig kwargs."""
    quant, double = "none", False
    if quant_cfg:
        if quant_cfg.get("load_in_8bit"):
            quant = "int8"
        elif quant_cfg.get("load_in_4bit"):
            quant = quant_cfg.get("bnb_4bit_quant_type", "fp4")  # BitsAndBytesConfig's default
            double = bool(quant_cfg.get("bnb_4bit_use_double_quant", False))
    if not lora_cfg:
        return {"finetune": "full", **lora_defaults(), "quant": quant, "double_quant": double}
    targets = lora_cfg["target_modules"]
    return {
        "finetune": "qlora" if quant in ("nf4", "fp4") else "lora",
        "lora_rank": lora_cfg["r"],
        "lora_targets": (targets,) if isinstance(targets, str) else tuple(targets),
        "lora_dropout": lora_cfg.get("lora_dropout", 0.0),
        "modules_to_save": tuple(lora_cfg.get("modules_to_save") or ()),
        "lora_dora": bool(lora_cfg.get("use_dora", False)),
        "quant": quant,
        "double_quant": double,
    }
