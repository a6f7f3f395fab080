"""The op-level run as a CPU run of it allocates: the tensors only CUDA's kernels make left out.

The runs (``trainer.py`` with ``cuda=False``, ``hf_trainer.py`` / ``hf_loop.py`` on the
``cpu_flash`` kernel) follow CPU's kernels where the two devices' ops differ in what they keep
(LoRA's dropout: CPU's composite ``input * noise``; bitsandbytes' ``MatMul8bitFp``; SDPA's
``_scaled_dot_product_flash_attention_for_cpu``). What CUDA's kernels allocate on top, read from
PyTorch's and bitsandbytes' sources, is tagged so that the CPU's view of the run leaves it out; the
CPU comparisons (tests/unit/timeline_peaks.py, tests/accuracy/hf_steps.py, peft_steps.py) hold
this view against the real trainers on CPU.
"""

from __future__ import annotations

from memplan.costmodel.timeline.events import MARK, Snapshot, Timeline
from memplan.specs.plan import Plan

# ``embedding_dense_backward_cuda``'s index buffers and scratch (ops.embedding): the CPU kernel
# makes the weight gradient alone
CUDA_EMBEDDING_SCRATCH = frozenset(
    {
        "sorted_ids", "sort_order", "iota", "radix_sort_scratch", "segment_offsets", "num_segments", "segment_tmp",
        "scan_scratch", "partials_per_segment", "partial_offsets", "num_partials", "partial_segment_offsets",
        "grad_weight_per_segment",
    }
)  # fmt: skip


def cuda_temporaries() -> frozenset[str]:
    """CUDA's kernels' temporaries (from source): activation offload's staging copies of
    non-contiguous saves and flash's copies of unpacked saves; the sum-to-weight staging buffer and
    its semaphores (autograd.REDUCE_WORKSPACE_CAP); the softmax backward's ``grad * output``
    (eager.py); FSDP2's host-to-device copies of offloaded shards (fsdp.py: ``.to(device)`` is a
    no-op on a CPU-only machine); the memory-efficient kernel's backward temporaries
    (mem_efficient.py); bitsandbytes' dequantize + F.linear inside its gemm_4bit custom op
    (quant.py); and memplan's Triton backward's delta (triton_attention.py), allocated on both
    devices but inside its custom op, below the dispatch mode the CPU meter (MemTracker) watches,
    and its autotuner's benchmark buffer. (A function: the kernels' modules are imported only for
    a CPU view, not by the CUDA estimate.)"""
    from memplan.costmodel.timeline.act_offload import STAGING
    from memplan.costmodel.timeline.eager import SOFTMAX_TMP
    from memplan.costmodel.timeline.mem_efficient import DELTA, DELTA_PRODUCT, DELTA_SUM, WORKSPACE
    from memplan.costmodel.timeline.ops import FLASH_OUT_COPY, HEADS_MAJOR_COPY
    from memplan.costmodel.timeline.quant import CUDA_FALLBACK
    from memplan.costmodel.timeline.triton_attention import AUTOTUNE_FLUSH
    from memplan.costmodel.timeline.triton_attention import DELTA as TRITON_DELTA

    kernels = {STAGING, FLASH_OUT_COPY, HEADS_MAJOR_COPY, "reduce_workspace", "reduce_semaphores", SOFTMAX_TMP, "h2d"}
    kernels |= {DELTA_PRODUCT, DELTA_SUM, DELTA, WORKSPACE, TRITON_DELTA, AUTOTUNE_FLUSH}
    return frozenset(kernels | CUDA_FALLBACK)


# transformers' ``caching_allocator_warmup`` (``modeling_utils.py``, 5.23) keeps only accelerator devices
# (``is_accelerator_device``) and returns at once for a model loaded on the CPU (hf_build.py's warmup tensor)
WARMUP = "caching_allocator_warmup"


def cuda_only(tag: str, temporaries: frozenset[str] | None = None) -> bool:
    """Whether the tensor tagged ``tag`` is one only CUDA allocates: cuBLAS's workspaces, the
    embedding backward's index buffers, the kernels' temporaries (:func:`cuda_temporaries`), the
    loader's warmup segment (:data:`WARMUP`)."""
    last = tag.rpartition(".")[2]
    temporaries = cuda_temporaries() if temporaries is None else temporaries
    return tag.startswith("cublas_workspace") or last in CUDA_EMBEDDING_SCRATCH or last in temporaries or tag == WARMUP


def cpu_view(timeline: Timeline) -> Timeline:
    """``timeline`` without its CUDA-only allocations and their frees (marks kept, the steady
    snapshots' live sets and positions with them): what the same step allocates on CPU."""
    temporaries = cuda_temporaries()
    events, where = [], {}
    for i, e in enumerate(timeline.events):
        if e.op == MARK or not cuda_only(e.tag, temporaries):
            where[i] = len(events)
            events.append(e)
    snapshots = tuple(
        Snapshot(where[s.index], s.tag, s.since, tuple(e for e in s.live if not cuda_only(e.tag, temporaries)))
        for s in timeline.snapshots
    )
    return Timeline(tuple(events), snapshots, timeline.host_peak, timeline.stage)


ZERO3_ON_CPU = (
    "FSDP2 ZeRO-3 on CPU (at 128 tokens a micro-batch the trainer on CPU peaks 0.2-0.3 MB below the run, "
    "not traced to a tensor: docs/cost-model.md)"
)


def cpu_unmodelled(plan: Plan) -> str | None:
    """What keeps the bundled trainer's op-level run from answering a CPU estimate of ``plan`` that
    ``support.supported`` accepts, or None. FSDP2 with ``reshard_after_forward`` (ZeRO-3 over dp > 1)
    is declined: the CPU trainer at 2 x 64 and 4 x 32 tokens (tiny GQA Llama, rank simulation, torch
    2.13, 2026-11-28) peaked 199,316 B (bf16-mixed) and 298,388 B (fp32) below the run, while ZeRO-2,
    DDP and one rank agree to ~100 B there and ZeRO-3 does at 256 tokens; the same family of miss as
    TP 2 + SP over ZeRO-3 at 1 x 128 tokens (docs/cost-model.md). The phase model answers them."""
    if plan.dp > 1 and plan.zero == 3:
        return ZERO3_ON_CPU
    return None
