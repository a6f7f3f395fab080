"""memplan's Triton attention (``attention: triton``) in the op-level run (``timeline/triton_attention.py``).

No GPU trace ran the Triton kernels: the run is held against the bundled trainer itself on CPU,
its kernels under Triton's interpreter (``TRITON_INTERPRET=1``, which must be set before Triton is
first imported: a fresh process, as tests/kernels does), measured the way tests/validate measures
it (MemTracker, the steady peak over the measured steps). The backward's ``delta`` is allocated
inside the custom op, where MemTracker does not look (``timeline_peaks.CUDA_TEMPORARIES``).

The interpreter's own garbage: each launch (``GridExecutor.__call__``, Triton 3.8
``runtime/interpreter.py``) builds the recursive closures ``_to_cpu`` and ``_from_cpu`` over a
dict of the arguments' storages, a reference cycle that keeps every argument of the last launch
alive until the garbage collector next runs (measured: the dQ kernel's q, k, v, lse, dO and dQ,
+91,648 B on a 2-layer bf16 run at 64 tokens). Compiled kernels on a GPU take no such copy, so
the harness collects the youngest generation after each launch.

The 32-wide cases are sized so that the backward peaks inside a layer's attention backward (at dv,
after lse's materialised zero gradient, dq and dk): q, k, v widths over a 32-wide residual, a tiny
MLP and vocabulary, each peak over 840 KB so that 84 B stays within ``CPU_BOUND``. Measured
2026-11-27 (torch 2.13.0+cpu, Triton 3.8.0), predicted - measured, for the step and for the forward
and backward alone: -84 B in every case (as the flash and eager runs of the same models) but LoRA's,
-32 B, ZeRO-1's, -44 B, and the pipeline rank's, -40 B. Step peaks measured: bf16-mha 947,100 B;
bf16-mixed-selective 1,210,332; fp32 1,271,772; bf16-mixed 1,134,556; bf16-selective (b 2) 971,420;
bf16-full-accum2 (b 3) 996,444; bf16-selective-op (b 2) 915,036; bf16-master 1,184,596; lora
490,336; zero3-dp2 4,121,308; ddp2-full 5,908,948; zero1-dp2 4,640,052; pp2 3,086,376;
tp2-sp-zero3-dp2-s256 3,637,660 (at 64 tokens TP 2 + SP misses by 0.1 MB under flash and eager too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeline_peaks import assert_peaks, measured_peaks, steady_peaks, trainer_record

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline import triton_attention as ta
from memplan.costmodel.timeline.events import ALLOC, STEADY
from memplan.costmodel.timeline.support import supported
from memplan.costmodel.timeline.trainer import MICRO_BATCHES_MODELLED, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

GQA = ModelSpec(
    name="tiny-gqa", hidden_size=32, num_layers=2, num_attention_heads=8, num_kv_heads=2, head_dim=32, ffn_size=32,
    vocab_size=32,
)  # fmt: skip
MHA = GQA.model_copy(update=dict(name="tiny-mha", num_kv_heads=8))
# data parallel: a wider residual (FSDP2 and DDP on the 32-wide models miss by 0.1 to 0.4 MB under
# flash and eager alike, not the kernel's doing)
WIDE = ModelSpec(
    name="tiny-wide", hidden_size=192, num_layers=2, num_attention_heads=6, num_kv_heads=2, ffn_size=256, vocab_size=256
)
MODELS = {"gqa": GQA, "mha": MHA, "wide": WIDE}

TRITON = dict(attention="triton")
# name: (model, plan, (seq_len, micro_batch, global_batch))
CASES = {
    "bf16-mha": ("mha", dict(precision="bf16", **TRITON), (64, 1, None)),
    "bf16-mixed-selective": ("gqa", dict(precision="bf16-mixed", recompute="selective", **TRITON), (64, 1, None)),
    "fp32": ("gqa", dict(precision="fp32", **TRITON), (64, 1, None)),
    "bf16-mixed": ("gqa", dict(precision="bf16-mixed", **TRITON), (64, 1, None)),
    "bf16-selective": ("gqa", dict(precision="bf16", recompute="selective", **TRITON), (64, 2, None)),
    "bf16-full-accum2": ("gqa", dict(precision="bf16", recompute="full", **TRITON), (64, 3, 6)),
    "bf16-selective-op": ("gqa", dict(precision="bf16", recompute="selective-op", **TRITON), (64, 2, None)),
    "bf16-master": ("gqa", dict(precision="bf16-master", **TRITON), (64, 1, None)),
    "lora": ("gqa", dict(precision="bf16", finetune="lora", lora_rank=4, **TRITON), (64, 1, None)),
    "zero3-dp2": ("wide", dict(precision="bf16", dp=2, zero=3, **TRITON), (64, 1, None)),
    "ddp2-full": ("wide", dict(precision="bf16", dp=2, zero=0, recompute="full", **TRITON), (64, 1, None)),
    "zero1-dp2": ("wide", dict(precision="bf16", dp=2, zero=1, **TRITON), (64, 1, None)),
    "pp2": ("wide", dict(precision="bf16", pp=2, **TRITON), (64, 1, 2)),
    "tp2-sp-zero3-dp2-s256": (
        "wide",
        dict(precision="bf16", tp=2, sequence_parallel=True, dp=2, zero=3, **TRITON),
        (256, 1, None),
    ),
}
# in the default run: one subprocess, the op under autocast and a selective checkpoint (14 s on
# 2 shared cores); the others under -m slow (the interpreter is slow, the default suite bounded)
DEFAULT = ("bf16-mixed-selective",)

# run in a fresh interpreter with TRITON_INTERPRET=1: the trainer's measured peaks per case, each
# by ``measure`` of the module named first (this one, test_timeline_triton_quant)
_SCRIPT = """
import gc, importlib, json, sys
from triton.runtime.interpreter import GridExecutor

