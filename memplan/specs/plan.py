"""A parallel training plan: degrees, ZeRO, offload, recomputation, precision, optimizer."""

from collections.abc import Collection
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

_MAX_DEGREE = 1_000_000

Offload = Literal["none", "cpu", "nvme"]
Recompute = Literal["none", "selective", "selective-op", "full"]
PrecisionName = Literal["fp32", "bf16-mixed", "bf16-master", "fp16-master", "bf16", "fp8"]
OptimizerName = Literal[
    "adamw", "sgd", "adafactor", "adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit", "paged-lion-8bit",
    "paged-lion-32bit",
]  # fmt: skip
AttentionImpl = Literal["flash", "eager", "triton"]
PipelineSchedule = Literal["1f1b", "interleaved", "gpipe"]
Finetune = Literal["full", "lora", "qlora"]
Quant = Literal["none", "int8", "nf4", "fp4"]
ActivationOffload = Literal["none", "cpu"]
Fp8Recipe = Literal["auto", "tensorwise", "rowwise", "delayed"]
ModelBuild = Literal["from_pretrained", "to_device"]
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head


class Plan(BaseModel):
    """How one training job is laid out on the GPUs. World size = dp x tp x pp x cp.

    Expert parallelism (ep) splits the experts over ranks of the data x context parallel group,
    as Megatron-LM does, so it does not add to the world size.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: StrictInt = Field(1, gt=0, le=_MAX_DEGREE, description="Data-parallel degree.")
    tp: StrictInt = Field(1, gt=0, le=_MAX_DEGREE, description="Tensor-parallel degree.")
    sequence_parallel: StrictBool = Field(
        False, description="Shard norms/dropout activations over TP ranks (Megatron SP)."
    )
    pp: StrictInt = Field(1, gt=0, le=_MAX_DEGREE, description="Pipeline-parallel degree (stages).")
    pp_schedule: PipelineSchedule = "1f1b"
    virtual_stages: StrictInt = Field(1, gt=0, le=1024, description="Model chunks per pipeline rank (interleaved).")
    cp: StrictInt = Field(1, gt=0, le=_MAX_DEGREE, description="Context-parallel degree (sequence split over ranks).")
    ep: StrictInt = Field(1, gt=0, le=_MAX_DEGREE, description="Expert-parallel degree (within dp x cp).")
    zero: StrictInt = Field(0, ge=0, le=3, description="ZeRO stage: 1 shards optimizer states, 2 + grads, 3 + params.")
    offload_optimizer: Offload = Field("none", description="Where optimizer states (and master weights) live.")
    offload_params: Offload = Field("none", description="Where parameters live between uses (ZeRO-3 only).")
    recompute: Recompute = Field(
        "none",
        description="Activation recomputation: none; selective (the attention core, Korthikanti et al.); "
        "selective-op (torchtitan's per-op SAC: every second matmul recomputed); full (whole layers).",
    )
    recompute_layers: StrictInt | None = Field(
        None, gt=0, le=100_000, description="With full recompute: layers per stage recomputed (default: all)."
    )
    precision: PrecisionName = "bf16-master"
    fp8_recipe: Fp8Recipe = Field(
        "auto",
        description="precision fp8: the scaling recipe. auto: the library's default (Transformer Engine's delayed "
        "scaling under runtime megatron, torchao's tensorwise otherwise); tensorwise (dynamic per-tensor: torchao, "
        "TE's current scaling); rowwise (torchao); delayed (TE, amax history of 1024).",
    )
    fp8_all_gather: StrictBool = Field(
        False,
        description="precision fp8 under FSDP2 (zero 2/3): all-gather the fp8 linears' weights in fp8 (torchao's "
        "enable_fsdp_float8_all_gather; tensorwise only).",
    )
    optimizer: OptimizerName = "adamw"
    attention: AttentionImpl = Field(
        "flash",
        description="flash: scaled_dot_product_attention, whose kernel PyTorch picks for the device and dtype "
        "(flash, memory-efficient or cuDNN keep no s x s scores; the math path, e.g. fp32 with GQA on CUDA, does); "
        "eager: scores materialised (transformers' eager path); triton: memplan's Triton FlashAttention-2 "
        "(bundled trainer only: out and log-sum-exp in any dtype).",
    )

    finetune: Finetune = Field(
        "full",
        description="full: every weight trained; lora: frozen base, PEFT LoRA adapters trained; qlora: lora over "
        "a 4-bit base (quant: nf4 with double_quant unless given).",
    )
    lora_rank: StrictInt = Field(16, gt=0, le=65_536, description="LoRA rank r (finetune: lora or qlora).")
    lora_targets: tuple[str, ...] = Field(
        ("q_proj", "v_proj"),
        min_length=1,
        description="Module names the adapters wrap (PEFT's target_modules), or all-linear (every linear layer "
        "but the output head).",
    )
    # strict: a YAML true or '0.1' is a mistake, not a number (as tp: true is refused)
    lora_dropout: StrictFloat = Field(
        0.0, ge=0.0, lt=1.0, allow_inf_nan=False, description="Dropout on each adapter's input."
    )
    modules_to_save: tuple[str, ...] = Field(
        (), description="Modules trained in full beside the adapters (PEFT's modules_to_save), e.g. lm_head."
    )
    lora_dora: StrictBool = Field(
        False,
        description="DoRA (PEFT's LoraConfig(use_dora=True)): each adapter also trains a magnitude per output "
        "feature and its forward forms B @ A and the norm of W + scaling * B @ A per row (runtime hf / hf-loop).",
    )
    quant: Quant = Field(
        "none", description="Base linear weights: none, int8 (LLM.int8), nf4 or fp4 (bitsandbytes 4-bit)."
    )
    double_quant: StrictBool = Field(False, description="4-bit: quantize the per-block absmax scales again.")
    offload_activations: ActivationOffload = Field(
        "none", description="Saved activations moved to CPU memory during the forward (save_on_cpu)."
    )
    # The default: a bitsandbytes base always loads this way (transformers' quantizer_bnb_4bit.py /
    # quantizer_bnb_8bit.py ``update_device_map`` sets {"": current device} when none is given), and a
    # dense model loaded with a device_map goes straight to the GPU the same way. A script that loads on
    # the CPU and lets the Trainer move the model (``_move_model_to_device``) is ``to_device``.
    model_build: ModelBuild = Field(
        "from_pretrained",
        description="How the transformers Trainer's model reached the GPU (runtime hf / hf-loop): from_pretrained "
        "with a device_map (transformers' caching-allocator warmup: one segment the size of the weights, the "
        "weights carved from it); to_device: loaded on the CPU, each parameter its own allocation (model.to('cuda'), "
        "as the Trainer moves a model loaded without a device_map; under the Trainer's FSDP2 sharded onto the GPUs "
        "by accelerate's cpu_ram_efficient_loading). Default: to_device for runtime hf over dp > 1 at zero 2/3 "
        "with an unquantized base (fsdp_build), else from_pretrained.",
    )

    # None: the precision's recipe under transformers' loops (``trainer_autocast``); a bf16 model can
    # train either way, and the forward's casts (and LoRA's adapters, fp32 under PEFT) differ
    autocast: StrictBool | None = Field(
        None,
        description="runtime hf / hf-loop with precision bf16: whether the forward runs under bf16 autocast (the "
        "Trainer's bf16=True, accelerate's autocast) over the bfloat16 model. Default: the precision's recipe (hf: "
        "on, as the exporters write it; hf-loop: off).",
    )

    # None: what transformers' loops do unless told (``checkpoint_reentrant``); the two checkpoints keep
    # different tensors (timeline/reentrant.py)
    use_reentrant: StrictBool | None = Field(
        None,
        description="runtime hf / hf-loop with recompute full: the use_reentrant value transformers' gradient "
        "checkpointing hands torch.utils.checkpoint (gradient_checkpointing_kwargs). true: torch's reentrant "
        "checkpoint (the layers' forward under no_grad, each backward re-running the layer and a nested backward); "
        "false: the non-reentrant one. Default: hf: false (the Trainer's gradient_checkpointing=True sets "
        "use_reentrant=False); hf-loop: true over a quantized base (peft's prepare_model_for_kbit_training(model) "
        "passes gradient_checkpointing_kwargs={}, so torch takes its default, True), else false "
        "(model.gradient_checkpointing_enable()).",
    )

    @model_validator(mode="before")
    @classmethod
    def _qlora_defaults(cls, data: object) -> object:
        """``finetune: qlora`` is LoRA over an NF4 base with double quantization, unless given."""
        if isinstance(data, dict) and data.get("finetune") == "qlora":
            given = {k: v for k, v in data.items() if v is not None}
            defaults = {"quant": "nf4", "double_quant": given.get("quant", "nf4") in ("nf4", "fp4")}
            data = {**defaults, **given}
        return data

    @model_validator(mode="after")
    def _check(self) -> "Plan":
        if self.pp_schedule == "interleaved" and self.virtual_stages < 2:
            raise ValueError("virtual_stages: the interleaved schedule needs virtual_stages >= 2")
        if self.pp_schedule != "interleaved" and self.virtual_stages != 1:
            raise ValueError(f"virtual_stages: virtual_stages={self.virtual_stages} needs pp_schedule: interleaved")
        if self.offload_params != "none" and self.zero != 3:
            raise ValueError(f"offload_params: offloading parameters needs zero: 3 (got zero: {self.zero})")
        if self.offload_optimizer != "none" and self.zero == 0:
            raise ValueError("offload_optimizer: offloading optimizer states needs zero >= 1")
        if self.recompute_layers is not None and self.recompute != "full":
            raise ValueError("recompute_layers: only meaningful with recompute: full")
        if self.ep > 1 and (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep: ep={self.ep} does not divide dp x cp = {self.dp * self.cp}")
        if self.finetune == "full":
            for name in ("lora_rank", "lora_targets", "lora_dropout", "modules_to_save", "lora_dora"):
                # against the default, not model_fields_set: a dumped plan validates again
                if getattr(self, name) != _defaults()[name]:
                    raise ValueError(f"{name}: only meaningful with finetune: lora or qlora")
            if self.quant != "none":
                raise ValueError(
                    f"quant: a {self.quant} base is frozen (its weights cannot take optimizer steps): "
                    "train adapters over it (finetune: lora or qlora)"
                )
        if self.double_quant and self.quant not in ("nf4", "fp4"):
            raise ValueError(f"double_quant: quantizes the 4-bit scales; needs quant: nf4 or fp4 (got {self.quant})")
        if self.quant != "none" and self.model_build != "from_pretrained":
            raise ValueError(
                f"model_build: a {self.quant} base is always loaded by from_pretrained with a device_map "
                "(transformers gives bitsandbytes one when none is passed)"
            )
        if self.finetune == "qlora" and self.quant == "none":
            raise ValueError("quant: qlora is LoRA over a quantized base; use finetune: lora for an unquantized one")
        if self.quant != "none" and self.precision == "fp8":
            raise ValueError(
                f"precision: a {self.quant} base dequantizes to bf16, fp16 or fp32 (bitsandbytes' compute dtype), "
                "not fp8"
            )
        if self.precision != "fp8":
            for name in ("fp8_recipe", "fp8_all_gather"):
                if getattr(self, name) != _defaults()[name]:
                    raise ValueError(f"{name}: only meaningful with precision: fp8")
        if self.fp8_all_gather and self.fp8_recipe not in ("auto", "tensorwise"):
            raise ValueError(
                f"fp8_all_gather: torchao gathers fp8 weights with tensorwise scaling only, not {self.fp8_recipe}"
            )
        if self.fp8_all_gather and self.zero < 2:
            raise ValueError(
                f"fp8_all_gather: the fp8 all-gather is FSDP2's, which needs zero 2 or 3 (got zero: {self.zero})"
            )
        if self.use_reentrant is not None and self.recompute != "full":
            raise ValueError(
                f"use_reentrant: only meaningful with recompute: full (transformers' gradient checkpointing; got "
                f"recompute: {self.recompute})"
            )
        if self.autocast is not None and self.precision != "bf16":
            raise ValueError(f"autocast: only meaningful with precision: bf16 ({_NO_CHOICE[self.precision]})")
        targets = self.lora_targets
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"lora_targets: {ALL_LINEAR} already names every linear layer; give it alone")
        if len(set(targets)) != len(targets):
            raise ValueError("lora_targets: a module is named twice")
        if len(set(self.modules_to_save)) != len(self.modules_to_save):
            raise ValueError("modules_to_save: a module is named twice")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stages(self) -> int:
        """Model chunks in the whole pipeline: pp x virtual stages."""
        return self.pp * self.virtual_stages


# why autocast cannot be chosen for the other precisions
_NO_CHOICE = {
    "bf16-mixed": "bf16-mixed is bf16 autocast over fp32 weights by definition",
    "fp32": "fp32 runs no autocast; the Trainer's bf16=True over fp32 weights is bf16-mixed",
    "bf16-master": "bf16-master keeps fp32 master weights: DeepSpeed's bf16, not the Trainer's bf16=True",
    "fp16-master": "fp16-master keeps fp32 master weights: DeepSpeed's fp16, not the Trainer's fp16=True",
    "fp8": "fp8's matmuls are scaled, not autocast",
}
TRANSFORMERS_RUNTIMES = ("hf", "hf-loop")


def checkpoint_reentrant(plan, runtime: str) -> bool:
    """Whether a transformers loop's checkpointed layers run torch's reentrant checkpoint: ``plan.use_reentrant``,
    else the runtime's recipe. ``hf``: the Trainer's ``gradient_checkpointing=True`` enables
    ``activation_checkpointing_kwargs=None``, which transformers makes ``{"use_reentrant": False}``
    (``modeling_utils._activation_checkpointing_enable``). ``hf-loop``: over a quantized base the recipe is
    ``peft.prepare_model_for_kbit_training(model)`` (``use_gradient_checkpointing=True``), which passes
    ``gradient_checkpointing_kwargs={}``: no ``use_reentrant`` reaches ``torch.utils.checkpoint``, which takes
    True (with a warning); over a 16-bit base ``model.gradient_checkpointing_enable()``: False."""
    if plan.recompute != "full":
        return False
    if plan.use_reentrant is not None:
        return plan.use_reentrant
    return runtime == "hf-loop" and plan.quant != "none"


def trainer_autocast(plan, runtime: str) -> bool:
    """Whether a transformers loop's forward runs under bf16 autocast: ``bf16-mixed`` (fp32
    weights) always; ``bf16`` (a bfloat16 model) as ``plan.autocast`` says, else by the runtime's
    recipe: the Trainer's (``hf``) ``bf16=True``, as memplan's exporters write it
    (``export/hf_trainer.py`` ``PRECISION``), the hand-written loop's (``hf-loop``) none."""
    if plan.precision != "bf16":
        return plan.precision == "bf16-mixed"
    return plan.autocast if plan.autocast is not None else runtime == "hf"


