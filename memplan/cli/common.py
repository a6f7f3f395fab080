"""Option parsing shared by the commands: the bundled trainer's (validate, tune, check) and the
fine-tuning flags that estimate and export both take."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from memplan.errors import MemplanError
from memplan.specs.resolve import CLI
from memplan.units import parse_bytes


def auto_device(requested: str, needs: str, field: str) -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``, for ``auto``; torch is imported only here.
    ``needs`` names what wants torch, for the error where the train extra is missing."""
    if requested != "auto":
        return requested
    try:
        import torch
    except ImportError:  # pragma: no cover - the train extra brings torch
        raise MemplanError(
            f"{needs} needs the train extra: pip install 'memplan[train]'", source=CLI, field=field
        ) from None
    return "cuda" if torch.cuda.is_available() else "cpu"


def memory_limit_bytes(text: str | None) -> int | None:
    """``--memory-limit`` (e.g. ``2GiB``) in bytes; None when not given."""
    if text is None:
        return None
    try:
        limit = parse_bytes(text)
    except ValueError as err:
        raise MemplanError(str(err), source=CLI, field="--memory-limit") from None
    if limit <= 0:
        raise MemplanError("must be a positive size, e.g. 2GiB", source=CLI, field="--memory-limit")
    return limit


def name_list(text: str | None, field: str) -> tuple[str, ...] | None:
    """A comma-separated flag value (``--lora-targets q_proj,v_proj``) as a tuple; None when not given."""
    if text is None:
        return None
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise MemplanError("an empty name in the list (write names separated by commas)", source=CLI, field=field)
    return names


# --- the fine-tuning flags of estimate and export ---------------------------------------------
FINETUNE_PANEL = "Fine-tuning"
FinetuneOpt = Annotated[
    str | None, typer.Option(help="full, lora or qlora (LoRA over an NF4 base).", rich_help_panel=FINETUNE_PANEL)
]
LoraRankOpt = Annotated[int | None, typer.Option(help="LoRA rank r.", rich_help_panel=FINETUNE_PANEL)]
LoraTargetsOpt = Annotated[
    str | None,
    typer.Option(
        help="Modules the adapters wrap, comma-separated (q_proj,v_proj), or all-linear.",
        rich_help_panel=FINETUNE_PANEL,
    ),
]
LoraDropoutOpt = Annotated[
    float | None, typer.Option(help="Dropout on the adapters' input.", rich_help_panel=FINETUNE_PANEL)
]
ModulesToSaveOpt = Annotated[
    str | None,
    typer.Option(help="Modules trained in full beside the adapters, e.g. lm_head.", rich_help_panel=FINETUNE_PANEL),
]
QuantOpt = Annotated[
    str | None, typer.Option(help="Base weights: none, int8, nf4 or fp4.", rich_help_panel=FINETUNE_PANEL)
]
DoubleQuantOpt = Annotated[
    bool | None,
    typer.Option(
        "--double-quant/--no-double-quant", help="4-bit: quantize the scales again.", rich_help_panel=FINETUNE_PANEL
    ),
]
OffloadActivationsOpt = Annotated[
    str | None, typer.Option(help="none or cpu: saved activations kept in host memory.", rich_help_panel="Plan")
]


def finetune_overrides(
    finetune: str | None,
    lora_rank: int | None,
    lora_targets: str | None,
    lora_dropout: float | None,
    modules_to_save: str | None,
    quant: str | None,
    double_quant: bool | None,
    offload_activations: str | None,
) -> dict[str, Any]:
    """The fine-tuning flags as plan fields (None: not given), the name lists split."""
    return dict(
        finetune=finetune,
        lora_rank=lora_rank,
        lora_targets=name_list(lora_targets, "--lora-targets"),
        lora_dropout=lora_dropout,
        modules_to_save=name_list(modules_to_save, "--modules-to-save"),
        quant=quant,
        double_quant=double_quant,
        offload_activations=offload_activations,
    )
