"""The Optuna study over the plan space: storage, sampler, objective, seeds.

One categorical parameter per varying dimension of the space (``space.DIMENSIONS``): TPE
models each dimension's good values (multivariate TPE also their interplay), which a single
categorical over plan indices would hide from it. A sampled combination that is not a valid
plan (a micro-batch larger than the data-parallel share, ZeRO without data parallelism) is
mapped to the nearest valid plan (``Space.nearest``) rather than failed: TPE gets a value for
every trial, and the trial's ``evaluation`` attribute says which plan it was. A plan that does not
fit is infeasible (constraint = GiB over capacity less the margin, feasible <= 0), so TPE ranks
it after every fitting plan, by how far over it is (Optuna's constrained TPE).

Objectives: ``throughput`` maximizes tokens/s (TPE), ``memory`` minimizes the peak reserved
GiB (TPE), ``pareto`` does both (NSGA-II). Known-good plans (``seeds``) are enqueued first.

Storage is any URL Optuna's RDB storage accepts (``sqlite:///memplan-tune.db`` by default;
``postgresql://...`` lets workers on several machines share one study). A study records what
it searches (model, GPUs, options) and refuses to be resumed with different ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.trial import FrozenTrial, TrialState

from memplan.errors import MemplanError
from memplan.search.evaluate import Context, Evaluation, Objective, evaluate
from memplan.search.space import Candidate, Space, SpaceOptions

CLI = "command line"
GiB = 2**30
DIRECTIONS: dict[str, list[str]] = {
    "throughput": ["maximize"],
    "memory": ["minimize"],
    "pareto": ["maximize", "minimize"],
}
SIGNATURE_ATTR = "memplan_search"
# optuna >= 5 records constraints on the trial; older versions read them through constraints_func
_TRIAL_CONSTRAINTS = hasattr(optuna.trial.Trial, "set_constraint")
_SQLITE_TIMEOUT_S = 60  # concurrent workers on one SQLite file wait this long for its lock
_OPEN_ATTEMPTS = 5
# SQLAlchemy's default driver per dialect, named when it is missing
_DRIVERS = {"postgresql": "psycopg[binary]", "mysql": "mysqlclient"}


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An RDB storage for ``url``; a URL that cannot be opened is a one-line MemplanError.

    Opening is retried a few times when the error is one that a concurrent worker creating the
    same new database causes (``_lost_creation_race``): the winner's tables are there next time.
    """
    sqlite = url.startswith("sqlite:")
    kwargs: dict[str, Any] = {"engine_kwargs": {"connect_args": {"timeout": _SQLITE_TIMEOUT_S}}} if sqlite else {}
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            storage = optuna.storages.RDBStorage(url, **kwargs)
            break
        except Exception as err:  # noqa: BLE001 - sqlalchemy's URL, driver and connection errors alike
            if _lost_creation_race(err) and attempt + 1 < _OPEN_ATTEMPTS:
                time.sleep(random.uniform(0.1, 0.3) * (attempt + 1))
                continue
            raise MemplanError(
                f"cannot open storage {url!r}: {_storage_error(url, err)}", source=CLI, field="--storage"
            ) from None
    if sqlite:
        _sqlite_for_workers(storage.engine)
    return storage


def check_storage(url: str) -> None:
    """Refuse, before any search, a ``--storage`` that cannot be opened or created: a SQLite file
    whose folder is missing (SQLite creates the file, never its folders: ``sqlite3_open_v2``'s
    ``SQLITE_CANTOPEN``), that is a folder, or that cannot be written; any other URL is opened
    (``open_storage``, whose error names the reason). A SQLite file is not created here, so a
    search that stores no study (every plan predicted) leaves nothing behind."""
    path = _sqlite_file(url)
    if path is None:
        _dispose(open_storage(url))
        return
    reason = _sqlite_file_problem(path)
    if reason is not None:
        raise MemplanError(f"cannot open storage {url!r}: {reason}", source=CLI, field="--storage")


def _dispose(storage: optuna.storages.BaseStorage) -> None:
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()


