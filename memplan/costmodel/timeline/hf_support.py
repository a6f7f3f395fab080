"""Which ``--runtime hf`` plans the op-level run of ``transformers.Trainer`` (``hf_trainer.py``) models.

Apart from the run so that asking does not build it. Modelled (tests/unit/test_timeline_hf.py, every
case equal to the real Trainer's peak on CPU; the families in tests/unit/test_timeline_hf_families.py):
full fine-tuning on one rank of a dense Llama-layout decoder (Llama, Mistral without a sliding window,
Qwen2 with its q/k/v biases) or of the families of ``hf_families.py`` as transformers writes them
(Qwen3 without attention biases or sliding layers, Phi-3 with full rotary embeddings, OLMo 2 without
attention biases, Gemma 3 without attention soft-capping; Mistral's, Qwen2's, Phi-3's and Gemma 3's sliding
layers where the sequence is shorter than the window, so that transformers passes SDPA no mask, and under the
Trainer on CPU where it reaches it: SDPA with the window's mask, ``hf_sliding.py``,
tests/unit/test_timeline_hf_sliding.py; on CUDA under the memory-efficient kernel, :func:`sliding_cuda_ok`, from
source, tests/unit/test_timeline_hf_sliding_cuda.py) under SDPA, and
Gemma 2 under the eager attention transformers gives it, and Mixtral, Qwen3-MoE and Qwen2-MoE
(``hf_moe.py``: the router and the ``grouped_mm`` experts, Qwen2-MoE's one shared expert under its sigmoid
gate, the Qwen families' dense layers; full fine-tuning, or PEFT LoRA as ``MOE_LORA_TARGETS`` allows (the
experts and routers PEFT wraps in its ParamWrapper: ``hf_moe_lora.py``), one rank, DDP or FSDP2 (below);
no router biases; tests/unit/test_timeline_hf_moe.py), and DeepSeek-V3 and V2 (``hf_mla.py``: MLA under the
CPU's math SDPA, on CUDA under the memory-efficient kernel, ``mla_cuda_ok``, from source; V3's sigmoid router
with its score bias and groups, the ungated shared experts; ``hf_mla_v2.py``:
V2's complex RoPE and softmax router, greedy or group-limited; full fine-tuning, or PEFT LoRA on MLA's
linears, on one rank, under DDP or FSDP2 (below: not V3 loaded on the CPU, :func:`_cpu_load_buffer`);
tests/unit/test_timeline_hf_mla.py, test_timeline_hf_mla_v2.py, test_timeline_hf_fsdp_mla.py);
fp32, ``bf16`` (a bf16 model under
``bf16=True``, the exporters' recipe: ``specs.plan.trainer_autocast``; tests/unit/test_timeline_hf_autocast.py;
without it where the plan's ``autocast`` is off), or ``bf16=True`` over fp32 (``bf16-mixed``); the default
fused AdamW, and the Trainer's other optimizers over every family, full fine-tuning or PEFT (``hf_optimizers.py``: SGD,
Adafactor; ``hf_bnb_optim.py``: bitsandbytes' 8-bit, 32-bit and paged AdamW and Lion, the paged buffers in
CUDA managed memory from source; tests/unit/test_timeline_hf_optimizers.py); gradient checkpointing of every
layer or none; any gradient accumulation; PEFT LoRA over the frozen base (tests/unit/test_timeline_hf_peft.py:
any of the decoder layers' linears, any rank, dropout, ``modules_to_save`` lm_head or an untied
embed_tokens), over every dense family above (tests/unit/test_timeline_hf_peft_families.py; Phi-3's adapters
by its own names, ``qkv_proj`` and ``gate_up_proj``: :func:`_dense_lora_ok`). On CUDA the kernels are those of
the bundled trainer's traces (``support.sdpa_kernel``),
and LoRA's dropout is ``native_dropout`` from its source: not yet checked on a GPU against transformers.
A 4-bit base (nf4 / fp4, double quantization; ``hf_bnb.py``) wherever CUDA's ``gemm_4bit`` path is known for
every linear (``_kernel_known``: over 1536 tokens a micro-batch bitsandbytes' dequantize-then-``F.linear``
fallback on every GPU; up to it the fused kernel or the fallback as its rule picks on the GPU's SMs and
compute capability, ``costmodel.gemm_4bit_rule``; both read from its source); an LLM.int8 base
(``hf_bnb.Bnb8bit``, ``int8.py``: CPU's ``MatMul8bitFp`` equal to the byte, tests/unit/test_timeline_int8.py;
over every dense family, tests/unit/test_timeline_hf_int8_families.py; CUDA's ``MatMul8bitLt`` from the source,
its outlier columns ``int8.OUTLIER_COLUMNS``: a loaded checkpoint taken as trained; a random one keeps more,
tests/unit/test_timeline_int8_cuda.py); either under the MoE and MLA families on CPU
(:func:`_quant_moe_ok`: the ``nn.Linear`` quantized, the router and 3-D experts fp32; under the Trainer and the
hand-written loop on one rank, tests/unit/test_timeline_hf_quant_moe.py; under the Trainer's DDP and, 4-bit over
Mixtral and Qwen3-MoE, its FSDP2, tests/unit/test_timeline_hf_quant_moe_ranks.py). Any of these over
``dp`` > 1 ranks under DDP (``zero: 0``: the Trainer under ``torchrun``, ``hf_ddp.py``;
tests/unit/test_timeline_hf_ddp.py, two gloo ranks on CPU, rank 0's peak equal to the run's). The Trainer's
FSDP2 (``--zero 3``: ``full_shard``, ``--zero 2``: ``shard_grad_op``; ``hf_fsdp.py``;
tests/unit/test_timeline_hf_fsdp.py, rank 0 of two or four under the fake process group on CPU, equal to the
real Trainer's peak) for full fine-tuning of every family above (the MoE and MLA ones: each decoder
layer one group, the experts sharded on the expert axis, ``hf_fsdp_moe.py``, tests/unit/test_timeline_hf_fsdp_moe.py,
test_timeline_hf_fsdp_mla.py)
loaded onto the GPU (``model_build:
from_pretrained``) or on the CPU and sharded by ``cpu_ram_efficient_loading`` (``model_build: to_device``,
the default for these plans, ``specs/resolve.py``; ``hf_fsdp_load.py``, tests/unit/test_timeline_hf_fsdp_load.py:
the shards' order and sizes and the peak equal on CPU, the full copies on the GPU from source), in fp32, a
bf16 model without ``bf16=True``, or under ``bf16=True`` (accelerate's bf16 policy over fp32 master shards;
Gemma 2 / 3 too: their bf16 residual stream, ``hf_gemma.py``), and PEFT LoRA (any targets, dropout,
``modules_to_save`` none, an untied lm_head or embed_tokens) over an fp32 or a bf16 base, with or without
``bf16=True`` (``hf_fsdp_peft.py``; over an MoE base as ``MOE_LORA_TARGETS`` allows, PEFT's ``ParamWrapper``
too), with the Trainer's or FSDP's own checkpointing and accumulation, and
QLoRA (nf4 / fp4, double quantization, the recipe's ``bnb_4bit_quant_storage``: the packed weights sharded,
Qwen2's and Qwen2-MoE's q/k/v biases recast once, ``hf_fsdp_qlora.py``; tests/unit/test_timeline_hf_fsdp_qlora.py,
test_timeline_hf_fsdp_mla.py). Not modelled: an LLM.int8 base under FSDP (the Trainer cannot run it: ``fully_shard``
gathers its ``Int8Params`` back as plain Parameters, and ``specs.job.check_fsdp_int8`` refuses the plan),
ZeRO-1 (DeepSpeed's), and tensor, pipeline, context or expert
parallelism. Activation offload (``offload_activations: cpu``, ``hf_offload.py``: TRL's ``OffloadActivations``
around ``training_step``) on CPU, over the dense, MoE and MLA families, on one rank, under DDP or FSDP2, over a
float, 4-bit or LLM.int8 base (tests/accuracy/test_offload_accuracy.py, tests/unit/test_timeline_hf_offload_ranks.py,
test_timeline_hf_offload_moe.py, equal to the byte);
on CUDA (TRL's strided copies and side streams) not followed.
A model loaded on the CPU without ``cpu_ram_efficient_loading`` (``fully_shard``
moving each group to the GPU full-size as it shards it) is run as with it: the build differs by a group's
full parameters, never the steps.

``runtime="hf-loop"`` (the hand-written loop of ``hf_loop.py``; tests/unit/test_timeline_hf_loop.py, every
case equal to the real loop's peak on CPU): the same models, precisions, kernels, checkpointing, LoRA and
4-bit and LLM.int8 bases (the int8 linears' inputs held with ``out``'s graph to the next forward;
tests/unit/test_timeline_hf_int8_families.py), checkpointing with either of torch's checkpoints (``use_reentrant``,
``specs.plan.checkpoint_reentrant``: by default the reentrant one over a quantized base, as PEFT's
``prepare_model_for_kbit_training(model)`` leaves it, ``reentrant.py``; under the Trainer where the plan says so,
on one rank, under DDP and FSDP2, under activation offload: TRL's hooks under the Trainer, ``save_on_cpu`` under the
hand-written loop, tests/unit/test_timeline_hf_reentrant_offload.py), every
family above with the LoRA and QLoRA the Trainer's run follows on it (the family modules composed under the
loop's step; tests/unit/test_timeline_hf_loop_families.py, and over Qwen3, Phi-3, OLMo 2, Gemma 2 and 3
test_timeline_hf_loop_peft_families.py), sliding windows the sequence reaches on CPU as under the Trainer (the
loop's ``DynamicSlidingWindowLayer``s keep a view of the whole sequence's copy, as a ``DynamicLayer`` does), and on
CUDA where the Trainer's are, on the same kernel (:func:`sliding_cuda_ok` at the loop's precision; from source,
tests/unit/test_timeline_hf_loop_sliding_cuda.py), with
``AdamW(foreach=True)``, any gradient accumulation (``loss = out.loss / ga``, ``opt.step()`` every ``ga``
iterations), on one rank, with or without activation offload (``save_on_cpu`` around the forward and backward:
``act_offload.py``'s hooks, checked over the dense families, Mixtral, Qwen3-MoE, Qwen2-MoE and DeepSeek-V2 / V3,
``LOOP_OFFLOAD_FAMILIES``, over a float, 4-bit or LLM.int8 base; tests/accuracy/test_offload_accuracy.py,
test_timeline_hf_loop_peft_families.py, test_timeline_hf_quant_moe.py);
there ``bf16`` is the bf16 model without autocast unless the plan's ``autocast`` puts the forward under
``torch.autocast`` (tests/unit/test_plan_autocast.py), so over a 4-bit base SDPA takes the fp32 stream: without
GQA the memory-efficient kernel on CUDA (:func:`_four_bit_kernel_ok`).

Eager attention (``attn_implementation="eager"``, the plan's ``attention: eager``; ``hf_eager.py``,
``hf_eager_moe.py``) over every dense and MoE family above (``EAGER_FAMILIES``; not MLA's), under both runtimes,
every precision, checkpointing, PEFT, 4-bit and ranks as under SDPA, the windows in its masks at any length
(``EAGER_WINDOWS``); on CUDA the same ops (no kernel choice), not run on a GPU (tests/unit/test_timeline_hf_eager.py).

fp32 SDPA without GQA (as many KV heads as query heads: transformers passes no ``enable_gqa``) runs CUDA's
memory-efficient kernel, followed from source on compute capability 8.0 / 9.0 (``mem_efficient.py``,
:func:`_efficient_cuda_ok`; tests/unit/test_timeline_hf_mem_efficient.py), as the masked sliding layers' and MLA's.
"""

