"""The estimate against the GPU runs of 2026-11-28 (tests/data/gpu-runs/): one NVIDIA H200 and one H100.

Measured there by CUDA's caching allocator (``torch.cuda.max_memory_allocated`` /
``max_memory_reserved``, steps after the first), not by anything memplan re-implements:

- ``validate``: ``memplan validate`` runs of the bundled trainer (one rank, simulated where the plan
  has several), mechanisms with no allocator trace before: ZeRO-1, DDP with selective-op recompute,
  the interleaved pipeline schedule, activation offload, a 70B TP 8 + SP x PP 4 x FSDP2 rank, an
  LLM.int8 base; and the alone runs whose step time was profiled (the Llama-3.2-1B shapes, LoRA and
  QLoRA nf4 over an 8B base);
- ``callback``: real ``transformers.Trainer`` runs with :class:`MemplanCallback` (benchmarks/gpu_callback.py),
  each estimated here from the plan the callback read off the live model.

Issue 27's bounds: allocated within 0.5%, reserved within 1%, and every run that ran called "fits".
The band (``fits_margin``) must cover what each run reserved: the prediction plus the band's model
term reaches the measured peak, the misses included.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from memplan.cli.app import run

DATA = Path(__file__).parents[1] / "data"
RUNS = {
    gpu: json.loads((DATA / "gpu-runs" / f"{file}-2026-11-28.json").read_text())
    for gpu, file in (("h200", "h200"), ("h100-sxm", "h100"))
}
ALLOCATED_BOUND, RESERVED_BOUND = 0.005, 0.01
# the bundled trainer over an LLM.int8 base: bitsandbytes' CUDA path keeps what its CPU path does not
INT8 = (
    "LLM.int8 base on CUDA: MatMul8bitLt keeps the outlier columns (|x| >= 6.0) of each input as fp32 subA "
    "in ctx.tensors (timeline/int8_outliers.py); their count is taken from the random init treating tokens as "
    "independent (4,543 columns of the down projection where the GPU showed ~4,000): allocated +1.06% "
    "(59,210,662,912 predicted, 58,591,312,384 measured), reserved +2.99% (73,987,522,560, 71,840,038,912), "
    "over; with the columns the GPU held, -0.08% / exact (tests/unit/test_timeline_int8_cuda.py)"
)
MISSES = {
    "v-1b-qlora-int8": INT8,
    "v-1b-qlora-int8-snap": INT8,
}
CALLBACK_MISSES = {
    "llama1b-lora-int8": "the Trainer over a random 8-bit base on CUDA: allocated +0.60%, reserved exact; "
    "RandomInit counts 1,500 outlier columns per down projection (tokens independent) where the real layers "
    "held 919 to 1,390; with the columns counted on CPU +0.21% / exact (tests/unit/test_timeline_int8_cuda.py). "
    "Taken as trained (before 2026-11-29): -2.34% / -2.64%",
}


def _estimate(args: list[str], gpu: str) -> dict:
    """``memplan estimate`` of a validate run's plan: the bundled trainer's runtime (a LoRA plan's default
    runtime is transformers' Trainer)."""
    args = [str(DATA / "gpu-traces" / a) if a.endswith(".config.json") else a for a in args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(["estimate", *args, "--runtime", "memplan", "--gpu", gpu, "--format", "json"])
    assert code == 0
    return json.loads(out.getvalue())


def _cases(kind: str, misses: dict[str, str]) -> list:
    return [
        pytest.param(gpu, name, id=f"{gpu}-{name}", marks=[pytest.mark.xfail(strict=True, reason=misses[name])])
        if name in misses
        else pytest.param(gpu, name, id=f"{gpu}-{name}")
        for gpu, runs in RUNS.items()
        for name in runs[kind]
    ]


def _check(allocated: int, reserved: int, run: dict) -> None:
    a_err = allocated / run["measured_allocated"] - 1
    r_err = reserved / run["measured_reserved"] - 1
    assert abs(a_err) <= ALLOCATED_BOUND and abs(r_err) <= RESERVED_BOUND, (
        f"allocated {a_err:+.3%}, reserved {r_err:+.3%}"
    )


@pytest.mark.parametrize(("gpu", "name"), _cases("validate", MISSES))
def test_the_bundled_trainer_runs(gpu, name):
    r = RUNS[gpu]["validate"][name]
    d = _estimate(r["args"], gpu)
    assert d["memory"]["model"] == "op-level" and d["fits"]
    _check(*_at_the_measured_rank(d, r), r)


def _at_the_measured_rank(d: dict, r: dict) -> tuple[int, int]:
    """The predicted (allocated, reserved) of the rank the run measured. Under a pipeline every stage's
    run is replayed (``memory.stage_peaks``, ``memory.stage_reserved``) and the estimate follows the one
    that runs out of memory first (``costmodel/stages.py``), which need not be the rank ``memplan validate``
    ran when the run was recorded: it ran the phase model's pick then (h200 ``v-70b-tp8sp-pp4-dp2-z3-selop-exp``:
    rank 48, stage 3, where the runs now name stage 0, 39,061,553,152 B reserved against stage 3's
    34,028,388,352 B; stage 0 was not measured)."""
    m = d["memory"]
    if not m.get("stage_reserved"):
        return m["peak"]["allocated"], m["peak"]["reserved"]
    stage = str(r["rank"] // (d["plan"]["dp"] * d["plan"]["tp"]))  # the trainer's (pp, dp, tp) mesh
    return m["stage_peaks"][stage], m["stage_reserved"][stage]


@pytest.mark.parametrize(("gpu", "name"), [(g, n) for g, runs in RUNS.items() for n in runs["validate"]])
def test_the_band_covers_what_each_run_reserved(gpu, name):
    """A plan the band calls "ample" with the same error would have run: misses included."""
    r = RUNS[gpu]["validate"][name]
    d = _estimate(r["args"], gpu)
    m = d["fits_margin"]
    model_term = m["band_bytes"] - m["outside_spread_bytes"] - m["capacity_spread_bytes"]
    assert d["memory"]["peak"]["reserved"] + model_term >= r["measured_reserved"], m["basis"]


@pytest.fixture(scope="module")
def callback_models():
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        from gpu_callback import MODELS
    finally:
        sys.path.pop(0)
    return MODELS


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n, marks=[pytest.mark.xfail(strict=True, reason=CALLBACK_MISSES[n])] if n in CALLBACK_MISSES else []
        )
        for n in RUNS["h200"]["callback"]
    ],
)
def test_the_callbacks_trainer_runs(callback_models, name):
    """The plan MemplanCallback read off each live model (its ``result.plan``), estimated again: the
    op-level run of transformers' Trainer against the H200's allocator."""
    from memplan.api import estimate, model_spec
    from memplan.specs.plan import Plan

    r = RUNS["h200"]["callback"][name]
    p = r["plan"]
    plan = {k: v for k, v in p.items() if k in Plan.model_fields and k != "world_size"}
    if p["precision"] != "bf16":
        plan.pop("autocast")  # resolved, not an input: autocast is bf16-mixed's by definition
    workload = {k: p[k] for k in ("seq_len", "micro_batch", "global_batch")}
    # benchmarks/gpu_callback.py saved each model from_config and loaded it back: random weights, norms at one,
    # which the callback reads off the live model since 2026-11-29 (only an 8-bit base's estimate reads it)
    model = model_spec(dict(callback_models[r["case"]["model"]]))[0].model_copy(update={"random_init": 0.02})
    result = estimate(model, plan=plan, workload=workload, gpu="h200", runtime="hf", device="cuda")
    assert result.memory.model == "op-level" and result.fits
    _check(result.memory.peak.allocated, result.memory.peak.reserved, r)
