"""Happy paths of the ``memplan`` command, in-process through ``memplan.cli.app.run``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memplan.cli.app import run
from memplan.costmodel.overhead import fast_reserved_bytes

ROOT = Path(__file__).parents[2]
HF_DIR = ROOT / "tests" / "data" / "hf"
MODEL_PROFILES = sorted(p.stem for p in (ROOT / "profiles" / "models").glob("*.yaml"))
GPU_PROFILES = sorted(p.stem for p in (ROOT / "profiles" / "gpus").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)


def memplan(capsys, *args: object) -> str:
    """Run the command; it must succeed and print nothing on stderr. Returns stdout."""
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    return out


def estimate_json(capsys, *args: object) -> dict:
    return json.loads(memplan(capsys, "estimate", *args, "--format", "json"))


def _walk(value, path=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


# ---------------------------------------------------------------------------------------------
# estimate --format json: the contract


def test_json_contract(capsys):
    d = estimate_json(capsys, "llama3-8b", "--gpus", "8", "--zero", "3")

    assert d["model"]["name"] == "llama3-8b"
    assert d["model"]["parameters"] == 8_030_261_248
    for key in (
        "dp",
        "tp",
        "pp",
        "cp",
        "ep",
        "zero",
        "recompute",
        "precision",
        "optimizer",
        "attention",
        "micro_batch",
        "seq_len",
        "global_batch",
        "world_size",
        "runtime",
        "offload_optimizer",
        "offload_params",
        "pp_schedule",
        "virtual_stages",
        "sequence_parallel",
        "gradient_accumulation",
    ):
        assert key in d["plan"], key
    assert (d["plan"]["dp"], d["plan"]["tp"], d["plan"]["pp"], d["plan"]["cp"], d["plan"]["ep"]) == (8, 1, 1, 1, 1)
    assert d["plan"]["zero"] == 3 and d["plan"]["world_size"] == 8
    assert d["gpu"]["name"] == "h100-sxm"
    assert isinstance(d["gpu"]["memory_bytes"], int) and d["gpu"]["memory_bytes"] > 0

    mem = d["memory"]
    assert set(mem["model_states"]) >= {"parameters", "gradients", "optimizer_states"}
    assert set(mem["activations"]) >= {"per_layer", "total"}
    assert "kv_cache" in mem
    assert set(mem["peak"]) >= {"allocated", "reserved", "phase", "rank", "breakdown"}
    assert set(mem["offload"]) >= {"cpu", "nvme"}
    assert isinstance(d["fits"], bool)

    peak = mem["peak"]
    assert sum(peak["breakdown"].values()) == peak["allocated"]
    assert peak["reserved"] >= peak["allocated"] > 0
    # reserved is the allocator's (max_memory_reserved); the context, NCCL and workspaces are
    # outside it and come off the capacity PyTorch sees
    limit = d["gpu"]["capacity_bytes"] - mem["overhead"]
    assert d["gpu"]["capacity_bytes"] <= d["gpu"]["memory_bytes"]
    assert d["fits"] == (peak["reserved"] <= limit) and d["fits_reason"].startswith("fits" if d["fits"] else "")
    assert d["headroom_bytes"] == limit - peak["reserved"]
    detail = peak["reserved_detail"]
    assert detail["allocator"] == "default" and detail["limit"] == limit
    assert sum(detail["reserved_by_stream"].values()) <= peak["reserved"]
    # ZeRO-3 over 8 ranks: each holds an eighth of the bf16 parameters
    assert mem["model_states"]["parameters"] == pytest.approx(2 * 8_030_261_248 / 8, rel=0.01)


def _sizes(d: dict):
    yield from _walk(d["memory"], "memory")
    for key in ("model.parameters", "model.active_parameters", "gpu.memory_bytes", "headroom_bytes"):
        section, _, name = key.rpartition(".")
        yield key, (d[section] if section else d)[name]
    for i, s in enumerate(d["suggestions"]):
        yield f"suggestions[{i}].reserved_bytes", s["reserved_bytes"]
        yield f"suggestions[{i}].saved_bytes", s["saved_bytes"]


@pytest.mark.parametrize(
    "args",
    [
        ["llama3-8b", "--gpus", "8", "--zero", "3"],
        ["llama3-70b", "--gpus", "8", "--zero", "0"],
        ["mixtral-8x7b", "--gpus", "16", "--ep", "8", "--zero", "1", "--recompute", "full"],
        ["llama3-8b", "--inference", "--batch", "4", "--context", "8192"],
        ["qwen3-30b-a3b", "--gpus", "8", "--zero", "3", "--offload-params", "cpu", "--offload-optimizer", "nvme"],
    ],
)
def test_every_size_is_an_int(capsys, args):
    d = estimate_json(capsys, *args)
    for path, value in _sizes(d):
        if path.endswith(
            (".phase", ".rank_role", ".allocator", ".failed_tensor", ".fits_with_expandable_segments", ".timeline")
            + (".torch_version", ".source")  # memory.outside: which figures, not sizes
            + (".prefill.moment",)
            + ("memory.model", "memory.model_reason")  # which model answered, and why
        ):
            continue  # names and verdicts, not sizes
        if path.endswith((".failed_request", ".expandable_reserved")) and value is None:
            continue  # every request was served
        if path == "memory.prefill" and value is None:
            continue  # a training step has no prefill
        if path == "memory.stage_reserved" and value is None:
            continue  # no pipeline answered op by op: one rank, no per-stage replays
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
    peak = d["memory"]["peak"]
    assert sum(peak["breakdown"].values()) == peak["allocated"]
    assert peak["reserved"] >= peak["allocated"]


def test_offload_is_reported(capsys):
    d = estimate_json(
        capsys, "llama3-8b", "--gpus", "8", "--zero", "3", "--offload-params", "cpu", "--offload-optimizer", "nvme"
    )
    assert d["memory"]["offload"]["cpu"] > 0
    assert d["memory"]["offload"]["nvme"] > 0


# ---------------------------------------------------------------------------------------------
# table output


def test_table_says_whether_it_fits_and_the_phase(capsys):
    d = estimate_json(capsys, "llama3-8b", "--gpus", "8", "--zero", "3")
    out = memplan(capsys, "estimate", "llama3-8b", "--gpus", "8", "--zero", "3")
    assert d["fits"] is True
    assert "fits" in out and "does not fit" not in out
    assert f"{d['memory']['peak']['phase']} phase" in out
    assert "llama3-8b" in out and "8 x h100-sxm" in out
    assert "pipeline stages" not in out  # one stage: nothing to list


def test_table_lists_every_pipeline_stages_reserved(capsys):
    """A pipelined op-level plan replays every stage's run (``costmodel/stages.py``): the table names each
    stage's reserved peak, and the one it breaks down (1B config, pp 4, 1F1B, fp32, 4 micro-batches: stage 0,
    where the phase model named stage 3)."""
    config = str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")
    args = [config, "--pp", "4", "--precision", "fp32", "--seq-len", "512", "--micro-batch", "1"]
    args += ["--global-batch", "4", "--gpu", "h200"]
    d = estimate_json(capsys, *args)
    out = " ".join(memplan(capsys, "estimate", *args).split())  # rich wraps at the terminal's width
    reserved = d["memory"]["stage_reserved"]
    assert sorted(reserved) == ["0", "1", "2", "3"] and d["memory"]["peak"]["stage"] == 0
    assert d["memory"]["peak"]["reserved"] == max(reserved.values())
    listed = ", ".join(f"{s} {r / 2**30:.2f} GiB" for s, r in sorted(reserved.items()))
    assert f"the table is stage 0's, the first to run out of memory: least headroom): {listed}" in out


def test_table_console_writes_names_as_given(capsys, monkeypatch):
    """The table's console: rich's emoji codes off (``:fire:`` stays as written), plain where no styles
    are written (captured here, not a terminal), highlighted with colours forced."""
    from memplan.cli.estimate import _console

    plain = _console()
    plain.print(":fire: 1.5 GiB")
    assert capsys.readouterr().out == ":fire: 1.5 GiB\n"
    assert plain.color_system is None
    monkeypatch.setenv("FORCE_COLOR", "1")
    coloured = _console()
    coloured.print(":fire: 1.5 GiB")
    out = capsys.readouterr().out
    assert coloured.color_system is not None and ":fire:" in out and "\x1b[" in out  # the number highlighted


def test_table_does_not_fit(capsys):
    out = memplan(capsys, "estimate", "llama3-70b", "--gpus", "8", "--zero", "0")
    assert "does not fit" in out
    assert "phase" in out
    assert "Changes that would help" in out
    assert "ZeRO stage 3" in out


def _verdicts(out: str) -> list[str]:
    """The report's verdict lines (rich wraps at 200 columns here: one line each)."""
    return [line for line in out.splitlines() if line.startswith(("fits", "does not fit"))]