from __future__ import annotations

from memplan.costmodel.attention import sdpa_backend
from memplan.costmodel.lora import ALL_LINEAR, ATTENTION, LINEARS, MLA_ATTENTION, SAVABLE, layer_linears, model_targets
from memplan.costmodel.quant import CudaArch, gemm_4bit_kernel
from memplan.costmodel.timeline.support import sdpa_kernel
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan, checkpoint_reentrant, trainer_autocast
from memplan.specs.workload import TrainingWorkload

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma3")
MOE_FAMILIES = ("mixtral", "qwen3-moe", "qwen2-moe")  # hf_moe.py: the sparse block on Mistral's, Qwen3's, Qwen2's layer
# hf_mla.py: MLA, V3's sigmoid router with its score bias, the shared experts; hf_mla_v2.py: V2's complex RoPE
# and softmax router
MLA_FAMILIES = ("deepseek-v2", "deepseek-v3")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + MLA_FAMILIES
# each family's layer as transformers writes it: (layer norms, q/k norm scope or None, (fused qkv, fused gate-up))
LAYOUT = {
    "qwen3": ("pre", "head", (False, False)),
    "qwen3-moe": ("pre", "head", (False, False)),
    "phi3": ("pre", None, (True, True)),
    "olmo2": ("post", "full", (False, False)),
    "gemma2": ("sandwich", None, (False, False)),
    "gemma3": ("sandwich", "head", (False, False)),
}
LLAMA_LAYOUT = ("pre", None, (False, False))
QKV_BIAS_FAMILIES = ("qwen2", "qwen2-moe")  # q/k/v biases (hf_model.QKV_BIAS)
# save_on_cpu around the hand-written loop's forward and backward (act_offload.py) checked against the loop on CPU:
# Llama's layout (tests/accuracy/test_offload_accuracy.py), the other dense families, Mixtral, Qwen3-MoE, Qwen2-MoE
# and DeepSeek-V2 / V3 (tests/unit/test_timeline_hf_loop_peft_families.py)
LOOP_OFFLOAD_FAMILIES = (*DENSE_FAMILIES, "mixtral", "qwen3-moe", "qwen2-moe", "deepseek-v2", "deepseek-v3")
ACTIVATION = {"gemma2": "gelu_tanh", "gemma3": "gelu_tanh"}  # GeGLU (gelu_pytorch_tanh); the others SwiGLU
# transformers runs Gemma 2 eagerly whatever is asked (_supports_sdpa = False: SDPA takes no soft-cap),
# over both masks it builds, so its sliding layers are followed at any window
EAGER = ("gemma2",)
# attn_implementation="eager" (hf_eager.py, hf_eager_moe.py: eager_attention_forward over the masks masking_utils
# builds for it) followed on these families, on CPU and on CUDA (the same ops: no kernel choice); MLA's is its own
EAGER_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
# under eager attention a window is in the mask at any length: the families whose sliding masks are followed
EAGER_WINDOWS = ("mistral", "qwen2", "phi3", "gemma3", "mixtral")
# families whose sliding layers, with a window the sequence does not reach, run as full causal ones:
# masking_utils._ignore_causal_mask_sdpa skips the mask (kv_length < window), SDPA runs is_causal; past
# the window, on CPU (and on CUDA where sliding_cuda_ok), SDPA with the mask (hf_sliding.py), under either runtime
WINDOW_SKIPPED = ("mistral", "qwen2", "phi3", "gemma3", "mixtral")


