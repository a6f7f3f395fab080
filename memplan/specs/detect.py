"""``--gpu auto``: the GPU this machine has, through NVML (nvidia-ml-py, the ``nvml`` extra).

The card's name (``nvmlDeviceGetName``) and memory (``nvmlDeviceGetMemoryInfo().total``) pick a
bundled profile; a card no profile describes gets one built from what NVML tells. NVML does not
report peak FLOP/s or bandwidths: the built profile borrows the slowest bundled NVIDIA profile's
figures and says so in its ``sources`` and in the note the CLI prints. Without nvidia-ml-py, a
driver or a GPU, the default is ``h100-sxm``, with the reason.

``pynvml`` is imported only inside :func:`probe`, and only when it is installed
(``importlib.util.find_spec``), so the estimate path stays light and the probe cheap (no NVML:
microseconds; with a driver: one ``nvmlInit``, tens of milliseconds).
"""

from __future__ import annotations

import importlib.util
import os
import re
import time

from memplan.records import record
from memplan.specs.hardware import GPUSpec
from memplan.specs.loader import load_gpu

AUTO = "auto"
DEFAULT_GPU = "h100-sxm"
# the slowest bundled NVIDIA profile (dense bf16 165 TFLOP/s, 1 TB/s, PCIe Gen4): what a card
# no profile describes is assumed to reach, so its predicted step time errs long
FALLBACK_FIGURES = "rtx-4090"
# how far NVML's memory total may sit from a profile's (ECC on or off moves it ~6%, e.g. L40S
# 46068 MiB with ECC, 49140 MiB without) and still be that card; 40 GB and 80 GB parts differ 2x
MEMORY_TOLERANCE = 0.08

# NVML names (nvidia-smi --query-gpu=name) of the parts the bundled profiles describe; the
# memory check then separates the 40 GB and 80 GB A100 and refuses look-alikes (H100 NVL 94 GB).
# PCIe A100s and the H200 NVL are other parts (power, links): they get a built profile.
NAMES: tuple[tuple[str, str], ...] = (
    (r"\bh100\b.*\bpcie\b", "h100-pcie"),  # "NVIDIA H100 PCIe"
    (r"\bh100\b.*\b(hbm3|sxm)", "h100-sxm"),  # "NVIDIA H100 80GB HBM3"
    (r"\bh200\b(?!.*\bnvl\b)", "h200"),  # "NVIDIA H200"
    (r"\ba100-sxm4-40gb\b", "a100-40gb"),  # "NVIDIA A100-SXM4-40GB"
    (r"\ba100-sxm4-80gb\b", "a100-80gb"),  # "NVIDIA A100-SXM4-80GB"
    (r"\bb200\b", "b200"),  # "NVIDIA B200"
    (r"\bl40s\b", "l40s"),  # "NVIDIA L40S"
    (r"\brtx 4090\b(?!.*\blaptop\b)", "rtx-4090"),  # "NVIDIA GeForce RTX 4090"
)


@record()
class Device:
    """One GPU as NVML describes it."""

    name: str
    memory_bytes: int

    def __init__(
        self,
        name: str,
        memory_bytes: int,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "name", name)
        _set(self, "memory_bytes", memory_bytes)


@record()
class Probe:
    """What NVML found: the devices, or why none (``why``), and how long asking took."""

    devices: tuple[Device, ...] = ()
    why: str = ""
    seconds: float = 0.0

    def __init__(
        self,
        devices: tuple[Device, ...] = (),
        why: str = "",
        seconds: float = 0.0,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "devices", devices)
        _set(self, "why", why)
        _set(self, "seconds", seconds)


@record()
class AutoGPU:
    """The GPU ``--gpu auto`` resolved to, how many there are (0: none detected), the header
    line that says which and why, and the reference a plan file records (a profile name, or
    ``auto`` for a built profile, which no name reloads)."""

    spec: GPUSpec
    count: int
    note: str
    ref: str = AUTO

    def __init__(
        self,
        spec: GPUSpec,
        count: int,
        note: str,
        ref: str = AUTO,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "spec", spec)
        _set(self, "count", count)
        _set(self, "note", note)
        _set(self, "ref", ref)


