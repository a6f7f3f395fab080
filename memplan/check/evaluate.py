"""Evaluate a budgets file: each entry resolved into a job, estimated (or measured), compared
with its budget and with the baseline.

Every input mistake is a :class:`MemplanError` located in the budgets file
(``budgets.yaml: entries[2].model: unknown model 'x'``) and raised before anything is
evaluated; an entry that cannot be evaluated at run time (a failed measurement) is an
``error`` result, which fails the check like an entry over its budget.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from memplan.check.spec import Baseline, BaselineEntry, BudgetsFile, Entry, Metric
from memplan.costmodel.overhead import communicators, fixed_overhead_bytes
from memplan.errors import MemplanError
from memplan.estimation import estimate
from memplan.specs.loader import read_data, short, validate
from memplan.specs.plan import Plan
from memplan.specs.resolve import CLI, INFERENCE_FIELDS, TRAINING_FIELDS, Job, resolve_job
from memplan.units import format_bytes

Status = Literal["pass", "over-budget", "regressed", "tight", "error"]
FAILING: tuple[Status, ...] = ("over-budget", "regressed", "tight")  # an entry that fails the check
TOP_FIELDS = ("gpu", "gpus", "nodes", "runtime", "allocator")
_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def list_path(field: str | None) -> str | None:
    """``entries.2.model`` -> ``entries[2].model`` (how the error names a list item)."""
    return _INDEX.sub(r"[\1]", field) if field else field


def load_budgets(path: Path) -> BudgetsFile:
    """Read and validate a budgets file; entry names must be unique."""
    source = short(path)
    try:
        budgets = validate(BudgetsFile, read_data(path), source)
    except MemplanError as err:
        raise MemplanError(err.reason, source=err.source, field=list_path(err.field)) from None
    seen: set[str] = set()
    for i, entry in enumerate(budgets.entries):
        if entry.name in seen:
            raise MemplanError(f"duplicate entry name {entry.name!r}", source=source, field=f"entries[{i}].name")
        seen.add(entry.name)
    return budgets


@dataclass(frozen=True)
class Resolved:
    """An entry with its job, the metric it is held to and its limit in bytes."""

    index: int
    entry: Entry
    job: Job
    metric: Metric
    limit_bytes: int


def _model_ref(entry: Entry, base: Path) -> str:
    beside = base / entry.model
    return str(beside) if beside.exists() else entry.model


def _overrides(entry: Entry, where: str) -> tuple[dict[str, Any], bool]:
    """The entry as resolve_job's field values (and whether it is an inference workload)."""
    plan = dict(entry.plan or {})
    work = dict(entry.workload or {})
    unknown = sorted(set(plan) - set(Plan.model_fields))
    if unknown:
        raise MemplanError("unknown field", source=where, field=f"plan.{unknown[0]}")
    kind = work.pop("kind", "training")
    if kind not in ("training", "inference"):
        raise MemplanError(f"unknown kind {kind!r} (training, inference)", source=where, field="workload.kind")
    own = INFERENCE_FIELDS if kind == "inference" else TRAINING_FIELDS
    unknown = sorted(set(work) - own)
    if unknown:
        reason = "unknown field" if unknown[0] not in TRAINING_FIELDS | INFERENCE_FIELDS else f"not a {kind} field"
        raise MemplanError(reason, source=where, field=f"workload.{unknown[0]}")
    top = {k: getattr(entry, k) for k in TOP_FIELDS}
    return {**plan, **work, **top}, kind == "inference"


def _locate(err: MemplanError, entry: Entry, model_ref: str, source: str, prefix: str) -> MemplanError:
    """resolve_job's error (against a flag, or the model reference) against the entry's field."""
    if err.source == model_ref and err.field is None:
        return MemplanError(f"unknown model {entry.model!r} ({err.reason})", source=source, field=f"{prefix}.model")
    if err.source != CLI:
        return err  # inside a model or GPU file the entry names: that file is at fault
    name = (err.field or "").removeprefix("--").replace("-", "_")
    if name in (entry.plan or {}):
        field = f"{prefix}.plan.{name}"
    elif name in (entry.workload or {}):
        field = f"{prefix}.workload.{name}"
    elif name in TOP_FIELDS:
        field = f"{prefix}.{name}"
    else:  # a value the entry did not set (a default) is at fault: blame the entry
        field = prefix
    return MemplanError(err.reason, source=source, field=field)


