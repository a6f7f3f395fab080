"""``memplan estimate --device cpu`` answered by the op-level run on CPU's kernels (issues 27, 28).

Where the run models the plan, the CPU estimate is the run's CPU view (``timeline.cpu``: CUDA's own
tensors left out) replayed byte by byte without a caching allocator (``costmodel.cpu_reserve``:
reserved equals allocated). Each estimate is held here against the real loop on CPU, measured
by the suites' own meters (memoised per shape): the bundled trainer (``timeline_peaks``: its
meter's steady peak and forward / backward peaks, within ``CPU_BOUND``), transformers' Trainer and
the hand loop (``hf_steps``: live storages over three steps, to the byte), and the Trainer over
PEFT LoRA, QLoRA and LLM.int8 models (``hf_peft_steps``, to the byte). The estimates start from a
config.json, as a user's would.

One tensor is in the estimate and not in the meters: bitsandbytes' dynamic map
(``functional.name2qmap["dynamic"]``, 256 fp32 made at the first double quantization and kept for the
process), made in the model's build, before the meters start; it is taken off the prediction
where it appears (its tag in the run), as the meters do not see it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
from timeline_peaks import CPU_BOUND, measured_peaks, trainer_record  # noqa: E402

from memplan.costmodel import memory  # noqa: E402
from memplan.costmodel.timeline.events import ALLOC  # noqa: E402
from memplan.estimation import memory_verdict  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.resolve import resolve_job  # noqa: E402

# the bundled trainer's tiny Llama (GQA), as a config.json
TINY = hf_steps.Case("cpu-tiny", hidden=128, layers=4, heads=4, kv_heads=2, ffn=256, vocab=1000)


def _config(tmp_path: Path, case) -> str:  # noqa: ANN001 - an hf_steps.Case or a peft_steps.PeftCase
    path = tmp_path / f"{case.name}.json"
    path.write_text(json.dumps(case.hf_config()))
    return str(path)


def _job(model: str, seq_len: int, micro_batch: int, **plan):  # noqa: ANN003, ANN202
    fields = {"seq_len": seq_len, "micro_batch": micro_batch, "gpu": "h100-sxm", **plan}
    return resolve_job(model, None, fields, inference=False)


def _plan_fields(plan: Plan) -> dict:
    return plan.model_dump(exclude_unset=True)


def _cpu_estimate(job):  # noqa: ANN001, ANN202
    """The CPU estimate, checked to come from the run alone: op-level, reserved = allocated."""
    report, v, _ = memory_verdict(job, "cpu")
    assert report.model == "op-level" and report.model_reason is None, report.model_reason
    assert report.peak.reserved == report.peak.allocated == v.replay.max_allocated
    assert report.peak.reserved_detail.timeline == v.timeline
    return report, v


def _dynamic_map(v) -> int:  # noqa: ANN001 - a Verdict
    """bitsandbytes' process-wide dynamic map in the run (module docstring)."""
    return sum(e.size for e in v.run if e.op == ALLOC and e.tag.endswith("dynamic_map"))


# --- the bundled trainer -------------------------------------------------------------------------------

