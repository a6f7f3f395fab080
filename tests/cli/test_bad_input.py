"""Bad input through the real command (a subprocess, as a user runs it).

Every user mistake must end the same way: exit code 2, nothing on stdout, exactly one line on
stderr, ``memplan: error: SOURCE: FIELD: reason``, no traceback. ``MEMPLAN_DEBUG=1`` is the one
way to get the traceback.

Which run holds which case (the default suite's time: a subprocess costs ~0.5 s of CPU, mostly
the interpreter's start and the CLI's imports): a test with one case runs the real command in the
default run. A parametrized test's cases run twice: by default in this process (``run(argv)``, the
function ``python -m memplan.cli`` calls, under the same working directory and environment, stdout
and stderr captured), and under ``-m slow`` through the real command, each with the same
assertions (:func:`pytest_generate_tests` adds the ``via`` parameter).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memplan.cli.app import run

PREFIX = "memplan: error: "
CLI = "command line"
DROP = object()  # a value that removes the key from a model mapping

SMALL_MODEL = {
    "name": "small",
    "hidden_size": 768,
    "num_layers": 12,
    "num_attention_heads": 12,
    "num_kv_heads": 4,
    "ffn_size": 2048,
    "vocab_size": 32000,
}
HF_LLAMA = json.loads((Path(__file__).parents[1] / "data" / "hf" / "llama3-8b.json").read_text())
HF_MIXTRAL = json.loads((Path(__file__).parents[1] / "data" / "hf" / "mixtral-8x7b.json").read_text())


def _env(debug: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    env["COLUMNS"] = "200"
    if debug:
        env["MEMPLAN_DEBUG"] = "1"
    return env


_VIA = {"mode": "subprocess"}  # set per test by the ``via`` fixture


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A parametrized test's cases: in this process by default, through the real command under -m slow."""
    if metafunc.definition.get_closest_marker("parametrize") is not None:
        metafunc.parametrize("via", ["in-process", pytest.param("subprocess", marks=pytest.mark.slow)], indirect=True)


@pytest.fixture(autouse=True)
def via(request: pytest.FixtureRequest) -> Iterator[str]:
    """How :func:`memplan` runs the command in this test: ``subprocess`` unless parametrized."""
    _VIA["mode"] = getattr(request, "param", "subprocess")
    yield _VIA["mode"]
    _VIA["mode"] = "subprocess"


def memplan(*args: object, cwd: Path, debug: bool = False) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "memplan.cli", *map(str, args)]
    if _VIA["mode"] == "in-process":
        with _environment(cwd, _env(debug)):
            code, out, err = _run_in_process(argv[3:])
        return subprocess.CompletedProcess(argv, code, out, err)
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=_env(debug), timeout=60)


@contextmanager
def _environment(cwd: Path, env: dict[str, str]) -> Iterator[None]:
    """The subprocess's working directory and environment, for a run in this process."""
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)


