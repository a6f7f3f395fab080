"""An op-level plan's estimate is built from its run alone (``costmodel/run_report.py``).

Where the op-level run answers a plan on CUDA (the bundled trainer's run, transformers' Trainer's,
the hand-written loop's), ``memplan estimate`` reports the run's figures and does not compute the
phase model (``memory.training_peak`` and the moments under it); a plan the run does not answer
still gets the phase model's report, with the replay's reserved bytes. Each figure of the report
is held against the run it came from, read here independently of ``run_report``.
"""

from __future__ import annotations

import pytest

from memplan.costmodel import memory
from memplan.costmodel.reserve import peak_breakdown
from memplan.costmodel.timeline import phases
from memplan.costmodel.timeline.events import Builder, Category
from memplan.estimation import estimate, memory_verdict
from memplan.specs.resolve import resolve_job

TINY = """name: tiny
hidden_size: 128
num_layers: 4
num_attention_heads: 4
num_kv_heads: 2
ffn_size: 256
vocab_size: 1000
"""


@pytest.fixture
def tiny(tmp_path) -> str:  # noqa: ANN001
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


def _job(model: str, **plan):  # noqa: ANN202
    plan = {"seq_len": 256, "micro_batch": 2, "gpu": "h100-sxm", **plan}
    return resolve_job(model, None, plan, inference=False)


@pytest.fixture
def no_phase_model(monkeypatch):  # noqa: ANN001, ANN201
    """The phase model's entry points raise: an estimate that answers did not compute it."""

    def refuse(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the phase model was computed")

    for name in ("training_peak", "estimate_training", "_stage_phases", "stage_moments"):
        monkeypatch.setattr(memory, name, refuse)


def _assert_the_report_is_the_runs(job, report, v) -> None:  # noqa: ANN001
    """Every figure of an op-level report against its run, read here again."""
    run = v.run
    assert report.model == "op-level" and report.model_reason is None
    assert report.peak.allocated == v.replay.max_allocated
    assert report.peak.reserved == v.reserved
    assert report.peak.reserved_detail.timeline_allocated == v.replay.max_allocated
    assert report.peak.breakdown == peak_breakdown(v) and sum(report.peak.breakdown.values()) == report.peak.allocated
    assert report.phases == v.replay.phase_peaks and set(report.phases) == {"forward", "backward", "optimizer"}
    assert report.stage_peaks[report.peak.stage] == max(report.phases.values())
    if v.stage_loads:  # the bundled trainer's pipeline: every stage's run (costmodel.stages)
        assert set(report.stage_peaks) == set(report.stage_reserved) == set(range(job.plan.pp))
        assert report.stage_reserved[report.peak.stage] == v.reserved
    else:
        assert set(report.stage_peaks) == {report.peak.stage} and report.stage_reserved is None
    assert report.model_states.model_dump() == phases.model_states(run)
    per_layer, total = phases.saved_activations(run)
    assert (report.activations.per_layer, report.activations.total) == (per_layer, total)
    assert 0 < per_layer < total
    assert report.gradient_accumulation == memory.gradient_accumulation(job.workload, job.plan)


@pytest.mark.parametrize(
    "plan",
    [
        dict(precision="bf16", recompute="none"),
        dict(dp=2, zero=3, precision="bf16-mixed", recompute="selective", global_batch=8),
        dict(dp=2, zero=3, precision="bf16", offload_params="cpu", offload_optimizer="cpu"),
        dict(pp=2, precision="bf16", global_batch=8),  # the followed stage: the runs', not the sums'
    ],
    ids=["one-gpu", "fsdp2-accumulation", "fsdp2-offload", "pipeline"],
)
def test_an_op_level_estimate_does_not_compute_the_phase_model(tiny, no_phase_model, plan):
    job = _job(tiny, **plan)
    report, v, limit = memory_verdict(job, "cuda")
    assert v.timeline == "trainer"
    _assert_the_report_is_the_runs(job, report, v)
    assert report.peak.reserved_detail.limit == limit == job.gpu.capacity_bytes - report.overhead
    result = estimate(job, with_suggestions=False)  # the whole estimate: time, host, margin
    assert result.memory == report and result.fits_margin["model"].startswith("op-level")


def test_the_host_and_paged_bytes_keep_their_closed_form(tiny):
    """Offloaded states are not on the device the run follows: the ZeRO partition says what the
    host holds (``rank.stage_states``), as the phase model's report did."""
    job = _job(tiny, dp=2, zero=3, precision="bf16", offload_params="cpu", offload_optimizer="cpu")
    report, _, _ = memory_verdict(job, "cuda")
    phase = memory.estimate_memory(job.model, job.workload, job.plan, job.runtime, "cuda")
    assert report.offload == phase.offload and report.offload.cpu > 0
    assert report.paged_optimizer_states == phase.paged_optimizer_states == 0
    assert (report.overhead, report.outside) == (phase.overhead, phase.outside)


def test_a_pipelined_estimate_follows_the_rank_its_run_follows(tiny):
    """Under a pipeline the run follows the most-loaded stage (``trainer.most_loaded_stage``: every
    stage's run replayed, ``costmodel.stages``); the report names that stage and its rank."""
    from memplan.costmodel.timeline.trainer import followed_rank, most_loaded_stage

    job = _job(tiny, pp=2, precision="bf16", global_batch=8)
    report, v, _ = memory_verdict(job, "cuda")
    stage = most_loaded_stage(job.model, job.workload, job.plan)
    assert (report.peak.stage, report.peak.rank) == (stage, followed_rank(job.model, job.workload, job.plan, stage))
    assert report.peak.rank_role == memory.stage_role(stage, 2)
    _assert_the_report_is_the_runs(job, report, v)


@pytest.mark.parametrize("runtime", ["hf", "hf-loop"])
def test_transformers_runs_name_their_phases_and_answer_alone(tiny, no_phase_model, runtime):
    """transformers' Trainer's and the loop's runs mark the meter's phases, so their reports too
    come from the run: phases, model states (gradients and AdamW's states of the LoRA adapters alone)."""
    job = _job(tiny, runtime=runtime, finetune="lora", precision="bf16")
    report, v, _ = memory_verdict(job, "cuda")
    assert v.timeline == runtime
    _assert_the_report_is_the_runs(job, report, v)
    states = report.model_states
    assert 0 < states.gradients < states.parameters // 10  # the adapters' gradients, not the base's
    # AdamW's two fp32 moments per adapter element (the Trainer's fused AdamW adds a 4 B step per tensor)
    assert 2 * states.gradients <= states.optimizer_states < 2 * states.gradients + 4096


def test_a_plan_the_run_does_not_answer_computes_the_phase_model(tiny, monkeypatch):
    calls = []
    real = memory.training_peak

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "training_peak", counted)
    report, v, _ = memory_verdict(_job(tiny, precision="bf16", runtime="megatron"), "cuda")
    assert v.timeline.startswith("phases") and report.model == "phase" and calls
    calls.clear()
    report, v, _ = memory_verdict(_job(tiny, precision="bf16", runtime="megatron"), "cpu")  # on CPU likewise
    assert v.timeline.startswith("phases") and report.model == "phase" and calls


