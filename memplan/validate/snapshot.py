"""``memplan validate --snapshot DIR``: each rank's run recorded as a PyTorch memory snapshot.

The launcher starts ``python -m memplan.validate.snapshot PATH memplan.train.worker ...`` in
place of the worker itself: the allocator's history is recorded from the process's start
(``torch.cuda.memory._record_memory_history``, as the six traces of ../shared/gpu-traces were)
and dumped when the worker ends, whatever its outcome (an out-of-memory run is the one most
worth explaining). ``PATH`` may hold ``{rank}``, filled from torchrun's ``RANK``.

Read the result with ``memplan explain PATH MODEL [plan flags]``.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError

MAX_ENTRIES = 3_000_000  # events kept (a 70B ZeRO-3 run of three steps records ~140,000)
CUDA_ONLY = (
    "memory snapshots need CUDA: torch.cuda.memory._record_memory_history records the CUDA caching "
    "allocator, and a CPU run has none (run on a GPU, or drop --snapshot)"
)


def check_snapshot_dir(path: Path, field: str = "--snapshot") -> Path:
    """The folder the snapshots go to: an existing folder, or one to create in an existing folder."""
    source = str(path)
    if path.exists() and not path.is_dir():
        raise MemplanError("is a file, not a folder for the snapshots", source=source, field=field)
    parent = path if path.exists() else path.parent
    if not parent.is_dir():
        raise MemplanError(f"the folder {parent} does not exist", source=source, field=field)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MemplanError(f"cannot write in {parent} (permission denied)", source=source, field=field)
    return path


def refuse_cpu(device: str, field: str = "--snapshot") -> None:
    if device != "cuda":
        raise MemplanError(CUDA_ONLY, source="command line", field=field)


def snapshot_path(folder: Path, name: str, rank: int | None) -> Path:
    """``folder/NAME.rank{R}.pickle``; ``{rank}`` stays for the worker to fill when ``rank`` is None."""
    return folder / f"{name}.rank{'{rank}' if rank is None else rank}.pickle"


@contextmanager
def recording(memory: Any, path: Path, max_entries: int = MAX_ENTRIES) -> Iterator[None]:
    """Record ``memory``'s (``torch.cuda.memory``) allocator history while the block runs, then
    dump it to ``path`` and stop recording, also when the block raises or exits."""
    memory._record_memory_history(enabled="all", context=None, max_entries=max_entries)
    try:
        yield
    finally:
        path.parent.mkdir(parents=True, exist_ok=True)
        memory._dump_snapshot(str(path))
        memory._record_memory_history(enabled=None)


def main(argv: list[str]) -> int:
    """``PATH MODULE ARGS...``: run ``MODULE`` as ``__main__`` with ``ARGS`` while recording."""
    template, module, *args = argv
    import torch

    path = Path(template.replace("{rank}", os.environ.get("RANK", "0")))
    sys.argv = [module, *args]
    code: int | str | None = 0
    with recording(torch.cuda.memory, path):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            code = done.code
    return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
