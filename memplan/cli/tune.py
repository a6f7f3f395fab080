"""``memplan tune``: the fastest plan that fits, found by an Optuna study (or every plan),
optionally validated by real runs.

Optuna (``memplan.search.study`` and ``memplan.search.tune``) is imported only when the
command runs, so that ``import memplan.cli`` stays light; torch only in ``--validate``'s runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from memplan.cli.common import (
    HOST_MEMORY_HELP,
    output_path,
    warn,
)
from memplan.cli.options import DEFAULT_PRECISION
from memplan.cli.planflags import FP8, SERVING, PlanFlags, takes_plan_flags
from memplan.errors import MemplanError
from memplan.search.request import check_export, tune_request
from memplan.search.tuning import (
    PLAN_FILE,
    STUDY_FILE,
    WORK_ROOT,
    Hooks,
    TuneRequest,
    TuneResult,
    plan_yaml,
)
from memplan.specs.loader import load_model, short
from memplan.specs.resolve import TRAINER_PRECISION
from memplan.specs.workload import TrainingWorkload
from memplan.units import format_bytes

Opt = typer.Option
CLI = "command line"
SPACE = "Search space"
SEARCH = "Search"
VALIDATE = "Validation"


SEARCHED = "searched: the plans of the space take each value it allows"
# the plan flags tune does not take as one plan's value: the search varies them, or tune has its own
# option of that name for the search space (a list, a range, or searched unless given)
EXCLUDED = {
    **{name: SEARCHED for name in ("dp", "tp", "pp", "pp_schedule", "virtual_stages", "cp", "ep", "zero", "recompute")},
    "recompute_layers": "searched plans recompute every layer of a stage, or none (--recompute is searched)",
    **{
        name: "searched with --allow-offload" for name in ("offload_optimizer", "offload_params", "offload_activations")
    },
    "quant": "searched with --allow-quantization",
    "double_quant": "a searched 4-bit base takes qlora's default (on)",
    "precision": "tune's own --precision: the precisions searched, comma-separated",
    "global_batch": "tune's own --global-batch: a number or a range searched",
    "micro_batch": "tune's own --micro-batch: fixed when given, else searched up to --max-micro-batch",
    "sequence_parallel": "tune's own --sequence-parallel: on by default for the plans with tp > 1",
    "runtime": "tune's own --runtime: the loops the search models, checked as given",
    "autocast": "the searched plans take each precision's recipe (bf16 under --runtime hf: the Trainer's bf16=True)",
    "model_build": "the searched plans load the model as a plan does by default (with a device_map; on the CPU for "
    "the Trainer's FSDP2)",
    "use_reentrant": "the searched plans checkpoint as each runtime does by default (specs.plan.checkpoint_reentrant)",
    "attention": "the searched plans run the device's default attention kernel (--device)",
    "lora_dora": "the search builds plain LoRA adapters (memplan estimate --lora-dora answers DoRA under --runtime hf)",
    **{name: "the searched plans take fp8's defaults where --precision allows fp8" for name in FP8},
    **{name: "tune searches training plans, not serving" for name in SERVING},
}


@takes_plan_flags(EXCLUDED, after="gpu")
def tune(
    flags: PlanFlags,
    model: Annotated[str, typer.Argument(help="Bundled profile name, memplan model YAML, or HF config.json.")],
    gpus: Annotated[
        int | None, Opt(help="Total GPUs; every plan uses all of them (default: the GPUs NVML detects here).", min=1)
    ] = None,
    nodes: Annotated[int | None, Opt(help="Nodes (default: whole 8-GPU nodes).", min=1)] = None,
    gpu: Annotated[
        str, Opt(help="GPU profile name or YAML, or auto: the GPU NVML detects here (h100-sxm when none).")
    ] = "auto",
    global_batch: Annotated[
        str | None,
        Opt(help="Sequences per step, or a range such as 256-1024 (default: no accumulation).", rich_help_panel=SPACE),
    ] = None,
    micro_batch: Annotated[
        int | None, Opt(help="A fixed micro-batch (default: searched).", min=1, rich_help_panel=SPACE)
    ] = None,
    max_micro_batch: Annotated[
        int, Opt(help="Largest micro-batch tried.", min=1, max=1_000_000, rich_help_panel=SPACE)
    ] = 16,
    precision: Annotated[
        str | None,
        Opt(
            help=f"Precisions allowed, comma-separated (e.g. bf16-mixed,bf16). Default: {DEFAULT_PRECISION}, as "
            f"memplan estimate and plan files ({TRAINER_PRECISION} under --runtime hf or hf-loop); with --export, "
            "bf16-mixed and bf16-master, whichever the target can express.",
            rich_help_panel=SPACE,
        ),
    ] = None,
    allow_offload: Annotated[
        bool,
        Opt(
            "--allow-offload",
            help="Also try CPU offload of optimizer states (and params) and, under --runtime hf or hf-loop, of "
            "activations.",
            rich_help_panel=SPACE,
        ),
    ] = False,
    host_memory: Annotated[str | None, Opt(help=HOST_MEMORY_HELP, rich_help_panel=SPACE)] = None,
    allow_quantization: Annotated[
        bool,
        Opt(
            "--allow-quantization",
            help="Fine-tuning: also try other base formats (lora: int8, nf4; qlora: fp4, int8).",
            rich_help_panel=SPACE,
        ),
    ] = False,
    max_cp: Annotated[
        int | None,
        Opt(help="Largest context-parallel degree (default: 8 from seq 16384, else 1).", min=1, rich_help_panel=SPACE),
    ] = None,
    sequence_parallel: Annotated[
        bool,
        Opt("--sequence-parallel/--no-sequence-parallel", help="Sequence parallelism with TP.", rich_help_panel=SPACE),
    ] = True,
    runtime: Annotated[
        Literal["memplan", "hf", "hf-loop", "megatron"] | None,
        Opt(
            help="Activation accounting (default: hf with --finetune lora or qlora, else memplan).",
            rich_help_panel=SPACE,
        ),
    ] = None,
    allocator: Annotated[
        Literal["default", "expandable"] | None,
        Opt(
            help="CUDA caching allocator the plans run under (default: PYTORCH_CUDA_ALLOC_CONF, else PyTorch's).",
            rich_help_panel=SPACE,
        ),
    ] = None,
    margin: Annotated[
        str, Opt(help="Memory kept free: a share of capacity (5%) or a size (2GiB).", rich_help_panel=SEARCH)
    ] = "5%",
    allow_tight: Annotated[
        bool,
        Opt(
            "--allow-tight",
            help="Recommend plans that fit with less headroom than the model's measured error for that kind of "
            "plan (the tight band, docs/cost-model.md); by default they count as not fitting.",
            rich_help_panel=SEARCH,
        ),
    ] = False,
    objective: Annotated[
        Literal["throughput", "memory", "pareto"],
        Opt(help="Fastest plan, smallest plan, or the Pareto front of both.", rich_help_panel=SEARCH),
    ] = "throughput",
    trials: Annotated[int, Opt(help="Trials this run adds to the study.", min=1, rich_help_panel=SEARCH)] = 300,
    exhaustive: Annotated[
        bool | None,
        Opt(
            "--exhaustive/--no-exhaustive",
            help="Predict every valid plan (no study), or run the study. Default: every plan when that is quicker "
            "than the trials (a few tens of thousands of plans), else the study.",
            rich_help_panel=SEARCH,
        ),
    ] = None,
    seed: Annotated[int, Opt(help="Sampler seed (give each worker its own).", rich_help_panel=SEARCH)] = 0,
    study: Annotated[
        str | None, Opt(help="Study name: resumes or joins it (default: a new study).", rich_help_panel=SEARCH)
    ] = None,
    storage: Annotated[
        str | None,
        Opt(
            help=f"Optuna storage URL (sqlite:///FILE, postgresql://...). Default: {STUDY_FILE} in the working "
            "directory.",
            rich_help_panel=SEARCH,
        ),
    ] = None,
    calibration: Annotated[
        bool,
        Opt(
            "--calibration/--no-calibration", help="Apply the GPU profile's stored calibration.", rich_help_panel=SEARCH
        ),
    ] = True,
    validate: Annotated[
        int, Opt("--validate", help="Run the best K plans with the bundled trainer.", min=0, rich_help_panel=VALIDATE)
    ] = 0,
    validate_steps: Annotated[int, Opt(help="Measured steps per run.", min=1, rich_help_panel=VALIDATE)] = 2,
    validate_timeout: Annotated[
        float, Opt(help="Seconds before a run is ended.", min=1, rich_help_panel=VALIDATE)
    ] = 600,
    validate_device: Annotated[
        Literal["auto", "cpu", "cuda"],
        Opt(help="Where runs go (auto: CUDA when NVML sees GPUs).", rich_help_panel=VALIDATE),
    ] = "auto",
    memory_limit: Annotated[
        str | None,
        Opt(
            help="Simulated device capacity for CPU runs, e.g. 2GiB (default: none, the host's memory).",
            rich_help_panel=VALIDATE,
        ),
    ] = None,
    device: Annotated[
        Literal["cuda", "cpu"],
        Opt(help="Where the plans run: cuda (the GPU profile) or cpu: which attention kernel runs and keeps what."),
    ] = "cuda",
    top: Annotated[int, Opt(help="Plans shown.", min=1)] = 10,
    workdir: Annotated[
        str | None,
        Opt(
            "--workdir",
            help=f"Folder for the plan, its exports and the study (default: {WORK_ROOT}/MODEL-GPUSxGPU under the "
            "current directory, e.g. memplan-tune/llama3-8b-8xh100-sxm).",
        ),
    ] = None,
    out: Annotated[
        str | None,
        Opt("--out", help=f"Where the recommended plan YAML goes (default: {PLAN_FILE} in the working directory)."),
    ] = None,
    export: Annotated[
        str | None,
        Opt(
            "--export",
            help="Also write the recommended plan for a trainer: deepspeed, accelerate, torchtitan, megatron or "
            "fsdp2 (beside --out, with the target's suffix); only plans the target can express are searched.",
        ),
    ] = None,
    format: Annotated[Literal["table", "json"], Opt("--format", help="table or json.")] = "table",
    timeline: Annotated[
        str | None,
        Opt(
            "--timeline",
            help="Also draw the recommended plan's predicted run to this file: .html, .svg, .png (the viz "
            "extra) or .pickle (PyTorch's memory snapshot format), as memplan estimate --timeline does.",
        ),
    ] = None,
) -> None:
    """Search the parallel plans for the fastest one that fits; write it as a plan YAML."""
    check_export(export)
    # before any search: a plan found cannot be lost to a bad path
    output_path(out, "--out", inputs=(model,))
    refuse_tracked(out, "--out")
    if storage is not None:  # a study database that cannot be opened or created, refused before any search
        from memplan.search.study import check_storage

        check_storage(storage)
    drawing = None
    if timeline is not None:
        from memplan.viz.output import check_output

        drawing = check_output(timeline)
    given = {k: v for k, v in flags.values.items() if v is not None}
    _check_plan_flags(flags)
    setup = tune_request(
        load_model(model), model, gpus=gpus, nodes=nodes, gpu=gpu, global_batch=global_batch,
        seq_len=given.get("seq_len", TrainingWorkload.model_fields["seq_len"].default),
        micro_batch=micro_batch, max_micro_batch=max_micro_batch, precision=precision,
        optimizer=given.get("optimizer", "adamw"), allow_offload=allow_offload, host_memory=host_memory,
        finetune=given.get("finetune", "full"), lora_rank=given.get("lora_rank", 16),
        lora_targets=given.get("lora_targets", "q_proj,v_proj"), lora_dropout=given.get("lora_dropout", 0.0),
        modules_to_save=given.get("modules_to_save"),
        allow_quantization=allow_quantization, max_cp=max_cp, sequence_parallel=sequence_parallel, runtime=runtime,
        allocator=allocator, margin=margin, allow_tight=allow_tight, objective=objective, trials=trials,
        exhaustive=exhaustive, seed=seed,
        study=study, storage=storage, calibration=calibration, validate=validate, validate_steps=validate_steps,
        validate_timeout=validate_timeout, validate_device=validate_device, memory_limit=memory_limit, device=device,
        top=top, export=export, workdir=workdir,
    )  # fmt: skip
    warn(setup.warnings)
    request = setup.request
    if out is None:
        out = str(setup.folder / PLAN_FILE)
        output_path(out, "--workdir", inputs=(model,))
        refuse_tracked(out, "--workdir")
    result = _run(request, show=format == "table")
    if setup.gpu_note:  # --gpu auto or --gpus detected: which GPU and why, in the JSON as in the table
        result = result.model_copy(update={"gpu_auto": setup.gpu_note})
    out_path = Path(out)
    if result.recommended is not None:
        out = out_path
        out.parent.mkdir(parents=True, exist_ok=True)
        # a model file is named relative to the plan file (as memplan export reads it)
        ref = os.path.relpath(Path(model).resolve(), out.parent.resolve()) if Path(model).is_file() else model
        out.write_text(plan_yaml(result, request, ref))
        result = result.model_copy(update={"plan_path": str(out)})
    if storage is not None and result.study is None:  # --storage given, but the search stored no study
        note_unused_storage(storage, result.search_reason)
    if format == "json":
        typer.echo(result.model_dump_json(indent=2))
    else:
        if result.gpu_auto:  # --gpu auto or --gpus detected: which GPU and why
            Console().print(result.gpu_auto, soft_wrap=True)
        render(result, Console(), model)
    if export is not None and result.recommended is not None:
        _export(model, out_path, export)
    if drawing is not None:
        _timeline(model, out_path if result.recommended is not None else None, device, *drawing)
    err = Console(stderr=True)
    if result.interrupted:
        if result.study:
            err.print(
                f"interrupted: {result.trials} trials are saved in study {result.study!r} ({result.storage}); "
                f"resume with the same options and --study {result.study} --storage {result.storage}",
                soft_wrap=True,
            )
        else:
            err.print("interrupted")
        raise typer.Exit(130)
    if result.recommended is None:
        raise typer.Exit(1)


FINETUNE_FLAGS = ("finetune", "lora_rank", "lora_targets", "lora_dropout", "modules_to_save")


def _check_plan_flags(flags: PlanFlags) -> None:
    """The optimizer and fine-tuning flags given, checked as estimate checks them (an error names the
    flag: ``--lora-rank`` without ``--finetune lora`` is refused, not ignored)."""
    from memplan.specs.resolve import plan_from_flags

    fields = {k: v for k, v in flags.overrides().items() if k in (*FINETUNE_FLAGS, "optimizer") and v is not None}
    if fields:
        plan_from_flags(fields)


def note_unused_storage(storage: str, reason: str) -> None:
    """One stderr line: ``--storage`` was given but no study was stored in it (every plan was
    predicted, no Optuna study ran), and how to get one."""
    print(
        f"memplan: note: --storage {short(storage, 100)}: no study stored there: every plan was predicted "
        f"({reason}), no Optuna study ran; give --no-exhaustive to run and store one",
        file=sys.stderr,
    )


def refuse_tracked(path: str | Path | None, field: str, then: str = "") -> None:
    """A file git tracks is never written over: a plan or configuration committed beside the
    code is the user's (``git ls-files --error-unmatch``: 0 tracked, 1 not, 128 no repository;
    without git, nothing to refuse). ``then`` ends the message (what was kept)."""
    if path is None or not Path(path).is_file():
        return
    path = Path(path)
    try:
        asked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", "--", path.name],
            cwd=path.absolute().parent,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return
    if asked.returncode == 0:
        raise MemplanError(
            f"{short(path, 100)}: a file git tracks: tune does not write over it; give another path{then}",
            source=CLI,
            field=field,
        )


def _timeline(model: str, plan_path: Path | None, device: str, path: Path, kind: str) -> None:
    """The recommended plan's predicted run, read back from its YAML as ``memplan estimate`` reads it."""
    err = Console(stderr=True)
    if plan_path is None:
        err.print(f"no plan fits: no timeline written to {short(path, 100)}", soft_wrap=True)
        return
    from memplan.specs.resolve import resolve_job
    from memplan.viz.output import write_job_timeline

    job = resolve_job(model, str(plan_path), {})
    write_job_timeline(job, path, kind, device, title=f"recommended: {job.model.name} ({plan_path})")
    err.print(f"timeline: {path} (the recommended plan's predicted run)", soft_wrap=True)


