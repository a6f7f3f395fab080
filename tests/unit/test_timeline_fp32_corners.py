"""fp32 corners of the op-level run: FSDP2's CPU offload in fp32 (``fsdp.py``, ``offload=True``
without a mixed-precision policy); activation offload (``save_on_cpu``, ``act_offload.py``) in
fp32, where SDPA runs its math path on CUDA (``precision.py``), and with gradient accumulation on
one rank; fp32 SDPA without GQA, CUDA's memory-efficient kernel (``mem_efficient.py``).

No GPU trace ran these plans: each is held against the bundled trainer itself, run on CPU under
rank simulation and measured the way tests/validate measures it (MemTracker, the steady peak over
the measured steps, FSDP2's host-side categories taken out: ``train.tracker``), in fp32 with GQA
under SDPA's math backend (the kernel CUDA takes; on CPU fp32 would take the CPU flash kernel); in
fp32 without GQA the CPU flash kernel stands in for the memory-efficient one (the same output and
log-sum-exp at 128 tokens, a multiple of its 32-row padding). Left out of the comparison are the
run's CUDA-only allocations (``timeline_peaks.steady_peaks``): besides those every CPU comparison
leaves out, FSDP2's per-parameter host-to-device copies of the offloaded shards
(``FSDPParam.all_gather_inputs``: ``sharded_param_data.to(device)``, a no-op on a CPU-only
machine), activation offload's staging copy of the math path's strided key (the scaled
``k.transpose(-2, -1)`` that ``bmm`` saves: ``copy_requires_temporaries``, ``Copy.cu``), and the
memory-efficient backward's delta temporaries and dQ workspace (from source, mem_efficient.py).

Measured 2026-11-27 (torch 2.13.0+cpu), the trainer's steady peak for the step and for the forward
and backward, predicted - measured: FSDP2 offload in fp32 12,999,432 B both (0 B), with full
recompute (4 layers, 2 x 128) 12,934,920 B (0 B); activation offload in fp32 80,648,092 /
69,629,604 B, with full recompute 86,382,244 B, with 2 micro-batches 80,652,188 / 80,645,284 B,
bf16-master with 2 micro-batches 96,780,956 / 72,584,356 B, DDP dp 2 with full recompute
89,332,900 B (each -156 B, the same 156 B as every bf16 offload case of
test_timeline_act_offload.py, not traced to a tensor); the memory-efficient kernel's plans
61,207,972 B, full recompute 58,468,252 / 48,443,044 B, selective 61,183,396 B, selective-op
58,468,252 / 50,976,164 B, with activation offload 58,468,252 / 46,974,116 B, TP 2 + SP over ZeRO-3
25,440,044 B (each -156 B), LoRA r 8 33,135,432 B (-64 B), FSDP2 offload 28,434,184 B (0 B). Host
copies: the trainer's exactly in fp32 (the math path makes no philox seed; the memory-efficient
kernel's are CPU tensors, whose 16 B a layer CUDA would pack to pinned memory too, not counted);
in bf16-master 16 B a layer above it (flash's device seeds, which the CPU kernel does not make).
"""

from __future__ import annotations

import pytest
from timeline_peaks import assert_peaks, measured_peaks, steady_peaks, trainer_record

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline import act_offload, mem_efficient
from memplan.costmodel.timeline.events import ALLOC
from memplan.costmodel.timeline.mem_efficient import DELTA, DELTA_PRODUCT, DELTA_SUM, WORKSPACE
from memplan.costmodel.timeline.ops import PHILOX
from memplan.costmodel.timeline.support import supported
from memplan.costmodel.timeline.trainer import MICRO_BATCHES_MODELLED, trainer_run
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
SHALLOW = TINY.model_copy(update=dict(name="tiny-2-layers", num_layers=2))  # the default run's FSDP2 case
# the widest moment inside a layer's backward (the MLP's), where the unpacked copies are live
WIDE = TINY.model_copy(update=dict(name="tiny-wide", ffn_size=1536, vocab_size=256))

# as many KV heads as query heads: fp32 SDPA takes the memory-efficient kernel on CUDA
MHA = TINY.model_copy(update=dict(name="tiny-mha", num_kv_heads=6))