def _layout(model: ModelSpec) -> tuple:
    """The spec's layer in ``LAYOUT``'s terms."""
    scope = model.qk_norm_scope if model.qk_norm and model.qk_norm_weight else None
    return model.layer_norms, scope, (model.fused_qkv, model.fused_gate_up)


def _attention_ok(model: ModelSpec, seq_len: int | None, masked: bool, eager: bool = False) -> bool:
    """Full causal attention in every layer, or sliding layers whose window the sequence does not reach, or
    reaches where ``masked`` (on CPU, under the Trainer or the hand-written loop: SDPA with the window's mask,
    ``hf_sliding.py``; the loop's ``DynamicSlidingWindowLayer`` keeps a slice of the whole sequence's copy,
    ``hf_loop.py``; on CUDA under either where :func:`sliding_cuda_ok`); under eager attention (``eager``: the
    plan's, ``hf_eager.py``) any window of the families whose sliding masks are followed."""
    kinds = set(model.attention_pattern)
    eager = model.architecture in EAGER or (eager and model.architecture in EAGER_WINDOWS)
    if kinds <= {"full"} or (eager and kinds <= {"full", "sliding"}):
        return True
    window = model.sliding_window
    reached = seq_len is None or window is None or seq_len >= window
    return kinds <= {"full", "sliding"} and model.architecture in WINDOW_SKIPPED and (masked or not reached)


def _window_reason(model: ModelSpec, plan: Plan, gpu_arch: CudaArch | None, runtime: str) -> str:
    """Why a reached window is not followed: a family or kind ``hf_sliding.py`` does not follow (Qwen3's windows,
    chunked layers), or on CUDA the masked SDPA kernel (``hf_sliding.cuda_masked_kernel``: cuDNN or the
    memory-efficient one, from source); on CPU both runtimes follow it."""
    from memplan.costmodel.timeline.hf_sliding import cuda_masked_kernel

    if model.architecture not in WINDOW_SKIPPED or not set(model.attention_pattern) <= {"full", "sliding"}:
        return f"sliding or chunked attention (a window the sequence reaches, in the {model.architecture} family)"
    cap = (9, 0) if gpu_arch is None else (gpu_arch.major, gpu_arch.minor)
    half = _sdpa_half(plan, runtime)
    kernel = cuda_masked_kernel(model.head_size, model.num_attention_heads, half, cap)
    where = f"on CUDA SDPA takes the mask to its {kernel} kernel"
    if kernel == "efficient":  # sliding_cuda_ok: the backward's blocks known on 8.0 / 9.0
        where += " outside compute capability 8.0 / 9.0"
    runs = "the Trainer" if runtime == "hf" else "the hand-written loop"
    return (
        f"sliding or chunked attention (a window the sequence reaches: {where}, not followed; the op-level run "
        f"follows it under {runs} on CPU, --device cpu)"
    )


def _sdpa_half(plan: Plan, runtime: str) -> bool:
    """Whether SDPA gets 16-bit inputs: ``bf16=True``'s autocast, or a bf16 model whose stream a quantized base
    does not make fp32 (``hf_trainer.hf_kernel``'s rule)."""
    return trainer_autocast(plan, runtime) or not (plan.precision == "fp32" or plan.quant != "none")


def _masked_cuda(model: ModelSpec, plan: Plan, gpu_arch: CudaArch | None, runtime: str) -> bool:
    """:func:`sliding_cuda_ok` asked only of a model with windows (it imports ``hf_sliding``, the run's modules)."""
    return bool(model.attention_pattern) and sliding_cuda_ok(model, plan, gpu_arch, runtime)


def sliding_cuda_ok(model: ModelSpec, plan: Plan, gpu_arch: CudaArch | None, runtime: str = "hf") -> bool:
    """A sliding layer's masked SDPA on CUDA as ``hf_sliding.cuda_masked_sdpa`` follows it: the memory-efficient
    kernel (``hf_sliding.cuda_masked_kernel``), on compute capability 8.0 or 9.0 (an unknown GPU: 9.0; the
    backward kernels' blocks by the GPU's shared memory, as MLA's: :data:`MLA_CAPABILITIES`), in fp32 or 16 bits at
    any head dim (``mem_efficient_half.py``: Gemma 3's 256; Mistral's, Qwen2's, Phi-3's 128 or less in 16 bits where
    cuDNN is not first, on 8.0). cuDNN (16 bits over heads of 128 or less on 9.0 / 10.0, first there from torch
    2.10 at the bundled cuDNN: ``attention.cuda_priority``) is not followed: its workspace comes from cuDNN's
    execution plan at run time. ``runtime``: whose precision reaches SDPA (``_sdpa_half``: the hand-written loop
    autocasts only where the plan says, so its 4-bit base hands SDPA the fp32 stream)."""
    from memplan.costmodel.timeline.hf_sliding import cuda_masked_kernel

    cap = (9, 0) if gpu_arch is None else (gpu_arch.major, gpu_arch.minor)
    kernel = cuda_masked_kernel(model.head_size, model.num_attention_heads, _sdpa_half(plan, runtime), cap)
    return kernel == "efficient" and cap in MLA_CAPABILITIES


