"""Property tests: the memory model moves the way physics says it must.

Memory never grows with a higher ZeRO stage, more TP or PP, or more recomputation; it grows
with batch and sequence; the breakdown sums to the peak. Properties are stated on
``peak.allocated``: ``peak.reserved`` adds an NCCL communicator when a new parallel group
appears, which can outweigh what a small model saves. Where physics lets memory grow (a ZeRO or
pipeline step under FSDP2 and torch.distributed.pipelining, per-op SAC's save list), the
allowance is a hand calculation from the config (h, L, V, b, s, dtype sizes, p, dp) with its
source, never a figure the estimate under test produced.
"""

from __future__ import annotations

from functools import cache

from hypothesis import example, given, settings
from hypothesis import strategies as st

from memplan.costmodel import overhead as O
from memplan.costmodel.layout import stage_layout
from memplan.costmodel.memory import estimate_memory, model_states
from memplan.costmodel.precision import POLICIES
from memplan.errors import MemplanError
from memplan.specs.job import check_compatible
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

MODELS = ["llama2-7b", "llama3-8b", "mistral-7b", "qwen2.5-7b", "mixtral-8x7b", "qwen3-30b-a3b", "gpt3-175b"]
RECOMPUTE_ORDER = ["none", "selective", "selective-op", "full"]


@cache
def model(name: str):
    return load_model(name)


@st.composite
def jobs(draw):
    """A valid (model, workload, plan, runtime) with the 1F1B schedule."""
    m = model(draw(st.sampled_from(MODELS)))
    runtime = draw(st.sampled_from(["memplan", "hf", "megatron"]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if m.num_attention_heads % t == 0 and m.kv_heads % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if m.num_layers % p == 0]))
    dp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    micro = draw(st.sampled_from([1, 2, 4]))
    accumulation = draw(st.sampled_from([1, 2, 8, 16]))
    seq = draw(st.sampled_from([512, 1024, 2048, 4096]))
    zero = draw(st.integers(0, 3))
    plan = Plan(
        dp=dp,
        tp=tp,
        pp=pp,
        zero=zero,
        sequence_parallel=draw(st.booleans()) and tp > 1,
        recompute=draw(st.sampled_from(RECOMPUTE_ORDER)),
        precision=draw(st.sampled_from(["fp32", "bf16-mixed", "bf16-master", "bf16", "fp8"])),
        optimizer=draw(st.sampled_from(["adamw", "sgd", "adamw-8bit", "adafactor"])),
        attention=draw(st.sampled_from(["flash", "eager"])),
    )
    workload = TrainingWorkload(seq_len=seq, micro_batch=micro, global_batch=micro * dp * accumulation)
    check_compatible(m, workload, plan)
    return m, workload, plan, runtime


def allocated(m, workload, plan, runtime) -> int:
    return estimate_memory(m, workload, plan, runtime).peak.allocated


def _with(plan: Plan, **update) -> Plan | None:
    try:
        return Plan.model_validate({**plan.model_dump(), **update})
    except ValueError:
        return None


# Allowances written out by hand from the model's config, never taken from the estimate: a
# tensor's bytes are its elements times its dtype's bytes. They are upper bounds, so each counts
# generously (biases everywhere, replicated regions unsplit, every activation at fp32's 4 bytes).


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _param_bytes(plan: Plan) -> int:
    """Parameters: fp32 under fp32 and bf16-mixed (autocast), else bf16."""
    return 4 if plan.precision in ("fp32", "bf16-mixed") else 2


def _layer_params(m, plan: Plan) -> int:
    """Most parameter elements of one layer on one rank: q, k, v, o (and their biases, q/k
    norms), the MLP (3 matrices h x f, or every routed expert's and the router's), two norms
    with biases. Matrices split by t; norms and router not."""
    h, hd, t = m.hidden_size, m.head_size, plan.tp
    q, kv = m.num_attention_heads * hd, m.kv_heads * hd
    attention = _ceil(2 * h * q + 2 * h * kv + q + 2 * kv + h, t) + 2 * hd
    if m.moe is None:
        mlp = _ceil(3 * h * m.ffn_size + 2 * m.ffn_size + h, t)
    else:
        e = m.moe
        mlp = _ceil(e.num_experts * 3 * h * e.expert_ffn_size, t) + h * e.num_experts
        mlp += _ceil(max(e.num_shared_experts, 1) * 3 * h * (e.shared_expert_ffn_size or m.ffn_size), t)
    return attention + mlp + 4 * h