TRAINER_PLANS = [
    pytest.param(dict(precision="bf16"), id="bf16"),
    # fp32 with GQA: SDPA's CPU flash kernel (CUDA would run the math path)
    pytest.param(dict(precision="fp32"), id="fp32-gqa-cpu-flash"),
    # LoRA's dropout: CPU's composite input * noise (CUDA's fused kernel keeps a bool mask)
    pytest.param(dict(precision="bf16", finetune="lora", lora_dropout=0.1), id="lora-dropout"),
    # a 4-bit base on bitsandbytes' CPU backend (CUDA's gemm_4bit temporaries left out)
    pytest.param(dict(precision="bf16", finetune="qlora", quant="nf4"), id="qlora-nf4"),
    # FSDP2 ZeRO-3 at 128 tokens a micro-batch, where the run peaks at the reduce-scatter's copy-in:
    # CUDA's ``_chunk_cat`` packs its metadata on the device, CPU's composite allocates none
    pytest.param(dict(precision="fp32", dp=2, zero=3, seq_len=64), id="zero3-fp32-2x64"),
    # dp 3 does not divide dim 0: each unsharded parameter is a view of its padded all-gather output
    # (ZeRO-2 keeps them all through the forward: 26,752 B over the run's rows x cols at 2 x 64)
    pytest.param(dict(precision="fp32", dp=3, zero=2, seq_len=64), id="zero2-dp3-padded"),
    pytest.param(dict(precision="bf16-mixed", dp=3, zero=3, seq_len=64), id="zero3-dp3-padded", marks=pytest.mark.slow),
    pytest.param(
        dict(precision="bf16-mixed", dp=2, zero=3, seq_len=32, micro_batch=4), id="zero3-4x32", marks=pytest.mark.slow
    ),
    pytest.param(dict(precision="fp32", recompute="full"), id="fp32-full-recompute", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16-mixed", recompute="selective"), id="autocast-selective", marks=pytest.mark.slow),
    pytest.param(dict(precision="fp32", finetune="qlora", quant="int8"), id="int8", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", global_batch=4), id="accumulation", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", dp=2, zero=0), id="ddp", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", dp=2, zero=1), id="zero1", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16-mixed", dp=2, zero=2), id="zero2", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", pp=2, global_batch=4), id="pipeline", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", tp=2), id="tp-sp", marks=pytest.mark.slow),
    pytest.param(dict(precision="fp32", attention="eager"), id="eager-fp32", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", recompute="selective-op"), id="selective-op", marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", offload_activations="cpu"), id="save-on-cpu", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("plan", TRAINER_PLANS)
def test_a_cpu_estimate_of_the_bundled_trainer_is_its_run(tmp_path, plan):
    fields = {"seq_len": 128, "micro_batch": 2, **plan}  # 2 x 128 tokens unless the case says
    job = _job(_config(tmp_path, TINY), fields.pop("seq_len"), fields.pop("micro_batch"), runtime="memplan", **fields)
    report, v = _cpu_estimate(job)
    assert v.timeline == "trainer"
    record = trainer_record(job.model, job.workload, job.plan, rank=report.peak.rank)
    step, passes = measured_peaks(record)
    dynamic = _dynamic_map(v)
    phases = report.phases
    predicted = (max(phases.values()) - dynamic, max(phases["forward"], phases["backward"]) - dynamic)
    for what, want, got in zip(("step", "forward and backward"), predicted, (step, passes), strict=True):
        assert abs(want / got - 1) <= CPU_BOUND, f"{plan} {what}: predicted {want:,}, measured {got:,}"