def resolve_entries(budgets: BudgetsFile, path: Path, allocator: str | None = None) -> list[Resolved]:
    """Every entry as a job with its limit; the first mistake raises, located in the file.
    ``allocator`` (``--allocator``) applies to entries that do not name one."""
    source, out = short(path), []
    for i, entry in enumerate(budgets.entries):
        prefix = f"entries[{i}]"
        ref = _model_ref(entry, path.parent)
        try:
            overrides, inference = _overrides(entry, source)
            overrides["allocator"] = overrides["allocator"] or allocator
        except MemplanError as err:
            raise MemplanError(err.reason, source=source, field=f"{prefix}.{err.field}") from None
        try:
            job = resolve_job(ref, None, overrides, inference=inference)
        except MemplanError as err:
            raise _locate(err, entry, ref, source, prefix) from None
        usable = allocator_capacity(job)
        limit = entry.budget.limit(usable)
        if limit <= 0:
            raise MemplanError(
                f"the headroom leaves no memory on {job.gpu.name} ({format_bytes(usable)} for the allocator)",
                source=source,
                field=f"{prefix}.budget.headroom",
            )
        out.append(Resolved(i, entry, job, entry.metric or budgets.metric, limit))
    return out


class Measurement(BaseModel):
    """A measured peak (``memplan check --measure``): bytes, or why there are none."""

    model_config = ConfigDict(frozen=True)

    value_bytes: int | None
    reason: str | None = None
    tight: str | None = None  # the estimate fits within the tight band: why (None: not tight, or measured)


Measure = Callable[[Resolved], Measurement]


class EntryResult(BaseModel):
    """One entry's outcome (``memplan check --format json``: keys are added, never renamed)."""

    model_config = ConfigDict(frozen=True)

    name: str
    model: str
    gpu: str
    gpus: int
    plan: str
    metric: Metric
    measured: bool
    value_bytes: int | None
    limit_bytes: int
    capacity_bytes: int
    budget: str
    headroom_bytes: int | None
    baseline_bytes: int | None
    change_bytes: int | None
    change_pct: float | None
    status: Status
    reason: str | None


class CheckReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str
    threshold: str
    entries: list[EntryResult]

    @property
    def passed(self) -> bool:
        return all(e.status == "pass" for e in self.entries)

    @property
    def exit_code(self) -> int:
        """0: every entry within its budget and not regressed; 1: any over, regressed or not evaluated."""
        return 0 if self.passed else 1

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("pass", "over-budget", "regressed", "tight", "error")}
        for e in self.entries:
            out[e.status] += 1
        return out


def allocator_capacity(job: Job) -> int:
    """What the caching allocator may use on the job's GPU: the capacity PyTorch sees less the
    memory outside it (CUDA context, workspaces, one NCCL communicator per parallel group)."""
    p = job.plan
    return job.gpu.capacity_bytes - fixed_overhead_bytes(communicators(p.dp, p.tp, p.pp, p.cp, p.ep))