def cpu_loadable(model: Any) -> bool:
    """Whether accelerate's ``cpu_ram_efficient_loading`` can shard ``model`` under FSDP2: not with a
    persistent floating buffer (DeepSeek-V3's routers' ``e_score_correction_bias``): accelerate 1.15's
    ``fsdp2_load_full_state_dict`` reads ``.device_mesh`` off every state-dict entry and ``fully_shard``
    leaves buffers plain tensors (``AttributeError`` in ``accelerator.prepare``; ``timeline/hf_support.py``
    ``_cpu_load_buffer``, tests/unit/test_timeline_hf_fsdp_mla.py)."""
    return model.moe is None or not model.moe.router_score_bias


def fsdp_build(plan: Plan, given: Collection[str], runtime: str, model: Any) -> Plan:
    """``model_build`` left out (not among the fields ``given``) of an FSDP plan of the Trainer (runtime
    ``hf``, ``dp`` > 1, ZeRO-2/3, an unquantized base, a ``model`` accelerate can load on the CPU:
    :func:`cpu_loadable`): ``to_device``, the model loaded on the CPU and sharded by accelerate's
    ``cpu_ram_efficient_loading``, as FSDP users load it and as ``memplan export --to hf-trainer |
    accelerate | axolotl`` write it (``costmodel/timeline/hf_fsdp_load.py``; ``memplan tune``'s searched
    plans too); otherwise ``Plan``'s default, ``from_pretrained`` with a device_map."""
    if "model_build" in given or runtime != "hf" or plan.dp < 2 or plan.zero < 2 or plan.quant != "none":
        return plan
    if not cpu_loadable(model):
        return plan
    return plan.model_copy(update={"model_build": "to_device"})


