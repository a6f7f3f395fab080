"""The timeline of a run and the allocator's verdict on it.

The timeline reaches every moment of the phase model with exactly its bytes per category, and
its steady step peaks at the phase model's allocated peak (the fast form the search uses);
replaying it through the allocator model gives reserved memory and "fits"."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from phase_run import steady_peak

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.memory import estimate_training, stage_moments
from memplan.costmodel.reserve import replay, verdict
from memplan.costmodel.timeline.events import ALLOC, FREE, Category, Moment, Stream
from memplan.costmodel.timeline.step import build_run, pieces
from memplan.errors import MemplanError
from memplan.specs.job import check_compatible
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_allocator
from memplan.specs.workload import TrainingWorkload

TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"
# GPT-2 small (124M) as Hugging Face publishes its config.json: LayerNorm, GELU, learned
# positions, tied embeddings, 12 heads without grouped keys; beside the Llama and MoE profiles
GPT2_SMALL = str(Path(__file__).parents[1] / "data" / "hf" / "gpt2.json")
MODELS = {"llama3-8b": "llama3-8b", "mixtral-8x7b": "mixtral-8x7b", "gpt2-small": GPT2_SMALL}


def _live_at_marks(timeline) -> dict[str, dict[str, int]]:
    live: dict[str, int] = {}
    out = {}
    for e in timeline.events:
        if e.op == ALLOC:
            live[e.category] = live.get(e.category, 0) + e.size
        elif e.op == FREE:
            live[e.category] -= e.size
        else:
            out[e.tag] = {k: v for k, v in live.items() if v}
    return out


GRID = [
    dict(dp=8, zero=3, precision="bf16-mixed"),
    dict(dp=8, zero=3, precision="bf16", recompute="full"),
    dict(dp=4, tp=2, sequence_parallel=True, zero=3, precision="bf16-mixed", recompute="full"),
    dict(dp=8, zero=1, precision="bf16-master", recompute="selective"),
    dict(dp=2, tp=2, pp=2, zero=1, precision="bf16-mixed", recompute="selective-op"),
    dict(dp=1, pp=4, zero=0, precision="bf16", pp_schedule="interleaved", virtual_stages=2),
    dict(dp=2, pp=2, zero=2, precision="fp32", pp_schedule="gpipe"),
    dict(dp=8, zero=0, precision="fp32"),
    dict(dp=8, zero=3, precision="bf16-mixed", offload_optimizer="cpu", offload_params="cpu"),
]


@pytest.mark.parametrize(
    ("name", "plan", "runtime", "micro_batch"),
    [
        (name, plan, runtime, mb)
        for name, (plan, runtime, mb) in zip(
            itertools.cycle(MODELS),
            itertools.product(GRID, ["memplan", "hf", "megatron"], [1, 4]),
        )
    ],
)
def test_timeline_reaches_each_moment_and_peaks_at_the_phase_models_peak(name, plan, runtime, micro_batch):
    model = load_model(MODELS[name])
    if name == "gpt2-small":  # the label loads what it names, not a Llama
        assert (model.architecture, model.hidden_size, model.num_layers) == ("gpt2", 768, 12)
    p = Plan(**plan)
    seq_len = min(2048, model.max_position_embeddings)  # GPT-2's learned positions stop at 1024
    work = TrainingWorkload(seq_len=seq_len, micro_batch=micro_batch, global_batch=micro_batch * p.dp * 4)
    try:
        check_compatible(model, work, p)
    except MemplanError:
        pytest.skip("plan does not apply to this model")
    report = estimate_training(model, work, p, runtime)
    sm = stage_moments(model, work, p, runtime)
    timeline = build_run(sm.moments, sm.granularity, sm.build_grads)
    marks = _live_at_marks(timeline)
    for moment in (Moment.FORWARD, Moment.BACKWARD_START, Moment.BACKWARD, Moment.OPTIMIZER):
        want = {k: v for k, v in sm.moments[moment].items() if v}
        assert marks[moment] == want, moment  # the last step's mark: category by category
    assert sum(marks[report.peak.phase].values()) == report.peak.allocated
    if sm.granularity.fsdp:
        # FSDP2's forward holds a layer group's all-gather output beside the activations, a
        # moment the phase model does not evaluate: it can only add (docs/cost-model.md)
        assert steady_peak(timeline) >= report.peak.allocated
    else:
        assert steady_peak(timeline) == report.peak.allocated


def _suite_cases():
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "validate"))
    from trainer_cases import CASES

    return CASES


@pytest.mark.parametrize("case", _suite_cases(), ids=lambda c: c.name)
def test_timeline_peak_equals_the_estimate_on_the_trainer_accuracy_suite(case):
    """Every plan of the CPU accuracy suite: the timeline's steady-step peak is the estimate's
    peak.allocated (which the suite holds within 2% of the measured peak)."""
    plan, work = Plan(**case.plan), case.workload()
    report = estimate_training(case.model, work, plan, "memplan")
    sm = stage_moments(case.model, work, plan, "memplan")
    assert steady_peak(build_run(sm.moments, sm.granularity, sm.build_grads)) == report.peak.allocated


def test_tensors_are_cut_to_the_sizes_a_step_allocates():
    assert pieces(10, [4]) == [4, 4, 2]
    assert pieces(7, [3, 1]) == [3, 1, 3]
    assert pieces(5, [0]) == [5]
    model = load_model("llama3-8b")
    p = Plan(dp=8, zero=3, precision="bf16-mixed")
    work = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=8)
    sm = stage_moments(model, work, p, "memplan")
    timeline = build_run(sm.moments, sm.granularity, sm.build_grads)
    sizes = {e.size for e in timeline.events if e.op == ALLOC and e.category == Category.LOGITS}
    assert 4 * 4096 * model.vocab_size in sizes  # one fp32 b s V tensor
    streams = {e.stream for e in timeline.events if e.op == ALLOC}
    assert streams == {Stream.COMPUTE, Stream.ALL_GATHER, Stream.REDUCE_SCATTER}  # FSDP2's own streams
    grads = {e.stream for e in timeline.events if e.op == ALLOC and e.category == Category.GRADIENTS}
    assert grads == {Stream.REDUCE_SCATTER}  # reduce-scatter outputs are the sharded gradients


def _run(plan: Plan, seq_len: int, micro_batch: int, model: str = "llama3-8b"):
    m = load_model(model)
    work = TrainingWorkload(seq_len=seq_len, micro_batch=micro_batch, global_batch=micro_batch * plan.dp)
    sm = stage_moments(m, work, plan, "memplan")
    return build_run(sm.moments, sm.granularity, sm.build_grads), estimate_training(m, work, plan)


def test_replay_reserves_at_least_the_allocated_peak_and_each_stream_caches_its_own():
    timeline, report = _run(Plan(dp=8, zero=3, precision="bf16", recompute="full"), 4096, 2)
    r = replay(timeline, AllocatorConfig())
    assert r.max_allocated >= report.peak.allocated  # blocks are rounded up
    assert r.max_reserved >= r.max_allocated
    assert set(r.reserved_by_stream) == {"compute", "all_gather", "reduce_scatter"}
    assert r.reserved_by_stream["all_gather"] > 0 and r.failure is None


def test_verdict_fits_does_not_fit_and_names_the_failing_request():
    timeline, report = _run(Plan(dp=8, zero=3, precision="bf16", recompute="full"), 4096, 2)
    free = replay(timeline, AllocatorConfig())
    fits = verdict(timeline, AllocatorConfig(), free.max_reserved)
    assert fits.fits and fits.reserved == free.max_reserved and fits.reason.startswith("fits")
    small = verdict(timeline, AllocatorConfig(), report.peak.allocated // 2)
    assert not small.fits and small.failure is not None
    assert small.reason.startswith("does not fit") and small.failure.category in {c.value for c in Category}


def test_the_allocator_comes_from_the_flag_else_pytorch_cuda_alloc_conf():
    assert not resolve_allocator(None, {}).expandable_segments
    assert resolve_allocator(None, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).expandable_segments
    assert not resolve_allocator("default", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).expandable_segments
    conf = resolve_allocator("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert conf.expandable_segments and conf.max_split_size == 512 * 2**20
    with pytest.raises(MemplanError) as err:
        resolve_allocator(None, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:maybe"})
    assert err.value.source == "PYTORCH_CUDA_ALLOC_CONF"


def test_runs_set_the_allocator_the_plan_was_predicted_under(monkeypatch):
    from memplan.specs.resolve import alloc_conf_text
    from memplan.validate.launch import worker_env
    from memplan.validate.spec import RunSpec

    assert alloc_conf_text(None, {}) == ""
    assert alloc_conf_text("expandable", {}) == "expandable_segments:True"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:False"}
    assert alloc_conf_text("expandable", env) == "max_split_size_mb:512,expandable_segments:True"
    assert alloc_conf_text(None, env) == env["PYTORCH_CUDA_ALLOC_CONF"]
    model = load_model("llama3-8b")
    spec = RunSpec(model=model, workload=TrainingWorkload(seq_len=64, micro_batch=1), plan=Plan())
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert worker_env(spec)["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6"
    expandable = spec.model_copy(update={"alloc_conf": "expandable_segments:True"})
    assert worker_env(expandable)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def _fragmenting_run():
    """25 tensors of 4 MiB (five 20 MiB segments of the default allocator, five 20 MiB pages of
    one expandable segment), the two at the end of the first segment and the two at the start
    of the second freed, then one of 12 MiB. The default allocator has two 8 MiB holes in two
    segments, neither empty; expandable segments have one 16 MiB run across a page boundary."""
    from memplan.costmodel.timeline.events import Builder

    b = Builder()
    ids = [b.alloc(4 * 2**20, Category.ACTIVATIONS, f"a{i}") for i in range(25)]
    for tensor in ids[3:7]:
        b.free(tensor)
    b.alloc(12 * 2**20, Category.LOGITS, "wide")
    return b.build()


def test_fragmentation_is_reported_as_such_with_what_expandable_segments_reserve():
    run, limit = _fragmenting_run(), 100 * 2**20
    v = verdict(run, AllocatorConfig(), limit)
    assert not v.fits and v.failure is not None and v.failure.size == 12 * 2**20 and v.failure.tag == "wide"
    assert v.failure.cached_free == 16 * 2**20  # reserved but free: the two holes
    assert v.expandable_fits is True and v.expandable_reserved == 100 * 2**20
    assert v.reason.startswith("fits with expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    assert "fragmentation" in v.reason
    assert verdict(run, AllocatorConfig(expandable_segments=True), limit).fits
    # more than the device: no allocator can help, and the verdict says so
    too_big = verdict(run, AllocatorConfig(), 90 * 2**20)
    assert not too_big.fits and too_big.reason.startswith("does not fit")


@pytest.mark.parametrize(
    ("name", "plan", "work"),
    [
        ("llama3-8b", dict(), dict(batch=32, prompt_tokens=8192, generated_tokens=0)),
        ("llama3-70b", dict(tp=4, pp=2), dict(batch=8, prompt_tokens=4096, generated_tokens=512, kv_dtype="fp8")),
        ("mixtral-8x7b", dict(tp=2, ep=1), dict(batch=4, prompt_tokens=2048, generated_tokens=256, block_size=16)),
    ],
)
def test_serving_run_peaks_at_weights_cache_and_one_layers_working_set(name, plan, work):
    from memplan.costmodel.memory import estimate_inference, serving_run
    from memplan.specs.workload import InferenceWorkload

    model, p, w = load_model(name), Plan(**plan), InferenceWorkload(**work)
    report = estimate_inference(model, w, p)
    run = serving_run(model, w, p)
    assert run.peak()[0] == report.peak.allocated
    kv = [e for e in run.events if e.op == ALLOC and e.category == Category.KV_CACHE]
    assert sum(e.size for e in kv) == report.kv_cache and len({e.size for e in kv}) == 1  # a K and a V per layer
    assert replay(run, AllocatorConfig()).max_reserved >= report.peak.allocated