def _stage_params(m, plan: Plan, role: str = "only") -> int:
    """Most parameter elements one rank of one pipeline stage holds: ceil(L/p) layers, plus on
    the first stage the embedding (V x h, split by t) and learned positions, on the last the LM
    head (V x h / t, a copy of its own when tied and p > 1) and the final norm; ``only`` (no
    pipeline, or the most any stage holds) counts both ends."""
    embedding = _ceil(m.vocab_size, plan.tp) * m.hidden_size
    if m.position_embedding == "learned":
        embedding += m.max_position_embeddings * m.hidden_size
    head = _ceil(m.vocab_size, plan.tp) * m.hidden_size + 2 * m.hidden_size
    ends = {"only": embedding + head, "first": embedding, "middle": 0, "last": head}[role]
    return _ceil(m.num_layers, plan.pp) * _layer_params(m, plan) + ends


def _layer_activations(m, workload, plan: Plan) -> int:
    """Most bytes one layer saves for one micro-batch, every tensor counted at 4 bytes. Per
    token: each norm's input, fp32 copy and output (2 x 3h), the residual and dropout masks
    (3h), the matmuls' autocast input copies (5h); q, k and v, their RoPE'd and q/k-normed
    copies, k and v repeated to every head, a scaled copy of q and the attention output
    (7q + 4kv), the log-sum-exp (a); the s x s core (scores or probabilities, dropout mask and
    output, 3as) where it is stored: eager attention, or fp32, which no fused SDPA kernel
    takes (flash and cuDNN need fp16 / bf16), so SDPA's math path runs; the MLP's gate, up,
    activation and product (4f), or per routed copy of a token its input and the weighted
    output (2h) and five expert tensors (5f_e), and the router's logits and probabilities
    (2E). Head-split tensors / t, the rest unsplit. Selective recomputation stores no s x s
    core (Korthikanti Sec. 5), nor does op-level (its save list names matmuls and fused SDPA
    kernels, not an eager softmax); full keeps the layer's input alone."""
    h, hd, a, t = m.hidden_size, m.head_size, m.num_attention_heads, plan.tp
    tokens = workload.micro_batch * workload.seq_len
    if plan.recompute == "full":
        return 4 * tokens * h  # the layer's input, (b, s, h), alone
    q, kv = a * hd, m.kv_heads * hd
    replicated = 14 * h
    split = 7 * q + 4 * kv + a
    if plan.recompute == "none" and (plan.attention == "eager" or plan.precision == "fp32"):
        split += 3 * a * workload.seq_len
    if m.moe is None:
        split += 4 * m.ffn_size
    else:
        e = m.moe
        replicated += 2 * e.num_experts + e.top_k * 2 * h
        split += e.top_k * 5 * e.expert_ffn_size + 5 * (e.shared_expert_ffn_size or 0) * e.num_shared_experts
    return 4 * tokens * (replicated + _ceil(split, t))


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_higher_zero_stage_never_uses_more(job):
    m, workload, plan, runtime = job
    if plan.zero == 3:
        return
    higher = _with(plan, zero=plan.zero + 1)
    # ZeRO-3 gathers whole layers (and the embedding) beside the shards: with only two ranks
    # to shard over, a stage with a large embedding can hold more than ZeRO-2; from four up it
    # cannot, so that step is asserted from four ranks.
    if plan.zero == 2 and plan.dp * plan.cp < 4:
        return
    slack = 0
    if runtime == "memplan" and plan.pp > 1 and plan.zero == 1 and plan.dp * plan.cp > 1:
        # under pipelining FSDP2 (memplan's ZeRO-2) reduce-scatters only after the last
        # micro-batch, so its gradients stay unsharded like ZeRO-1's, and its sharded params
        # sit beside the unsharded ones (measured, docs/cost-model.md): at most those shards more,
        # the stage's parameters split over the data-parallel ranks
        slack = _ceil(_stage_params(m, plan) * _param_bytes(plan), plan.dp * plan.cp)
    assert allocated(m, workload, higher, runtime) <= allocated(m, workload, plan, runtime) + slack


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_more_tensor_parallelism_never_uses_more(job):
    m, workload, plan, runtime = job
    more = _with(plan, tp=plan.tp * 2)
    try:
        check_compatible(m, workload, more)
    except MemplanError:
        return
    assert allocated(m, workload, more, runtime) <= allocated(m, workload, plan, runtime)


