"""LoRA beyond h200_a_lora8b's plan in the op-level run (``timeline/lora.py``, ``dropout.py``):
gradient accumulation, ``lora_dropout``, a trained LM head copy (``modules_to_save``), over an
fp32 base, under autocast (bf16-mixed), and bf16-master (AdamW over the fp32 adapters;
MasterAdamW beside a 16-bit copy, ``master.py``), each with full or selective recompute; and
under DDP and ZeRO-1 (``ddp.py``: the reducer over the adapters, the broadcast over every
parameter, grouped by dtype).

No GPU ran these plans: each is held against the bundled trainer itself, run on CPU and measured
the way tests/validate measures it (MemTracker, the steady peak over the measured steps), as
tests/unit/test_timeline_zero1.py does, cuBLAS's workspaces and the CUDA kernels' scratch left out.
The run compared is the one with CPU's kernels where the run models both (``trainer_run(...,
cuda=False)``: dropout's composite ``input * noise``, the fp32 noise kept, instead of CUDA's fused
kernel and its bool mask). Under ZeRO-1 the trainer runs the rank the run follows
(``zero1.most_loaded`` over the adapters). Measured 2026-11-27 (torch 2.13.0+cpu): every case
below within 228 B of the trainer's peak, for the step and for the forward and backward alone
(at most 0.002%; those few bytes are not traced to a tensor, as in test_timeline_recompute.py)."""

from __future__ import annotations

import pytest
from timeline_peaks import measured_peaks, steady_peaks, trainer_record

from memplan.costmodel.lora import HF_NAMES
from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline import zero1
from memplan.costmodel.timeline.autograd import Tape
from memplan.costmodel.timeline.ddp import assign_buckets, assign_buckets_by_dtype, broadcast_buckets
from memplan.costmodel.timeline.events import ALLOC, Builder
from memplan.costmodel.timeline.lora import Lora, config
from memplan.costmodel.timeline.trainer import dims, supported, trainer_run
from memplan.costmodel.timeline.trainer_model import param_shapes
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

CPU_BOUND = 0.0001  # 0.01% of the trainer's peak, as test_timeline_recompute.py
SEQ = 128

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
# the CUDA kernels' scratch, as test_timeline_zero1.py (tags' last component)
CUDA_ONLY = {
    "sorted_ids", "sort_order", "iota", "radix_sort_scratch", "segment_offsets", "num_segments", "segment_tmp",
    "scan_scratch", "partials_per_segment", "partial_offsets", "num_partials", "partial_segment_offsets",
    "grad_weight_per_segment", "reduce_workspace", "reduce_semaphores", "grad_times_output",
}  # fmt: skip
LORA = dict(finetune="lora", lora_rank=8, lora_targets=("all-linear",))

