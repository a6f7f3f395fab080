"""The plan flags' option declarations, each once, with the defaults in their help: every
option that sets a plan or workload field (:mod:`memplan.cli.planflags` lists them and gives them
to the commands that take a plan).

A flag left out takes the plan file's value, else the spec's default: each help text reads that
default from the spec (:mod:`memplan.specs.plan`, :mod:`memplan.specs.workload`), so ``--help``
cannot drift from what a run uses.
"""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import BaseModel

from memplan.specs.plan import Plan
from memplan.specs.resolve import TRAINER_PRECISION
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

Opt = typer.Option
PLAN, WORK, HW = "Plan", "Workload", "Hardware"


def spec_default(name: str, spec: type[BaseModel] = Plan) -> str:
    """``(default: 2048)``: the default of ``spec``'s field ``name`` as ``--help`` shows it."""
    value = spec.model_fields[name].default
    if isinstance(value, tuple):
        value = ",".join(value) or "none"
    elif isinstance(value, bool):
        value = "on" if value else "off"
    elif value is None:
        value = "none"
    return f"(default: {value})"


# One default precision for training across estimate, tune, check, validate and plan files: the
# plan's, bf16-master (bf16 weights and gradients, fp32 master weights and Adam states in the
# optimizer, as Megatron-LM's --bf16 and DeepSpeed's bf16 section run it; docs/tune.md says why).
DEFAULT_PRECISION: str = Plan.model_fields["precision"].default


def precision_help(names: str) -> str:
    """The precisions a command takes, and the default (transformers' loops: the Trainer's recipe,
    ``specs.resolve.TRAINER_PRECISION``)."""
    return f"{names} (default: {DEFAULT_PRECISION}; {TRAINER_PRECISION} under --runtime hf or hf-loop)."