def hf_supported(
    model: ModelSpec,
    plan: Plan,
    workload: TrainingWorkload | None = None,
    runtime: str = "hf",
    gpu_arch: CudaArch | None = None,
    device: str = "cuda",
) -> str | None:
    """What keeps the op-level run from following this ``hf`` (or ``hf-loop``) plan on ``device``,
    or None (``workload``: the micro-batch, whose tokens decide bitsandbytes' CUDA path with the GPU's
    SMs and compute capability, ``gpu_arch``, and whether a sliding window is reached). On CPU neither
    CUDA question arises: bitsandbytes' CPU backend takes one path at every size, and SDPA runs the
    CPU flash kernel in fp32 with and without GQA (``hf_kernel``: ``cpu_flash``)."""
    cpu = device == "cpu"
    tokens = None if workload is None or cpu else workload.micro_batch * workload.seq_len
    seq_len = None if workload is None else workload.seq_len
    checks = [
        (model.architecture in FAMILIES, f"the {model.architecture} family"),
        (model.mla is None or model.architecture in MLA_FAMILIES, "MLA models"),
        (model.mla is None or cpu or mla_cuda_ok(model, plan, gpu_arch), _MLA_CUDA),
        (model.mla is None or _mla_ok(model, plan), _MLA_PLAN),
        (_moe_ok(model), "this MoE block (shared experts, dense layers, router biases or fused experts)"),
        (model.moe is None or plan.quant == "none" or _quant_moe_ok(model, cpu), _QUANT_MOE),
        (
            model.moe is None or gpu_arch is None or gpu_arch.major >= 8,
            "MoE experts below compute capability 8.0 (transformers' own grouped_mm fallback)",
        ),
        (model.mlp == "gated" and model.activation == ACTIVATION.get(model.architecture, "silu"), "this MLP"),
        (model.attn_logit_softcapping is None or model.architecture in EAGER, "attention logit soft-capping"),
        (model.norm == "rmsnorm" and model.position_embedding == "rope", "LayerNorm or non-RoPE models"),
        (not (model.attn_out_bias or model.mlp_bias), "these biases"),
        (_layout(model) == LAYOUT.get(model.architecture, LLAMA_LAYOUT), f"this {model.architecture} layer layout"),
        (model.partial_rotary_factor == 1.0, "partial rotary embeddings"),
        (not model.qkv_bias or model.architecture in QKV_BIAS_FAMILIES, "Q/K/V biases outside Qwen2 and Qwen2-MoE"),
        (
            _attention_ok(
                model, seq_len, cpu or _masked_cuda(model, plan, gpu_arch, runtime), plan.attention == "eager"
            ),
            lambda: _window_reason(model, plan, gpu_arch, runtime),
        ),
        (
            plan.attention == "flash"
            or model.architecture in EAGER
            or (plan.attention == "eager" and model.architecture in EAGER_FAMILIES),
            f"{plan.attention} attention",
        ),
        (
            plan.quant in ("none", "int8") or tokens is None or _kernel_known(model, plan, tokens, gpu_arch),
            f"a 4-bit base over {tokens} tokens a micro-batch on a GPU of unknown SMs or compute capability, where "
            "CUDA's gemm_4bit picks its fused kernel or the fallback by these (5 to 1536 tokens, by the shapes)",
        ),
        (
            plan.finetune == "full"
            or _dense_lora_ok(model, plan)
            or _moe_lora_ok(model, plan)
            or (model.architecture in MLA_FAMILIES and _mla_lora_ok(model, plan)),
            f"PEFT over the {model.architecture} family" + (_MOE_LORA if model.architecture in MOE_FAMILIES else ""),
        ),
        (not plan.lora_dora or _dora_reason(model, plan, runtime) is None, lambda: _dora_reason(model, plan, runtime)),
        (set(plan.modules_to_save) <= set(SAVABLE), f"modules_to_save {list(plan.modules_to_save)}"),
        (not (model.tied_embeddings and "embed_tokens" in plan.modules_to_save), "a trained copy of tied embeddings"),
        # TRL's activation offload around the Trainer's training_step (hf_offload.py) is followed on CPU over
        # every family, rank layout and base the Trainer's run follows (on CUDA its copies run on side streams)
        (
            plan.offload_activations == "none" or runtime == "hf-loop" or cpu,
            "activation offload under the Trainer on CUDA (TRL's hooks: followed on CPU, --device cpu)",
        ),
        (
            plan.offload_activations == "none" or runtime == "hf" or model.architecture in LOOP_OFFLOAD_FAMILIES,
            f"activation offload under the hf-loop runtime over the {model.architecture} family (checked for "
            f"{', '.join(LOOP_OFFLOAD_FAMILIES)})",
        ),
        (plan.offload_params == "none" and plan.offload_optimizer == "none", "offload"),
        (plan.tp == plan.pp == plan.cp == plan.ep == 1, "more than one rank (tensor, pipeline, context or expert)"),
        # before the Trainer's own multi-rank checks (ZeRO-1, FSDP), which would name the Trainer's mechanisms
        (plan.dp == 1 or runtime == "hf", "more than one rank under the hf-loop runtime (its loop has no DDP)"),
        (
            plan.dp == 1 or plan.zero != 1,
            "ZeRO over more than one rank at stage 1 (DeepSpeed's; the Trainer's FSDP is 2 or 3)",
        ),
        (plan.dp == 1 or plan.zero == 0 or _fsdp_ok(model, plan, runtime), _fsdp_reason(model, plan)),
        (not _cpu_load_buffer(model, plan), _CPU_LOAD_BUFFER),
        (plan.optimizer == "adamw" or _optimizer_ok(plan, runtime), _optimizer_reason(plan, runtime)),
        (plan.precision in ("fp32", "bf16", "bf16-mixed"), _precision_reason(plan.precision)),
        (plan.recompute in ("none", "full") and plan.recompute_layers is None, "this recompute"),
        (
            cpu
            or plan.precision != "fp32"
            or sdpa_kernel(model, plan) == "math"
            or model.architecture in EAGER
            or plan.attention == "eager"  # no SDPA (hf_eager.py)
            or model.mla is not None  # MLA's own check: mla_cuda_ok
            or _efficient_cuda_ok(gpu_arch),
            _EFFICIENT_CUDA,
        ),
        (
            cpu or plan.quant == "none" or _four_bit_kernel_ok(model, plan, runtime, gpu_arch),
            f"{_EFFICIENT_CUDA} (a quantized base's fp32 stream without autocast, no GQA)",
        ),
    ]
    for ok, what in checks:
        if not ok:
            return what() if callable(what) else what  # a reason worked out only when it is given
    return None