# name: (plan, (micro_batch, global_batch)); the tiny model, sequences of 128 tokens
CPU_CASES = {
    "accum2-bf16": (dict(precision="bf16"), (1, 2)),
    "accum3-full-bf16": (dict(precision="bf16", recompute="full"), (2, 6)),
    "dropout-bf16": (dict(precision="bf16", lora_dropout=0.1), (1, None)),
    "dropout-full-accum2-bf16": (dict(precision="bf16", lora_dropout=0.05, recompute="full"), (1, 2)),
    "dropout-q-v-selective-bf16": (
        dict(precision="bf16", lora_dropout=0.1, lora_targets=("q_proj", "v_proj"), recompute="selective"), (2, None)
    ),
    "lm-head-copy-bf16": (dict(precision="bf16", modules_to_save=("lm_head",)), (1, None)),
    "lm-head-copy-dropout-full-accum2-bf16": (
        dict(precision="bf16", modules_to_save=("lm_head",), lora_dropout=0.1, recompute="full"), (1, 2)
    ),
    "bf16-master": (dict(precision="bf16-master"), (1, None)),
    "bf16-master-lm-head-copy-accum2": (dict(precision="bf16-master", modules_to_save=("lm_head",)), (1, 2)),
    "fp32": (dict(precision="fp32"), (1, None)),
    "fp32-lm-head-copy-dropout-full": (
        dict(precision="fp32", modules_to_save=("lm_head",), lora_dropout=0.1, recompute="full"), (1, None)
    ),
    "bf16-mixed": (dict(precision="bf16-mixed"), (1, None)),
    "bf16-mixed-full": (dict(precision="bf16-mixed", recompute="full"), (1, None)),
    "bf16-mixed-lm-head-copy-dropout-accum2": (
        dict(precision="bf16-mixed", modules_to_save=("lm_head",), lora_dropout=0.1), (1, 2)
    ),
    "bf16-mixed-q-v-selective": (
        dict(precision="bf16-mixed", recompute="selective", lora_targets=("q_proj", "v_proj")), (2, None)
    ),
    "bf16-mixed-selective-op": (dict(precision="bf16-mixed", recompute="selective-op"), (1, None)),
    "bf16-mixed-full-2-layers-dropout": (
        dict(precision="bf16-mixed", recompute="full", recompute_layers=2, lora_dropout=0.1), (1, None)
    ),
    "ddp-dp2-bf16": (dict(precision="bf16", dp=2), (1, None)),
    "ddp-dp2-bf16-mixed-accum2": (dict(precision="bf16-mixed", dp=2), (1, 4)),
    "ddp-dp2-full-dropout-bf16": (dict(precision="bf16", dp=2, recompute="full", lora_dropout=0.1), (1, None)),
    "ddp-dp2-bf16-mixed-lm-head-copy": (dict(precision="bf16-mixed", dp=2, modules_to_save=("lm_head",)), (1, None)),
    "ddp-dp2-bf16-lm-head-copy-accum2": (dict(precision="bf16", dp=2, modules_to_save=("lm_head",)), (1, 4)),
    "ddp-dp2-bf16-master-lm-head-copy": (
        dict(precision="bf16-master", dp=2, modules_to_save=("lm_head",), recompute="full"), (1, None)
    ),
    "zero1-dp2-bf16": (dict(precision="bf16", dp=2, zero=1), (1, None)),
    "zero1-dp3-fp32-lm-head-copy-full": (
        dict(precision="fp32", dp=3, zero=1, modules_to_save=("lm_head",), recompute="full"), (1, None)
    ),
    "zero1-dp2-bf16-master-selective-op-accum2": (
        dict(precision="bf16-master", dp=2, zero=1, recompute="selective-op"), (1, 4)
    ),
}  # fmt: skip


def _plan(changes: dict) -> Plan:
    return Plan(**dict(LORA, **changes))


