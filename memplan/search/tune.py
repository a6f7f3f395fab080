"""``memplan tune`` as a library call: search the plans, validate the best, recommend one.

The search is exhaustive (every valid plan predicted) or an Optuna study (``study``); by default
the first when it is quicker than the study's trials (``search_mode``). With ``export_target`` the
space is first cut to the plans that target can express (its exporter's refusal rules). With
``validate`` > 0 the best plans are run (``validation``), each run recorded as a trial of the
study, the list re-ranked by measured throughput where a real run measured it, and the
measured / predicted ratios added to the calibration of the GPU profile.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from memplan.costmodel.advice import host_suggestions
from memplan.costmodel.host import host_memory
from memplan.costmodel.memory import estimate_memory
from memplan.errors import MemplanError
from memplan.search import study as S
from memplan.search.advice import Fix, lowest_peak, what_would_fit
from memplan.search.calibration import load_calibration, save_calibration, with_runs
from memplan.search.evaluate import Context, Evaluation, evaluate, evaluate_all, pareto_front, rank, replayed
from memplan.search.seeds import seeds
from memplan.search.space import Candidate, Space, enumerate_space
from memplan.search.tuning import Hooks, LadderRow, RankedPlan, TuneRequest, TuneResult
from memplan.search.validation import Outcome, detect_gpus, run_spec, validate_plan
from memplan.specs.workload import TrainingWorkload

CLI = "command line"
# the speed of the two searches, measured on a 2-core machine (docs/tune.md, docs/accuracy.md):
# evaluate() predicts 10,000-15,000 plans/s of the spaces tune searches with its memos (llama3-8b
# on 8 GPUs, llama3-70b on 64, llama3.1-405b on 512; 2026-11-24, the cores shared), kept low here;
# a study trial (multivariate TPE, SQLite) takes ~32 ms (300 trials of llama3-8b on 8 GPUs: 9.6 s)
PLANS_PER_S = 8_000
TRIAL_S = 0.03
# the plans whose peak comes from the op-level run (``evaluate.from_run``: fine-tuning and fp32 on
# one rank, every plan the run models under transformers' loops): 10-20 plans/s on the same machine,
# 1-4 for the whole runs under --runtime hf's FSDP2 (docs/cost-model.md), kept low here
RUN_PLANS_PER_S = 5
MAX_EXHAUSTIVE = 100_000  # ~12 s at PLANS_PER_S


def study_name(req: TuneRequest) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{req.ctx.model.name}-{req.options.gpus}x{req.ctx.gpu.name}-{stamp}"


def search_mode(req: TuneRequest, plans: int, run_plans: int = 0) -> tuple[bool, str]:
    """Whether to predict every plan, and why: as asked (``exhaustive`` True or False); a named
    study is resumed or joined; else every plan when that takes no longer than the study's trials
    would (``PLANS_PER_S``, ``TRIAL_S``; ``RUN_PLANS_PER_S`` for the ``run_plans`` of them whose
    peak comes from the op-level run, in both), the same answer or a better one, sooner."""
    if req.exhaustive is not None:
        return req.exhaustive, "as asked" + (" (--exhaustive)" if req.exhaustive else " (--no-exhaustive)")
    if req.study is not None:
        return False, f"study {req.study!r} named (--study): resumed or joined"
    from_run = run_plans / plans / RUN_PLANS_PER_S if plans else 0.0  # a plan's share of the run's seconds
    every = plans / PLANS_PER_S + run_plans / RUN_PLANS_PER_S
    study = req.trials * (TRIAL_S + from_run)
    if every <= study and plans <= MAX_EXHAUSTIVE:
        return (
            True,
            f"predicting all {plans:,} plans (~{every:.1f} s) is quicker than {req.trials} trials (~{study:.0f} s)",
        )
    return (
        False,
        f"predicting all {plans:,} plans (~{every:.0f} s) would take longer than {req.trials} trials (~{study:.0f} s)",
    )


Refusal = Callable[[Candidate, Context], "MemplanError | None"]


def export_refusal(target: str) -> Refusal:
    """What ``target`` says of a candidate: None when it can express the plan, else its refusal
    (the exporter's own rules, ``export.common.expressible``; nothing is written)."""
    from memplan.export.common import expressible
    from memplan.specs.resolve import Job

    def refusal(c: Candidate, ctx: Context) -> MemplanError | None:
        job = Job(ctx.model, c.workload, c.plan, ctx.gpu, ctx.cluster, ctx.runtime, ctx.allocator)  # type: ignore[arg-type]
        return expressible(job, target)

    return refusal


def _expressible(req: TuneRequest, space: Space) -> Space:
    """The plans the export target can express; none is an error that says why, before any search."""
    refusal = export_refusal(req.export_target or "")
    kept, why = [], Counter()
    for c in space.candidates:
        err = refusal(c, req.ctx)
        if err is None:
            kept.append(c)
        else:
            why[(err.field or "", err.reason)] += 1
    if not kept:
        reasons, seen = [], set()
        for (field, reason), count in why.most_common():
            if field not in seen and len(seen) < 3:
                seen.add(field)
                reasons.append(f"{reason} ({count:,} of them)")
        if not req.options.allow_offload and seen & {"plan.zero", "plan.offload_optimizer", "plan.offload_params"}:
            reasons.append("--allow-offload also searches plans with the optimizer (and parameters) on the CPU")
        raise MemplanError(
            f"{req.export_target} can express none of the {len(space):,} valid plans: {'; '.join(reasons)}",
            source=CLI,
            field="--export",
        )
    return Space(tuple(kept))


def _space(req: TuneRequest) -> tuple[Space, int]:
    """The plans searched (with ``export_target``, those it can express) and the valid plans before that."""
    space = enumerate_space(req.ctx.model, req.options)
    if not len(space):
        o = req.options
        batch = f", global batch {', '.join(map(str, o.global_batches))}" if o.global_batches else ""
        raise MemplanError(
            f"no valid plan of {req.ctx.model.name} on {o.gpus} GPUs ({o.gpus_per_node} per node) with seq_len "
            f"{o.seq_len}{batch}: TP, PP, CP and the batch must split evenly",
            source=CLI,
            field="--gpus",
        )
    valid = len(space)
    if req.export_target:
        space = _expressible(req, space)
    if req.exhaustive and len(space) > MAX_EXHAUSTIVE:
        raise MemplanError(
            f"the space has {len(space):,} plans, more than {MAX_EXHAUSTIVE:,} (~40 s); drop --exhaustive "
            "or narrow it (--micro-batch, fewer --precision values, no --allow-offload)",
            source=CLI,
            field="--exhaustive",
        )
    return space, valid


def _open(req: TuneRequest, name: str):  # noqa: ANN202 - optuna.Study
    if req.work_dir is not None:  # the working directory's study file: its folder made on first use
        req.work_dir.mkdir(parents=True, exist_ok=True)
    storage = S.open_storage(req.storage)
    sampler = S.make_sampler(req.objective, req.seed)
    return S.open_study(name, storage, sampler, S.signature(req.ctx, req.options, req.objective))


@dataclass
class _Search:
    """What the search left: the study (None when exhaustive), the plans it predicted and the
    first trial of each."""

    study: Any
    name: str
    evaluations: list[Evaluation]
    trials_of: dict[tuple, int] = field(default_factory=dict)
    ran: int = 0


def _search(req: TuneRequest, space: Space, hooks: Hooks, exhaustive: bool) -> _Search:
    name = req.study or study_name(req)
    if exhaustive:
        hooks.started("evaluating", len(space))
        return _Search(None, name, evaluate_all(space.candidates, req.ctx, progress=hooks.advanced))
    study = _open(req, name)
    objective = S.SearchObjective(space, req.ctx, req.objective)
    if not study.get_trials(deepcopy=False):  # a new study: known-good plans first
        S.enqueue_seeds(study, space, seeds(space, objective.evaluate, req.objective))
    hooks.started("searching", req.trials)
    done = 0

    def advanced(_trial: object) -> None:
        nonlocal done
        done += 1
        hooks.advanced(done)

    ran = S.optimize(study, objective, req.trials, on_trial=advanced, should_stop=hooks.should_stop)
    trials_of = S.searched(study)  # every worker's trials, predicted again with this context
    evaluations = [objective.evaluate(space.index[key]) for key in trials_of if key in space.index]
    return _Search(study, name, evaluations, trials_of, ran)


def _fitting(
    req: TuneRequest, space: Space, evaluations: list[Evaluation]
) -> tuple[list[Evaluation], Evaluation | None]:
    """The fitting plans best first (the Pareto front for ``pareto``); when none, the plan of
    the whole space closest to fitting (memory model only)."""
    ranked = pareto_front(evaluations) if req.objective == "pareto" else rank(evaluations, req.objective)
    fitting = _replay_until(ranked, max(req.top, req.validate), req.ctx, req.host_memory_bytes)
    if req.objective == "pareto":  # the replay moves peaks: a plan may now be dominated
        fitting = pareto_front(fitting)
    if fitting:
        return fitting, None
    closest = _closest(space, req.ctx)
    if closest.fits and host_fits(closest, req.ctx, req.host_memory_bytes):
        return [closest], None  # the study missed it
    return [], closest


REPLAY_BUDGET = 4  # replays per reported plan before the search stops looking further down


def host_fits(ev: Evaluation, ctx: Context, host_bytes: int | None) -> bool:
    """Whether the node's host memory holds what the plan keeps there (``costmodel.host``: CPU
    offload, pinned, and paged optimizer states beyond the device's headroom); True when unknown.
    The paged states are the op-level run's where transformers' Trainer's run answers the plan
    (:func:`run_paged_bytes`), else the closed form's (``optimizer.paged_state_bytes``)."""
    if host_bytes is None:
        return True
    report = estimate_memory(ctx.model, ev.workload, ev.plan, ctx.runtime, ctx.device)
    paged = run_paged_bytes(ev, ctx)
    if paged is not None:
        report = report.model_copy(update={"paged_optimizer_states": paged})
    ranks = min(ctx.cluster.gpus_per_node, ev.plan.world_size)
    return host_memory(report, ranks, ev.headroom_bytes, host_bytes, "").fits


def run_paged_bytes(ev: Evaluation, ctx: Context) -> int | None:
    """The bytes of bitsandbytes' paged states in CUDA managed memory as the Trainer's op-level run places
    them (``timeline/hf_bnb_optim.py``: ``Trainer.create_optimizer``'s ``register_module_override`` gives
    every ``nn.Embedding`` 32-bit states under an 8-bit optimizer, which the closed form does not know:
    llama3-8b's ``paged-adamw-8bit`` pages 19.21 GB, not 16.06 GB), where that run answers the plan
    (``--runtime hf`` on CUDA, ``hf_support.hf_supported``); None elsewhere. One run, ~0.4 s for an 8B
    model, for each plan the search checks against the host (a few: ``REPLAY_BUDGET``)."""
    from memplan.costmodel.optimizer import is_paged

    plan = ev.plan
    if ctx.runtime != "hf" or ctx.device != "cuda" or not is_paged(plan.optimizer):
        return None
    from memplan.costmodel.quant import cuda_arch
    from memplan.costmodel.timeline.hf_support import hf_supported

    arch = cuda_arch(ctx.gpu)
    if hf_supported(ctx.model, plan, ev.workload, "hf", arch, ctx.device) is not None:
        return None
    from memplan.costmodel.timeline.hf_trainer import hf_plan_run

    return hf_plan_run(ctx.model, ev.workload, plan, arch, ctx.device).managed


def _replay_until(
    ranked: list[Evaluation], wanted: int, ctx: Context, host_bytes: int | None = None
) -> list[Evaluation]:
    """The first ``wanted`` plans, best first, that still fit when their runs are replayed
    through the caching allocator model (the fast form only screens them) and whose host share
    fits the node's host memory (when known); at most ``REPLAY_BUDGET x wanted`` replays."""
    out: list[Evaluation] = []
    tries = 0
    for ev in ranked:
        if len(out) == wanted or tries == REPLAY_BUDGET * wanted:
            break
        if ev.fits and host_fits(ev, ctx, host_bytes):
            tries += 1
            if (ev := replayed(ev, ctx)).fits:
                out.append(ev)
    return out


def _run_plans(req: TuneRequest, space: Space) -> int:
    """How many of the plans take their peak from the op-level run (``evaluate.from_run``)."""
    ctx = req.ctx
    if not ctx.every_plan_from_run and not any(
        c.plan.finetune != "full" or c.plan.precision == "fp32" for c in space.candidates
    ):
        return 0
    from memplan.costmodel.fast_run import applies

    return sum(applies(ctx.model, c.plan, ctx.runtime, ctx.device) for c in space.candidates)


def tune(req: TuneRequest, hooks: Hooks | None = None) -> TuneResult:
    """Search, validate the best ``req.validate`` plans, rank, recommend (see the module)."""
    hooks = hooks or Hooks()
    space, valid = _space(req)
    exhaustive, reason = search_mode(req, len(space), _run_plans(req, space))
    found = _search(req, space, hooks, exhaustive)
    fitting, closest = _fitting(req, space, found.evaluations)
    keep = None
    if req.export_target:
        refusal = export_refusal(req.export_target)

        def keep(c: Candidate, ctx: Context) -> bool:
            return refusal(c, ctx) is None

    top = [
        RankedPlan(rank=i, trial=found.trials_of.get(ev.candidate.key), evaluation=ev)
        for i, ev in enumerate(fitting[: max(req.top, req.validate)], 1)
    ]
    study, written = found.study, None
    if req.validate and top and not hooks.should_stop():
        study = study or _open(req, found.name)
        top, written = _validate(req, space, study, top, hooks)
    return TuneResult(
        model=req.ctx.model.name,
        gpu=req.ctx.gpu.name,
        gpus=req.options.gpus,
        nodes=req.ctx.cluster.nodes,
        runtime=req.ctx.runtime,
        objective=req.objective,
        allocator="expandable" if req.ctx.allocator.expandable_segments else "default",
        capacity_bytes=req.ctx.gpu.capacity_bytes,
        margin_bytes=req.ctx.margin_bytes,
        limit_bytes=req.ctx.limit_bytes,
        space_size=len(space),
        evaluated=len(found.evaluations),
        exhaustive=exhaustive,
        search_reason=reason,
        export_target=req.export_target,
        space_before_export=valid if req.export_target else None,
        study=found.name if study is not None else None,
        storage=req.storage if study is not None else None,
        trials=len(study.get_trials(deepcopy=False)) if study is not None else 0,
        trials_run=found.ran,
        interrupted=hooks.should_stop(),
        calibration=_calibration_used(req.ctx),
        top=top,
        recommended=next((r for r in top if not (r.validation and r.validation.status == "oom")), None),
        closest=closest,
        fixes=_fixes(req, closest, keep),
        calibration_written=written,
        micro_batch_ladder=_ladder(req, top),
        host_memory_bytes=req.host_memory_bytes,
        host_memory_source=req.host_memory_source,
    )


def _fixes(req: TuneRequest, closest: Evaluation | None, keep: Callable[[Candidate, Context], bool] | None) -> list:
    """What would make the closest plan fit: when it fits the device and not the node's host
    memory, the changes that move its host share to NVMe or back (``advice.host_suggestions``);
    else the device's (``search.advice.what_would_fit``)."""
    if closest is None:
        return []
    if not closest.fits:
        return what_would_fit(closest, req.options, req.ctx, keep)
    ctx, host = req.ctx, req.host_memory_bytes or 0
    ranks = min(ctx.cluster.gpus_per_node, closest.plan.world_size)
    limit = ctx.limit_bytes - closest.overhead_bytes
    found = host_suggestions(
        ctx.model, closest.workload, closest.plan, ctx.runtime, limit, closest.peak_reserved_bytes, ranks, host,
        ctx.device,
    )  # fmt: skip
    return [
        Fix(kind="plan", change=f"{s.change} (--allow-offload)", peak_reserved_bytes=s.reserved, limit_bytes=limit)
        for s in found
        if s.fits
    ]


LADDER_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)


