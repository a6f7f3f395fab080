"""The public Python API (``memplan.estimate``, ``memplan.tune``): the names it exports, a light
``import memplan``, results equal to what the commands print as JSON for the same inputs, and bad
input refused with the commands' own reasons."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import FunctionType

import pytest
import yaml
from typer.testing import CliRunner

import memplan
from memplan.cli.app import build_app, run
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "name": "tiny",
    "hidden_size": 128,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "ffn_size": 256,
    "vocab_size": 1000,
}


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each test in its own folder with its own (empty) calibration file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMPLAN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


def cli_json(*args: str) -> dict:
    """The command's ``--format json`` output, run through typer's CliRunner."""
    result = CliRunner().invoke(build_app(args[0]), [*args, "--format", "json"])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def cli_error(*args: str) -> str:
    """The one stderr line of a command refusing its input (exit code 2)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(list(args))
    assert code == 2, (out.getvalue(), err.getvalue())
    (line,) = err.getvalue().splitlines()
    return line


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_public_names():
    assert memplan.__all__ == ["EstimateResult", "MemplanError", "TuneResult", "estimate", "tune"]
    from memplan.api import estimate, tune
    from memplan.errors import MemplanError
    from memplan.estimation import EstimateResult
    from memplan.search.tuning import TuneResult

    assert (memplan.estimate, memplan.tune) == (estimate, tune)
    assert (memplan.EstimateResult, memplan.TuneResult, memplan.MemplanError) == (
        EstimateResult,
        TuneResult,
        MemplanError,
    )
    assert set(memplan.__all__) <= set(dir(memplan))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        memplan.nothing  # noqa: B018


LIGHT = textwrap.dedent(
    """
    import json, sys
    import memplan
    loaded = sorted(m for m in ("torch", "optuna", "triton", "pydantic", "memplan.api") if m in sys.modules)
    import memplan.cli.app, memplan.cli.estimate, memplan.cli.tune, memplan.estimation
    kinds = [type(memplan.estimate).__name__, type(memplan.tune).__name__]
    result = memplan.estimate("llama3-8b", gpu="h100-sxm")
    heavy = sorted(m for m in ("torch", "triton", "optuna") if m in sys.modules)
    print(json.dumps({"loaded": loaded, "kinds": kinds, "result": type(result).__name__, "heavy": heavy}))
    """
)


def test_import_memplan_is_light_and_estimate_stays_the_function():
    """In a fresh interpreter: ``import memplan`` loads none of torch, optuna, triton, pydantic or
    the API's module; after the commands' modules and the estimation module are imported,
    ``memplan.estimate`` is still the function (not the module of that name it once was)."""
    proc = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"loaded": [], "kinds": ["function", "function"], "result": "EstimateResult", "heavy": []}


def test_estimate_stays_the_function_in_process():
    import memplan.cli.estimate
    import memplan.estimation  # noqa: F401

    assert isinstance(memplan.estimate, FunctionType) and memplan.estimate.__module__ == "memplan.api"


def test_estimate_a_profile_name_equals_the_command():
    got = memplan.estimate(
        "llama3-8b", plan={"tp": 2, "zero": 1}, workload={"seq_len": 4096}, gpu="h100-sxm", gpus=8, runtime="megatron"
    )
    want = cli_json(
        "estimate", "llama3-8b", "--tp", "2", "--zero", "1", "--seq-len", "4096", "--gpu", "h100-sxm", "--gpus", "8",
        "--runtime", "megatron",
    )  # fmt: skip
    assert isinstance(got, memplan.EstimateResult)
    assert got.model_dump(mode="json") == want


def test_estimate_spec_objects_and_the_default_gpu_equal_a_plan_file(tmp_path: Path):
    """Plan and workload objects are read as a plan file holding the fields they were given (dp
    left to be derived from gpus); no GPU named: the command's default (auto)."""
    got = memplan.estimate(
        "llama3-8b", plan=Plan(tp=4, recompute="full"), workload=TrainingWorkload(micro_batch=2), gpus=8
    )
    plan = write_yaml(
        tmp_path / "p.yaml", {"gpus": 8, "plan": {"tp": 4, "recompute": "full"}, "workload": {"micro_batch": 2}}
    )
    assert got.plan["dp"] == 2
    assert got.model_dump(mode="json") == cli_json("estimate", "llama3-8b", "--plan", plan)