def _export(model: str, plan_path: Path, target: str) -> Path:
    """The recommended plan, read back from its YAML as ``memplan export`` reads it, written
    for ``target`` beside it; the notes on what the trainer must do go to stderr."""
    from memplan.export import render
    from memplan.specs.resolve import resolve_job

    job = resolve_job(model, str(plan_path), {})
    try:
        exported = render(job, target)
    except MemplanError as err:
        # the searched plan uses something the target cannot express: say so, keep the YAML
        raise MemplanError(f"{err.reason} (the plan YAML is in {plan_path})", source=CLI, field="--export") from None
    path = plan_path.with_name(f"{plan_path.stem}-{target}{exported.suffix}")
    refuse_tracked(path, "--export", f" (the plan YAML is in {short(plan_path, 100)})")
    try:
        path.write_text(exported.text)
    except OSError as exc:  # --out was checked before the search; this name is the target's, beside it
        reason = f"{short(path, 100)}: cannot be written ({exc.strerror or exc.__class__.__name__})"
        raise MemplanError(
            f"{reason} (the plan YAML is in {short(plan_path, 100)})", source=CLI, field="--export"
        ) from None
    err_console = Console(stderr=True)
    err_console.print(f"wrote {path}", soft_wrap=True)
    for note in exported.notes:
        err_console.print(f"memplan: note: {note}", soft_wrap=True, highlight=False)
    return path