FSDP_OFFLOAD = dict(dp=2, zero=3, offload_params="cpu", offload_optimizer="cpu")
ACT_OFFLOAD = dict(offload_activations="cpu")
# name: (model, plan, (micro_batch, global_batch)); sequences of 128 tokens
CASES = {
    "fsdp2-offload-fp32": (SHALLOW, dict(precision="fp32", **FSDP_OFFLOAD), (1, None)),
    "fsdp2-offload-fp32-full": (TINY, dict(precision="fp32", recompute="full", **FSDP_OFFLOAD), (2, None)),
    "act-offload-fp32": (WIDE, dict(precision="fp32", **ACT_OFFLOAD), (2, None)),
    "act-offload-fp32-full": (WIDE, dict(precision="fp32", recompute="full", **ACT_OFFLOAD), (4, None)),
    "act-offload-fp32-accum2": (WIDE, dict(precision="fp32", **ACT_OFFLOAD), (4, 8)),
    "act-offload-bf16-master-accum2": (WIDE, dict(precision="bf16-master", **ACT_OFFLOAD), (4, 8)),
    "act-offload-ddp2-fp32-full": (
        WIDE, dict(precision="fp32", dp=2, zero=0, recompute="full", **ACT_OFFLOAD), (4, None)
    ),
    "efficient-fp32": (MHA, dict(precision="fp32"), (2, None)),
    "efficient-fp32-full": (MHA, dict(precision="fp32", recompute="full"), (2, None)),
    "efficient-fp32-selective": (MHA, dict(precision="fp32", recompute="selective"), (2, None)),
    "efficient-fp32-selective-op": (MHA, dict(precision="fp32", recompute="selective-op"), (2, None)),
    "efficient-fp32-act-offload": (MHA, dict(precision="fp32", **ACT_OFFLOAD), (2, None)),
    "efficient-fp32-lora": (MHA, dict(precision="fp32", finetune="lora", lora_rank=8), (2, None)),
    "efficient-fp32-tp2-sp-zero3": (MHA, dict(precision="fp32", dp=2, zero=3, tp=2, sequence_parallel=True), (2, None)),
    "efficient-fp32-fsdp2-offload": (MHA, dict(precision="fp32", **FSDP_OFFLOAD), (2, None)),
}  # fmt: skip

# in the default run: each mechanism once; the other cases under -m slow (the default suite's time)
DEFAULT = {"fsdp2-offload-fp32", "act-offload-fp32", "efficient-fp32"}


CUDA_ONLY = (DELTA_PRODUCT, DELTA_SUM, DELTA, WORKSPACE)  # mem_efficient.py's backward temporaries


class _Recorded(act_offload.SaveOnCpu):
    """The run's hooks, kept for their host bytes."""

    made: list[act_offload.SaveOnCpu] = []

    def __init__(self) -> None:
        super().__init__()
        _Recorded.made.append(self)


def _measure(model: ModelSpec, workload: TrainingWorkload, plan: Plan):  # noqa: ANN202 - a RunRecord
    """The bundled trainer on CPU, rank 0, two measured steps; fp32 under SDPA's math backend."""
    gqa = model.num_kv_heads != model.num_attention_heads  # else CPU's flash stands in for CUDA's efficient kernel
    return trainer_record(model, workload, plan, math=plan.precision == "fp32" and gqa)


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name, monkeypatch):
    pytest.importorskip("torch")
    model, changes, (micro_batch, global_batch) = CASES[name]
    plan, workload = Plan(**changes), TrainingWorkload(seq_len=128, micro_batch=micro_batch, global_batch=global_batch)
    assert supported(model, workload, plan) is None
    _Recorded.made = []
    monkeypatch.setattr(act_offload, "SaveOnCpu", _Recorded)
    peaks = steady_peaks(trainer_run(model, workload, plan, max_micro_batches=MICRO_BATCHES_MODELLED))
    record = _measure(model, workload, plan)
    assert_peaks(name, peaks, measured_peaks(record))
    if plan.offload_activations == "cpu":  # the host copies; CUDA's flash also saves its seeds (bf16)
        philox = 0 if plan.precision == "fp32" or plan.recompute == "full" else 2 * PHILOX * model.num_layers
        assert [h.host_peak - philox for h in _Recorded.made] == [record.offload_host_bytes]


@pytest.mark.parametrize(
    "changes",
    [
        dict(precision="fp32", dp=8, zero=3, offload_params="cpu", offload_optimizer="cpu", recompute="full"),
        dict(precision="fp32", offload_activations="cpu"),
        dict(precision="fp32", offload_activations="cpu", recompute="full", global_batch=4),
        dict(precision="bf16-master", offload_activations="cpu", global_batch=4),
    ],
    ids=["fsdp2-offload", "act-offload", "act-offload-full-accum4", "act-offload-bf16-master-accum4"],
)
def test_the_estimate_answers_these_plans_with_the_op_level_run(changes):
    job = resolve_job("llama3-8b", None, dict(seq_len=4096, micro_batch=1, **changes), False)
    assert supported(job.model, job.workload, job.plan) is None
    _, which = plan_run(job.model, job.workload, job.plan, "memplan")
    assert which == "trainer", which


def test_accumulation_over_data_parallel_with_activation_offload_stays_refused():
    """The trainer refuses it (``trainer_offload.unmodelled_accumulation``): no run to follow."""
    plan = Plan(precision="bf16", dp=2, zero=0, offload_activations="cpu")
    why = supported(WIDE, TrainingWorkload(seq_len=128, micro_batch=1, global_batch=4), plan)
    assert why is not None and "accumulation over data parallel" in why


