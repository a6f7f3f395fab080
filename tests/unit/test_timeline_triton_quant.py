"""memplan's Triton attention over a quantized base in the op-level run (``triton_attention.py``
over ``quant.py`` / ``int8.py``; issue 27).

The bundled trainer runs ``attention: triton`` over a 4-bit or LLM.int8 base (``validate.support``
refuses neither; ``memplan.train.model.attention`` calls ``flash_attention`` whatever the base).
``prepare_model_for_kbit_training`` casts the embedding, norms and head to fp32, and bitsandbytes'
linears return their input's dtype (``Linear4bit.forward``: ``out.to(inp_dtype)``; CPU's
``MatMul8bitFp`` and CUDA's ``MatMul8bitLt`` alike), so q, k and v reach the kernel in fp32 whatever
the compute dtype: its output, dq, dk and dv are fp32, and on CUDA its autotuner prunes from the
fp32 configs (``triton_attention.benchmarked``, itemsize 4). The run composed this already; only
``support.py`` declined it ("not checked").

No GPU ran these plans. Each case is held against the bundled trainer on CPU, its kernels under
Triton's interpreter in a fresh process (as tests/unit/test_timeline_triton.py, whose docstring says
why the harness collects garbage after each launch), measured and predicted as
tests/unit/test_timeline_quant_compose.py does (CUDA's temporaries, bitsandbytes' dynamic map and
AdamW's host ``step`` scalars set apart; the Triton backward's ``delta``, allocated below the CPU
meter's dispatch mode, among the first). Measured 2026-11-28 (torch 2.13.0+cpu, Triton 3.8.0,
bitsandbytes 0.50.2): every case equals the trainer's step peak and forward-and-backward peak to
the byte. The MHA cases peak at dv in the last layer's attention backward (after lse's zero gradient,
dq and dk: the kernel's tensors decide the peak); SDPA's memory-efficient kernel on the same plans
peaks 2,048 B lower there, the size of lse's materialised zero gradient.
"""

from __future__ import annotations

import pytest
from test_timeline_quant_compose import HEAD, INT8, NF4, _measured, _predicted
from test_timeline_triton import GQA, MHA
from test_timeline_triton import interpreted_peaks as triton_peaks

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline import triton_attention as ta
from memplan.costmodel.timeline.events import ALLOC, STEADY
from memplan.costmodel.timeline.support import supported
from memplan.costmodel.timeline.trainer import trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

QWEN = GQA.model_copy(update=dict(name="tiny-qwen2", qkv_bias=True))
TRITON = dict(attention="triton")
# name: (model, plan, (seq_len, micro_batch, global_batch)). A 4-bit base computing in bf16 takes
# CUDA's fused kernel at 4 tokens; in fp32 from 8 tokens the fallback (gemm_4bit_kernel): both
# known on every GPU. Step peaks measured (B): int8-mha-selective 1,353,976; nf4-mha-fp32 791,112;
# nf4-gqa-fused-selective-op 355,840 (forward and backward 314,632); int8-gqa-ddp2-head-copy
# 987,388; fp4-mha-fp32-full-accum2 697,800; int8-mha-zero1-dp2-dropout 1,520,832;
# int8-mha-bf16-master-selective-op 1,495,792; nf4-mha-fp32-partial-single 654,968; int8-qwen2 927,992.
CASES = {
    "int8-mha-selective": (MHA, dict(INT8, precision="bf16", recompute="selective"), (64, 1, None)),
    "nf4-mha-fp32": (MHA, dict(NF4, precision="fp32"), (32, 1, None)),
    "nf4-gqa-fused-selective-op": (GQA, dict(NF4, precision="bf16", recompute="selective-op"), (4, 1, None)),
    "int8-gqa-ddp2-head-copy": (GQA, dict(INT8, precision="bf16", dp=2, **HEAD), (64, 1, None)),
    "fp4-mha-fp32-full-accum2": (MHA, dict(NF4, quant="fp4", precision="fp32", recompute="full"), (32, 1, 2)),
    "int8-mha-zero1-dp2-dropout": (MHA, dict(INT8, precision="bf16", dp=2, zero=1, lora_dropout=0.1), (64, 1, None)),
    "int8-mha-bf16-master-selective-op": (
        MHA, dict(INT8, precision="bf16-master", recompute="selective-op"), (64, 1, None)
    ),
    "nf4-mha-fp32-partial-single": (
        MHA, dict(NF4, precision="fp32", recompute="full", recompute_layers=1, double_quant=False), (32, 1, None)
    ),
    "int8-qwen2": (QWEN, dict(INT8, precision="bf16"), (64, 1, None)),
}  # fmt: skip
# in the default run one subprocess, a 4-bit base peaking at the kernel's dv (the interpreter is
# slow, the default suite bounded); the rest, the int8 base among them, under -m slow
DEFAULT = ("nf4-mha-fp32",)


