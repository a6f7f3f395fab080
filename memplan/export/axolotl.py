"""Axolotl: a config YAML for ``axolotl train``.

Keys from axolotl's config schema (``src/axolotl/utils/schemas/``: ``config.py``
``AxolotlInputConfig``, ``peft.py`` ``LoraConfig``, ``training.py``, ``model.py``, ``fsdp.py``
``FSDPConfig``) and its docs (docs/config-reference.qmd, docs/lora.qmd, docs/multi-gpu.qmd,
docs/mixed_precision.qmd), read at axolotl-ai-cloud/axolotl 067b021c (July 2026). Axolotl does not
install here (it pins its own torch); the tests check the keys against that list.

Mapping: ``adapter`` lora / qlora (a 4-bit base is ``qlora`` with ``load_in_4bit``, an 8-bit one
``lora`` with ``load_in_8bit``, as axolotl's validation requires), ``lora_r``, ``lora_alpha`` (2r:
a scale, not a memory parameter), ``lora_dropout``, ``lora_target_linear`` (all-linear) or
``lora_target_modules``, ``lora_modules_to_save``; the 4-bit type and double quantization through
``bnb_config_kwargs`` (axolotl's defaults are nf4 with double quantization); ``sequence_len`` with
``pad_to_sequence_len`` (every step at the estimated shape), ``micro_batch_size``,
``gradient_accumulation_steps``, ``gradient_checkpointing``, ``activation_offloading``,
``bf16`` / ``fp16``, ``optimizer``, ``max_grad_norm``, ``attn_implementation`` (sdpa / eager);
ZeRO as the ``deepspeed`` config ``--to deepspeed`` writes, inline (the key takes a path or a
dict), or with ``sharding="fsdp"`` FSDP2 (``fsdp_version: 2``, ``fsdp_config``).

Precision: axolotl loads the weights in bf16 whenever ``bf16`` is on (its ``torch_dtype``), so
``bf16: true`` is the plan's ``bf16`` (bf16 weights and optimizer states) and bf16-mixed (fp32
weights under autocast) exists only as DeepSpeed's ``torch_autocast`` (``bf16: false``) or FSDP2
(Accelerate upcasts the trainable weights to fp32). ``bf16-master`` / ``fp16-master`` are
DeepSpeed's ``bf16`` / ``fp16`` sections. A bfloat16 model trained without autocast (``bf16`` with
the plan's ``autocast`` off) is ``bfloat16: true`` with ``bf16: false``: the schema's non-AMP switch
(``AxolotlInputConfig.bfloat16``, "for non-AMP cases"), which sets ``torch_dtype`` as ``bf16`` does
(``utils/config/__init__.py``: ``if cfg.bf16 or cfg.bfloat16: cfg.torch_dtype = torch.bfloat16``).

Not expressible, beyond what the Trainer under it cannot do (memplan.export.hf_trainer): axolotl's
own tensor and context parallelism (transformers' tp_plan and ring attention, whose layouts
memplan does not model), bf16-mixed without ZeRO, an 8-bit base without a 16-bit precision
(axolotl loads it in float16).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from memplan.export import deepspeed
from memplan.export.common import (
    GRADIENT_CLIPPING,
    Exported,
    autocast_off,
    comment_block,
    finetune_fields,
    fsdp_cpu_load,
    header_world,
    hf_attention,
    hf_layer_class,
    hf_model_id,
    lora_defaults,
    preamble,
    refuse,
)
from memplan.export.hf_trainer import (
    ATTENTION_BACK,
    COMPUTE_DTYPE,
    OPTIM,
    OPTIM_BACK,
    deepspeed_config,
    unused_parameters_off,
)
from memplan.export.hf_trainer import CARRIES as TRAINER_CARRIES
from memplan.export.hf_trainer import check as trainer_check
from memplan.specs.plan import ALL_LINEAR, checkpoint_reentrant
from memplan.specs.resolve import Job

TARGET = "axolotl"
FINETUNE = True
CARRIES = TRAINER_CARRIES  # the same plan fields as hf-trainer: axolotl drives the same Trainer
# (bf16, fp16) per backend and precision; axolotl's torch_dtype follows them (bf16 > fp16 > fp32)
PRECISION = {
    "none": {"fp32": (False, False), "bf16": (True, False)},
    "deepspeed": {
        "fp32": (False, False),
        "bf16-mixed": (False, False),  # DeepSpeed's torch_autocast over fp32 weights
        "bf16-master": (True, False),
        "fp16-master": (False, True),
        "bf16": (True, False),
    },
    "fsdp": {"fp32": (False, False), "bf16-mixed": (True, False)},
}


def check(job: Job, sharding: str | None) -> str:
    """The Trainer's refusals under axolotl's name, and axolotl's own; the backend."""
    kind = trainer_check(job, TARGET, sharding)
    p = job.plan
    if p.precision not in PRECISION[kind]:
        raise refuse(
            "precision",
            TARGET,
            f"precision {p.precision} without ZeRO",
            "axolotl loads the weights in bf16 whenever bf16 is on (that is precision bf16); fp32 weights under bf16 "
            "autocast need zero >= 1 (DeepSpeed's torch_autocast, or --sharding fsdp)",
        )
    bf16, fp16 = PRECISION[kind][p.precision]
    if p.quant == "int8" and not (bf16 or fp16):  # bfloat16 (autocast off) loads it in bf16 too
        raise refuse(
            "precision",
            TARGET,
            f"an int8 base with precision {p.precision}",
            "axolotl loads an 8-bit base in float16 unless bf16 is on; use a bf16 precision",
        )
    return kind


