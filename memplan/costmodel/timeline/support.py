"""Which plans the bundled trainer's op-by-op run (``trainer.py``) models.

Apart from that run so that the estimate path asks the question without importing the run's
model (``trainer_model``, ``autograd``, ``fsdp``): a plan it does not model is replayed from the
phase model's moments (``step.py``), and the trainer's modules stay unimported.
"""

from __future__ import annotations

from memplan.costmodel.attention import sdpa_backend
from memplan.costmodel.quant import CudaArch, gemm_4bit_kernel
from memplan.costmodel.trainer_offload import unmodelled, unmodelled_accumulation
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

_PRECISIONS = ("fp32", "bf16", "bf16-mixed", "bf16-master")  # fp8, fp16-master: not modelled
# Layer forwards of one pipelined step the run follows; past it the phase model answers, so that
# ``memplan estimate`` stays quick: llama3-70b, pp 8, 64 micro-batches (640 a step) took 5 s for the
# run (build and three steps) and its replay on one core, 2026-11-27.
PIPELINE_LAYER_PASSES = 1024


def supported(model: ModelSpec, workload: TrainingWorkload, plan: Plan, gpu_arch: CudaArch | None = None) -> str | None:
    """What keeps the timeline from following this plan faithfully, or None (``gpu_arch``: the GPU's
    SMs and compute capability, ``quant.cuda_arch``; they pick bitsandbytes' 4-bit kernel).

    Modelled (the traces cover each mechanism): one pipeline stage; a dense Llama-family decoder
    (RMSNorm, RoPE, gated SiLU MLP, no QK-norm, no biases but Qwen2's on q, k and v:
    ``qkv_bias.py``, in every mechanism below, checked against the trainer on CPU,
    test_timeline_qkv_bias.py; over a 4-bit or int8 base too, frozen, added in the base's kernel:
    test_timeline_quant_compose.py) with flash SDPA, or in fp32 with GQA
    SDPA's math path (``precision.py``, h200_a_fp32full), without GQA its memory-efficient kernel
    (``mem_efficient.py``, from PyTorch's source: no trace; over a quantized base's fp32 stream
    too: test_timeline_quant_compose.py); AdamW (foreach), or bf16-master's
    MasterAdamW (``master.py``, h200_a_master1b); recompute none, full (every layer) or
    selective; in bf16, bf16-master or bf16-mixed (autocast without FSDP2, else
    MixedPrecisionPolicy), or fp32: one data rank without sharding; DDP over dp > 1 (ZeRO-0,
    ``ddp.py``: h200_a_ddp1b), or DDP with ``ZeroRedundancyOptimizer`` (ZeRO-1, ``zero1.py``:
    no trace, the trainer on CPU); or FSDP2 over dp > 1, ZeRO-3 or ZeRO-2
    (``reshard_after_forward=False``: h200_b_z2_8b), with an untied LM head, optionally with
    tensor and sequence parallel, and under ZeRO-3 optionally with FSDP2's CPU offload of
    parameters and optimizer together (h200_b_off8b), in fp32 too (the trainer on CPU:
    test_timeline_fp32_corners.py); FSDP2 in fp32 without offload (the
    trainer on CPU); a tied embedding under FSDP2 (one root group holding it; under a pipeline
    each chunk its own root, the head its own matrix: checked on CPU). With offload or without:
    any number of micro-batches per step (gradient accumulation; DDP's ``no_sync``; under offload
    every reduce-scatter output copied to the host, added there), selective-op and full recompute
    of the first ``recompute_layers`` (``recompute.py``; CPU: test_timeline_recompute.py,
    test_timeline_zero1.py, test_timeline_fsdp_variants.py).
    In every precision above also pipeline parallelism, one rank's
    chunks under GPipe, 1F1B or the interleaved schedule (``pipeline.py``, the bundled trainer's
    ``StageReplay``), on one data rank, or under FSDP2 (ZeRO-2 or ZeRO-3, each chunk its own
    root), optionally with TP + SP (h200_b_pp4 with the old StageReplay; fp32, bf16-master,
    FSDP2 over interleaved chunks and TP: the trainer on CPU, test_timeline_pipeline_combos.py).
    TP + SP on one data rank too (the trainer on CPU, the same tests). LoRA adapters
    (``lora.py``) over a frozen bf16 base on one rank (h200_a_lora8b), and over a bf16, fp32,
    bf16-mixed or bf16-master base with any number of micro-batches, dropout (``dropout.py``), a
    trained LM head copy (``modules_to_save``), under DDP or ZeRO-1 (the bundled trainer on CPU);
    a 4-bit base (``quant.py``, QLoRA: an fp32 stream on SDPA's math path), nf4 with double
    quantization computing in bf16 over more than 1536 tokens (h200_a_qlora8b), and fp4, single
    quantization, bf16-master or fp32 compute, with the LoRA variants above, under DDP or ZeRO-1
    (a head copy fp32 there), wherever CUDA's ``gemm_4bit`` takes one path on every GPU, and at
    5 to 1536 tokens on a GPU of known SMs and compute capability, the fused kernel or the fallback
    per linear as bitsandbytes' rule picks (``costmodel.gemm_4bit_rule``; the trainer on CPU,
    bitsandbytes' CUDA-only temporaries and its rule from its source: test_timeline_quant_gpu.py).
    Activation offload
    (``save_on_cpu``, ``act_offload.py``) where the trainer runs it, in bf16, bf16-mixed,
    bf16-master or fp32 (the math path's saves), with accumulation on one rank (the trainer refuses
    it over DDP); eager attention (``eager.py``) in every precision above, under autocast too
    (bf16-mixed), in full training or under LoRA over any base above (a quantized one:
    test_timeline_quant_compose.py); memplan's Triton attention (``triton_attention.py``, the
    kernel's tensors from its source), the trainer on CPU under Triton's interpreter
    (test_timeline_triton.py: every precision above, recompute none, full, selective and
    selective-op, accumulation, ZeRO-1, ZeRO-3, DDP, TP + SP, a pipeline rank, LoRA), over a 4-bit
    or int8 base too (fp32 q, k, v from the base's fp32 stream; test_timeline_triton_quant.py); tensor
    parallel without sequence parallel wherever the trainer runs it: under FSDP2, on one data rank,
    with a pipeline or without (``tensor_parallel.all_reduce``, the plain norms' own parameter
    group, whole-sequence receive buffers; checked on CPU: test_timeline_tensor_parallel.py,
    test_timeline_tp_nosp.py, no GPU trace). An LLM.int8 base
    (``int8.py``: CPU's ``MatMul8bitFp`` checked against the trainer on CPU, CUDA's
    ``MatMul8bitLt`` from bitsandbytes' source with the outlier columns ``int8_outliers.RandomInit``
    counts over the trainer's random weights, held against an H200 run: test_timeline_int8_cuda.py)
    on one rank, DDP or ZeRO-1, any
    recompute (selective-op, the first ``recompute_layers``), with accumulation, dropout or a
    trained head copy (test_timeline_quant_compose.py).

    Not modelled: context or expert parallelism; pipelines with DDP or ZeRO-1 (the trainer refuses
    them); MoE; a plain MLP, LayerNorm, output or MLP biases (the trainer refuses them),
    QK-norm; fp16-master, fp8; offload of one side alone or NVMe, or on one data rank (the trainer
    refuses it); tensor parallel over DDP (the trainer refuses it);
    LLM.int8 bases under autocast (``_int8_modelled``: the trainer refuses it); 4-bit bases under
    autocast, or whose ``gemm_4bit`` kernel the GPU's architecture picks (5 to 1536 tokens, by the
    weights' shapes) where ``gpu_arch`` is not given (no profile, or a ROCm one: bitsandbytes' ROCm
    rule reads the gfx architecture); LoRA under FSDP2, TP or PP (the trainer refuses them), under
    ZeRO-1 beside a 16-bit modules_to_save copy (the trainer refuses it: ZeroRedundancyOptimizer
    takes one dtype), a copy over a tied embedding or of another module. On CPU (``--device cpu``,
    where the run takes CPU's kernels and leaves CUDA's own tensors out: ``timeline.cpu``) the same
    plans, FSDP2 ZeRO-3 included."""
    checks = [
        (model.moe is None, "MoE models"),
        (model.mlp == "gated" and model.activation == "silu", "a non-gated or non-SiLU MLP"),
        (model.norm == "rmsnorm" and model.position_embedding == "rope", "LayerNorm or non-RoPE models"),
        (not (model.attn_out_bias or model.mlp_bias or model.qk_norm), "output or MLP biases, or QK-norm"),
        (plan.quant != "int8" or _int8_modelled(plan), _INT8),
        (_quant_modelled(model, workload, plan, gpu_arch), _QUANT),
        (plan.finetune == "full" or _plain_lora(plan), _LORA_PLAIN),
        (plan.finetune == "full" or _lora_variant(plan), _LORA_VARIANT),
        (plan.finetune == "full" or _saved_head(model, plan), "modules_to_save other than an untied lm_head"),
        (plan.offload_activations == "none" or _act_offload_modelled(plan), "activation offload with this plan"),
        (plan.cp == 1 and plan.ep == 1 and _pipeline_modelled(model, workload, plan), _PARALLEL),
        (plan.offload_params == "none" or plan.dp > 1, _OFFLOAD_ONE_RANK),
        (_offload_modelled(plan), "offload"),
        (plan.optimizer == "adamw" and plan.precision in _PRECISIONS, "this optimizer or precision"),
        (not _fp32_stream(plan) or plan.attention == "eager" or _fp32_sdpa_modelled(model, plan), _EFFICIENT_QUANT),
        (plan.offload_activations == "none" or _offload_accumulation(workload, plan), _OFFLOAD_ACCUM),
        (plan.tp == 1 or _fsdp(plan) or _tp_one_rank(plan), _TP_WITHOUT_FSDP),
        (_divides(model, workload, plan), "dimensions that tensor parallel does not divide"),
    ]
    for ok, what in checks:
        if not ok:
            return what
    return None