def _run(request: TuneRequest, show: bool) -> TuneResult:
    """The search with a progress bar on stderr. The first Ctrl-C stops a study after the
    running trial (the study keeps every finished one), or the validation after the running
    run; a second Ctrl-C, or one during an exhaustive search (nothing to keep), aborts."""
    import warnings

    import optuna

    from memplan.search.tune import tune as run_tune

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    console = Console(stderr=True)
    stop = {"requested": False, "phase": ""}

    def on_sigint(signum: int, frame: object) -> None:
        if stop["requested"] or stop["phase"] == "evaluating":
            raise KeyboardInterrupt
        stop["requested"] = True
        console.print("stopping after the current trial or run (Ctrl-C again to abort)")

    # a live bar only on a terminal (a pipe or a log gets no redraws), started with the first task
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=not (show and console.is_terminal), transient=True,
    )  # fmt: skip
    task = {"id": None}

    def started(what: str, total: int) -> None:
        stop["phase"] = what
        if task["id"] is None:
            progress.start()
        else:
            progress.remove_task(task["id"])
        task["id"] = progress.add_task(what, total=total)

    hooks = Hooks(
        started=started,
        advanced=lambda n: progress.update(task["id"], completed=n),
        step=lambda s, t: progress.update(task["id"], completed=s),
        should_stop=lambda: stop["requested"],
    )
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        return run_tune(request, hooks)
    finally:
        progress.stop()
        signal.signal(signal.SIGINT, previous)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:,.1f}"