def plan_summary(job: Job) -> str:
    p = job.plan
    parts = [f"{k}={getattr(p, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(p, k) > 1 or k == "dp"]
    parts += [f"zero={p.zero}", p.precision]
    if p.recompute != "none":
        parts.append(f"recompute={p.recompute}")
    return " ".join(parts)


def estimated(r: Resolved, device: str = "cuda") -> Measurement:
    """The estimate's peak on the most-loaded rank, in the entry's metric, for ``device``."""
    result = estimate(r.job, with_suggestions=False, device=device)
    peak, margin = result.memory.peak, result.fits_margin
    tight = None
    if result.tight:
        assert margin is not None
        tight = (
            f"fits, tight: {format_bytes(margin['headroom_bytes'])} of headroom on the GPU is within the "
            f"{format_bytes(margin['band_bytes'])} band of the {margin['model']}'s measured error "
            f"({margin['error']:.1%}: {margin['basis']})"
        )
    return Measurement(value_bytes=peak.reserved if r.metric == "reserved" else peak.allocated, tight=tight)


def _threshold_bytes(baseline: int, threshold: float | int) -> int:
    return int(baseline * threshold) if isinstance(threshold, float) else threshold


def describe_threshold(threshold: float | int) -> str:
    return f"{threshold:.1%}" if isinstance(threshold, float) else format_bytes(threshold)


def judge(
    r: Resolved, m: Measurement, measured: bool, baseline: Baseline | None, threshold: float | int
) -> EntryResult:
    """Budget first, then regression against the baseline (same metric, same kind of number)."""
    job, value = r.job, m.value_bytes
    base = baseline.entries.get(r.entry.name) if baseline else None
    if base is not None and (base.metric != r.metric or base.measured != measured):
        base = None  # not comparable: a different metric, or an estimate against a measurement
    status: Status = "pass"
    reason = m.reason
    change = pct = None
    if value is None:
        status = "error"
        reason = f"could not be evaluated: {m.reason or 'no value'}"
    else:
        if base is not None:
            change = value - base.bytes
            pct = 100.0 * change / base.bytes if base.bytes else None
            if change > _threshold_bytes(base.bytes, threshold):
                status = "regressed"
                reason = (
                    f"{r.metric} {format_bytes(value)} is {format_bytes(change)} ({pct or 0:+.2f}%) above the "
                    f"baseline {format_bytes(base.bytes)}, beyond the threshold {describe_threshold(threshold)}"
                )
        if value > r.limit_bytes:
            over = f"{r.metric} {format_bytes(value)} exceeds the budget {format_bytes(r.limit_bytes)} by "
            over += format_bytes(value - r.limit_bytes)
            reason = over + (f"; also {reason}" if status == "regressed" else "")
            status = "over-budget"
        elif status == "pass" and m.tight and r.entry.budget.tight is False:
            status, reason = "tight", m.tight
    return EntryResult(
        name=r.entry.name,
        model=job.model.name,
        gpu=job.gpu.name,
        gpus=job.plan.world_size,
        plan=plan_summary(job),
        metric=r.metric,
        measured=measured,
        value_bytes=value,
        limit_bytes=r.limit_bytes,
        capacity_bytes=allocator_capacity(job),
        budget=r.entry.budget.describe(),
        headroom_bytes=None if value is None else r.limit_bytes - value,
        baseline_bytes=base.bytes if base else None,
        change_bytes=change,
        change_pct=pct,
        status=status,
        reason=reason,
    )


def check(
    budgets: BudgetsFile,
    resolved: list[Resolved],
    source: str,
    baseline: Baseline | None = None,
    measure: Measure | None = None,
    device: str = "cuda",
) -> CheckReport:
    """Evaluate every entry (estimate for ``device``, or ``measure``) and judge it."""
    results = []
    for r in resolved:
        m = measure(r) if measure else estimated(r, device)
        results.append(judge(r, m, measure is not None, baseline, budgets.threshold))
    return CheckReport(source=source, threshold=describe_threshold(budgets.threshold), entries=results)


def new_baseline(report: CheckReport) -> Baseline:
    """The report's numbers as the next baseline (entries without a value are left out)."""
    return Baseline(
        entries={
            e.name: BaselineEntry(metric=e.metric, bytes=e.value_bytes, measured=e.measured)
            for e in report.entries
            if e.value_bytes is not None
        }
    )


def load_baseline(path: Path) -> Baseline:
    """A baseline file (JSON); missing or malformed is a MemplanError naming the file."""
    source = short(path)
    try:
        data = read_data(path)
    except MemplanError as err:
        if err.reason == "no such file":
            raise MemplanError("no such file (create it with --update-baseline)", source=source) from None
        raise
    return validate(Baseline, data, source)