def _dtype(bf16: bool, fp16: bool) -> str:
    return "bfloat16" if bf16 else "float16" if fp16 else "float32"


def config(job: Job, sharding: str | None = None, gradient_clipping: float = GRADIENT_CLIPPING) -> dict[str, Any]:
    """The YAML's mapping (see the module docstring)."""
    kind = check(job, sharding)
    p, f = job.plan, finetune_fields(job)
    bf16, fp16 = PRECISION[kind][p.precision]
    out: dict[str, Any] = {"base_model": hf_model_id(job) or job.model.name}
    off = autocast_off(job)  # bf16 weights without AMP: axolotl's bfloat16 (its torch_dtype), bf16 off
    if p.quant == "int8":
        out["load_in_8bit"] = True
    elif p.quant != "none":
        out["load_in_4bit"] = True
        bnb = {
            "bnb_4bit_quant_type": p.quant,
            "bnb_4bit_use_double_quant": p.double_quant,
            "bnb_4bit_compute_dtype": COMPUTE_DTYPE.get(p.precision, "bfloat16"),
        }
        if kind == "fsdp" or p.zero == 3:
            bnb["bnb_4bit_quant_storage"] = _dtype(bf16, fp16)
        out["bnb_config_kwargs"] = bnb
    if p.finetune != "full":
        out["adapter"] = f["finetune"]
        out["lora_r"] = p.lora_rank
        out["lora_alpha"] = 2 * p.lora_rank  # a scale on the adapters' output, not a memory parameter
        out["lora_dropout"] = p.lora_dropout
        if p.lora_targets == (ALL_LINEAR,):
            out["lora_target_linear"] = True
        else:
            out["lora_target_modules"] = list(p.lora_targets)
        if p.modules_to_save:
            out["lora_modules_to_save"] = list(p.modules_to_save)
        if p.lora_dora:
            out["peft_use_dora"] = True  # axolotl's key for LoraConfig(use_dora=True)
    out.update(
        sequence_len=f["seq_len"],
        pad_to_sequence_len=True,
        sample_packing=False,
        micro_batch_size=f["micro_batch"],
        gradient_accumulation_steps=f["gradient_accumulation"],
        gradient_checkpointing=p.recompute == "full" and kind != "fsdp",
    )
    if out["gradient_checkpointing"]:
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": checkpoint_reentrant(p, "hf")}  # the plan's checkpoint
        if unused_parameters_off(p, kind):
            out["ddp_find_unused_parameters"] = False
    out.update(
        activation_offloading=p.offload_activations == "cpu",
        bf16=bf16 and not off,
        **({"bfloat16": True} if off else {}),
        fp16=fp16,
        optimizer=OPTIM[p.optimizer],
        max_grad_norm=gradient_clipping,
        attn_implementation=hf_attention(job),
    )
    if kind == "deepspeed":
        out["deepspeed"] = deepspeed_config(job, gradient_clipping)
    elif kind == "fsdp":
        out["fsdp_version"] = 2
        out["fsdp_config"] = {
            "reshard_after_forward": p.zero == 3,
            "offload_params": p.offload_params == "cpu",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": hf_layer_class(job, TARGET),
            "activation_checkpointing": p.recompute == "full",
            "cpu_ram_efficient_loading": fsdp_cpu_load(job),
            "state_dict_type": "SHARDED_STATE_DICT",
        }
    return out


def notes(job: Job, kind: str) -> tuple[str, ...]:
    p, f = job.plan, finetune_fields(job)
    per_node = f["gpus"] // f["nodes"]
    out = []
    if not hf_model_id(job):
        out.append(f"base_model: replace {job.model.name!r} with the model's Hub id or path")
    out.append("add datasets: and output_dir: (the export carries the memory-relevant keys only)")
    if p.quant != "none" and (kind == "fsdp" or p.zero == 3):
        out.append(
            "quantized base under ZeRO-3 / FSDP: axolotl skips peft.prepare_model_for_kbit_training, so the "
            "unquantized weights (embeddings, norms, head) stay in the model dtype, below the estimate's fp32"
        )
    out.append(
        f"launch: axolotl train memplan.yaml under accelerate launch --num_processes "
        f"{f['gpus']} --num_machines {f['nodes']} (or torchrun --nnodes {f['nodes']} --nproc-per-node {per_node}); "
        f"axolotl takes the world size from the launcher (global batch {f['global_batch']})"
    )
    return tuple(out)


