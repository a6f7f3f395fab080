"""benchmarks/gpu_suite.py on CPU: the plan lists, the step runner's resume, the report writer,
the no-GPU exit and one dry run end to end (in a subprocess, tiny plans, about 20 s)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import pytest

from memplan.specs.plan import Recompute

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gs = _load()


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("PYTEST_ADDOPTS", None)
    env.update(extra)
    return env


# --- the plan lists -------------------------------------------------------------------------


def _all_plans(quick: bool) -> list:
    return gs.plan_list(quick) + [p for s in gs.sweep_list(quick) for p in s.plans()]


def test_plan_list_covers_the_issue():
    plans = gs.plan_list()
    assert {p.model for p in plans} == {"1b", "8b", "70b"}
    validate = [p for p in plans if p.runner == "validate"]
    assert any(p.dp > 1 and p.zero >= 2 for p in validate), "FSDP2"
    assert any(p.tp > 1 and p.sequence_parallel for p in validate), "TP + sequence parallel"
    assert any(p.pp > 1 and p.pp_schedule == "1f1b" for p in validate), "PP"
    assert any(p.pp_schedule == "interleaved" for p in validate)
    assert {p.recompute for p in validate} == set(get_args(Recompute)) == {"none", "selective", "selective-op", "full"}
    assert {"fp32", "bf16", "bf16-mixed"} <= {p.precision for p in validate}
    assert {p.allocator for p in plans} == {"default", "expandable"}
    hf = [p for p in plans if p.runner == "hf"]
    assert hf and {"fp32", "bf16", "bf16-mixed"} <= {p.precision for p in hf}
    assert all(p.world_size == 1 and p.recompute in ("none", "full") for p in hf)
    assert any(p.simulated and p.model == "70b" for p in plans), "a large plan as one simulated rank"
    ids = [p.id for p in _all_plans(quick=False)]
    assert len(ids) == len(set(ids))


def test_sweeps_double_the_micro_batch_from_one():
    sweeps = gs.sweep_list()
    assert 1 <= len(sweeps) <= 2
    for sweep in sweeps:
        mbs = sweep.micro_batches
        assert mbs[0] == 1 and all(b == 2 * a for a, b in zip(mbs, mbs[1:], strict=False))
        assert [p.micro_batch for p in sweep.plans()] == list(mbs)
        assert all(p.batch == p.micro_batch * p.dp for p in sweep.plans())  # no accumulation


def test_quick_is_a_subset_within_25_minutes():
    full, quick = gs.plan_list(), gs.plan_list(quick=True)
    assert quick and set(quick) < set(full)
    assert {s.id for s in gs.sweep_list(quick=True)} <= {s.id for s in gs.sweep_list()}
    quick_units = {u.key for u in gs.build_units(quick=True)}
    assert quick_units < {u.key for u in gs.build_units()} | {"bench/bench_attention"}
    # the quick subset still spans the three sizes, both runners and both allocators
    assert {p.model for p in quick} == {"1b", "8b", "70b"}
    assert {p.runner for p in quick} == {"validate", "hf"}
    assert {p.allocator for p in quick} == {"default", "expandable"}
    assert {p.recompute for p in quick} == set(get_args(Recompute))
    assert {"fp32", "bf16", "bf16-mixed"} <= {p.precision for p in quick}
    assert any(p.zero >= 2 for p in quick) and any(p.tp > 1 for p in quick) and any(p.pp > 1 for p in quick)
    assert gs.quick_budget_s() <= gs.QUICK_LIMIT_S - 5 * 60  # five minutes to spare
    assert all(gs.timeout_for(u) >= u.budget_s for u in gs.build_units(quick=True))


def test_plans_are_what_the_trainer_runs_and_fit_an_h100():
    """Every plan passes validate's own checks; every validate plan fits an H100 by the estimate,
    and every sweep reaches a micro-batch the estimate says does not fit (about 4 s)."""
    from memplan.estimation import estimate
    from memplan.specs.resolve import resolve_job
    from memplan.validate.spec import RunSpec
    from memplan.validate.support import check_model, check_plan, check_workload

    def job(p):
        overrides = dict(
            dp=p.dp, tp=p.tp, sequence_parallel=p.sequence_parallel, pp=p.pp, pp_schedule=p.pp_schedule,
            virtual_stages=p.virtual_stages, zero=p.zero, recompute=p.recompute, precision=p.precision,
            micro_batch=p.micro_batch, global_batch=p.batch, seq_len=p.seq_len, gpu="h100-sxm",
            runtime="hf" if p.runner == "hf" else "memplan", allocator=p.allocator,
        )  # fmt: skip
        return resolve_job(gs.model_arg(p.model), None, overrides, inference=False)

    assert gs.model_arg("1b") is not None
    for p in gs.plan_list():
        j = job(p)
        spec = RunSpec(model=j.model, workload=j.workload, plan=j.plan)
        check_model(spec.model), check_plan(spec.plan), check_workload(spec)
        assert estimate(j, with_suggestions=False).fits, p.id
    for sweep in gs.sweep_list():
        fits = [estimate(job(p), with_suggestions=False).fits for p in sweep.plans()]
        assert fits[0] and not fits[-1], (sweep.id, fits)


def test_flags_and_tiny_shapes():
    plan = next(p for p in gs.plan_list() if p.tp > 1 and p.pp > 1)
    flags = plan.flags()
    for flag in ("--tp", "--sequence-parallel", "--pp", "--zero", "--allocator", "--recompute", "--precision"):
        assert flag in flags
    hf = next(p for p in gs.plan_list() if p.runner == "hf")
    assert "--tp" not in hf.flags() and "--pp" not in hf.flags()
    for p in gs.plan_list():
        tiny = gs.tiny_plan(p)
        cfg = gs.tiny_config(tiny)
        assert cfg["num_hidden_layers"] % (p.pp * p.virtual_stages) == 0
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            assert cfg[key] % p.tp == 0
        assert tiny.seq_len % p.tp == 0 and tiny.micro_batch == p.micro_batch
        assert tiny.batch // (tiny.micro_batch * tiny.dp) == p.batch // (p.micro_batch * p.dp)


def test_gpu_profile_for_device_names():
    assert gs.gpu_profile_for("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert gs.gpu_profile_for("NVIDIA H100 PCIe") == "h100-pcie"
    assert gs.gpu_profile_for("NVIDIA H200") == "h200"
    assert gs.gpu_profile_for("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert gs.gpu_profile_for("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert gs.gpu_profile_for("Something else") == "h100-sxm"


def test_pytest_result_parsing():
    out = "tests/x.py ....F\nFAILED tests/x.py::test_a - boom\n== 1 failed, 4 passed, 3 skipped in 9.1s =="
    r = gs.pytest_result(1, out, "python -m pytest", collect_only=False)
    assert r["status"] == "failed" and r["counts"] == {"failed": 1, "passed": 4, "skipped": 3}
    assert r["failures"] == ["FAILED tests/x.py::test_a - boom"]
    r = gs.pytest_result(0, "a\n52/1302 tests collected (1250 deselected) in 8.20s\n", "c", collect_only=True)
    assert r["status"] == "collected" and r["counts"]["collected"] == 52
    assert gs.pytest_result(None, "", "c", collect_only=False)["status"] == "timeout"


# --- the report writer ----------------------------------------------------------------------


def _synthetic() -> dict:
    row = {
        "plan": "v-8b-x",
        "runner": "validate",
        "model": "8B",
        "parallel": "FSDP2 dp8 z3",
        "simulated": True,
        "recompute": "full",
        "precision": "bf16",
        "allocator": "default",
        "seq_len": 4096,
        "micro_batch": 2,
        "status": "ok",
        "ran": True,
        "predicted_fits": True,
        # no error_pct given: the writer computes it
        "allocated": {"predicted": 11 * 2**30, "measured": 10 * 2**30},
        "reserved": {"predicted": 12 * 2**30, "measured": 16 * 2**30},
        "step_time_s": {"predicted": 1.5, "measured": None},
    }
    oom = {**row, "plan": "s-1b/mb8", "status": "oom", "ran": False, "predicted_fits": True, "reason": "OOM here"}
    oom["allocated"] = {"predicted": 100, "measured": None}
    header = {
        "date": "2026-01-02 03:04 UTC",
        "device": "NVIDIA H100 80GB HBM3",
        "gpu_profile": "h100-sxm",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "triton": "3.6.0",
        "transformers": "5.0",
        "python": "3.11.7",
        "commit": "abc1234",
        "quick": True,
        "dry_run": False,
    }
    return {
        "header": header,
        "steps": {
            "pytest": {"status": "passed", "summary": "12 passed in 3.0s", "command": "python -m pytest"},
            "bench": {"status": "skipped", "reason": "no reason"},
            "validate": {"rows": [row]},
            "sweep": {"rows": [{**row, "plan": "s-1b/mb4"}, oom]},
        },
    }


def test_report_header_tables_and_error_percentages(tmp_path: Path):
    md_path, json_path = gs.write_report(_synthetic(), tmp_path / "r.md")
    assert json_path == tmp_path / "r.json"
    md = md_path.read_text()
    for text in ("2026-01-02 03:04 UTC", "NVIDIA H100 80GB HBM3", "torch 2.11.0+cu130 (CUDA 13.0)", "Triton 3.6.0",
                 "abc1234", "mode: quick"):  # fmt: skip
        assert text in md
    for title in ("## 1. GPU-marked tests", "## 2. Attention benchmark", "## 3. validate", "## 4. Fits boundary"):
        assert title in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| v-8b-x (sim) |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # alloc 11 vs 10 GiB: +10%; reserved 12 vs 16 GiB: -25%; step time measured missing
    assert cells[9:18] == ["11.00", "10.00", "+10.0%", "12.00", "16.00", "-25.0%", "1500.0", "-", "-"]
    assert cells[18:] == ["yes", "yes"]
    assert "Predicted fits agreed with the run in 1 of 2 runs." in md
    assert "s-1b/mb8: oom: OOM here" in md
    data = json.loads(json_path.read_text())
    got = data["steps"]["validate"]["rows"][0]
    assert got["allocated"]["error_pct"] == pytest.approx(10.0)
    assert got["reserved"]["error_pct"] == pytest.approx(-25.0)
    assert got["step_time_s"]["error_pct"] is None
    assert data["header"]["device"] == "NVIDIA H100 80GB HBM3"


def test_error_pct():
    assert gs.error_pct(110, 100) == pytest.approx(10.0)
    assert gs.error_pct(90, 100) == pytest.approx(-10.0)
    assert gs.error_pct(1, None) is None and gs.error_pct(None, 5) is None and gs.error_pct(1, 0) is None


# --- state and resume -----------------------------------------------------------------------


def _units():
    sweep = gs.sweep_list(quick=True)[0]
    plans = gs.plan_list(quick=True)[:3]
    units = [gs.Unit("pytest", "tests", 10), *(gs.Unit("validate", p.id, 10, plan=p) for p in plans)]
    return units + [gs.Unit("sweep", p.id, 10, plan=p, group=sweep.id) for p in sweep.plans()]


def test_resume_skips_finished_units(tmp_path: Path):
    units = _units()
    path = tmp_path / "state.json"
    calls: list[str] = []

    def runner(unit, timeout):
        calls.append(unit.key)
        if unit.key == units[2].key:
            raise KeyboardInterrupt  # the suite stopped mid-way
        if unit.step == "sweep" and unit.plan.micro_batch == 4:
            return {"status": "oom", "ran": False}
        return {"status": "ok", "ran": True, "timeout": timeout}

    state = gs.load_state(path, "gpu")
    with pytest.raises(KeyboardInterrupt):
        gs.run_units(units, state, runner, lambda s: gs.save_state(path, s))
    assert calls == [units[0].key, units[1].key, units[2].key]
    assert set(json.loads(path.read_text())["units"]) == {units[0].key, units[1].key}

    calls.clear()
    state = gs.load_state(path, "gpu")
    lines: list[str] = []

    def runner2(unit, timeout):
        calls.append(unit.key)
        return {"status": "oom"} if unit.step == "sweep" and unit.plan.micro_batch == 4 else {"status": "ok"}

    gs.run_units(units, state, runner2, lambda s: gs.save_state(path, s), log=lines.append)
    sweep_keys = [u.key for u in units if u.step == "sweep"]
    # the finished two are skipped; the sweep stops at its first OOM (micro-batch 4 of 1, 2, 4, 8)
    assert calls == [u.key for u in units[2:] if u.step != "sweep"] + sweep_keys[:3]
    assert any("resuming: 2 of" in ln for ln in lines) and any("stops at" in ln for ln in lines)
    recorded = json.loads(path.read_text())["units"]
    assert set(recorded) == {u.key for u in units} - {sweep_keys[3]}
    assert all("duration_s" in r for r in recorded.values())

    calls.clear()  # a third run has nothing left to do, the stopped sweep included
    gs.run_units(units, gs.load_state(path, "gpu"), runner2, lambda s: gs.save_state(path, s))
    assert calls == []
    # another mode, or --fresh, starts over
    assert gs.load_state(path, "dry-run")["units"] == {}
    assert gs.load_state(path, "gpu", fresh=True)["units"] == {}


def test_failures_are_results_and_deadline_leaves_units_for_a_rerun(tmp_path: Path):
    units = _units()[:3]
    state = gs.load_state(tmp_path / "s.json", "gpu")

    def runner(unit, timeout):
        if unit.step == "pytest":
            raise RuntimeError("boom")
        return {"status": "ok"}

    gs.run_units(units, state, runner, lambda s: None, deadline=time.monotonic() + 15)
    assert state["units"][units[0].key]["status"] == "error" and "boom" in state["units"][units[0].key]["reason"]
    assert state["units"][units[1].key]["status"] == "ok"
    assert units[2].key in state["units"]
    late = gs.Unit("validate", "late", budget_s=1000, plan=units[1].plan)
    gs.run_units([late], state, runner, lambda s: None, deadline=time.monotonic() + 60)
    assert late.key not in state["units"]


def test_parallel_jobs_record_every_unit(tmp_path: Path):
    units = _units()
    state = gs.load_state(tmp_path / "s.json", "dry-run")
    gs.run_units(units, state, lambda u, t: {"status": "ok"}, lambda s: None, jobs=2)
    assert set(state["units"]) == {u.key for u in units}


# --- the script -----------------------------------------------------------------------------


def test_module_imports_no_torch():
    code = f"import runpy, sys; runpy.run_path({str(SCRIPT)!r}); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_no_gpu_exits_zero_with_one_line(tmp_path: Path):
    out = tmp_path / "r.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        env=_env(PATH=os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0], lines
    assert not out.exists()


def test_dry_run_end_to_end_and_resume(tmp_path: Path):
    """A tiny plan list through every step on CPU (tests collected, benchmark skipped, two plans,
    a sweep to its simulated OOM), then a rerun that finds everything recorded (about 20 s)."""
    out = tmp_path / "report.md"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--quick", "--out", str(out)]
    cmd += ["--plans", "v-1b-none-bf16mixed,hf-1b-*,s-1b-*"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "running" in proc.stderr  # progress on stderr
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["header"]["dry_run"] is True
    steps = data["steps"]
    assert steps["pytest"]["status"] == "collected" and steps["pytest"]["counts"]["collected"] > 0
    assert steps["bench"]["status"] == "skipped" and steps["bench"]["reason"]
    rows = {r["plan"]: r for r in steps["validate"]["rows"]}
    assert set(rows) == {"v-1b-none-bf16mixed", "hf-1b-bf16mixed-full-exp"}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["allocated"]["measured"] > 0 and row["allocated"]["predicted"] > 0
        assert abs(row["allocated"]["error_pct"]) < 5, row["allocated"]
        assert row["tiny"] and row["seq_len"] == gs.DRY_SEQ_LEN
    sweep = steps["sweep"]["rows"]
    assert [r["status"] for r in sweep][-1] == "oom" and all(r["status"] == "ok" for r in sweep[:-1])
    assert [r["predicted_fits"] for r in sweep] == [r["ran"] for r in sweep]
    md = out.read_text()
    assert "dry run on CPU" in md and "| v-1b-none-bf16mixed |" in md and "collected" in md
    state = json.loads((tmp_path / "report.state.json").read_text())
    assert state["mode"] == "dry-run" and len(state["units"]) == 2 + 2 + len(sweep)

    again = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming: {len(state['units'])} of" in again.stderr and ": running" not in again.stderr
    assert json.loads((tmp_path / "report.json").read_text())["steps"]["validate"]["rows"] == list(rows.values())
