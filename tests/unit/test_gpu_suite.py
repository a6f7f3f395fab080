"""benchmarks/gpu_suite.py on CPU: the plan lists, the schedule (benchmarks/gpu_schedule.py), the
step runner's resume and memory gate, the report writer, the no-GPU exit and one dry run end to end
(in a subprocess, tiny plans, about 40 s)."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import pytest
from benchmark_script import load

from memplan.specs.plan import Recompute

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"


def _load():
    return load("gpu_suite")


gs = _load()
import gpu_schedule  # noqa: E402 - beside gpu_suite, on the path once it is loaded

GIB = 2**30
# torch.cuda.mem_get_info()'s total on the H200 of 2026-11-27 (../shared/gpu-traces/README.md)
H200_CAPACITY = 150_109_880_320
TRACES = Path(__file__).resolve().parents[3] / "shared" / "gpu-traces"


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
        assert mbs[0] == 1 and all(b == 2 * a for a, b in itertools.pairwise(mbs))
        assert [p.micro_batch for p in sweep.plans()] == list(mbs)
        assert all(p.batch == p.micro_batch * p.dp for p in sweep.plans())  # no accumulation


def test_quick_is_a_subset_within_8_minutes():
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
    assert gs.QUICK_LIMIT_S == 8 * 60
    for schedule in _quick_schedules():  # nothing dropped, install, probe and report included
        assert schedule.fits() and not schedule.dropped and schedule.end_s <= 480, schedule.end_s
        assert {s.key for s in schedule.slots} == quick_units
        assert schedule.setup_s >= gs.INSTALL_S + gs.PROBE_S and schedule.report_s == gs.REPORT_S
    assert all(gs.timeout_for(u) >= u.budget_s for u in gs.build_units(quick=True))
    sized = [gs.size_unit(u, "h100-sxm") for u in gs.build_units(quick=True)]
    assert all(gs.timeout_for(u) >= 2 * u.budget_s for u in sized)


def _quick_schedules() -> list:
    """--quick's schedule on an H100 (the profile's measured capacity) and on an H200 (measured)."""
    h200 = [gs.size_unit(u, "h200") for u in gs.build_units(quick=True)]
    return [gs.quick_schedule("h100-sxm"), gs.suite_schedule(h200, H200_CAPACITY, gs.QUICK_LIMIT_S)]


def test_quick_schedule_memory_units_side_by_side_the_rest_alone():
    units = {u.key: u for u in (gs.size_unit(u, "h100-sxm") for u in gs.build_units(quick=True))}
    alone = {k for k, u in units.items() if u.alone}
    # alone: the benchmark, the sweep (out-of-memory boundary) and every plan whose step time is judged
    assert alone == {k for k, u in units.items() if u.step in ("bench", "sweep") or (u.plan and u.plan.timed)}
    assert {k for k, u in units.items() if u.plan and u.plan.simulated} == set(units) - alone - {
        "pytest/gpu-and-kernels-tests"
    }
    for schedule in _quick_schedules():
        shared = [w for w in schedule.waves if not w.alone]
        assert len(shared) == 1 and shared[0].lanes >= 2  # the memory units run together
        assert {s.key for s in shared[0].slots} == set(units) - alone
        assert shared[0].peak_hold_bytes() <= schedule.capacity_bytes
        for wave in schedule.waves:
            if wave.alone:
                assert len({units[s.key].group or s.key for s in wave.slots}) == 1
    capacity = gs.profile_capacity("h100-sxm")
    assert abs(capacity - 79.18 * GIB) < 0.01 * GIB  # what PyTorch sees on an H100 80GB HBM3


def test_plans_are_what_the_trainer_runs_and_fit_an_h100():
    """Every plan passes validate's own checks; every validate plan fits an H100 by the estimate,
    and every sweep reaches a micro-batch the estimate says does not fit (about 4 s)."""
    from memplan.estimation import estimate
    from memplan.specs.resolve import resolve_job
    from memplan.validate.spec import RunSpec
    from memplan.validate.support import check_model, check_plan, check_workload

    def job(p, gpu="h100-sxm"):
        overrides = dict(
            dp=p.dp, tp=p.tp, sequence_parallel=p.sequence_parallel, pp=p.pp, pp_schedule=p.pp_schedule,
            virtual_stages=p.virtual_stages, zero=p.zero, recompute=p.recompute, precision=p.precision,
            micro_batch=p.micro_batch, global_batch=p.batch, seq_len=p.seq_len, gpu=gpu,
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
    for sweep in gs.sweep_list(quick=True):  # --quick keeps the predicted boundary: the last fit, the first not
        quick = sweep.plans(quick=True)
        assert set(quick) <= set(sweep.plans()) and len(quick) >= 2
        for gpu in ("h100-sxm", "h200"):
            fits = [estimate(job(p, gpu), with_suggestions=False).fits for p in quick]
            assert fits == [True] * (len(quick) - 1) + [False], (sweep.id, gpu, fits)


def test_trace_spans_are_the_traces():
    """The GPU phases taken from ../shared/gpu-traces: first to last event of each trace (about 5 s)."""
    if not TRACES.is_dir():
        pytest.skip("../shared/gpu-traces is not beside this checkout")
    spans = {}
    for name in {trace for trace, _ in gs.TRACE_SPANS.values()}:
        events = pickle.load(gzip.open(TRACES / f"{name}.pkl.gz"))["device_traces"][0]
        times = [e["time_us"] for e in events if e.get("time_us")]
        spans[name] = (max(times) - min(times)) / 1e6
    for plan_id, (name, seconds) in gs.TRACE_SPANS.items():
        assert seconds == pytest.approx(spans[name], abs=0.05), (plan_id, name, spans[name])


# --- the schedule -------------------------------------------------------------------------


def _random_jobs(rng: random.Random) -> list:
    jobs = []
    for i in range(rng.randint(1, 14)):
        alone = rng.random() < 0.4
        group = f"g{rng.randint(0, 1)}" if alone and rng.random() < 0.3 else None
        jobs.append(
            gpu_schedule.Job(
                f"u{i}",
                budget_s=rng.choice([5, 20, 45, 90, 150]),
                predicted_bytes=rng.randint(0, 90) * GIB if not alone else rng.randint(0, 150) * GIB,
                alone=alone,
                group=group,
                processes=rng.choice([1, 1, 4]),
            )
        )
    return jobs


def _overlap(a, b) -> bool:
    return a.start_s < b.end_s and b.start_s < a.end_s


def test_schedule_never_puts_an_alone_unit_beside_another():
    rng = random.Random(26)
    for _ in range(300):
        jobs = _random_jobs(rng)
        schedule = gpu_schedule.make_schedule(jobs, rng.choice([80, 140]) * GIB, rng.choice([None, 300, 480]))
        alone = {j.key for j in jobs if j.alone}
        slots = schedule.slots
        assert len({s.key for s in slots}) == len(slots)  # each unit once
        assert {s.key for s in slots} | set(schedule.dropped) == {j.key for j in jobs}
        for slot in slots:
            if slot.key in alone:
                assert not [o.key for o in slots if o is not slot and _overlap(o, slot)], slot
        for wave in schedule.waves:
            if wave.alone:
                assert wave.lanes == 1 and all(s.key in alone or s.hold_bytes == 0 for s in wave.slots)


def test_schedule_side_by_side_peaks_sum_within_capacity():
    rng = random.Random(27)
    for _ in range(300):
        jobs = _random_jobs(rng)
        capacity = rng.choice([80, 140]) * GIB
        schedule = gpu_schedule.make_schedule(jobs, capacity, None, setup_s=30)
        by_key = {j.key: j for j in jobs}
        for slot in schedule.slots:
            running = [o for o in schedule.slots if o.start_s <= slot.start_s < o.end_s]
            assert len(running) <= gpu_schedule.MAX_LANES
            assert sum(o.hold_bytes for o in running) <= capacity, running
            if slot.hold_bytes:  # a unit beside others holds its predicted peak, the margin and the outside memory
                job = by_key[slot.key]
                assert slot.hold_bytes >= job.predicted_bytes * 1.25 + job.processes * 0.8 * GIB - 1
        if schedule.waves:
            assert schedule.waves[0].start_s >= 30
        for a, b in itertools.pairwise(schedule.waves):
            assert b.start_s >= a.end_s  # waves one after another


def test_schedule_limit_drops_what_cannot_end_in_time():
    jobs = [
        gpu_schedule.Job("mem-a", 100, 20 * GIB, alone=False),
        gpu_schedule.Job("mem-b", 100, 20 * GIB, alone=False),
        gpu_schedule.Job("big", 50, 200 * GIB, alone=False),  # beyond the device: alone instead
        gpu_schedule.Job("timed", 60),
        gpu_schedule.Job("sweep/1", 40, group="sweep"),
        gpu_schedule.Job("sweep/2", 40, group="sweep"),
        gpu_schedule.Job("late", 100),
    ]
    full = gpu_schedule.make_schedule(jobs, 80 * GIB, None, setup_s=10, report_s=5)
    assert [w.alone for w in full.waves] == [False, True, True, True, True]
    assert full.waves[0].lanes == 2 and full.waves[0].end_s == 110  # a and b together
    assert [s.key for s in full.waves[2].slots] == ["sweep/1", "sweep/2"]  # a group in one lane, in order
    assert full.end_s == 110 + 60 + 80 + 100 + 50 + 5 and not full.dropped
    cut = gpu_schedule.make_schedule(jobs, 80 * GIB, 240, setup_s=10, report_s=5)
    assert cut.fits() and cut.end_s <= 240
    assert cut.dropped == ("sweep/2", "late", "big")  # a group's tail, then what no longer fits
    lines = gpu_schedule.render(cut)
    assert "side by side, 2 lanes" in lines[1] and "(fits)" in lines[-2] and "dropped" in lines[-1]


def test_memory_gate_lets_in_only_what_fits(tmp_path: Path):
    units = [
        gs.Unit("validate", f"m{i}", 1, alone=False, predicted_bytes=30 * GIB) for i in range(5)
    ]  # 30 x 1.25 + 0.8 = 38.3 GiB each: two at a time on 80 GiB
    gate = gs.MemoryGate(80 * GIB)
    lock, running, most = gs.threading.Lock(), [], [0]

    def runner(unit, timeout):
        with lock:
            running.append(unit.key)
            most[0] = max(most[0], len(running))
        time.sleep(0.05)
        with lock:
            running.remove(unit.key)
        return {"status": "ok"}

    state = gs.load_state(tmp_path / "s.json", "gpu")
    gs.run_units(units, state, runner, lambda s: None, jobs=4, gate=gate)
    assert most[0] == 2 and gate.peak <= 80 * GIB and not gate.held
    assert set(state["units"]) == {u.key for u in units}
    results = state["units"]
    assert any(r["beside"] for r in results.values())
    for key, result in results.items():  # a unit that joined later is named by both
        assert all(key in results[other]["beside"] for other in result["beside"]), (key, result)


def test_out_of_memory_beside_others_runs_again_alone(tmp_path: Path):
    units = [gs.Unit("validate", f"m{i}", 10, alone=False, predicted_bytes=10 * GIB) for i in range(3)]
    units.append(gs.Unit("bench", "b", 10))
    schedule = gs.suite_schedule(units, 80 * GIB, None, spent_s=0)
    assert schedule.waves[0].lanes == 3
    lock, running, started = gs.threading.Lock(), set(), set()
    seen: list[tuple[str, int]] = []
    # the three shared units' first runs meet here, so they overlap whatever the machine's load (a
    # sleep alone let a slow thread start after the others had ended: m1 then ran alone and never failed)
    together = gs.threading.Barrier(3, timeout=30)

    def runner(unit, timeout):
        with lock:
            running.add(unit.key)
            seen.append((unit.key, len(running)))
            first_shared = unit.key.startswith("validate/") and unit.key not in started
            started.add(unit.key)
        if first_shared:
            together.wait()  # past it, the three have all started: this run is one beside others
        crowded = first_shared
        time.sleep(0.05)
        with lock:
            running.discard(unit.key)
        return {"status": "oom" if unit.key == "validate/m1" and crowded else "ok"}

    state = gs.load_state(tmp_path / "s.json", "gpu")
    lines: list[str] = []
    gs.run_schedule(schedule, units, state, runner, lambda s: None, log=lines.append)
    result = state["units"]["validate/m1"]
    assert result["status"] == "ok" and result["beside_oom"]["status"] == "oom" and result["beside_oom"]["beside"]
    assert seen[-1] == ("validate/m1", 1)  # its second run had the GPU to itself
    assert any("running it again alone" in ln for ln in lines)
    assert [k for k, n in seen if k == "bench/b"] and all(n == 1 for k, n in seen if k == "bench/b")


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


def test_list_prints_the_quick_schedule_and_a_dry_run_refuses_one_past_its_limit(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--list"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "schedule on 79.18 GiB" in out and "side by side" in out and "(alone)" in out and "(fits)" in out
    assert all(f"  {u.key}" in out for u in gs.build_units(quick=True))
    total = next(ln for ln in out.splitlines() if ln.startswith("total: "))
    assert float(total.split()[1]) <= 480, total
    cmd = [sys.executable, str(SCRIPT), "--quick", "--dry-run", "--time-limit", "200", "--out", str(tmp_path / "r.md")]
    late = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert late.returncode == 1 and "past 200 s" in late.stderr and "dropped" in late.stdout
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow  # about 40 s: run it (-m slow) before a GPU session uses the script
def test_dry_run_end_to_end_and_resume(tmp_path: Path):
    """A tiny plan list through every step on CPU (tests collected, benchmark skipped, two plans,
    a sweep to its simulated OOM), then a rerun that finds everything recorded (about 40 s)."""
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
    assert any(r["status"] == "ok" for r in sweep)  # the boundary: a micro-batch that ran, then one that did not
    # the schedule, printed: the tests side by side (no simulated plan here), the rest alone, within 8 minutes
    assert "schedule on 79.18 GiB" in proc.stdout and "(alone)" in proc.stdout and "(fits)" in proc.stdout
    md = out.read_text()
    assert "dry run on CPU" in md and "| v-1b-none-bf16mixed |" in md and "collected" in md
    assert "## Schedule" in md and "side by side" in md  # the tests run beside the memory units
    state = json.loads((tmp_path / "report.state.json").read_text())
    assert state["mode"] == "dry-run" and len(state["units"]) == 2 + 2 + len(sweep)

    again = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming: {len(state['units'])} of" in again.stderr and ": running" not in again.stderr
    assert json.loads((tmp_path / "report.json").read_text())["steps"]["validate"]["rows"] == list(rows.values())
