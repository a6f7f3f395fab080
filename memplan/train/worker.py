"""One rank's process: ``python -m memplan.train.worker SPEC.json OUT_DIR``.

Reads a RunSpec, runs it, writes ``OUT_DIR/rank{R}.json`` the moment the run ends (whatever
the outcome) and prints ``progress STEP TOTAL`` lines on stdout for the launcher's bar.
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
        print(f"progress {step} {total}", flush=True)

    from memplan.train.runner import run

    record = run(spec, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"rank{record.rank}.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(target)
    print(f"done {record.status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
