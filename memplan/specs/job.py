"""A plan file (what ``memplan tune`` writes and ``estimate`` reads) and the checks that tie a
plan to a model and a workload (divisibility, offload rules, world size)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from memplan.errors import MemplanError
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

RuntimeName = Literal["memplan", "hf", "hf-loop", "megatron"]
AllocatorName = Literal["default", "expandable"]


class PlanFile(BaseModel):
    """A plan YAML: every section optional; command-line flags override it field by field."""

    # defer_build: validators built when a plan file is first read, not on every estimate's import
    model_config = ConfigDict(extra="forbid", defer_build=True)

    model: str | None = Field(None, description="Model profile name or path (informational for estimate).")
    gpu: str | None = Field(None, description="GPU profile name or path.")
    gpus: StrictInt | None = Field(None, gt=0, le=10_000_000, description="Total GPUs.")
    nodes: StrictInt | None = Field(None, gt=0, le=1_000_000)
    runtime: RuntimeName | None = None
    allocator: AllocatorName | None = Field(
        None, description="PyTorch's CUDA caching allocator mode: default or expandable (expandable_segments:True)."
    )
    workload: dict | None = Field(
        None, description="Training or inference workload fields (kind: training | inference)."
    )
    plan: dict | None = Field(None, description="Plan fields (see memplan.specs.plan.Plan).")


def check_compatible(
    model: ModelSpec, workload: TrainingWorkload | InferenceWorkload, plan: Plan, runtime: str = "memplan"
) -> None:
    """Raise MemplanError (field = the plan or workload field at fault) when the plan cannot
    run this model: TP must divide attention and KV heads, PP x virtual stages the layers,
    CP the sequence, EP the experts, and the global batch must split into micro-batches;
    LoRA / QLoRA as :func:`check_lora` allows it under ``runtime`` (the training code)."""
    if model.num_attention_heads % plan.tp:
        raise MemplanError(
            f"tp={plan.tp} does not divide num_attention_heads={model.num_attention_heads} of {model.name}",
            field="plan.tp",
        )
    training = isinstance(workload, TrainingWorkload)
    if model.kv_heads % plan.tp and (training or plan.tp % model.kv_heads):
        # training: Megatron-LM splits the KV heads (num_query_groups) over TP ranks and requires
        # tp to divide them; serving (vLLM) replicates them when tp is a multiple
        how = "training splits the KV heads over TP ranks (as Megatron-LM requires)" if training else ""
        raise MemplanError(
            f"tp={plan.tp} does not divide num_kv_heads={model.kv_heads} of {model.name}" + (f": {how}" if how else ""),
            field="plan.tp",
        )
    if plan.sequence_parallel and plan.tp == 1 and training:
        raise MemplanError(
            "sequence parallelism shards activations over tensor-parallel ranks: needs tp > 1",
            field="plan.sequence_parallel",
        )
    per_stage = model.num_layers // plan.pp
    if plan.recompute_layers is not None and plan.recompute_layers > per_stage:
        raise MemplanError(
            f"recompute_layers={plan.recompute_layers} is more than the {per_stage} layers of a pipeline stage "
            f"({model.name}: {model.num_layers} layers, pp={plan.pp})",
            field="plan.recompute_layers",
        )
    if model.num_layers % plan.stages:
        what = "pp x virtual_stages" if plan.virtual_stages > 1 else "pp"
        raise MemplanError(
            f"{what}={plan.stages} does not divide num_layers={model.num_layers} of {model.name}", field="plan.pp"
        )
    if plan.ep > 1:
        if model.moe is None:
            raise MemplanError(f"ep={plan.ep} but {model.name} has no experts", field="plan.ep")
        if model.moe.num_experts % plan.ep:
            raise MemplanError(f"ep={plan.ep} does not divide num_experts={model.moe.num_experts}", field="plan.ep")
    if plan.finetune != "full":
        check_lora(model, plan, runtime, workload if isinstance(workload, TrainingWorkload) else None)
    if isinstance(workload, TrainingWorkload):
        check_fsdp_optimizer(plan, runtime)
        check_fsdp_int8(plan, runtime)
        if workload.seq_len % plan.cp:
            raise MemplanError(f"cp={plan.cp} does not divide seq_len={workload.seq_len}", field="plan.cp")
        if plan.sequence_parallel and workload.seq_len // plan.cp % plan.tp:
            raise MemplanError(
                f"sequence parallel needs seq_len/cp divisible by tp={plan.tp}", field="plan.sequence_parallel"
            )
        if workload.global_batch is not None and workload.global_batch % (workload.micro_batch * plan.dp):
            raise MemplanError(
                f"global_batch={workload.global_batch} is not divisible by micro_batch x dp = "
                f"{workload.micro_batch} x {plan.dp}",
                field="workload.global_batch",
            )
        if plan.pp_schedule == "interleaved":  # an unset global batch is one micro-batch per step
            accumulation = (workload.global_batch or workload.micro_batch * plan.dp) // (workload.micro_batch * plan.dp)
            if accumulation % plan.pp:
                raise MemplanError(
                    f"the interleaved schedule needs micro-batches per step ({accumulation}) divisible by pp={plan.pp}",
                    field="workload.global_batch",
                )


def check_fsdp_int8(plan: Plan, runtime: str) -> None:
    """Refuse an LLM.int8 base under the Trainer's FSDP2 (``--runtime hf``, ``--zero 2|3`` over dp > 1 ranks,
    ``--quant int8``). Seen with the real Trainer on CPU, rank 0 under the fake process group (transformers 5.23,
    accelerate 1.15, bitsandbytes 0.50.2; tests/unit/test_timeline_hf_fsdp_int8.py): ``fully_shard`` replaces
    each ``Int8Params`` by a DTensor shard and gathers it back as a plain ``nn.Parameter``
    (``FSDPParam.init_unsharded_param``), which has none of the int8 weight's ``CB`` / ``SCB``, so the first
    forward's ``Linear8bitLt.forward`` raises "AttributeError: 'Parameter' object has no attribute 'CB'" (on CUDA
    too: the same module code reads ``self.weight.CB`` before any kernel). A 4-bit base shards
    (``bnb_4bit_quant_storage``, ``hf_fsdp_qlora.py``); DeepSpeed's ZeRO (a master-weight precision) is not this
    path."""
    if runtime != "hf" or plan.dp == 1 or plan.zero < 2 or plan.quant != "int8":
        return
    if plan.precision not in FSDP2_PRECISIONS:
        return
    raise MemplanError(
        f"an 8-bit (LLM.int8) base cannot run under the Trainer's FSDP2 (zero={plan.zero} over dp={plan.dp}): "
        "fully_shard gathers its Int8Params back as plain Parameters without their CB/SCB, so Linear8bitLt's first "
        "forward raises; use --zero 0 (DDP) or a 4-bit base (--quant nf4)",
        field="plan.quant",
    )


# the Trainer's optimizers that step FSDP2's DTensor parameters: fused AdamW, and SGD (no state, in-place adds)
FSDP2_OPTIMIZERS = ("adamw", "sgd")
# the precisions the Trainer runs under its FSDP2 (the rest, fp32 masters in the optimizer, are DeepSpeed's)
FSDP2_PRECISIONS = ("fp32", "bf16", "bf16-mixed")


def check_fsdp_optimizer(plan: Plan, runtime: str) -> None:
    """Refuse an optimizer that cannot step the Trainer's FSDP2 (``--runtime hf``, ``--zero 2|3`` over dp > 1
    ranks), where accelerate hands the optimizer DTensor parameters (``_prepare_fsdp2``). Read from the
    installed code and seen with the real Trainer on CPU, rank 0 under the fake process group
    (tests/unit/test_timeline_hf_optimizers_dist.py):
    transformers 5.23's ``Adafactor.step`` makes its states with ``torch.zeros(grad_shape[:-1]).to(grad)``,
    plain tensors of the full shape, and its first ``exp_avg_sq_row.mul_(...).add_(...)`` over a DTensor
    update raises "got mixed torch.Tensor and DTensor"; bitsandbytes 0.50.2's 32-bit update is a custom op
    (``bitsandbytes.optimizer_update_32bit``) with no DTensor sharding strategy ("does not have a sharding
    strategy registered"): an 8-bit optimizer's first parameter, the embedding, takes it too (32-bit states by the
    Trainer's override), and its 8-bit update mixes the plain quantization maps with DTensor states
    (``bitsandbytes.dequantize_blockwise``: "got mixed torch.Tensor and DTensor"). A plan in a master-weight
    precision (``bf16-master``, ``fp16-master``) is DeepSpeed's ZeRO under the Trainer, not FSDP2: DeepSpeed hands
    the client optimizer its flat fp32 partitions, plain tensors, which these optimizers step (the exporters write
    such plans as DeepSpeed configs)."""
    if runtime != "hf" or plan.dp == 1 or plan.zero < 2 or plan.optimizer in FSDP2_OPTIMIZERS:
        return
    if plan.precision not in FSDP2_PRECISIONS:
        return
    what = (
        "transformers' Adafactor makes its factored states as plain tensors beside DTensor gradients"
        if plan.optimizer == "adafactor"
        else "bitsandbytes' optimizer kernels are custom ops with no DTensor sharding strategy"
    )
    raise MemplanError(
        f"optimizer {plan.optimizer} cannot step the Trainer's FSDP2 (zero={plan.zero} over dp={plan.dp}): {what}, "
        "so the Trainer raises at its first optimizer step; use --zero 0 (DDP), adamw or sgd",
        field="plan.optimizer",
    )


def suspicious(model: ModelSpec, workload: TrainingWorkload | InferenceWorkload) -> list[str]:
    """Legal but suspicious inputs, one warning line each: a sequence beyond the model's positions
    (context extension trains or serves beyond them on purpose, so it is a warning, not an error)."""
    tokens = workload.seq_len if isinstance(workload, TrainingWorkload) else workload.context
    limit = model.max_position_embeddings
    if tokens > limit:
        what = "seq_len" if isinstance(workload, TrainingWorkload) else "the context (prompt + generated tokens)"
        return [
            f"{what} {tokens:,} is beyond max_position_embeddings {limit:,} of {model.name}: estimated as given "
            "(context extension, e.g. RoPE scaling, runs beyond it; the model itself was not trained there)"
        ]
    return []


def dora_time(plan: Plan, workload: TrainingWorkload | InferenceWorkload) -> list[str]:
    """A DoRA plan's step time, one warning line: the time model (``time_lora.adapter_bytes_per_token``) counts
    LoRA's adapter kernels, not DoRA's further ones (``timeline/hf_dora.py``: the identity through the adapters,
    ``W + scaling * B @ A`` and its row norms once per linear and forward, the magnitude's products over every
    token, their backward), so the time is a lower bound; the memory is the op-level run's, DoRA's own."""
    if not plan.lora_dora or not isinstance(workload, TrainingWorkload):
        return []
    return [
        "lora_dora: the step time counts LoRA's adapter kernels, not DoRA's further ones (B @ A and the row norms of "
        "W + scaling * B @ A each forward, the magnitude's products over every token): a lower bound; the memory "
        "is DoRA's own (the op-level run)"
    ]


def check_lora(
    model: ModelSpec, plan: Plan, runtime: str = "memplan", workload: TrainingWorkload | None = None
) -> None:
    """LoRA / QLoRA: the model must be one whose decoder layers memplan models under PEFT (a
    dense Llama-family layer: transformers' q/k/v/o_proj and gate/up/down_proj; under ``--runtime hf`` or ``hf-loop``
    Phi-3's fused qkv_proj / gate_up_proj, OLMo 2's, Gemma 2's and 3's layers as :func:`check_run_lora`
    allows them; or an MoE one as :func:`check_moe_lora` allows it under ``runtime``), and every target and
    module to save must name one of its modules (PEFT raises on a target that matches nothing)."""
    from memplan.costmodel import lora

    dense = (*lora.FAMILIES, *lora.RUN_FAMILIES)
    if model.moe is None and (model.architecture not in dense or model.mlp != "gated"):
        raise MemplanError(
            f"{plan.finetune} is modelled for dense Llama-family models ({', '.join(lora.FAMILIES)}: "
            f"q/k/v/o_proj, gate/up/down_proj), under --runtime hf or hf-loop for {', '.join(lora.RUN_FAMILIES)} and "
            f"Mixtral, Qwen3-MoE and Qwen2-MoE; {model.name} is a {model.architecture} ({model.mlp} MLP) model",
            field="plan.finetune",
        )
    # DeepSeek-V2 / V3 MLA linears in place of k_proj / v_proj (check_moe_lora narrows them to those the model builds)
    mla = model.architecture in ("deepseek-v2", "deepseek-v3")
    linears = ("q_proj", *lora.MLA_ATTENTION, "o_proj", *lora.MLP) if mla else lora.LINEARS
    if model.moe is None:  # the dense layer's own names (Phi-3's fused qkv_proj and gate_up_proj)
        linears = tuple(lora.layer_linears(model))
    valid = (*linears, lora.ALL_LINEAR)
    unknown = [name for name in plan.lora_targets if name not in valid]
    if unknown:
        raise MemplanError(
            f"{', '.join(unknown)} matches no linear layer of {model.name}; "
            f"valid: {', '.join(valid)} (the LM head is not a LoRA target: use modules_to_save: lm_head)",
            field="plan.lora_targets",
        )
    unknown = [name for name in plan.modules_to_save if name not in lora.SAVABLE]
    if unknown:
        raise MemplanError(
            f"{', '.join(unknown)} matches no module memplan trains in full; valid: {', '.join(lora.SAVABLE)}",
            field="plan.modules_to_save",
        )
    if model.moe is not None:
        check_moe_lora(model, plan, runtime, workload)
    elif model.architecture in lora.RUN_FAMILIES:
        check_run_lora(model, plan, runtime, workload)
    if plan.lora_dora:
        check_dora(model, plan, runtime, workload)


def check_dora(model: ModelSpec, plan: Plan, runtime: str, workload: TrainingWorkload | None) -> None:
    """PEFT DoRA (``lora_dora``): answered by the op-level run of transformers' Trainer or of the hand-written loop
    alone (``timeline.hf_dora``, checked to the byte against both on CPU: tests/unit/test_timeline_hf_dora.py). The
    phase model has no DoRA (its LoRA layer would answer plain LoRA: a wrong answer), and the bundled trainer and
    Megatron build no DoRA adapters: every other plan is refused here. Without ``workload`` only the runtime is
    checked; the questions that depend on the GPU are asked by the run (``reserve.plan_run``), which refuses the plan
    rather than fall back."""
    first = (
        "DoRA (lora_dora) is modelled under --runtime hf or hf-loop alone (PEFT's adapters under transformers' "
        "Trainer or a hand-written loop, op by op)"
    )
    _hf_runs_only(model, plan, runtime, workload, first, "DoRA", "plan.lora_dora")


def _hf_runs_only(
    model: ModelSpec, plan: Plan, runtime: str, workload: TrainingWorkload | None, first: str, what: str, field: str
) -> None:
    """Refuse, in one line naming ``field``, a plan only the op-level runs of transformers' loops answer: under
    another runtime (``first``, the runtime appended), or one ``hf_supported`` declines (``what`` over the model)."""
    from memplan.costmodel.timeline.hf_support import hf_supported

    if runtime not in ("hf", "hf-loop"):
        raise MemplanError(f"{first}; the runtime is {runtime}", field=field)
    why = None if workload is None else hf_supported(model, plan, workload, runtime, device="cpu")
    if why is not None:
        runs = "transformers' Trainer" if runtime == "hf" else "the hand-written transformers loop"
        raise MemplanError(
            f"{what} over {model.name} ({model.architecture}) is modelled by the op-level run of {runs} alone, "
            f"which does not follow {why}",
            field=field,
        )


def check_run_lora(model: ModelSpec, plan: Plan, runtime: str, workload: TrainingWorkload | None) -> None:
    """PEFT LoRA over Phi-3, OLMo 2, Gemma 2 or Gemma 3: answered by the op-level run of transformers' Trainer or of
    the hand-written loop alone (``timeline.hf_lora`` over ``timeline.hf_families``, under ``hf_trainer.py``'s or
    ``hf_loop.py``'s step, checked to the byte against the real Trainer and loop on CPU:
    tests/unit/test_timeline_hf_peft_families.py, test_timeline_hf_loop_peft_families.py). The phase model's LoRA
    layer (``lora.hf_layer``) is Llama's (no sandwich or post norms, no fused projections, no eager attention), and
    the bundled trainer and Megatron build no such adapters: every other plan is refused here. Without ``workload``
    only the runtime is checked; the questions that depend on the GPU are asked by the run (``reserve.plan_run``),
    which refuses the plan rather than fall back."""
    first = (
        f"{plan.finetune} over {model.name} ({model.architecture}) is modelled under --runtime hf or hf-loop alone "
        "(transformers' Trainer or a hand-written loop, op by op)"
    )
    _hf_runs_only(model, plan, runtime, workload, first, plan.finetune, "plan.finetune")


def check_moe_lora(model: ModelSpec, plan: Plan, runtime: str, workload: TrainingWorkload | None) -> None:
    """PEFT LoRA over an MoE model: answered by the op-level run of transformers' Trainer or of the hand-written loop
    alone (``timeline.hf_moe``, checked to the byte against the real Trainer and loop on CPU:
    tests/unit/test_timeline_hf_moe.py, test_timeline_hf_loop_families.py), with adapters on the attention linears
    of Mixtral, Qwen3-MoE or Qwen2-MoE, or on any linear of Qwen2-MoE, on one rank or over DDP
    (``hf_support._moe_lora_ok``; the targets PEFT 0.21 wraps otherwise: :func:`_moe_targets_refused`). The phase
    model's LoRA layer (``lora.hf_layer``) counts a dense MLP of ``ffn_size`` where the experts are, and the bundled
    trainer and Megatron build no MoE adapters: every other plan is refused here, before either model runs. Without
    ``workload`` only the adapters are checked (family, runtime, targets). The questions that depend on the GPU (its
    compute capability) are asked by the run (``reserve.plan_run``), which refuses the plan rather than fall back to
    the phase model."""
    from memplan.costmodel.timeline.hf_support import MLA_FAMILIES, MOE_FAMILIES, hf_supported, mla_linears

    name, families = f"{model.name} ({model.architecture})", MOE_FAMILIES + MLA_FAMILIES
    if model.architecture not in families:
        raise MemplanError(
            f"{plan.finetune} over an MoE model is modelled for {', '.join(families)} under --runtime hf; "
            f"{name} is another MoE family",
            field="plan.finetune",
        )
    if runtime not in ("hf", "hf-loop"):  # the hand-written loop's run composes the same modules (hf_loop.py)
        raise MemplanError(
            f"{plan.finetune} over an MoE model is modelled under --runtime hf or hf-loop alone (transformers' "
            f"Trainer or a hand-written loop, op by op); {name} is an MoE model and the runtime is {runtime}",
            field="plan.finetune",
        )
    if model.architecture in MLA_FAMILIES:  # DeepSeek-V2 / V3 MLA linears alone (hf_support._mla_lora_ok)
        attention = mla_linears(model)
        outside = [target for target in plan.lora_targets if target not in attention]
        if outside:
            raise MemplanError(
                f"{', '.join(outside)} over the experts of {name} is not modelled: LoRA over an MoE model "
                f"is modelled on the attention linears alone ({', '.join(attention)})",
                field="plan.lora_targets",
            )
    else:
        _moe_targets_refused(model, plan, name)
    # said with the adapters: ``memplan tune``'s space (its plans on a GPU) would hold no plan. A quantized MoE base
    # is followed on CPU (one rank, DDP, FSDP2 over a 4-bit base: ``hf_support._quant_moe_ok``), asked below with
    # the workload
    if plan.finetune == "qlora" and workload is None:
        raise MemplanError(
            f"qlora over an MoE model is modelled by the op-level run of transformers' Trainer alone, which does "
            f"not follow a quantized MoE base in a search ({name}; memplan estimate --device cpu follows it)",
            field="plan.finetune",
        )
    if workload is None:  # the adapters alone (``memplan tune`` checks them before it builds plans)
        return
    why = hf_supported(model, plan, workload, runtime, device="cpu")
    if why is not None:
        raise MemplanError(
            f"{plan.finetune} over an MoE model is modelled by the op-level run of transformers' Trainer "
            f"alone, which does not follow {why}",
            field="plan.finetune",
        )


def _moe_targets_refused(model: ModelSpec, plan: Plan, name: str) -> None:
    """Targets the run does not follow: Mixtral's gate/up/down_proj, which match no module under PEFT 0.21.2
    and transformers 5.23 (``peft/utils/transformers_weight_conversion.py: _convert_peft_config_moe``, checked
    on tiny models: its v4 experts were w1/w2/w3), dropped beside another target and raised on alone. The
    targets PEFT wraps in ``lora.ParamWrapper`` (``all-linear`` on Mixtral and Qwen3-MoE, Qwen3-MoE's MLP names)
    are followed (``timeline/hf_moe_lora.py``) as PEFT builds them (:func:`_param_wrapper_refused`)."""
    from memplan.costmodel.lora import ATTENTION
    from memplan.costmodel.timeline.hf_support import MOE_LORA_TARGETS

    allowed = MOE_LORA_TARGETS[model.architecture]
    outside = [target for target in plan.lora_targets if target not in allowed]
    if not outside:
        _param_wrapper_refused(model, plan, name)
        return
    raise MemplanError(
        f"{', '.join(outside)} over the experts of {name}: PEFT 0.21 matches no module of Mixtral by these names "
        f"(its experts are 3-D parameters, w1/w2/w3 in transformers 4); LoRA over Mixtral is modelled on the "
        f"attention linears ({', '.join(ATTENTION)}) or all-linear (the experts and the router wrapped)",
        field="plan.lora_targets",
    )


def _param_wrapper_refused(model: ModelSpec, plan: Plan, name: str) -> None:
    """What PEFT 0.21.2 itself raises on where it wraps parameters (Mixtral's and Qwen3-MoE's experts and
    routers): gate_proj without up_proj or the reverse (``_convert_peft_config_moe``: fused in
    ``gate_up_proj``), dropout and DoRA (``ParamWrapper.__init__``)."""
    from memplan.costmodel.lora import ATTENTION
    from memplan.costmodel.timeline.hf_support import DORA_PARAM_WRAPPER

    mlp = set(plan.lora_targets) - set(ATTENTION)
    if model.architecture not in ("mixtral", "qwen3-moe") or not mlp:
        return
    if len(mlp & {"gate_proj", "up_proj"}) == 1:
        raise MemplanError(
            f"{', '.join(sorted(mlp & {'gate_proj', 'up_proj'}))} alone over the experts of {name}: PEFT 0.21 raises "
            "(gate_proj and up_proj are fused in the experts' gate_up_proj); target both",
            field="plan.lora_targets",
        )
    if plan.lora_dropout > 0:
        raise MemplanError(
            f"lora_dropout {plan.lora_dropout} with adapters on the experts of {name}: PEFT 0.21's ParamWrapper "
            "raises (dropout cannot be factored out of a weight's delta); use 0",
            field="plan.lora_dropout",
        )
    if plan.lora_dora:  # ParamWrapper.__init__, after its dropout check
        raise MemplanError(
            f"lora_dora with adapters on the experts of {name}: PEFT 0.21 raises ({DORA_PARAM_WRAPPER}); DoRA is "
            "modelled on the attention linears (q/k/v/o_proj) of this family",
            field="plan.lora_dora",
        )