def render(result: TuneResult, console: Console, model_ref: str) -> None:
    """The header, the table of the best plans, the recommendation or what would make one fit."""
    where = f"{result.gpus} x {result.gpu} ({result.nodes} node{'s' if result.nodes > 1 else ''})"
    how = (
        f"every plan predicted ({result.evaluated:,})"
        if result.exhaustive
        else f"{result.trials_run} trials run, {result.evaluated:,} distinct plans in study {result.study!r} "
        f"({result.trials} trials, {result.storage})"
    )
    valid = f"{result.space_size:,} valid plans"
    if result.export_target:
        valid += f" that {result.export_target} can express (of {result.space_before_export:,})"
    console.print(
        f"[bold]{result.model}[/] on {where}: {valid}, {how}; objective {result.objective}; "
        f"fits = peak reserved <= {format_bytes(result.limit_bytes)} ({format_bytes(result.capacity_bytes)} "
        f"less {format_bytes(result.margin_bytes)} margin)",
        soft_wrap=True,
    )
    if result.search_reason:
        console.print(f"search: {'every plan' if result.exhaustive else 'Optuna study'}, {result.search_reason}",
                      soft_wrap=True, highlight=False)  # fmt: skip
    if result.host_memory_bytes is not None:
        console.print(
            f"host memory per node: {format_bytes(result.host_memory_bytes)} ({result.host_memory_source}); "
            "a plan keeping more there (CPU offload, pinned) does not fit",
            soft_wrap=True,
        )
    if result.calibration:
        c = result.calibration
        console.print(
            f"calibration of {result.gpu}: step time x{c['step_time_ratio']:.3f}, peak x{c['peak_ratio']:.3f}"
        )
    if result.top:
        table, legend = _table(result, console.width)
        console.print(table)
        if legend:
            console.print(legend, soft_wrap=True, highlight=False)
    if result.recommended is not None:
        r = result.recommended
        won = f" (trial {r.trial} of the study)" if r.trial is not None else ""
        console.print(f"[green]recommended[/]: {r.evaluation.candidate.describe()}{won}", soft_wrap=True)
        if result.plan_path:
            console.print(f"written to {result.plan_path}; check it with: memplan estimate {model_ref} --plan "
                          f"{result.plan_path}", soft_wrap=True)  # fmt: skip
    if result.micro_batch_ladder:
        ladder = Table(title="the recommended plan's largest micro-batch that fits, by sequence length")
        for col in ("seq len", "micro-batch", "peak reserved"):
            ladder.add_column(col, justify="right")
        for row in result.micro_batch_ladder:
            size = "-" if row.peak_reserved_bytes is None else format_bytes(row.peak_reserved_bytes, "GiB")
            ladder.add_row(f"{row.seq_len:,}", str(row.micro_batch) if row.micro_batch else "none", size)
        console.print(ladder)
    if result.calibration_written:
        w = result.calibration_written
        step = f"step time x{w['step_time_ratio']:.3f}" if w["step_time_ratio"] else "step time not measured"
        console.print(f"calibration of {w['gpu']} updated in {w['path']}: {step}, peak x{w['peak_ratio']:.3f}")
    if result.closest is not None:
        c = result.closest
        if c.fits:  # the device holds it; the node's host memory (--host-memory) does not
            console.print(
                f"[red]nothing fits[/] the host memory: the closest plan, {c.candidate.describe()}, fits the device "
                f"({format_bytes(c.peak_reserved_bytes)} reserved) but keeps more than "
                f"{format_bytes(result.host_memory_bytes or 0)} in the node's RAM ({result.host_memory_source})",
                soft_wrap=True,
            )
        else:
            console.print(
                f"[red]nothing fits[/]: the closest plan, {c.candidate.describe()}, peaks at "
                f"{format_bytes(c.peak_reserved_bytes)} reserved "
                f"({format_bytes(c.peak_reserved_bytes - c.limit_bytes)} over)",
                soft_wrap=True,
            )
        if result.fixes:
            table = Table(title="What would make it fit")
            for col in ("change", "peak reserved GiB", "limit GiB"):
                table.add_column(col, justify="left" if col == "change" else "right")
            for f in result.fixes:
                table.add_row(f.change, _gib(f.peak_reserved_bytes), _gib(f.limit_bytes))
            console.print(table)
        else:
            console.print("no single change, up to 8x the GPUs or a bundled GPU with more memory would make it fit")


