"""``memplan estimate``: per-GPU memory of one configuration, and what would make it fit."""

# No ``from __future__ import annotations``: typer reads the options from the annotations, and as
# objects (built once, at import) they cost it nothing, where strings are evaluated again on every
# run (about 7 ms of a cold estimate: benchmarks/bench_estimate.py).
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from memplan.cli.app import keep_to_exit
from memplan.cli.common import HOST_MEMORY_HELP, warn
from memplan.cli.options import GpusOpt, NodesOpt, PlanFileOpt
from memplan.cli.planflags import PlanFlags, takes_plan_flags
from memplan.costmodel.optimizer import paged_residency
from memplan.costmodel.report import MemoryReport
from memplan.costmodel.timeline.events import Timeline
from memplan.estimation import EstimateResult, report_job
from memplan.specs.detect import AUTO
from memplan.specs.resolve import Job, resolve_job
from memplan.specs.values import host_memory_bytes
from memplan.units import format_bytes

Opt = typer.Option
HW = "Hardware"


@takes_plan_flags()
def estimate(
    model: Annotated[str, typer.Argument(help="Bundled profile name, memplan model YAML, or HF config.json.")],
    flags: PlanFlags,
    plan: PlanFileOpt = None,
    gpu: Annotated[
        str | None,
        Opt(
            help="GPU profile name or YAML, or auto: the GPU NVML detects here (the default; h100-sxm when none).",
            rich_help_panel=HW,
        ),
    ] = None,
    allocator: Annotated[
        str | None,
        Opt(
            help="CUDA caching allocator: default or expandable (expandable_segments:True). "
            "Default: what PYTORCH_CUDA_ALLOC_CONF says, else PyTorch's default.",
            rich_help_panel=HW,
        ),
    ] = None,
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
    host_memory: Annotated[str | None, Opt(help=HOST_MEMORY_HELP, rich_help_panel=HW)] = None,
    calibration: Annotated[
        bool,
        Opt(
            "--calibration/--no-calibration",
            help="Scale the step time by the GPU profile's measured/predicted ratio (memplan tune --validate).",
        ),
    ] = True,
    device: Annotated[
        Literal["cuda", "cpu"],
        Opt(
            help="Where the step runs: cuda (the GPU profile) or cpu (a CPU run of the trainer, as the CPU "
            "accuracy suites measure): which attention kernel runs and what it keeps.",
            rich_help_panel=HW,
        ),
    ] = "cuda",
    format: Annotated[Literal["table", "json"], Opt("--format", help="table or json.")] = "table",
    timeline: Annotated[
        str | None,
        Opt(
            "--timeline",
            help="Also draw the predicted run of the most-loaded rank to this file: .html (self-contained, "
            "interactive), .svg or .png (the viz extra), or .pickle (PyTorch's memory snapshot format).",
        ),
    ] = None,
) -> None:
    """Per-GPU memory of one configuration at the peak of a step, on the most-loaded rank."""
    target = None
    if timeline is not None:  # checked before any work; memplan.viz is imported only when asked for
        from memplan.viz.output import check_output

        target = check_output(timeline)
    overrides = {**flags.overrides(), "gpu": gpu, "allocator": allocator, "gpus": gpus, "nodes": nodes}
    job = resolve_job(model, plan, overrides, inference=flags.inference, default_gpu=AUTO)
    host_bytes, host_source = host_memory_bytes(host_memory, job.gpu_note)
    result, run, which = report_job(job, calibration, device, host_bytes, host_source)
    warn(result.warnings)  # legal but suspicious inputs, one stderr line each (also in the JSON)
    if target is not None:
        _write_timeline(job, result, run, which, *target)
    if format == "json":
        typer.echo(result.model_dump_json(indent=2))
    else:
        render(result, _console())
        if target is not None:
            Console().print(f"timeline: {target[0]} (the predicted run of rank {result.memory.peak.rank})")
    keep_to_exit(job, result, run)  # freed with the process, not as this frame returns (cli.app)


