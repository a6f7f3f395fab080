"""The flags this work added or changed, through the CLI: ``--host-memory`` (estimate, tune), the
paged optimizers in ``--optimizer``, ``tune --allow-offload`` with activation offload and NVMe on
one GPU, tune's fine-tuning runtime default."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from memplan.cli.app import run

A100 = ("llama3-8b", "--gpus", "1", "--gpu", "a100-80gb")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMPLAN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")


def memplan(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run([*args])
    return code, out.getvalue(), err.getvalue()


def test_estimate_host_memory_refuses_the_cpu_tier_and_advises_nvme():
    offload = ("--zero", "1", "--offload-optimizer", "cpu", "--precision", "bf16-mixed")
    code, out, err = memplan("estimate", *A100, *offload, "--host-memory", "48GiB")
    assert code == 0, err
    assert "the host does not" in out and "host memory: the plan keeps 59.83 GiB" in out
    assert "NVMe" in out
    code, out, _ = memplan("estimate", *A100, *offload, "--host-memory", "64GiB", "--format", "json")
    data = json.loads(out)
    assert data["fits"] and data["host"]["available_bytes"] == 64 * 2**30 and data["host"]["source"] == "--host-memory"


@pytest.mark.parametrize("value", ["lots", "0GiB", "-4GiB", "1e400GiB"])
def test_a_bad_host_memory_is_one_line(value):
    for command in (("estimate", *A100), ("tune", *A100)):
        code, out, err = memplan(*command, "--host-memory", value)
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and "--host-memory" in err


def test_tune_one_gpu_with_offload_fits_and_goes_to_nvme_when_the_host_is_small(tmp_path):
    """Issue 20's single-GPU case still recommends a fitting plan; with 48 GiB of host memory the
    CPU tier (60 GiB of AdamW states) cannot hold, and the NVMe tier is what is recommended."""
    code, out, err = memplan("tune", *A100, "--allow-offload", "--format", "json", "--out", str(tmp_path / "a.yaml"))
    assert code == 0, err
    best = json.loads(out)["recommended"]["evaluation"]
    assert best["fits"] and best["plan"]["offload_optimizer"] == "cpu"
    code, out, err = memplan(
        "tune",
        *A100,
        "--allow-offload",
        "--host-memory",
        "48GiB",
        "--format",
        "json",
        "--out",
        str(tmp_path / "b.yaml"),
    )
    assert code == 0, err
    result = json.loads(out)
    best = result["recommended"]["evaluation"]
    assert best["fits"] and best["plan"]["offload_optimizer"] == "nvme" and best["plan"]["zero"] == 3
    assert result["host_memory_bytes"] == 48 * 2**30
    code, out, err = memplan("estimate", "llama3-8b", "--plan", str(tmp_path / "b.yaml"), "--host-memory", "48GiB",
                             "--format", "json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["fits"]  # the plan file tune wrote, estimated against the same host


def test_tune_finetune_defaults_to_the_trainer_loop_and_searches_activation_offload(tmp_path):
    args = ("llama3-8b", "--gpus", "1", "--gpu", "rtx-4090", "--finetune", "lora", "--precision", "bf16")
    code, out, err = memplan("tune", *args, "--seq-len", "1024", "--format", "json", "--out", str(tmp_path / "p.yaml"))
    assert code == 0, err
    plain = json.loads(out)
    assert plain["runtime"] == "hf"
    code, out, err = memplan(
        "tune", *args, "--seq-len", "1024", "--allow-offload", "--format", "json", "--out", str(tmp_path / "q.yaml")
    )
    assert code == 0, err
    offload = json.loads(out)
    assert offload["space_size"] > 2 * plain["space_size"]  # activation offload doubles it, state offload adds
    plans = [r["evaluation"]["plan"] for r in offload["top"]]
    assert any(p["offload_activations"] == "cpu" for p in plans)
    code, out, err = memplan("tune", *args, "--runtime", "memplan", "--allow-offload", "--format", "json",
                             "--out", str(tmp_path / "r.yaml"))  # fmt: skip
    assert code == 0, err
    assert all(r["evaluation"]["plan"]["offload_activations"] == "none" for r in json.loads(out)["top"])


def test_a_paged_optimizer_is_reported_outside_the_allocator():
    code, out, err = memplan(
        "estimate", "llama3-8b", "--gpus", "1", "--gpu", "rtx-4090", "--finetune", "lora", "--lora-rank", "64",
        "--optimizer", "paged-adamw-32bit", "--recompute", "full",
    )  # fmt: skip
    assert code == 0, err
    # q_proj A and B and v_proj A at r=64 (32 x 3 x 64 x 4096 elements, 8 bytes each): 0.19 GiB
    assert "paged optimizer states: 0.19 GiB in CUDA unified memory" in out
    code, out, err = memplan("estimate", *A100, "--optimizer", "paged-adamw", "--format", "json")
    assert code == 2 and "--optimizer" in err and len(err.strip().splitlines()) == 1


def test_plan_files_take_the_paged_names(tmp_path):
    good = tmp_path / "paged.yaml"
    good.write_text("model: llama3-8b\ngpus: 1\nplan:\n  finetune: qlora\n  optimizer: paged-adamw-8bit\n")
    code, out, err = memplan("estimate", "llama3-8b", "--plan", str(good), "--gpu", "rtx-4090", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["optimizer"] == "paged-adamw-8bit"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama3-8b\ngpus: 1\nplan:\n  optimizer: paged_adamw_8bit\n")  # transformers' spelling
    code, out, err = memplan("estimate", "llama3-8b", "--plan", str(bad), "--gpu", "rtx-4090")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "plan.optimizer" in err


def test_tune_says_when_only_the_host_memory_is_short(tmp_path):
    """1 GiB of host memory holds no offloaded plan, and on one A100 every plan that fits the
    device offloads: nothing is recommended, and the output says it is the host, not the device."""
    code, out, err = memplan(
        "tune", *A100, "--allow-offload", "--host-memory", "1GiB", "--out", str(tmp_path / "p.yaml"), "--format", "json"
    )
    assert code == 1, err
    result = json.loads(out)
    assert result["recommended"] is None and result["closest"]["fits"]
    code, out, err = memplan(
        "tune", *A100, "--allow-offload", "--host-memory", "1GiB", "--out", str(tmp_path / "p.yaml")
    )
    assert code == 1 and "nothing fits the host memory" in out and "fits the device" in out
    assert not (tmp_path / "p.yaml").exists()
