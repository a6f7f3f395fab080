"""``--gpu auto``'s detection, with NVML faked at the library boundary (a ``pynvml`` module)."""

from __future__ import annotations

import sys
import types

import pytest

from memplan.specs import detect
from memplan.specs.detect import Device, auto_gpu, match_profile, probe

MIB = 2**20


class NVMLError(Exception):
    pass


def fake_pynvml(cards: list[tuple[str, int]] | None, calls: list[str] | None = None) -> types.ModuleType:
    """A ``pynvml`` whose devices are ``cards`` (name, MiB); None: nvmlInit fails (no driver)."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    log = calls if calls is not None else []

    def init():
        log.append("init")
        if cards is None:
            raise NVMLError("Driver Not Loaded")

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: log.append("shutdown")
    mod.nvmlDeviceGetCount = lambda: len(cards)
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: cards[h][0]
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=cards[h][1] * MIB, used=0, free=0)
    return mod


@pytest.fixture
def nvml(monkeypatch):
    """Install a fake pynvml: ``nvml(cards)``; find_spec sees it as installed."""

    def install(cards, calls=None):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(cards, calls))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # NVML's list as the fake gives it
        monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name: object() if name == "pynvml" else None)

    return install


@pytest.mark.parametrize(
    ("name", "mib", "profile"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm"),
        ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
        ("NVIDIA H200", 143771, "h200"),
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
        ("NVIDIA B200", 183359, "b200"),
        ("NVIDIA L40S", 46068, "l40s"),
        ("NVIDIA L40S", 49140, "l40s"),  # ECC off
        ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090"),
        ("NVIDIA H100 NVL", 95830, None),  # another part: memory differs from both H100 profiles
        ("NVIDIA A100 80GB PCIe", 81920, None),  # not the SXM4 part the profile describes
        ("NVIDIA GeForce RTX 4090 Laptop GPU", 16376, None),
        ("Tesla T4", 15360, None),
    ],
)
def test_match_profile(name, mib, profile):
    assert match_profile(Device(name, mib * MIB)) == profile


def test_known_card_gets_its_bundled_profile(nvml):
    calls = []
    nvml([("NVIDIA A100-SXM4-80GB", 81920)] * 4, calls)
    auto = auto_gpu()
    assert (auto.spec.name, auto.count) == ("a100-80gb", 4)
    assert auto.note == "gpu a100-80gb (detected: 4 x NVIDIA A100-SXM4-80GB)"
    assert calls == ["init", "shutdown"]


def test_unknown_card_gets_a_built_profile_that_says_what_it_assumes(nvml):
    nvml([("Tesla T4", 15360)])
    auto = auto_gpu()
    assert auto.count == 1
    assert auto.spec.name == "tesla-t4"
    assert auto.spec.memory_bytes == 15360 * MIB
    assert auto.spec.nvlink_bytes_per_s is None and auto.spec.efficiency is None
    assert "NVML" in auto.spec.sources["memory_bytes"]
    assert "not this card's" in auto.spec.sources["peak_flops"]
    assert "no bundled profile" in auto.note and "unknown" in auto.note and "rtx-4090" in auto.note


def test_mixed_cards_use_device_0_and_say_so(nvml):
    nvml([("NVIDIA H200", 143771), ("NVIDIA L40S", 46068)])
    auto = auto_gpu()
    assert (auto.spec.name, auto.count) == ("h200", 2)
    assert "device 0 used" in auto.note


def test_no_driver_defaults_to_h100_sxm(nvml):
    calls = []
    nvml(None, calls)
    auto = auto_gpu()
    assert (auto.spec.name, auto.count) == ("h100-sxm", 0)
    assert auto.note == "gpu h100-sxm (default: no GPU detected, NVML: Driver Not Loaded)"
    assert calls == ["init"]


def test_zero_devices_defaults_to_h100_sxm(nvml):
    nvml([])
    auto = auto_gpu()
    assert (auto.spec.name, auto.count) == ("h100-sxm", 0)
    assert "NVML reports 0 GPUs" in auto.note


def test_not_installed_defaults_to_h100_sxm_without_importing(monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name: None)
    found = probe()
    assert found.why == "nvidia-ml-py not installed" and found.devices == ()
    assert "pynvml" not in sys.modules
    auto = auto_gpu(found)
    assert auto.note == "gpu h100-sxm (default: no GPU detected, nvidia-ml-py not installed)"


def test_bytes_names_from_old_nvidia_ml_py(nvml, monkeypatch):
    nvml([("x", 0)])
    monkeypatch.setattr(sys.modules["pynvml"], "nvmlDeviceGetName", lambda h: b"NVIDIA H100 PCIe")
    monkeypatch.setattr(
        sys.modules["pynvml"], "nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(total=81559 * MIB)
    )
    assert auto_gpu().spec.name == "h100-pcie"


@pytest.mark.parametrize(
    ("env", "indices", "hidden"),
    [
        (None, [0, 1, 2, 3], False),
        ("2,0", [2, 0], True),
        ("1,7,2", [1], True),  # CUDA stops at the first invalid index
        ("", [], True),
        ("-1", [], True),
        ("GPU-8f6e2a1c-0000", [0, 1, 2, 3], False),  # UUIDs are not resolved: NVML's list
    ],
)
def test_cuda_visible_devices(env, indices, hidden):
    devices = tuple(Device(f"gpu{i}", 2**30) for i in range(4))
    assert detect.visible(devices, env) == (tuple(devices[i] for i in indices), hidden)


def test_hidden_gpus_are_not_counted(nvml, monkeypatch):
    nvml([("NVIDIA H100 PCIe", 81559)] * 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert (auto_gpu().spec.name, auto_gpu().count) == ("h100-pcie", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert auto_gpu().note == "gpu h100-sxm (default: no GPU detected, CUDA_VISIBLE_DEVICES hides them)"
