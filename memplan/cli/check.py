"""``memplan check``: memory budgets for CI (exit 0 within budget, 1 over or regressed, 2 bad input)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from memplan.check import CheckReport, load_baseline, load_budgets, new_baseline, resolve_entries
from memplan.check import check as run_check
from memplan.check.evaluate import FAILING, Measurement, Resolved
from memplan.check.render import MARK, junit_xml, markdown
from memplan.cli.common import auto_device, output_path, warn
from memplan.cli.options import DEFAULT_PRECISION
from memplan.cli.planflags import PLAN_FLAGS, takes_plan_flags
from memplan.errors import MemplanError
from memplan.specs.resolve import CLI
from memplan.units import format_bytes

Opt = typer.Option
OUT = "Output"
RUN = "Measure"


# every plan flag: the budgets file's entries each carry their plan and workload (memplan.check.spec)
EXCLUDED = dict.fromkeys(PLAN_FLAGS, "each budgets entry carries its own plan and workload (the budgets YAML)")


@takes_plan_flags(EXCLUDED)
def check(
    budgets: Annotated[
        Path,
        typer.Argument(
            help="Budgets YAML: entries of model, workload, plan, GPU and budget; a field an entry leaves out takes "
            f"memplan estimate's default (e.g. precision {DEFAULT_PRECISION}, seq_len 2048), the GPU h100-sxm."
        ),
    ],
    baseline: Annotated[
        Path | None, Opt("--baseline", help="JSON of the last accepted numbers; a regression beyond threshold fails.")
    ] = None,
    update_baseline: Annotated[
        bool, Opt("--update-baseline", help="Accept this run's numbers: write them to --baseline (no regression test).")
    ] = False,
    junit: Annotated[str | None, Opt("--junit", help="Write JUnit XML here.", rich_help_panel=OUT)] = None,
    summary: Annotated[
        str | None, Opt("--markdown", help="Write the Markdown summary here (a PR comment).", rich_help_panel=OUT)
    ] = None,
    format: Annotated[
        Literal["table", "json", "markdown"], Opt("--format", help="table, json or markdown.", rich_help_panel=OUT)
    ] = "table",
    measure: Annotated[
        bool, Opt("--measure", help="Measure with the bundled trainer (memplan validate) instead of estimating.")
    ] = False,
    allocator: Annotated[
        Literal["default", "expandable"] | None,
        Opt(
            help="CUDA caching allocator for entries that name none (default: PYTORCH_CUDA_ALLOC_CONF, else PyTorch's)."
        ),
    ] = None,
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        Opt(
            help="Where the entries run: cuda (the GPU profiles) or cpu; auto is cuda for estimates and, with "
            "--measure, cuda when torch sees a GPU, else cpu.",
            rich_help_panel=RUN,
        ),
    ] = "auto",
    timeout: Annotated[float, Opt(help="--measure: seconds per entry.", min=1, rich_help_panel=RUN)] = 600,
    timeline: Annotated[
        str | None,
        Opt(
            "--timeline",
            help="Draw the predicted run of the first failing entry (else the one closest to its budget) to this "
            "file: .html, .svg, .png (the viz extra) or .pickle.",
            rich_help_panel=OUT,
        ),
    ] = None,
) -> None:
    """Estimate (or measure) each budgets entry; fail when one exceeds its budget or regresses."""
    if update_baseline and baseline is None:
        raise MemplanError("needs --baseline FILE to write", source=CLI, field="--update-baseline")
    # every file this run writes is checked before anything is estimated or measured
    output_path(junit, "--junit", inputs=(budgets, baseline))
    output_path(summary, "--markdown", inputs=(budgets, baseline))
    if update_baseline:
        output_path(baseline, "--baseline", inputs=(budgets,))
    drawing = None
    if timeline is not None:
        from memplan.viz.output import check_output

        drawing = check_output(timeline)
    spec = load_budgets(budgets)
    resolved = resolve_entries(spec, budgets, allocator)
    warn([f"{r.entry.name}: {line}" for r in resolved for line in r.job.warnings])
    previous = None
    if baseline is not None and not update_baseline:
        previous = load_baseline(baseline)
    measurer = None
    where = "cuda" if device == "auto" else device
    if measure:
        from memplan.check.measure import measure as run_measure

        where = auto_device(device, "--measure", "--measure")

        def measurer(r: Resolved) -> Measurement:
            return run_measure(r, where, timeout)

    report = run_check(spec, resolved, str(budgets), previous, measurer, where)
    if update_baseline and baseline is not None:
        baseline.parent.mkdir(parents=True, exist_ok=True)
        baseline.write_text(new_baseline(report).model_dump_json(indent=2) + "\n")
    for path, text in ((junit, junit_xml), (summary, markdown)):
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text(report), encoding="utf-8")
    if drawing is not None:
        _timeline(report, resolved, "cuda" if where == "auto" else where, *drawing)
    if format == "json":
        typer.echo(json.dumps({**report.model_dump(), "passed": report.passed}, indent=2))
    elif format == "markdown":
        typer.echo(markdown(report), nl=False)
    else:
        render(report, Console())
    raise typer.Exit(report.exit_code)


def _timeline(report: CheckReport, resolved: list[Resolved], device: str, path: Path, kind: str) -> None:
    """The predicted run of the first failing entry, else of the entry nearest its budget."""
    from memplan.viz.output import write_job_timeline

    scored = [(e, r) for e, r in zip(report.entries, resolved, strict=True) if e.value_bytes is not None]
    if not scored:
        Console(stderr=True).print(f"no entry was evaluated: no timeline written to {path}", soft_wrap=True)
        return
    failing = [(e, r) for e, r in scored if e.status in FAILING]
    entry, chosen = failing[0] if failing else max(scored, key=lambda er: er[0].value_bytes / er[0].limit_bytes)
    why = "failing" if failing else "closest to its budget"
    write_job_timeline(chosen.job, path, kind, device, title=f"{entry.name} ({why}): {chosen.job.model.name}")
    Console(stderr=True).print(f"timeline: {path} (entry {entry.name}, {why})", soft_wrap=True)


def _gib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n, "GiB")


def render(report: CheckReport, console: Console) -> None:
    table = Table(title=f"memplan check {report.source} (regression threshold {report.threshold})")
    for col in ("entry", "model", "GPUs", "metric", "peak", "budget", "headroom", "baseline", "status"):
        table.add_column(col, justify="right" if col in ("peak", "budget", "headroom", "baseline") else "left")
    for e in report.entries:
        metric = e.metric + (" (measured)" if e.measured else "")
        table.add_row(
            e.name, e.model, f"{e.gpus} x {e.gpu}", metric, _gib(e.value_bytes), _gib(e.limit_bytes),
            _gib(e.headroom_bytes), _gib(e.baseline_bytes), MARK[e.status],
        )  # fmt: skip
    console.print(table)
    for e in report.entries:
        if e.status != "pass":
            console.print(f"[bold]{e.name}[/]: {e.reason}")
    counts = report.counts()
    verdict = "[green]passed[/]" if report.passed else "[red]failed[/]"
    console.print(
        f"{verdict}: {counts['pass']} pass, {counts['over-budget']} over budget, {counts['regressed']} regressed, "
        f"{counts['tight']} tight, "
        f"{counts['error']} not evaluated"
    )