def _max_stage_states(m, plan: Plan) -> int:
    policy = POLICIES[plan.precision]
    factored = 1 / m.hidden_size + 1 / m.ffn_size
    totals = []
    for stage in {0, plan.pp - 1}:
        layout = stage_layout(m, plan.tp, plan.ep, plan.pp, plan.virtual_stages, stage)
        st_ = model_states(layout, plan, policy, factored)
        totals.append(st_.params + st_.grads + st_.optimizer)
    return max(totals)


def _activation(m, workload, plan: Plan) -> int:
    """One (b, s, h) activation as pipeline stages exchange it: in the residual dtype (fp32
    under fp32 and autocast), split by t under SP."""
    element = 4 if plan.precision in ("fp32", "bf16-mixed") else 2
    tokens = workload.micro_batch * workload.seq_len
    return _ceil(tokens * m.hidden_size * element, plan.tp if plan.sequence_parallel else 1)


def _pipeline_growth(m, workload, plan: Plan, more: Plan, runtime: str) -> dict[str, int]:
    """The most a stage of ``more`` (2p stages) may hold beyond the peak of ``plan``, by the
    stage's role (first, middle, last): what it may hold beyond the stage of ``plan`` whose
    layers it takes.

    Activations (1F1B, Korthikanti et al. 2022, Sec. 4.2.3): stage i of 2p keeps min(2p - i, m)
    micro-batches of L/(2p) layers, never more than stage i // 2 of p keeps of L/p; in a
    backward the other micro-batches' layers stay, which may add one micro-batch's L/(2p)
    layers on every stage but the last (which keeps one micro-batch in flight either way), and
    each extra micro-batch in flight keeps its embedding-side tensors: int64 token ids (8 b s),
    RoPE's cos and sin (2 s x head_dim, fp32 at most), the embedding dropout mask (b s h, 1 byte).

    Under the bundled trainer (``memplan``), torch.distributed.pipelining's own buffers
    (torch/distributed/pipelining/stage.py, torch 2.13), one activation each:
    ``_setup_forward_recv_info`` allocates a receive buffer per micro-batch on every stage but
    the first, ``_setup_backward_recv_info`` a gradient receive buffer per micro-batch on every
    stage but the last; each received activation's gradient accumulates in its buffer's
    ``.grad`` until ``clear_runtime_states`` at the next step; ``fwd_cache`` keeps each in-flight
    micro-batch's output (at most min(2p, m)) until its backward. From one stage to two, the
    first stage gains the gradient receive buffers and ``fwd_cache``, the last the receive
    buffers and their gradients; a middle stage of 2p has at most both of those more than the
    end stage of p it replaces. FSDP2 under pipelining reduce-scatters only after the last
    micro-batch, so the stage's gradients stay unsharded through the backward (measured,
    docs/cost-model.md), at 4 bytes at most (after the first micro-batch they are upcast to the
    reduce dtype); a single stage never holds them at once. And FSDP2 (ZeRO-3) prefetches the
    next group in the backward: a layer on a stage that is not the first, where a single stage
    prefetched the embedding."""
    accumulation = workload.global_batch // (workload.micro_batch * plan.dp)
    layers = m.num_layers // more.pp * _layer_activations(m, workload, more)
    extra = min(more.pp, accumulation) - min(plan.pp, accumulation)
    b, s, h = workload.micro_batch, workload.seq_len, m.hidden_size
    embedding_side = extra * (8 * b * s + 2 * s * m.head_size * 4 + b * s * h)
    first = layers + embedding_side
    last = 0
    middle = layers + embedding_side if more.pp > 2 else 0
    if runtime != "memplan":
        return {"first": first, "middle": middle, "last": last}
    a = _activation(m, workload, more)
    fsdp2 = plan.dp * plan.cp > 1
    if plan.pp == 1:
        first += (accumulation + min(more.pp, accumulation)) * a  # gradient receive buffers, fwd_cache
        last += 2 * accumulation * a  # receive buffers and their gradients
        if fsdp2 and plan.zero >= 2:
            first += _stage_params(m, more, "first") * 4
            last += _stage_params(m, more, "last") * 4
    else:
        first += extra * a  # fwd_cache
        middle += (2 * accumulation + min(more.pp, accumulation)) * a
    if fsdp2 and plan.zero == 3:
        # a layer gathered where the stage before had the embedding (none to drop when tied)
        embedding = 0 if m.tied_embeddings else _ceil(m.vocab_size, more.tp) * h * 4
        prefetch = max(_layer_params(m, more) * 4 - embedding, 0)
        last += prefetch if plan.pp == 1 else 0
        middle += prefetch
    return {"first": first, "middle": middle, "last": last}