def test_one_verdict_carries_allocated_and_reserved(capsys):
    """Issue 26 item 4: "does not fit" was printed twice, with the reserved figure and then the
    allocator's allocated one; one line now carries both against what the allocator can use."""
    args = ("llama3-8b", "--gpus", "1", "--gpu", "a100-80gb")
    d = estimate_json(capsys, *args)
    out = memplan(capsys, "estimate", *args)
    assert out.count("does not fit") == 1 and d["fits_reason"].startswith("does not fit:")  # JSON keeps it
    peak, limit = d["memory"]["peak"], d["gpu"]["capacity_bytes"] - d["memory"]["overhead"]
    allocated = peak["reserved_detail"]["timeline_allocated"]
    assert allocated > limit
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    assert _verdicts(out) == [
        f"does not fit: {gib(allocated)} allocated and {gib(peak['reserved'])} reserved at the peak, of {gib(limit)} "
        f"the allocator can use ({gib(d['gpu']['capacity_bytes'])} less {gib(d['memory']['overhead'])} outside it): "
        f"the allocated bytes alone are {gib(allocated - limit)} over"
    ]


def test_one_verdict_when_the_host_does_not_fit(capsys):
    offload = ("--offload-optimizer", "cpu", "--host-memory", "1GiB")
    out = memplan(capsys, "estimate", "llama3-8b", "--gpus", "8", "--zero", "3", *offload)
    (line,) = _verdicts(out)
    assert line.startswith("does not fit: ") and "reserved fits the device" in line
    assert "; the host does not: host memory: the plan keeps" in line
    assert out.count("does not fit") == 1