def _sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite:///FILE`` URL names; None for any other URL, an in-memory database or
    a ``file:`` URI (those are opened to be checked)."""
    if not url.startswith("sqlite:"):
        return None
    try:
        database = sqlalchemy.engine.make_url(url).database
    except sqlalchemy.exc.ArgumentError:
        return None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def _sqlite_file_problem(path: Path) -> str | None:
    """Why SQLite could not open or create ``path`` (None: it can)."""
    if path.is_dir():
        return f"{path} is a folder, not a database file"
    if path.exists():
        return None if os.access(path, os.R_OK | os.W_OK) else f"{path} cannot be read and written (permission denied)"
    folder = path.absolute().parent
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        return f"the folder {folder} {what} (SQLite creates the database file, not its folders)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot create a file in {folder} (permission denied)"
    return None


def _lost_creation_race(err: Exception) -> bool:
    """Whether ``err`` is what a worker gets when another creates the same new database first.

    Workers opening one new database at once race to create its tables, enum types and version
    row: the loser gets a duplicate key (IntegrityError: SQLite's version row, PostgreSQL's
    ``pg_type`` entry), an object that "already exists" (ProgrammingError / OperationalError),
    or SQLite's "database is locked". A bad URL, a refused connection or a wrong password is none
    of these and is reported at once.
    """
    kind, text = type(err).__name__, str(err).lower()
    return kind == "IntegrityError" or (
        kind in ("OperationalError", "ProgrammingError") and ("already exists" in text or "locked" in text)
    )


def _storage_error(url: str, err: Exception) -> str:
    """One line for why ``url`` could not be opened; a missing database driver is named."""
    if isinstance(err, ImportError) and isinstance(err.__cause__, ModuleNotFoundError):
        scheme = url.split(":", 1)[0]
        hint = _DRIVERS.get(scheme)  # only a URL without "+driver" uses the dialect's default
        install = f"; pip install {hint!r}" if hint else ""
        return f"its database driver is not installed (no module named {err.__cause__.name!r}{install})"
    reason = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", " ".join(str(err).split()))
    return (reason or type(err).__name__)[:300]


def _sqlite_for_workers(engine: sqlalchemy.engine.Engine) -> None:
    """Make every SQLite transaction take the write lock when it begins, and log ahead.

    pysqlite begins transactions lazily, at the first write, so two workers can both read an
    enqueued trial as WAITING and both run it (optuna/optuna#4621: the second fails with
    "Cannot tell a COMPLETE trial"); Optuna's SELECT ... FOR UPDATE is a no-op on SQLite.
    With BEGIN IMMEDIATE the read and the write of popping a trial are one locked step
    (SQLAlchemy's pysqlite recipe for controlling BEGIN). PostgreSQL and MySQL lock the row.
    """

    @sqlalchemy.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # pysqlite emits no BEGIN of its own
        # write-ahead log, synced at checkpoints: a trial's ~20 small transactions then cost no
        # fsync each (an application crash loses nothing; only a power loss can lose the last)
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin(connection: sqlalchemy.engine.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections made before the listeners are dropped


def signature(ctx: Context, options: SpaceOptions, objective: Objective) -> dict[str, Any]:
    """What a study searches: resuming it with anything else would mix incomparable trials."""
    model = json.dumps(ctx.model.model_dump(mode="json"), sort_keys=True)
    return {
        "model": ctx.model.name,
        "model_sha256": hashlib.sha256(model.encode()).hexdigest()[:16],
        "gpu": ctx.gpu.name,
        "nodes": ctx.cluster.nodes,
        "runtime": ctx.runtime,
        "margin_bytes": ctx.margin_bytes,
        "objective": objective,
        "space": options.model_dump(mode="json"),
    }


def make_sampler(objective: Objective, seed: int) -> optuna.samplers.BaseSampler:
    """Seeded multivariate TPE for one objective, NSGA-II for the Pareto front."""
    extra: dict[str, Any] = {} if _TRIAL_CONSTRAINTS else {"constraints_func": _constraints}
    if objective == "pareto":
        return optuna.samplers.NSGAIISampler(seed=seed, **extra)
    with warnings.catch_warnings():  # multivariate TPE is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, **extra)


def _constraints(trial: FrozenTrial) -> list[float]:
    return [trial.user_attrs.get("constraint", 0.0)]


def open_study(
    name: str, storage: optuna.storages.BaseStorage, sampler: optuna.samplers.BaseSampler, sig: dict[str, Any]
) -> optuna.Study:
    """Create the study, or load it (``load_if_exists``) when it searches the same thing."""
    objective = sig["objective"]
    study = optuna.create_study(
        study_name=name, storage=storage, sampler=sampler, directions=DIRECTIONS[objective], load_if_exists=True
    )
    stored = study.user_attrs.get(SIGNATURE_ATTR)
    if stored is None:
        study.set_user_attr(SIGNATURE_ATTR, sig)
    elif stored != sig:
        diff = sorted(k for k in set(stored) | set(sig) if stored.get(k) != sig.get(k))
        raise MemplanError(
            f"study {name!r} searches something else (differs in {', '.join(diff)}); "
            "give the options it was created with, or a new --study name",
            source=CLI,
            field="--study",
        )
    return study


class SearchObjective:
    """Optuna's objective: sample a plan, predict it, record it on the trial."""

    def __init__(self, space: Space, ctx: Context, objective: Objective):
        self.space = space
        self.ctx = ctx
        self.objective = objective
        self.cache: dict[tuple, Evaluation] = {}

    def evaluate(self, candidate: Candidate) -> Evaluation:
        found = self.cache.get(candidate.key)
        if found is None:
            found = self.cache[candidate.key] = evaluate(candidate, self.ctx)
        return found

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        params = {dim: trial.suggest_categorical(dim, choices) for dim, choices in self.space.choices.items()}
        exact = self.space.find(params)
        ev = self.evaluate(exact or self.space.nearest(params))
        trial.set_user_attr("kind", "search")
        trial.set_user_attr("evaluation", ev.model_dump(mode="json"))
        trial.set_user_attr("constraint", ev.constraint)
        if exact is None:
            trial.set_user_attr("mapped_to_nearest", True)
        if _TRIAL_CONSTRAINTS:
            trial.set_constraint("memory", ev.constraint)
        return objective_values(ev, self.objective)


def objective_values(ev: Evaluation, objective: Objective) -> float | tuple[float, float]:
    if objective == "memory":
        return ev.peak_reserved_bytes / GiB
    if objective == "pareto":
        return ev.tokens_per_s, ev.peak_reserved_bytes / GiB
    return ev.tokens_per_s


def enqueue_seeds(study: optuna.Study, space: Space, candidates: list[Candidate]) -> None:
    """Queue known-good plans to run first (skipped when the study already has them)."""
    for c in candidates:
        study.enqueue_trial(space.params(c), user_attrs={"seed": True}, skip_if_exists=True)


def optimize(
    study: optuna.Study,
    objective: SearchObjective,
    n_trials: int,
    on_trial: Callable[[FrozenTrial], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> int:
    """Run up to ``n_trials`` trials; ``should_stop()`` (e.g. after Ctrl-C) ends the study
    after the running trial, which is recorded. Returns the trials this call ran."""
    ran = 0

    def callback(study: optuna.Study, trial: FrozenTrial) -> None:
        nonlocal ran
        ran += 1
        if on_trial is not None:
            on_trial(trial)
        if should_stop is not None and should_stop():
            study.stop()

    study.optimize(objective, n_trials=n_trials, callbacks=[callback], catch=())
    return ran


def searched(study: optuna.Study) -> dict[tuple, int]:
    """Each plan the study's search trials evaluated, with the first trial that did."""
    out: dict[tuple, int] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        data = t.user_attrs.get("evaluation")
        if t.user_attrs.get("kind") == "search" and data:
            ev = Evaluation.model_validate(data)
            out.setdefault(ev.candidate.key, t.number)
    return out


def record_validation(
    study: optuna.Study,
    space: Space,
    ev: Evaluation,
    objective: Objective,
    attrs: dict[str, Any],
    failed: bool,
) -> int:
    """Add a validation run as a trial of its own (finished trials cannot take new
    attributes): COMPLETE with the predicted value, or FAIL with the reason in ``attrs``."""
    params = space.params(ev.candidate)
    distributions = {d: optuna.distributions.CategoricalDistribution(space.choices[d]) for d in params}
    values = objective_values(ev, objective)
    tag = uuid.uuid4().hex
    trial = optuna.trial.create_trial(
        state=TrialState.FAIL if failed else TrialState.COMPLETE,
        values=None if failed else (list(values) if isinstance(values, tuple) else [values]),
        params=params,
        distributions=distributions,
        user_attrs={"kind": "validation", "evaluation": ev.model_dump(mode="json"), "tag": tag, **attrs},
    )
    study.add_trial(trial)
    # another worker may have added trials meanwhile: find this one by its tag
    return next(t.number for t in reversed(study.get_trials(deepcopy=False)) if t.user_attrs.get("tag") == tag)