def test_the_cli_answers_a_cpu_plan_from_the_run(tmp_path, capsys):
    """``memplan estimate CONFIG --device cpu --format json``: the JSON keys as on CUDA, the run's figures."""
    from memplan.cli.app import run

    model = _config(tmp_path, TINY)
    args = [model, "--device", "cpu", "--runtime", "memplan", "--precision", "bf16", "--seq-len", "128"]
    code = run(["estimate", *args, "--micro-batch", "2", "--gpu", "h100-sxm", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    memory_json = json.loads(out)["memory"]
    report, _ = _cpu_estimate(_job(model, 128, 2, runtime="memplan", precision="bf16"))
    assert memory_json["model"] == "op-level" and memory_json["model_reason"] is None
    peak = memory_json["peak"]
    assert (peak["allocated"], peak["reserved"]) == (report.peak.allocated, report.peak.allocated)
    assert peak["reserved_detail"]["timeline"] == "trainer" and memory_json["phases"] == report.phases
    assert run(["estimate", *args, "--micro-batch", "2", "--gpu", "h100-sxm"]) == 0
    table = capsys.readouterr().out
    assert "the op-level run (the bundled trainer op by op on CPU's kernels; no caching allocator)" in table
    assert "CPU allocator: caches nothing" in table and "segments" not in table


# --- transformers' Trainer and the hand loop ------------------------------------------------------------

SMALL = dict(hf_steps.BASE_SMALL)
HF_CASES = [
    pytest.param(hf_steps.Case("cpu-hf-fp32-gqa", loop="trainer", kv_heads=2), id="trainer-fp32-gqa"),
    pytest.param(
        hf_steps.Case(
            "cpu-hf-bf16-ckpt", loop="trainer", **{**SMALL, "kv_heads": 1}, dtype="bfloat16", checkpointing=True
        ),
        id="trainer-bf16-ckpt",
    ),
    pytest.param(hf_steps.Case("cpu-hf-autocast", loop="trainer", **SMALL, autocast=True), id="trainer-bf16-true"),
    pytest.param(hf_steps.Case("cpu-hf-loop-fp32", loop="hand", kv_heads=2), id="hand-loop-fp32"),
    pytest.param(hf_steps.Case("cpu-hf-tied", loop="trainer", tied=True), id="trainer-tied", marks=pytest.mark.slow),
    pytest.param(
        hf_steps.Case("cpu-hf-qwen2", loop="trainer", arch="qwen2", kv_heads=2, checkpointing=True),
        id="trainer-qwen2-ckpt",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("case", HF_CASES)
def test_a_cpu_estimate_of_transformers_is_its_run(tmp_path, case):
    recompute = "full" if case.checkpointing else "none"
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute)
    job = _job(_config(tmp_path, case), case.seq, case.batch, runtime=case.runtime, **_plan_fields(plan))
    report, v = _cpu_estimate(job)
    assert v.timeline == case.runtime
    measured = hf_steps.measure_peak(case, steps=3)
    assert report.peak.allocated == measured, f"{case.name}: {report.peak.allocated:,} B predicted, {measured:,} B"


PEFT_CASES = [
    # the Trainer's bf16=True over a bf16 base: PEFT's fp32 adapters run in bf16 (issue 28's +5-10%)
    pytest.param(dict(dtype="bfloat16", autocast=True), id="lora-bf16-true"),
    pytest.param(dict(quant="nf4", double_quant=True, dtype="bfloat16"), id="qlora-nf4-dq"),
    # the usual recipe over an 8-bit base: bf16 base, bf16=True, checkpointing
    pytest.param(dict(quant="int8", dtype="bfloat16", autocast=True, checkpointing=True), id="int8-recipe"),
    pytest.param(
        dict(dtype="bfloat16", targets=("all-linear",), dropout=0.1), id="lora-dropout", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("fields", PEFT_CASES)
def test_a_cpu_estimate_of_the_trainer_over_peft_is_its_run(tmp_path, fields):
    pytest.importorskip("peft")
    import hf_peft_steps
    from peft_steps import TINY as PEFT_TINY
    from peft_steps import PeftCase, plan_of

    case = PeftCase("cpu-peft", **{**PEFT_TINY, **fields})
    job = _job(_config(tmp_path, case), case.seq, case.batch, runtime="hf", **_plan_fields(plan_of(case)))
    report, v = _cpu_estimate(job)
    assert v.timeline == "hf"
    measured, predicted = hf_peft_steps.measure(case, steps=3), report.peak.allocated - _dynamic_map(v)
    assert predicted == measured, f"{fields}: {predicted:,} B predicted, {measured:,} B measured"


# --- where the run declines, the phase model answers ----------------------------------------------------


@pytest.mark.parametrize(
    ("plan", "reason"),
    [
        (dict(runtime="megatron", precision="bf16"), "the megatron runtime"),
        # (eager attention is the run's since 2026-11-29: tests/unit/test_timeline_hf_eager.py)
        (dict(runtime="hf", precision="bf16", attention="triton"), "triton attention"),
    ],
)
def test_a_cpu_plan_the_run_declines_stays_on_the_phase_model(tmp_path, plan, reason):
    job = _job(_config(tmp_path, TINY), 128, 2, **plan)
    report, v, _ = memory_verdict(job, "cpu")
    assert v.timeline.startswith("phases") and report.model == "phase" and reason in report.model_reason
    phase = memory.estimate_memory(job.model, job.workload, job.plan, job.runtime, "cpu")
    assert report.peak.allocated == phase.peak.allocated