def export(job: Job, sharding: str | None = None, gradient_clipping: float = GRADIENT_CLIPPING) -> Exported:
    cfg = config(job, sharding, gradient_clipping)
    kind = check(job, sharding)
    text = comment_block(preamble(job, TARGET, notes(job, kind))) + yaml.safe_dump(cfg, sort_keys=False)
    return Exported(target=TARGET, text=text, suffix=".yaml", notes=notes(job, kind))


def parse(text: str) -> dict[str, Any]:
    """The plan fields an axolotl config carries, read back. Axolotl takes the world size from the
    launcher: the GPUs and nodes come from the header comment (or the DeepSpeed batch)."""
    cfg = yaml.safe_load(text)
    micro, accumulation = cfg["micro_batch_size"], cfg.get("gradient_accumulation_steps") or 1
    ds = cfg.get("deepspeed")
    fsdp = cfg.get("fsdp_config") if cfg.get("fsdp_version") == 2 else None
    zero, offload_opt, offload_par = 0, "none", "none"
    recompute = bool(cfg.get("gradient_checkpointing"))
    world = header_world(text)
    if isinstance(ds, dict):
        back = deepspeed.parse(json.dumps(ds))
        zero, offload_opt, offload_par, precision = (
            back["zero"],
            back["offload_optimizer"],
            back["offload_params"],
            back["precision"],
        )
        world = world or (back["dp"], 1)
    elif fsdp is not None:
        zero = 3 if fsdp.get("reshard_after_forward", True) else 2
        offload_opt = offload_par = "cpu" if fsdp.get("offload_params") else "none"
        recompute = recompute or bool(fsdp.get("activation_checkpointing"))
        precision = "bf16-mixed" if cfg.get("bf16") is True else "fp32"
    else:
        precision = "bf16" if cfg.get("bf16") is True or cfg.get("bfloat16") is True else "fp32"
    gpus, nodes = world or (1, 1)
    attention = cfg.get("attn_implementation")
    if attention is None:  # axolotl's deprecated booleans
        attention = "eager" if cfg.get("eager_attention") else "sdpa"
    out = {
        "gpus": gpus,
        "nodes": nodes,
        "dp": gpus,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "zero": zero,
        "offload_optimizer": offload_opt,
        "offload_params": offload_par,
        "recompute": "full" if recompute else "none",
        "precision": precision,
        # bfloat16 without bf16: bf16 weights, no autocast (axolotl's "for non-AMP cases")
        "autocast": False if cfg.get("bfloat16") is True and cfg.get("bf16") is not True else None,
        "optimizer": OPTIM_BACK[cfg.get("optimizer", "adamw_torch")],
        "attention": ATTENTION_BACK[attention],
        "micro_batch": micro,
        "global_batch": micro * gpus * accumulation,
        "seq_len": cfg["sequence_len"],
        "offload_activations": "cpu" if cfg.get("activation_offloading") else "none",
        "use_reentrant": True if recompute and _reentrant(cfg) else None,  # the Trainer's False: the plan's None
    }
    out.update(_finetune(cfg))
    return out


def _reentrant(cfg: dict[str, Any]) -> bool:
    return bool((cfg.get("gradient_checkpointing_kwargs") or {}).get("use_reentrant"))


def _finetune(cfg: dict[str, Any]) -> dict[str, Any]:
    quant, double = "none", False
    if cfg.get("load_in_8bit"):
        quant = "int8"
    elif cfg.get("load_in_4bit"):
        bnb = cfg.get("bnb_config_kwargs") or {}
        quant = bnb.get("bnb_4bit_quant_type", "nf4")  # axolotl's defaults: nf4, double quantization
        double = bool(bnb.get("bnb_4bit_use_double_quant", True))
    adapter = cfg.get("adapter")
    if not adapter:
        return {"finetune": "full", **lora_defaults(), "quant": quant, "double_quant": double}
    targets = (ALL_LINEAR,) if cfg.get("lora_target_linear") else tuple(cfg.get("lora_target_modules") or ())
    return {
        "finetune": adapter,
        "lora_rank": cfg["lora_r"],
        "lora_targets": targets,
        "lora_dropout": cfg.get("lora_dropout") or 0.0,
        "modules_to_save": tuple(cfg.get("lora_modules_to_save") or ()),
        "lora_dora": bool(cfg.get("peft_use_dora", False)),
        "quant": quant,
        "double_quant": double,
    }
