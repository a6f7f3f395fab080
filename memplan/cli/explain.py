"""``memplan explain``: where a PyTorch memory snapshot's memory went, against the prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from memplan.cli.options import PlanFileOpt
from memplan.cli.planflags import PlanFlags, takes_plan_flags
from memplan.costmodel.allocator.trace import load_snapshot
from memplan.errors import MemplanError
from memplan.explain.report import Explained, ExplainResult
from memplan.explain.report import explain as run_explain
from memplan.specs.resolve import CLI, Job, resolve_job
from memplan.units import format_bytes

Opt = typer.Option


@takes_plan_flags()
def explain(
    flags: PlanFlags,
    snapshot: Annotated[
        str, typer.Argument(help="A PyTorch memory snapshot (_dump_snapshot's pickle, gzip'd or not).")
    ],
    model: Annotated[
        str | None, typer.Argument(help="The model it ran: profile name, memplan model YAML, or HF config.json.")
    ] = None,
    plan: PlanFileOpt = None,
    gpu: Annotated[str | None, Opt(help="GPU profile name or YAML (default: h100-sxm).")] = None,
    allocator: Annotated[
        Literal["default", "expandable"] | None,
        Opt(help="The prediction's allocator (default: what the snapshot's allocator_settings say)."),
    ] = None,
    trace_device: Annotated[
        int, Opt("--trace-device", help="Which CUDA device's trace of the snapshot to read.", min=0)
    ] = 0,
    format: Annotated[Literal["table", "json"], Opt("--format", help="table or json.")] = "table",
    timeline: Annotated[
        str | None,
        Opt("--timeline", help="Draw the measured run (and the predicted one, with MODEL) to .html, .svg or .png."),
    ] = None,
) -> None:
    """Where a memory snapshot's memory went: peaks, what was live there by category, reserved but
    free memory per stream; with MODEL and plan flags, measured against predicted."""
    target = None
    if timeline is not None:
        from memplan.viz.output import check_output

        target = check_output(timeline, pickle_ok=False)
    overrides = flags.overrides()
    job = data = None
    if model is not None:
        data = load_snapshot(snapshot)
        overrides |= {"gpu": gpu, "allocator": allocator or _snapshot_allocator(data)}
        job = resolve_job(model, plan, overrides, inference=flags.inference)
    elif plan is not None or allocator is not None or gpu is not None or flags.given():
        raise MemplanError("plan flags describe a MODEL's run: give the model after the snapshot", source=CLI)
    explained = run_explain(snapshot, job, trace_device=trace_device, snapshot=data)
    if target is not None:
        _draw(explained, job, *target)
    if format == "json":
        typer.echo(explained.result.model_dump_json(indent=2))
    else:
        render(explained.result, Console())
        if target is not None:
            Console().print(f"timeline: {target[0]}")


def _snapshot_allocator(data: dict) -> str:
    """The allocator the snapshot's run used (its ``allocator_settings``)."""
    settings = data.get("allocator_settings") or {}
    return "expandable" if settings.get("expandable_segments") else "default"


def _draw(explained: Explained, job: Job | None, path: Path, kind: str) -> None:
    """The measured run and, with a model, the predicted one under it."""
    from memplan.viz.output import write_panels
    from memplan.viz.predicted import predicted_panel
    from memplan.viz.series import panel

    r = explained.result
    limit = label = None
    predicted = []
    if job is not None and explained.predicted is not None:
        p = predicted_panel(explained.predicted, job, explained.predicted_run, explained.overhead)
        limit, label = p.limit, p.limit_label
        predicted = [p]
    title = f"measured: {r.source} ({r.allocator} allocator, categories from {r.attribution})"
    write_panels([panel(explained.measured, title, limit=limit, limit_label=label or ""), *predicted], path, kind)


def _gib(n: int) -> str:
    return format_bytes(n, "GiB")


def _diff(n: int) -> str:
    return f"{n / 2**30:+.2f} GiB"


def render(r: ExplainResult, console: Console) -> None:
    console.print(
        f"[bold]{r.source}[/] (device {r.device}, {r.allocator} allocator): {r.allocations:,} allocations, "
        f"{r.frees:,} frees, {r.segment_events:,} segment events"
    )
    if r.oom is not None:
        o = r.oom
        console.print(
            f"[red]out of memory[/] after event {o.event}: {_gib(o.requested)} requested with {_gib(o.allocated)} "
            f"allocated and {_gib(o.reserved)} reserved ({_gib(o.reserved - o.allocated)} of it free but "
            f"fragmented), {_gib(o.device_free)} free on the device"
        )
    phase = f" in the {r.peak_phase}" if r.peak_phase else ""
    table = Table(title=f"Live at the allocated peak (event {r.peak_event}{phase})")
    cols = ["category", "measured", "share"] + (["predicted", "difference"] if r.comparison else [])
    for col in cols:
        table.add_column(col, justify="left" if col == "category" else "right")
    predicted = {row.category: row for row in r.comparison.categories} if r.comparison else {}
    for name in [*r.categories, *[c for c in predicted if c not in r.categories]]:
        value = r.categories.get(name, 0)
        row = [name.replace("_", " "), _gib(value), f"{100 * value / max(r.peak_allocated, 1):.1f}%"]
        if r.comparison:
            p = predicted[name]
            row += [_gib(p.predicted), _diff(p.difference)]
        table.add_row(*row)
    table.add_section()
    c = r.comparison
    extra = [_gib(c.predicted_allocated), _diff(r.peak_allocated - c.predicted_allocated)] if c else []
    table.add_row("[bold]peak allocated[/]", _gib(r.peak_allocated), "", *extra)
    extra = [_gib(c.predicted_reserved), _diff(r.peak_reserved - c.predicted_reserved)] if c else []
    table.add_row("[bold]peak reserved[/]", _gib(r.peak_reserved), "", *extra)
    console.print(table)
    console.print(f"categories: {r.attribution_note}")
    if c is not None:
        console.print(f"predicted by the {c.run} run of {c.model}")
        if c.largest_differences:
            console.print("largest differences: " + "; ".join(c.largest_differences))
        else:
            console.print("no category differs: the prediction holds what the snapshot held")
    console.print("largest tensors at the peak: " + ", ".join(
        f"{t.label} ({t.category.replace('_', ' ')}) {_gib(t.size)}" for t in r.largest[:5]))  # fmt: skip
    streams = Table(title="Reserved but free, per stream (fragmentation)")
    for col in ("stream", "at the peak: reserved", "allocated", "free", "at the end: reserved", "free "):
        streams.add_column(col, justify="left" if col == "stream" else "right")
    end = {s.stream: s for s in r.streams_at_end}
    for s in r.streams_at_peak:
        e = end.get(s.stream)
        name = f"{s.stream} ({s.name})" if s.name else str(s.stream)
        at_end = (_gib(e.reserved), _gib(e.cached_free)) if e else ("-", "-")
        streams.add_row(name, _gib(s.reserved), _gib(s.allocated), _gib(s.cached_free), *at_end)
    console.print(streams)
