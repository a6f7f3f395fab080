"""A ``memplan validate`` run with its worker under ``torch.profiler``: the step time term by term.

    python benchmarks/gpu_step_profile.py OUT.json -- VALIDATE ARGS...

Runs ``memplan validate VALIDATE ARGS --format json`` (one rank: the plan's busiest, simulated as
validate does by default) with the worker started under this file's ``--worker`` mode, which wraps
``memplan.train.worker`` in ``torch.profiler.profile`` (CUDA activity only: the kernels' own
durations, measured by CUPTI on the device, unaffected by the host-side overhead of tracing). The
profiler skips the warm-up step and records the measured steps (``memplan.train.worker.say``'s
``progress`` lines step it). ``OUT.json`` gets validate's JSON (predicted and measured memory, and
step time) and, per kernel name, the calls and the summed device time per measured step, largest
first, with each kernel put in a class (GEMM, attention, element-wise, reduction, copy, NCCL,
bitsandbytes, other) by its name. That is what issue 26's "found term by term" needs: the time
model's terms (docs/cost-model.md) against the kernels that ran.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

CLASSES = (  # first match wins; kernel names as CUPTI reports them (demangled)
    ("bitsandbytes", re.compile(r"kDequantize|kQuantize|kgemm_4bit|kInt8|kspmm|dequantize|bnb", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|cudnn.*(mha|sdpa)", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|cublas|nvjet|wgmma|matmul|_mm_", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|cat|fill|index|gather|scatter", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|sum|mean|max|cross_entropy|nll", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|foreach|adam|pointwise|triton", re.I)),
)


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def worker(out: Path, argv: list[str]) -> int:
    """``--worker OUT SPEC RECORDS``: ``memplan.train.worker`` under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from memplan.train import worker as w
    from memplan.validate.spec import RunSpec

    spec = RunSpec.model_validate_json(Path(argv[0]).read_text())
    cuda = torch.cuda.is_available() and spec.device == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    warmup = spec.warmup
    prof = profile(activities=activities, schedule=schedule(wait=warmup, warmup=0, active=spec.steps, repeat=1))
    say = w.say

    def stepping(line: str) -> None:
        if line.startswith("progress "):
            prof.step()
        say(line)

    w.say = stepping
    with prof:
        code = w.main(argv)
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        us = device_us if cuda else e.self_cpu_time_total
        if us <= 0:
            continue
        rows.append({"name": e.key, "class": kernel_class(e.key), "calls": e.count, "us_per_step": us / spec.steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    by_class: dict[str, float] = {}
    for r in rows:
        by_class[r["class"]] = by_class.get(r["class"], 0.0) + r["us_per_step"]
    out.write_text(json.dumps({"steps": spec.steps, "device": "cuda" if cuda else "cpu", "by_class_us": by_class,
                               "kernels": rows[:200]}, indent=1))  # fmt: skip
    return code


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        return worker(Path(argv[1]), argv[2:])
    out, sep, *args = argv
    if sep != "--":
        raise SystemExit("usage: gpu_step_profile.py OUT.json -- VALIDATE ARGS...")
    out = Path(out)
    kernels = out.with_suffix(".kernels.json")
    from memplan.validate import launch

    original = launch.worker_command

    def profiled(spec, spec_path, out_dir, nproc, snapshot=None):  # noqa: ANN001, ANN202
        cmd = original(spec, spec_path, out_dir, nproc, snapshot)
        i = cmd.index("memplan.train.worker")
        return [*cmd[: i - 1], str(Path(__file__).resolve()), "--worker", str(kernels), *cmd[i + 1 :]]

    launch.worker_command = profiled
    import contextlib
    import io

    from memplan.cli.app import run

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = run(["validate", *args, "--format", "json"])
    doc: dict = {"args": args, "exit_code": code}
    try:
        doc["validate"] = json.loads(text.getvalue())
    except ValueError:
        doc["output"] = text.getvalue()[-4000:]
    if kernels.exists():
        doc["profile"] = json.loads(kernels.read_text())
    out.write_text(json.dumps(doc, indent=1))
    print(f"{out}: exit {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main(sys.argv[1:]))