# Llama 2 7B, dp 16, ZeRO-3, fp32, eager attention, full recomputation, 16 micro-batches of
# 4 x 4096 tokens, pp 1 -> 2 (the first example the derandomized CI profile met): the last stage
# grows by 18,714,246,144 B. Its unsharded gradients (+11,792,235,520 B, the 3,369,209,856 stage
# parameters at 4 bytes for the 16th-share of the whole model's), pipelining's receive buffers
# (+8,321,499,136 B: 16 activation receive buffers and the 15 gradients accumulated in them by
# the last backward, 31 x b s h x 4), a layer prefetched where the single stage prefetched the
# embedding (+285,245,440 B: (202,383,360 - 131,072,000) x 4), less the halved parameter and
# optimizer shards (-1,684,602,880 B) and the token ids the last stage does not hold (-131,072 B).
# A bound without the receive buffers missed it (by 75,004,928 B, with its other terms' slack).
LLAMA2_PP_FSDP2 = (
    model("llama2-7b"),
    TrainingWorkload(seq_len=4096, micro_batch=4, global_batch=1024),
    Plan(dp=16, zero=3, recompute="full", precision="fp32", optimizer="sgd", attention="eager"),
    "memplan",
)


@settings(max_examples=300, deadline=None)
@given(jobs())
@example(job=LLAMA2_PP_FSDP2)
def test_more_pipeline_stages_never_use_more(job):
    """More stages never hold more model states. The peak never grows either, except by what
    physics puts there, written out from the config in ``_pipeline_growth``: the first 1F1B
    stage keeps L layers of activations in flight whatever p is (Korthikanti et al. 2022, Sec.
    4.2.3), and at the end of a micro-batch's backward it still holds the other micro-batches'
    (1 - 1/p) L layers, which grows with p; so doubling p may add at most one micro-batch's
    L/(2p) stored layers, and each extra micro-batch in flight its embedding-side tensors.
    Under the bundled trainer (``memplan``) torch.distributed.pipelining adds its own buffers,
    and FSDP2 under it keeps unsharded gradients and prefetches a layer where a single stage
    prefetched the embedding."""
    m, workload, plan, runtime = job
    more = _with(plan, pp=plan.pp * 2)
    try:
        check_compatible(m, workload, more)
    except MemplanError:
        return
    assert _max_stage_states(m, more) <= _max_stage_states(m, plan)
    bigger = estimate_memory(m, workload, more, runtime)
    base = allocated(m, workload, plan, runtime)
    allowance = _pipeline_growth(m, workload, plan, more, runtime)
    for stage, held in bigger.stage_peaks.items():  # each stage the estimate examined
        role = "first" if stage == 0 else "last" if stage == more.pp - 1 else "middle"
        assert held <= base + allowance[role], (stage, role)


# Megatron, Llama 2 7B, tp 8 with SP, fp32, flash, 1 x 512 tokens, selective -> selective-op (a
# random profile's find): +4,456,448 B = 32 layers x 512 tokens x 272 B, where per token
# d h (1 - 1/t) - 2h/t - d kv/t - 2 d f/t + 4a/t = 14,336 - 1,024 - 2,048 - 11,008 + 16 = 272:
# per-op SAC keeps the down projection's full-width partial sum and the log-sum-exp; selective
# keeps more of the rest: a norm's input, the dropout masks, k, and the up projection's output
# and the down projection's input.
MEGATRON_SELECTIVE_OP = (
    model("llama2-7b"),
    TrainingWorkload(seq_len=512, micro_batch=1, global_batch=1),
    Plan(tp=8, sequence_parallel=True, recompute="selective", precision="fp32", optimizer="sgd", attention="flash"),
    "megatron",
)


