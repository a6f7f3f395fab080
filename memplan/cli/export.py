"""``memplan export``: a plan as a DeepSpeed / Accelerate / torchtitan / Megatron-LM / FSDP2 config, or a
fine-tuning run as an HF Trainer (TRL SFTTrainer) or axolotl config."""

from __future__ import annotations

import math
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.cli.common import output_path, warn
from memplan.cli.options import GpusOpt, NodesOpt
from memplan.cli.planflags import SERVING, PlanFlags, takes_plan_flags
from memplan.errors import MemplanError
from memplan.export import render
from memplan.specs.job import PlanFile
from memplan.specs.loader import read_data, short, validate
from memplan.specs.resolve import CLI, resolve_job

Opt = typer.Option
HW = "Hardware"
OUT = "Export"


class Target(StrEnum):
    deepspeed = "deepspeed"
    accelerate = "accelerate"
    torchtitan = "torchtitan"
    megatron = "megatron"
    fsdp2 = "fsdp2"
    hf_trainer = "hf-trainer"
    axolotl = "axolotl"


class Sharding(StrEnum):
    deepspeed = "deepspeed"
    fsdp = "fsdp"


class TorchtitanForm(StrEnum):
    python = "python"
    toml = "toml"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def locate(err: MemplanError, model_ref: str, plan_path: str | None, flags: set[str]) -> MemplanError:
    """An exporter's error (field ``plan.x``, ``workload.x``, ``model...`` or ``--option``) against
    where the value came from: its flag, else the plan file, else the model reference."""
    field = err.field or ""
    if err.source or field.startswith("--"):
        return err.located(CLI)
    if field == "model" or field.startswith("model."):
        return MemplanError(
            err.reason, source=short(model_ref), field=field.removeprefix("model.") if "." in field else None
        )
    name = field.split(".")[-1]
    if name in flags or not plan_path:
        return MemplanError(err.reason, source=CLI, field=_flag(name))
    return err.located(short(plan_path))


def _model_ref(model: str | None, plan_path: str | None) -> str:
    """--model, else the plan file's ``model`` (a path relative to the plan file when one is there)."""
    if model:
        return model
    if plan_path:
        pf = validate(PlanFile, read_data(Path(plan_path)), short(plan_path))
        if pf.model:
            beside = Path(plan_path).parent / pf.model
            return str(beside) if beside.exists() else pf.model
        raise MemplanError("no model to export: give one here or with --model", source=short(plan_path), field="model")
    raise MemplanError("give a plan file with a model, or --model", source=CLI, field="--model")


EXCLUDED = {
    **{name: "export writes training configurations: a serving workload has none" for name in SERVING},
}


@takes_plan_flags(EXCLUDED, after="nvme_path")
def export(
    flags: PlanFlags,
    plan: Annotated[
        str | None, typer.Argument(help="Plan YAML (model, gpu, gpus, nodes, runtime, workload, plan sections).")
    ] = None,
    to: Annotated[
        Target | None,
        Opt(
            "--to",
            help="deepspeed, accelerate, torchtitan, megatron, fsdp2; fine-tuning: hf-trainer (TrainingArguments / "
            "SFTConfig, LoraConfig, BitsAndBytesConfig YAML) or axolotl.",
        ),
    ] = None,
    output: Annotated[str | None, Opt("-o", "--output", help="Write here instead of stdout.")] = None,
    model: Annotated[
        str | None, Opt("--model", help="Model profile, YAML or config.json (default: the plan file's model).")
    ] = None,
    torchtitan_form: Annotated[
        TorchtitanForm | None,
        Opt(
            help="torchtitan: python (Trainer.Config function) or toml (legacy job file) (default: python).",
            rich_help_panel=OUT,
        ),
    ] = None,
    torchtitan_model: Annotated[
        str | None,
        Opt(
            help="torchtitan: model NAME:FLAVOR when the shape is not a known one (default: matched by shape).",
            rich_help_panel=OUT,
        ),
    ] = None,
    gradient_clipping: Annotated[
        float | None,
        Opt(
            help="Max gradient norm (deepspeed, torchtitan, megatron, hf-trainer, axolotl; default 1.0).",
            rich_help_panel=OUT,
        ),
    ] = None,
    sharding: Annotated[
        Sharding | None,
        Opt(help="hf-trainer, axolotl: ZeRO as deepspeed (default) or fsdp (FSDP2, zero 2 or 3).", rich_help_panel=OUT),
    ] = None,
    nvme_path: Annotated[
        str | None,
        Opt(help="deepspeed: NVMe mount for nvme offload (default: none; needed with nvme).", rich_help_panel=OUT),
    ] = None,
    gpu: Annotated[str | None, Opt(help="GPU profile name or YAML (default: h100-sxm).", rich_help_panel=HW)] = None,
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
) -> None:
    """Write a plan as a real trainer's configuration; refuse what the target cannot express."""
    if to is None:
        targets = ", ".join(t.value for t in Target)
        raise MemplanError(f"missing option ({targets})", source=CLI, field="--to")
    output_path(output, "--output", inputs=(plan, model))
    if gradient_clipping is not None and not (math.isfinite(gradient_clipping) and gradient_clipping > 0):
        raise MemplanError(
            f"{gradient_clipping} is not a max gradient norm: give a positive finite number (1.0 is the usual)",
            source=CLI,
            field="--gradient-clipping",
        )
    overrides: dict[str, Any] = {**flags.overrides(), "gpu": gpu, "gpus": gpus, "nodes": nodes}
    ref = _model_ref(model, plan)
    job = resolve_job(ref, plan, overrides)
    opts = dict(
        form=torchtitan_form.value if torchtitan_form else None,
        model=torchtitan_model,
        gradient_clipping=gradient_clipping,
        nvme_path=nvme_path,
        sharding=sharding.value if sharding else None,
    )
    flags = {k for k, v in overrides.items() if v is not None}
    try:
        result = render(job, to.value, **opts)
    except MemplanError as err:
        if err.field in ("--form", "--model"):  # the exporter's option names, as the CLI spells them
            err = MemplanError(err.reason, field="--torchtitan-" + err.field.removeprefix("--"))
        raise locate(err, ref, plan, flags) from None
    warn(job.warnings)
    if output is None:
        sys.stdout.write(result.text)
    else:
        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(result.text)
    for note in result.notes:
        print(f"memplan: note: {note}", file=sys.stderr)
