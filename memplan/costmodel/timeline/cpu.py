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
    and its autotuner's benchmark buffer; FSDP2's copy-out and reduce-scatter copy-in metadata, which
    CUDA's ``split_with_sizes_copy`` and ``_chunk_cat`` kernels pack onto the device and CPU's
    composites never make (fsdp.py: ``COPY_OUT``, ``COPY_IN``). (A function: the kernels' modules
    are imported only for a CPU view, not by the CUDA estimate.)"""
    from memplan.costmodel.timeline.act_offload import STAGING
    from memplan.costmodel.timeline.eager import SOFTMAX_TMP
    from memplan.costmodel.timeline.fsdp import COPY_IN, COPY_OUT
    from memplan.costmodel.timeline.mem_efficient import DELTA, DELTA_PRODUCT, DELTA_SUM, WORKSPACE
    from memplan.costmodel.timeline.ops import FLASH_OUT_COPY, HEADS_MAJOR_COPY
    from memplan.costmodel.timeline.quant import CUDA_FALLBACK
    from memplan.costmodel.timeline.triton_attention import AUTOTUNE_FLUSH
    from memplan.costmodel.timeline.triton_attention import DELTA as TRITON_DELTA

    kernels = {STAGING, FLASH_OUT_COPY, HEADS_MAJOR_COPY, "reduce_workspace", "reduce_semaphores", SOFTMAX_TMP, "h2d"}
    kernels |= {DELTA_PRODUCT, DELTA_SUM, DELTA, WORKSPACE, TRITON_DELTA, AUTOTUNE_FLUSH, COPY_OUT, COPY_IN}
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
    for i, e in enumerate(timeline.raw):
        if e[0] == MARK or not cuda_only(e[5], temporaries):
            where[i] = len(events)
            events.append(e)
    snapshots = tuple(
        Snapshot(where[s.index], s.tag, s.since, tuple(e for e in s.live if not cuda_only(e[5], temporaries)))
        for s in timeline.snapshots
    )
    return Timeline(tuple(events), snapshots, timeline.host_peak, timeline.stage, timeline.managed)