def _write_timeline(job: Job, result: EstimateResult, run: Timeline, which: str, path: Path, kind: str) -> None:
    """The predicted run (the one the allocator verdict replayed, not built again) drawn or written
    as a snapshot."""
    from memplan.viz.output import write_panels
    from memplan.viz.predicted import predicted_panel
    from memplan.viz.snapshot import write_snapshot
    from memplan.viz.track import replay_timeline

    track = replay_timeline(run, job.allocator)
    if kind == "pickle":
        write_snapshot(track, path)
    else:
        write_panels([predicted_panel(track, job, which, result.memory.overhead)], path, kind)


def _console() -> Console:
    """The report's console, without rich's emoji codes (a name such as ``:fire:`` in a model or file
    name is printed as written: ~13 M instructions of a cold estimate spent looking for them,
    benchmarks/bench_estimate.py); where it writes no styles (not a terminal: a pipe or a file;
    ``NO_COLOR``), also without its automatic highlighting, which only adds styles and whose first
    use compiles its regular expressions (~20 M instructions)."""
    plain = Console(emoji=False, highlight=False)
    return plain if plain.color_system is None else Console(emoji=False)


def _gib(n: int) -> str:
    return format_bytes(n, "GiB")


def header(result: EstimateResult) -> str:
    """The report's first line: the model, the GPUs, and every setting the figures depend on,
    defaults included (a training step's or a serving batch's, never the other's)."""
    plan = result.plan
    inference = plan.get("kind") == "inference"
    degrees = ("dp", "tp", "pp", "ep") if inference else ("dp", "tp", "pp", "cp", "ep")
    parts = [
        f"[bold]{result.model['name']}[/] ({result.model['parameters'] / 1e9:,.2f} B params) on "
        f"{plan['world_size']} x {result.gpu['name']} ",
        " ".join(f"{k}={plan[k]}" for k in degrees if k in plan) + " ",
    ]
    if inference:
        kv = f"kv_dtype={plan['kv_dtype']}" + (f" block_size={plan['block_size']}" if plan.get("block_size") else "")
        parts += [
            f"inference: batch={plan['batch']} prompt={plan['prompt_tokens']} generated={plan['generated_tokens']} "
            f"(context {plan['prompt_tokens'] + plan['generated_tokens']}) weights={plan['weights_dtype']} {kv}"
        ]
        return " ".join(parts)
    tuning = f" finetune={plan['finetune']} quant={plan['quant']}" if plan.get("finetune", "full") != "full" else ""
    parts += [
        f"zero={plan['zero']} recompute={plan['recompute']} precision={plan['precision']}{tuning} "
        f"runtime={plan['runtime']}"
        + (f" attention={plan['attention_kernel']} ({result.gpu['device']})" if "attention_kernel" in plan else ""),
        f" seq_len={plan['seq_len']} micro_batch={plan['micro_batch']} global_batch={plan['global_batch']}",
    ]
    return " ".join(parts)


def _prefill_setting(result: EstimateResult) -> str:
    """The header line of a serving estimate: how the prompts are prefilled, and vLLM's default."""
    p, plan = result.memory.prefill, result.plan
    assert p is not None
    if p.tokens < plan["batch"] * plan["prompt_tokens"]:
        cache = (
            "a paged KV cache (vLLM)"
            if plan["block_size"]
            else "a contiguous KV cache (transformers' DynamicCache, whose chunks copy the cached prefix; "
            "--block-size 16 for vLLM's paged one)"
        )
        return (
            f"prefill: chunks of {plan['prefill_chunk']:,} tokens across the batch (--prefill-chunk), "
            f"{p.tokens:,} per forward, over {cache}"
        )
    from memplan.costmodel.inference import vllm_default_chunk  # serving's: not on a training estimate's path

    default = vllm_default_chunk(result.gpu["capacity_bytes"], result.gpu["name"])
    return (
        f"prefill: every prompt in one forward, {p.tokens:,} tokens (transformers' generate; vLLM V1 chunks "
        f"prefills, {default:,} tokens per step by default for its API server on this GPU: give --prefill-chunk)"
    )