def case(name: str) -> tuple[ModelSpec, TrainingWorkload, Plan]:
    model, changes, (seq, micro_batch, global_batch) = CASES[name]
    workload = TrainingWorkload(seq_len=seq, micro_batch=micro_batch, global_batch=global_batch)
    return model, workload, Plan(**changes, **TRITON)


def measure(name: str) -> tuple[int, int]:
    """The trainer's measured peaks of case ``name`` over its quantized base (in the interpreted process)."""
    return _measured(*case(name))


def interpreted_peaks(names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The bundled trainer on CPU over a quantized base, its Triton kernels interpreted."""
    return triton_peaks(names, "test_timeline_triton_quant")


def assert_cases(names: tuple[str, ...]) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")
    measured = interpreted_peaks(names)
    for name in names:
        model, workload, plan = case(name)
        assert supported(model, workload, plan) is None  # the estimate follows it op by op
        predicted = _predicted(model, workload, plan)
        for what, p, got in zip(("step", "forward and backward"), predicted, measured[name], strict=True):
            assert p == got, f"{name} {what}: predicted {p:,}, measured {got:,}"


@pytest.mark.slow  # the trainer interpreted (8 s); the default suite keeps the kernel's fp32 stream below
def test_the_bundled_trainer_with_triton_over_a_quantized_base_peaks_where_the_run_does():
    assert_cases(DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in DEFAULT])
def test_the_other_triton_quantized_cases_peak_where_the_run_does(name):
    assert_cases((name,))


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_the_kernel_takes_the_bases_fp32_stream(quant):
    """Computing in bf16 over a quantized base, the kernel's inputs, output and gradients are fp32
    (the stream's dtype), and its first launches benchmark the fp32 configs: at head dim 128 and
    4096 tokens 3 of each kernel (a bf16 stream keeps 4, 4 and 3)."""
    model = GQA.model_copy(update=dict(head_dim=128))
    workload = TrainingWorkload(seq_len=4096, micro_batch=1)
    plan = Plan(**dict(INT8 if quant == "int8" else NF4, precision="bf16"), **TRITON)
    timeline = trainer_run(model, workload, plan)
    assert timeline is not None
    sizes = {e.tag.rpartition(".")[2]: e.size for e in timeline if e.op == ALLOC and "flash_attention" in e.tag}
    q_bytes, kv_bytes = 4096 * model.q_size * 4, 4096 * model.kv_size * 4
    assert (sizes["out"], sizes["dq"], sizes["dk"], sizes["dv"]) == (q_bytes, q_bytes, kv_bytes, kv_bytes)
    steady = next(i for i, e in enumerate(timeline) if e.tag == STEADY)
    flushes = [i for i, e in enumerate(timeline) if e.op == ALLOC and e.tag.endswith(ta.AUTOTUNE_FLUSH)]
    assert [ta.benchmarked(k, 128, 4096, 4) for k in ("fwd", "dkdv", "dq")] == [3, 3, 3]
    assert len(flushes) == 9 and max(flushes) < steady


@pytest.mark.parametrize(
    "changes",
    [dict(NF4, precision="bf16"), dict(NF4, precision="fp32", recompute="selective"), dict(INT8, precision="bf16")],
    ids=["nf4", "nf4-fp32-selective", "int8"],
)
def test_the_estimate_answers_triton_over_a_quantized_base_with_the_op_level_run(changes):
    job = resolve_job("llama3-8b", None, dict(changes, seq_len=2048, micro_batch=1, **TRITON), inference=False)
    assert supported(job.model, job.workload, job.plan) is None
    assert plan_run(job.model, job.workload, job.plan, "memplan")[1] == "trainer"
