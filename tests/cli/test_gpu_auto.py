"""``--gpu auto`` through the CLI, with NVML faked at the library boundary (a ``pynvml`` module
in ``sys.modules``): a known card gets its bundled profile, an unknown one a built profile the
header qualifies, no driver or no nvidia-ml-py the h100-sxm default with the reason."""

from __future__ import annotations

import json
import sys
import types

import pytest
import yaml

from memplan.cli.app import run
from memplan.specs import detect

MIB = 2**20


class NVMLError(Exception):
    pass


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def nvml(monkeypatch):
    """``nvml(cards)`` installs a fake pynvml with these (NVML name, MiB) devices, None: no driver;
    returns the list of NVML calls made."""

    def install(cards):
        calls = []
        mod = types.ModuleType("pynvml")
        mod.NVMLError = NVMLError

        def init():
            calls.append("init")
            if cards is None:
                raise NVMLError("Driver Not Loaded")

        mod.nvmlInit = init
        mod.nvmlShutdown = lambda: calls.append("shutdown")
        mod.nvmlDeviceGetCount = lambda: len(cards)
        mod.nvmlDeviceGetHandleByIndex = lambda i: i
        mod.nvmlDeviceGetName = lambda h: cards[h][0]
        mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=cards[h][1] * MIB)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # NVML's list as the fake gives it
        monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name: object() if name == "pynvml" else None)
        return calls

    return install


def memplan(capsys, *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_known_card_is_the_default(nvml, capsys):
    nvml([("NVIDIA A100-SXM4-80GB", 81920)] * 8)
    code, out, err = memplan(capsys, "estimate", "llama3-8b")
    assert code == 0, err
    assert " x a100-80gb " in out
    assert "gpu a100-80gb (detected: 8 x NVIDIA A100-SXM4-80GB)" in out
    code, out, _ = memplan(capsys, "estimate", "llama3-8b", "--format", "json")
    gpu = json.loads(out)["gpu"]
    assert gpu["name"] == "a100-80gb" and gpu["auto"].startswith("gpu a100-80gb (detected")


def test_unknown_card_gets_a_built_profile_and_the_header_says_so(nvml, capsys):
    nvml([("Tesla T4", 15360)])
    code, out, err = memplan(capsys, "estimate", "llama3-8b", "--format", "json")
    assert code in (0, 1), err  # an 8B model does not fit 15 GiB: exit 1 is the verdict, not an error
    gpu = json.loads(out)["gpu"]
    assert gpu["name"] == "tesla-t4" and gpu["memory_bytes"] == 15360 * MIB
    assert "no bundled profile" in gpu["auto"] and "unknown" in gpu["auto"] and "rtx-4090" in gpu["auto"]
    _, out, _ = memplan(capsys, "estimate", "llama3-8b")
    assert "gpu tesla-t4 (detected: 1 x Tesla T4, no bundled profile" in " ".join(out.split())


@pytest.mark.parametrize("installed", [True, False])
def test_no_gpu_defaults_to_h100_sxm_and_says_why(nvml, monkeypatch, capsys, installed):
    if installed:
        nvml(None)
        why = "NVML: Driver Not Loaded"
    else:
        monkeypatch.delitem(sys.modules, "pynvml", raising=False)
        monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name: None)
        why = "nvidia-ml-py not installed"
    code, out, err = memplan(capsys, "estimate", "llama3-8b")
    assert code == 0 and err == ""
    assert f"gpu h100-sxm (default: no GPU detected, {why})" in out
    assert " x h100-sxm " in out


def test_a_named_gpu_does_not_ask_nvml(nvml, capsys):
    calls = nvml([("NVIDIA H200", 143771)])
    code, out, err = memplan(capsys, "estimate", "llama3-8b", "--gpu", "l40s", "--format", "json")
    assert calls == []
    assert "auto" not in json.loads(out)["gpu"]
    code, out, err = memplan(capsys, "estimate", "llama3-8b", "--gpu", "auto")
    assert calls == ["init", "shutdown"] and "gpu h200 (detected: 1 x NVIDIA H200)" in out


def test_tune_gpus_default_to_the_detected_count(nvml, capsys):
    nvml([("NVIDIA H100 80GB HBM3", 81559)] * 4)
    code, out, err = memplan(capsys, "tune", "llama3-8b", "--seq-len", "2048", "--exhaustive", "--out", "p.yaml")
    assert code == 0, err
    assert "gpu h100-sxm (detected: 4 x NVIDIA H100 80GB HBM3); gpus 4 (detected" in " ".join(out.split())
    assert "on 4 x h100-sxm" in out
    written = yaml.safe_load(open("p.yaml"))
    assert (written["gpu"], written["gpus"]) == ("h100-sxm", 4)  # the profile, so the file reads the same anywhere


def test_tune_without_gpus_and_no_gpu_is_one_line(nvml, capsys):
    nvml(None)
    code, out, err = memplan(capsys, "tune", "llama3-8b")
    assert code == 2
    assert err.strip().splitlines() == [
        "memplan: error: command line: --gpus: no GPU detected (NVML: Driver Not Loaded): give the total, e.g. --gpus 8"
    ]


TINY = """name: tiny
hidden_size: 128
num_layers: 2
num_attention_heads: 4
num_kv_heads: 2
ffn_size: 256
vocab_size: 1000
"""


@pytest.mark.slow  # the default suite's time: a real validate run
def test_validate_gpus_default_to_the_detected_count(nvml, capsys, tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "tiny.yaml").write_text(TINY)
    nvml([("NVIDIA L40S", 46068)] * 2)
    args = ["validate", "tiny.yaml", "--precision", "fp32", "--seq-len", "64", "--micro-batch", "2", "--steps", "1"]
    code, out, err = memplan(capsys, *args, "--device", "cpu")
    assert code == 0, err
    text = " ".join(out.split())
    assert "gpu l40s (detected: 2 x NVIDIA L40S); gpus 2 (detected: 2 x NVIDIA L40S)" in text
    assert "of 2, simulated" in text
    code, out, err = memplan(capsys, *args, "--device", "cpu", "--dp", "1", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["world_size"] == 1