launch = GridExecutor.__call__

def collected(self, *args, **kwargs):  # the launch's reference cycle of its arguments' storages
    try:
        return launch(self, *args, **kwargs)
    finally:
        gc.collect(0)

GridExecutor.__call__ = collected
module = importlib.import_module(sys.argv[1])
print(json.dumps({name: module.measure(name) for name in sys.argv[2:]}))
"""


def case(name: str) -> tuple[ModelSpec, TrainingWorkload, Plan]:
    model, changes, (seq, micro_batch, global_batch) = CASES[name]
    workload = TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=global_batch)
    return MODELS[model], workload, Plan(**changes)


def measure(name: str) -> tuple[int, int]:
    """The trainer's measured peaks of case ``name`` (in the interpreted process)."""
    return measured_peaks(trainer_record(*case(name)))


def interpreted_peaks(names: tuple[str, ...], module: str = "test_timeline_triton") -> dict[str, tuple[int, int]]:
    """The bundled trainer on CPU, its Triton kernels interpreted, one process for ``names``
    measured by ``module``'s ``measure``."""
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-c", _SCRIPT, module, *names]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: tuple(peaks) for name, peaks in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def assert_cases(names: tuple[str, ...]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    measured = interpreted_peaks(names)
    for name in names:
        model, workload, plan = case(name)
        assert supported(model, workload, plan) is None
        predicted = steady_peaks(trainer_run(model, workload, plan, max_micro_batches=MICRO_BATCHES_MODELLED))
        assert_peaks(name, predicted, measured[name])


def test_the_bundled_trainer_with_triton_attention_interpreted_on_cpu_peaks_where_the_run_does():
    assert_cases(DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in DEFAULT])
def test_the_other_triton_cases_peak_where_the_run_does(name):
    assert_cases((name,))


def test_the_run_allocates_the_kernels_tensors():
    # the last layer's attention backward: lse's zero gradient, dq, dk, dv, then the op's delta (fp32)
    model, workload, plan = case("bf16-mha")
    allocs = [(e.tag.rpartition(".")[2], e.size) for e in trainer_run(model, workload, plan) if e.op == ALLOC]
    tags, sizes = [tag for tag, _ in allocs], dict(allocs)
    rows = workload.seq_len * model.num_attention_heads
    start = tags.index("dlse_zeros")
    assert tags[start : start + 5] == ["dlse_zeros", "dq", "dk", "dv", "triton_delta"]
    assert sizes["dlse_zeros"] == sizes["triton_delta"] == sizes["lse"] == rows * 4
    assert "philox_seed" not in sizes and "scratch" not in sizes  # SDPA's flash kernel's, not this one's


def test_the_estimate_answers_triton_plans_with_the_op_level_run():
    # over a quantized base too (test_timeline_triton_quant.py)
    qlora = dict(precision="bf16", finetune="qlora", quant="nf4")
    for changes in (dict(precision="bf16"), dict(precision="bf16-mixed", recompute="selective"), qlora):
        job = resolve_job("llama3-8b", None, dict(seq_len=2048, attention="triton", **changes), False)
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", (changes, which)


def test_the_autotuners_configs_are_the_kernels():
    """``triton_attention.CONFIGS`` and ``benchmarked`` against the kernels' own table and pruner."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    from memplan.kernels import fused_attention as fa

    if fa.INTERPRETED:
        pytest.skip("the interpreter's autotuner has one config")
    assert {k: {b: set(c) for b, c in t.items()} for k, t in ta.CONFIGS.items()} == {
        k: {b: set(c) for b, c in t.items()} for k, t in fa._CONFIGS.items()
    }
    assert ta.SMEM_BUDGET_BYTES == fa._SMEM_BUDGET_BYTES
    for kind in ("fwd", "dkdv", "dq"):
        for dtype in (torch.bfloat16, torch.float32):
            for head_dim in (16, 64, 80, 128, 256):
                for seq in (16, 64, 100, 4096):
                    args = {"Q": torch.empty(0, dtype=dtype), "HEAD_DIM_PAD": max(16, 1 << (head_dim - 1).bit_length())}
                    kept = len(fa._pruner(kind)(fa._configs(kind), {**args, "N_CTX": seq}))
                    want = ta.benchmarked(kind, head_dim, seq, dtype.itemsize)
                    assert want == (kept if kept > 1 else 0), (kind, dtype, head_dim, seq)


def test_the_warm_up_benchmarks_each_kernel_once():
    # llama3-8b-like heads (128), bf16, 4096 tokens: 4 forward, 4 dK/dV and 3 dQ configs survive the pruner
    model = GQA.model_copy(update=dict(head_dim=128))
    workload, plan = TrainingWorkload(seq_len=4096, micro_batch=1), Plan(precision="bf16", **TRITON)
    timeline = trainer_run(model, workload, plan)
    steady = next(i for i, e in enumerate(timeline) if e.tag == STEADY)
    flushes = [i for i, e in enumerate(timeline) if e.op == ALLOC and e.tag.endswith(ta.AUTOTUNE_FLUSH)]
    assert [ta.benchmarked(k, 128, 4096, 2) for k in ("fwd", "dkdv", "dq")] == [4, 4, 3]
    assert len(flushes) == 11 and max(flushes) < steady
    assert {e.size for e in timeline if e.tag.endswith(ta.AUTOTUNE_FLUSH)} == {256 * 1024 * 1024}