def _fp32_sdpa_modelled(model: ModelSpec, plan: Plan) -> bool:
    """fp32 SDPA on CUDA: the math path (GQA, ``precision.py``), or the memory-efficient kernel
    (``mem_efficient.py``: from source, no GPU trace), over a quantized base's fp32 stream too
    (the bundled trainer on CPU: tests/unit/test_timeline_quant_compose.py)."""
    return sdpa_kernel(model, plan) in ("math", "efficient")


_EFFICIENT_QUANT = "fp32 SDPA on a kernel other than the math or memory-efficient one"


def _act_offload_modelled(plan: Plan) -> bool:
    """``save_on_cpu`` as the trainer runs it (``trainer_offload.unmodelled`` says where: one
    rank or DDP, recompute none or full, full training, SDPA; ``act_offload.py``), checked on
    CPU in bf16, bf16-mixed, bf16-master and fp32 (CUDA's math path, whose saves are packed like
    any other: test_timeline_act_offload.py, test_timeline_fp32_corners.py)."""
    return unmodelled(plan) is None and plan.precision in ("bf16", "bf16-mixed", "bf16-master", "fp32")


def _offload_accumulation(workload: TrainingWorkload, plan: Plan) -> bool:
    """Activation offload with accumulation where the trainer runs it: one rank, in any precision
    above (checked on CPU in bf16, bf16-master and fp32); over data parallel the trainer refuses it
    (``trainer_offload.unmodelled_accumulation``, ``validate.support``)."""
    return unmodelled_accumulation(plan, accumulation(workload, plan)) is None