def changed_plan(plan: Plan, update: dict, runtime: str, model: Any) -> Plan:
    """``plan`` with ``update`` applied and validated (advice's and tune's changed plans); a ``model_build``
    that was ``plan``'s default (:func:`fsdp_build`) is resolved again for the changed plan (the Trainer's
    FSDP over a model loaded on the CPU; a quantized base or DDP with a device_map)."""
    data = {**plan.model_dump(), **update}
    default = fsdp_build(_loaded_on_gpu(plan), (), runtime, model).model_build
    if "model_build" in update or plan.model_build != default:
        return Plan.model_validate(data)
    del data["model_build"]
    return fsdp_build(Plan.model_validate(data), (), runtime, model)


def _loaded_on_gpu(plan: Plan) -> Plan:
    return plan.model_copy(update={"model_build": "from_pretrained"})


@cache
def _defaults() -> dict[str, object]:
    """Each field's default, read once: ``Plan.model_fields`` goes through pydantic's
    class-property getter on every access (six per plan validated)."""
    return {name: info.default for name, info in Plan.model_fields.items()}


class PlanFields:
    """A validated plan's fields, with ``world_size`` and ``stages``, as plain attributes: what
    the search's per-plan path (``search.evaluate``: ``memory.training_peak``, ``time.step_speed``)
    reads instead of the :class:`Plan`, which it reads the same way (duck typed; read only by
    convention). Why: pydantic's ``BaseModel`` defines ``__getattr__``, so CPython 3.11 does not
    specialise an attribute read on a model (``Python/specialize.c``, ``SPEC_FAIL_OVERRIDDEN``):
    each read goes through ``slot_tp_getattr_hook``, 116 ns against 27 ns for a plain one
    (timeit, 2026-11-27), and the search reads ~250 per plan of the 768-plan grid
    (``benchmarks/bench_estimate.py``). Built once per plan: it shares the plan's field dict
    (pydantic keeps the fields in the instance's ``__dict__``) and its two properties."""

    world_size = Plan.world_size
    stages = Plan.stages

    def __init__(self, plan: Plan) -> None:
        self.__dict__ = plan.__dict__