def test_estimate_serving_equals_the_command():
    got = memplan.estimate(
        "llama3-8b", plan={"tp": 2}, workload=InferenceWorkload(batch=8, block_size=16), gpu="a100-80gb"
    )
    want = cli_json(
        "estimate", "llama3-8b", "--inference", "--tp", "2", "--batch", "8", "--block-size", "16", "--gpu", "a100-80gb"
    )
    assert "weights_dtype" in got.plan and got.model_dump(mode="json") == want


@pytest.mark.parametrize("path", ["profiles/models/gemma2-9b.yaml", "tests/data/hf/llama2-7b.json"])
def test_estimate_a_path_equals_the_command(path: str):
    full = ROOT / path
    got = memplan.estimate(full, plan={"tp": 2}, gpu="h200", gpus=2, host_memory="64GiB")
    want = cli_json("estimate", str(full), "--tp", "2", "--gpu", "h200", "--gpus", "2", "--host-memory", "64GiB")
    assert got.model_dump(mode="json") == want


def test_estimate_a_dict_equals_the_command_on_its_yaml(tmp_path: Path):
    got = memplan.estimate(TINY, workload={"seq_len": 512, "micro_batch": 4}, gpu="h100-sxm", device="cpu")
    model = write_yaml(tmp_path / "tiny.yaml", TINY)
    want = cli_json("estimate", model, "--seq-len", "512", "--micro-batch", "4", "--gpu", "h100-sxm", "--device", "cpu")
    assert got.model_dump(mode="json") == want


def test_estimate_a_transformers_config_equals_the_command_on_its_config_json(tmp_path: Path):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=4096, name_or_path="tiny-llama",
    )  # fmt: skip
    got = memplan.estimate(config, plan={"precision": "bf16-mixed"}, gpu="h100-sxm")
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    want = cli_json("estimate", str(tmp_path / "config.json"), "--precision", "bf16-mixed", "--gpu", "h100-sxm")
    assert got.model["name"] == "tiny-llama" and got.model["architecture"] == "llama"
    assert got.model_dump(mode="json") == want


def test_an_unknown_profile_is_the_commands_error():
    with pytest.raises(memplan.MemplanError) as err:
        memplan.estimate("llama3-9b")
    assert err.value.source == "llama3-9b" and "bundled model profile" in err.value.reason
    assert cli_error("estimate", "llama3-9b") == f"memplan: error: {err.value}"


def test_an_unknown_plan_field_is_the_commands_error(tmp_path: Path):
    with pytest.raises(memplan.MemplanError) as err:
        memplan.estimate("llama3-8b", plan={"tp": 2, "tpp": 2}, gpu="h100-sxm")
    assert str(err.value) == "plan.tpp: unknown field" and err.value.field == "plan.tpp"
    plan = write_yaml(tmp_path / "p.yaml", {"plan": {"tp": 2, "tpp": 2}})
    assert (
        cli_error("estimate", "llama3-8b", "--plan", plan, "--gpu", "h100-sxm")
        == f"memplan: error: {plan}: {err.value}"
    )


def test_an_unknown_model_field_is_the_commands_error(tmp_path: Path):
    with pytest.raises(memplan.MemplanError) as err:
        memplan.estimate({**TINY, "hidden_sise": 64})
    assert str(err.value) == "model: hidden_sise: unknown field"
    model = write_yaml(tmp_path / "tiny.yaml", {**TINY, "hidden_sise": 64})
    assert cli_error("estimate", model) == f"memplan: error: {model}: hidden_sise: unknown field"