_EFFICIENT_CUDA = (
    "fp32 SDPA on the memory-efficient kernel outside compute capability 8.0 / 9.0 (its backward's blocks by the "
    "GPU's shared memory)"
)


def _efficient_cuda_ok(gpu_arch: CudaArch | None) -> bool:
    """fp32 SDPA without GQA on CUDA (``mem_efficient.py``: transformers passes no ``enable_gqa`` over as many KV
    heads as query heads, ``is_causal`` and no mask; ``can_use_mem_efficient_attention`` takes it, flash and cuDNN
    take no fp32): followed on compute capability 8.0 / 9.0 (an unknown GPU: 9.0), where the Sm80 kernels'
    shared memory is known to fit (:data:`MLA_CAPABILITIES`)."""
    cap = (9, 0) if gpu_arch is None else (gpu_arch.major, gpu_arch.minor)
    return cap in MLA_CAPABILITIES


def _four_bit_kernel_ok(model: ModelSpec, plan: Plan, runtime: str, gpu_arch: CudaArch | None) -> bool:
    """Over a 4-bit (or LLM.int8) base the residual stream is fp32 whatever the precision (bitsandbytes dequantizes
    to the compute dtype, the norms and embeddings stay fp32): without autocast (the hand-written loop's ``bf16``, the
    Trainer's ``bf16`` with ``autocast: false``) SDPA takes fp32 inputs, and over heads without GQA CUDA runs the
    memory-efficient kernel (``hf_trainer.hf_kernel``: ``efficient``), followed where :func:`_efficient_cuda_ok`."""
    from memplan.costmodel.timeline.hf_trainer import hf_kernel

    return hf_kernel(model, plan, "cuda", runtime) != "efficient" or _efficient_cuda_ok(gpu_arch)


def _optimizer_ok(plan: Plan, runtime: str) -> bool:
    """An optimizer other than the default fused AdamW as the Trainer builds it (``hf_optimizers.py``: SGD,
    transformers' Adafactor; ``hf_bnb_optim.py``: bitsandbytes' 8-bit, 32-bit and paged AdamW and Lion), on
    one rank or each rank under DDP (the states per rank as on one, beside the reducer's buckets), under FSDP2
    SGD alone (no state; the others cannot step DTensor parameters: ``specs.job.check_fsdp_optimizer``
    refuses them), full fine-tuning or PEFT over dense, MoE and MLA families (Adafactor's factored states of
    3-D experts per expert: ``hf_optimizers.Param.lead``; PEFT's ``ParamWrapper`` adapters of the experts are
    2-D); tests/unit/test_timeline_hf_optimizers.py, test_timeline_hf_optimizers_dist.py and
    test_timeline_hf_optimizers_peft_moe.py. The hand-written loop builds its own ``AdamW(foreach=True)``."""
    return runtime == "hf" and not (plan.dp > 1 and plan.zero >= 2 and plan.optimizer != "sgd")


def _optimizer_reason(plan: Plan, runtime: str) -> str:
    """Why the op-level run does not follow ``plan.optimizer``."""
    if runtime != "hf":
        return f"optimizer {plan.optimizer} under the hf-loop runtime (its loop builds AdamW(foreach=True))"
    return f"optimizer {plan.optimizer} under the Trainer's FSDP2 (DTensor parameters)"


def _dense_lora_ok(model: ModelSpec, plan: Plan) -> bool:
    """PEFT LoRA over a dense family as tests/unit/test_timeline_hf_peft.py (Llama, Mistral, Qwen2) and
    test_timeline_hf_peft_families.py (Qwen3, Phi-3, OLMo 2, Gemma 2 and 3) check it against the real Trainer:
    adapters on linears the family's decoder layer has (``lora.layer_linears``: Phi-3's fused ``qkv_proj`` and
    ``gate_up_proj``, where a plan's q_proj or gate_proj matches nothing, as in PEFT)."""
    if model.architecture not in DENSE_FAMILIES:
        return False
    names = {*layer_linears(model), ALL_LINEAR}
    return bool(model_targets(model, plan.lora_targets)) and set(plan.lora_targets) <= names


# PEFT's DoRA (hf_dora.py) as tests/unit/test_timeline_hf_dora.py checks it against the real Trainer and loop; over
# the MoE and MLA families on their nn.Linear adapters (tests/unit/test_timeline_hf_dora_moe.py)
DORA_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + MLA_FAMILIES
# PEFT 0.21.2 on a 3-D expert or router parameter (lora.ParamWrapper.__init__) and on an LLM.int8 base over CPU
DORA_PARAM_WRAPPER = "lora.ParamWrapper does not work with use_dora=True"
DORA_INT8 = (
    "an LLM.int8 base (PEFT 0.21.2's own run fails on CPU: DoRA's dequantize_module_weight re-wraps the weight "
    "with module.weight.to('cpu'), a new Int8Params without its SCB, and the layer's next forward reads None in "
    "bitsandbytes' MatMul8bitFp; on CUDA not checked)"
)


