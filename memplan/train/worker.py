"""One rank's process: ``python -m memplan.train.worker SPEC.json OUT_DIR``.

Reads a RunSpec, runs it, writes ``OUT_DIR/rank{R}.json`` the moment the run ends (whatever
the outcome) and prints ``progress STEP TOTAL`` lines on stdout for the launcher's bar.

Under torchrun every rank shares one stdout pipe with the launcher, so each line goes out in
one ``write(2)`` (``say``): POSIX keeps a write of at most ``PIPE_BUF`` bytes (4096 on Linux,
pipe(7)) in one piece on a pipe. ``print`` does not: under ``PYTHONUNBUFFERED`` (worker_env) it
writes the text and the newline in two system calls, and two ranks leaving the same collective
printed ``progress 1 2progress 1 2`` (``strace -e inject=write:delay_exit=30000`` makes it happen
on every run), which broke the launcher's parsing (tests/cli/test_validate.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    spec_path, out_dir = Path(argv[0]), Path(argv[1])
    from memplan.validate.spec import RunSpec

    spec = RunSpec.model_validate_json(spec_path.read_text())
    rank = int(os.environ.get("RANK", spec.rank))
    if not spec.simulate:
        spec = spec.model_copy(update={"rank": rank})

    def progress(step: int, total: int) -> None:
        say(f"progress {step} {total}")

    from memplan.train.runner import run

    record = run(spec, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"rank{record.rank}.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(target)
    say(f"done {record.status}")
    return 0


def say(line: str) -> None:
    """One line on stdout in one ``write(2)``: never interleaved with another rank's line (module doc)."""
    sys.stdout.flush()  # anything printed before goes first
    data = (line + "\n").encode()
    while data:  # a pipe takes a line this short whole; the loop is for a file or terminal's short write
        data = data[os.write(sys.stdout.fileno(), data) :]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