def _ladder(req: TuneRequest, top: list[RankedPlan]) -> list[LadderRow]:
    """Fine-tuning on a few GPUs: for the recommended plan, the largest micro-batch (powers of two
    up to ``max_micro_batch``) that fits at each sequence length, judged as the recommended plans
    are: the run replayed through the caching allocator model (``replayed``), its reserved peak and
    the memory outside the allocator within the limit, so that each row's figure is the one
    ``memplan estimate`` gives for that plan (the fast form's screen is ~7% above it). The question
    people bring to a fine-tuning run: which batch fits at which length. A length the op-level run does
    not follow for a plan only it answers (``reserve.run_only``: LoRA over Gemma 3 past its window) has no
    row, as ``memplan estimate`` gives no figure there."""
    if req.options.finetune == "full" or not top:
        return []
    plan = top[0].evaluation.plan
    rows = []
    for seq_len in LADDER_SEQ_LENS:
        best, reserved = 0, None
        mb = 1
        try:
            while mb <= req.options.max_micro_batch:
                workload = TrainingWorkload(seq_len=seq_len, micro_batch=mb, global_batch=mb * plan.dp)
                ev = replayed(evaluate(Candidate(plan, workload), req.ctx), req.ctx)
                if not ev.fits:
                    break
                best, reserved, mb = mb, ev.peak_reserved_bytes, mb * 2
        except MemplanError:  # no figure at this length (estimate refuses the plan there in one line)
            continue
        rows.append(LadderRow(seq_len=seq_len, micro_batch=best, peak_reserved_bytes=reserved))
    return rows


