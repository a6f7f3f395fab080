"""``memplan check --measure``: an entry's peak measured by the bundled trainer (``memplan validate``).

The one part of ``memplan.check`` that runs something: the trainer in a child process
(``memplan.validate.launch``), the most-loaded rank alone under the fake process group. Needs
the ``train`` extra. ``reserved`` is only measured on CUDA (the caching allocator); on a CPU,
hold such entries to ``metric: allocated``. A run that fails, times out or cannot apply the
plan gives no value, and the entry fails as not evaluated.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from memplan.check.evaluate import Measurement, Resolved
from memplan.estimation import estimate
from memplan.specs.workload import TrainingWorkload
from memplan.validate.launch import launch
from memplan.validate.spec import RunSpec
from memplan.validate.support import TrainerUnsupported, check_model, check_plan, check_workload


def measure(r: Resolved, device: str, timeout_s: float, steps: int = 2) -> Measurement:
    """Run the entry's most-loaded rank for ``steps`` steps after one warm-up; its peak in the metric."""
    job = r.job
    if not isinstance(job.workload, TrainingWorkload):
        return Measurement(value_bytes=None, reason="the trainer measures training workloads only")
    if r.metric == "reserved" and device != "cuda":
        return Measurement(value_bytes=None, reason=f"reserved is measured on CUDA only (this run is on {device})")
    rank = estimate(job, with_suggestions=False, device=device).memory.peak.rank
    spec = RunSpec(
        model=job.model, workload=job.workload, plan=job.plan, steps=steps, device=device, simulate=True, rank=rank
    )
    try:
        check_model(spec.model)
        check_plan(spec.plan)
        check_workload(spec)
    except TrainerUnsupported as err:
        return Measurement(value_bytes=None, reason=f"the trainer cannot run it: {err.field}: {err.reason}")
    with tempfile.TemporaryDirectory(prefix="memplan-check-") as tmp:
        result = launch(spec, Path(tmp), timeout_s)
    record = result.records.get(rank)
    if record is None:
        what = "timed out" if result.timed_out else f"exited with code {result.returncode}"
        tail = [ln for ln in result.stderr_tail.strip().splitlines() if ln.strip()][-1:]
        return Measurement(value_bytes=None, reason=f"the run {what}" + (f": {tail[0][:200]}" if tail else ""))
    if record.status != "ok":
        return Measurement(value_bytes=None, reason=f"the run ended {record.status}: {record.reason}")
    if r.metric == "reserved":
        if record.peak_reserved is None:
            return Measurement(value_bytes=None, reason="the run recorded no reserved peak")
        return Measurement(value_bytes=record.peak_reserved)
    return Measurement(value_bytes=record.peak_allocated)
