"""``memplan validate`` end to end through the CLI (CPU, rank simulation and real gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

TINY = """name: tiny
hidden_size: 128
num_layers: 2
num_attention_heads: 4
num_kv_heads: 2
ffn_size: 256
vocab_size: 1000
"""
BASE = ["--seq-len", "64", "--micro-batch", "2", "--steps", "1"]


def _memplan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memplan.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_json_contract_and_record(tiny: Path, tmp_path: Path):
    out = tmp_path / "rec" / "run.json"
    r = _memplan("validate", str(tiny), "--dp", "4", "--zero", "3", "--precision", "bf16-mixed", *BASE,
                 "--format", "json", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "ok" and data["simulated"] is True and data["world_size"] == 4
    assert abs(data["error_pct"]) < 2.0
    assert data["error_pct"] == pytest.approx(
        100 * (data["predicted_bytes"] - data["measured_bytes"]) / data["measured_bytes"]
    )
    assert set(data["phases"]) == {"forward", "backward", "optimizer"}
    record = json.loads(out.read_text())
    assert record["peak_allocated"] == data["measured_bytes"] and record["versions"]["torch"]
    assert data["mfu"] is None  # a CPU has no peak FLOP/s, and a simulated rank's time is not the job's
    assert data["predicted_step_time_s"] > 0  # the time model's prediction for the --gpu profile


def test_table_output(tiny: Path):
    r = _memplan("validate", str(tiny), "--tp", "2", "--precision", "fp32", *BASE)
    assert r.returncode == 0, r.stderr
    assert "peak" in r.stdout and "phase backward" in r.stdout and "simulated rank" in r.stdout


def test_out_of_memory_is_a_result(tiny: Path):
    r = _memplan("validate", str(tiny), "--precision", "fp32", "--memory-limit", "4MiB", *BASE, "--format", "json")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "oom"
    oom = data["record"]["oom"]
    assert oom["requested_bytes"] > 4 * 2**20
    # issue 26 item 4: the warm-up step's forward, not "setup" (the meter's exit cleared the label it was in)
    assert (oom["phase"], oom["step"], oom["warmup"]) == ("forward", 1, True)
    r = _memplan("validate", str(tiny), "--precision", "fp32", "--memory-limit", "4MiB", *BASE)
    assert r.returncode == 1 and "out of memory in the forward of the warm-up step (step 1)" in r.stdout


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--cp", "2"], None),  # not a validate flag: a usage error
        (["--tp", "3"], "tp"),  # heads not divisible
        (["--dp", "2", "--tp", "2", "--zero", "0"], "zero"),  # DDP with DTensor params
        (["--pp", "3"], "pp"),  # 2 layers into 3 stages
        (["--precision", "fp8"], "precision"),
        (["--memory-limit", "lots"], "--memory-limit"),
        (["--dp", "2", "--zero", "3", "--offload-params", "cpu"], "offload_params"),
        (["--gpu", "no-such-gpu"], "--gpu"),
    ],
)
def test_plans_the_trainer_cannot_apply(tiny: Path, flags: list[str], field: str | None):
    r = _memplan("validate", str(tiny), *flags, *BASE)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memplan: error:"), r.stderr
    if field:
        assert f"{field}:" in lines[0]


def test_hang_is_ended_and_reported(tiny: Path):
    r = _memplan("validate", str(tiny), "--precision", "fp32", *BASE, "--timeout", "1", "--format", "json")
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert data["status"] == "timeout" and "[0]" in data["reason"]


@pytest.mark.slow  # passes alone (9 s); once seen to print no JSON inside the full suite, not yet explained
def test_real_gloo_ranks_match_simulation(tiny: Path):
    common = ["validate", str(tiny), "--dp", "2", "--zero", "2", "--precision", "fp32", *BASE, "--format", "json"]
    r = _memplan(*common, "--real-ranks")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    real = json.loads(r.stdout)
    sim = _memplan(*common)  # its exit code and stderr kept, so that a run printing no JSON says why
    assert sim.returncode == 0 and sim.stdout.strip(), (sim.returncode, sim.stdout[-2000:], sim.stderr[-4000:])
    simulated = json.loads(sim.stdout)
    assert real["status"] == "ok" and real["simulated"] is False
    assert real["measured_bytes"] == pytest.approx(simulated["measured_bytes"], rel=0.001)