def _dora_reason(model: ModelSpec, plan: Plan, runtime: str = "hf") -> str | None:
    """What of a DoRA plan (``lora_dora``) the run does not follow, or None: it follows PEFT's DoRA adapters over a
    16-bit or 4-bit base of the dense families, on one rank, under DDP or under the Trainer's FSDP2 (the magnitudes
    sharded and gathered with their layer's adapters, ``hf_fsdp.peft_shapes``), under the Trainer's optimizers, with
    or without either of torch's checkpoints (``hf_dora.py``; tests/unit/test_timeline_hf_dora.py,
    test_timeline_hf_dora_fsdp.py), and on one rank of the dense families with activation offload (TRL's
    ``OffloadActivations`` under the Trainer, ``save_on_cpu`` around the hand loop: ``lora_weight``'s dead graph's
    saves packed as any save, ``hf_dora.DeadSaves``; tests/unit/test_timeline_hf_dora_offload.py); over Mixtral,
    Qwen3-MoE, Qwen2-MoE, DeepSeek-V2 or V3 wherever the LoRA run follows the plan (a 4-bit base where
    :func:`_quant_moe_ok` takes it), on the ``nn.Linear`` adapters PEFT gives DoRA (the frozen experts as under
    LoRA; tests/unit/test_timeline_hf_dora_moe.py). PEFT itself raises on DoRA where it wraps parameters (Mixtral's
    and Qwen3-MoE's experts and routers; ``specs.job._param_wrapper_refused`` says so first). The phase model has no
    DoRA: what is named here is refused, never answered as plain LoRA (``costmodel.reserve.run_only``).
    """
    why = None
    inside = plan.recompute == "full" and not checkpoint_reentrant(plan, runtime)  # the checkpoint's hooks innermost
    if model.architecture not in DORA_FAMILIES:
        why = f"the {model.architecture} family (followed over {', '.join(DORA_FAMILIES)})"
    elif plan.quant == "int8":
        why = DORA_INT8
    elif model.architecture in ("mixtral", "qwen3-moe") and set(plan.lora_targets) - set(ATTENTION):
        why = f"the experts and routers PEFT wraps in its ParamWrapper (PEFT 0.21.2 raises: {DORA_PARAM_WRAPPER})"
    elif plan.offload_activations != "none" and (plan.dp > 1 or model.architecture not in DENSE_FAMILIES):
        why = (
            "activation offload over more than one rank or an MoE / MLA family (followed on one rank of the dense "
            "families: TRL's OffloadActivations under the Trainer, save_on_cpu around the hand loop)"
        )
    elif runtime == "hf" and plan.offload_activations != "none" and trainer_autocast(plan, runtime) and not inside:
        if plan.precision == "bf16" or plan.quant != "none":  # over an fp32 base (bf16-mixed) followed
            why = (
                "TRL's activation offload under the Trainer's autocast over a bf16 or quantized base outside a "
                "non-reentrant checkpoint (TRL's own figure 640 B under the run with up_proj and down_proj over a bf16 "
                "base, no address reused, the emulation equal; not found; with gradient checkpointing followed)"
            )
    return None if why is None else f"PEFT's DoRA over {why}"


_QUANT_MOE = (
    "a quantized MoE base other than on CPU (the op-level run follows it there, on one rank, under DDP and, over a "
    "4-bit base, under FSDP2, TRL's offload under the Trainer and save_on_cpu around the hand-written loop too; "
    "--device cpu)"
)


def _quant_moe_ok(model: ModelSpec, cpu: bool) -> bool:
    """A 4-bit or LLM.int8 base of Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V2 or V3 as
    tests/unit/test_timeline_hf_quant_moe.py checks it against the real Trainer and hand-written loop on CPU:
    bitsandbytes replaces the ``nn.Linear`` alone (the attention's, MLA's, the shared experts' and Qwen2-MoE's
    shared-expert gate, the dense layers' MLP: ``hf_bnb.Bnb4bit.quantized``), the router and the 3-D experts stay
    float (fp32 after ``prepare_model_for_kbit_training``); on one rank, or over more as
    tests/unit/test_timeline_hf_quant_moe_ranks.py checks them against the real Trainer: DDP over every one of
    these families (``hf_ddp.py`` as over a dense base: the fp32 experts and router frozen, outside the
    buckets, broadcast with the packed weights at construction), FSDP2 where :func:`_fsdp_ok` takes the plan
    (a 4-bit base of any of them: the packed weights sharded in their storage dtype beside the fp32 experts,
    sharded on the expert axis, ``hf_fsdp_qlora.py`` over ``hf_fsdp_moe.py``; Qwen2-MoE's q/k/v biases recast
    once, ``hf_fsdp_qlora.HfFsdpQlora.recast_biases``; DeepSeek's tests/unit/test_timeline_hf_fsdp_mla.py); under
    the Trainer with TRL's activation offload too (``hf_offload.py`` over the same runs;
    tests/unit/test_timeline_hf_quant_moe_ranks.py, on one rank, DDP and FSDP2); under the hand-written loop with
    ``save_on_cpu`` around its forward and backward (``act_offload.py`` over the same run: every save packed, the
    fp32 experts' ``grouped_mm`` saves too, and under PEFT's reentrant checkpoint the re-runs' saves in the
    backward; tests/unit/test_timeline_hf_quant_moe.py). Not followed: CUDA (fp32 experts under ``grouped_mm``
    there: not checked)."""
    return cpu and model.architecture in MOE_FAMILIES + MLA_FAMILIES


def _moe_ok(model: ModelSpec) -> bool:
    """No experts, or the sparse block ``hf_moe.py`` follows as transformers builds it for the family: a
    router without biases, gate and up in one 3-D parameter as transformers 5 stores them, the top-k
    routed experts alone (Mixtral, Qwen3-MoE) or beside one shared expert under its sigmoid gate
    (Qwen2-MoE); dense layers (``mlp_only_layers``, ``decoder_sparse_step``) in the Qwen families, whose
    decoder layer reads them, not in Mixtral's, which has none."""
    moe, arch = model.moe, model.architecture
    if moe is None:
        return True
    if arch in MLA_FAMILIES:  # DeepseekV{2,3}MoE: one ungated shared MLP, V3's score bias, dense layers first
        first = tuple(range(len(moe.dense_layers)))
        plain = not (moe.router_bias or moe.fused_gate_up or moe.shared_expert_gate)
        bias = moe.router_score_bias == (arch == "deepseek-v3")
        return plain and bias and moe.num_shared_experts == 1 and moe.dense_layers == first
    if moe.router_bias or moe.router_score_bias or moe.fused_gate_up or arch not in MOE_FAMILIES:
        return False
    shared = (moe.num_shared_experts, moe.shared_expert_gate) == ((1, True) if arch == "qwen2-moe" else (0, False))
    return shared and (arch != "mixtral" or (moe.layer_freq == 1 and not moe.dense_layers))


# DeepSeek-V3's q/k and v heads differ in width (192, 128): CUDA's flash kernel needs one head dim, so SDPA runs the
# memory-efficient kernel (mem_efficient.py, mem_efficient_half.py: from source, no GPU trace)
_MLA_CUDA = (
    "MLA attention on CUDA outside compute capability 8.0 and 9.0 (the memory-efficient backward kernel's blocks "
    "by the GPU's shared memory; the op-level run follows it on CPU, --device cpu)"
)
MLA_CAPABILITIES = ((8, 0), (9, 0))  # A100; H100, H200: the 128-row backward kernels' shared memory fits (xformers)


