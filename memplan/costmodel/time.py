"""Step time of a training plan on the slowest pipeline stage.

The step is the micro-batches' kernels, priced by class as one GPU runs them: GEMMs at an
achievable fraction of the dense peak of the dtype they run in (bf16 on tensor cores; fp32 as
IEEE fp32 on CUDA cores, PyTorch's default), fused attention kernels at their own fraction,
the math / eager attention path as two batched GEMMs (roofline: FLOPs or the s x s operands'
bytes) plus its score traffic, element-wise, norm, cast and loss kernels at HBM bandwidth;
plus the communication that is not hidden behind compute, the pipeline bubble and the
optimizer step (bytes it moves at HBM bandwidth). Collectives follow the alpha-beta model of
ring algorithms (Thakur et al. 2005; Patarasuk & Yuan 2009): a ring all-reduce of B bytes over
n ranks takes 2 (n - 1) (alpha + B / (n bw)), an all-gather or a reduce-scatter half that. Each
group runs over NVLink when it fits in a node, else over the inter-node network (Megatron's
rank order: TP innermost, then CP, EP, DP, PP outermost).

Every constant below is an assumption with its source; a calibration per GPU profile
(measured / predicted step time from ``memplan tune --validate``) scales the result.
"""

from dataclasses import field
from functools import lru_cache
from operator import attrgetter
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from memplan.costmodel import lora as L
from memplan.costmodel import params as P
from memplan.costmodel.activations import layer_matmul_widths
from memplan.costmodel.flops import attention_flops_per_token, training_flops_per_token
from memplan.costmodel.layout import stage_layer_indices
from memplan.costmodel.optimizer import is_paged, paged_residency, state_bytes_per_param
from memplan.costmodel.precision import POLICIES
from memplan.costmodel.rank import gradient_accumulation, sdpa_kind
from memplan.costmodel.runtimes import RUNTIMES
from memplan.records import record
from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload


class Efficiency(BaseModel):
    """Fractions of peak that real kernels reach; ``calibration`` scales the whole step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    matmul: float = Field(0.75, gt=0, le=1, description="Large bf16 GEMMs: ~740 of 989 TFLOP/s on H100 SXM (cuBLAS).")
    matmul_fp32: float = Field(
        0.75,
        gt=0,
        le=1,
        description="IEEE fp32 GEMMs on CUDA cores (cuBLAS SGEMM): the generic large-GEMM fraction; the profiles' "
        "fitted ``matmul`` is a bf16 tensor-core figure and is not applied to them.",
    )
    attention: float = Field(
        0.45,
        gt=0,
        le=1,
        description="FlashAttention-2 fwd + bwd: 35-50% of peak on H100 (FA2, FA3 papers).",
    )
    cudnn_attention: tuple[tuple[int, float, float], ...] = Field(
        (),
        description="SDPA's cuDNN backend against FlashAttention-2: (head dim, forward speed-up, backward "
        "speed-up) rows (the GPU profile's ``efficiency.cudnn_attention``); empty: cuDNN priced as flash.",
    )
    hbm: float = Field(0.8, gt=0, le=1, description="Element-wise kernels reach ~80% of HBM bandwidth.")
    network: float = Field(0.8, gt=0, le=1, description="NCCL bus bandwidth over link bandwidth for large messages.")
    alpha_intra_s: float = Field(5e-6, ge=0, description="Latency per ring step inside a node (NVLink).")
    alpha_inter_s: float = Field(15e-6, ge=0, description="Latency per ring step across nodes (InfiniBand).")
    dp_overlap: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Share of the compute that DP traffic hides behind.",
    )
    host_adam_params_per_s: float = Field(
        1e9, gt=0, description="CPU Adam updates per second per GPU (ZeRO-Offload's AVX CPU-Adam, ~1e9 params/s)."
    )
    host_thread_bytes_per_s: float = Field(
        10e9,
        gt=0,
        description="Bytes/s one host core streams to and from DRAM (an assumption, by Little's law: ~16 "
        "outstanding L1 misses of 64 B over ~100 ns of DRAM latency on a server core); what PyTorch's "
        "element-wise CPU kernels reach on one OpenMP thread.",
    )
    host_threads: int = Field(
        1,
        ge=1,
        description="OpenMP threads of each rank's CPU kernels: torchrun sets OMP_NUM_THREADS=1 per rank unless "
        "told otherwise (torch.distributed.run), and memplan validate's ranks do the same (validate/launch.py).",
    )
    calibration: float = Field(1.0, gt=0, description="Measured / predicted step time for this GPU profile.")

    @classmethod
    def for_gpu(cls, gpu: GPUSpec, calibration: float = 1.0) -> "Efficiency":
        """The defaults, with the matmul and attention fractions the GPU profile measured
        (its ``efficiency`` block) where it has them."""
        measured = gpu.efficiency
        if measured is None:
            return cls(calibration=calibration)
        return cls(
            matmul=measured.matmul,
            attention=measured.attention,
            cudnn_attention=measured.cudnn_attention,
            calibration=calibration,
        )


class TimeReport(BaseModel):
    """Predicted step of the slowest rank. ``breakdown`` (seconds) sums to ``step_time_s``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_time_s: float
    tokens_per_s: float = Field(description="Whole job, all data-parallel replicas.")
    tokens_per_s_per_gpu: float
    mfu: float = Field(description="Model FLOPs (PaLM App. B, no recomputation) / time / dense peak.")
    hfu: float = Field(description="Hardware FLOPs (with recomputation) / time / dense peak.")
    flops_per_step: float = Field(description="Model FLOPs of one step, whole job.")
    peak_flops: float = Field(description="Dense peak FLOP/s per GPU of the compute dtype.")
    calibration: float = Field(1.0, description="Measured / predicted step time applied (1: uncalibrated).")
    breakdown: dict[str, float]


class Link(NamedTuple):
    bytes_per_s: float
    alpha_s: float


