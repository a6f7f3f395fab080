"""Issue 20, "hidden defaults and stray files": every option's default in ``--help``, the settings
a report depends on in its header (a training step's or a serving batch's, never the other's),
one default precision for training across commands, the flag the user gave blamed for a value
derived from it, the ``--gpu auto`` line in every command's JSON, and ``tune`` writing only under
a working directory it names, never over a file git tracks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml

from memplan.cli.app import COMMANDS, build_app, run
from memplan.cli.options import DEFAULT_PRECISION
from memplan.specs import detect
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

CLI = "command line"
NO_GPU = "gpu h100-sxm (default: no GPU detected, nvidia-ml-py not installed)"
# options whose absence means "not done" (no file read or written, no target): nothing to default to
NOTHING_TO_DEFAULT = {"plan", "timeline", "out", "snapshot", "output", "baseline", "junit", "summary", "export", "to"}


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMPLAN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)  # no NVML: the h100-sxm default, said
    monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name: None)


def memplan(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- --help ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_with_a_value_says_its_default(name: str):
    """An option that takes a value shows typer's [default: ...] or says "default" in its help,
    unless leaving it out means nothing is read or written; on/off flags are off unless given."""
    command = typer.main.get_command(build_app(name)).commands[name]
    silent = []
    for p in command.params:
        if p.param_type_name != "option" or p.name == "help" or p.name in NOTHING_TO_DEFAULT:
            continue
        if getattr(p, "is_flag", False) and not p.secondary_opts:
            continue  # --inference, --force, ...: off unless given
        if "default" not in (p.help or "").lower() and not (p.show_default and p.default is not None):
            silent.append(p.name)
    assert silent == []


@pytest.mark.parametrize("name", ["estimate", "validate", "export"])
def test_help_shows_the_specs_defaults(capsys, name: str):
    code, out, _ = memplan(capsys, name, "--help")
    assert code == 0
    text = " ".join(out.split())
    seq_len, micro_batch = (TrainingWorkload.model_fields[k].default for k in ("seq_len", "micro_batch"))
    assert (seq_len, micro_batch) == (2048, 1)
    assert f"tokens per sequence (default: {seq_len})" in text
    assert f"sequences per micro-batch (default: {micro_batch})" in text
    assert f"(default: {Plan.model_fields['precision'].default}; bf16 under --runtime hf or hf-loop)" in text
    assert "ZeRO stage 0-3 (default: 0)" in text and "(default: none)" in text


def test_estimate_help_shows_runtime_device_and_inference_defaults(capsys):
    _, out, _ = memplan(capsys, "estimate", "--help")
    text = " ".join(out.split())
    assert "(default: memplan; hf for lora and qlora)" in text  # runtime
    assert "[default: cuda]" in text  # device
    assert "auto: the GPU NVML detects here (the default; h100-sxm when none)" in text
    kv, batch = InferenceWorkload.model_fields["kv_dtype"].default, InferenceWorkload.model_fields["batch"].default
    assert f"int8 (default: {kv})" in text and f"concurrent sequences (default: {batch})" in text


# --- one default precision ---------------------------------------------------------------------


def test_one_default_precision_for_training(capsys, tmp_path: Path):
    """estimate, tune (its search and the plan file it writes), validate and check all train in
    the plan's default precision unless told otherwise."""
    assert DEFAULT_PRECISION == Plan.model_fields["precision"].default == "bf16-master"
    _, out, _ = memplan(capsys, "estimate", "llama3-8b", "--format", "json")
    assert json.loads(out)["plan"]["precision"] == DEFAULT_PRECISION
    code, out, err = memplan(capsys, "tune", "llama3-8b", "--gpus", "8", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert {r["evaluation"]["plan"]["precision"] for r in data["top"]} == {DEFAULT_PRECISION}
    assert yaml.safe_load(Path(data["plan_path"]).read_text())["plan"]["precision"] == DEFAULT_PRECISION
    _, out, _ = memplan(capsys, "tune", "--help")
    assert f"Default: {DEFAULT_PRECISION}, as memplan estimate and plan files" in " ".join(out.split())
    budgets = tmp_path / "b.yaml"
    budgets.write_text(yaml.safe_dump({"entries": [{"name": "a", "model": "llama3-8b", "gpus": 8, "budget": "80GiB"}]}))
    code, out, err = memplan(capsys, "check", str(budgets), "--format", "json")
    assert code == 1, err  # llama3-8b without ZeRO does not fit 80 GiB: the verdict, not an error
    assert json.loads(out)["entries"][0]["plan"] == f"dp=8 zero=0 {DEFAULT_PRECISION}"


@pytest.mark.parametrize("finetune", ["lora", "qlora"])
def test_fine_tuning_defaults_to_the_trainers_recipe_answered_op_level(capsys, finetune: str):
    """Fine-tuning defaults to transformers' Trainer (``--runtime hf``), which keeps no fp32 masters:
    its default precision is its usual recipe, ``bf16`` (a bfloat16 model under ``bf16=True``, as
    ``memplan export --to hf-trainer`` writes it), shown in the resolved plan and the header, and the
    op-level run of the Trainer answers it. ``bf16-master`` given explicitly is declined with why."""
    code, out, err = memplan(capsys, "estimate", "llama3-8b", "--finetune", finetune, "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["precision"] == "bf16" and data["plan"]["runtime"] == "hf"
    assert data["memory"]["model"] == "op-level" and data["memory"]["model_reason"] is None
    code, out, err = memplan(capsys, "estimate", "llama3-8b", "--finetune", finetune)
    assert code == 0, err
    assert {"precision=bf16", "runtime=hf"} <= set(out.splitlines()[0].split())
    code, out, err = memplan(
        capsys, "estimate", "llama3-8b", "--finetune", finetune, "--precision", "bf16-master", "--format", "json"
    )
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert memory["model"] == "phase" and "DeepSpeed's" in memory["model_reason"]


# --- the report header -------------------------------------------------------------------------


def test_training_header_shows_the_workload_and_its_defaults(capsys):
    code, out, err = memplan(capsys, "estimate", "llama3-8b", "--gpus", "8")
    assert code == 0, err
    first = out.splitlines()[0]
    assert "seq_len=2048 micro_batch=1 global_batch=8" in first
    assert "zero=0 recompute=none precision=bf16-master runtime=memplan" in first
    assert out.splitlines()[1] == NO_GPU  # the device: which GPU, and why that one
    _, out, _ = memplan(capsys, "estimate", "llama3-8b", "--seq-len", "4096", "--micro-batch", "2")
    assert "seq_len=4096 micro_batch=2 global_batch=2" in out.splitlines()[0]


def test_inference_header_shows_serving_settings_only(capsys):
    code, out, err = memplan(
        capsys, "estimate", "llama3-8b", "--inference", "--batch", "8", "--context", "4096", "--kv-dtype", "fp8"
    )
    assert code == 0, err
    first = out.splitlines()[0]
    assert "inference: batch=8 prompt=4096 generated=0 (context 4096) weights=bf16 kv_dtype=fp8" in first
    for training in ("zero=", "recompute=", "precision=", "runtime=", "seq_len=", "micro_batch=", "bf16-master"):
        assert training not in first, training
    _, out, _ = memplan(capsys, "estimate", "llama3-8b", "--inference", "--block-size", "16", "--precision", "fp32")
    assert "prompt=2048 generated=256 (context 2304) weights=fp32 kv_dtype=bf16 block_size=16" in out.splitlines()[0]


def test_inference_json_plan_has_no_training_settings(capsys):
    _, out, _ = memplan(capsys, "estimate", "llama3-8b", "--inference", "--format", "json")
    plan = json.loads(out)["plan"]
    assert plan["kind"] == "inference" and plan["weights_dtype"] == "bf16" and plan["kv_dtype"] == "bf16"
    for training in ("zero", "optimizer", "recompute", "runtime", "offload_optimizer", "finetune", "seq_len"):
        assert training not in plan, training
    _, out, _ = memplan(capsys, "estimate", "llama3-8b", "--inference", "--precision", "fp8", "--format", "json")
    assert json.loads(out)["plan"]["weights_dtype"] == "fp8"


# --- the flag the user gave is the one blamed --------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["estimate", "llama3-8b", "--gpus", "10000000"],
        ["estimate", "llama3-8b", "--gpus", "10000000", "--tp", "2"],
        ["validate", "llama3-8b", "--gpus", "10000000"],
        ["tune", "llama3-8b", "--gpus", "10000000"],  # 1,250,000 nodes of 8
        ["tune", "llama3-8b", "--gpus", "9999999"],  # one node of 9,999,999
    ],
)
def test_too_many_gpus_blames_gpus(capsys, args: list[str]):
    code, out, err = memplan(capsys, *args)
    assert code == 2 and out == ""
    line = error_line(err)
    assert line.startswith(f"memplan: error: {CLI}: --gpus: {args[args.index('--gpus') + 1]} GPUs make "), line
    assert "--dp" not in line and "--nodes" not in line