def mla_cuda_ok(model: ModelSpec, plan: Plan, gpu_arch: CudaArch | None) -> bool:
    """MLA's SDPA on CUDA as ``hf_mla.HfDeepseekV3.mla_sdpa`` follows it: the memory-efficient kernel
    (``attention.sdpa_backend`` over (qk, v) head dims, causal, training, torch 2.11: flash needs one head dim,
    cuDNN is offered no unequal pair) in bf16 (bf16 weights, or ``bf16=True``'s autocast) or fp32, on compute
    capability 8.0 or 9.0 (an unknown GPU: 9.0), at any head dims (``mem_efficient_half.py``)."""
    mla = model.mla
    qk, vd, heads = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim, model.num_attention_heads
    half = plan.precision != "fp32"
    cap = (9, 0) if gpu_arch is None else (gpu_arch.major, gpu_arch.minor)
    dtype = "bf16" if half else "fp32"
    kernel = sdpa_backend("cuda", dtype, qk, heads, heads, enable_gqa=False, v_head_dim=vd, capability=cap)
    return kernel == "efficient" and cap in MLA_CAPABILITIES


_MLA_PLAN = (
    "MLA other than full fine-tuning or LoRA on the attention linears (q_a_proj, q_b_proj or q_proj, "
    "kv_a_proj_with_mqa, kv_b_proj, o_proj) of DeepSeek-V2 or V3 without attention biases"
)


def _mla_ok(model: ModelSpec, plan: Plan) -> bool:
    """DeepSeek-V3 and V2 as tests/unit/test_timeline_hf_mla*.py check them against the real Trainer: full fine-tuning
    or PEFT LoRA on linears MLA has (no ``modules_to_save``), on one rank (fp32, bf16 with or without
    ``bf16=True``, ``bf16=True`` over fp32), under the Trainer's FSDP2 (``full_shard`` or ``shard_grad_op``,
    full fine-tuning, LoRA or QLoRA: each decoder layer one group, dense or MoE, the experts sharded on the
    expert axis as Mixtral's, ``hf_fsdp_moe.py``; tests/unit/test_timeline_hf_fsdp_mla.py) or its DDP (``hf_ddp.py``
    as over any base, float or quantized: test_timeline_hf_fsdp_mla.py, test_timeline_hf_quant_moe_ranks.py; a bf16
    V3 the harness builds by ``.to(bfloat16)`` has its router score bias bf16, 2 B an expert a sparse layer under
    the run, which keeps it fp32 as ``from_pretrained`` does), no attention biases (``attention_bias``: q_a_proj's
    and kv_a_proj_with_mqa's, not followed)."""
    return not model.mla.down_proj_bias and (plan.finetune == "full" or _mla_lora_ok(model, plan))


def mla_linears(model: ModelSpec) -> tuple[str, ...]:
    """The attention linears ``DeepseekV3Attention`` (and V2's) builds (``q_proj`` in place of q_a / q_b without
    ``q_lora_rank``), by transformers' names."""
    queries = ("q_proj",) if model.mla.q_lora_rank is None else MLA_ATTENTION[:2]
    return (*queries, *MLA_ATTENTION[2:], "o_proj")


def _mla_lora_ok(model: ModelSpec, plan: Plan) -> bool:
    """LoRA (or QLoRA) over DeepSeek-V3 / V2 as checked: adapters on the attention linears it has, nothing trained
    in full."""
    targets = set(plan.lora_targets)
    lora = plan.finetune in ("lora", "qlora")  # QLoRA on CPU alone (_quant_moe_ok)
    return lora and bool(targets) and targets <= set(mla_linears(model)) and not plan.modules_to_save


# The targets whose adapters the run follows on each MoE family. On Qwen2-MoE (no v4-to-v5 conversion in
# transformers 5.23: PEFT takes target_modules as given) gate/up/down_proj name the shared expert's and the dense
# layers' nn.Linear and all-linear adds shared_expert_gate, never the router (Qwen2MoeTopKRouter) or the 3-D
# experts. On Qwen3-MoE, PEFT's conversion (utils/transformers_weight_conversion.py: _convert_peft_config_moe)
# moves the MLP names to target_parameters on the experts (lora.ParamWrapper: hf_moe_lora.py), gate and up
# together (fused in gate_up_proj); on Mixtral and Qwen3-MoE all-linear wraps the experts and the router's
# weight. Mixtral's MLP names match no module (specs.job.check_moe_lora says so).
MOE_LORA_TARGETS = {
    "mixtral": (*ATTENTION, ALL_LINEAR),
    "qwen3-moe": (*LINEARS, ALL_LINEAR),
    "qwen2-moe": (*LINEARS, ALL_LINEAR),
}
_MOE_LORA = (
    " other than LoRA on attention linears (q/k/v/o_proj) or all-linear, on Qwen3-MoE's experts (gate_proj with "
    "up_proj, down_proj) or on any of Qwen2-MoE's linears, without dropout where PEFT wraps parameters"
)


def _moe_lora_ok(model: ModelSpec, plan: Plan) -> bool:
    """PEFT LoRA over a MoE model as tests/unit/test_timeline_hf_moe.py checks it against the real Trainer:
    adapters on the attention linears (the frozen experts' ``grouped_mm`` keeping no input,
    ``hf_moe_ops.grouped_mm``), on Qwen3-MoE's experts (``hf_moe_lora.py``), on Qwen2-MoE on any of its
    ``nn.Linear`` (``MOE_LORA_TARGETS``), with or
    without ``modules_to_save``, on one rank or over DDP (``test_lora_under_ddp_equals_rank_0s_peak``: rank 0
    of two gloo ranks), or under the Trainer's FSDP2 (tests/unit/test_timeline_hf_fsdp_moe.py)."""
    return (
        model.architecture in MOE_FAMILIES
        and plan.finetune in ("lora", "qlora")
        and bool(plan.lora_targets)
        and set(plan.lora_targets) <= set(MOE_LORA_TARGETS[model.architecture])
        and _param_wrapper_ok(model, plan)
    )


def _param_wrapper_ok(model: ModelSpec, plan: Plan) -> bool:
    """PEFT's ``ParamWrapper`` over Mixtral's and Qwen3-MoE's experts and routers as it builds it: gate_proj and
    up_proj together (PEFT raises on one: they are fused in ``gate_up_proj``), no dropout
    (``ParamWrapper.update_layer`` raises)."""
    targets = set(plan.lora_targets)
    if model.architecture not in ("mixtral", "qwen3-moe") or not targets - set(ATTENTION):
        return True
    return len(targets & {"gate_proj", "up_proj"}) != 1 and plan.lora_dropout == 0


