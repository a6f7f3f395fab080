"""The verdict people act on: the capacity PyTorch sees, the memory outside the allocator, and the
tight band, held against what an H200 measured (tests/data/gpu-traces/h200.json, copied from
../shared/gpu-traces/README.md: these runs were not used to build the op-level run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from memplan.cli.app import run
from memplan.costmodel import margin
from memplan.costmodel.overhead import NCCL_COMMUNICATOR_BYTES, outside_memory
from memplan.specs.loader import load_gpu
from memplan.specs.plan import Plan

ROOT = Path(__file__).parents[2]
TRACES = ROOT / "tests" / "data" / "gpu-traces"
H200 = json.loads((TRACES / "h200.json").read_text())
GiB = 2**30
MiB = 2**20
GPUS = sorted(p.stem for p in (ROOT / "profiles" / "gpus").glob("*.yaml"))
OOM_PLAN = H200["runs"]["h200_c_sel8b_s8k_m2"]["args"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


def estimate(capsys, args: list[str], *more: str) -> dict:
    args = [str(TRACES / a) if a.endswith(".json") else a for a in args]
    code = run(["estimate", *args, *more, "--format", "json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    return json.loads(out)


@pytest.mark.parametrize("name", GPUS)
def test_every_profile_carries_the_capacity_pytorch_sees_with_its_source(name):
    gpu = load_gpu(name)
    assert gpu.torch_capacity_bytes is not None and gpu.capacity_basis in ("measured", "published", "derived")
    assert len(gpu.sources["torch_capacity_bytes"]) > 40
    reservation = gpu.memory_bytes - gpu.capacity_bytes  # nvidia-smi (or rocm-smi) total less PyTorch's
    if gpu.vendor == "nvidia":  # what current drivers keep back: 316 MiB (RTX 4090) to 881 MiB (A100 80GB)
        assert 300 * MiB <= reservation <= 900 * MiB, reservation / MiB
    else:  # ROCm: hipMemGetInfo's total and rocm-smi's disagree by a few hundred MiB, either way
        assert abs(reservation) <= gpu.torch_capacity_spread_bytes


def test_the_h200_capacity_is_what_pytorch_reported():
    gpu = load_gpu("h200")
    assert gpu.capacity_bytes == H200["capacity_bytes"] == 150_109_880_320 and gpu.capacity_basis == "measured"
    assert gpu.memory_bytes == 143_771 * MiB  # nvidia-smi's total, beside it


def test_a_profile_without_a_capacity_derives_one_and_says_how(tmp_path):
    text = yaml.safe_load((ROOT / "profiles" / "gpus" / "h100-sxm.yaml").read_text())
    for key in ("torch_capacity_bytes", "torch_capacity_basis", "torch_capacity_spread_bytes"):
        text.pop(key)
    text["sources"].pop("torch_capacity_bytes")
    path = tmp_path / "card.yaml"
    path.write_text(yaml.safe_dump(text))
    gpu = load_gpu(str(path))
    assert gpu.capacity_basis == "derived" and gpu.capacity_bytes == 81_559 * MiB - 881 * MiB
    assert "derived" in gpu.capacity_note and "881 MiB" in gpu.capacity_note


def test_outside_memory_is_the_measured_context_within_0_15_gib_and_nccl_per_communicator():
    one = outside_memory(0)
    for measured in H200["outside_allocator_gib"]:
        assert abs(one.total - measured * GiB) <= 0.15 * GiB
    assert one.total >= max(H200["outside_allocator_gib"]) * GiB - 2**20  # "fits" holds on every run seen
    assert one.spread == round(0.81 * GiB) - round(0.73 * GiB)
    two = outside_memory(2)
    assert two.total - one.total == 2 * NCCL_COMMUNICATOR_BYTES and "NCCL" in two.source


def test_an_unmeasured_torch_version_gets_the_nearest_measured_figure_and_says_so():
    assert outside_memory(0, "2.11.0+cu130").source == outside_memory(0).source
    other = outside_memory(0, "2.9.1")
    assert other.cuda_context == outside_memory(0).cuda_context
    assert "torch 2.9 not measured" in other.source


def test_estimate_reports_capacity_and_outside_memory_on_the_h200(capsys):
    d = estimate(capsys, ["llama3-8b", "--gpu", "h200", "--gpus", "1", "--zero", "0", "--finetune", "lora"])
    assert d["gpu"]["capacity_bytes"] == 150_109_880_320 and d["gpu"]["capacity_basis"] == "measured"
    assert d["gpu"]["memory_bytes"] == 143_771 * MiB
    outside = d["memory"]["outside"]
    assert outside["communicators"] == 0 and outside["nccl"] == 0
    assert d["memory"]["overhead"] == outside["cuda_context"] + outside["nccl"]
    assert all(abs(d["memory"]["overhead"] - m * GiB) <= 0.15 * GiB for m in H200["outside_allocator_gib"])


def test_the_plan_that_ran_out_of_memory_on_the_h200_is_not_called_a_fit(capsys):
    d = estimate(capsys, [*OOM_PLAN, "--gpu", "h200"])
    assert d["fits_margin"]["state"] in ("does not fit", "tight")
    assert not d["fits"]
    # the H200 said: "Tried to allocate 7.83 GiB ... 8.84 GiB is reserved by PyTorch but unallocated"
    assert "7.83 GiB logits_and_loss allocation" in d["fits_reason"] and "8.84 GiB" in d["fits_reason"]


@pytest.mark.parametrize("name", [k for k, r in H200["runs"].items() if r["measured_reserved"]])
def test_the_band_covers_what_each_h200_run_reserved(capsys, name):
    """Each run that ran: the prediction plus the band's model term reaches the measured reserved peak,
    so a plan called "fits" (not tight) with the same error would have run."""
    r = H200["runs"][name]
    d = estimate(capsys, [*r["args"], "--gpu", "h200"])
    m = d["fits_margin"]
    assert d["fits"] and m["state"] == "ample"  # every one of them ran
    model_term = m["band_bytes"] - m["outside_spread_bytes"] - m["capacity_spread_bytes"]
    predicted = d["memory"]["peak"]["reserved"]
    assert predicted + model_term >= r["measured_reserved"], (predicted, model_term, r["measured_reserved"])
    assert m["model"] == (
        "op-level run" if d["memory"]["peak"]["reserved_detail"]["timeline"] == "trainer" else "phase model"
    )


def test_mechanisms_pick_their_measured_error_and_unmeasured_ones_the_largest():
    assert margin.phase_error(Plan(pp=2, dp=4), "memplan")[0] == margin.PHASE_MEASURED["pipeline"][0]
    assert margin.phase_error(Plan(finetune="qlora"), "memplan")[0] == margin.UNMEASURED
    error, basis = margin.phase_error(Plan(cp=2), "memplan")
    assert error == margin.UNMEASURED and "not measured on a GPU" in basis
    assert margin.band("trainer", Plan(), "memplan", 100 * GiB, 0).error == margin.OP_LEVEL
    lora = Plan(finetune="lora")
    assert margin.band("hf", lora, "hf", 100 * GiB, 0).error == margin.HF_OP_LEVEL
    # an LLM.int8 base was measured off on the GPU (2026-11-28): its plans take that error, and say so
    for which, runtime in (("trainer", "memplan"), ("hf", "hf")):
        int8 = margin.band(which, Plan(finetune="qlora", quant="int8"), runtime, 100 * GiB, 0)
        assert int8.error == margin.OP_LEVEL_MISSES[which]["LLM.int8"][0] and "LLM.int8" in int8.basis
    assert margin.state(True, 1, 2) == "tight" and margin.state(True, 3, 2) == "ample"
    assert margin.state(False, -1, 2) == "does not fit"


def _card(tmp_path: Path, capacity: int) -> str:
    text = yaml.safe_load((ROOT / "profiles" / "gpus" / "h200.yaml").read_text())
    text.update(name="card", torch_capacity_bytes=capacity, torch_capacity_spread_bytes=0)
    path = tmp_path / f"card-{capacity}.yaml"
    path.write_text(yaml.safe_dump(text))
    return str(path)


PLAN = ["llama3-8b", "--gpus", "1", "--finetune", "lora", "--seq-len", "4096"]


def test_a_fit_within_the_band_is_tight_and_one_beyond_it_ample(capsys, tmp_path):
    d = estimate(capsys, [*PLAN, "--gpu", "h200"])
    need = d["memory"]["peak"]["reserved"] + d["memory"]["overhead"]
    band = d["fits_margin"]["band_bytes"] - d["fits_margin"]["capacity_spread_bytes"]
    tight = estimate(capsys, [*PLAN, "--gpu", _card(tmp_path, need + band // 2)])
    assert tight["fits"] and tight["fits_margin"]["state"] == "tight"
    assert tight["fits_margin"]["headroom_bytes"] == band // 2
    ample = estimate(capsys, [*PLAN, "--gpu", _card(tmp_path, need + band + 2**20)])
    assert ample["fits"] and ample["fits_margin"]["state"] == "ample"


def test_check_fails_a_tight_fit_only_when_the_budget_says_tight_false(capsys, tmp_path):
    d = estimate(capsys, [*PLAN, "--gpu", "h200"])
    need = d["memory"]["peak"]["reserved"] + d["memory"]["overhead"]
    card = _card(tmp_path, need + (d["fits_margin"]["band_bytes"] // 2))
    entry = {
        "name": "lora",
        "model": "llama3-8b",
        "gpu": card,
        "gpus": 1,
        "workload": {"seq_len": 4096},
        "plan": {"finetune": "lora"},
    }
    for tight, code, status in ((None, 0, "pass"), (False, 1, "tight")):
        budget = {"fits": True} if tight is None else {"fits": True, "tight": tight}
        path = tmp_path / "budgets.yaml"
        path.write_text(yaml.safe_dump({"entries": [{**entry, "budget": budget}]}))
        got = run(["check", str(path), "--format", "json"])
        out, err = capsys.readouterr()
        assert got == code, err
        e = json.loads(out)["entries"][0]
        assert e["status"] == status
        if status == "tight":
            assert e["reason"].startswith("fits, tight:") and "band" in e["reason"]


def test_check_refuses_a_tight_that_is_not_a_boolean(capsys, tmp_path):
    path = tmp_path / "budgets.yaml"
    entry = {"name": "x", "model": "llama3-8b", "budget": {"fits": True, "tight": "no"}}
    path.write_text(yaml.safe_dump({"entries": [entry]}))
    assert run(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "budgets.yaml" in err and "tight" in err


def test_tune_does_not_recommend_a_tight_plan_unless_asked():
    from dataclasses import replace

    from memplan.search.evaluate import Context, evaluate, replayed
    from memplan.search.space import Candidate
    from memplan.specs.hardware import ClusterSpec
    from memplan.specs.loader import load_model
    from memplan.specs.workload import TrainingWorkload

    model, gpu = load_model("llama3-8b"), load_gpu("h200")
    candidate = Candidate(Plan(finetune="lora", lora_targets=["all-linear"]), TrainingWorkload(seq_len=4096))
    base = Context(model, gpu, ClusterSpec(gpus_per_node=1))
    ev = replayed(evaluate(candidate, base), base)
    assert ev.fits and not ev.tight and ev.band_bytes > 0
    need = ev.peak_reserved_bytes + ev.overhead_bytes
    card = gpu.model_copy(update={"torch_capacity_bytes": need + ev.band_bytes // 2, "torch_capacity_spread_bytes": 0})
    ctx = Context(model, card, ClusterSpec(gpus_per_node=1))
    tight = replayed(evaluate(candidate, ctx), ctx)
    assert tight.tight and not tight.fits  # tune skips it
    allowed = replayed(evaluate(candidate, replace(ctx, allow_tight=True)), replace(ctx, allow_tight=True))
    assert allowed.tight and allowed.fits  # --allow-tight


def test_the_table_says_fits_tight_with_the_numbers_and_what_buys_headroom(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    d = estimate(capsys, [*PLAN, "--gpu", "h200"])
    need = d["memory"]["peak"]["reserved"] + d["memory"]["overhead"]
    card = _card(tmp_path, need + d["fits_margin"]["band_bytes"] // 2)
    assert run(["estimate", *PLAN, "--gpu", card]) == 0
    out = capsys.readouterr().out
    verdicts = [line for line in out.splitlines() if line.startswith(("fits", "does not fit"))]
    assert len(verdicts) == 1 and verdicts[0].startswith("fits, tight: ")
    # the Trainer's op-level run answers this LoRA plan (bf16, the Trainer's recipe): its band is the error
    # measured on real Trainer runs on an H200, and the line says so
    assert "band of the op-level run's measured error" in out and "Trainer runs on an H200" in " ".join(out.split())
    assert "Changes that buy the headroom" in out
    tight = estimate(capsys, [*PLAN, "--gpu", card])
    assert tight["suggestions"] and any(s["fits"] for s in tight["suggestions"])