def test_one_verdict_for_fragmentation(capsys):
    """The allocator's reason (fragmentation: the allocated bytes are within the limit) follows
    the figures once, without a second "does not fit"."""
    from rich.console import Console

    from memplan.cli.estimate import verdict
    from memplan.estimation import estimate
    from memplan.specs.resolve import resolve_job

    result = estimate(resolve_job("llama3-8b", None, {"gpus": 8, "zero": 3}), with_suggestions=False)
    reason = "does not fit: the 1.00 GiB activations allocation (x) fails with 77.00 GiB reserved, 3.00 GiB of it free"
    broken = result.model_copy(update={"fits": False, "fits_reason": reason})
    console = Console(width=400, record=True)
    console.print(verdict(broken))
    (line,) = console.export_text().splitlines()
    assert line.startswith("does not fit: ") and line.count("does not fit") == 1
    assert " allocated and " in line and line.endswith("; " + reason.removeprefix("does not fit: "))


def test_table_inference_shows_kv_cache(capsys):
    out = memplan(capsys, "estimate", "llama3-8b", "--inference", "--batch", "8", "--context", "4096")
    assert "KV cache" in out


# ---------------------------------------------------------------------------------------------
# suggestions


def _check_ranked(d: dict) -> list[dict]:
    suggestions = d["suggestions"]
    assert suggestions, "a plan that does not fit should come with suggestions"
    fits = [s["fits"] for s in suggestions]
    assert fits == sorted(fits, reverse=True), "the changes that fit come first"
    for group in (True, False):
        saved = [s["saved_bytes"] for s in suggestions if s["fits"] is group]
        assert saved == sorted(saved, reverse=True), f"fits={group}: not ranked by bytes saved"
    # single changes are screened with the fast form, against the same form of this plan; those that fit
    # are estimated again in full (verified), against this plan's full reserved peak
    fast = fast_reserved_bytes(d["memory"]["peak"]["allocated"])
    full = d["memory"]["peak"]["reserved"]
    limit = d["gpu"]["capacity_bytes"] - d["memory"]["overhead"]
    for s in suggestions:
        assert s["saved_bytes"] == (full if s["verified"] else fast) - s["reserved_bytes"]
        assert s["saved_bytes"] > 0 or s["verified"]
        if s["verified"]:  # the allocator's replay decides (a fragmented run may fail under the limit)
            assert not s["fits"] or s["reserved_bytes"] <= limit
        else:
            assert s["fits"] == (s["reserved_bytes"] <= limit)
        assert s["change"]
    return suggestions