def _fsdp_ok(model: ModelSpec, plan: Plan, runtime: str) -> bool:
    """The Trainer's FSDP2 as ``hf_fsdp.py`` follows it, over every family of :data:`FAMILIES` (the dense ones,
    tests/unit/test_timeline_hf_fsdp.py; the MoE ones, test_timeline_hf_fsdp_moe.py; DeepSeek-V2 / V3,
    test_timeline_hf_fsdp_mla.py): full fine-tuning of a dense base or of Mixtral, Qwen3-MoE, Qwen2-MoE or
    DeepSeek (``hf_fsdp_moe.py``: each decoder layer one group, its experts sharded on the expert axis) loaded
    onto the rank's GPU (``from_pretrained`` with a device_map) or on the CPU
    (``to_device``: sharded through ``cpu_ram_efficient_loading``, ``hf_fsdp_load.py``), in fp32, a bf16
    model without ``bf16=True`` (``MixedPrecisionPolicy()``), or under ``bf16=True`` (accelerate's bf16
    policy over fp32 master shards); PEFT LoRA (:func:`_fsdp_lora_ok`; over an MoE base PEFT's
    ``ParamWrapper`` adapters of the experts and the router too, sharded on their own dim 0)."""
    return (
        runtime == "hf"
        and (plan.finetune == "full" or _fsdp_lora_ok(model, plan))
        and (plan.quant == "none" or _fsdp_qlora_ok(model, plan))
    )


_CPU_LOAD_BUFFER = (
    "DeepSeek-V3 under the Trainer's FSDP loaded on the CPU (model_build to_device: cpu_ram_efficient_loading), "
    "which the Trainer cannot run: accelerate's fsdp2_load_full_state_dict reads .device_mesh off each state-dict "
    "entry, and the routers' e_score_correction_bias is a plain buffer (AttributeError); --model-build "
    "from_pretrained runs"
)


def _cpu_load_buffer(model: ModelSpec, plan: Plan) -> bool:
    """A persistent floating buffer (DeepSeek-V3's routers' ``e_score_correction_bias``) under FSDP2 with
    ``cpu_ram_efficient_loading`` (``model_build: to_device``, never over a 4-bit base: ``specs.plan``; an int8 one
    is refused under FSDP2): accelerate 1.15's ``fsdp2_load_full_state_dict``
    (accelerate/utils/fsdp_utils.py:620-630) takes every entry of the sharded ``model.state_dict()`` for a DTensor
    (``sharded_param.device_mesh``), and a buffer ``fully_shard`` leaves a plain tensor: the real Trainer raises
    ``AttributeError`` in ``accelerator.prepare`` (tests/unit/test_timeline_hf_fsdp_mla.py)."""
    fsdp = plan.dp > 1 and plan.zero >= 2 and plan.model_build == "to_device"
    return fsdp and model.moe is not None and model.moe.router_score_bias


def _fsdp_qlora_ok(model: ModelSpec, plan: Plan) -> bool:
    """QLoRA under the Trainer's FSDP2 as checked (``hf_fsdp_qlora.py``): a 4-bit base (nf4 / fp4, with or
    without double quantization) stored as the model's float dtype (``bnb_4bit_quant_storage``, the recipe
    the exporters write), its packed weights sharded; Qwen2's and Qwen2-MoE's q/k/v biases recast once by
    ``Linear4bit.forward`` (``hf_fsdp_qlora.HfFsdpQlora.recast_biases``)."""
    return plan.finetune == "qlora" and plan.quant in ("nf4", "fp4")


def _fsdp_lora_ok(model: ModelSpec, plan: Plan) -> bool:
    """PEFT LoRA under the Trainer's FSDP2 as checked (``hf_fsdp_peft.py``): fp32 adapters over an fp32
    or bf16 base, with or without ``bf16=True`` (the policy gathers the adapters in bf16 and PEFT runs
    them so), ``modules_to_save`` none, an untied ``lm_head`` (the tail group holds the original and
    the copy) or ``embed_tokens`` (the embedding's group likewise), or both. A tied head the Trainer
    cannot shard: ``fully_shard`` refuses the original, shared with the embedding (torch 2.13: "is shared
    with a parameter already managed by another FSDP group")."""
    saved = set(plan.modules_to_save)
    lora = plan.finetune in ("lora", "qlora") and plan.precision in ("fp32", "bf16", "bf16-mixed")
    return lora and saved <= {"lm_head", "embed_tokens"} and not (saved and model.tied_embeddings)


def _fsdp_reason(model: ModelSpec, plan: Plan) -> str:
    """Why the Trainer's FSDP2 run does not follow the plan."""
    if plan.finetune != "full" and "lm_head" in plan.modules_to_save and model.tied_embeddings:
        return (
            "modules_to_save lm_head over tied embeddings under the Trainer's FSDP "
            "(fully_shard refuses the shared weight)"
        )
    if plan.quant == "int8":
        return "an LLM.int8 base under the Trainer's FSDP (it cannot run it: specs.job.check_fsdp_int8 refuses it)"
    return "PEFT under the Trainer's FSDP other than LoRA or QLoRA (modules_to_save lm_head, embed_tokens or none)"


def accumulation(workload: TrainingWorkload, plan: Plan) -> int:
    """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
    total = workload.global_batch or workload.micro_batch * plan.dp
    return max(1, total // (workload.micro_batch * plan.dp))


def _precision_reason(precision: str) -> str:
    """Why the Trainer's run does not follow ``precision``, and the precisions it runs: the plain
    Trainer keeps no fp32 master copy (``bf16-master``, memplan's default, is DeepSpeed's bf16)."""
    runs = "--precision bf16 (bf16 weights under bf16=True), bf16-mixed (bf16=True over fp32 weights) or fp32"
    if precision in ("bf16-master", "fp16-master"):
        return f"precision {precision} (fp32 master weights: DeepSpeed's, not the plain Trainer's; {runs})"
    return f"precision {precision} (the Trainer's run follows {runs})"


def _kernel_known(model: ModelSpec, plan: Plan, tokens: int, gpu_arch: CudaArch | None) -> bool:
    """Which kernel CUDA's ``gemm_4bit`` runs for every decoder linear of a 4-bit base at ``tokens``
    rows is known (``costmodel.quant.gemm_4bit_kernel``): on a known GPU always; without one where
    every GPU takes the same path (over 1536 rows; over 512 for weights of 4 Mi elements or more; at
    most 4 the fused kernel). ``hf_bnb`` follows both paths."""
    compute = 4 if plan.precision == "fp32" else 2
    shapes = {(n, k) for k, n in layer_linears(model).values()}  # Phi-3's fused qkv_proj and gate_up_proj too
    return all(gemm_4bit_kernel(tokens, n, k, compute, gpu_arch) is not None for n, k in shapes)