# The best-plans table: short headers (HEADERS; LEGEND names each abbreviation once, under the
# table) and no cell ever cut: the columns are no_wrap at their widest cell, and when the terminal
# is narrower than the table (80 columns, a pipe's default), the least important columns go
# first (DROPPABLE: the trial number, MFU, the headroom, then the settings beside the degrees),
# never the degrees, recomputation, the memory or tokens/s.
HEADERS = {
    "micro-batch": "mb", "global batch": "gb", "peak GiB": "peak\nGiB", "headroom GiB": "head-\nroom\nGiB",
    "measured peak GiB": "meas.\npeak\nGiB", "measured tokens/s": "meas.\ntokens/s",
}  # fmt: skip
LEGEND = {
    "mb": "micro-batch", "gb": "global batch", "peak": "peak reserved per GPU",
    "meas.": "measured by --validate's runs",
}  # fmt: skip
RECOMPUTE = {"selective": "sel", "selective-op": "sel-op"}  # the recompute column's short values
DROPPABLE = ("trial", "MFU", "headroom GiB", "global batch", "precision", "offload", "micro-batch")


def _table(result: TuneResult, width: int = 10**6) -> tuple[Table, str]:
    """The best plans as a table that fits ``width`` columns, and its legend line (the
    abbreviations used and any column left out to fit)."""
    rows, cols = _rows(result)
    dropped: list[str] = []
    table = _build(result, rows, cols)
    for name in DROPPABLE:
        if _width(table) <= width:
            break
        if name in cols:
            cols.remove(name)
            dropped.append(name)
            table = _build(result, rows, cols)
    used = {HEADERS.get(c, c).split("\n")[0] for c in cols}
    notes = [f"{short} = {long}" for short, long in LEGEND.items() if short in used]
    if "recompute" in cols and any(r["recompute"] in RECOMPUTE.values() for r in rows):
        notes.append("recompute " + ", ".join(f"{v} = {k}" for k, v in RECOMPUTE.items()))
    if dropped:
        notes.append(f"left out at this width: {', '.join(dropped)} (--format json has every figure)")
    return table, "; ".join(notes)