# Counterexamples of selective-op -> full that unseeded runs found (2026-11-28), each full above
# selective-op in the phase model's sums, none in the mechanism. Under the bundled trainer
# (``memplan``) and bf16-mixed every per-op SAC layer runs under a checkpoint, so autocast's cache
# holds every layer's weight casts while a stage's last layer runs its MLP, beside every in-flight
# micro-batch's saves: the op-level run has that moment (1B config, pp 4, 4,096 tokens, stage 0:
# 704,643,328 B beyond the saves, tests/unit/test_op_sac_forward.py), the sums had it for full
# recomputation only (now ``memory.op_sac_mlp_forward``). gpt3-175b, TP 2 x PP 4, SGD, 8 micro-batches
# of 512 tokens: full was 513,254,912 B above selective-op (311.35 against 310.83 GB); now 4.24 GB below.
GPT3_SELECTIVE_OP = (
    model("gpt3-175b"),
    TrainingWorkload(seq_len=512, micro_batch=1, global_batch=8),
    Plan(tp=2, pp=4, recompute="selective-op", precision="bf16-mixed", optimizer="sgd", attention="flash"),
    "memplan",
)
# A Llama (the run models the mechanism; not this optimizer): TP 8 x PP 2, eager attention, 8-bit
# AdamW, 8 micro-batches of 512 tokens: full was 2,680,704 B above selective-op.
LLAMA2_SELECTIVE_OP = (
    model("llama2-7b"),
    TrainingWorkload(seq_len=512, micro_batch=1, global_batch=8),
    Plan(tp=8, pp=2, recompute="selective-op", precision="bf16-mixed", optimizer="adamw-8bit", attention="eager"),
    "memplan",
)
# Megatron under TE fp8, ZeRO-3 dp 8, TP 8 x PP 4: the sums applied TE's fp8 saved inputs (the norms'
# outputs, fc2's input, ``fp8.te_saved_input_delta``) to per-op SAC's layer, which keeps none of
# them, so a selective-op layer kept 14,155,776 B, less than a fully recomputed layer's input
# (25,165,824 B): full was 805,521,408 B above selective-op.
GPT3_TE_FP8_SELECTIVE_OP = (
    model("gpt3-175b"),
    TrainingWorkload(seq_len=512, micro_batch=2, global_batch=256),
    Plan(
        dp=8, tp=8, pp=4, zero=3, recompute="selective-op", precision="fp8", optimizer="adamw-8bit", attention="eager"
    ),
    "megatron",
)


def _autocast(model, workload, plan, runtime: str) -> bool:  # noqa: ANN001
    """Whether the phase model runs ``plan`` under autocast (its ``Shape``, as its sums read it)."""
    from memplan.costmodel.memory import _shape
    from memplan.costmodel.runtimes import RUNTIMES

    return _shape(model, workload, plan, POLICIES[plan.precision], RUNTIMES[runtime], "cuda").autocast