def error_line(
    proc: subprocess.CompletedProcess[str], source: object, field: str | None = None, *reason_parts: str
) -> str:
    """Check the one-line error contract; return the text after ``memplan: error: ``."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "", proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, f"not one line: {proc.stderr!r}"
    line = proc.stderr.rstrip("\n")
    assert line.startswith(PREFIX), line
    message = line[len(PREFIX) :]
    head = f"{source}: {field}: " if field else f"{source}: "
    assert message.startswith(head), f"expected {head!r} at the start of {message!r}"
    reason = message[len(head) :]
    assert reason.strip(), f"no reason in {message!r}"
    assert "internal error" not in reason
    for part in reason_parts:
        assert part in reason, f"{part!r} not in {reason!r}"
    return message


def write_model(tmp_path: Path, filename: str = "model.yaml", **changes: object) -> Path:
    data = {**SMALL_MODEL, **changes}
    data = {k: v for k, v in data.items() if v is not DROP}
    path = tmp_path / filename
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_json(tmp_path: Path, data: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------------------------------------
# where the model comes from


def test_missing_model_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    proc = memplan("estimate", missing, cwd=tmp_path)
    error_line(proc, missing, None, "no such file")


def test_missing_model_file_relative_name_is_shown_as_given(tmp_path):
    proc = memplan("estimate", "models/nope.json", cwd=tmp_path)
    error_line(proc, "models/nope.json", None, "no such file")


def test_unknown_profile_name(tmp_path):
    proc = memplan("estimate", "llama9-8b", cwd=tmp_path)
    message = error_line(proc, "llama9-8b", None, "bundled")
    assert "llama3-8b" in message  # the bundled names are listed


def test_model_argument_missing(tmp_path):
    error_line(memplan("estimate", cwd=tmp_path), CLI, "MODEL", "missing")


# ---------------------------------------------------------------------------------------------
# malformed files


def test_malformed_yaml_model_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("name: small\nhidden_size: [768,\nnum_layers: 12\n")
    error_line(memplan("estimate", path, cwd=tmp_path), path, None, "malformed YAML", "line")


def test_malformed_yaml_plan_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("plan:\n  tp: 2\n   pp: 2\n")
    error_line(memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path), path, None, "malformed YAML", "line")


def test_malformed_json_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,,}')
    error_line(memplan("estimate", path, cwd=tmp_path), path, None, "malformed JSON", "line 1")


def test_model_file_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("- hidden_size\n- 768\n")
    error_line(memplan("estimate", path, cwd=tmp_path), path, None, "expected a mapping")


def test_model_path_is_a_directory_without_config(tmp_path):
    folder = tmp_path / "weights.json"
    folder.mkdir()
    error_line(memplan("estimate", folder, cwd=tmp_path), folder, None, "cannot read")


# ---------------------------------------------------------------------------------------------
# model fields


def test_unknown_field_in_model_yaml(tmp_path):
    path = write_model(tmp_path, hiden_size=768)
    error_line(memplan("estimate", path, cwd=tmp_path), path, "hiden_size", "unknown field")


@pytest.mark.parametrize("field", ["hidden_size", "num_layers", "num_attention_heads", "ffn_size", "vocab_size"])
def test_missing_required_model_field(tmp_path, field):
    path = write_model(tmp_path, **{field: DROP})
    error_line(memplan("estimate", path, cwd=tmp_path), path, field, "required")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("hidden_size", 0, "greater than 0"),
        ("num_layers", -1, "greater than 0"),
        ("num_attention_heads", 0, "greater than 0"),
        ("num_kv_heads", -4, "greater than 0"),
        ("vocab_size", 10**12, "less than or equal"),
        ("hidden_size", 10**9, "less than or equal"),
        ("num_layers", 10**6, "less than or equal"),
        ("hidden_size", "abc", "valid integer"),
        ("num_layers", 12.5, "integer"),
        ("num_layers", [12], "integer"),
        ("mlp", "swiglu", "'gated'"),
        ("norm", "batchnorm", "'rmsnorm'"),
        ("tied_embeddings", "sometimes", "boolean"),
    ],
)
def test_bad_model_value(tmp_path, field, value, reason):
    path = write_model(tmp_path, **{field: value})
    error_line(memplan("estimate", path, cwd=tmp_path), path, field, reason)


def test_heads_not_divisible_by_kv_heads(tmp_path):
    path = write_model(tmp_path, num_attention_heads=12, num_kv_heads=5)
    error_line(memplan("estimate", path, cwd=tmp_path), path, "num_kv_heads", "not a multiple")


def test_hidden_not_divisible_by_heads(tmp_path):
    path = write_model(tmp_path, hidden_size=770)
    error_line(memplan("estimate", path, cwd=tmp_path), path, "hidden_size", "head_dim")


def test_moe_top_k_above_num_experts(tmp_path):
    path = write_model(tmp_path, moe={"num_experts": 4, "top_k": 8, "expert_ffn_size": 1024})
    error_line(memplan("estimate", path, cwd=tmp_path), path, "moe.top_k", "exceeds num_experts")


def test_moe_unknown_field(tmp_path):
    path = write_model(tmp_path, moe={"num_experts": 4, "top_k": 2, "expert_ffn_size": 1024, "experts": 4})
    error_line(memplan("estimate", path, cwd=tmp_path), path, "moe.experts", "unknown field")


def test_moe_dense_layer_out_of_range(tmp_path):
    path = write_model(tmp_path, moe={"num_experts": 4, "top_k": 2, "expert_ffn_size": 1024, "dense_layers": [40]})
    error_line(memplan("estimate", path, cwd=tmp_path), path, "moe.dense_layers", "outside")


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def test_unsupported_hf_architecture(tmp_path):
    path = write_json(
        tmp_path,
        {
            "architectures": ["BertForMaskedLM"],
            "model_type": "bert",
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "vocab_size": 30522,
        },
    )
    message = error_line(
        memplan("estimate", path, cwd=tmp_path), path, "architectures", "unsupported", "BertForMaskedLM"
    )
    assert "LlamaForCausalLM" in message  # what is supported


def test_unknown_hf_model_type(tmp_path):
    path = write_json(tmp_path, {"model_type": "bert", "hidden_size": 768})
    error_line(memplan("estimate", path, cwd=tmp_path), path, "model_type", "bert")


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"])
def test_hf_config_missing_required_field(tmp_path, key):
    cfg = {k: v for k, v in HF_LLAMA.items() if k != key}
    path = write_json(tmp_path, cfg)
    error_line(memplan("estimate", path, cwd=tmp_path), path, key, "LlamaForCausalLM", "missing")


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("num_hidden_layers", 0, "greater than 0"),  # the error names the config.json key, not num_layers
        ("hidden_size", "big", "integer"),
        ("num_key_value_heads", 5, "not a multiple"),
        ("vocab_size", 10**12, "less than or equal"),
    ],
)
def test_hf_config_bad_value_names_the_config_key(tmp_path, key, value, reason):
    path = write_json(tmp_path, {**HF_LLAMA, key: value})
    error_line(memplan("estimate", path, cwd=tmp_path), path, key, reason)


def test_hf_moe_top_k_above_num_experts(tmp_path):
    path = write_json(tmp_path, {**HF_MIXTRAL, "num_local_experts": 4, "num_experts_per_tok": 8})
    error_line(memplan("estimate", path, cwd=tmp_path), path, "num_experts_per_tok", "exceeds num_experts")


# ---------------------------------------------------------------------------------------------
# impossible plans from flags: the error names the flag


@pytest.mark.parametrize(
    ("args", "flag", "reason"),
    [
        (["llama3-8b", "--tp", "3"], "--tp", "num_attention_heads=32"),
        (["{small}", "--tp", "6"], "--tp", "num_kv_heads=4"),  # 12 heads split by 6, 4 KV heads not
        (["llama3-8b", "--pp", "5"], "--pp", "num_layers=32"),
        (["llama3-8b", "--pp", "4", "--pp-schedule", "interleaved", "--virtual-stages", "3"], "--pp", "num_layers"),
        (["llama3-8b", "--gpus", "8", "--global-batch", "12", "--micro-batch", "1"], "--global-batch", "1 x 8"),
        (["llama3-8b", "--offload-params", "cpu", "--zero", "2"], "--offload-params", "zero: 3"),
        (["llama3-8b", "--offload-params", "nvme"], "--offload-params", "zero: 3"),
        (["llama3-8b", "--offload-optimizer", "cpu", "--zero", "0"], "--offload-optimizer", "zero >= 1"),
        (["llama3-8b", "--virtual-stages", "2"], "--virtual-stages", "interleaved"),
        (["llama3-8b", "--pp", "2", "--pp-schedule", "interleaved"], "--virtual-stages", ">= 2"),
        (
            [
                "llama3-8b",
                "--gpus",
                "16",
                "--pp",
                "2",
                "--pp-schedule",
                "interleaved",
                "--virtual-stages",
                "2",
                "--global-batch",
                "24",
            ],
            "--global-batch",
            "divisible by pp=2",
        ),
        # no global batch: one micro-batch a step, which the interleaved schedule cannot split (was an IndexError)
        (["llama3-8b", "--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2"], "--global-batch", "(1)"),
        (["llama3-8b", "--ep", "2"], "--ep", "ep=2"),
        (["llama3-8b", "--gpus", "8", "--ep", "2"], "--ep", "no experts"),
        (["mixtral-8x7b", "--gpus", "8", "--ep", "3"], "--ep", "ep=3"),
        (["mixtral-8x7b", "--gpus", "48", "--ep", "16"], "--ep", "num_experts=8"),
        (["llama3-8b", "--cp", "3", "--seq-len", "4096"], "--cp", "seq_len=4096"),
        (["llama3-8b", "--sequence-parallel", "--tp", "8", "--seq-len", "4100"], "--sequence-parallel", "tp=8"),
        (["llama3-8b", "--recompute-layers", "4"], "--recompute-layers", "recompute: full"),
        (["llama3-8b", "--gpus", "8", "--tp", "3"], "--gpus", "tp x pp x cp = 3"),
        (["llama3-8b", "--gpus", "8", "--dp", "2"], "--gpus", "= 2"),
        (["llama3-8b", "--gpus", "8", "--nodes", "3"], "--nodes", "3 nodes"),
        (["llama3-8b", "--gpus", "2050", "--tp", "2"], "--gpus", "--nodes"),
        (["llama3-8b", "--batch", "8"], "--batch", "--inference"),
        (["llama3-8b", "--context", "4096"], "--context", "--inference"),
        (["llama3-8b", "--inference", "--seq-len", "4096"], "--seq-len", "training"),
        (["llama3-8b", "--inference", "--context", "0"], "--context", "greater than 0"),
    ],
)
def test_impossible_plan_from_flags(tmp_path, args, flag, reason):
    small = write_model(tmp_path, "small.yaml")
    argv = [a.format(small=small) for a in args]
    error_line(memplan("estimate", *argv, cwd=tmp_path), CLI, flag, reason)


# ---------------------------------------------------------------------------------------------
# impossible plans and bad fields from a plan file: the error names the file and the field path


@pytest.mark.parametrize(
    ("plan", "field", "reason"),
    [
        ({"plan": {"tp": 3}}, "plan.tp", "num_attention_heads"),
        ({"plan": {"pp": 5}}, "plan.pp", "num_layers"),
        ({"plan": {"zero": 2, "offload_params": "cpu"}}, "plan.offload_params", "zero: 3"),
        ({"plan": {"zero": 0, "offload_optimizer": "cpu"}}, "plan.offload_optimizer", "zero >= 1"),
        ({"plan": {"virtual_stages": 2}}, "plan.virtual_stages", "interleaved"),
        ({"gpus": 8, "plan": {"ep": 2}}, "plan.ep", "no experts"),
        ({"plan": {"cp": 3}, "workload": {"seq_len": 4096}}, "plan.cp", "seq_len"),
        ({"gpus": 8, "workload": {"global_batch": 12}}, "workload.global_batch", "micro_batch x dp"),
        ({"gpus": 8, "plan": {"tp": 3}}, "gpus", "tp x pp x cp = 3"),
        ({"gpus": 8, "nodes": 3}, "nodes", "3 nodes"),
        ({"gpus": 0}, "gpus", "greater than 0"),
        ({"plan": {"tp": 0}}, "plan.tp", "greater than 0"),
        ({"plan": {"tp": "two"}}, "plan.tp", "integer"),
        ({"gpus": 8, "plan": {"tp": "two"}}, "plan.tp", "integer"),
        ({"plan": {"zero": 4}}, "plan.zero", "less than or equal to 3"),
        ({"plan": {"precision": "fp7"}}, "plan.precision", "'bf16-master'"),
        ({"plan": {"recompute": "sometimes"}}, "plan.recompute", "'selective'"),
        ({"plan": {"tp": 1, "tensor_parallel": 2}}, "plan.tensor_parallel", "unknown field"),
        ({"plna": {"tp": 1}}, "plna", "unknown field"),
        ({"plan": "tp=2"}, "plan", "dictionary"),
        ({"workload": {"kind": "finetune"}}, "workload.kind", "unknown kind"),
        ({"workload": {"seq_length": 4096}}, "workload.seq_length", "unknown field"),
        ({"workload": {"kind": "inference", "seq_len": 4096}}, "workload.seq_len", "inference"),
        ({"workload": {"seq_len": 0}}, "workload.seq_len", "greater than 0"),
        ({"gpu": "h900"}, "gpu", "unknown GPU"),
        ({"runtime": "deepspeed"}, "runtime", "'memplan'"),
    ],
)
def test_bad_plan_file(tmp_path, plan, field, reason):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    error_line(memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path), path, field, reason)


def test_plan_file_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("- tp: 2\n")
    error_line(memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path), path, None, "expected a mapping")


def test_missing_plan_file(tmp_path):
    path = tmp_path / "plan.yaml"
    error_line(memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path), path, None, "no such file")


def test_flag_error_blames_the_flag_not_the_plan_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"plan": {"zero": 1}}))
    proc = memplan("estimate", "llama3-8b", "--plan", path, "--tp", "3", cwd=tmp_path)
    error_line(proc, CLI, "--tp", "num_attention_heads")


# ---------------------------------------------------------------------------------------------
# bad flag values


@pytest.mark.parametrize(
    ("args", "flag", "reason"),
    [
        (["--tp", "abc"], "--tp", "integer"),
        (["--tp", "0"], "--tp", "greater than 0"),
        (["--tp", "-2"], "--tp", "greater than 0"),
        (["--pp", "1.5"], "--pp", "integer"),
        (["--zero", "4"], "--zero", "less than or equal to 3"),
        (["--precision", "fp7"], "--precision", "'bf16-master'"),
        (["--recompute", "sometimes"], "--recompute", "'selective'"),
        (["--optimizer", "lion"], "--optimizer", "'adamw'"),
        (["--attention", "sparse"], "--attention", "'flash'"),
        (["--pp-schedule", "zb"], "--pp-schedule", "'1f1b'"),
        (["--offload-optimizer", "disk", "--zero", "1"], "--offload-optimizer", "'cpu'"),
        (["--runtime", "deepspeed"], "--runtime", "memplan"),
        (["--format", "xml"], "--format", "xml"),
        (["--gpus", "0"], "--gpus", "greater than 0"),
        (["--gpus", "-8"], "--gpus", "greater than 0"),
        (["--nodes", "0"], "--nodes", "greater than 0"),
        (["--seq-len", "0"], "--seq-len", "greater than 0"),
        (["--seq-len", "1000000000"], "--seq-len", "less than or equal"),
        (["--micro-batch", "0"], "--micro-batch", "greater than 0"),
        (["--global-batch", "0"], "--global-batch", "greater than 0"),
        (["--inference", "--kv-dtype", "fp7"], "--kv-dtype", "'bf16'"),
        (["--inference", "--batch", "0"], "--batch", "greater than 0"),
        (["--inference", "--block-size", "0"], "--block-size", "greater than 0"),
        (["--bogus"], "--bogus", "no such option"),
        (["--tp"], "--tp", "requires an argument"),
    ],
)
def test_bad_flag_value(tmp_path, args, flag, reason):
    error_line(memplan("estimate", "llama3-8b", *args, cwd=tmp_path), CLI, flag, reason)


def test_profiles_bad_format(tmp_path):
    error_line(memplan("profiles", "--format", "xml", cwd=tmp_path), CLI, "--format", "xml")


def test_unknown_command(tmp_path):
    error_line(memplan("estmate", "llama3-8b", cwd=tmp_path), CLI, None, "estmate")


# ---------------------------------------------------------------------------------------------
# GPUs


def test_unknown_gpu(tmp_path):
    message = error_line(
        memplan("estimate", "llama3-8b", "--gpu", "h900", cwd=tmp_path), CLI, "--gpu", "unknown GPU", "h900"
    )
    assert "h100-sxm" in message  # the bundled names are listed


def _gpu_yaml(**changes: object) -> dict:
    data = {
        "name": "tiny",
        "display_name": "Tiny GPU",
        "vendor": "nvidia",
        "memory_bytes": "16GiB",
        "hbm_bytes_per_s": "1TB/s",
        "peak_flops": {"bf16": "100TFLOPS"},
        "pcie_bytes_per_s": "32GB/s",
        "sources": {
            "memory_bytes": "datasheet",
            "hbm_bytes_per_s": "datasheet",
            "peak_flops": "datasheet",
            "pcie_bytes_per_s": "datasheet",
        },
    }
    data.update(changes)
    return data


def test_gpu_yaml_missing_a_source(tmp_path):
    data = _gpu_yaml()
    del data["sources"]["hbm_bytes_per_s"]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    error_line(memplan("estimate", "llama3-8b", "--gpu", path, cwd=tmp_path), path, "sources", "hbm_bytes_per_s")


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"memory_bytes": "16XB"}, "memory_bytes", "16XB"),
        ({"memory_bytes": "989TFLOPS"}, "memory_bytes", "FLOPS"),
        ({"memory_bytes": 0}, "memory_bytes", "greater than 0"),
        ({"vendor": "intel"}, "vendor", "'nvidia'"),
        ({"peak_flops": {"bf17": "1TFLOPS"}}, "peak_flops.bf17", "'bf16'"),
        ({"hbm_bytes": "1TB/s"}, "hbm_bytes", "unknown field"),
        ({"efficiency": {"matmul": 1.5, "attention": 0.3}}, "efficiency.matmul", "less than or equal to 1"),
        ({"efficiency": {"matmul": 0.5}}, "efficiency.attention", "required"),
        ({"efficiency": {"matmul": 0.5, "attention": 0.3}}, "sources", "efficiency"),  # no source for it
    ],
)
def test_bad_gpu_yaml(tmp_path, changes, field, reason):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(_gpu_yaml(**changes)))
    error_line(memplan("estimate", "llama3-8b", "--gpu", path, cwd=tmp_path), path, field, reason)


def test_missing_gpu_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    error_line(memplan("estimate", "llama3-8b", "--gpu", path, cwd=tmp_path), path, None, "no such file")


# ---------------------------------------------------------------------------------------------
# MEMPLAN_DEBUG


def test_debug_shows_the_traceback(tmp_path):
    proc = memplan("estimate", "llama3-8b", "--tp", "3", cwd=tmp_path, debug=True)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr
    assert "MemplanError" in proc.stderr


def test_debug_shows_the_traceback_of_a_bad_flag(tmp_path):
    proc = memplan("estimate", "llama3-8b", "--tp", "abc", cwd=tmp_path, debug=True)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr


# ---------------------------------------------------------------------------------------------
# fuzz: any model mapping gives a result or one clean error, never a crash


def _run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(argv)
    return code, out.getvalue(), err.getvalue()


_values = st.one_of(
    st.integers(min_value=-5, max_value=10**13),
    st.sampled_from([0, 1, 2, 3, 7, 8, 64, 4096, "abc", "", None, True, 1.5, [], {}]),
)


_MODEL_FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
_MODEL_CHANGES = st.dictionaries(
    st.sampled_from(sorted(SMALL_MODEL) + ["head_dim", "moe", "extra"]), _values, max_size=3
)
_TPS = st.sampled_from(["1", "2", "3", "4", "0"])


# a model that estimates runs its op-level run (about 1 s on 2 cores): 6 examples and the two below by
# default (the suite's time), 300 under -m slow
@settings(max_examples=6, **_MODEL_FUZZ)
@given(changes=_MODEL_CHANGES, tp=_TPS)
@example(changes={}, tp="2")  # the model as written estimates: the result path runs every time
@example(changes={"num_layers": 3}, tp="1")
def test_fuzzed_model_files_fail_cleanly(tmp_path, monkeypatch, changes, tp):
    _model_file_fails_cleanly(tmp_path, monkeypatch, changes, tp)


@pytest.mark.slow
@settings(max_examples=300, **_MODEL_FUZZ)
@given(changes=_MODEL_CHANGES, tp=_TPS)
def test_fuzzed_model_files_fail_cleanly_slow(tmp_path, monkeypatch, changes, tp):
    _model_file_fails_cleanly(tmp_path, monkeypatch, changes, tp)


def _model_file_fails_cleanly(tmp_path, monkeypatch, changes, tp) -> None:  # noqa: ANN001
    """Any model mapping gives a result or one clean error line (exit 2), never a crash."""
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    path = write_model(tmp_path, "fuzz.yaml", **changes)
    code, out, err = _run_in_process(["estimate", str(path), "--tp", tp, "--format", "json"])
    if code == 0:
        assert json.loads(out)["model"]["parameters"] > 0
        assert err == ""
        return
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(PREFIX), err
    assert "internal error" not in err


# --- the caching allocator: --allocator, PYTORCH_CUDA_ALLOC_CONF, trace files ----------------


def test_unknown_allocator_flag(tmp_path):
    proc = memplan("estimate", "llama3-8b", "--allocator", "bogus", cwd=tmp_path)
    error_line(proc, "command line", "--allocator", "'default' or 'expandable'")


@pytest.mark.parametrize(
    "command", [["tune", "llama3-8b", "--gpus", "8"], ["validate", "llama3-8b"], ["check", "b.yaml"]]
)
def test_unknown_allocator_flag_on_every_command(tmp_path, command):
    proc = memplan(*command, "--allocator", "bogus", cwd=tmp_path)
    error_line(proc, "command line", "--allocator", "'default', 'expandable'")


@pytest.mark.parametrize(
    "command",
    [["estimate", "llama3-8b"], ["tune", "llama3-8b", "--gpus", "8"], ["validate", "llama3-8b"], ["check", "b.yaml"]],
)
def test_unknown_device_on_every_command(tmp_path, command):
    proc = memplan(*command, "--device", "tpu", cwd=tmp_path)
    error_line(proc, "command line", "--device", "'cpu'")


def test_triton_attention_is_refused_by_exports(tmp_path):
    proc = memplan("export", "--model", "llama3-8b", "--gpus", "8", "--zero", "3", "--attention", "triton",
                   "--to", "deepspeed", cwd=tmp_path)  # fmt: skip
    error_line(proc, "command line", "--attention", "bundled trainer")


def test_unknown_allocator_in_a_plan_file(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("allocator: fancy\n")
    proc = memplan("estimate", "llama3-8b", "--plan", plan, cwd=tmp_path)
    error_line(proc, plan, "allocator", "'default' or 'expandable'")


@pytest.mark.parametrize(
    ("conf", "field", "reason"),
    [
        ("expandable_segments:maybe", "expandable_segments", "True or False"),
        ("no_such_key:1", "no_such_key", "unrecognized"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold", ""),
        ("max_split_size_mb:1", "max_split_size_mb", ""),
    ],
)
def test_alloc_conf_pytorch_would_reject(tmp_path, monkeypatch, conf, field, reason):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    proc = memplan("estimate", "llama3-8b", cwd=tmp_path)
    error_line(proc, "PYTORCH_CUDA_ALLOC_CONF", field, reason)


def test_trace_file_that_is_not_one(tmp_path):
    from memplan.costmodel.allocator import load_snapshot
    from memplan.errors import MemplanError

    bad = tmp_path / "trace.pkl"
    bad.write_bytes(b"not a pickle at all")
    with pytest.raises(MemplanError) as err:
        load_snapshot(bad)
    assert err.value.source == str(bad) and str(err.value).count("\n") == 0


# --- fine-tuning: LoRA, QLoRA, quantized bases ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag", "reason"),
    [
        (["--finetune", "prefix"], "--finetune", "'lora'"),
        (["--finetune", "lora", "--lora-rank", "0"], "--lora-rank", "greater than 0"),
        (["--finetune", "lora", "--lora-rank", "-4"], "--lora-rank", "greater than 0"),
        (["--lora-rank", "8"], "--lora-rank", "only meaningful with finetune: lora or qlora"),
        (["--finetune", "lora", "--lora-dropout", "1.5"], "--lora-dropout", "less than 1"),
        (["--lora-dora"], "--lora-dora", "only meaningful with finetune: lora or qlora"),
        (["--finetune", "lora", "--lora-dora", "--runtime", "memplan"], "--lora-dora", "--runtime hf or hf-loop alone"),
        (["--finetune", "lora", "--quant", "int8", "--lora-dora", "--runtime", "hf"], "--lora-dora", "LLM.int8"),
        # under the Trainer's FSDP2 DoRA is followed (test_timeline_hf_dora_fsdp.py); activation offload is not
        (
            [
                "--finetune",
                "lora",
                "--lora-dora",
                "--runtime",
                "hf",
                "--gpus",
                "2",
                "--zero",
                "3",
                "--offload-activations",
                "cpu",
            ],
            "--lora-dora",
            "PEFT's DoRA over activation offload",
        ),
        (["--finetune", "lora", "--lora-targets", "q_proj,,v_proj"], "--lora-targets", "empty name"),
        (["--finetune", "lora", "--lora-targets", "all-linear,q_proj"], "--lora-targets", "give it alone"),
        (["--finetune", "lora", "--lora-targets", "q_proj,q_proj"], "--lora-targets", "named twice"),
        (["--quant", "nf4"], "--quant", "finetune: lora or qlora"),
        (["--quant", "int4"], "--quant", "'nf4'"),
        (["--finetune", "lora", "--double-quant"], "--double-quant", "needs quant: nf4 or fp4"),
        (["--finetune", "qlora", "--quant", "none"], "--quant", "use finetune: lora"),
        (["--finetune", "qlora", "--precision", "fp8"], "--precision", "not fp8"),
        (["--offload-activations", "gpu"], "--offload-activations", "'cpu'"),
        (["--model-build", "from_config"], "--model-build", "'to_device'"),
        (["--finetune", "qlora", "--model-build", "to_device"], "--model-build", "always loaded by from_pretrained"),
    ],
)
def test_bad_finetune_flag(tmp_path, args, flag, reason):
    error_line(memplan("estimate", "llama3-8b", *args, cwd=tmp_path), CLI, flag, reason)


def test_bad_finetune_field_in_a_plan_file(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("plan: {finetune: lora, lora_rank: -1}\n")
    error_line(memplan("estimate", "llama3-8b", "--plan", plan, cwd=tmp_path), plan, "plan.lora_rank", "greater than 0")


def test_validate_refuses_adapters_the_trainer_does_not_build(tmp_path):
    """The bundled trainer builds nf4 / fp4 / int8 bases computing in fp32 or bf16
    (memplan.train.quant); autocast over one is still estimate-only."""
    proc = memplan("validate", "llama3-8b", "--finetune", "qlora", "--precision", "bf16-mixed", cwd=tmp_path)
    error_line(proc, CLI, "precision", "bf16-mixed (autocast) over a nf4 base", "estimate-only")
    proc = memplan("validate", "llama3-8b", "--finetune", "lora", "--modules-to-save", "embed_tokens", cwd=tmp_path)
    error_line(proc, CLI, "modules_to_save", "estimate-only")


def test_activation_offload_is_refused_by_the_estimate_where_the_trainer_does_not_offload(tmp_path):
    """Modelled for the loops that run it (hf: TRL's activation_offloading, hf-loop and the bundled
    trainer: save_on_cpu); the trainer's is measured with recompute none or full only: an error naming
    the field, not a silent number. (The default plan recomputes nothing, and offloads: a suggestion
    that would recompute selectively is no suggestion, not an error; test_advice_that_the_run_declines.)"""
    proc = memplan("estimate", "llama3-8b", "--offload-activations", "cpu", "--recompute", "selective", cwd=tmp_path)
    error_line(proc, "plan.offload_activations", None, "recompute selective", "use none or full")


def test_advice_that_the_run_declines_is_no_suggestion(tmp_path):
    """The default plan with activation offload estimates: the suggestions that would recompute
    selectively (which the trainer's offload does not run) are left out, not raised as the plan's error."""
    proc = memplan("estimate", "llama3-8b", "--offload-activations", "cpu", "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["plan"]["offload_activations"] == "cpu" and d["plan"]["recompute"] == "none"
    assert all("selective" not in s["change"] for s in d["suggestions"]), d["suggestions"]


def test_validate_refuses_offload_the_trainer_does_not_run_in_one_line(tmp_path):
    args = ["--offload-activations", "cpu", "--recompute", "none", "--tp", "2", "--device", "cpu"]
    proc = memplan("validate", "llama3-8b", *args, cwd=tmp_path)
    error_line(proc, "plan.offload_activations", None, "tensor parallel", "use tp 1")


@pytest.mark.parametrize(
    ("model", "args", "flag", "reason"),
    [
        ("llama3-8b", ["--lora-targets", "q_proj,wq"], "--lora-targets", "wq matches no linear layer of llama3-8b"),
        ("llama3-8b", ["--lora-targets", "lm_head"], "--lora-targets", "use modules_to_save: lm_head"),
        ("llama3-8b", ["--modules-to-save", "head"], "--modules-to-save", "valid: lm_head, embed_tokens"),
        ("gpt3-175b", [], "--finetune", "dense Llama-family models"),
        # LoRA over an MoE model: the Trainer's op-level run alone answers it (one rank, DDP or FSDP)
        ("mixtral-8x7b", ["--runtime", "memplan"], "--finetune", "an MoE model"),
        ("mixtral-8x7b", ["--lora-targets", "up_proj"], "--lora-targets", "matches no module of Mixtral"),
        # DoRA where PEFT wraps the experts and the router (lora.ParamWrapper): PEFT raises, and so does memplan
        (
            "mixtral-8x7b",
            ["--lora-dora", "--lora-targets", "all-linear"],
            "--lora-dora",
            "PEFT 0.21 raises (lora.ParamWrapper does not work with use_dora=True)",
        ),
        (
            "qwen3-30b-a3b",
            ["--lora-dora", "--lora-targets", "q_proj,gate_proj,up_proj", "--gpus", "2", "--zero", "3"],
            "--lora-dora",
            "lora.ParamWrapper does not work with use_dora=True",
        ),
        # DoRA over an LLM.int8 MoE base: PEFT's own run fails on CPU (hf_support.DORA_INT8)
        ("mixtral-8x7b", ["--lora-dora", "--quant", "int8", "--device", "cpu"], "--finetune", "DoRA over an LLM.int8"),
    ],
)
def test_adapters_that_name_no_module_of_the_model(tmp_path, model, args, flag, reason):
    error_line(memplan("estimate", model, "--finetune", "lora", *args, cwd=tmp_path), CLI, flag, reason)


# ---------------------------------------------------------------------------------------------
# config.json families of issue 18: values memplan cannot model name their config.json key

HF_DIR = Path(__file__).parents[1] / "data" / "hf"


def _hf(name: str) -> dict:
    return json.loads((HF_DIR / f"{name}.json").read_text())


@pytest.mark.parametrize(
    ("name", "changes", "field", "reason"),
    [
        ("gemma2-9b", {"layer_types": ["global"] * 42}, "layer_types", "unknown attention kind"),
        ("qwen3-8b", {"hidden_act": "swiglu"}, "hidden_act", "Input should be"),
        ("deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq", "only 1"),
        ("phi3-mini", {"attention_bias": True}, "attention_bias", "without biases"),
        # Mixtral's window as Mistral's: an int or null (transformers' strict config), more than 0 keys
        ("mixtral-8x7b", {"sliding_window": 0}, "sliding_window", "greater than 0"),
        ("mixtral-8x7b", {"sliding_window": "4096"}, "sliding_window", "an integer number of keys or null"),
        ("mixtral-8x7b", {"sliding_window": True}, "sliding_window", "an integer number of keys or null"),
    ],
)
def test_hf_family_value_not_modelled(tmp_path, name, changes, field, reason):
    path = write_json(tmp_path, {**_hf(name), **changes})
    error_line(memplan("estimate", path, cwd=tmp_path), path, field, reason)


def test_hf_multimodal_error_names_the_text_config_key(tmp_path):
    cfg = _hf("llama4-scout")
    cfg["text_config"] = {**cfg["text_config"], "layer_types": ["sliding_attention"] * 48}
    path = write_json(tmp_path, cfg)
    error_line(memplan("estimate", path, cwd=tmp_path), path, "text_config.layer_types", "unknown attention kind")


# ---------------------------------------------------------------------------------------------
# issue 20: absurd inputs refused where they are read, outputs checked before any work


def _budgets(tmp_path: Path, budget: object = "70GiB", **top: object) -> Path:
    entry = {"name": "a", "model": "llama3-8b", "gpus": 8, "plan": {"zero": 3}, "budget": budget}
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump({**top, "entries": [entry]}))
    return path


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        ("plan: {tp: true}\n", "plan.tp", "a boolean (true)"),
        ("plan: {tp: 2.0}\n", "plan.tp", "valid integer"),
        ("plan: {sequence_parallel: 1}\n", "plan.sequence_parallel", "valid boolean"),
        ("workload: {seq_len: '4096'}\n", "workload.seq_len", "a string ('4096')"),
        ("gpus: true\n", "gpus", "a boolean"),
    ],
)
def test_wrong_types_in_a_plan_file_are_refused_not_coerced(tmp_path, text, field, reason):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    error_line(memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path), path, field, reason)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("plan: {tp: 2}\nplan: {tp: 4}\n", "'plan' at line 2"),
        ("plan:\n  tp: 2\n  zero: 1\n  tp: 4\n", "'tp' at line 4"),
    ],
)
def test_duplicate_keys_in_a_plan_file(tmp_path, text, key):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    error_line(memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path), path, None, "duplicate key " + key)


def test_duplicate_keys_in_a_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_LLAMA)[:-1] + ', "num_hidden_layers": 2}')
    error_line(memplan("estimate", path, cwd=tmp_path), path, None, "duplicate key 'num_hidden_layers'")


@pytest.mark.parametrize(
    ("args", "flag", "reason"),
    [
        (["--gpus", "16", "--tp", "16"], "--tp", "does not divide num_kv_heads=8"),
        (["--recompute", "full", "--recompute-layers", "99"], "--recompute-layers", "32 layers of a pipeline stage"),
        (["--sequence-parallel"], "--sequence-parallel", "needs tp > 1"),
        (["--inference", "--zero", "3", "--optimizer", "sgd", "--offload-optimizer", "cpu"], "--offload-optimizer",
         "a training setting"),
    ],
)  # fmt: skip
def test_impossible_or_ignored_plan_flags(tmp_path, args, flag, reason):
    error_line(memplan("estimate", "llama3-8b", *args, cwd=tmp_path), CLI, flag, reason)


def test_a_plan_file_for_another_model_is_refused(tmp_path):
    plan = tmp_path / "plan8b.yaml"
    plan.write_text("model: llama3-8b\nplan: {zero: 1}\n")
    proc = memplan("estimate", "mixtral-8x7b", "--plan", plan, cwd=tmp_path)
    error_line(proc, plan, "model", "for llama3-8b", "mixtral-8x7b")
    assert memplan("estimate", "llama3-8b", "--plan", plan, cwd=tmp_path).returncode == 0


def test_a_sequence_beyond_the_models_positions_is_a_warning(tmp_path):
    """Legal (context extension trains beyond max_position_embeddings): estimated, with one warning line."""
    proc = memplan("export", "--model", "llama3-8b", "--gpus", "8", "--zero", "3", "--seq-len", "16384",
                   "--to", "deepspeed", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("memplan: warning:")]
    assert len(warnings) == 1 and "max_position_embeddings 8,192" in warnings[0]
    proc = memplan("estimate", "llama3-8b", "--seq-len", "1048576", "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0 and "seq_len 1,048,576 is beyond" in json.loads(proc.stdout)["warnings"][0]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("memplan: warning:")]
    assert len(warnings) == 1 and "seq_len 1,048,576 is beyond" in warnings[0]  # the table's and JSON's stderr
    proc = memplan("estimate", "llama3-8b", "--seq-len", "16384", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr.count("memplan: warning:") == 1


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_export_gradient_clipping_must_be_a_positive_number(tmp_path, value):
    proc = memplan("export", "--model", "llama3-8b", "--gpus", "8", "--zero", "3", "--to", "deepspeed",
                   "--gradient-clipping", value, cwd=tmp_path)  # fmt: skip
    error_line(proc, CLI, "--gradient-clipping", "positive finite number")


@pytest.mark.parametrize(
    ("budget", "top", "field", "reason"),
    [
        ("1e30GiB", {}, "entries[0].budget", "beyond any GPU's memory"),
        ("70GiB", {"threshold": "-2%"}, "threshold", "at least 0%"),
        ("70GiB", {"threshold": "two%"}, "threshold", "as a percentage"),
    ],
)
def test_absurd_budgets_and_thresholds(tmp_path, budget, top, field, reason):
    path = _budgets(tmp_path, budget, **top)
    error_line(memplan("check", path, cwd=tmp_path), path, field, reason)


@pytest.mark.parametrize("command", [["estimate", "{path}"], ["estimate", "llama3-8b", "--plan", "{path}"]])
def test_empty_and_binary_files(tmp_path, command):
    empty, binary = tmp_path / "empty.yaml", tmp_path / "binary.yaml"
    empty.write_text("")
    binary.write_bytes(bytes(range(128, 256)) * 4)
    for path, reason in ((empty, "the file is empty"), (binary, "not a text file")):
        proc = memplan(*(str(path) if a == "{path}" else a for a in command), cwd=tmp_path)
        message = error_line(proc, path, None, reason)
        assert "NoneType" not in message and "UnicodeDecodeError" not in message


def test_an_empty_section_says_so(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("plan:\nworkload: {seq_len: 4096}\n")
    proc = memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr  # an empty plan section is no plan fields
    path.write_text("workload: [4096]\n")
    error_line(memplan("estimate", "llama3-8b", "--plan", path, cwd=tmp_path), path, "workload", "got a list")


OUTPUT_COMMANDS = {
    "--out": ["tune", "llama3-8b", "--gpus", "8", "--out"],
    "--output": ["export", "--model", "llama3-8b", "--gpus", "8", "--zero", "3", "--to", "deepspeed", "-o"],
    "--junit": ["check", "{budgets}", "--junit"],
    "--markdown": ["check", "{budgets}", "--markdown"],
}


@pytest.mark.parametrize("flag", OUTPUT_COMMANDS)
@pytest.mark.parametrize(
    ("target", "reason"),
    [("adir/", "is a directory"), ("adir", "is a directory"), ("afile/out.txt", "is a file, not a directory")],
)
def test_output_paths_are_checked_before_any_work(tmp_path, flag, target, reason):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    budgets = _budgets(tmp_path)
    args = [str(budgets) if a == "{budgets}" else a for a in OUTPUT_COMMANDS[flag]]
    proc = memplan(*args, target, cwd=tmp_path)
    error_line(proc, CLI, flag, target, reason)
    assert not (tmp_path / "memplan-tune").exists()  # the search never started


def test_a_very_long_output_name_is_shortened(tmp_path):
    name = "p" * 5000 + ".yaml"
    proc = memplan("tune", "llama3-8b", "--gpus", "8", "--out", name, cwd=tmp_path)
    message = error_line(proc, CLI, "--out", "too long")
    assert len(message) < 300 and "…" in message


def test_a_very_long_input_name_is_shortened(tmp_path):
    for args in (["estimate", "m" * 100_000 + ".yaml"], ["estimate", "llama3-8b", "--plan", "q" * 100_000]):
        proc = memplan(*args, cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr) < 600 and "…" in proc.stderr, proc.stderr[:300]
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_an_output_the_permission_bits_allow_but_the_system_refuses(tmp_path):
    """/proc takes no new files, even from root (whom every access() check lets through)."""
    proc = memplan("tune", "llama3-8b", "--gpus", "8", "--out", "/proc/memplan-plan.yaml", cwd=tmp_path)
    error_line(proc, CLI, "--out", "/proc/memplan-plan.yaml: cannot be written")


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["--max-micro-batch", "100000000"], "--max-micro-batch"), (["--micro-batch", "100000000"], "--micro-batch"),
     (["--global-batch", "999999999999"], "--global-batch"), (["--seq-len", "1000000000"], "--seq-len")],
)  # fmt: skip
def test_tune_workload_bounds_are_flag_errors(tmp_path, args, flag):
    error_line(memplan("tune", "llama3-8b", "--gpus", "8", *args, cwd=tmp_path), CLI, flag, "less than or equal")


# ---------------------------------------------------------------------------------------------
# issue 19: --timeline paths, snapshots that are not ones, validate --snapshot folders


@pytest.mark.parametrize("case", ["directory", "missing-parent", "unknown-suffix"])
def test_timeline_path_is_checked_before_any_work(tmp_path, case):
    path = {"directory": tmp_path, "missing-parent": tmp_path / "no" / "t.html", "unknown-suffix": tmp_path / "t.jpg"}
    reason = {"directory": "is a directory", "missing-parent": "does not exist", "unknown-suffix": "unknown suffix"}
    proc = memplan("estimate", "llama3-8b", "--timeline", path[case], cwd=tmp_path)
    error_line(proc, path[case], "--timeline", reason[case])


def test_explain_a_file_that_is_not_a_snapshot(tmp_path):
    path = tmp_path / "notes.pickle"
    path.write_text("these are notes, not a memory snapshot\n")
    error_line(memplan("explain", path, cwd=tmp_path), path, None, "not a memory snapshot")


def test_validate_snapshot_folder_that_is_a_file(tmp_path):
    path = tmp_path / "snaps"
    path.write_text("")
    proc = memplan("validate", "llama3-8b", "--device", "cpu", "--snapshot", path, cwd=tmp_path)
    error_line(proc, path, "--snapshot", "is a file")


# ---------------------------------------------------------------------------------------------
# activation offload (plan.offload_activations): refused by field where no loop runs it


def test_activation_offload_refused_for_a_runtime_without_it(tmp_path):
    args = ["--offload-activations", "cpu", "--runtime", "megatron", "--finetune", "lora", "--precision", "bf16"]
    proc = memplan("estimate", "llama3-8b", *args, cwd=tmp_path)
    error_line(proc, "plan.offload_activations", None, "not runtime megatron")


def test_activation_offload_refused_for_lora_in_the_bundled_trainer(tmp_path):
    args = ["--offload-activations", "cpu", "--runtime", "memplan", "--finetune", "lora", "--precision", "bf16"]
    proc = memplan("estimate", "llama3-8b", *args, "--recompute", "none", cwd=tmp_path)
    error_line(proc, "plan.offload_activations", None, "finetune lora")


def test_activation_offload_refused_by_field_in_a_plan_file(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("runtime: megatron\nplan: {offload_activations: cpu}\n")
    error_line(memplan("estimate", "llama3-8b", "--plan", plan, cwd=tmp_path), "plan.offload_activations", None)


def test_activation_offload_refused_for_serving(tmp_path):
    proc = memplan("estimate", "llama3-8b", "--offload-activations", "cpu", "--inference", cwd=tmp_path)
    error_line(proc, CLI, "--offload-activations", "a training setting")


@pytest.mark.parametrize(
    ("runtime", "fields"),
    [("hf", ["--finetune", "lora"]), ("hf-loop", ["--finetune", "lora"]), ("memplan", ["--recompute", "full"])],
)
def test_activation_offload_estimated_for_the_loops_that_run_it(tmp_path, runtime, fields):
    args = ["--offload-activations", "cpu", "--runtime", runtime, *fields, "--precision", "bf16"]
    proc = memplan("estimate", "llama3-8b", *args, "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["memory"]["offload"]["cpu"] > 0
    assert out["time"]["breakdown"].get("activation_offload", 0.0) >= 0.0


# issue 20 (validate): inputs and capacity checked before any run
def test_validate_output_that_is_a_directory_is_refused_before_the_run(tmp_path):
    (tmp_path / "adir").mkdir()
    proc = memplan("validate", "llama3-8b", "--device", "cpu", "--out", "adir/", cwd=tmp_path)
    error_line(proc, CLI, "--out", "is a directory")


def test_validate_on_cuda_without_a_gpu_is_one_line(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = memplan("validate", "llama3-8b", "--device", "cuda", cwd=tmp_path)
    error_line(proc, CLI, "--device", "sees no GPU")


def test_validate_refuses_a_run_larger_than_the_free_host_memory(tmp_path):
    """llama3-70b on one CPU host: about 1.5 TiB predicted; refused with the figures, nothing allocated."""
    pytest.importorskip("torch")
    proc = memplan("validate", "llama3-70b", "--device", "cpu", cwd=tmp_path)
    error_line(proc, CLI, "plan", "of host memory", "is free", "--force")


def test_an_empty_output_path_and_a_module_saved_twice_are_refused(tmp_path):
    """Fuzz findings: ``-o ""`` was reported as a directory; ``--modules-to-save lm_head,lm_head`` was accepted."""
    (tmp_path / "p.yaml").write_text("model: llama3-8b\ngpus: 8\nplan: {zero: 3}\n")
    proc = memplan("export", "p.yaml", "--to", "deepspeed", "-o", "", cwd=tmp_path)
    error_line(proc, CLI, "--output", "an empty path")
    proc = memplan("estimate", "llama3-8b", "--finetune", "lora", "--modules-to-save", "lm_head,lm_head", cwd=tmp_path)
    error_line(proc, CLI, "--modules-to-save", "named twice")


def test_an_absurd_attention_width_gets_an_answer_not_a_hang(tmp_path, monkeypatch):
    """Found by the fuzz test above: 3,972 heads of width 3,972 over a hidden size of 768 (4.6 TB of
    activations a rank) cut into 3 MB tensors made a 3-million-event run that the allocator's replay
    took many minutes over. The run's activation tensors grow instead (timeline.step.MAX_LIVE)."""
    from memplan.costmodel.reserve import plan_run
    from memplan.specs.resolve import resolve_job

    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    path = write_model(tmp_path, "wide.yaml", num_attention_heads=3972, head_dim=3972)
    job = resolve_job(str(path), None, {"tp": 4})
    run, _ = plan_run(job.model, job.workload, job.plan, job.runtime)
    assert len(run.events) < 500_000  # 372,742; was 2,971,942
    code, out, err = _run_in_process(["estimate", str(path), "--tp", "4", "--format", "json"])
    assert code == 0, err
    assert json.loads(out)["fits"] is False