PlanFileOpt = Annotated[str | None, Opt("--plan", help="Plan YAML (flags override it).")]
DpOpt = Annotated[
    int | None,
    Opt(help="Data-parallel degree (default: GPUs / (tp x pp x cp); 1 without --gpus).", rich_help_panel=PLAN),
]
TpOpt = Annotated[int | None, Opt(help=f"Tensor-parallel degree {spec_default('tp')}.", rich_help_panel=PLAN)]
SequenceParallelOpt = Annotated[
    bool | None,
    Opt(
        "--sequence-parallel/--no-sequence-parallel",
        help=f"Megatron sequence parallelism, with tp > 1 {spec_default('sequence_parallel')}.",
        rich_help_panel=PLAN,
    ),
]
PpOpt = Annotated[int | None, Opt(help=f"Pipeline stages {spec_default('pp')}.", rich_help_panel=PLAN)]
PpScheduleOpt = Annotated[
    str | None, Opt(help=f"1f1b, interleaved or gpipe {spec_default('pp_schedule')}.", rich_help_panel=PLAN)
]
VirtualStagesOpt = Annotated[
    int | None,
    Opt(help=f"Model chunks per rank (interleaved) {spec_default('virtual_stages')}.", rich_help_panel=PLAN),
]
CpOpt = Annotated[int | None, Opt(help=f"Context-parallel degree {spec_default('cp')}.", rich_help_panel=PLAN)]
EpOpt = Annotated[
    int | None, Opt(help=f"Expert-parallel degree, within dp x cp {spec_default('ep')}.", rich_help_panel=PLAN)
]
ZeroOpt = Annotated[int | None, Opt(help=f"ZeRO stage 0-3 {spec_default('zero')}.", rich_help_panel=PLAN)]
RecomputeOpt = Annotated[
    str | None, Opt(help=f"none, selective, selective-op or full {spec_default('recompute')}.", rich_help_panel=PLAN)
]
RecomputeLayersOpt = Annotated[
    int | None, Opt(help="Layers per stage recomputed with full (default: all).", rich_help_panel=PLAN)
]
OptimizerOpt = Annotated[
    str | None,
    Opt(
        help="adamw, sgd, adafactor, adamw-8bit, paged-adamw-8bit|32bit, paged-lion-8bit|32bit "
        f"{spec_default('optimizer')}.",
        rich_help_panel=PLAN,
    ),
]
AttentionOpt = Annotated[
    str | None,
    Opt(
        help=f"flash (PyTorch's SDPA), eager or triton (memplan's kernel) {spec_default('attention')}.",
        rich_help_panel=PLAN,
    ),
]
PrecisionOpt = Annotated[
    str | None,
    Opt(help=precision_help("fp32, bf16-mixed, bf16-master, fp16-master, bf16, fp8"), rich_help_panel=PLAN),
]
AutocastOpt = Annotated[
    bool | None,
    Opt(
        "--autocast/--no-autocast",
        help="With precision bf16 under --runtime hf or hf-loop: the forward under bf16 autocast (the Trainer's "
        "bf16=True) or not (a bfloat16 model trained as it is) (default: the runtime's recipe: on under hf, off "
        "under hf-loop).",
        rich_help_panel=PLAN,
    ),
]
Fp8RecipeOpt = Annotated[
    str | None,
    Opt(
        help="With fp8: auto, tensorwise, rowwise (torchao), delayed (Transformer Engine) (default: auto: delayed "
        "under megatron, tensorwise otherwise).",
        rich_help_panel=PLAN,
    ),
]
Fp8AllGatherOpt = Annotated[
    bool | None,
    Opt(
        "--fp8-all-gather/--no-fp8-all-gather",
        help="With fp8 under FSDP2: all-gather the linear weights in fp8 (torchao) (default: off).",
        rich_help_panel=PLAN,
    ),
]
OffloadOptimizerOpt = Annotated[
    str | None, Opt(help=f"none, cpu or nvme {spec_default('offload_optimizer')}.", rich_help_panel=PLAN)
]
OffloadParamsOpt = Annotated[
    str | None, Opt(help=f"none, cpu or nvme, with ZeRO-3 {spec_default('offload_params')}.", rich_help_panel=PLAN)
]
RuntimeOpt = Annotated[
    str | None,
    Opt(
        help="Training: whose step the activations are counted for: memplan (the bundled trainer), hf "
        "(transformers' Trainer), hf-loop or megatron (default: memplan; hf for lora and qlora).",
        rich_help_panel=PLAN,
    ),
]
FINETUNE_PANEL = "Fine-tuning"
FinetuneOpt = Annotated[
    str | None,
    Opt(help="full, lora or qlora (LoRA over an NF4 base) (default: full).", rich_help_panel=FINETUNE_PANEL),
]
LoraRankOpt = Annotated[int | None, Opt(help="LoRA rank r (default: 16).", rich_help_panel=FINETUNE_PANEL)]
LoraTargetsOpt = Annotated[
    str | None,
    Opt(
        help="Modules the adapters wrap, comma-separated, or all-linear (default: q_proj,v_proj).",
        rich_help_panel=FINETUNE_PANEL,
    ),
]
LoraDropoutOpt = Annotated[
    float | None, Opt(help="Dropout on the adapters' input (default: 0.0).", rich_help_panel=FINETUNE_PANEL)
]
ModulesToSaveOpt = Annotated[
    str | None,
    Opt(
        help="Modules trained in full beside the adapters, e.g. lm_head (default: none).",
        rich_help_panel=FINETUNE_PANEL,
    ),
]
LoraDoraOpt = Annotated[
    bool | None,
    Opt(
        "--lora-dora/--no-lora-dora",
        help="DoRA adapters (PEFT's use_dora=True; runtime hf or hf-loop) (default: off).",
        rich_help_panel=FINETUNE_PANEL,
    ),
]
QuantOpt = Annotated[
    str | None,
    Opt(help="Base weights: none, int8, nf4 or fp4 (default: none; nf4 with qlora).", rich_help_panel=FINETUNE_PANEL),
]
DoubleQuantOpt = Annotated[
    bool | None,
    Opt(
        "--double-quant/--no-double-quant",
        help="4-bit: quantize the scales again (default: on with nf4 or fp4 under qlora, else off).",
        rich_help_panel=FINETUNE_PANEL,
    ),
]
OffloadActivationsOpt = Annotated[
    str | None,
    Opt(help="none or cpu: saved activations kept in host memory (default: none).", rich_help_panel=PLAN),
]
UseReentrantOpt = Annotated[
    bool | None,
    Opt(
        "--use-reentrant/--no-use-reentrant",
        help="runtime hf / hf-loop with recompute full: the use_reentrant value transformers' gradient checkpointing "
        "passes to torch.utils.checkpoint (gradient_checkpointing_kwargs) (default: off under hf, the Trainer's; "
        "under hf-loop on over a quantized base, as peft's prepare_model_for_kbit_training(model) leaves it, else "
        "off).",
        rich_help_panel=FINETUNE_PANEL,
    ),
]
ModelBuildOpt = Annotated[
    str | None,
    Opt(
        help="runtime hf / hf-loop: how the model reached the GPU: from_pretrained (with a device_map: one warmup "
        "segment the weights are carved from) or to_device (loaded on the CPU: model.to('cuda'), one allocation "
        "per parameter; under the Trainer's FSDP2 sharded onto the GPUs by cpu_ram_efficient_loading) (default: "
        "to_device for hf FSDP plans (dp > 1, zero 2/3), else from_pretrained).",
        rich_help_panel=FINETUNE_PANEL,
    ),
]