def _closest(space: Space, ctx: Context) -> Evaluation:
    best = lowest_peak(space.candidates, ctx)
    assert best is not None  # the space is never empty here
    return evaluate(best[0], ctx)


def _calibration_used(ctx: Context) -> dict[str, float] | None:
    ratio = ctx.time_efficiency.calibration
    if ratio == 1.0 and ctx.peak_ratio == 1.0:
        return None
    return {"step_time_ratio": ratio, "peak_ratio": ctx.peak_ratio}


def uncalibrated(ctx: Context) -> Context:
    """What a validation run is compared with: the bundled trainer's accounting (``memplan``
    runtime, as ``memplan validate``), without calibration (the ratios calibrate the model)."""
    efficiency = ctx.time_efficiency.model_copy(update={"calibration": 1.0})
    return replace(ctx, runtime="memplan", efficiency=efficiency, peak_ratio=1.0)


def _validate(
    req: TuneRequest, space: Space, study, top: list[RankedPlan], hooks: Hooks
) -> tuple[list[RankedPlan], dict | None]:
    """Run the best ``req.validate`` plans, record each as a trial, re-rank, calibrate."""
    gpus = detect_gpus() if req.validation.device != "cpu" else 0
    raw_ctx = uncalibrated(req.ctx)
    done: list[RankedPlan] = []
    for i, r in enumerate(top[: req.validate]):
        if hooks.should_stop():
            break
        hooks.started(f"validating {i + 1}/{min(req.validate, len(top))}", req.validation.steps + 1)
        raw = evaluate(r.evaluation.candidate, raw_ctx)
        spec = run_spec(req.ctx.model, raw, req.ctx.gpu, req.validation, gpus)
        outcome = validate_plan(spec, raw, req.validation.timeout_s, progress=hooks.step)
        attrs = {"validated_trial": r.trial, **outcome.model_dump(mode="json")}
        number = S.record_validation(study, space, r.evaluation, req.objective, attrs, failed=outcome.failed)
        done.append(r.model_copy(update={"validation": outcome, "validation_trial": number}))
    ranked = rerank([*done, *top[len(done) :]])
    return ranked, _calibrate(req, [d.validation for d in done if d.validation])


