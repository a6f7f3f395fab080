"""``memplan profiles``: the bundled model and GPU profiles."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from memplan.costmodel.params import total_params
from memplan.specs.loader import load_gpu, load_model, profile_names
from memplan.units import format_bytes


def profiles(
    format: Annotated[Literal["table", "json"], typer.Option("--format", help="table or json.")] = "table",
) -> None:
    """List the bundled model and GPU profiles."""
    models = [load_model(name) for name in profile_names("models")]
    gpus = [load_gpu(name) for name in profile_names("gpus")]
    if format == "json":
        data = {
            "models": [{"name": m.name, "architecture": m.architecture, "parameters": total_params(m)} for m in models],
            "gpus": [{"name": g.name, "display_name": g.display_name, "memory_bytes": g.memory_bytes} for g in gpus],
        }
        typer.echo(json.dumps(data, indent=2))
        return
    console = Console()
    table = Table(title="Models")
    for col in ("name", "architecture", "parameters", "layers", "hidden", "experts"):
        table.add_column(col, justify="right" if col not in ("name", "architecture") else "left")
    for m in models:
        experts = f"{m.moe.num_experts} (top {m.moe.top_k})" if m.moe else "-"
        table.add_row(
            m.name, m.architecture, f"{total_params(m) / 1e9:,.2f} B", str(m.num_layers), str(m.hidden_size), experts
        )
    console.print(table)
    table = Table(title="GPUs")
    for col in ("name", "part", "memory", "bf16 dense"):
        table.add_column(col)
    for g in gpus:
        bf16 = g.peak_flops.get("bf16")
        table.add_row(
            g.name, g.display_name, format_bytes(g.memory_bytes), f"{bf16 / 1e12:,.0f} TFLOP/s" if bf16 else "-"
        )
    console.print(table)