MicroBatchOpt = Annotated[
    int | None,
    Opt(
        help=f"Training: sequences per micro-batch {spec_default('micro_batch', TrainingWorkload)}.",
        rich_help_panel=WORK,
    ),
]
GlobalBatchOpt = Annotated[
    int | None,
    Opt(
        help="Training: sequences per optimizer step (default: micro-batch x dp, no accumulation).",
        rich_help_panel=WORK,
    ),
]
SeqLenOpt = Annotated[
    int | None,
    Opt(help=f"Training: tokens per sequence {spec_default('seq_len', TrainingWorkload)}.", rich_help_panel=WORK),
]
_PROMPT, _GENERATED = (InferenceWorkload.model_fields[k].default for k in ("prompt_tokens", "generated_tokens"))
BatchOpt = Annotated[
    int | None,
    Opt(help=f"Inference: concurrent sequences {spec_default('batch', InferenceWorkload)}.", rich_help_panel=WORK),
]
ContextOpt = Annotated[
    int | None,
    Opt(
        help=f"Inference: tokens held per sequence, all prefilled (default: a {_PROMPT}-token prompt and "
        f"{_GENERATED} generated).",
        rich_help_panel=WORK,
    ),
]
KvDtypeOpt = Annotated[
    str | None,
    Opt(
        help="Inference: KV-cache element type: fp32, bf16, fp16, fp8, int8 "
        f"{spec_default('kv_dtype', InferenceWorkload)}.",
        rich_help_panel=WORK,
    ),
]
BlockSizeOpt = Annotated[
    int | None,
    Opt(
        help="Inference: paged KV block size in tokens, as vLLM's 16 (default: none, a contiguous cache).",
        rich_help_panel=WORK,
    ),
]
InferenceOpt = Annotated[
    bool, Opt("--inference", help="Serving memory (KV cache) instead of training.", rich_help_panel=WORK)
]
PrefillChunkOpt = Annotated[
    int | None,
    Opt(
        help="Inference: tokens per prefill forward across the batch (chunked prefill, vLLM's "
        "max_num_batched_tokens). Default: every prompt in one forward (transformers' generate).",
        rich_help_panel=WORK,
    ),
]
# the hardware flags of estimate and export (the other commands' --gpus differ: detected, or searched over)
GpusOpt = Annotated[
    int | None, Opt(help="Total GPUs (default: dp x tp x pp x cp, 1 when none is given).", rich_help_panel=HW)
]
NodesOpt = Annotated[
    int | None, Opt(help="Nodes (default: whole 8-GPU nodes when the GPUs fill them, else 1).", rich_help_panel=HW)
]