_OFFLOAD_ACCUM = "activation offload with accumulation over data parallel (the trainer refuses it)"
_TP_WITHOUT_FSDP = "tensor parallel without FSDP2 over dp > 1 (DDP)"


def _tp_one_rank(plan: Plan) -> bool:
    """TP on one data rank (the trainer refuses it over DDP), held against the trainer on CPU
    (tests/unit/test_timeline_pipeline_combos.py; without SP test_timeline_tp_nosp.py)."""
    return plan.dp == 1


# FSDP2's CPUOffloadPolicy on one data rank: the trainer applies FSDP2 over dp > 1 only
# (``parallel.uses_fsdp``), so ``validate.support.check_plan`` refuses the plan
_OFFLOAD_ONE_RANK = "CPU offload on one data rank (the trainer refuses it: FSDP2 over dp > 1 only)"


def _offload_modelled(plan: Plan) -> bool:
    """None, or FSDP2's ``CPUOffloadPolicy`` as the trainer applies it: parameters and optimizer
    both on the host, under ZeRO-3 over dp > 1 (``fsdp.py``; h200_b_off8b exact)."""
    offload = (plan.offload_params, plan.offload_optimizer)
    return offload == ("none", "none") or (offload == ("cpu", "cpu") and plan.zero == 3 and plan.dp > 1)