def test_plan_that_does_not_fit_lists_ranked_suggestions(capsys):
    d = estimate_json(capsys, "llama3-70b", "--gpus", "8", "--zero", "0")
    assert d["fits"] is False
    assert d["headroom_bytes"] < 0
    _check_ranked(d)


def test_suggestions_that_fit_come_first(capsys):
    d = estimate_json(capsys, "llama3-8b", "--gpus", "8", "--zero", "0")
    assert d["fits"] is False
    suggestions = _check_ranked(d)
    assert suggestions[0]["fits"] is True
    assert not suggestions[-1]["fits"] or all(s["fits"] for s in suggestions)


def test_plan_that_fits_has_no_suggestions(capsys):
    d = estimate_json(capsys, "llama3-8b", "--gpus", "8", "--zero", "3")
    assert d["fits"] is True
    assert d["suggestions"] == []


# ---------------------------------------------------------------------------------------------
# inference


def test_inference_kv_cache(capsys):
    d = estimate_json(capsys, "llama3-8b", "--inference", "--batch", "8", "--context", "4096")
    layers, kv_heads, head_dim, bf16 = 32, 8, 128, 2
    assert d["memory"]["kv_cache"] > 0
    assert d["memory"]["kv_cache"] == 2 * layers * 8 * 4096 * kv_heads * head_dim * bf16
    assert d["plan"]["batch"] == 8
    assert d["plan"]["prompt_tokens"] + d["plan"]["generated_tokens"] == 4096


def test_inference_kv_cache_scales_with_dtype(capsys):
    bf16 = estimate_json(capsys, "llama3-8b", "--inference", "--batch", "8", "--context", "4096")
    fp8 = estimate_json(capsys, "llama3-8b", "--inference", "--batch", "8", "--context", "4096", "--kv-dtype", "fp8")
    assert fp8["memory"]["kv_cache"] * 2 == bf16["memory"]["kv_cache"]


def test_training_has_no_kv_cache(capsys):
    assert estimate_json(capsys, "llama3-8b")["memory"]["kv_cache"] == 0


# ---------------------------------------------------------------------------------------------
# models from files


@pytest.mark.parametrize("name", [p.stem for p in sorted(HF_DIR.glob("*.json")) if p.stem in MODEL_PROFILES])
def test_hf_config_gives_the_same_parameters_as_the_profile(capsys, name):
    from_hf = estimate_json(capsys, HF_DIR / f"{name}.json")
    from_profile = estimate_json(capsys, name)
    assert from_hf["model"]["parameters"] == from_profile["model"]["parameters"]
    assert from_hf["model"]["active_parameters"] == from_profile["model"]["active_parameters"]


def test_hf_config_llama3_8b(capsys):
    d = estimate_json(capsys, HF_DIR / "llama3-8b.json", "--gpus", "8", "--zero", "3")
    assert d["model"]["parameters"] == 8_030_261_248
    assert d["model"]["name"] == "llama3-8b"


def test_hf_model_folder(capsys, tmp_path):
    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text((HF_DIR / "llama3-8b.json").read_text())
    d = estimate_json(capsys, folder)
    assert d["model"]["parameters"] == 8_030_261_248
    assert d["model"]["name"] == "Meta-Llama-3-8B"