def _serving_memory(mem: MemoryReport) -> str:
    """Serving: weights, KV cache and what the prefill activations are (not a per-layer figure)."""
    p = mem.prefill
    assert p is not None
    return (
        f"weights per rank {_gib(mem.model_states.parameters)}; KV cache {_gib(mem.kv_cache)}; prefill "
        f"activations {_gib(mem.activations.total)}: the peak transient of one prefill forward over {p.tokens:,} "
        f"tokens (one layer's {p.moment} moment and the tensors kept for the whole forward)"
    )


def verdict(result: EstimateResult) -> str:
    """The one verdict line: fits or not, with the figures it was judged on (the allocator's
    replay: allocated and reserved at the peak) against what the allocator can use (the capacity
    PyTorch sees less the memory outside it), and, when it does not fit, why: the allocated bytes
    alone are over, the allocator's fragmentation (``fits_reason``, the JSON's), or the host."""
    mem, peak = result.memory, result.memory.peak
    capacity = result.gpu["capacity_bytes"]
    limit = capacity - mem.overhead
    usable = f"{_gib(limit)} the allocator can use ({_gib(capacity)} less {_gib(mem.overhead)} outside it)"
    margin = result.fits_margin
    if result.tight:
        assert margin is not None
        spreads = _gib(margin["outside_spread_bytes"] + margin["capacity_spread_bytes"])
        return (
            f"[yellow]fits, tight[/]: {_gib(peak.reserved)} reserved of {usable}, headroom "
            f"{_gib(result.headroom_bytes)}, less than the {_gib(margin['band_bytes'])} band of the "
            f"{margin['model']}'s measured error ({margin['error']:.1%} of reserved: {margin['basis']}; "
            f"memory outside the allocator and the capacity vary by {spreads}): it may run out of memory"
        )
    if result.fits:
        return f"[green]fits[/]: {_gib(peak.reserved)} reserved of {usable}, headroom {_gib(result.headroom_bytes)}"
    host = result.host
    if host is not None and not host.fits and result.headroom_bytes >= 0:  # the device fits, the host does not
        fits_device = f"{_gib(peak.reserved)} reserved fits the device ({_gib(limit)} the allocator can use)"
        return f"[red]does not fit[/]: {fits_device}; the host does not: {host.reason()}"
    detail = peak.reserved_detail
    allocated = detail.timeline_allocated if detail is not None and detail.timeline_allocated else peak.allocated
    figures = f"{_gib(allocated)} allocated and {_gib(peak.reserved)} reserved at the peak, of {usable}"
    if allocated > limit:
        return f"[red]does not fit[/]: {figures}: the allocated bytes alone are {_gib(allocated - limit)} over"
    return f"[red]does not fit[/]: {figures}; {result.fits_reason.removeprefix('does not fit: ')}"


# the loop each op-level run follows (``reserve.plan_run``'s names)
RUNS = {"trainer": "the bundled trainer", "hf": "transformers' Trainer", "hf-loop": "the hand-written loop"}


def _which_model(mem: MemoryReport, device: str) -> str:
    """The line above the table: which model answered (``memory.model``), on ``device``."""
    if mem.model == "op-level":
        detail = mem.peak.reserved_detail
        which = RUNS.get(detail.timeline if detail is not None else "", RUNS["trainer"])
        if device == "cpu":  # costmodel.cpu_reserve
            return f"memory model: the op-level run ({which} op by op on CPU's kernels; no caching allocator)"
        return f"memory model: the op-level run ({which} op by op, replayed through the allocator)"
    return f"memory model: the phase model, approximate (not the op-level run: {mem.model_reason})"