def test_too_many_gpus_per_given_node_blames_nodes(capsys):
    code, _, err = memplan(capsys, "tune", "llama3-8b", "--gpus", "10000000", "--nodes", "2")
    assert code == 2
    assert error_line(err) == (
        f"memplan: error: {CLI}: --nodes: 5000000 GPUs per node; gpus per node: Input should be less than or equal "
        "to 1024"
    )


@pytest.mark.parametrize("runtime", ["megatron", "hf", "memplan"])
def test_inference_refuses_a_runtime(capsys, runtime: str):
    """A runtime profile is one training code's activation accounting; serving memory has one model."""
    code, out, err = memplan(capsys, "estimate", "llama3-8b", "--inference", "--runtime", runtime)
    assert code == 2 and out == ""
    assert error_line(err) == (
        f"memplan: error: {CLI}: --runtime: a training setting: --inference estimates serving memory, which does "
        "not depend on it (drop it)"
    )


# --- the --gpu auto line in every command's JSON -----------------------------------------------


def test_tune_json_says_which_gpu_and_why(capsys):
    code, out, err = memplan(capsys, "tune", "llama3-8b", "--gpus", "8", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["gpu_auto"] == NO_GPU
    code, out, err = memplan(capsys, "tune", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["gpu_auto"] is None  # named: nothing detected, nothing to say


TINY = {"name": "tiny", "hidden_size": 64, "num_layers": 1, "num_attention_heads": 2, "num_kv_heads": 2,
        "ffn_size": 128, "vocab_size": 256}  # fmt: skip


def test_validate_json_says_which_gpu_and_why(capsys, tmp_path: Path):
    pytest.importorskip("torch")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    args = ["validate", "tiny.yaml", "--precision", "fp32", "--seq-len", "32", "--steps", "1", "--device", "cpu"]
    code, out, err = memplan(capsys, *args, "--format", "json")
    assert code == 0, err
    assert json.loads(out)["gpu_auto"] == NO_GPU


# --- tune's working directory ------------------------------------------------------------------


def test_tune_writes_only_under_the_working_directory_it_names(capsys, tmp_path: Path):
    code, out, err = memplan(capsys, "tune", "llama3-8b", "--gpus", "8", "--trials", "2", "--no-exhaustive")
    assert code == 0, err
    work = Path("memplan-tune/llama3-8b-8xh100-sxm")
    assert f"written to {work / 'best-plan.yaml'}" in out and f"sqlite:///{work / 'study.db'}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memplan-tune"]
    names = {p.name for p in work.iterdir()}  # SQLite's -wal and -shm beside the study while it is open
    assert {"best-plan.yaml", "study.db"} <= names and all(n.startswith(("best-plan.", "study.db")) for n in names)
    code, out, err = memplan(capsys, "tune", "llama3-8b", "--gpus", "8", "--workdir", "here", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["plan_path"] == "here/best-plan.yaml" and Path("here/best-plan.yaml").is_file()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("flag", ["--out", "--workdir"])
def test_tune_never_writes_over_a_tracked_file(capsys, tmp_path: Path, flag: str):
    plan = Path("memplan-tune/llama3-8b-8xh100-sxm/best-plan.yaml")
    plan.parent.mkdir(parents=True)
    plan.write_text("# mine\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "mine"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    args = ["tune", "llama3-8b", "--gpus", "8"] + (["--out", str(plan)] if flag == "--out" else [])
    code, out, err = memplan(capsys, *args)
    assert code == 2 and out == ""
    assert error_line(err) == (
        f"memplan: error: {CLI}: {flag}: {plan}: a file git tracks: tune does not write over it; give another path"
    )
    assert plan.read_text() == "# mine\n" and not (plan.parent / "study.db").exists()
    code, _, err = memplan(capsys, *args[:4], "--out", "untracked.yaml")  # an untracked file is fine
    assert code == 0, err


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_tune_export_never_writes_over_a_tracked_file(capsys):
    Path("x-torchtitan.py").write_text("# mine\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "mine"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    code, _, err = memplan(capsys, "tune", "llama3-8b", "--gpus", "8", "--out", "x.yaml", "--export", "torchtitan")
    assert code == 2
    assert error_line(err) == (
        f"memplan: error: {CLI}: --export: x-torchtitan.py: a file git tracks: tune does not write over it; give "
        "another path (the plan YAML is in x.yaml)"
    )
    assert Path("x-torchtitan.py").read_text() == "# mine\n" and Path("x.yaml").is_file()
