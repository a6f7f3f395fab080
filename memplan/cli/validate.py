"""``memplan validate``: run a plan with the bundled trainer, print measured against predicted."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from memplan.cli.common import auto_device, detected_gpus, output_path
from memplan.cli.options import PlanFileOpt, precision_help
from memplan.cli.planflags import FP8, SERVING, PlanFlags, takes_plan_flags
from memplan.costmodel.flops import rank_flops_per_step
from memplan.costmodel.time import matmul_peak_flops
from memplan.errors import MemplanError
from memplan.estimation import estimate as run_estimate
from memplan.specs.detect import AUTO
from memplan.specs.resolve import CLI, alloc_conf_text, resolve_job
from memplan.specs.values import memory_limit_bytes
from memplan.units import format_bytes
from memplan.validate.capacity import check_fits_here, host_available_bytes, require_cuda
from memplan.validate.compare import Validation, compare
from memplan.validate.launch import launch, pick_record
from memplan.validate.record import RunRecord
from memplan.validate.snapshot import check_snapshot_dir, refuse_cpu, snapshot_path
from memplan.validate.spec import RunSpec
from memplan.validate.support import TrainerUnsupported, check_model, check_plan, check_workload

Opt = typer.Option
PLAN = "Plan"
RUN = "Run"


# the plan flags the bundled trainer cannot honour (memplan.validate.support says why for the plan's fields)
EXCLUDED = {
    "cp": "the bundled trainer has no context parallelism",
    "ep": "the bundled trainer builds dense models: no expert parallelism",
    "optimizer": "the bundled trainer runs adamw",
    "runtime": "the bundled trainer's step is the runtime (memplan)",
    "autocast": "the bundled trainer's precision is its recipe (autocast is the transformers Trainer's bf16=True)",
    "model_build": "the bundled trainer builds its model itself (model_build is the transformers Trainer's)",
    "use_reentrant": "the bundled trainer checkpoints non-reentrantly (use_reentrant is transformers' checkpoint's)",
    "lora_dora": "the bundled trainer builds plain LoRA adapters (memplan.train.lora); DoRA is PEFT's",
    **{name: "the bundled trainer runs no fp8 matmuls" for name in FP8},
    **{name: "validate runs training steps, not serving" for name in SERVING},
}
# where the trainer honours less than the estimate models
HELPS = {
    "precision": precision_help("fp32, bf16-mixed, bf16-master, bf16"),
    "offload_optimizer": "none or cpu (default: none).",
    "offload_params": "none or cpu, with ZeRO-3 (default: none).",
    "finetune": "full, lora (adapters over a frozen base, memplan.train.lora) or qlora (over a bitsandbytes nf4, fp4 "
    "or int8 base computing in fp32 or bf16, memplan.train.quant) (default: full).",
}


@takes_plan_flags(EXCLUDED, HELPS, after="gpus")
def validate(
    flags: PlanFlags,
    model: Annotated[str, typer.Argument(help="Bundled profile name, memplan model YAML, or HF config.json.")],
    plan: PlanFileOpt = None,
    gpus: Annotated[
        int | None,
        Opt(
            help="Total GPUs, dp = GPUs / (tp x pp) (default: the GPUs NVML detects here, unless --plan or --dp is "
            "given).",
            min=1,
            rich_help_panel=PLAN,
        ),
    ] = None,
    steps: Annotated[int, Opt(help="Measured steps after one warm-up step.", min=1, rich_help_panel=RUN)] = 2,
    simulate_ranks: Annotated[
        bool,
        Opt(
            "--simulate-ranks/--real-ranks",
            help="Run the most-loaded rank alone under the fake process group (memory real, time not), "
            "or every rank as a real process under torchrun.",
            rich_help_panel=RUN,
        ),
    ] = True,
    device: Annotated[Literal["auto", "cpu", "cuda"], Opt(help="Where to run.", rich_help_panel=RUN)] = "auto",
    gpu: Annotated[
        str | None,
        Opt(
            help="GPU profile for the prediction's capacity and MFU's peak, or auto: the GPU NVML detects here "
            "(the default; h100-sxm when none).",
            rich_help_panel=RUN,
        ),
    ] = None,
    allocator: Annotated[
        Literal["default", "expandable"] | None,
        Opt(
            help="CUDA caching allocator: the runs set PYTORCH_CUDA_ALLOC_CONF to match (default: the environment's).",
            rich_help_panel=RUN,
        ),
    ] = None,
    memory_limit: Annotated[
        str | None,
        Opt(
            help="Simulated device capacity on CPU, e.g. 2GiB (an OOM beyond it) (default: none, the host's memory).",
            rich_help_panel=RUN,
        ),
    ] = None,
    timeout: Annotated[float, Opt(help="Seconds before every rank is ended.", min=1, rich_help_panel=RUN)] = 600,
    out: Annotated[Path | None, Opt("--out", help="Where to write the run record JSON.", rich_help_panel=RUN)] = None,
    snapshot: Annotated[
        Path | None,
        Opt(
            "--snapshot",
            help="CUDA: record each rank's PyTorch memory snapshot into this folder (read it with memplan explain).",
            rich_help_panel=RUN,
        ),
    ] = None,
    format: Annotated[Literal["table", "json"], Opt("--format", help="table or json.")] = "table",
    force: Annotated[
        bool,
        Opt(
            "--force",
            help="Start even when the predicted peak exceeds the memory this machine has free.",
            rich_help_panel=RUN,
        ),
    ] = False,
) -> None:
    """Run a plan for a few steps with the bundled trainer; measured against predicted memory."""
    output_path(out, "--out", inputs=(model, plan))  # before any work
    if snapshot is not None:  # the folder is checked before any work, the device once it is known
        check_snapshot_dir(snapshot)
    overrides = {**flags.overrides(), "gpu": gpu, "runtime": "memplan", "allocator": allocator}
    notes = []
    # the degrees are this machine's GPUs, when NVML sees any
    if gpus is None and plan is None and flags.values["dp"] is None:
        gpus, detected = detected_gpus()
        notes.append(detected)
    job = resolve_job(model, plan, {**overrides, "gpus": gpus}, inference=False, default_gpu=AUTO)
    limit = memory_limit_bytes(memory_limit or None)
    where = auto_device(device, "validate", "--device")
    if where == "cuda":
        require_cuda("--device", CLI)
    if snapshot is not None:
        refuse_cpu(where)
    result = run_estimate(job, with_suggestions=False, device=where)
    report = result.memory
    spec = RunSpec(
        model=job.model,
        workload=job.workload,
        plan=job.plan,
        steps=steps,
        device=where,
        simulate=simulate_ranks,
        rank=report.peak.rank,
        memory_limit=limit,
        alloc_conf=alloc_conf_text("expandable" if job.allocator.expandable_segments else "default"),
        peak_flops=matmul_peak_flops(job.gpu, job.plan.precision) if where == "cuda" else None,
        flops_per_step=rank_flops_per_step(
            job.model,
            job.workload.seq_len,
            job.workload.micro_batch * job.workload.seq_len * report.gradient_accumulation,
            job.plan,
        ),
    )
    try:
        check_model(spec.model)
        check_plan(spec.plan)
        check_workload(spec)
    except TrainerUnsupported as err:
        raise MemplanError(err.reason, source=plan or CLI, field=err.field) from None
    if where == "cpu" and not force:
        # on the CPU every rank this host runs holds its tensors in host memory: one with --simulate-ranks
        # (the busiest), else all of them; a GPU's own out-of-memory is what a run there may be meant to find
        ranks = 1 if simulate_ranks else job.plan.world_size
        needed = report.peak.allocated * ranks
        if limit is not None:
            needed = min(needed, limit * ranks)  # the run stops at the simulated capacity
        check_fits_here(needed, host_available_bytes(), "host", plan or CLI)
    target = snapshot_path(snapshot, _run_name(job), spec.rank if simulate_ranks else None) if snapshot else None
    notes = [n for n in (job.gpu_note, *notes) if n]
    if notes and format == "table":  # --gpu auto or --gpus detected: which and why, once the run is sure to start
        Console().print("; ".join(notes), soft_wrap=True)
    record, path, by_rank = _run(spec, timeout, out, show=format == "table", snapshot=target)
    predicted_time = result.time.step_time_s if result.time is not None else None
    validation = compare(report, record, str(path) if path else None, predicted_time)
    if not simulate_ranks:
        validation = validation.model_copy(update={"measured_bytes_by_rank": by_rank})
    if target is not None:
        validation = validation.model_copy(update={"snapshot_path": str(target)})
    if notes:  # --gpu auto or --gpus detected, in the JSON as in the table
        validation = validation.model_copy(update={"gpu_auto": "; ".join(notes)})
    if format == "json":
        typer.echo(validation.model_dump_json(indent=2))
    else:
        render(validation, Console())
    if record.status != "ok":
        raise typer.Exit(1)


def _run_name(job) -> str:
    """``llama3-8b-dp8-tp1-pp1-zero3``: the snapshot's file name, the plan's degrees in it."""
    p = job.plan
    return f"{job.model.name}-dp{p.dp}-tp{p.tp}-pp{p.pp}-zero{p.zero}".replace("/", "_")


def _run(
    spec: RunSpec, timeout: float, out: Path | None, show: bool, snapshot: Path | None = None
) -> tuple[RunRecord, Path | None, dict[int, int]]:
    """Launch, with a progress bar on stderr; the record is copied to ``--out`` at once. Also returns
    the measured peak of every rank that reported one."""
    console = Console(stderr=True)
    total = spec.steps + spec.warmup
    with tempfile.TemporaryDirectory(prefix="memplan-validate-") as tmp:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
            TimeElapsedColumn(), console=console, disable=not show, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("validating", total=total)
            result = launch(
                spec, Path(tmp), timeout, progress=lambda s, t: bar.update(task, completed=s), snapshot=snapshot
            )
        record = pick_record(spec, result)
        by_rank = {r: rec.peak_allocated for r, rec in sorted(result.records.items()) if rec.peak_allocated is not None}
        path = out
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(record.model_dump_json(indent=2))
    return record, path, by_rank


def _b(n: int | None) -> str:
    return "-" if n is None else format_bytes(n, "MiB")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def oom_where(oom: dict) -> str:
    """``the forward of the warm-up step (step 1)``: the phase and the step an out-of-memory
    happened in (a record's ``oom``); ``setup`` before the first step (or in a record without the step)."""
    step = oom.get("step")
    if step is None:
        return oom["phase"]
    which = "the warm-up step" if oom.get("warmup") else "a measured step"
    return f"the {oom['phase']} of {which} (step {step})"


def render(v: Validation, console: Console) -> None:
    where = f"rank {v.rank} (stage {v.stage}) of {v.world_size}" + (", simulated" if v.simulated else "")
    console.print(f"[bold]validate[/] on {v.device} ({v.device_name}), {where}: status [bold]{v.status}[/]")
    if v.reason:
        console.print(f"reason: {v.reason}")
    oom = v.record.get("oom")
    if oom:
        console.print(
            f"[red]out of memory[/] in {oom_where(oom)}: requested {_b(oom['requested_bytes'])}, "
            f"peak so far {_b(oom['peak_bytes'])}"
        )
    table = Table(title="Peak allocated: predicted (--runtime memplan) vs measured")
    for col in ("", "predicted", "measured", "error"):
        table.add_column(col, justify="right" if col else "left")
    table.add_row("[bold]peak[/]", _b(v.predicted_bytes), _b(v.measured_bytes), _pct(v.error_pct))
    if v.measured_reserved_bytes:
        table.add_row("peak reserved", _b(v.predicted_reserved_bytes), _b(v.measured_reserved_bytes),
                      _pct(v.reserved_error_pct))  # fmt: skip
    table.add_section()
    for name, row in v.phases.items():
        table.add_row(f"phase {name}", _b(row.predicted_bytes), _b(row.measured_bytes), _pct(row.error_pct))
    table.add_section()
    for name, row in v.components.items():
        table.add_row(name.replace("_", " "), _b(row.predicted_bytes), _b(row.measured_bytes), _pct(row.error_pct))
    if (host := v.offload_host) is not None:  # the activations' host copies (pinned memory on a GPU)
        table.add_section()
        row = (_b(host.predicted_bytes), _b(host.measured_bytes), _pct(host.error_pct))
        table.add_row("host (activation offload)", *row)
    console.print(table)
    if v.measured_bytes_by_rank:
        ranks = ", ".join(f"rank {r} {_b(n)}" for r, n in v.measured_bytes_by_rank.items())
        console.print(f"measured peak of every rank: {ranks}", soft_wrap=True)
    if v.step_time_s is not None:
        note = " (simulated rank: not the real job's step time)" if v.simulated else ""
        tps = f", {v.tokens_per_s:,.0f} tokens/s" if v.tokens_per_s else ""
        mfu = f", MFU {100 * v.mfu:.1f}%" if v.mfu is not None else ""
        console.print(f"step time {v.step_time_s * 1000:.1f} ms (median){tps}{mfu}{note}")
    if v.predicted_step_time_s is not None:
        predicted = v.predicted_step_time_s * 1000
        console.print(f"predicted step time of the whole job on the --gpu profile: {predicted:.1f} ms")
    if v.record_path:
        console.print(f"record: {v.record_path}")
    if v.snapshot_path:
        console.print(f"memory snapshot: {v.snapshot_path} (read it with memplan explain and the same model and plan)")