def group_link(gpu: GPUSpec, cluster: ClusterSpec, stride: int, size: int, eff: Efficiency) -> Link:
    """The bottleneck bandwidth of a ring over a group of ``size`` ranks ``stride`` apart.

    Inside one node: NVLink (or PCIe). Across nodes: NCCL splits a collective over several
    rings (channels) and, on rail-optimised clusters (one NIC per GPU), each ring leaves a
    node through a different GPU's NIC, so the data a node must send and receive is spread
    over the NICs of the group's ranks on that node: the ring runs at (ranks per node) x
    (per-GPU network bandwidth), capped by NVLink, which every byte also crosses inside the
    node. A group one rank per node (e.g. data parallelism across nodes under TP = 8) gets
    one NIC. (NCCL's ring topology, docs "NCCL_ALGO"/"NCCL_CROSS_NIC"; nccl-tests multi-node
    busbw is about the node's total NIC bandwidth, e.g. ~400 GB/s on 8 x 400 Gb/s H100 nodes.)"""
    intra = gpu.nvlink_bytes_per_s or gpu.pcie_bytes_per_s
    if stride * size <= cluster.gpus_per_node:
        return Link(intra * eff.network, eff.alpha_intra_s)
    per_node = max(1, min(size, cluster.gpus_per_node // stride))
    return Link(min(per_node * cluster.inter_node_bytes_per_s, intra) * eff.network, eff.alpha_inter_s)


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in total: (n - 1) (alpha + B / (n bw))."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * (link.alpha_s + nbytes / n / link.bytes_per_s)


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, 2 (n - 1) (alpha + B / (n bw))."""
    return 2 * all_gather_s(nbytes, n, link)


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of ``nbytes`` per rank: each rank sends (n - 1)/n of it, pairwise."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.alpha_s + nbytes * (n - 1) / n / link.bytes_per_s


def layer_matmul_params(model: ModelSpec, index: int) -> float:
    """Parameters of layer ``index`` a token is multiplied by (routed experts: top_k of them)."""
    count = P.layer_params(model, index) - P.layer_norm_params(model) - P.qk_norm_params(model)
    if model.is_moe_layer(index):
        moe = model.moe
        assert moe is not None
        count -= (moe.num_experts - moe.top_k) * P.mlp_params(model, moe.expert_ffn_size)
    return count


def stage_flops_per_token(model: ModelSpec, plan: Plan, stage: int, seq_len: int, causal: bool) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one token's forward and backward on pipeline ``stage``
    (all its chunks), before the split over TP and CP: 6 x params per layer (the LM head's
    V h on the last stage), 12 q s per layer for attention, halved when causal blocks are
    skipped."""
    on_stage = stage_layers(model, plan.pp, plan.virtual_stages, stage)
    matmul = 6.0 * on_stage.matmul_params
    if stage == plan.pp - 1:
        matmul += 6.0 * model.vocab_size * model.hidden_size
    attention = attention_flops_per_token(model, seq_len, causal, on_stage.layers)
    return matmul, attention


class StageLayers(NamedTuple):
    """What the step-time model reads of a pipeline stage's layers, summed once per stage."""

    layers: int  # how many
    matmul_params: int  # sum of layer_matmul_params over the stage's layers
    moe_layers: int


@lru_cache(maxsize=4096)
def stage_layers(model: ModelSpec, pp: int, virtual_stages: int, stage: int) -> StageLayers:
    """The layers of pipeline rank ``stage`` (``layout.stage_layer_indices``): how many, the
    parameters a token is multiplied by in them, and how many are MoE layers. Depends on the
    model and the pipeline layout only, so the search computes it once per stage, not once per
    plan and layer."""
    indices = stage_layer_indices(model.num_layers, pp, virtual_stages, stage)
    return StageLayers(
        len(indices),
        sum(layer_matmul_params(model, i) for i in indices),
        sum(model.is_moe_layer(i) for i in indices),
    )


class Recomputation(NamedTuple):
    """Extra forward work recomputation adds, as shares of the step's (forward and backward)
    layer matmuls, attention and element-wise traffic, and extra TP collective rounds per
    layer beyond the forward's and the backward's."""

    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    tp_rounds: float = 0.0


def recompute_fraction(plan: Plan, layers: int, model: ModelSpec | None = None) -> Recomputation:
    """Full recomputation runs a recomputed layer's forward again: a third of its forward and
    backward, collectives included. Selective (Korthikanti Sec. 5) runs the attention core
    again: a third of the attention. Selective-op (torchtitan's per-op SAC) runs the even-
    numbered matmuls again (k, the output projection, up / fc2: for Llama 3 8B 37% of the
    layer's forward matmul FLOPs, so 12% of the step's), every element-wise kernel, eager
    attention (not on the save list; flash attention's output is saved) and the forward's
    collectives but the saved reduce-scatters (SP: the two all-gathers; else the two
    all-reduces)."""
    if plan.recompute == "full":
        share = 1.0 if plan.recompute_layers is None else min(plan.recompute_layers, layers) / max(layers, 1)
        return Recomputation(share / 3, share / 3, share / 3, share)
    if plan.recompute == "selective":
        return Recomputation(attention=1 / 3)
    if plan.recompute == "selective-op":
        assert model is not None, "selective-op needs the model's matmul widths"
        attention = 1 / 3 if plan.attention == "eager" else 0.0
        return Recomputation(_op_sac_redone(model) / 3, attention, 1 / 3, 0.5 if plan.sequence_parallel else 1.0)
    return Recomputation()


@lru_cache(maxsize=256)
def _op_sac_redone(model: ModelSpec) -> float:
    """The share of a layer's matmul FLOPs selective-op recomputation runs again: the second,
    fourth, ... of ``layer_matmul_widths`` (once per model)."""
    widths = [i * o for i, o in layer_matmul_widths(model)]
    return sum(w for k, w in enumerate(widths) if k % 2 == 1) / sum(widths)


def cast_bytes(src: int, dst: int) -> int:
    """Bytes one element's dtype conversion moves: read ``src``, write ``dst`` (none when equal)."""
    return 0 if src == dst else src + dst


def runs_autocast(plan: Plan, runtime: str) -> bool:
    """bf16-mixed under ``torch.autocast`` (fp32 params, bf16 matmuls): the eager PyTorch runtimes
    (``RuntimeProfile.autocast``) unless FSDP2's mixed-precision policy casts the params instead
    (ZeRO-2/3 over more than one rank), as ``memory._shape`` decides."""
    policy = POLICIES[plan.precision]
    rt = RUNTIMES[runtime]
    fsdp2 = rt.pytorch_parallel and plan.zero >= 2 and plan.dp * plan.cp > 1
    return rt.autocast and policy.param_bytes > policy.compute_bytes and not fsdp2


def elementwise_bytes_per_token(
    model: ModelSpec, plan: Plan, layers: int, d: int, fused: bool, *, autocast: bool = False
) -> float:
    """HBM traffic of one token's memory-bound kernels on a stage, forward and backward
    (backward ~2x forward), in bytes.

    Per layer and element, forward, eager PyTorch (transformers, torchtitan without compile,
    memplan's trainer), with r the residual stream's dtype (d; fp32 under autocast):
    RMSNorm runs as an upcast to fp32, square, mean, scale, downcast and weight multiply
    (cast(r, 4) + 20 + cast(4, r) + 2 r: 4 d + 28 for d = 2, 28 in fp32), but LayerNorm is one
    ATen kernel (``native_layer_norm``: read and write, 2 d); RoPE ``x cos + rotate_half(x) sin``
    (mul, neg, cat, mul, add: 5 d + 5 r' bytes on q and k, r' the product's dtype, the tables'
    being r; none for learned or ALiBi positions); SwiGLU is silu then multiply (5 d on f), a
    plain MLP's activation one kernel (2 d on f); two residual adds (r + d + r on h). Fused
    kernels (Megatron / Transformer Engine) read and write each tensor once: 2 d, 2 d, 3 d (2 d
    plain), 3 d. TP splits q, k and f; sequence parallelism also the h-wide terms.

    ``autocast`` (``torch.autocast`` over fp32 params): the residual stream, the norms and
    RoPE's tables are fp32 (r = 4), every matmul casts its fp32 input to d itself (autocast
    caches weights, not activations: q, k, v, gate and up each cast the norm's output, 6 bytes
    per element each) and the attention kernel casts the fp32 RoPE'd q and k back to d."""
    h, t = model.hidden_size, plan.tp
    f = model.moe.expert_ffn_size * model.moe.top_k if model.moe else model.ffn_size
    qk = (model.q_size + model.kv_size) / t
    gated = model.mlp == "gated"
    r = 4 if autocast else d
    casts = 0.0
    if fused:
        norm, rope, act, add = 2 * d, 2 * d, (3 * d if gated else 2 * d), 3 * d
    else:
        norm = cast_bytes(r, 4) + 20 + cast_bytes(4, r) + 2 * r if model.norm == "rmsnorm" else 2 * r
        product = max(d, r)
        rope = 5 * d + 5 * product + cast_bytes(product, d)
        act, add = (5 * d if gated else 2 * d), 2 * r + d
        casts = (3 + (2 if gated else 1)) * cast_bytes(r, d)
    if model.position_embedding != "rope":
        rope = 0
    wide = (2 * norm + 2 * add + casts) * h / (t if plan.sequence_parallel else 1)
    forward = wide + rope * qk + act * f / t
    return 3.0 * forward * layers


def eager_score_bytes_per_token(
    model: ModelSpec, plan: Plan, seq_len: int, layers: int, d: int, fused: bool, dropout: bool
) -> float:
    """HBM traffic of eager attention's memory-bound kernels on the a x s x s scores, per
    token on a stage, forward and backward (backward ~2x forward), in bytes.

    Eager attention materialises each query's scores against all ``seq_len`` keys (the causal
    mask is applied to them, nothing is skipped): a s / t score elements per token and layer.
    Per element, forward: a fused scale-mask-softmax (Megatron's ``FusedScaleMaskSoftmax``)
    reads and writes it once, 2 d; unfused PyTorch scales (2 d), masks (2 d), takes an fp32
    softmax (d + 4) and casts back (4 + d): 6 d + 8. Attention dropout adds a read, a write and
    a 1-byte mask: 2 d + 1. The two batched matmuls around them are GEMMs
    (:func:`score_gemm_bytes_per_token`).

    For bf16 the unfused count is also what memplan's trainer moves, itemised forward and
    backward: scale 4, mask 4, ``softmax(dtype=float32)`` as a separate upcast 6 (ATen's
    ``softmax`` fuses the upcast only for Half) and an fp32 softmax 8, the cast for P V 6 (28);
    backward the casts' 6 + 6, softmax's 12, mask 4, scale 4 (32): 60 = 3 (6 d + 8)."""
    if plan.attention != "eager":
        return 0.0
    per_element = 2 * d if fused else 6 * d + 8
    if dropout:
        per_element += 2 * d + 1
    scores = model.num_attention_heads * seq_len / plan.tp
    return 3.0 * per_element * scores * layers


def math_score_bytes_per_token(
    model: ModelSpec, plan: Plan, seq_len: int, layers: int, d: int, recompute: float = 0.0
) -> float:
    """HBM traffic of SDPA's math path on its a x s x s scores, per token on a stage, forward
    and backward (``_scaled_dot_product_attention_math``, ATen ``attention.cpp``).

    Per element, forward: the causal mask added in place (2 d), then ``_safe_softmax``: softmax
    (2 d), ``eq(-inf)`` (d + 1), ``all`` over the row (1), ``where`` (2 d): 7 d + 2; backward the
    softmax's (read the gradient and the output, write: 3 d): 10 d + 2 (42 bytes in fp32).
    ``recompute``: the forwards run again (``3 x Recomputation.attention``; full recomputation:
    1), each the forward's 7 d + 2 bytes: unlike the GEMMs' a third, the forward is 30 of the 42
    fp32 bytes (the H200 profile of the QLoRA step runs the mask add, softmax, ``isneginf``,
    ``all`` and ``where`` kernels twice a layer and the softmax backward once)."""
    scores = model.num_attention_heads * seq_len / plan.tp
    forward, backward = 7 * d + 2, 3 * d
    return (forward * (1 + recompute) + backward) * scores * layers


def score_gemm_bytes_per_token(model: ModelSpec, plan: Plan, seq_len: int, layers: int, d: int) -> float:
    """The s x s operands of the math / eager path's batched GEMMs, per token on a stage: forward
    Q K^T writes the scores and P V reads the probabilities; backward dP = dO V^T writes, and dV,
    dQ, dK read one each: 6 d bytes per score element. With a head size of 64 these GEMMs do
    2 x 64 FLOPs per element moved, below the ridge point of a bf16 tensor core (H100 SXM:
    989 TFLOP/s / 3.35 TB/s ~ 295 FLOP/B): they run at HBM bandwidth, not at the matmul peak
    (roofline, Williams et al. 2009)."""
    return 6 * d * model.num_attention_heads * seq_len / plan.tp * layers


def materialised_token_bytes(model: ModelSpec, plan: Plan, layers: int, d: int, autocast: bool = False) -> float:
    """Per-token traffic around the math / eager path's GEMMs, on a stage, forward and backward
    (backward ~2x forward): GQA's ``repeat_interleave`` of K and V up to the query heads (read
    kv, write q wide; K in fp32 under autocast, after RoPE) and the copy of the (b, a, s, d_h)
    output into (b, s, a d_h) for the output projection (2 d on q). Flash kernels read the
    unrepeated heads and write the output in that layout."""
    q, kv = model.q_size / plan.tp, model.kv_size / plan.tp
    k_bytes = 4 if autocast else d
    repeat = (k_bytes + d) * (kv + q) if model.kv_heads < model.num_attention_heads else 0.0
    return 3.0 * (repeat + 2 * d * q) * layers


def gemm_seconds(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    """Roofline time of a GEMM (Williams, Waterman & Patterson 2009): compute- or memory-bound,
    whichever is slower."""
    return max(flops / flops_per_s, nbytes / bytes_per_s)


def loss_bytes_per_token(model: ModelSpec, plan: Plan, fused: bool = True, d: int = 4) -> float:
    """The last stage's logits, per token.

    Fused (Megatron's vocab-parallel cross-entropy): the log-softmax reads and writes b s V / t
    in fp32, its backward once more (~4 passes of 4 bytes).

    Eager PyTorch (``F.cross_entropy(logits.float(), labels)``): the upcast of the d-byte logits
    (d + 4, none in fp32); ``log_softmax`` over rows too long for shared memory (ATen
    ``cunn_SoftMaxForward``: a reduction pass and a pass that re-reads and writes, 12); backward
    ``nll_loss`` writes a dense fp32 gradient (4), ``log_softmax``'s backward sums it and then
    reads it and the output to write (16), and the upcast's backward casts it to d (4 + d)."""
    if fused:
        return 4 * 4 * model.vocab_size / plan.tp
    return (2 * cast_bytes(d, 4) + 12 + 4 + 16) * model.vocab_size / plan.tp


def autocast_weight_bytes(model: ModelSpec, plan: Plan, stage: int) -> float:
    """Per micro-batch under autocast: every matmul weight cast fp32 -> bf16 once in the forward
    (the autocast cache, 6 bytes) and its bf16 gradient cast to fp32 for ``.grad`` (6 bytes)."""
    weights = stage_layers(model, plan.pp, plan.virtual_stages, stage).matmul_params
    if stage == plan.pp - 1:
        weights += model.vocab_size * model.hidden_size
    return 12.0 * weights / plan.tp


def matmul_peak_flops(gpu: GPUSpec, precision: str) -> float:
    """The dense peak of the dtype the matmuls run in (fp8, fp32, else bf16), MFU's denominator;
    bf16's, or the profile's first figure, where the profile lacks that dtype. fp32 is IEEE fp32
    on CUDA cores: PyTorch's default ``torch.backends.cuda.matmul.allow_tf32 = False``
    (``get_float32_matmul_precision() == "highest"``) keeps fp32 matmuls off the TF32 tensor
    cores (H100 SXM: 66.9 vs 989.4 TFLOP/s bf16 dense, H100 whitepaper)."""
    policy = POLICIES[precision]
    dtype = "fp8" if policy.fp8_matmuls else ("fp32" if policy.compute_bytes == 4 else "bf16")
    return gpu.peak_flops.get(dtype) or gpu.peak_flops.get("bf16") or next(iter(gpu.peak_flops.values()))


def matmul_efficiency(eff: Efficiency, precision: str) -> float:
    """The fraction of that peak GEMMs reach: fp32 GEMMs (CUDA cores) at ``matmul_fp32``, tensor-core
    GEMMs (bf16, fp16, fp8) at ``matmul``."""
    return eff.matmul_fp32 if POLICIES[precision].compute_bytes == 4 else eff.matmul


def attention_speedups(eff: Efficiency, backend: str, head_dim: int) -> tuple[float, float]:
    """(forward, backward) speed of the fused attention kernel ``backend`` over FlashAttention-2's,
    whose throughput the efficiency's ``attention`` fraction is. cuDNN's (SDPA's cuDNN backend)
    come from the GPU profile's ``cudnn_attention`` rows (on Hopper: Shah et al. 2024,
    FlashAttention-3, arXiv 2407.08608, Figs. 5 and 6, the cuDNN and FlashAttention-2 bars),
    interpolated linearly in the head dim between rows and held at the end rows beyond them.
    Every other fused kernel (``flash``; the memory-efficient kernel; memplan's Triton
    FlashAttention-2, for which no backward figure is published) runs at flash's speed: (1, 1)."""
    rows = eff.cudnn_attention
    if backend != "cudnn" or not rows:
        return 1.0, 1.0
    if head_dim <= rows[0][0]:
        return rows[0][1], rows[0][2]
    for (d0, f0, b0), (d1, f1, b1) in zip(rows, rows[1:], strict=False):
        if head_dim <= d1:
            w = (head_dim - d0) / (d1 - d0)
            return f0 + w * (f1 - f0), b0 + w * (b1 - b0)
    return rows[-1][1], rows[-1][2]


def fused_attention_seconds(flash_s: float, speedups: tuple[float, float], recompute: float) -> float:
    """Seconds of a fused attention kernel's forward, recomputed forward and backward, from
    ``flash_s``, FlashAttention-2's seconds for the forward and backward (the time model's
    convention: the backward is two thirds of the FLOPs, as for the GEMMs), the kernel's
    (forward, backward) speed-ups over it (:func:`attention_speedups`) and ``recompute``
    (``Recomputation.attention``: the recomputed share of forward + backward, a third per
    recomputed forward)."""
    forward, backward = flash_s / 3, 2 * flash_s / 3
    return forward * (1 + 3 * recompute) / speedups[0] + backward / speedups[1]


def attention_backend(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, gpu: GPUSpec, autocast: bool = False
) -> str:
    """The attention kernel one rank runs: ``eager`` (scores materialised by the runtime), else
    the kernel PyTorch's ``scaled_dot_product_attention`` picks: ``flash`` needs fp16 / bf16,
    the memory-efficient kernel (``efficient``) takes fp32 but not ``enable_gqa``, so fp32 with
    GQA (fewer K/V heads than query heads) falls to the ``math`` path (PyTorch ``sdp_utils``;
    ``memory.sdpa_kind``, ``attention.sdpa_backend``: on torch 2.11 an H100 prefers ``cudnn``,
    priced as the fused kernels). memplan's Triton kernel (``triton``) is a flash kernel in any
    dtype. Over a quantized base q, k and v are fp32 (``time_lora.quantized_stream``): SDPA
    chooses as for fp32."""
    if plan.attention == "eager":
        return "eager"
    policy = POLICIES["fp32" if plan.quant != "none" and not autocast else plan.precision]  # quantized_stream
    return sdpa_kind(model, plan, policy, "cuda", gpu.compute_capability)


FOREACH_ADAMW_RUNTIMES = frozenset({"memplan", "hf-loop"})
"""Runtimes whose AdamW is ``torch.optim.AdamW(foreach=True)`` (the bundled trainer; the hand-written
transformers loop ``hf-loop``); Megatron runs a fused multi-tensor Adam, transformers' ``Trainer``
(``hf``) ``AdamW(fused=True)`` (its default ``optim``, ``adamw_torch_fused``)."""


def foreach_adamw(plan: Plan, runtime: str) -> bool:
    """Whether the step's AdamW is priced as ``foreach`` (:func:`adam_bytes_per_param`).

    Convention: ZeRO-2/3 under FSDP2 is priced fused. The FSDP2 runs the model is compared
    with are torchtitan's (``optimizer.implementation`` defaults to ``fused``), which
    benchmarks/time_vs_published.py predicts with the ``memplan`` runtime; the bundled
    trainer's own FSDP2 path runs ``foreach`` (52 bytes per owned parameter more), which is
    therefore under-costed there."""
    fsdp2 = RUNTIMES[runtime].pytorch_parallel and plan.zero >= 2 and plan.dp * plan.cp > 1
    return runtime in FOREACH_ADAMW_RUNTIMES and not fsdp2


def adam_bytes_per_param(policy, foreach: bool) -> float:  # noqa: ANN001 - PrecisionPolicy
    """HBM bytes one parameter's Adam(W) update moves.

    Fused (one kernel, apex / Transformer Engine FusedAdam, ``fused=True``): read and write the
    param, read the gradient, read and write two fp32 states and, with master weights, the
    fp32 master. ``foreach`` (``torch.optim.adam._multi_tensor_adam``, decoupled weight decay):
    eight passes, ``mul_`` (param r/w), ``lerp_`` (m r/w, g r), ``mul_`` (v r/w), ``addcmul_``
    (v r/w, g r), ``sqrt`` (v r, t w), ``div_`` and ``add_`` (t r/w each), ``addcdiv_`` (param
    r/w, m r, t r): 20 accesses of 4 bytes, 80; with master weights the gradients' cast to
    fp32 and the copy back to the params on top."""
    if not foreach:
        return 2 * policy.param_bytes + policy.grad_bytes + 2 * 2 * 4 + (2 * 4 if policy.master_bytes else 0)
    per_param = 20 * 4
    if policy.master_bytes:
        per_param += cast_bytes(policy.grad_bytes, 4) + cast_bytes(4, policy.param_bytes)
    return per_param


def _dp_group(plan: Plan) -> tuple[int, int]:
    """(stride, size) of the gradient-reduction group: dp x cp ranks, tp apart (Megatron's
    order tp-cp-dp-pp; CP ranks reduce gradients with their data-parallel peers)."""
    return plan.tp, plan.dp * plan.cp


class StepSpeed(NamedTuple):
    """The figures of a :class:`TimeReport` without the report (the search's fast form)."""

    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    flops_per_step: float
    peak_flops: float
    breakdown: dict[str, float]


def estimate_time(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    gpu: GPUSpec,
    cluster: ClusterSpec,
    runtime: str = "memplan",
    eff: Efficiency | None = None,
    attention_kernel: str | None = None,
) -> TimeReport:
    """Step time, tokens/s, MFU and HFU of a training plan (see the module docstring).
    ``runtime`` picks fused (``megatron``) or eager element-wise kernels, its loss and its
    optimizer implementation, and whether bf16-mixed runs under autocast. ``attention_kernel``: the
    fused kernel a run is known to have run (``flash``, ``efficient``, ``cudnn``) in place of the one
    :func:`attention_backend` picks for torch 2.11; a past run's, e.g. (eager plans stay eager)."""
    eff = eff or Efficiency.for_gpu(gpu)
    speed = step_speed(model, workload, plan, gpu, cluster, runtime, eff, attention_kernel=attention_kernel)
    return TimeReport(
        step_time_s=speed.step_time_s,
        tokens_per_s=speed.tokens_per_s,
        tokens_per_s_per_gpu=speed.tokens_per_s_per_gpu,
        mfu=speed.mfu,
        hfu=speed.hfu,
        flops_per_step=speed.flops_per_step,
        peak_flops=speed.peak_flops,
        calibration=eff.calibration,
        breakdown=speed.breakdown,
    )


_FULL_STAGE_FIELDS = (
    "tp", "cp", "pp", "virtual_stages", "ep", "sequence_parallel", "recompute", "recompute_layers", "attention",
    "precision", "finetune",
)  # fmt: skip
_LORA_STAGE_FIELDS = ("quant", "double_quant", "lora_targets", "lora_dropout", "modules_to_save")
STAGE_FIELDS = _FULL_STAGE_FIELDS + _LORA_STAGE_FIELDS
"""The plan fields one stage's micro-batch (:func:`_stage_micro_batch`) reads, itself or through
its helpers; not dp, ZeRO, offload, the schedule or the global batch (tests/unit/test_time.py
checks it by recording what the function reads). The LoRA / QLoRA ones are read only when
``finetune`` is not ``full`` (:func:`_stage_key` leaves them out of a full-training plan's key)."""
_full_stage_fields = attrgetter(*_FULL_STAGE_FIELDS)
_lora_stage_fields = attrgetter(*_LORA_STAGE_FIELDS)


def _stage_key(plan: Plan) -> tuple:
    """What a stage's micro-batch reads of the plan (``STAGE_FIELDS``), as the memo's key."""
    if plan.finetune == "full":
        return _full_stage_fields(plan)
    return _full_stage_fields(plan) + _lora_stage_fields(plan)


OPTIMIZER_FIELDS = (
    "zero", "pp", "tp", "offload_optimizer", "offload_params", "precision", "finetune", "lora_targets", "lora_rank",
    "modules_to_save",
)  # fmt: skip
"""What :func:`_optimizer` reads of the plan (besides the data-parallel size and the AdamW kind)."""
_optimizer_fields = attrgetter(*OPTIMIZER_FIELDS)


@record(frozen=False, slots=True)
class TimeMemo:
    """What the plans of one search share, for one model, GPU, cluster, efficiencies and
    runtime (``search.evaluate.Context`` owns one): one micro-batch's seconds on a stage, the
    FLOPs recomputation adds per token and the optimizer step, by the plan fields they read,
    the links of the groups the plans communicate over, and the model's parameter count and
    training FLOPs per token."""

    stages: dict[tuple, dict[str, float]] = field(default_factory=dict)
    recompute_flops: dict[tuple, float] = field(default_factory=dict)
    links: dict[tuple[int, int], Link] = field(default_factory=dict)  # group_link by (stride, size)
    optimizer: dict[tuple, dict[str, float]] = field(default_factory=dict)  # _optimizer's step
    flops: dict[int, float] = field(default_factory=dict)  # training_flops_per_token by sequence length
    params: int | None = None  # total_params (its lru_cache hashes the model: ~1 us a plan)

    def __init__(
        self,
        stages: "dict[tuple, dict[str, float]] | None" = None,
        recompute_flops: "dict[tuple, float] | None" = None,
        links: "dict[tuple[int, int], Link] | None" = None,
        optimizer: "dict[tuple, dict[str, float]] | None" = None,
        flops: "dict[int, float] | None" = None,
        params: "int | None" = None,
    ) -> None:  # written out: memplan.records (annotations quoted: not evaluated at import)
        self.stages = {} if stages is None else stages
        self.recompute_flops = {} if recompute_flops is None else recompute_flops
        self.links = {} if links is None else links
        self.optimizer = {} if optimizer is None else optimizer
        self.flops = {} if flops is None else flops
        self.params = params

    def total_params(self, model: ModelSpec) -> int:
        if self.params is None:
            self.params = P.total_params(model)
        return self.params

    def link(self, gpu: GPUSpec, cluster: ClusterSpec, stride: int, size: int, eff: Efficiency) -> Link:
        if (found := self.links.get((stride, size))) is None:
            found = self.links[stride, size] = group_link(gpu, cluster, stride, size, eff)
        return found


def step_speed(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    gpu: GPUSpec,
    cluster: ClusterSpec,
    runtime: str,
    eff: Efficiency,
    memo: TimeMemo | None = None,
    attention_kernel: str | None = None,
) -> StepSpeed:
    """:func:`estimate_time`'s figures, without building the report. ``memo``: what the plans
    of one search (one model, GPU, cluster, efficiencies and runtime) share; they differ in dp,
    ZeRO and offload more than in what a stage's micro-batch reads. ``attention_kernel``: as for
    :func:`estimate_time` (the search passes none; with a memo it must not change between plans)."""
    policy = POLICIES[plan.precision]
    d = policy.compute_bytes
    peak = matmul_peak_flops(gpu, plan.precision)
    m = gradient_accumulation(workload, plan)
    s, mb = workload.seq_len, workload.micro_batch  # read once: a model's attribute read is slow (PlanFields)
    tokens_mb = mb * s / plan.cp  # tokens one rank holds per micro-batch
    dp_stride, dp_size = _dp_group(plan)
    link = group_link if memo is None else memo.link
    dp_link = link(gpu, cluster, dp_stride, dp_size, eff)
    pp_link = link(gpu, cluster, plan.tp * plan.cp * plan.dp, 2, eff)
    autocast = runs_autocast(plan, runtime)
    stage_key = _full_stage_fields(plan) if plan.finetune == "full" else _stage_key(plan)
    key = (stage_key, s, mb, autocast)

    def stage_parts(stage: int) -> dict[str, float]:
        backend = attention_backend(model, workload, plan, gpu, autocast)
        if attention_kernel is not None and plan.attention != "eager":
            backend = attention_kernel
        return _stage_micro_batch(
            model,
            plan,
            stage,
            s,
            tokens_mb,
            d,
            peak,
            gpu,
            eff,
            link(gpu, cluster, 1, plan.tp, eff),
            link(gpu, cluster, plan.tp, plan.cp, eff),
            link(gpu, cluster, plan.tp * plan.cp, plan.ep, eff),
            runtime == "megatron",
            RUNTIMES[runtime].dropout,
            backend,
            autocast,
        )

    slowest: dict[str, float] = {}
    per_mb = -1.0
    for stage in (0,) if plan.pp == 1 else (0, plan.pp - 1):
        if memo is None:
            parts = stage_parts(stage)
        elif (parts := memo.stages.get((key, stage))) is None:
            parts = memo.stages[key, stage] = stage_parts(stage)
        if (seconds := sum(parts.values())) > per_mb:  # the first of equals
            slowest, per_mb = parts, seconds
    breakdown = {k: v * m for k, v in slowest.items()}

    # pipeline: (p - 1) / v micro-batch slots of bubble (1F1B, interleaved), the same for GPipe
    # (Narayanan et al. 2021), and the fill / drain sends that nothing hides
    if plan.pp > 1:
        breakdown["pp_bubble"] = (plan.pp - 1) / plan.virtual_stages * per_mb
        act = tokens_mb * model.hidden_size * d / (plan.tp if plan.sequence_parallel else 1)
        breakdown["pp_p2p"] = 2 * (plan.pp - 1) * (pp_link.alpha_s + act / pp_link.bytes_per_s)
    if plan.offload_activations != "none":
        from memplan.costmodel.memory import activation_offload_bytes  # the phase model: only where it is read

        mechanism, moved = activation_offload_bytes(model, workload, plan, runtime)
        breakdown["activation_offload"] = m * activation_offload_s(moved, gpu.pcie_bytes_per_s, per_mb, mechanism)
    params = P.total_params(model) if memo is None else memo.total_params(model)
    pcie = gpu.pcie_bytes_per_s
    breakdown.update(_data_parallel(model, plan, policy, m, per_mb, dp_size, dp_link, pcie, eff, params))
    breakdown.update(_nvme(model, plan, policy, m, dp_size, cluster))
    if is_paged(plan.optimizer):
        breakdown["paged_optimizer"] = paged_optimizer_s(model, workload, plan, gpu, runtime)
    foreach = foreach_adamw(plan, runtime)
    # runtime != "megatron": PyTorch's AdamW when the optimizer is on the host (the memo's runtime is fixed)
    if memo is None:
        breakdown.update(_optimizer(model, plan, policy, dp_size, gpu, eff, foreach, runtime != "megatron", params))
    else:
        opt_key = (_optimizer_fields(plan), dp_size, foreach)
        if (optimizer := memo.optimizer.get(opt_key)) is None:
            optimizer = _optimizer(model, plan, policy, dp_size, gpu, eff, foreach, runtime != "megatron", params)
            memo.optimizer[opt_key] = optimizer
        breakdown.update(optimizer)
    calibration = eff.calibration
    step = sum(breakdown.values()) * calibration
    breakdown = {k: v * calibration for k, v in breakdown.items() if v}

    job_tokens = mb * s * m * plan.dp
    if memo is None:
        flops = training_flops_per_token(model, s)
    elif (flops := memo.flops.get(s)) is None:
        flops = memo.flops[s] = training_flops_per_token(model, s)
    model_flops = job_tokens * flops
    if memo is None:
        recompute_flops = _recompute_flops_per_token(model, plan, s)
    elif (recompute_flops := memo.recompute_flops.get(key)) is None:
        recompute_flops = memo.recompute_flops[key] = _recompute_flops_per_token(model, plan, s)
    hardware_flops = model_flops + job_tokens * recompute_flops
    world = plan.world_size
    return StepSpeed(
        step,
        job_tokens / step,
        job_tokens / step / world,
        model_flops / step / world / peak,
        hardware_flops / step / world / peak,
        model_flops,
        peak,
        breakdown,
    )


def activation_offload_s(nbytes: float, pcie_bytes_per_s: float, per_mb: float, mechanism: str) -> float:
    """Exposed seconds of one micro-batch's activation offload: ``nbytes`` cross the host link
    (the GPU profile's ``pcie_bytes_per_s``, per direction) device-to-host in the forward and
    host-to-device in the backward. ``save_on_cpu`` copies on the compute stream (its pack's
    ``copy_`` and its unpack's ``to``): nothing hides, 2 B / bw. TRL's ``OffloadActivations``
    copies on a second stream, which overlaps the forward's copies with the forward's compute
    (a third of the micro-batch's ``per_mb`` seconds) and the backward's with the backward's (two
    thirds): max(0, B / bw - per_mb / 3) + max(0, B / bw - 2 per_mb / 3). Both directions at the
    profile's bandwidth, with no allowance for pinned-memory registration or link contention."""
    one_way = nbytes / pcie_bytes_per_s
    if mechanism == "save_on_cpu":
        return 2 * one_way
    return max(0.0, one_way - per_mb / 3) + max(0.0, one_way - 2 * per_mb / 3)


def _recompute_flops_per_token(model: ModelSpec, plan: Plan, seq_len: int) -> float:
    """Model FLOPs recomputation adds per token (PaLM's HFU numerator minus MFU's)."""
    extra = recompute_fraction(plan, model.num_layers // plan.pp, model)
    attention = attention_flops_per_token(model, seq_len)
    layers = training_flops_per_token(model, seq_len) - attention - 6.0 * model.vocab_size * model.hidden_size
    return extra.matmul * layers + extra.attention * attention


def _stage_micro_batch(
    model: ModelSpec,
    plan: Plan,
    stage: int,
    s: int,
    tokens_mb: float,
    d: int,
    peak: float,
    gpu: GPUSpec,
    eff: Efficiency,
    tp_link: Link,
    cp_link: Link,
    ep_link: Link,
    fused: bool,
    dropout: bool,
    backend: str = "flash",
    autocast: bool = False,
) -> dict[str, float]:
    """Seconds of one micro-batch's forward and backward on one rank of ``stage``: GEMMs and
    fused attention kernels (``compute``), HBM-bound kernels (``memory_bound``), collectives."""
    on_stage = stage_layers(model, plan.pp, plan.virtual_stages, stage)
    layers = on_stage.layers
    # fused attention kernels skip the masked blocks; the math / eager path computes every score
    # (two batched GEMMs, roofline) and runs its softmax over them in HBM
    materialised = backend in ("eager", "math")
    matmul, attention = stage_flops_per_token(model, plan, stage, s, causal=not materialised)
    extra = recompute_fraction(plan, layers, model)
    last = stage == plan.pp - 1
    head = 6.0 * model.vocab_size * model.hidden_size if last else 0.0
    hbm = gpu.hbm_bytes_per_s * eff.hbm
    gemm_flops_per_s = peak * matmul_efficiency(eff, plan.precision)
    # over a quantized base the activations are fp32, and so attention and the LM head
    act, act_peak, act_flops_per_s = d, peak, gemm_flops_per_s
    if plan.quant != "none" and not autocast and d != 4:  # time_lora.quantized_stream, below fp32
        act, act_peak = 4, matmul_peak_flops(gpu, "fp32")
        act_flops_per_s = act_peak * eff.matmul_fp32
    # attention under CP: each rank's queries against the whole sequence, so its FLOPs are
    # the full-sequence count split over cp like the tokens
    tokens = tokens_mb / plan.tp
    if plan.finetune == "full":
        gemms = tokens * (matmul + extra.matmul * (matmul - head)) / gemm_flops_per_s
    else:
        int8_flops_per_s = (gpu.peak_flops.get("int8") or peak) * eff.matmul
        rates = (gemm_flops_per_s, act_flops_per_s, int8_flops_per_s)
        gemms = tokens * frozen_gemm_seconds(matmul - head, head, extra.matmul, plan, *rates)
    if materialised:
        operands = tokens_mb * score_gemm_bytes_per_token(model, plan, s, layers, act)
        attn = gemm_seconds(tokens * attention, operands, act_flops_per_s, hbm)
        attn *= 1 + extra.attention
    else:
        speedups = attention_speedups(eff, backend, model.head_size)
        attn = fused_attention_seconds(tokens * attention / (act_peak * eff.attention), speedups, extra.attention)
    compute = gemms + attn
    traffic = (1 + extra.elementwise) * elementwise_bytes_per_token(model, plan, layers, act, fused, autocast=autocast)
    if materialised:
        traffic += (1 + extra.attention) * materialised_token_bytes(model, plan, layers, act, autocast)
    if backend == "math":
        traffic += math_score_bytes_per_token(model, plan, s, layers, act, 3 * extra.attention)
    else:
        traffic += (1 + extra.attention) * eager_score_bytes_per_token(model, plan, s, layers, act, fused, dropout)
    memory = tokens_mb * traffic / hbm
    if last:
        memory += tokens_mb * loss_bytes_per_token(model, plan, fused, act) / hbm
    if autocast:
        memory += autocast_weight_bytes(model, plan, stage) / hbm
    parts = {"compute": compute, "memory_bound": memory}
    if plan.finetune != "full":
        parts.update(frozen_base_traffic_s(model, plan, layers, tokens_mb, act, extra, hbm, autocast))
    # TP (Megatron, Korthikanti Sec. 4.2.2): per layer, forward 2 all-reduces of b s h (with SP
    # 2 all-gathers + 2 reduce-scatters, the same bytes), backward the same; recomputation repeats
    # the forward's; not overlapped
    if plan.tp > 1:
        act = tokens_mb * model.hidden_size * d
        per_layer = 2 * all_reduce_s(act, plan.tp, tp_link)
        parts["tp_comm"] = layers * per_layer * (2 + extra.tp_rounds)
    # CP (ring attention): each layer passes K and V around the ring (cp - 1 hops) forward, and
    # K, V, dK, dV backward; hidden behind the attention compute when it is longer
    if plan.cp > 1:
        kv = 2 * tokens_mb * model.kv_size / min(plan.tp, model.kv_heads) * d  # K and V, TP-split heads
        ring = 3 * (plan.cp - 1) * (cp_link.alpha_s + kv / cp_link.bytes_per_s) * layers
        attn_time = tokens_mb / plan.tp * attention / (peak * eff.attention)
        parts["cp_comm"] = max(0.0, ring - attn_time)
    # EP: dispatch and combine all-to-alls per MoE layer, forward and backward
    if plan.ep > 1 and model.moe is not None:
        routed = tokens_mb * model.moe.top_k * model.hidden_size * d
        parts["ep_comm"] = 4 * on_stage.moe_layers * all_to_all_s(routed, plan.ep, ep_link)
    return parts


def frozen_gemm_seconds(
    layer: float, head: float, recompute: float, plan: Plan, compute: float, activation: float, int8: float
) -> float:
    """Seconds of one token's GEMMs on a stage under LoRA / QLoRA (``time_lora``), from the
    full-training FLOPs ``layer`` (6 N of the stage's layer linears) and ``head`` (6 V h, 0 off
    the last stage) and ``recompute`` (``Recomputation.matmul``: the recomputed share of 6 N).
    The frozen linears run their forward and input gradient (2 of full training's 3 GEMMs,
    ``time_lora.gemm_passes``): in the compute dtype (``compute`` FLOP/s; 4-bit dequantizes to
    it), or for LLM.int8 the forward in int8 (``int8``) and the input gradient in the
    activations' dtype (``activation``). The LM head runs in the activations' dtype (fp32 over a
    quantized base), with its weight gradient only when it is a trained ``modules_to_save`` copy."""
    from memplan.costmodel import time_lora as Q  # fine-tuning's only: not on a full estimate's import

    forward = layer / 3
    redo = recompute * layer
    if plan.quant == "int8":
        linears = (forward + redo) / int8 + forward / activation
    else:
        linears = (Q.gemm_passes(False) * forward + redo) / compute
    return linears + head / 3 * Q.gemm_passes(Q.head_trained(plan)) / activation


def frozen_base_traffic_s(
    model: ModelSpec,
    plan: Plan,
    layers: int,
    tokens_mb: float,
    act: int,
    extra: Recomputation,
    hbm: float,
    autocast: bool = False,
) -> dict[str, float]:
    """One micro-batch's memory-bound seconds particular to LoRA / QLoRA on a stage (``hbm``:
    the achievable bytes/s): the adapters' kernels (``lora_adapters``: fp32 adapters,
    ``time_lora.ADAPTER_BYTES``, at the activations' dtype under autocast), bitsandbytes' casts around
    its matmuls (``quant_casts``) and its dequantizations (``dequant``), each under the plan's
    recomputation (the element-wise share for the kernels, the matmul share for dequantization)."""
    from memplan.costmodel import time_lora as Q  # fine-tuning's only: not on a full estimate's import

    redo = 3 * extra.elementwise
    compute = POLICIES[plan.precision].compute_bytes
    # 4-bit weights dequantize to the dtype they were quantized from (the param dtype); int8 to the input's
    out_bytes = act if plan.quant == "int8" else POLICIES[plan.precision].param_bytes
    adapter = act if autocast else Q.ADAPTER_BYTES
    return {
        "lora_adapters": tokens_mb * Q.adapter_bytes_per_token(model, plan, layers, act, redo, adapter) / hbm,
        "quant_casts": tokens_mb * Q.quant_cast_bytes_per_token(model, plan, layers, act, compute, redo) / hbm,
        "dequant": Q.dequant_bytes(model, plan, layers, out_bytes, 3 * extra.matmul) / hbm,
    }


def _data_parallel(
    model: ModelSpec,
    plan: Plan,
    policy,  # noqa: ANN001 - PrecisionPolicy
    m: int,
    per_mb: float,
    n: int,
    link: Link,
    pcie_bytes_per_s: float,
    eff: Efficiency,
    total_params: int,
) -> dict[str, float]:
    """Exposed gradient reduction and parameter gathers on the data-parallel group
    (``total_params``: the model's, ``params.total_params``).

    ZeRO-0/1: one all-reduce of the gradients per step, after the last micro-batch. ZeRO-2:
    a reduce-scatter of the gradients, and an all-gather of the updated parameters before
    the next forward (FSDP2 ``reshard_after_forward=False``; Megatron's distributed
    optimizer). ZeRO-3: the reduce-scatter, and every micro-batch all-gathers the parameters
    for its forward and again for its backward. The reduction hides behind the last
    micro-batch's backward (two thirds of its compute), a gather behind its pass (a third
    for the forward, two for the backward), each up to ``dp_overlap``; one layer's share
    never hides."""
    stage_params = total_params / plan.pp / plan.tp
    if n <= 1:
        # one rank: no collective, but offloaded parameters still cross PCIe (ZeRO-3 on one GPU)
        return {"param_offload": _params_pcie_s(plan, policy, m, stage_params, pcie_bytes_per_s)}
    # only trained parameters have gradients to reduce; ZeRO-3 gathers frozen ones too
    grads = (stage_params if plan.finetune == "full" else trained_params(model, plan) / plan.pp / plan.tp) * (
        policy.grad_bytes
    )
    gathered = stage_params * min(policy.param_bytes, policy.compute_bytes)
    if plan.precision == "fp8" and plan.fp8_all_gather:  # torchao gathers the layers' linear weights in fp8
        linear = sum(i * o for i, o in layer_matmul_widths(model)) * model.num_layers / plan.pp / plan.tp
        gathered -= linear * (min(policy.param_bytes, policy.compute_bytes) - 1)
    layers = max(1, model.num_layers // plan.pp)
    overlap = eff.dp_overlap  # read once: a model's attribute read is slow (specs.plan.PlanFields)

    def exposed(seconds: float, window: float) -> float:
        return max(seconds / layers, seconds - overlap * window)

    if plan.zero <= 1:
        return {"dp_comm": exposed(all_reduce_s(grads, n, link), per_mb * 2 / 3)}
    comm = exposed(all_gather_s(grads, n, link), per_mb * 2 / 3)
    gather = all_gather_s(gathered, n, link)
    if plan.zero == 2:
        comm += exposed(gather, per_mb / 3)
    else:
        comm += m * (exposed(gather, per_mb / 3) + exposed(gather, per_mb * 2 / 3))
    out = {"dp_comm": comm}
    # its own key: the optimizer step's PCIe term is "offload" (_optimizer)
    out["param_offload"] = _params_pcie_s(plan, policy, m, stage_params / n, pcie_bytes_per_s)
    return out


def trained_params(model: ModelSpec, plan: Plan) -> int:
    """Parameters with gradients and optimizer states: all of them in full training, the adapters
    and ``modules_to_save`` copies under LoRA / QLoRA (``lora.trainable_params``)."""
    if plan.finetune == "full":
        return P.total_params(model)
    return L.trainable_params(model, plan.lora_targets, plan.lora_rank, plan.modules_to_save)


def _params_pcie_s(plan: Plan, policy, m: int, shard_params: float, pcie_bytes_per_s: float) -> float:  # noqa: ANN001
    """Offloaded parameter shards cross PCIe for every forward and backward (ZeRO-Infinity)."""
    if plan.offload_params == "none":
        return 0.0
    return 2 * m * shard_params * policy.param_bytes / pcie_bytes_per_s


def paged_optimizer_s(model: ModelSpec, workload: TrainingWorkload, plan: Plan, gpu: GPUSpec, runtime: str) -> float:
    """Seconds a step spends paging bitsandbytes' paged optimizer states: what does not stay on
    the device beside the step's reserved peak (``optimizer.paged_residency``, the capacity less
    the memory outside the allocator) is evicted to the host while the forward and backward fill
    the device and paged back for the optimizer step (``prefetch_state``), once each way over
    PCIe at the profile's bandwidth; page-fault migration being slower than a bulk copy, a floor.
    The peak is the fast form's (the search's); the allocator replay ``memplan estimate`` shows can
    hold more (its cached free blocks), and then more pages than charged here."""
    from memplan.costmodel.memory import estimate_memory  # the phase model: only for a paged optimizer

    report = estimate_memory(model, workload, plan, runtime)
    headroom = gpu.capacity_bytes - report.overhead - report.peak.reserved
    _, spilled = paged_residency(report.paged_optimizer_states, headroom)
    return 2 * spilled / gpu.pcie_bytes_per_s


def _nvme(model: ModelSpec, plan: Plan, policy, m: int, n: int, cluster: ClusterSpec) -> dict[str, float]:  # noqa: ANN001
    """NVMe traffic of ZeRO-Infinity's NVMe tier, at the node's NVMe bandwidth shared by its ranks:
    offloaded optimizer states (master weights included) read and written back once per step (the
    CPU Adam step swaps them in and out; DeepSpeed's pipeline_read / pipeline_write, off by
    default, would overlap them with the step), offloaded parameters read for every forward and
    backward and written back after the step. No overlap with compute assumed."""
    if "nvme" not in (plan.offload_optimizer, plan.offload_params):
        return {}
    shards = n if plan.zero >= 1 else 1
    owned = P.total_params(model) / plan.pp / plan.tp / shards
    moved = 0.0
    if plan.offload_optimizer == "nvme":
        moved += 2 * owned * state_bytes_per_param(plan.optimizer, policy)
    if plan.offload_params == "nvme":
        moved += (2 * m + 1) * owned * policy.param_bytes
    per_rank = cluster.nvme_bytes_per_s / min(cluster.gpus_per_node, plan.world_size)
    return {"nvme": moved / per_rank}


def _optimizer(
    model: ModelSpec,
    plan: Plan,
    policy,  # noqa: ANN001 - PrecisionPolicy
    n: int,
    gpu: GPUSpec,
    eff: Efficiency,
    foreach: bool = False,
    torch_host: bool = False,
    total_params: int | None = None,
) -> dict[str, float]:
    """The optimizer step on the params this rank updates (:func:`trained_params`: under LoRA the
    adapters and saved modules only): memory-bound on the GPU (:func:`adam_bytes_per_param`,
    fused or ``foreach``), or on the host with the gradients crossing PCIe (:func:`host_offload_s`;
    ``torch_host``: PyTorch's AdamW over CPU tensors, else a vectorised CPU Adam). ``total_params``:
    the model's (``params.total_params``), where the caller has it: its cache hashes the model,
    ~2.5 us a call (``step_speed``)."""
    shards = n if plan.zero >= 1 else 1
    full = total_params is not None and plan.finetune == "full"
    owned = (total_params if full else trained_params(model, plan)) / plan.pp / plan.tp / shards
    if plan.offload_optimizer != "none":
        return host_offload_s(owned, plan, policy, gpu.pcie_bytes_per_s, eff, torch_host)
    return {"optimizer": owned * adam_bytes_per_param(policy, foreach) / (gpu.hbm_bytes_per_s * eff.hbm)}


def host_adam_s(owned: float, eff: Efficiency, torch_host: bool) -> float:
    """Seconds of the optimizer step on the host over ``owned`` parameters.

    PyTorch's ``torch.optim.AdamW`` over CPU tensors (FSDP2's ``CPUOffloadPolicy`` keeps the
    sharded fp32 params, their gradients and states on the host and the step runs there): the
    same element-wise passes as on the GPU, ``foreach`` or per tensor (``adam._multi_tensor_adam``,
    ``_single_tensor_adam``: 20 accesses of 4 bytes a parameter, :func:`adam_bytes_per_param`),
    each an ATen CPU kernel parallelised over ``Efficiency.host_threads`` OpenMP threads (one per
    rank under torchrun) at ``host_thread_bytes_per_s`` each. Otherwise (Megatron's offloaded
    optimizer, DeepSpeed's) a vectorised multi-threaded CPU Adam at ``host_adam_params_per_s``
    (ZeRO-Offload, Ren et al. 2021, Sec. 5)."""
    if not torch_host:
        return owned / eff.host_adam_params_per_s
    return owned * adam_bytes_per_param(POLICIES["fp32"], True) / (eff.host_thread_bytes_per_s * eff.host_threads)


def host_offload_s(
    owned: float,
    plan: Plan,
    policy,  # noqa: ANN001 - PrecisionPolicy
    pcie_bytes_per_s: float,
    eff: Efficiency,
    torch_host: bool,
) -> dict[str, float]:
    """An offloaded optimizer step: the host step (:func:`host_adam_s`) and the PCIe copies that go
    with it (``offload``): the gradients device-to-host, and the updated parameters host-to-device
    unless the parameters live on the host too. FSDP2's ``CPUOffloadPolicy`` offloads both (the
    bundled trainer's ``offload_params: cpu``): its params stay on the host after the step and
    cross PCIe before each all-gather instead (``param_offload``, :func:`_params_pcie_s`), so only
    the gradients cross here (``FSDPParam.to_sharded`` / post-backward's ``.to(cpu)``)."""
    moved = policy.grad_bytes
    if not (torch_host and plan.offload_params == "cpu"):
        moved += policy.param_bytes
    return {"optimizer": host_adam_s(owned, eff, torch_host), "offload": owned * moved / pcie_bytes_per_s}
