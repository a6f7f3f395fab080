"""``memplan export`` end to end: what it writes where, and one-line errors (exit 2) that name
the flag, the plan file's field or the model at fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memplan.cli.app import run
from memplan.export import export
from memplan.specs.resolve import resolve_job

PLAN = {
    "model": "llama3-8b",
    "gpu": "h100-sxm",
    "gpus": 8,
    "workload": {"seq_len": 4096, "micro_batch": 2, "global_batch": 64},
    "plan": {"zero": 3, "recompute": "full", "precision": "bf16-mixed"},
}
CLI = "command line"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")


def plan_file(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({**PLAN, **changes}))
    return path


def memplan(capsys, *args: object) -> tuple[int, str, str]:
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def error(capsys, *args: object) -> str:
    """The one error line's text after ``memplan: error: `` (exit 2, nothing on stdout)."""
    code, out, err = memplan(capsys, *args)
    assert code == 2, (code, out, err)
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("memplan: error: "), err
    return err.removeprefix("memplan: error: ").rstrip("\n")


def test_stdout_is_the_config_and_notes_go_to_stderr(tmp_path, capsys):
    path = plan_file(tmp_path)
    code, out, err = memplan(capsys, "export", path, "--to", "deepspeed")
    assert code == 0
    job = resolve_job("llama3-8b", str(path), {})
    assert out == export(job, "deepspeed")
    assert json.loads(out)["zero_optimization"]["stage"] == 3
    lines = err.splitlines()
    assert lines and all(line.startswith("memplan: note: ") for line in lines)
    assert any("gradient_checkpointing_enable" in line for line in lines)


def test_output_file(tmp_path, capsys):
    out_path = tmp_path / "configs" / "accelerate.yaml"
    code, out, _ = memplan(capsys, "export", plan_file(tmp_path), "--to", "accelerate", "-o", out_path)
    assert code == 0 and out == ""
    cfg = yaml.safe_load(out_path.read_text())
    assert cfg["fsdp_config"]["fsdp_version"] == 2
    assert cfg["num_processes"] == 8


def test_flags_override_the_plan_file_and_the_model_can_be_a_flag(tmp_path, capsys):
    code, out, _ = memplan(capsys, "export", plan_file(tmp_path), "--to", "torchtitan", "--zero", "2", "--gpus", "16")
    assert code == 0
    assert 'fsdp_reshard_after_forward="never"' in out and "data_parallel_shard_degree=16" in out
    code, out, _ = memplan(capsys, "export", "--model", "llama3-8b", "--gpus", "8", "--zero", "1", "--to", "megatron")
    assert code == 0 and "--use-distributed-optimizer" in out


def test_model_path_in_a_plan_file_is_relative_to_it(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    model = {
        "name": "small",
        "hidden_size": 256,
        "num_layers": 4,
        "num_attention_heads": 4,
        "ffn_size": 512,
        "vocab_size": 1000,
    }
    (tmp_path / "sub" / "small.yaml").write_text(yaml.safe_dump(model))
    path = tmp_path / "sub" / "plan.yaml"
    path.write_text(yaml.safe_dump({**PLAN, "model": "small.yaml"}))
    code, out, err = memplan(capsys, "export", path, "--to", "fsdp2")
    assert code == 0, err
    assert "# memplan export --to fsdp2: small on 8 x h100-sxm" in out


@pytest.mark.parametrize(
    ("plan", "args", "head", "reason"),
    [
        ({}, ["--to", "deepspeed", "--pp", "2"], f"{CLI}: --pp: ", "deepspeed cannot express pp=2"),
        ({"plan": {"pp": 2, "zero": 1}}, ["--to", "accelerate"], "{path}: plan.pp: ", "accelerate cannot express"),
        ({}, ["--to", "accelerate", "--zero", "1"], f"{CLI}: --zero: ", "ZeRO-2"),
        ({"workload": {"kind": "inference", "batch": 4}}, ["--to", "megatron"], "{path}: workload.kind: ", "training"),
        ({"model": "gpt3-175b"}, ["--to", "fsdp2"], "gpt3-175b: architecture: ", "gpt2"),
        ({"model": "mistral-7b"}, ["--to", "torchtitan"], "mistral-7b: ", "--torchtitan-model"),
        ({}, ["--to", "torchtitan", "--torchtitan-model", "llama3"], f"{CLI}: --torchtitan-model: ", "NAME:FLAVOR"),
        ({}, ["--to", "deepspeed", "--torchtitan-form", "toml"], f"{CLI}: --torchtitan-form: ", "--to deepspeed"),
        ({}, ["--to", "fsdp2", "--gradient-clipping", "0.5"], f"{CLI}: --gradient-clipping: ", "--to fsdp2"),
        ({}, ["--to", "deepspeed", "--offload-optimizer", "nvme"], f"{CLI}: --nvme-path: ", "NVMe"),
        ({}, ["--to", "torchtitan", "--torchtitan-form", "yaml"], f"{CLI}: --torchtitan-form: ", "yaml"),
        ({}, ["--to", "pytorch"], f"{CLI}: --to: ", "pytorch"),
        ({}, [], f"{CLI}: --to: ", "missing"),
        ({"model": None}, ["--to", "deepspeed"], "{path}: model: ", "--model"),
        ({"model": "llama9"}, ["--to", "deepspeed"], "llama9: ", "bundled model profile"),
        ({"gpus": 24, "plan": {"tp": 3}}, ["--to", "megatron"], "{path}: plan.tp: ", "num_attention_heads"),
    ],
)
def test_bad_export_is_one_line_naming_the_source(tmp_path, capsys, plan, args, head, reason):
    data = {**PLAN, **plan}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    message = error(capsys, "export", path, *args)
    assert message.startswith(head.format(path=path)), message
    assert reason in message


def test_no_plan_and_no_model(capsys):
    assert error(capsys, "export", "--to", "deepspeed").startswith(f"{CLI}: --model: ")


def test_the_error_contract_holds_in_a_real_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    path = plan_file(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "memplan.cli", "export", str(path), "--to", "megatron"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"memplan: error: {path}: plan.precision: megatron cannot express precision bf16-mixed: Megatron trains fp32, "
        "or bf16 / fp16 / fp8 parameters with fp32 main weights (--bf16, --fp16, --fp8-format); it has no autocast "
        "mode and no 16-bit-only optimizer states\n"
    )


@pytest.mark.parametrize("target", ["deepspeed", "accelerate", "torchtitan", "fsdp2"])
def test_a_plan_chosen_under_expandable_segments_says_what_to_set(tmp_path, capsys, monkeypatch, target):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    code, _, err = memplan(capsys, "export", plan_file(tmp_path, allocator="expandable"), "--to", target)
    assert code == 0, err
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in err
    code, _, err = memplan(capsys, "export", plan_file(tmp_path, allocator="default"), "--to", target)
    assert code == 0 and "PYTORCH_CUDA_ALLOC_CONF" not in err