@settings(max_examples=300, deadline=None)
@given(jobs())
@example(job=MEGATRON_SELECTIVE_OP)
@example(job=GPT3_SELECTIVE_OP)
@example(job=LLAMA2_SELECTIVE_OP)
@example(job=GPT3_TE_FP8_SELECTIVE_OP)
def test_more_recomputation_never_uses_more(job):
    """Each step of RECOMPUTE_ORDER stores less, but for one: torchtitan's per-op SAC
    (selective-op) keeps the outputs of every other matmul, where Korthikanti's selective keeps
    their inputs, so the two save lists are not nested. Beyond what selective keeps, per-op SAC
    keeps the down projection's output, which under TP is a row-parallel partial sum of the full
    width (b s h per rank, before its all-reduce or reduce-scatter), the two SP reduce-scatter
    outputs (2 b s h / t) and the attention kernel's fp32 log-sum-exp (4 b s a / t), which
    selective recomputes (torchtitan/distributed/activation_checkpoint.py, ``_save_list``;
    docs/cost-model.md). The step may add those, in the compute dtype, for each of the at most L
    layers of activations a 1F1B stage stores (Korthikanti et al. 2022, Sec. 4.2.3).

    And under autocast (the phase model's ``Shape.autocast``: bf16-mixed where the runtime runs it,
    not the bundled trainer's FSDP2 MixedPrecisionPolicy), none -> selective
    stores more: the checkpoint around the attention core holds the RoPE'd q and k, which are fp32
    (RoPE's tables are), where without it SDPA saves their bf16 casts: 2 (q + kv) / t bytes a token
    and layer more, less the log-sum-exp selective recomputes (the bundled trainer's op-level run:
    llama2-7b, 2,048 tokens, its forward and backward peaks 1,065,320,448 B higher under selective,
    ``activations.checkpointed_core_fp32_qk``)."""
    m, workload, plan, runtime = job
    level = RECOMPUTE_ORDER.index(plan.recompute)
    if level == len(RECOMPUTE_ORDER) - 1:
        return
    more = _with(plan, recompute=RECOMPUTE_ORDER[level + 1])
    allowance = 0
    if more.recompute == "selective" and _autocast(m, workload, plan, runtime):
        per_token = 2 * (m.q_size + m.kv_size) // plan.tp
        allowance = m.num_layers * workload.micro_batch * workload.seq_len * per_token
    if more.recompute == "selective-op":
        d = 4 if plan.precision == "fp32" else 2
        h, t = m.hidden_size, plan.tp
        per_token = d * h + (2 * d * h // t if plan.sequence_parallel else 0) + 4 * m.num_attention_heads // t
        allowance = m.num_layers * workload.micro_batch * workload.seq_len * per_token
    assert allocated(m, workload, more, runtime) <= allocated(m, workload, plan, runtime) + allowance


@settings(max_examples=300, deadline=None)
@given(jobs(), st.sampled_from([2, 4]))
def test_grows_with_batch_and_sequence(job, factor):
    """Per-layer activations strictly grow; the peak never shrinks. It stays put when the peak
    moment holds no activations: the optimizer step, or the embedding backward of a tied model
    (its gradients and their sum, measured on the bundled trainer). cuBLAS's workspaces, counted
    as activations beside every phase (``overhead.cublas_workspaces``), do not grow."""
    m, workload, plan, runtime = job
    base = estimate_memory(m, workload, plan, runtime)
    bigger_batch = workload.model_copy(
        update={"micro_batch": workload.micro_batch * factor, "global_batch": workload.global_batch * factor}
    )
    longer = workload.model_copy(update={"seq_len": workload.seq_len * factor})
    for bigger in (bigger_batch, longer):
        report = estimate_memory(m, bigger, plan, runtime)
        assert report.activations.per_layer > base.activations.per_layer
        assert report.peak.allocated >= base.peak.allocated
        workspaces = O.cublas_workspaces(runtime, "cuda")
        held = base.peak.breakdown.get("activations", 0) - workspaces, base.peak.breakdown.get("logits_and_loss", 0)
        holds_activations = any(held)
        if holds_activations:
            assert report.peak.allocated > base.peak.allocated


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_breakdown_sums_to_peak(job):
    report = estimate_memory(*job)
    assert sum(report.peak.breakdown.values()) == report.peak.allocated
    assert report.peak.reserved >= report.peak.allocated
    assert report.peak.allocated == max(report.phases.values())
    assert all(v >= 0 for v in report.peak.breakdown.values())


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from([1, 4, 16]), st.sampled_from([1024, 8192]), st.sampled_from([2, 4]))
def test_inference_grows_with_batch_and_context(name, batch, context, factor):
    m = model(name)
    plan = Plan(precision="bf16")
    base = InferenceWorkload(batch=batch, prompt_tokens=context, generated_tokens=0)
    report = estimate_memory(m, base, plan)
    assert sum(report.peak.breakdown.values()) == report.peak.allocated
    for bigger in (
        base.model_copy(update={"batch": batch * factor}),
        base.model_copy(update={"prompt_tokens": context * factor}),
    ):
        assert estimate_memory(m, bigger, plan).peak.allocated > report.peak.allocated
