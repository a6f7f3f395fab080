"""What would make a plan fit (``costmodel.advice.suggest``): one GPU's standard answer (ZeRO with
the optimizer, and the parameters, on the CPU) and combinations when no single change is enough."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

from memplan.cli.app import run
from memplan.costmodel.advice import rank_key, suggest
from memplan.costmodel.memory import estimate_memory
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

GiB = 2**30


def estimate_json(*args: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(["estimate", *args, "--format", "json"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def test_one_gpu_is_advised_zero_offload():
    """Issue 20's command: llama3-8b on one A100 80GB does not fit; ZeRO-Offload (and ZeRO-3 with
    the parameters on the CPU) does, with the peak it reaches and its step time."""
    data = estimate_json("llama3-8b", "--gpu", "a100-80gb", "--gpus", "1")
    assert not data["fits"]
    fitting = [s for s in data["suggestions"] if s["fits"]]
    assert any(s["change"].startswith("ZeRO-Offload") for s in fitting)
    for s in fitting:
        assert s["reserved_bytes"] <= data["gpu"]["capacity_bytes"] and s["step_time_s"] > 0
    assert data["suggestions"][0]["fits"]  # fitting changes first
    # the change, estimated in full (its run replayed through the allocator model), fits too
    changed = estimate_json(
        "llama3-8b", "--gpu", "a100-80gb", "--gpus", "1", "--zero", "1", "--offload-optimizer", "cpu"
    )
    assert changed["fits"]
    # and the advice shows that full estimate's figure, not the fast form it was screened with
    offload = next(s for s in fitting if s["change"].startswith("ZeRO-Offload"))
    assert offload["verified"] and offload["reserved_bytes"] == changed["memory"]["peak"]["reserved"]


def test_changes_are_combined_when_no_single_one_fits():
    """A 24 GB card at 8k tokens: no single change fits (offloading moves the peak to the activations,
    recomputation alone saves nothing while the optimizer step peaks), a combination does."""
    model, gpu = load_model("llama3-8b"), load_gpu("rtx-4090")
    work, plan = TrainingWorkload(seq_len=8192), Plan()
    current = estimate_memory(model, work, plan, "memplan").peak.reserved
    limit = gpu.capacity_bytes - 2 * GiB
    found = suggest(model, work, plan, "memplan", limit, current, gpu=gpu, cluster=ClusterSpec())
    singles = [s for s in found if " + " not in s.change]
    combined = [s for s in found if " + " in s.change]
    assert singles and not any(s.fits for s in singles)
    assert combined and all(s.fits and s.reserved <= limit for s in combined)
    assert found == sorted(found, key=rank_key) and found[0] in combined
    # the smallest combinations only: none contains another that fits
    parts = [set(s.change.split(" + ")) for s in combined]
    assert not any(a < b for a in parts for b in parts)


def test_a_single_change_that_fits_is_not_combined():
    model, gpu = load_model("llama3-8b"), load_gpu("h100-sxm")
    work, plan = TrainingWorkload(seq_len=2048), Plan(dp=8, zero=0)
    current = estimate_memory(model, work, plan, "memplan").peak.reserved
    found = suggest(model, work, plan, "memplan", current - 1, current, gpu=gpu, cluster=ClusterSpec())
    assert any(s.fits for s in found) and not any(" + " in s.change for s in found)


# what transformers' Trainer cannot change to (the hf-trainer exporter refuses each: export.hf_trainer.check)
NOT_IN_THE_TRAINER = {"tp", "pp", "sequence_parallel"}


def _changes(runtime: str) -> list:
    model = load_model("llama3-8b")
    wl = TrainingWorkload(seq_len=8192, micro_batch=2, global_batch=16)
    plan = Plan(dp=8, zero=3, precision="bf16", recompute="none")
    return suggest(model, wl, plan, runtime, 38 * GiB, 140 * GiB)


def test_under_transformers_loops_the_advice_offers_only_what_they_run():
    """The Trainer and the hand loop have no tensor, pipeline or sequence parallelism and checkpoint whole
    layers: the advice offers none of those under ``hf`` / ``hf-loop``, while the bundled trainer gets them."""
    for runtime in ("hf", "hf-loop"):
        for s in _changes(runtime):
            fields = dict(s.plan_update)
            assert not NOT_IN_THE_TRAINER & fields.keys(), (runtime, s.change)
            assert fields.get("recompute") in (None, "full"), (runtime, s.change)
    offered = {k for s in _changes("memplan") for k in dict(s.plan_update)}
    assert {"tp", "pp"} <= offered
    assert any(dict(s.plan_update).get("recompute") == "selective" for s in _changes("memplan"))


def test_what_the_trainer_is_advised_the_trainer_exporter_takes():
    """Every change advised under ``hf``, applied to the plan, is a plan ``memplan export --to hf-trainer``
    writes (NVMe aside: the exporter asks for the mount path)."""
    base = ["--model", "llama3-8b", "--runtime", "hf", "--gpus", "8", "--zero", "3", "--seq-len", "8192"]
    flags = {
        "zero": "--zero",
        "recompute": "--recompute",
        "offload_params": "--offload-params",
        "offload_optimizer": "--offload-optimizer",
        "precision": "--precision",
        "optimizer": "--optimizer",
    }
    for s in _changes("hf"):
        args = list(base)
        for key, value in s.plan_update:
            if key in flags:
                args += [flags[key], str(value)]
        if "nvme" in args:
            continue
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = run(["export", *args, "--to", "hf-trainer"])
        assert code == 0, (s.change, err.getvalue())


def test_a_single_change_the_screen_wrongly_fits_leads_to_the_combinations():
    """Under the Trainer's FSDP2 the screen (the phase model's sums) said full recomputation alone fits an
    A100 40GB at 2 x 8,192 tokens; estimated in full it reserves 48.7 GiB and does not. The combinations the
    screen skipped are then estimated and verified, so the user gets changes that fit."""
    data = estimate_json(
        "llama3-8b", "--runtime", "hf", "--gpus", "8", "--zero", "3", "--gpu", "a100-40gb", "--seq-len", "8192",
        "--micro-batch", "2",
    )  # fmt: skip
    assert not data["fits"]
    by = {s["change"]: s for s in data["suggestions"]}
    assert by["full recomputation"]["verified"] and not by["full recomputation"]["fits"]
    fitting = [s for s in data["suggestions"] if s["fits"]]
    assert fitting and all(s["verified"] and " + " in s["change"] for s in fitting)
    assert "full recomputation + micro-batch 1" in by


def test_one_sequence_a_micro_batch_is_offered_beside_half_the_micro_batch():
    """QLoRA over Qwen3-8B on a 24 GB card at 4 x 4,096 tokens: the logits of Qwen3's 151,936-token vocabulary
    dominate, and full recomputation fits with one sequence a micro-batch (20.5 GiB) but not with two
    (30.9 GiB): the advice offers micro-batch 1, not only the halved micro-batch."""
    data = estimate_json(
        "qwen3-8b", "--finetune", "qlora", "--quant", "nf4", "--gpu", "rtx-4090", "--seq-len", "4096",
        "--micro-batch", "4",
    )  # fmt: skip
    by = {s["change"]: s for s in data["suggestions"]}
    assert by["full recomputation + micro-batch 1"]["fits"] and by["full recomputation + micro-batch 1"]["verified"]
    assert "micro-batch 1" in by and "micro-batch 2" in by
