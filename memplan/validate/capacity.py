"""Whether this machine can take a validation run, checked before it starts.

A run on the CPU holds every rank's tensors in host memory: ``memplan validate llama3-70b`` would
start allocating 1.5 TiB on a 24 GiB machine. The predicted peak (the estimate's, per rank, times
the ranks this host runs) is compared with what the machine has free; a run that cannot fit is
refused with the figures, unless ``--force`` (or ``--memory-limit``, which makes the run stop at
that simulated capacity instead). On CUDA the device's own out-of-memory is caught and reported,
and may be what the run is for (an OOM boundary): not refused. ``--device cuda`` where torch sees
no GPU is one line.
"""

from __future__ import annotations

from pathlib import Path

from memplan.errors import MemplanError
from memplan.units import format_bytes

MEMINFO = Path("/proc/meminfo")


def host_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (Linux); None where there is none."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_cuda(field: str, source: str) -> None:
    """``--device cuda`` on a machine where torch sees no GPU: one line, before any work."""
    import torch

    if not torch.cuda.is_available():
        built = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise MemplanError(
            f"cuda was asked for, but torch sees no GPU here ({built}, torch {torch.__version__}); use --device cpu",
            source=source,
            field=field,
        )


def check_fits_here(needed: int, available: int | None, where: str, source: str) -> None:
    """Refuse a run whose predicted memory exceeds what ``where`` has free (None: unknown, allowed)."""
    if available is None or needed <= available:
        return
    raise MemplanError(
        f"the run would take about {format_bytes(needed, 'GiB')} of {where} memory (the predicted peak of the "
        f"ranks it runs here) and {format_bytes(available, 'GiB')} is free: choose a smaller plan, simulate one rank "
        "(--simulate-ranks), cap it with --memory-limit, or --force to start anyway",
        source=source,
        field="plan",
    )