def _predicted(workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    run = trainer_run(TINY, workload, plan, cuda=False)
    assert run is not None
    return steady_peaks([e for e in run if e.tag.rsplit(".", 1)[-1] not in CUDA_ONLY])


def _rank(workload: TrainingWorkload, plan: Plan) -> int:
    """The data rank the run follows: under ZeRO-1 the most-loaded partition's (of the
    trainable parameters: the adapters and a head copy), else 0."""
    if plan.zero != 1 or plan.dp == 1:
        return 0
    d = dims(TINY, workload, plan)
    lora, scratch = Lora(Tape(Builder()), config(plan), d.tokens), Tape(Builder())
    for name, (rows, cols) in param_shapes(d, TINY.tied_embeddings).items():
        lora.build(scratch.new(rows * cols, d.pd, name), name, rows, cols)
    return zero1.most_loaded(lora.params(), plan.dp)


def _measured(workload: TrainingWorkload, plan: Plan) -> tuple[int, int]:
    """The bundled trainer on CPU, in fp32 on SDPA's math backend (CUDA's for fp32 with GQA)."""
    pytest.importorskip("torch")
    rank = _rank(workload, plan)
    return measured_peaks(trainer_record(TINY, workload, plan, rank, math=plan.precision == "fp32"))


# in the default run: each mechanism once; the other cases under -m slow (the default suite's time)
DEFAULT = {
    "dropout-bf16",
    "lm-head-copy-bf16",
    "bf16-master",
    "fp32",
    "bf16-mixed",
    "ddp-dp2-bf16",
    "zero1-dp2-bf16",
    "accum2-bf16",
}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CPU_CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    changes, (micro_batch, global_batch) = CPU_CASES[name]
    plan, workload = _plan(changes), TrainingWorkload(seq_len=SEQ, micro_batch=micro_batch, global_batch=global_batch)
    assert supported(TINY, workload, plan) is None  # the estimate follows it op by op
    predicted, measured = _predicted(workload, plan), _measured(workload, plan)
    for what, p, got in zip(("step", "forward and backward"), predicted, measured, strict=True):
        assert abs(p / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {p:,}, measured {got:,}"


def test_cuda_dropout_keeps_a_bool_mask_per_adapter_input():
    """On CUDA the fused ``native_dropout`` keeps a 1-byte mask of each adapter's (b, s, in) input
    where CPU keeps the fp32 noise: one per targeted linear of each layer, each forward."""
    plan, workload = _plan(dict(precision="bf16", lora_dropout=0.1)), TrainingWorkload(seq_len=SEQ, micro_batch=2)
    cuda, cpu = trainer_run(TINY, workload, plan), trainer_run(TINY, workload, plan, cuda=False)
    masks = [e.size for e in cuda if e.op == ALLOC and e.tag.endswith("dropout_mask")]
    noise = [e.size for e in cpu if e.op == ALLOC and e.tag.endswith("dropout_noise")]
    tokens, h, f = 2 * SEQ, TINY.hidden_size, TINY.ffn_size
    inputs = [f if path == "feed_forward.w2" else h for path in HF_NAMES]  # w2 takes the (b, s, f) gate
    assert masks == [tokens * n for n in inputs] * TINY.num_layers * 3  # three forwards
    assert noise == [4 * size for size in masks]


@pytest.mark.parametrize(
    ("model", "changes", "reason"),
    [
        (TINY, dict(precision="bf16", dp=2, zero=1, modules_to_save=("lm_head",)), "16-bit modules_to_save copy"),
        (TINY, dict(precision="bf16", dp=2, zero=3), "LoRA other than adapters"),
        (TINY.model_copy(update=dict(tied_embeddings=True)), dict(modules_to_save=("lm_head",)), "untied lm_head"),
    ],
    ids=["zero1-bf16-head-copy", "fsdp2", "tied-head-copy"],
)
def test_lora_plans_it_does_not_follow_stay_on_the_phase_model(model, changes, reason):
    """The bundled trainer fails on ZeRO-1 over two dtypes (fp32 adapters, a bf16 head copy:
    ``ZeroRedundancyOptimizer`` takes one), runs LoRA without FSDP2 and trains no head copy over a
    tied embedding."""
    plan, workload = _plan(changes), TrainingWorkload(seq_len=SEQ, micro_batch=1)
    assert reason in (supported(model, workload, plan) or "")
    assert trainer_run(model, workload, plan) is None


def test_ddp_groups_its_buckets_by_dtype():
    """``compute_bucket_assignment_by_size``: a bucket per dtype, each with its own limits, the
    full ones in the order they close, the open ones last; one dtype as ``assign_buckets``.
    The broadcast's (``broadcast_coalesced``): the same per dtype, sorted by each one's first index."""
    assert assign_buckets_by_dtype([5, 5, 5], [4, 2, 4], [8]) == [[0, 2], [1]]
    assert assign_buckets_by_dtype([1, 3, 4, 2, 10], [4] * 5, [2, 6]) == assign_buckets([1, 3, 4, 2, 10], [2, 6])
    assert assign_buckets_by_dtype([3, 3, 1, 1], [2, 4, 2, 4], [2, 6]) == [[0], [1], [2], [3]]
    assert broadcast_buckets([(5, 2), (5, 4), (3, 4)], 100) == [[0], [1, 2]]
    assert broadcast_buckets([(5, 2), (5, 2), (3, 4)], 8) == [[0, 1], [2]]
    assert broadcast_buckets([(3, 4), (5, 1), (5, 1), (3, 4)], 8) == [[0, 3], [1, 2]]


def test_the_estimate_answers_these_plans_with_the_op_level_run():
    for changes in (
        dict(lora_dropout=0.05, global_batch=8, recompute="full"),
        dict(precision="bf16-mixed", modules_to_save=("lm_head",)),
        dict(dp=4, zero=1, precision="bf16-master", recompute="selective-op"),
    ):
        plan = dict(LORA, seq_len=4096, micro_batch=2, **changes)
        job = resolve_job("llama3-8b", None, plan, inference=False)
        assert supported(job.model, job.workload, job.plan) is None
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", which