@pytest.mark.parametrize(
    ("kwargs", "section", "message"),
    [
        (
            {"plan": {"tp": 3}, "gpus": 8},
            {"plan": {"tp": 3}, "gpus": 8},
            "gpus: 8 GPUs is not a multiple of tp x pp x cp = 3",
        ),  # fmt: skip
        ({"plan": {"tp": 3}}, {"plan": {"tp": 3}}, "plan.tp: tp=3 does not divide num_attention_heads=32 of llama3-8b"),
        (
            {"workload": {"seq_len": 0}},
            {"workload": {"seq_len": 0}},
            "workload.seq_len: Input should be greater than 0",
        ),
    ],
)
def test_an_impossible_plan_is_the_commands_error(tmp_path: Path, kwargs: dict, section: dict, message: str):
    with pytest.raises(memplan.MemplanError) as err:
        memplan.estimate("llama3-8b", gpu="h100-sxm", **kwargs)
    assert str(err.value) == message
    plan = write_yaml(tmp_path / "p.yaml", section)
    assert (
        cli_error("estimate", "llama3-8b", "--plan", plan, "--gpu", "h100-sxm") == f"memplan: error: {plan}: {message}"
    )


def test_bad_argument_types_are_errors_naming_the_argument():
    with pytest.raises(memplan.MemplanError, match=r"^model: expected a profile name"):
        memplan.estimate(42)
    with pytest.raises(memplan.MemplanError, match=r"^plan: expected a mapping of fields"):
        memplan.estimate("llama3-8b", plan=[2])
    with pytest.raises(memplan.MemplanError, match=r"^gpu: unknown GPU 'h900'"):
        memplan.estimate("llama3-8b", gpu="h900")
    with pytest.raises(memplan.MemplanError, match=r"^host_memory: must be a positive size"):
        memplan.estimate("llama3-8b", gpu="h100-sxm", host_memory=0)
    with pytest.raises(memplan.MemplanError, match=r"^device: unknown device"):
        memplan.estimate("llama3-8b", device="tpu")  # type: ignore[arg-type]


def test_tune_equals_what_the_command_reports(tmp_path: Path):
    """An exhaustive search of a tiny model on two GPUs: the same plans, ranked the same, the
    same recommendation (the command also writes it to a plan file: ``plan_path``)."""
    flags = dict(gpus=2, gpu="h100-sxm", seq_len=1024, max_micro_batch=4, exhaustive=True, top=3)
    got = memplan.tune(TINY, **flags, workdir=tmp_path / "api")
    assert isinstance(got, memplan.TuneResult) and got.recommended is not None and got.plan_path is None
    model = write_yaml(tmp_path / "tiny.yaml", TINY)
    want = cli_json(
        "tune", model, "--gpus", "2", "--gpu", "h100-sxm", "--seq-len", "1024", "--max-micro-batch", "4",
        "--exhaustive", "--top", "3", "--workdir", str(tmp_path / "cli"),
    )  # fmt: skip
    assert want.pop("plan_path") == str(tmp_path / "cli" / "best-plan.yaml")
    data = got.model_dump(mode="json")
    assert data.pop("plan_path") is None
    assert data == want and data["recommended"] == want["top"][0]
    assert not (tmp_path / "api").exists()  # an exhaustive search writes nothing


def test_tune_bad_input_is_the_commands_reason_naming_the_keyword():
    with pytest.raises(memplan.MemplanError) as err:
        memplan.tune("llama3-8b", gpus=8, gpu="h100-sxm", margin="200%")
    assert err.value.field == "margin" and str(err.value) == "margin: '200%' must leave part of the GPU's capacity"
    line = cli_error("tune", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--margin", "200%")
    assert line == f"memplan: error: command line: --margin: {err.value.reason}"
    with pytest.raises(memplan.MemplanError, match=r"^gpus: must be a whole number >= 1, got an integer \(0\)"):
        memplan.tune("llama3-8b", gpus=0)
    with pytest.raises(memplan.MemplanError, match=r"^objective: unknown"):
        memplan.tune("llama3-8b", gpus=8, objective="speed")


def test_the_keywords_checks_agree_with_the_search():
    """The choices the keywords are checked against are the ones the search itself takes."""
    import typing

    from memplan.api import _CHOICES
    from memplan.search.evaluate import Objective
    from memplan.search.validation import ValidationSettings

    assert _CHOICES["objective"] == typing.get_args(Objective)
    assert _CHOICES["validate_device"] == typing.get_args(typing.get_type_hints(ValidationSettings)["device"])