def test_memplan_model_yaml(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((ROOT / "profiles" / "models" / "llama3-8b.yaml").read_text().replace("name: llama3-8b", ""))
    d = estimate_json(capsys, path)
    assert d["model"]["name"] == "mine"
    assert d["model"]["parameters"] == 8_030_261_248


# ---------------------------------------------------------------------------------------------
# plan files


PLAN_FILE = {
    "gpu": "h200",
    "gpus": 8,
    "runtime": "megatron",
    "plan": {"tp": 2, "zero": 1, "recompute": "selective", "precision": "bf16-master", "optimizer": "adamw"},
    "workload": {"kind": "training", "seq_len": 4096, "micro_batch": 2, "global_batch": 64},
}


def _write_plan(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_plan_file(capsys, tmp_path):
    d = estimate_json(capsys, "llama3-8b", "--plan", _write_plan(tmp_path, PLAN_FILE))
    plan = d["plan"]
    assert (plan["dp"], plan["tp"], plan["zero"], plan["recompute"]) == (4, 2, 1, "selective")
    assert (plan["seq_len"], plan["micro_batch"], plan["global_batch"]) == (4096, 2, 64)
    assert plan["gradient_accumulation"] == 64 // (2 * 4)
    assert plan["runtime"] == "megatron"
    assert plan["world_size"] == 8
    assert d["gpu"]["name"] == "h200"


def test_flags_override_the_plan_file(capsys, tmp_path):
    path = _write_plan(tmp_path, PLAN_FILE)
    d = estimate_json(
        capsys, "llama3-8b", "--plan", path, "--tp", "4", "--seq-len", "8192", "--gpu", "h100-sxm", "--runtime", "hf"
    )
    plan = d["plan"]
    assert (plan["dp"], plan["tp"]) == (2, 4)  # dp re-derived from the file's 8 GPUs
    assert plan["seq_len"] == 8192
    assert plan["zero"] == 1 and plan["micro_batch"] == 2  # untouched fields stay as in the file
    assert plan["runtime"] == "hf"
    assert d["gpu"]["name"] == "h100-sxm"


def test_a_flag_can_fix_a_bad_plan_file_value(capsys, tmp_path):
    path = _write_plan(tmp_path, {"plan": {"tp": 3}})
    d = estimate_json(capsys, "llama3-8b", "--plan", path, "--tp", "2")
    assert d["plan"]["tp"] == 2


def test_inference_plan_file(capsys, tmp_path):
    path = _write_plan(
        tmp_path, {"workload": {"kind": "inference", "batch": 8, "prompt_tokens": 4000, "generated_tokens": 96}}
    )
    d = estimate_json(capsys, "llama3-8b", "--plan", path)
    assert d["plan"]["kind"] == "inference"
    assert d["memory"]["kv_cache"] == 2 * 32 * 8 * 4096 * 8 * 128 * 2


def test_gpu_yaml_file(capsys, tmp_path):
    path = tmp_path / "my-gpu.yaml"
    path.write_text((ROOT / "profiles" / "gpus" / "h200.yaml").read_text())
    d = estimate_json(capsys, "llama3-8b", "--gpu", path)
    assert d["gpu"]["name"] == "h200"


# ---------------------------------------------------------------------------------------------
# cluster shape


def test_default_is_one_gpu(capsys):
    plan = estimate_json(capsys, "llama3-8b")["plan"]
    assert (plan["world_size"], plan["dp"], plan["nodes"]) == (1, 1, 1)


def test_gpus_fill_eight_gpu_nodes(capsys):
    plan = estimate_json(capsys, "llama3-8b", "--gpus", "16", "--tp", "2")["plan"]
    assert (plan["world_size"], plan["dp"], plan["nodes"], plan["gpus_per_node"]) == (16, 8, 2, 8)
    plan = estimate_json(capsys, "llama3-8b", "--gpus", "16", "--nodes", "4")["plan"]
    assert (plan["nodes"], plan["gpus_per_node"]) == (4, 4)
    plan = estimate_json(capsys, "llama3-8b", "--gpus", "6")["plan"]  # not whole 8-GPU nodes: one node
    assert (plan["nodes"], plan["gpus_per_node"]) == (1, 6)


def test_many_gpus_without_nodes(capsys):
    plan = estimate_json(capsys, "llama3-70b", "--gpus", "2048", "--tp", "8", "--pp", "8", "--zero", "1")["plan"]
    assert (plan["world_size"], plan["dp"], plan["nodes"], plan["gpus_per_node"]) == (2048, 32, 256, 8)


# ---------------------------------------------------------------------------------------------
# profiles and help


def test_profiles_table_lists_everything(capsys):
    out = memplan(capsys, "profiles")
    for name in MODEL_PROFILES + GPU_PROFILES:
        assert name in out, name


def test_profiles_json(capsys):
    data = json.loads(memplan(capsys, "profiles", "--format", "json"))
    assert sorted(m["name"] for m in data["models"]) == MODEL_PROFILES
    assert sorted(g["name"] for g in data["gpus"]) == GPU_PROFILES
    for m in data["models"]:
        assert isinstance(m["parameters"], int) and m["parameters"] > 0
    for g in data["gpus"]:
        assert isinstance(g["memory_bytes"], int) and g["memory_bytes"] > 0


def test_every_bundled_model_estimates(capsys):
    for name in MODEL_PROFILES:
        d = estimate_json(capsys, name, "--gpus", "8", "--zero", "3")
        assert d["model"]["name"] == name


@pytest.mark.parametrize("args", [["--help"], ["estimate", "--help"], ["profiles", "--help"]])
def test_help(capsys, args):
    out = memplan(capsys, *args)
    assert "Usage" in out


def test_no_arguments_prints_help_and_exits_2(capsys):
    assert run([]) == 2
    out, err = capsys.readouterr()
    assert "Usage" in out + err


def test_python_dash_m_memplan_cli_help():
    proc = subprocess.run([sys.executable, "-m", "memplan.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "estimate" in proc.stdout and "profiles" in proc.stdout


def test_device_picks_the_attention_kernel_and_its_memory(capsys, tmp_path):
    """fp32 with GQA: CUDA's SDPA has no fused kernel for it (the math path keeps the s x s
    probabilities), the CPU's flash kernel takes fp32; bf16 runs a fused kernel on both."""
    args = ("llama3-8b", "--gpus", "1", "--precision", "fp32", "--seq-len", "2048", "--micro-batch", "1")
    cuda = estimate_json(capsys, *args)
    cpu = estimate_json(capsys, *args, "--device", "cpu")
    assert cuda["gpu"]["device"] == "cuda" and cpu["gpu"]["device"] == "cpu"
    assert cuda["plan"]["attention_kernel"] == "math" and cpu["plan"]["attention_kernel"] == "flash"
    # 32 layers x (b a s^2 fp32 probabilities + the scaled / repeated copies) at least
    probs = 32 * 1 * 32 * 2048 * 2048 * 4
    assert cuda["memory"]["activations"]["total"] - cpu["memory"]["activations"]["total"] >= probs
    bf16 = ("llama3-8b", "--gpus", "8", "--zero", "3", "--precision", "bf16-mixed", "--seq-len", "2048")
    assert estimate_json(capsys, *bf16)["plan"]["attention_kernel"] == "cudnn"  # torch 2.11 on sm90
    assert estimate_json(capsys, *bf16, "--device", "cpu")["plan"]["attention_kernel"] == "flash"
    eager = estimate_json(capsys, *bf16, "--attention", "eager")
    assert eager["plan"]["attention_kernel"] == "eager"


def test_the_gpus_compute_capability_picks_the_kernel_label_and_finetuning_defaults_to_the_trainer(capsys):
    """cuDNN comes first on sm90 (H100) only; an RTX 4090 (sm89) and an A100 (sm80) run flash.
    A fine-tuning plan without --runtime is transformers' Trainer step (the bundled trainer
    trains every weight)."""
    bf16 = ("llama3-8b", "--gpus", "8", "--zero", "3", "--precision", "bf16-mixed")
    assert estimate_json(capsys, *bf16, "--gpu", "a100-80gb")["plan"]["attention_kernel"] == "flash"
    qlora = estimate_json(capsys, "llama3-8b", "--gpus", "1", "--gpu", "rtx-4090", "--finetune", "qlora")
    assert qlora["plan"]["attention_kernel"] == "flash" and qlora["plan"]["runtime"] == "hf"