def probe() -> Probe:
    """Ask NVML for the devices here; never raises (no library, no driver: ``why`` says)."""
    start = time.perf_counter()
    if importlib.util.find_spec("pynvml") is None:
        return Probe(why="nvidia-ml-py not installed", seconds=time.perf_counter() - start)
    import pynvml

    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError (no driver) or the library missing
        return Probe(why=f"NVML: {_reason(exc)}", seconds=time.perf_counter() - start)
    try:
        devices = tuple(_device(pynvml, i) for i in range(int(pynvml.nvmlDeviceGetCount())))
    except Exception as exc:  # noqa: BLE001 - a device NVML cannot describe: treat as none
        return Probe(why=f"NVML: {_reason(exc)}", seconds=time.perf_counter() - start)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - shutting down is best effort
            pass
    devices, hidden = visible(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    why = "CUDA_VISIBLE_DEVICES hides them" if hidden and not devices else "NVML reports 0 GPUs"
    return Probe(devices=devices, why="" if devices else why, seconds=time.perf_counter() - start)


def visible(devices: tuple[Device, ...], env: str | None) -> tuple[tuple[Device, ...], bool]:
    """The devices CUDA (so PyTorch) sees, and whether ``CUDA_VISIBLE_DEVICES`` hid any: NVML
    lists every GPU regardless. Integer indices are followed up to the first invalid one, as CUDA
    does; UUIDs (``GPU-...``, ``MIG-...``) are not resolved here and leave the list as NVML gives it."""
    if env is None:
        return devices, False
    picked = []
    for entry in env.split(","):
        entry = entry.strip()
        if not entry.lstrip("-").isdigit():
            if entry.startswith(("GPU-", "MIG-")):
                return devices, False
            break
        index = int(entry)
        if not 0 <= index < len(devices):
            break
        picked.append(devices[index])
    return tuple(picked), len(picked) < len(devices)


def _device(pynvml, index: int) -> Device:  # noqa: ANN001 - the pynvml module
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(handle)
    if isinstance(name, bytes):  # nvidia-ml-py before 11.515 returns bytes
        name = name.decode(errors="replace")
    return Device(name=str(name).strip(), memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total))


def _reason(exc: Exception) -> str:
    return " ".join(str(exc).split()) or exc.__class__.__name__


def match_profile(device: Device) -> str | None:
    """The bundled profile describing ``device`` (its NVML name, and its memory within
    :data:`MEMORY_TOLERANCE` of the profile's), else None."""
    lowered = device.name.lower()
    for pattern, profile in NAMES:
        if re.search(pattern, lowered):
            known = load_gpu(profile).memory_bytes
            return profile if abs(device.memory_bytes - known) <= MEMORY_TOLERANCE * known else None
    return None


def built_spec(device: Device) -> GPUSpec:
    """A profile for a card no bundled profile describes: memory from NVML; peak FLOP/s and
    bandwidths, which NVML does not report, from :data:`FALLBACK_FIGURES`, said in ``sources``."""
    base = load_gpu(FALLBACK_FIGURES)
    borrowed = f"unknown (NVML does not report it): {FALLBACK_FIGURES}'s figure assumed, not this card's"
    slug = re.sub(r"[^a-z0-9]+", "-", device.name.lower()).strip("-") or "unknown-gpu"
    return GPUSpec(
        name=slug,
        display_name=f"{device.name} (detected)",
        vendor="nvidia",
        memory_bytes=device.memory_bytes,
        hbm_bytes_per_s=base.hbm_bytes_per_s,
        peak_flops=dict(base.peak_flops),
        pcie_bytes_per_s=base.pcie_bytes_per_s,
        sources={
            "memory_bytes": "NVML nvmlDeviceGetMemoryInfo().total on this machine (PyTorch sees somewhat less)",
            "hbm_bytes_per_s": borrowed,
            "peak_flops": borrowed,
            "pcie_bytes_per_s": borrowed,
        },
    )


def auto_gpu(found: Probe | None = None) -> AutoGPU:
    """``--gpu auto``: device 0's bundled profile, else one built from NVML, else ``h100-sxm``."""
    found = probe() if found is None else found
    if not found.devices:
        return AutoGPU(
            load_gpu(DEFAULT_GPU), 0, f"gpu {DEFAULT_GPU} (default: no GPU detected, {found.why})", DEFAULT_GPU
        )
    first, count = found.devices[0], len(found.devices)
    mixed = "; the GPUs differ, device 0 used" if len({d.name for d in found.devices}) > 1 else ""
    profile = match_profile(first)
    if profile is not None:
        return AutoGPU(load_gpu(profile), count, f"gpu {profile} (detected: {count} x {first.name}{mixed})", profile)
    spec = built_spec(first)
    note = (
        f"gpu {spec.name} (detected: {count} x {first.name}, no bundled profile; memory "
        f"{first.memory_bytes / 2**30:.2f} GiB from NVML; peak FLOP/s and bandwidths unknown, "
        f"{FALLBACK_FIGURES}'s assumed, so step time is not this card's{mixed})"
    )
    return AutoGPU(spec, count, note)
