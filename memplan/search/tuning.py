"""What a tuning run is asked (``TuneRequest``) and what it answers (``TuneResult``), and the
plan file it writes. Light to import (no optuna): the CLI builds and renders these, and only
``memplan.search.tune`` runs the search.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict

from memplan.search.advice import Fix
from memplan.search.evaluate import Context, Evaluation, Objective
from memplan.search.space import SpaceOptions
from memplan.search.validation import Outcome, ValidationSettings

DEFAULT_STORAGE = "sqlite:///memplan-tune.db"
WORK_ROOT = "memplan-tune"  # memplan tune's working directories, under the current one
PLAN_FILE = "best-plan.yaml"  # the recommended plan, in the working directory
STUDY_FILE = "study.db"  # the Optuna study (SQLite), in the working directory


def work_dir(model: str, gpus: int, gpu: str) -> Path:
    """Where ``memplan tune`` writes its plan and study unless told (``--out``, ``--storage``,
    ``--workdir``): ``memplan-tune/<model>-<gpus>x<gpu>`` under the current directory, one folder
    per question, so that tuning another model or GPU count neither overwrites a plan nor joins
    another question's study, and nothing generated lands among the user's own files."""

    def safe(name: str, cut: int) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:cut] or "model"

    return Path(WORK_ROOT) / f"{safe(model, 100)}-{gpus}x{safe(gpu, 60)}"


def sqlite_url(path: Path) -> str:
    """The SQLAlchemy URL of a SQLite file (relative paths stay relative to the current directory)."""
    return f"sqlite:///{path.as_posix()}"


@dataclass(frozen=True)
class TuneRequest:
    model_ref: str  # as the user gave it: the plan file's ``model``
    gpu_ref: str
    ctx: Context
    options: SpaceOptions
    objective: Objective = "throughput"
    trials: int = 300
    exhaustive: bool | None = None  # None: every plan when that is as quick as the study (tune.search_mode)
    export_target: str | None = None  # search only the plans this export target can express
    seed: int = 0
    study: str | None = None  # None: a new study with a generated name
    storage: str = DEFAULT_STORAGE
    top: int = 10
    validate: int = 0
    validation: ValidationSettings = field(default_factory=ValidationSettings)
    calibration_path: Path | None = None  # where validation ratios go (None: nowhere)
    host_memory_bytes: int | None = None  # per node: a plan keeping more there does not fit (None: not checked)
    host_memory_source: str = ""  # where host_memory_bytes comes from
    work_dir: Path | None = None  # the default storage's folder: created when a study opens (None: the URL's own)


@dataclass(frozen=True)
class Hooks:
    """Progress reporting and stopping, for the CLI (library code never prints)."""

    started: Callable[[str, int], None] = lambda what, total: None
    advanced: Callable[[int], None] = lambda completed: None
    step: Callable[[int, int], None] = lambda step, total: None  # a validation run's steps
    should_stop: Callable[[], bool] = lambda: False


class RankedPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    trial: int | None
    evaluation: Evaluation
    validation: Outcome | None = None
    validation_trial: int | None = None


class LadderRow(BaseModel):
    """At one sequence length, the largest micro-batch of the recommended plan that fits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int
    micro_batch: int  # 0: not even one sequence fits
    peak_reserved_bytes: int | None  # of that micro-batch's plan (the search's fast form)


class TuneResult(BaseModel):
    """What ``memplan tune --format json`` prints (keys are a contract: add, never rename)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    gpu: str
    gpu_auto: str | None = None  # --gpu auto or --gpus not given: what NVML detected and what was used
    gpus: int
    nodes: int
    runtime: str
    objective: str
    allocator: str = "default"  # the CUDA caching allocator the plans were judged under
    capacity_bytes: int
    margin_bytes: int
    limit_bytes: int
    space_size: int
    evaluated: int
    exhaustive: bool
    search_reason: str = ""  # why every plan was predicted, or a study run
    export_target: str | None = None  # the space was restricted to what this target can express
    space_before_export: int | None = None  # valid plans before that restriction
    study: str | None
    storage: str | None
    trials: int
    trials_run: int
    interrupted: bool
    calibration: dict[str, float] | None
    top: list[RankedPlan]
    recommended: RankedPlan | None
    closest: Evaluation | None
    fixes: list[Fix]
    calibration_written: dict | None
    plan_path: str | None = None
    # fine-tuning: the recommended plan's largest micro-batch that fits at each sequence length
    micro_batch_ladder: list[LadderRow] = []
    host_memory_bytes: int | None = None  # the node's host memory the plans were held to (None: not checked)
    host_memory_source: str = ""


def plan_yaml(result: TuneResult, req: TuneRequest, model_ref: str | None = None) -> str:
    """The recommended plan as a plan file (``memplan estimate|validate --plan``, ``memplan
    export``); ``model_ref`` (default: as given) is how the file names the model."""
    assert result.recommended is not None
    best = result.recommended.evaluation
    gib = 2**30
    where = f"study {result.study}, trial {result.recommended.trial}" if result.study else "exhaustive search"
    header = [
        f"# memplan tune: {result.model} on {result.gpus} x {result.gpu}, objective {result.objective} ({where})",
        f"# predicted: peak reserved {best.peak_reserved_bytes / gib:.1f} GiB of {best.capacity_bytes / gib:.1f} GiB, "
        f"{best.tokens_per_s:,.0f} tokens/s, MFU {100 * best.mfu:.1f}%",
    ]
    v = result.recommended.validation
    if v is not None and v.measured_peak_bytes:
        header.append(f"# measured ({v.device}{', simulated rank' if v.simulated else ''}): "
                      f"peak allocated {v.measured_peak_bytes / gib:.2f} GiB")  # fmt: skip
    if result.interrupted:
        header.append(f"# interrupted after {result.trials} trials: the best plan so far")
    workload = best.workload.model_dump(exclude={"kind"}, exclude_none=True)
    data = {
        "model": model_ref or req.model_ref,
        "gpu": req.gpu_ref,
        "gpus": result.gpus,
        "nodes": result.nodes,
        "runtime": result.runtime,
        "allocator": result.allocator,
        "workload": workload,
        "plan": best.plan.model_dump(exclude_none=True),
    }
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False)
