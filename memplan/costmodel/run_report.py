"""The memory report of a plan the op-level run answers, built from that run alone.

Where ``reserve.plan_run`` follows the plan op by op (the bundled trainer's run, transformers'
Trainer's or the hand-written loop's: ``estimation.OP_LEVEL_RUNS``), on CUDA or on CPU, every figure of
the step comes from the run and its replay (``reserve.verdict``; on CPU the run's CPU view replayed
without a caching allocator, ``cpu_reserve.cpu_verdict``), not from the phase model's sums
(``memory.training_peak``, which is then not computed):

- ``peak.allocated``: the replay's allocated peak (``torch.cuda.max_memory_allocated``), over the
  build and every step; ``peak.reserved`` its reserved peak; ``peak.breakdown`` the categories
  live at the allocated peak (``reserve.peak_breakdown``); ``peak.phase`` the meter's phase in
  force there (``Replay.peak_phase``, ``"setup"`` in the model's build);
- ``phases``: each phase's peak over the steady steps as the bundled trainer's meter measures
  them (``Replay.phase_peaks``, ``timeline.phases``); ``stage_peaks``: their highest, for the
  pipeline rank the run follows and, under the bundled trainer's pipeline, for every stage's run
  (``stages.stage_verdict``), whose reserved peaks ``stage_reserved`` gives;
- ``model_states``: the categories ``parameters``, ``gradients`` and ``optimizer_states`` live
  as the last step's optimizer phase starts (``phases.model_states``);
- ``activations``: what the forwards keep for their backwards (``phases.saved_activations``);
- the stage and rank: the rank the run follows (its ``Timeline.stage``: under the bundled trainer's
  pipeline the stage whose replayed run runs out of memory first, ``stages.load_key``, and
  ``followed_rank``; transformers' runs have one stage, rank 0).

The host's bytes of activation offload are the run's (``Timeline.host_peak``: the pinned copies
``save_on_cpu`` holds at most, ``act_offload.SaveOnCpu``). What the run does not hold keeps its own
source, none of them a phase sum: the states' host and NVMe bytes and bitsandbytes' paged states
(``rank.stage_states``: the ZeRO partition in closed form; under transformers' Trainer the run's own
``Timeline.managed``, ``hf_bnb_optim.py``), the memory outside the allocator
(``overhead.outside_memory``) and the micro-batches per step (``rank.gradient_accumulation``).
"""

from __future__ import annotations

from memplan.costmodel import overhead as O
from memplan.costmodel.rank import gradient_accumulation, stage_role, stage_states
from memplan.costmodel.report import Activations, MemoryReport, ModelStates, Offload, Peak, ReservedDetail
from memplan.costmodel.reserve import Verdict, peak_breakdown
from memplan.costmodel.timeline.phases import model_states, saved_activations
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload


def followed(model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, stage: int) -> tuple[int, int]:
    """(pipeline stage, global rank) the op-level run of ``runtime`` follows on pipeline rank
    ``stage`` (the run's ``Timeline.stage``)."""
    if runtime != "memplan":  # transformers' Trainer and loop: one stage, data and tensor rank 0
        return 0, 0
    from memplan.costmodel.timeline.trainer import followed_rank

    return stage, followed_rank(model, workload, plan, stage)


def run_report(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, v: Verdict, detail: ReservedDetail | None
) -> MemoryReport:
    """The memory report of a plan whose replayed run ``v`` is op-level (module docstring);
    ``detail``: the allocator's state at its peak."""
    run, replay = v.run, v.replay
    assert run is not None and replay.phase_peaks, "an op-level run names its phases"
    stage, rank = followed(model, workload, plan, runtime, run.stage)
    phases = dict(replay.phase_peaks)
    per_layer, total = saved_activations(run)
    states = stage_states(model, plan, stage)
    communicators = O.communicators(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep)
    peak = Peak(
        allocated=replay.max_allocated,
        reserved=v.reserved,
        phase=replay.peak_phase or max(phases, key=phases.__getitem__),
        rank=rank,
        stage=stage,
        rank_role=stage_role(stage, plan.pp),
        breakdown=peak_breakdown(v),
        reserved_detail=detail,
    )
    return MemoryReport(
        model_states=ModelStates(**model_states(run)),
        activations=Activations(per_layer=per_layer, total=total),
        kv_cache=0,
        peak=peak,
        offload=Offload(cpu=states.cpu + run.host_peak, nvme=states.nvme),
        # transformers' Trainer's run places bitsandbytes' paged buffers itself (hf_bnb_optim.py)
        paged_optimizer_states=run.managed if runtime == "hf" else states.paged,
        phases=phases,
        stage_peaks=_stage_peaks(v, stage, max(phases.values())),
        stage_reserved={s: load.reserved for s, load in v.stage_loads.items()} if v.stage_loads else None,
        overhead=O.fixed_overhead_bytes(communicators),
        outside=O.outside_memory(communicators).detail(),
        gradient_accumulation=gradient_accumulation(workload, plan),
        model="op-level",
    )


def _stage_peaks(v: Verdict, stage: int, steady: int) -> dict[int, int]:
    """Each examined stage's highest steady phase peak: every stage's under a pipeline
    (``Verdict.stage_loads``), else the followed one's."""
    if not v.stage_loads:
        return {stage: steady}
    return {s: load.steady for s, load in v.stage_loads.items()}