def render(result: EstimateResult, console: Console) -> None:
    """The human table: breakdown at the peak, model states, fit and suggestions."""
    mem, peak = result.memory, result.memory.peak
    console.print(header(result), soft_wrap=True, highlight=False)
    if result.gpu.get("auto"):
        console.print(result.gpu["auto"], soft_wrap=True)
    if mem.prefill is not None:
        console.print(_prefill_setting(result), soft_wrap=True)
    cpu_run = result.gpu.get("device") == "cpu" and mem.model == "op-level"
    console.print(_which_model(mem, "cpu" if cpu_run else "cuda"), soft_wrap=True, highlight=False)
    table = Table(title=f"Peak: {peak.phase} phase, rank {peak.rank} ({peak.rank_role})")
    table.add_column("component")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    for name, value in sorted(peak.breakdown.items(), key=lambda kv: -kv[1]):
        label = "prefill activations" if mem.prefill is not None and name == "activations" else name.replace("_", " ")
        table.add_row(label, _gib(value), f"{100 * value / max(peak.allocated, 1):.1f}%")
    table.add_section()
    table.add_row("[bold]peak allocated[/]", _gib(peak.allocated), "")
    table.add_row("cached by the allocator", _gib(peak.reserved - peak.allocated), "")
    table.add_row("[bold]peak reserved[/]", _gib(peak.reserved), "")
    table.add_row("outside the allocator (CUDA context, NCCL)", _gib(mem.overhead), "")
    console.print(table)
    detail = peak.reserved_detail
    if cpu_run:
        console.print("CPU allocator: caches nothing (c10's alloc_cpu / free_cpu): reserved is the allocated peak")
    elif detail is not None:
        streams = ", ".join(f"{k} {_gib(v)}" for k, v in detail.reserved_by_stream.items())
        console.print(
            f"allocator ({detail.allocator}): at the allocated peak {detail.segments} segments, reserved {streams}; "
            f"{_gib(detail.cached_free)} cached but free, largest free block {_gib(detail.largest_free)}"
        )
    if mem.stage_reserved:
        stages = ", ".join(f"{s} {_gib(r)}" for s, r in sorted(mem.stage_reserved.items()))
        console.print(
            f"pipeline stages, reserved (every stage's run replayed; the table is stage {peak.stage}'s, the "
            f"first to run out of memory: least headroom): {stages}"
        )
    states = mem.model_states
    if mem.prefill is not None:
        console.print(_serving_memory(mem))
    else:
        console.print(
            f"model states per rank: params {_gib(states.parameters)}, grads {_gib(states.gradients)}, "
            f"optimizer {_gib(states.optimizer_states)}; activations per layer {_gib(mem.activations.per_layer)}"
            + (f"; KV cache {_gib(mem.kv_cache)}" if mem.kv_cache else "")
        )
    if mem.offload.cpu or mem.offload.nvme:
        console.print(f"offloaded per rank: CPU {_gib(mem.offload.cpu)}, NVMe {_gib(mem.offload.nvme)}")
    host = result.host
    if host is not None and host.needed_bytes:
        has = f"the node has {_gib(host.available_bytes)} ({host.source})" if host.available_bytes else "not checked"
        console.print(
            f"host memory per node: {_gib(host.needed_bytes)} ({host.ranks_per_node} rank(s): pinned "
            f"{_gib(host.pinned_bytes)}, paged {_gib(host.paged_bytes)}); {has}"
        )
    if mem.paged_optimizer_states:
        resident, host = paged_residency(mem.paged_optimizer_states, result.headroom_bytes)
        console.print(
            f"paged optimizer states: {_gib(mem.paged_optimizer_states)} in CUDA unified memory, outside the "
            f"allocator (not in peak reserved): {_gib(resident)} stay on the device beside the peak, "
            f"{_gib(host)} page to the host and back each step"
        )
    if result.time is not None:
        t = result.time
        console.print(
            f"step time {t.step_time_s:.3f} s (predicted), {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"MFU {100 * t.mfu:.1f}% (HFU {100 * t.hfu:.1f}%); "
            + ", ".join(
                f"{k.replace('_', ' ')} {v:.3f} s" for k, v in sorted(t.breakdown.items(), key=lambda kv: -kv[1])
            )
        )
    console.print(verdict(result))
    tight = result.tight
    if result.fits and not tight:
        return
    if result.suggestions:
        title = "Changes that buy the headroom (fits: with the band free)" if tight else "Changes that would help"
        table = Table(title=f"{title} (ranked by memory saved)")
        for col in ("change", "peak reserved", "saved", "fits"):
            table.add_column(col)
        for s in result.suggestions:
            table.add_row(s.change, _gib(s.reserved_bytes), _gib(s.saved_bytes), "yes" if s.fits else "no")
        console.print(table)
