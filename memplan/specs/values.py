"""Values given as flags or as arguments of the Python API, parsed into what the library takes:
sizes (``2GiB``), name lists (``q_proj,v_proj``), and the GPU and GPU count of the commands that run
on this machine's GPUs. Errors name the flag (``--host-memory``), as the command line prints them."""

from __future__ import annotations

from memplan.errors import MemplanError
from memplan.specs.detect import AUTO, AutoGPU, auto_gpu, probe
from memplan.specs.loader import load_gpu, short
from memplan.specs.resolve import CLI
from memplan.units import parse_bytes


def gpu_and_count(ref: str, gpus: int | None) -> tuple[AutoGPU, int]:
    """``--gpu`` and ``--gpus`` of the commands that run on this machine's GPUs (tune): ``auto``
    through NVML (:mod:`memplan.specs.detect`), and ``--gpus`` not given the count NVML detects.
    The returned ``note`` says what was detected and used; empty when nothing was."""
    found = probe() if ref.lower() == AUTO or gpus is None else None
    if ref.lower() == AUTO:
        chosen = auto_gpu(found)
    else:
        try:
            chosen = AutoGPU(load_gpu(ref), len(found.devices) if found else 0, "", ref)
        except MemplanError as err:
            if err.source:
                raise
            raise MemplanError(err.reason, source=CLI, field="--gpu") from None
    if gpus is not None:
        return chosen, gpus
    if found is None or not found.devices:
        why = found.why if found is not None else "not asked"
        raise MemplanError(f"no GPU detected ({why}): give the total, e.g. --gpus 8", source=CLI, field="--gpus")
    count = len(found.devices)
    detected = f"gpus {count} (detected: {count} x {found.devices[0].name})"
    note = f"{chosen.note}; {detected}" if chosen.note else detected
    return AutoGPU(chosen.spec, count, note, chosen.ref), count


def memory_limit_bytes(text: str | None, field: str = "--memory-limit") -> int | None:
    """``--memory-limit`` (e.g. ``2GiB``; or the size flag ``field``) in bytes; None when not given."""
    if text is None:
        return None
    try:
        limit = parse_bytes(text)
    except ValueError as err:
        raise MemplanError(str(err), source=CLI, field=field) from None
    except OverflowError:  # 1e400GiB: a float too large to be a number of bytes
        raise MemplanError(f"{short(text, 60)!r} is not a finite size", source=CLI, field=field) from None
    if limit <= 0:
        raise MemplanError("must be a positive size, e.g. 2GiB", source=CLI, field=field)
    return limit


def host_memory_bytes(text: str | None, gpu_note: str) -> tuple[int | None, str]:
    """``--host-memory`` in bytes and where the figure comes from: as given; else, when ``--gpu auto``
    detected the GPU on this machine (its note says ``detected``), this machine's MemTotal; else
    (None, "") and nothing is checked (``costmodel.host``)."""
    if text is not None:
        size = memory_limit_bytes(text, "--host-memory")
        return size, "--host-memory"
    if "(detected:" in gpu_note:
        from memplan.costmodel.host import mem_total_bytes

        total = mem_total_bytes()
        return (total, "MemTotal of this machine, where the GPU was detected") if total else (None, "")
    return None, ""


def name_list(text: str | None, field: str) -> tuple[str, ...] | None:
    """A comma-separated flag value (``--lora-targets q_proj,v_proj``) as a tuple; None when not given."""
    if text is None:
        return None
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise MemplanError("an empty name in the list (write names separated by commas)", source=CLI, field=field)
    return names
