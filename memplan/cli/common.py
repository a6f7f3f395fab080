"""Option parsing shared by the commands: devices, GPUs, output paths, sizes and name lists (the
plan flags themselves are defined once in :mod:`memplan.cli.options` and :mod:`memplan.cli.planflags`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from memplan.errors import MemplanError
from memplan.specs.detect import probe
from memplan.specs.loader import short
from memplan.specs.resolve import CLI


def auto_device(requested: str, needs: str, field: str) -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``, for ``auto``; torch is imported only here.
    ``needs`` names what wants torch, for the error where the train extra is missing. ``cuda`` asked
    for where torch sees no GPU is refused here, before any run (one line, not a failed run per entry)."""
    if requested not in ("auto", "cuda"):
        return requested
    try:
        import torch
    except ImportError:  # pragma: no cover - the train extra brings torch
        raise MemplanError(
            f"{needs} needs the train extra: pip install 'memplan[train]'", source=CLI, field=field
        ) from None
    if requested == "cuda":
        from memplan.validate.capacity import require_cuda

        require_cuda("--device", CLI)
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def detected_gpus() -> tuple[int | None, str]:
    """The GPUs NVML detects here (None: none) and the line saying so (empty: none)."""
    found = probe()
    if not found.devices:
        return None, ""
    count = len(found.devices)
    return count, f"gpus {count} (detected: {count} x {found.devices[0].name})"


NAME_MAX = 255  # bytes of one file name on Linux, macOS and Windows file systems


def output_path(given: str | Path | None, field: str, inputs: tuple[str | Path | None, ...] = ()) -> None:
    """Check, before any work, that a file can be written at ``path`` (None: not asked for):
    not a directory, not one of the command's own ``inputs`` (it would be written over), each
    missing parent creatable (they are created when the file is written), the place writable. A
    failure names the flag and the path, shortened."""
    if given is None:
        return
    text, path = str(given), Path(given)

    def fail(reason: str) -> MemplanError:
        return MemplanError(f"{short(text, 100)}: {reason}", source=CLI, field=field)

    if not text.strip():
        raise MemplanError("an empty path: give a file name", source=CLI, field=field)
    for source in inputs:
        if source is not None and Path(source).is_file() and path.is_file() and path.samefile(source):
            raise fail("is this command's own input: it would be written over; give another file")

    if text.endswith(("/", "\\")) or _is_dir(path):
        raise fail("is a directory: give a file name")
    too_long = next((part for part in path.parts if len(os.fsencode(part)) > NAME_MAX), None)
    if too_long is not None:
        raise fail(f"a file name of {len(too_long):,} characters is too long (at most {NAME_MAX} bytes)")
    if path.exists() and not os.access(path, os.W_OK):
        raise fail("cannot be written (permission denied)")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise fail(f"{short(parent, 60)} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise fail(f"cannot write in {short(parent, 60)} (permission denied)")
    try:  # what the permission bits do not tell (a read-only mount, /proc; root passes every access())
        if path.exists():
            with path.open("a"):
                pass
        else:
            import tempfile  # only for an output path, off the estimate path's imports

            with tempfile.NamedTemporaryFile(dir=parent, prefix=".memplan-probe-"):
                pass
    except OSError as exc:
        raise fail(f"cannot be written ({exc.strerror or exc.__class__.__name__})") from None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def warn(lines: tuple[str, ...] | list[str]) -> None:
    """Warnings (legal but suspicious inputs) as one stderr line each."""
    for line in lines:
        print(f"memplan: warning: {' '.join(line.split())}", file=sys.stderr)


HOST_MEMORY_HELP = (
    "Host RAM per node (e.g. 64GiB): CPU-offloaded states and activations (pinned) must fit in it. "
    "Default: this machine's MemTotal when --gpu auto detected the GPU here; else not checked."
)
