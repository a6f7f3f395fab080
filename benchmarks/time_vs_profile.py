"""The step-time model term by term against the kernels a GPU ran (issue 26).

    python benchmarks/time_vs_profile.py [RUNS.json ...] [--format json]

For each ``prof-*`` run of each RUNS.json (default: tests/data/gpu-runs/h200-2026-11-28.json and
h100-2026-11-28.json; a ``memplan validate`` run under benchmarks/gpu_step_profile.py, the GPU
alone) it reads the kernel table of ``profiles/<device>-<name>.json`` beside it (the device: the
file name's first word, ``h200`` or ``h100``) and prints, per term, the model's seconds
(``memplan.costmodel.time``, the plan of the run's ``args``, the bundled trainer's runtime) against
the summed device time of the kernels that term prices:

- ``gemm (tensor cores)``: the linears' GEMMs in bf16 / fp16 (cuBLAS's ``nvjet_sm90`` kernels and
  their split-K reductions); the model's forward, recomputed forward and backward GEMMs, and the LM
  head where it runs in the compute dtype.
- ``gemm (fp32, CUDA cores)``: IEEE fp32 GEMMs (``sm80_xmma_gemm_f32f32``, ``cutlass ... sgemm``):
  over a quantized base the LM head and SDPA's math path (its two batched GEMMs), and the fp32 LoRA
  adapters' r-wide GEMMs, which the model prices as bytes inside ``lora_adapters``.
- ``attention (fused)``: cuDNN's / flash's fused kernels and their helpers (``cudnn::fusion``).
- ``memory-bound``: every other element-wise, copy, cast, reduction and fill kernel: the model's
  ``memory_bound`` (norms, RoPE, activation, residual adds, casts, loss, the math path's score
  traffic), ``lora_adapters``, ``quant_casts`` and ``dequant`` (bitsandbytes' kernels).
- ``optimizer``: ``multi_tensor_apply`` kernels (``torch.optim.AdamW(foreach=True)``).

A mapping of kernels to terms, by name; the profile's classes are benchmarks/gpu_step_profile.py's.

Two readings beside the split (docs/cost-model.md, "The step time against kernel profiles"):

- ``kernel_rate``: the model with its bf16 GEMMs at a cuBLAS kernel rate (``CUBLAS_KERNEL_FRACTION``,
  a microbenchmark of one large GEMM, not a training step) in place of the GPU profile's fitted
  whole-step ``matmul``: the GEMM term and the step each way.
- ``memory_kinds``: the memory-bound kernels' time split by how ATen launches them
  (:func:`memory_kind`): vectorised contiguous kernels, whose time follows HBM bandwidth, and the
  non-vectorised TensorIterator kernels (broadcast, strided or dtype-casting operands), whose time
  does not (the H100 and H200 run them in the same time: the same SMs and clocks, 1.43x the HBM).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from memplan.cli.planflags import plan_overrides
from memplan.costmodel import time as T
from memplan.specs.loader import load_model
from memplan.specs.resolve import Job, job_from

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "gpu-runs" / "h200-2026-11-28.json"
H100_RUNS = RUNS.with_name("h100-2026-11-28.json")
MODELS = ROOT / "tests" / "data" / "gpu-traces"  # the config.json files the runs name
GPU = "h200"
PROFILES = {"h200": "h200", "h100": "h100-sxm"}  # a runs file's device -> its GPU profile
TERMS = ("gemm (tensor cores)", "gemm (fp32, CUDA cores)", "attention (fused)", "memory-bound", "optimizer")
FP32_GEMM = re.compile(r"f32f32|sgemm", re.I)
OPTIMIZER = re.compile(r"multi_tensor_apply_kernel")
CUDNN_HELPER = re.compile(r"cudnn::fusion")
CUBLAS_KERNEL_FRACTION = 0.803
"""cuBLAS's bf16 GEMM at its best shape on an H100 SXM: 80.3% of the dense peak (stas00/ml-engineering,
compute/accelerator/benchmarks, the MAMF table: maximum achievable matmul FLOPS; the profile's own
source for ``matmul``); the H200 is the same die (the table finds it the same). The device machine
notes measure the same on the machines that took the profiles: an 8192^3 bf16 product on random data
at 798 TFLOP/s on an H100 and 788 on an H200 (80.7%, 79.6% of 989.4)."""
INDEX_BOUND = re.compile(r"^void at::native::(elementwise_kernel<|unrolled_elementwise_kernel<|.*CatArrayBatchedCopy<)")


def job_of(args: list[str], gpu: str = GPU) -> Job:
    """The job of a ``memplan validate`` run's arguments (model, then ``--flag value`` pairs), run by
    the bundled trainer (validate's runtime); ``--allocator`` changes no step time and is left out."""
    model_ref, rest = args[0], args[1:]
    path = MODELS / model_ref
    model = load_model(str(path) if path.exists() else model_ref)
    flags: dict = {"gpu": gpu, "runtime": "memplan"}
    for name, value in zip(rest[::2], rest[1::2], strict=True):
        key = name.lstrip("-").replace("-", "_")
        if key != "allocator":
            flags[key] = int(value) if value.isdigit() else value
    return job_from(model, None, None, plan_overrides(flags), default_gpu=gpu)


def kernel_rate_efficiency(job: Job) -> T.Efficiency:
    """The GPU profile's efficiencies with the bf16 GEMMs at ``CUBLAS_KERNEL_FRACTION`` of the peak."""
    return T.Efficiency.for_gpu(job.gpu).model_copy(update={"matmul": CUBLAS_KERNEL_FRACTION})


def model_terms(job: Job, eff: T.Efficiency | None = None) -> dict[str, float]:
    """The model's seconds per step by term (``TERMS``), single-micro-batch, single-stage plans as
    the profiled runs are: ``compute`` split into its GEMMs (tensor-core or fp32) and fused attention
    by the same functions ``time._stage_micro_batch`` uses; the memory-bound keys summed. ``eff``:
    the efficiencies (default: the GPU profile's)."""
    model, plan, work, gpu = job.model, job.plan, job.workload, job.gpu
    assert plan.pp == 1 and plan.tp == 1 and plan.cp == 1, "one-stage, one-rank plans only"
    eff = eff or T.Efficiency.for_gpu(gpu)
    report = T.estimate_time(model, work, plan, gpu, job.cluster, job.runtime, eff)
    b, m = report.breakdown, T.gradient_accumulation(work, plan)
    autocast = T.runs_autocast(plan, job.runtime)
    backend = T.attention_backend(model, work, plan, gpu, autocast)
    materialised = backend in ("eager", "math")
    matmul, _ = T.stage_flops_per_token(model, plan, 0, work.seq_len, causal=not materialised)
    extra = T.recompute_fraction(plan, model.num_layers, model)
    head = 6.0 * model.vocab_size * model.hidden_size
    peak = T.matmul_peak_flops(gpu, plan.precision)
    rate = peak * T.matmul_efficiency(eff, plan.precision)
    fp32_rate = T.matmul_peak_flops(gpu, "fp32") * eff.matmul_fp32
    tokens = work.micro_batch * work.seq_len * m
    fp32_stream = plan.quant != "none" and not autocast and T.POLICIES[plan.precision].compute_bytes != 4  # as time.py
    head_rate = fp32_rate if fp32_stream else rate
    if plan.finetune == "full":
        linears = tokens * (matmul - head) * (1 + extra.matmul) / rate
        head_s = tokens * head / rate
    else:
        linears = tokens * T.frozen_gemm_seconds(matmul - head, 0.0, extra.matmul, plan, rate, head_rate, rate)
        head_s = tokens * T.frozen_gemm_seconds(0.0, head, 0.0, plan, rate, head_rate, rate)
    tensor_core = linears + (0.0 if fp32_stream else head_s)
    fp32 = head_s if fp32_stream else 0.0
    attention = b["compute"] - linears - head_s
    if materialised:  # the math / eager path's batched GEMMs: fp32 over a quantized base
        fp32, attention = fp32 + attention, 0.0
    memory = sum(b.get(k, 0.0) for k in ("memory_bound", "lora_adapters", "quant_casts", "dequant"))
    known = {"compute", "memory_bound", "lora_adapters", "quant_casts", "dequant", "optimizer"}
    assert set(b) <= known, f"terms not mapped: {set(b) - known}"
    return dict(zip(TERMS, (tensor_core, fp32, attention, memory, b.get("optimizer", 0.0)), strict=True))


def kernel_term(name: str, klass: str) -> str:
    """The term a kernel's time belongs to (module docstring), from its name and profile class."""
    if OPTIMIZER.search(name):
        return "optimizer"
    if klass == "gemm":
        return "gemm (fp32, CUDA cores)" if FP32_GEMM.search(name) else "gemm (tensor cores)"
    if klass == "attention" or CUDNN_HELPER.search(name):
        return "attention (fused)"
    return "memory-bound"


def memory_kind(name: str) -> str:
    """``index-bound``: ATen's non-vectorised TensorIterator kernels (``elementwise_kernel`` and
    ``unrolled_elementwise_kernel``, launched when an operand is broadcast, strided or of another
    dtype: RMSNorm's broadcast scale and weight multiplies, RoPE's products of bf16 q / k and fp32
    tables, casts through ``LoadWithCast``) and ``CatArrayBatchedCopy`` (RoPE's ``rotate_half``),
    which compute an offset per element and per operand; ``bandwidth-bound``: every other
    memory-bound kernel (vectorised contiguous element-wise kernels, reductions, softmax, copies)."""
    return "index-bound" if INDEX_BOUND.search(name) else "bandwidth-bound"


def memory_kinds(profile: dict) -> dict[str, float]:
    """Seconds per measured step of the memory-bound kernels, by :func:`memory_kind`."""
    out = {"bandwidth-bound": 0.0, "index-bound": 0.0}
    for k in profile["kernels"]:
        if kernel_term(k["name"], k["class"]) == "memory-bound":
            out[memory_kind(k["name"])] += k["us_per_step"] / 1e6
    return out


def measured_terms(profile: dict) -> dict[str, float]:
    """Seconds per measured step by term, summed over the profile's kernels."""
    out = dict.fromkeys(TERMS, 0.0)
    for k in profile["kernels"]:
        out[kernel_term(k["name"], k["class"])] += k["us_per_step"] / 1e6
    return out


def compare(runs_path: Path = RUNS) -> dict[str, dict]:
    """Per profiled run (keyed by its name less ``prof-``): the model's and the kernels' seconds by
    term, and the measured and predicted step."""
    device = runs_path.name.split("-")[0]
    runs = json.loads(runs_path.read_text())["validate"]
    out = {}
    for name, run in runs.items():
        if not name.startswith("prof-"):
            continue
        short = name.removeprefix("prof-")
        profile_path = runs_path.parent / "profiles" / f"{device}-{short.removesuffix('-' + device)}.json"
        profile = json.loads(profile_path.read_text())
        job = job_of(run["args"], PROFILES[device])
        predicted = T.estimate_time(job.model, job.workload, job.plan, job.gpu, job.cluster, job.runtime)
        fast = kernel_rate_efficiency(job)
        at_kernel_rate = T.estimate_time(job.model, job.workload, job.plan, job.gpu, job.cluster, job.runtime, fast)
        out[short] = {
            "gpu": job.gpu.name,
            "model_s": model_terms(job),
            "kernels_s": measured_terms(profile),
            "predicted_step_s": predicted.step_time_s,
            "measured_step_s": run["measured_step_s"],
            "predicted_then_s": run["predicted_then"]["step_s"],
            "kernel_rate": {"model_s": model_terms(job, fast), "predicted_step_s": at_kernel_rate.step_time_s},
            "memory_kinds_s": memory_kinds(profile),
        }
    return out


def main(argv: list[str]) -> int:
    fmt = "json" if "--format" in argv and argv[argv.index("--format") + 1] == "json" else "table"
    paths = [a for a in argv if a.endswith(".json")]
    rows = {}
    for path in [Path(p) for p in paths] or [RUNS, H100_RUNS]:
        rows.update(compare(path))
    if fmt == "json":
        print(json.dumps(rows, indent=1))
        return 0
    for name, r in rows.items():
        step, meas = r["predicted_step_s"], r["measured_step_s"]
        kernels = sum(r["kernels_s"].values())
        print(f"{name} ({r['gpu']}): predicted {step * 1e3:.0f} ms, measured {meas * 1e3:.0f} ms "
              f"({step / meas - 1:+.1%}); kernels {kernels * 1e3:.0f} ms")  # fmt: skip
        print(f"  {'term':26s} {'model ms':>9s} {'kernels ms':>10s} {'model - kernels':>16s}")
        for term in TERMS:
            a, k = r["model_s"][term] * 1e3, r["kernels_s"][term] * 1e3
            print(f"  {term:26s} {a:9.1f} {k:10.1f} {a - k:+16.1f}")
        fast = r["kernel_rate"]
        gemm = fast["model_s"]["gemm (tensor cores)"] / r["kernels_s"]["gemm (tensor cores)"] - 1
        print(f"  GEMMs at {CUBLAS_KERNEL_FRACTION:.1%} of peak: {gemm:+.1%} of their kernels; step "
              f"{fast['predicted_step_s'] * 1e3:.0f} ms ({fast['predicted_step_s'] / meas - 1:+.1%})")  # fmt: skip
        kinds = r["memory_kinds_s"]
        print("  memory-bound kernels: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in kinds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