def _fsdp(plan: Plan) -> bool:
    """``parallel.uses_fsdp``: FSDP2 for ZeRO-2 and ZeRO-3 over dp > 1."""
    return plan.dp > 1 and plan.zero >= 2


_PARALLEL = "pipeline, context or expert parallelism"  # a pipeline: see _pipeline_modelled


def _pipeline_modelled(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> bool:
    """One pipeline rank (``pipeline.py``) on one data rank, or under FSDP2 over each of its
    chunks (one root per chunk), optionally with TP + SP; no offload; its chunks even (``validate.support``:
    the trainer refuses others); at most :data:`PIPELINE_LAYER_PASSES` layer forwards a step
    (the schedule runs every micro-batch: GPipe's peak grows with each)."""
    if plan.pp == 1:
        return True
    fsdp = _fsdp(plan)  # with TP, sequence parallel: the checks of every plan
    passes = accumulation(workload, plan) * model.num_layers // plan.pp
    even = model.num_layers % plan.stages == 0
    return (plan.dp == 1 or fsdp) and _plain(plan) and even and passes <= PIPELINE_LAYER_PASSES


def _plain(plan: Plan) -> bool:
    """Where pipelines were checked (``pipeline.py``): every precision the run follows (fp32 and
    bf16-master too: tests/unit/test_timeline_pipeline_combos.py), no offload, one data rank or
    FSDP2 (the trainer refuses DDP and ZeRO-1 under a pipeline: ``validate.support.check_plan``)."""
    return _no_offload(plan) and (plan.dp == 1 or _fsdp(plan))


def _no_offload(plan: Plan) -> bool:
    """No FSDP2 CPU offload: where pipelines (the trainer refuses offload there) and fp32 (not
    checked) were followed."""
    return plan.offload_params == "none" and plan.offload_optimizer == "none"


def accumulation(workload: TrainingWorkload, plan: Plan) -> int:
    """Micro-batches per step on one rank (``RunSpec.accumulation``)."""
    total = workload.global_batch or workload.micro_batch * plan.dp
    return max(1, total // (workload.micro_batch * plan.dp))


def _divides(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> bool:
    """``validate.support``: TP splits the heads, the FFN and the vocabulary; SP the sequence."""
    tp = plan.tp
    sizes = (model.q_size, model.kv_size, model.ffn_size, model.vocab_size, model.num_attention_heads, model.kv_heads)
    return all(n % tp == 0 for n in sizes) and (workload.seq_len % tp == 0 or not plan.sequence_parallel)


def sdpa_kernel(model: ModelSpec, plan: Plan) -> str:
    """The kernel the trainer's ``F.scaled_dot_product_attention(..., enable_gqa=kv != heads)``
    runs on CUDA (``attention.sdpa_backend``, torch 2.11, compute capability 9.0): "math" in fp32
    with GQA (flash and cuDNN take 16-bit only, memory-efficient no ``enable_gqa``;
    ``precision.math_sdpa``), "efficient" in fp32 without GQA, else "flash" (the run's fused
    16-bit kernel: the traces' tensors are flash's, ``ops.sdpa``)."""
    heads, kv = model.num_attention_heads // plan.tp, max(model.kv_heads // plan.tp, 1)
    if not _fp32_stream(plan):
        return "flash"
    return sdpa_backend("cuda", "fp32", model.head_size, heads, kv, enable_gqa=heads != kv)


def _fp32_stream(plan: Plan) -> bool:
    """fp32 hidden states: precision fp32, or a quantized base (``prepare_model_for_kbit_training``
    casts the embedding, norms and head to fp32; ``memplan.train.quant``)."""
    return plan.precision == "fp32" or plan.quant != "none"


_INT8 = "an LLM.int8 base under autocast or FSDP2"


def _int8_modelled(plan: Plan) -> bool:
    """An LLM.int8 base (``int8.py``) under LoRA as the bundled trainer on CPU was checked
    (tests/unit/test_timeline_int8.py, test_timeline_quant_compose.py: within the AdamW ``step``
    scalars): fp32, bf16 or bf16-master (the stream is fp32 either way), any recompute (selective-op:
    CPU's ``MatMul8bitFp`` runs an ``mm`` the policy counts, CUDA's int8 kernels none but the
    ``addmm`` of outlier columns; the first
    ``recompute_layers``), accumulation, dropout, a trained head copy (fp32 after
    ``prepare_model_for_kbit_training``, its frozen original too), one rank, DDP or ZeRO-1. Not
    under autocast (the trainer refuses it) nor FSDP2 (the trainer runs LoRA without it)."""
    return plan.precision != "bf16-mixed" and (plan.dp == 1 or plan.zero <= 1)


_QUANT = (
    "a 4-bit base whose gemm_4bit kernel the GPU picks (5 to 1536 tokens) on a GPU of unknown SMs or compute "
    "capability, or under autocast"
)


def _quant_modelled(model: ModelSpec, workload: TrainingWorkload, plan: Plan, gpu_arch: CudaArch | None) -> bool:
    """None, an int8 base (:func:`_int8_modelled` says which), or a 4-bit base (``quant.py``): nf4
    (h200_a_qlora8b) or fp4, with or without double quantization, computing in bf16 (bf16,
    bf16-master) or fp32, where CUDA's ``gemm_4bit`` path is known for each decoder linear
    (``costmodel.quant.gemm_4bit_kernel``: over 1536 tokens a micro-batch dequantize + F.linear, at
    most 4 its fused kernel; between, bitsandbytes' rule on ``gpu_arch``, or without it the shapes
    and compute dtypes where every GPU agrees: else declined). Not under autocast (bf16-mixed): the
    bundled trainer refuses it (``validate.support.check_plan``)."""
    if plan.quant in ("none", "int8"):  # int8: _int8_modelled
        return True
    if plan.quant not in ("nf4", "fp4") or plan.precision not in ("bf16", "bf16-master", "fp32"):
        return False
    tokens, h = workload.micro_batch * workload.seq_len, model.hidden_size
    shapes = {(model.q_size, h), (model.kv_size, h), (h, model.q_size), (model.ffn_size, h), (h, model.ffn_size)}
    compute = 4 if plan.precision == "fp32" else 2
    return all(gemm_4bit_kernel(tokens, n, k, compute, gpu_arch) is not None for n, k in shapes)


def _plain_lora(plan: Plan) -> bool:
    """LoRA as h200_a_lora8b and h200_a_qlora8b ran it (one rank, a bf16 base, or a 4-bit one
    computing in bf16; other 4-bit bases: :func:`_quant_modelled`), or over an fp32 base, under
    autocast (bf16-mixed: the frozen base's weights cast anew at each matmul, the adapters'
    cached) or bf16-master's (AdamW over the
    fp32 adapters, MasterAdamW beside a 16-bit ``modules_to_save`` copy), on one rank or under
    DDP or ZeRO-1 (the reducer over the adapters): the bundled trainer on CPU
    (tests/unit/test_timeline_lora_variants.py). The trainer runs LoRA without FSDP2, TP or PP."""
    ranks = plan.dp == 1 or plan.zero < 2
    return ranks and plan.tp == 1 and plan.pp == 1 and plan.precision in ("bf16", "bf16-mixed", "bf16-master", "fp32")


_LORA_PLAIN = "LoRA other than adapters on one rank or under DDP (FSDP2, TP, PP)"
_LORA_VARIANT = "LoRA under ZeRO-1 beside a 16-bit modules_to_save copy (the trainer refuses it)"


def _lora_variant(plan: Plan) -> bool:
    """Gradient accumulation, dropout (``dropout.py``) and a trained LM head copy (under DDP a
    16-bit copy beside the fp32 adapters: one reducer bucket per dtype,
    ``ddp.assign_buckets_by_dtype``), but not a 16-bit copy under ZeRO-1
    (``ZeroRedundancyOptimizer`` refuses mixed dtypes: the trainer fails). Over a 4-bit base the
    copy is fp32 (``prepare_model_for_kbit_training``), so ZeRO-1 takes it; the base's CUDA-only
    temporaries come from bitsandbytes' source, the rest checked against the trainer on CPU
    (tests/unit/test_timeline_quant_variants.py)."""
    zero1 = plan.dp > 1 and plan.zero == 1
    sixteen_bit_copy = plan.quant == "none" and plan.precision in ("bf16", "bf16-master")
    return not (zero1 and plan.modules_to_save and sixteen_bit_copy)


def _saved_head(model: ModelSpec, plan: Plan) -> bool:
    """``modules_to_save``: none, or the LM head of an untied model (the bundled trainer trains no
    other copy, nor one over a tied embedding: ``validate.support``)."""
    return set(plan.modules_to_save) <= {"lm_head"} and not (plan.modules_to_save and model.tied_embeddings)
