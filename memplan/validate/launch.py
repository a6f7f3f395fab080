"""Start the ranks of a validation run, watch them, and end them all on failure or timeout.

Rank simulation starts one worker process. A real multi-rank run starts them under torchrun
(``python -m torch.distributed.run --nproc-per-node N``; across nodes, the same command on
each node with ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint``). The launcher reads
the workers' progress lines; if a rank exits with an error, or nothing finishes within the
timeout, it kills the whole process group and reports which ranks had not written a record.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memplan.validate.record import RunRecord
from memplan.validate.spec import RunSpec

# a rank's ``progress STEP TOTAL`` line (memplan.train.worker.say); any other line is not read: the bar
# is a display, and a line it cannot read (a library printing on stdout) must not end the run
PROGRESS = re.compile(r"progress (\d+) (\d+)")


@dataclass(frozen=True)
class LaunchResult:
    records: dict[int, RunRecord]
    missing: list[int]  # ranks that wrote no record (died or hung)
    timed_out: bool
    returncode: int | None
    stderr_tail: str


def worker_command(
    spec: RunSpec, spec_path: Path, out_dir: Path, nproc: int, snapshot: Path | None = None
) -> list[str]:
    """The ranks' command; with ``snapshot`` (a path that may hold ``{rank}``) each rank runs under
    ``memplan.validate.snapshot``, which records its allocator history to that file."""
    worker = ["-m", "memplan.train.worker", str(spec_path), str(out_dir)]
    if snapshot is not None:
        worker = ["-m", "memplan.validate.snapshot", str(snapshot), *worker[1:]]
    if spec.simulate or nproc == 1:
        return [sys.executable, *worker]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        *worker,
    ]


def worker_env(spec: RunSpec) -> dict[str, str]:
    """The ranks' environment: this one's, unbuffered, one OpenMP thread unless set, and the
    caching allocator's settings the plan was predicted under."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if spec.alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = spec.alloc_conf
    return env


def launch(
    spec: RunSpec,
    workdir: Path,
    timeout_s: float,
    progress: Callable[[int, int], None] | None = None,
    snapshot: Path | None = None,
) -> LaunchResult:
    """Run the spec's ranks as child processes; never raises for what happens inside them.
    ``snapshot``: record each rank's memory snapshot there (``worker_command``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    out_dir = workdir / "records"
    ranks = [spec.rank] if spec.simulate else list(range(spec.plan.world_size))
    cmd = worker_command(spec, spec_path, out_dir, len(ranks), snapshot)
    env = worker_env(spec)
    err_path = workdir / "stderr.log"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            timed_out = _watch(lines, time.monotonic() + timeout_s, progress)
        except BaseException:  # the progress callback, or Ctrl-C: no rank outlives the launcher
            _kill(proc)
            raise
        if timed_out:
            _kill(proc)
        try:
            returncode = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill(proc)
            returncode = proc.wait()
    records = {}
    for rank in ranks:
        path = out_dir / f"rank{rank}.json"
        if path.exists():
            records[rank] = RunRecord.model_validate_json(path.read_text())
    missing = [r for r in ranks if r not in records]
    tail = err_path.read_text()[-4000:] if err_path.exists() else ""
    return LaunchResult(records, missing, timed_out, returncode, tail)


def _watch(lines: queue.Queue[str | None], deadline: float, progress: Callable[[int, int], None] | None) -> bool:
    """Read the ranks' lines until their stdout closes (False) or the deadline passes (True)."""
    while True:
        try:
            line = lines.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            line = ""
        if line is None:
            return False
        if progress is not None and (match := PROGRESS.fullmatch(line.strip())):
            progress(int(match[1]), int(match[2]))
        if time.monotonic() > deadline:
            return True


def pick_record(spec: RunSpec, result: LaunchResult) -> RunRecord:
    """The most-loaded rank's record, or a failure record naming the ranks that never reported."""
    if spec.rank in result.records and not result.missing:
        return result.records[spec.rank]
    failed = [r for r in result.records.values() if r.status != "ok"]
    if failed and not result.timed_out:
        return failed[0]
    what = "timed out" if result.timed_out else f"exited with code {result.returncode}"
    last = [ln for ln in result.stderr_tail.strip().splitlines() if ln.strip()][-1:] or [""]
    reason = f"ranks {result.missing} {what} without a record" + (f": {last[0][:300]}" if last[0] else "")
    base = next(iter(result.records.values()), None)
    return RunRecord(
        status="timeout" if result.timed_out else "error",
        reason=reason,
        device_name=base.device_name if base else spec.device,
        versions=base.versions if base else {},
        started="",
        finished="",
        **spec.record_fields(simulated=spec.simulate),
    )


def _kill(proc: subprocess.Popen) -> None:
    """End the worker and everything it started (torchrun's ranks share its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