@pytest.mark.parametrize("runtime", ["memplan", "hf", "hf-loop"])
def test_a_cpu_estimate_the_run_answers_does_not_compute_the_phase_model(tiny, no_phase_model, runtime):
    """On CPU the run answers as on CUDA, from CPU's kernels (``timeline.cpu``), with no caching
    allocator: reserved is its allocated peak (``cpu_reserve``), nothing cached, no segment."""
    job = _job(tiny, precision="bf16", runtime=runtime)
    report, v, limit = memory_verdict(job, "cpu")
    assert v.timeline == ("trainer" if runtime == "memplan" else runtime)
    _assert_the_report_is_the_runs(job, report, v)
    assert report.peak.reserved == report.peak.allocated and "allocator_rounding" not in report.peak.breakdown
    detail = report.peak.reserved_detail
    assert (detail.segments, detail.cached_free, detail.reserved_by_stream, detail.limit) == (0, 0, {}, limit)
    # CUDA's own tensors left out, and transformers' loader warms no allocator on the CPU
    assert not any(e.tag.startswith("cublas_workspace") or e.tag == "caching_allocator_warmup" for e in v.run)
    if runtime != "memplan":  # from_pretrained (the default build) warms CUDA's allocator
        cuda = memory_verdict(job, "cuda")[1].run
        assert any(e.tag == "caching_allocator_warmup" for e in cuda)


def test_saved_activations_reads_the_saves_at_the_backward_mark():
    """A hand-built run: two layers' saves, a workspace, the logits; the figures are read at the
    steady step's backward mark, the median layer's bytes without a chunk's kept output."""
    b = Builder()
    b.mark("build")
    for step in range(2):
        b.mark("phase:forward")
        if step == 0:
            b.alloc(4096, Category.ACTIVATIONS, "cublas_workspace.forward")
        batch = b.alloc(16, Category.ACTIVATIONS, "batch.ids")
        saves = [b.alloc(100, Category.ACTIVATIONS, f"layers.{i}.attention.q") for i in range(3)]
        saves += [b.alloc(10, Category.ACTIVATIONS, "c0.layers.2.residual_ffn")]  # the chunk's output
        gone = b.alloc(1000, Category.ACTIVATIONS, "layers.0.feed_forward.tmp")
        b.free(gone)
        logits = b.alloc(50, Category.LOGITS, "loss.log_softmax")
        b.alloc(7, Category.PARAMETERS, f"weights{step}")  # not an activation
        b.mark("phase:backward")
        for t in [*saves, logits, batch]:
            b.free(t)
        b.mark("phase:optimizer")
        b.mark("phase:end")
        b.mark(f"step{step}")
    assert phases.saved_activations(b.build()) == (100, 16 + 3 * 100 + 10 + 50)