def test_fsdp2_offload_in_fp32_copies_each_shard_once_and_casts_nothing():
    """Without a mixed-precision policy ``all_gather_inputs`` is the host-to-device copy itself
    (``_to_dtype_if_needed`` with no ``param_dtype``): one fp32 copy per parameter, no bf16 input."""
    plan, workload = Plan(precision="fp32", **FSDP_OFFLOAD), TrainingWorkload(seq_len=128, micro_batch=1)
    events = [e for e in trainer_run(TINY, workload, plan, steady_steps=1) if e.op == ALLOC]
    copies = [e for e in events if e.tag.endswith(".h2d")]
    assert copies and not [e for e in events if e.tag.endswith("all_gather_input")]
    layer = [e.size for e in copies if e.tag.startswith("fsdp.layers.0.layers.0.attention.wq")]
    assert layer and set(layer) == {192 * 192 // 2 * 4}  # wq's shard of dp 2, fp32


def test_activation_offload_in_fp32_stages_the_math_paths_strided_key_on_cuda():
    """Each layer's ``bmm`` saves the scaled key as the transpose's strided view: packing it copies
    it contiguous on the device first (CUDA only, left out of the CPU comparison); the
    probabilities (saved by the softmax and by the second ``bmm``) are contiguous and copied as they are."""
    plan, workload = Plan(precision="fp32", **ACT_OFFLOAD), TrainingWorkload(seq_len=128, micro_batch=1)
    events = [e for e in trainer_run(WIDE, workload, plan, steady_steps=1) if e.op == ALLOC]
    layer0 = [e for e in events if e.tag.startswith("layers.0.") and e.tag.endswith(act_offload.STAGING)]
    key_bytes = 128 * WIDE.num_attention_heads * WIDE.head_size * 4  # k repeated to q's heads, fp32
    assert key_bytes in {e.size for e in layer0}


def test_the_memory_efficient_kernel_allocates_what_its_source_says():
    """One layer's SDPA of an MHA Llama-3.2-1B-shaped fp32 step (b 2, s 4096, 32 heads of 64; the
    sizes ``_efficient_attention_forward/backward`` allocate, mem_efficient.py): forward the fp32
    output, then the log-sum-exp padded to 32 rows (no device philox tensors); backward dq, dk, dv,
    delta's product, sum and transposed copy, then dQ's workspace of the 64 x 64 kernel: 64 query
    blocks of (16 B + 64 x 64 fp32) per (batch, head)."""
    job = resolve_job("llama3-8b", None, dict(precision="fp32", seq_len=4096, micro_batch=2), False)
    model = job.model.model_copy(update=dict(hidden_size=2048, num_attention_heads=32, num_kv_heads=32, num_layers=2))
    assert supported(model, job.workload, job.plan) is None
    events = [e for e in trainer_run(model, job.workload, job.plan, steady_steps=1) if e.op == ALLOC]
    sdpa = [
        (e.tag.rpartition(".")[2], e.size) for e in events if e.tag.startswith("layers.0.attention.sdpa_efficient.")
    ]
    qkv, rows = 2 * 4096 * 2048 * 4, 2 * 32 * 4096 * 4
    forward = [item for item in sdpa if item[0] in ("out", "lse")][:2]
    assert forward == [("out", qkv), ("lse", rows)]
    backward = [item for item in sdpa if item[0] in ("dq", "dk", "dv", *CUDA_ONLY)][:7]
    workspace = 2 * 32 * 64 * (16 + 64 * 64 * 4)
    assert backward == [
        ("dq", qkv), ("dk", qkv), ("dv", qkv), ("delta_product", qkv), ("delta_sum", rows), ("delta", rows),
        ("grad_q_workspace", workspace),
    ]  # fmt: skip
    assert not [e for e in events if "philox" in e.tag and e.tag.startswith("layers.")]


def test_the_log_sum_exp_pads_to_the_backward_block_and_the_workspace_follows_the_head_dim():
    """``kAlignLSE = 32``; the kernel ``dispatch_cutlassB_f32_sm80`` takes first for the head dim."""
    assert mem_efficient.lse_numel(1, 2, 100) == 2 * 128
    assert mem_efficient.workspace_bytes(1, 1, 128, 64) == 2 * (16 + 64 * 64 * 4)  # 64 x 64: 2 query blocks
    assert mem_efficient.workspace_bytes(1, 1, 256, 128) == 2 * 2 * (16 + 128 * 64 * 4)  # 128 x 64: 2 x 2 tiles


def test_fp32_without_gqa_is_answered_by_the_run_over_a_quantized_base_too():
    job = resolve_job("llama3-8b", None, dict(precision="fp32", seq_len=4096, micro_batch=1, recompute="full"), False)
    mha = job.model.model_copy(update=dict(num_kv_heads=job.model.num_attention_heads))
    _, which = plan_run(mha, job.workload, job.plan, "memplan")
    assert which == "trainer", which
    qlora = job.plan.model_copy(update=dict(finetune="qlora", quant="nf4", double_quant=True, precision="bf16"))
    assert supported(mha, job.workload, qlora) is None  # test_timeline_quant_compose.py
