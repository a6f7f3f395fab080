"""fp32 attention without GQA on CUDA: SDPA's memory-efficient (CUTLASS) kernel, op by op (and, through
``mem_efficient_half.py``, its 16-bit form at every head dim: MLA, and masked sliding layers, on CUDA).

In fp32 with as many KV heads as query heads the trainer's ``F.scaled_dot_product_attention(q, k,
v, is_causal=True, enable_gqa=False)`` runs ``_scaled_dot_product_efficient_attention`` on CUDA
(flash and cuDNN take 16-bit only: ``attention.sdpa_backend``). From source (pytorch/pytorch; no
GPU trace ran it, and the CPU has no such kernel, so every size here is CUDA's alone):

Forward, ``_scaled_dot_product_efficient_attention_cuda`` (``transformers/cuda/attention.cu``):
q, k, v transposed to (b, s, heads, d), views; ``_efficient_attention_forward``:
``compute_log_sumexp`` holds in training (``should_compute_logsumexp``); without dropout and
outside graph capture the philox seed and offset are ``at::empty({}, kLong)`` on the **CPU**
(``device = in_capture_stream ? kCUDA : kCPU``): no device bytes; then ``res = at::empty({B, M,
heads, Kv}, output_t)`` (fp32), then ``logsumexp = at::empty({B, heads, ceil_div(M, kAlignLSE) *
kAlignLSE}, Float)`` with ``kAlignLSE = 32`` (``mem_eff_attention/kernel_forward.h``: "block size
of backward"); no output accumulator (``kNeedsOutputAccumulatorBuffer = !kKeepOutputInRF &&
output_accum_t != output_t``: both float). It returns ``res.transpose(1, 2)``: the caller's
``out.transpose(1, 2).reshape(b, s, -1)`` is a view, as flash's. Autograd saves q, k, v, the
output and the log-sum-exp (and the two CPU seeds).

Backward, ``_scaled_dot_product_efficient_attention_backward_cuda`` and
``_efficient_attention_backward`` (``transformers/cuda/attention_backward.cu``): the incoming
gradient transposed and ``.contiguous()`` (token-major already: no copy); ``grad_q``, ``grad_k``,
``grad_v`` by ``at::empty(sizes)``, one each ("We removed the chunk/cat optimization");
``delta``: ``kKernelComputesDelta = kIsHalf && ...`` is false in fp32
(``mem_eff_attention/kernel_backward.h``), so ``(grad_out.to(kFloat) * out.to(kFloat)).sum(-1)
.transpose(-2, -1).contiguous()``: the product (B M heads Kv, fp32; the casts are no-ops), its sum
(B M heads), the transposed copy (B heads M), the two temporaries freed at the statement's end
(C++ full-expression), ``delta`` with the launch lambda; then the workspace, ``at::empty({
p.workspace_size()}, Byte)``, freed as the function returns. In fp32 only dQ needs it
(``kNeedsAccumGradQ = kEnableSplitKeys || ...`` with ``kEnableSplitKeys = kMinSm >= 70``;
``kNeedsAccumGradK/V`` need ``output_accum_t != output_t``): ``workspace_size = B * heads *
align_up(ceil_div(M, kBlockSizeI) * ceil_div(d, kBlockSizeJ) * sizeof(GradQTempStorage) / 4, 4) *
4``, ``GradQTempStorage`` a 16-byte lock header and ``kBlockSizeI x kBlockSizeJ`` fp32
accumulators (``MatmulGradQ::ThreadblockShape = <kBlockSizeI, kBlockSizeJ>``); zeroed in place
when the keys are split. The block sizes are the first fp32 Sm80 kernel
(``kernels/cutlassB.h``, ``dispatch_cutlassB_f32_sm80``, which serves compute capability 9.0)
whose ``kMaxK`` covers the head dim: 64 x 64 up to d = 64, 128 x 64 up to 128, then 128 x 64
(``k65536``); :data:`BACKWARD_BLOCKS`. Not checked on a GPU: that the 128 x 64 kernel's shared
memory fits (else 64 x 64, a few hundred bytes less a head).
"""

from __future__ import annotations

from memplan.costmodel.timeline import mem_efficient_half, ops
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.mem_efficient_half import GRAD_Q_LOCK