def rerank(plans: list[RankedPlan]) -> list[RankedPlan]:
    """Plans measured by a real run first, by measured tokens/s; then the rest as predicted;
    plans whose run ran out of memory last."""

    def measured(r: RankedPlan) -> float | None:
        return r.validation.measured_tokens_per_s if r.validation else None

    real = sorted((r for r in plans if measured(r)), key=lambda r: -(measured(r) or 0.0))
    oom = [r for r in plans if r.validation and r.validation.status == "oom"]
    rest = [r for r in plans if not measured(r) and r not in oom]
    return [r.model_copy(update={"rank": i}) for i, r in enumerate([*real, *rest, *oom], 1)]


def _calibrate(req: TuneRequest, outcomes: list[Outcome]) -> dict | None:
    times = [o.step_time_ratio for o in outcomes if o.step_time_ratio]
    peaks = [o.peak_ratio for o in outcomes if o.peak_ratio]
    if req.calibration_path is None or not (times or peaks):
        return None
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    cal = with_runs(load_calibration(req.calibration_path), req.ctx.gpu.name, times, peaks, now)
    save_calibration(cal, req.calibration_path)
    profile = cal.profiles[req.ctx.gpu.name]
    return {
        "path": str(req.calibration_path),
        "gpu": req.ctx.gpu.name,
        "step_time_ratios": times,
        "peak_ratios": peaks,
        "step_time_ratio": profile.step_time_ratio,
        "peak_ratio": profile.peak_ratio,
    }
