"""Qwen2-style q, k, v biases (``ModelSpec.qkv_bias``) in the bundled trainer's op-level run.

The trainer builds ``nn.Linear(h, out, bias=spec.qkv_bias)`` for wq, wk and wv
(``memplan/train/model.py``). What a bias changes, op by op (torch 2.13, CPU dispatch log of
``nn.Linear`` over a (b, s, h) input, tests/unit/test_timeline_qkv_bias.py):

- forward: ``at::linear`` takes ``_flatten_nd_linear`` for a contiguous 3-D input with a bias
  (aten/src/ATen/native/Linear.cpp): ``addmm(bias, x.view(b s, h), w.t())`` viewed back to
  (b, s, out), one (b s, out) output as ``mm``'s. ``AddmmBackward0`` saves ``mat1`` (x) for dW and
  ``mat2`` (``w.t()``) for dX (tools/autograd/derivatives.yaml ``addmm``), nothing for the bias.
  Under autocast ``linear``'s arguments are cast right to left: the bias, the weight, the input
  (each leaf that requires grad cached for the forward, as the weight's);
- backward: dX (``mm(grad, w)``) first, then dW (``mm(grad.t(), x)``), the reverse of
  ``MmBackward0``; the bias's gradient is the incoming (b s, out) one (``maybe_multiply(grad, 1)``),
  summed to (out,) by the engine's ``validate_outputs`` (``sum_to``: ``sum(0, keepdim)`` then a
  view) once the apply returns. On CUDA that column sum is ``Reduce.cuh``'s global reduction: a
  staging buffer and semaphores while it runs (:func:`column_sum_staging`);
- parameters: each bias (out,) follows its weight in ``model.parameters()`` (DDP's buckets,
  ZeRO-1's partitions, AdamW's states and bf16-master's masters follow that order); FSDP2 shards
  and pads it on dim 0 as a norm weight; under TP it is column-parallel, sharded as its weight's
  rows (``ColwiseParallel``: ``Shard(0)``); under LoRA it stays frozen in the base linear, built
  before the adapters (``Module._apply`` visits the base child first).
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor

QKV = ("attention.wq", "attention.wk", "attention.wv")
# Reduce.cuh's launch (setReduceConfig): at most 512 threads a block, warps of 32, 2048 resident
# threads per SM, 132 SMs (H100 SXM and H200), values per thread split from 16 to 256
MAX_THREADS, WARP, THREADS_PER_SM, SMS = 512, 32, 2048, 132
MIN_VALUES, MAX_VALUES = 16, 256
ACC_BYTES = 4  # the fp32 accumulator of a bf16 or fp32 sum


def bias_name(weight: str) -> str | None:
    """The bias of a q, k or v weight (``layers.{i}.attention.wq.weight``), else None."""
    prefix = weight.removesuffix(".weight")
    return f"{prefix}.bias" if prefix.split(".", 2)[-1] in QKV else None


def _pow2(n: int, cap: int) -> int:
    """``last_pow2`` below ``cap``, else ``cap`` (``ReduceConfig::set_block_dimension``)."""
    return cap if n >= cap else 1 << (max(n, 1).bit_length() - 1)


def column_sum_staging(rows: int, cols: int) -> tuple[int, int]:
    """Bytes of the staging buffer and of the semaphores of CUDA's sum of a contiguous
    (rows, cols) tensor over its rows, (0, 0) when it needs none (aten/src/ATen/native/cuda/
    Reduce.cuh, ``setReduceConfig``, ``global_memory_size``, ``semaphore_size``): the reduced dim is
    not the fastest, so outputs are vectorized by 4 and split over the block's 32 lanes, the rows
    over its warps when each thread keeps 16 values or more; then over ``ctas`` blocks per output
    when each thread still has 256 or more and the grid is under one wave, staging
    ``4 x cols x ctas x 32 x 4`` B. For (8192, 2048) that is 128 MiB (8 B per element) and for
    (16384, 4096) 132 MiB: the norm weights' ``autograd.REDUCE_WORKSPACE_CAP`` cases."""
    vec = 4
    while cols % vec:
        vec //= 2
    cap = MAX_THREADS // vec
    dim0, dim1 = _pow2(cols // vec, cap), _pow2(rows, cap)
    height = min(dim1, cap // min(dim0, WARP))
    width = min(dim0, cap // height)
    if rows < min(height * MIN_VALUES, MAX_VALUES):  # each warp its own outputs: no global reduction
        return 0, 0
    values, grid = -(-rows // height), -(-(cols // vec) // width)
    target = SMS * (THREADS_PER_SM // (width * height))
    if values < MAX_VALUES or grid > target:
        return 0, 0
    ctas = max(min(-(-target // grid), -(-values // MIN_VALUES)), -(-values // MAX_VALUES))
    if ctas == 1:
        return 0, 0
    return ACC_BYTES * cols * ctas * width * vec, 4 * grid


def _bias_grad(tape: Tape, g: Tensor, bias: Tensor) -> Tensor:
    """``validate_outputs``' ``sum_to`` of the (b s, out) gradient to the bias: the (out,) sum,
    and on CUDA its staging buffer and semaphores, freed as the kernel's launcher returns."""
    out = tape.new(bias.numel, g.itemsize, "bias.grad", ops.grad_category(bias))
    if tape.reduce_workspace:
        staging, semaphores = column_sum_staging(g.numel // bias.numel, bias.numel)
        if staging:
            ws = tape.new(staging, 1, "reduce_workspace")
            tape.drop(tape.new(semaphores, 1, "reduce_semaphores"))
            tape.drop(ws)
    return out


def _product(tape: Tape, numel: int, itemsize: int, tag: str, weight: Tensor | None = None) -> Tensor:
    """A backward ``mm``'s output, a view (dX the 2-D product reshaped back, dW ``grad.t()``), and
    cuBLAS's workspace at the backward's first product."""
    out = tape.new(numel, itemsize, tag, ops.grad_category(weight))
    out.view = True
    if tape.on_first_mm is not None:
        tape.on_first_mm()
    return out


def addmm(tape: Tape, x: Tensor, w: Tensor, bias: Tensor, out_numel: int, tag: str) -> Tensor:
    """``F.linear(x, w, bias)``: ``addmm`` on the flattened input (``ops.linear`` otherwise). Saves
    x for dW and ``w.t()`` for dX, each only when that gradient is needed. Backward
    (AddmmBackward0): dX (a view of the 2-D product), dW (``w.t()``'s TBackward view), then the
    bias's sum. A selective-op checkpoint counts it as a matmul (``parallel._OP_SAC_MATMULS``)."""
    x_numel, w_numel = x.numel, w.numel

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        itemsize = g[0].itemsize
        dx = _product(tape, x_numel, itemsize, "dX") if node.nexts[1] is not None else None
        dw = _product(tape, w_numel, itemsize, "dW", w) if node.nexts[2] is not None else None
        db = _bias_grad(tape, g[0], bias) if node.nexts[0] is not None else None
        return [db, dx, dw]

    saved = ([x] if w.fn is not None else []) + ([ops._transpose(w)] if x.fn is not None else [])
    node = tape.node(tag, apply, [bias, x, w], saved=saved)
    kept = tape.cached("mm")
    if kept is not None:
        kept[0].fn = node
        return kept[0]
    out = ops.result(tape, out_numel, x.itemsize, tag, node)
    if tape.on_first_mm is not None:
        tape.on_first_mm()
    tape.keep("mm", [out])
    return out