K_ALIGN_LSE = 32  # kernel_forward.h: kAlignLSE, the log-sum-exp's padding of M
# (kMaxK, kBlockSizeI, kBlockSizeJ) of dispatch_cutlassB_f32_sm80's aligned kernels without dropout, in order
BACKWARD_BLOCKS = ((32, 64, 64), (64, 64, 64), (128, 128, 64), (65536, 128, 64))
# tags of what only CUDA allocates here (the CPU comparison has no memory-efficient kernel)
DELTA_PRODUCT, DELTA_SUM, DELTA, WORKSPACE = "delta_product", "delta_sum", "delta", "grad_q_workspace"
OUTPUT_ACCUM = "output_accum"  # the 16-bit forward's fp32 accumulator over heads above 128 (mem_efficient_half.py)


def lse_numel(b: int, heads: int, s: int) -> int:
    """The log-sum-exp's elements: (b, heads, s rounded up to :data:`K_ALIGN_LSE`)."""
    return b * heads * -(-s // K_ALIGN_LSE) * K_ALIGN_LSE


def workspace_bytes(b: int, heads: int, s: int, head_dim: int, value_dim: int | None = None) -> int:
    """``p.workspace_size()`` of the backward kernel ``dispatch_cutlassB_f32_sm80`` picks: dQ's
    per-tile accumulators and locks, per (batch, head), aligned to 4 floats. The kernel is the first
    whose ``kMaxK`` covers ``max(K, Kv)`` (``value_dim``: the value heads' width, MLA's; None: ``head_dim``);
    dQ's tiles span K."""
    max_k = max(head_dim, value_dim or head_dim)
    _, bi, bj = next(blocks for blocks in BACKWARD_BLOCKS if blocks[0] >= max_k)
    tiles = -(-s // bi) * -(-head_dim // bj)
    per_head = tiles * (GRAD_Q_LOCK + bi * bj * 4) // 4
    return b * heads * -(-per_head // 4) * 4 * 4


def sdpa(
    tape: Tape,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    b: int,
    heads: int,
    s: int,
    head_dim: int,
    value_dim: int | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """``_scaled_dot_product_efficient_attention`` on (b, heads, s, d) views of token-major q, k,
    v (as many KV heads as query heads; ``value_dim``: v's head width where it differs, MLA's): the
    output (v's size) and the padded log-sum-exp; saves q, k, v, out, lse, and ``bias`` first where one is
    given (``attn_bias``, read through a view by both kernels, given no gradient: ``hf_sliding.py``).
    Backward: dq, dk, dv, then in
    fp32 the delta's temporaries and dQ's workspace, in 16 bits the kernel's delta and its workspace
    (``mem_efficient_half.py``; over heads above 128 also the forward's fp32 output accumulator). A selective
    checkpoint that saves it keeps out and lse and hands them back (``ops.sdpa``)."""
    half = q.itemsize == 2
    qn, kn, vn, rows = q.numel, k.numel, v.numel, b * heads * s
    if half:
        ws = mem_efficient_half.workspace_bytes(b, heads, s, head_dim, value_dim or head_dim)
    else:
        ws = workspace_bytes(b, heads, s, head_dim, value_dim)

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        dq, dk, dv = (tape.new(n, q.itemsize, name) for n, name in ((qn, "dq"), (kn, "dk"), (vn, "dv")))
        if half:  # kKernelComputesDelta: at::empty({B, nH, M}, float)
            delta = tape.new(rows, 4, DELTA)
        else:  # (grad_out.to(float) * out.to(float)).sum(-1).transpose(-2, -1).contiguous()
            product = tape.new(vn, 4, DELTA_PRODUCT)
            total = tape.new(rows, 4, DELTA_SUM)
            delta = tape.new(rows, 4, DELTA)
            tape.drop(total)
            tape.drop(product)
        workspace = tape.new(ws, 1, WORKSPACE)
        tape.drop(delta)  # the launch lambda's local
        tape.drop(workspace)  # the function's
        return [dq, dk, dv]

    saved = [q, k, v] if bias is None else [bias, q, k, v]
    node = tape.node("sdpa_efficient", apply, [q, k, v], saved=saved)

    def forward() -> list[Tensor]:
        out = ops.result(tape, vn, q.itemsize, "sdpa_efficient.out", node)
        out.transposed = True  # written (b, s, heads, d), returned transposed
        lse = tape.new(lse_numel(b, heads, s), 4, "sdpa_efficient.lse")
        if half and mem_efficient_half.output_accumulator(head_dim, value_dim or head_dim):
            # kNeedsOutputAccumulatorBuffer (the 32x128_gmem kernel): the lambda's output_accum, fp32 of out's shape
            tape.drop(tape.new(vn, 4, f"sdpa_efficient.{OUTPUT_ACCUM}"))
        return [out, lse]

    return ops.attention_output(tape, node, forward)