def _width(table: Table) -> int:
    """The columns ``table`` takes when nothing is wrapped or cut."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10**4)
    return Measurement.get(console, console.options, table).maximum


def _build(result: TuneResult, rows: list[dict[str, str]], cols: list[str]) -> Table:
    title = "Pareto front (tokens/s vs peak memory)" if result.objective == "pareto" else "Best plans"
    table = Table(title=title)
    for c in cols:
        header = HEADERS.get(c, c)
        widest = max([len(r[c]) for r in rows] + [len(line) for line in header.split("\n")])
        justify = "left" if c in ("recompute", "precision", "offload", "run") else "right"
        table.add_column(header, justify=justify, no_wrap=True, min_width=widest)
    for r in rows:
        table.add_row(*(r[c] for c in cols))
    return table


def _rows(result: TuneResult) -> tuple[list[dict[str, str]], list[str]]:
    """Every plan's cells by column, and the columns shown (those that vary or matter)."""
    plans = result.top
    evs = [r.evaluation for r in plans]
    show = {
        "cp": any(e.plan.cp > 1 for e in evs),
        "ep": any(e.plan.ep > 1 for e in evs),
        "global batch": len({e.workload.global_batch for e in evs}) > 1,
        "precision": len({e.plan.precision for e in evs}) > 1,
        "offload": any(e.candidate.offload_label != "none" for e in evs),
        "validated": any(r.validation for r in plans),
        "trial": not result.exhaustive,
    }
    cols = ["#", "trial", "dp", "tp", "pp", "cp", "ep", "zero", "recompute", "micro-batch", "global batch",
            "precision", "offload", "peak GiB", "headroom GiB", "tokens/s", "MFU"]  # fmt: skip
    cols = [c for c in cols if show.get(c, True)]
    if show["validated"]:
        cols += ["run", "measured peak GiB", "measured tokens/s"]
    rows = []
    for r in plans:
        e, p, v = r.evaluation, r.evaluation.plan, r.validation
        pp = f"{p.pp}" + (f"x{p.virtual_stages}" if p.pp_schedule == "interleaved" else "")
        rows.append({
            "#": str(r.rank), "trial": "-" if r.trial is None else str(r.trial), "dp": str(p.dp), "tp": str(p.tp),
            "pp": pp, "cp": str(p.cp), "ep": str(p.ep), "zero": str(p.zero),
            "recompute": RECOMPUTE.get(p.recompute, p.recompute),
            "micro-batch": str(e.workload.micro_batch), "global batch": str(e.workload.global_batch),
            "precision": p.precision, "offload": e.candidate.offload_label,
            "peak GiB": _gib(e.peak_reserved_bytes), "headroom GiB": _gib(e.headroom_bytes),
            "tokens/s": f"{e.tokens_per_s:,.0f}", "MFU": f"{100 * e.mfu:.1f}%",
            "run": "-" if v is None else (v.status + (" (sim.)" if v.simulated else "")),
            "measured peak GiB": "-" if v is None else _gib(v.measured_peak_bytes),
            "measured tokens/s": "-" if v is None or not v.measured_tokens_per_s else f"{v.measured_tokens_per_s:,.0f}",
        })  # fmt: skip
    return rows, cols
