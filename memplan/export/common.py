"""What every exporter shares: the flat view of a job, refusals, the header, the layer sizes.

An exporter writes what its target's own keys carry and, for what the target sets in the
training code instead, a note. What the target cannot express at all is refused with a
:class:`MemplanError` naming the plan field and what would be lost; a config that silently
means a different plan is never written.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.layout import stage_layout
from memplan.costmodel.memory import ZERO3_PREFETCH_LAYERS, gradient_accumulation
from memplan.errors import MemplanError
from memplan.specs.model import ModelSpec
from memplan.specs.plan import TRANSFORMERS_RUNTIMES, Plan, trainer_autocast
from memplan.specs.resolve import Job
from memplan.specs.workload import TrainingWorkload

# plan and workload fields an exporter may carry, in memplan's names
WORKLOAD_FIELDS = ("seq_len", "micro_batch", "global_batch")
CLUSTER_FIELDS = ("gpus", "nodes")
# max gradient norm when none is given: Llama 2's (Touvron et al. 2023, Sec. 2.2) and torchtitan's
# default; clipping does not change the memory estimate
GRADIENT_CLIPPING = 1.0


class Exported(BaseModel):
    """One target's configuration text, and what the user must still set in code."""

    model_config = ConfigDict(frozen=True)

    target: str
    text: str
    suffix: str  # file extension the text is written with: ".json", ".yaml", ".toml", ".py", ".sh"
    notes: tuple[str, ...] = ()


def training(job: Job, target: str) -> TrainingWorkload:
    """The job's training workload; inference has no trainer configuration to export."""
    if not isinstance(job.workload, TrainingWorkload):
        raise MemplanError(
            f"{target} configurations describe training; this is an inference workload", field="workload.kind"
        )
    return job.workload


def fields(job: Job) -> dict[str, Any]:
    """The plan as one flat mapping in memplan's names: every Plan field, the resolved batch
    sizes (global_batch = micro_batch x dp x accumulation), world size and nodes.

    Values that change nothing are put in their one form, so that a target that cannot say them
    loses nothing: sequence parallel without TP is off, a pipeline schedule without a pipeline is
    1f1b, and recomputing every layer of a stage is ``recompute_layers`` None.
    """
    work = training(job, "export")
    plan = job.plan
    accumulation = gradient_accumulation(work, plan)
    layers = plan.recompute_layers
    if layers is not None and layers >= job.model.num_layers // plan.pp:
        layers = None
    return {
        **plan.model_dump(),
        "sequence_parallel": plan.sequence_parallel and plan.tp > 1,
        "pp_schedule": plan.pp_schedule if plan.pp > 1 else "1f1b",
        "recompute_layers": layers,
        "seq_len": work.seq_len,
        "micro_batch": work.micro_batch,
        "global_batch": work.global_batch or work.micro_batch * plan.dp,
        "gradient_accumulation": accumulation,
        "gpus": plan.world_size,
        "nodes": job.cluster.nodes,
    }


def refuse(field: str, target: str, what: str, lost: str) -> MemplanError:
    """The error for a plan value the target cannot express: the field, and what would be lost."""
    path = field if "." in field else f"plan.{field}"
    return MemplanError(f"{target} cannot express {what}: {lost}", field=path)


def refuse_split_offload(p: Plan, target: str, how: str) -> None:
    """Targets whose one switch offloads parameters, gradients and the optimizer step to CPU
    together (``how``) cannot express NVMe or only one of the two."""
    if "nvme" in (p.offload_params, p.offload_optimizer) or p.offload_params != p.offload_optimizer:
        field = "offload_params" if p.offload_params != "cpu" else "offload_optimizer"
        what = f"offload_params={p.offload_params}, offload_optimizer={p.offload_optimizer}"
        raise refuse(field, target, what, f"{how} moves parameters, gradients and the optimizer step to CPU together")


def header(job: Job, target: str) -> list[str]:
    """Comment lines naming the plan an export came from (no dates or versions: goldens stay stable)."""
    p = job.plan
    f = fields(job)
    degrees = f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep}"
    if p.sequence_parallel:
        degrees += " sp"
    if p.pp > 1:
        degrees += f" pp_schedule={p.pp_schedule}" + (
            f" virtual_stages={p.virtual_stages}" if p.virtual_stages > 1 else ""
        )
    recompute = p.recompute + (f"({p.recompute_layers} layers)" if p.recompute_layers else "")
    offload = ""
    if (p.offload_optimizer, p.offload_params) != ("none", "none"):
        offload = f" offload_optimizer={p.offload_optimizer} offload_params={p.offload_params}"
    return [
        f"memplan export --to {target}: {job.model.name} on {p.world_size} x {job.gpu.name}"
        f", {job.cluster.nodes} node(s)",
        f"plan: {degrees} zero={p.zero}",
        f"recompute={recompute} precision={p.precision} optimizer={p.optimizer} attention={p.attention}{offload}",
        f"workload: seq_len={f['seq_len']} micro_batch={f['micro_batch']} global_batch={f['global_batch']}"
        f" (gradient accumulation {f['gradient_accumulation']}); runtime={job.runtime}",
    ]


def py_literal(value: Any) -> str:
    """A Python literal as ruff format writes it (double-quoted strings), for generated modules."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def comment_block(lines: list[str], prefix: str = "# ", width: int = 110) -> str:
    """Comment lines, long ones wrapped (generated Python stays within ruff's line length)."""
    out = []
    for line in lines:
        wrapped = textwrap.wrap(line, width=width, subsequent_indent="  ", break_on_hyphens=False) or [""]
        out.extend(f"{prefix}{part}".rstrip() + "\n" for part in wrapped)
    return "".join(out)


def preamble(job: Job, target: str, notes: tuple[str, ...]) -> list[str]:
    """The header lines and, under them, what the training code must still set."""
    lines = header(job, target)
    if notes:
        lines += ["set in the training code:", *(f"- {note}" for note in notes)]
    return lines


def layer_elements(job: Job) -> int:
    """Parameters (elements) of the largest transformer layer on one rank (after TP / EP sharding).

    This is the unit of the ZeRO buffers the estimate assumes (memory.py): one layer's unsharded
    gradients in the reduce buffer, and under ZeRO-3 ``ZERO3_PREFETCH_LAYERS`` layers gathered.
    """
    p = job.plan
    return stage_layout(job.model, p.tp, p.ep, p.pp, p.virtual_stages, 0).largest_layer_params


def zero3_live_elements(job: Job) -> int:
    """Parameters the estimate holds gathered at once under ZeRO-3 (memory.py): the current and the
    prefetched layer, or the gathered embedding / LM head with one layer, whichever is larger."""
    from memplan.costmodel.layout import vocab_shard_params

    layer = layer_elements(job)
    return max(ZERO3_PREFETCH_LAYERS * layer, vocab_shard_params(job.model, job.plan.tp) + layer)


def layers_per_chunk(job: Job) -> int:
    """Transformer layers in one pipeline chunk: L / (pp x virtual_stages) (Megatron's even split)."""
    return job.model.num_layers // job.plan.stages


# the decoder-layer class of each architecture in transformers (the unit FSDP wraps and checkpoints)
HF_LAYER_CLASS = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "qwen2-moe": "Qwen2MoeDecoderLayer",
    "qwen3-moe": "Qwen3MoeDecoderLayer",
    "gpt2": "GPT2Block",
    "gpt-neox": "GPTNeoXLayer",
    "qwen3": "Qwen3DecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "gemma3": "Gemma3DecoderLayer",
    "phi3": "Phi3DecoderLayer",
    "deepseek-v2": "DeepseekV2DecoderLayer",
    "deepseek-v3": "DeepseekV3DecoderLayer",
    "olmo2": "Olmo2DecoderLayer",
    "llama4": "Llama4TextDecoderLayer",
}


def hf_attention(job: Job) -> str:
    """The ``attn_implementation`` transformers runs the plan's attention with: ``sdpa`` for memplan's
    flash (PyTorch SDPA), ``eager`` for eager, and eager for soft-capped attention (Gemma 2), which
    transformers' SDPA path refuses and memplan's estimate counts as eager."""
    if job.plan.attention == "eager" or job.model.attn_logit_softcapping is not None:
        return "eager"
    return "sdpa"


def model_features(model: ModelSpec) -> dict[str, str]:
    """What a model has beyond the Llama layer an exporter's own model flags describe, by the field
    that holds it (MLA, windowed or chunked layers, soft-capping, post / sandwich norms, full-width or
    weightless QK norms, NoPE layers, partial RoPE, a router score bias)."""
    found: dict[str, str] = {}
    if model.mla is not None:
        found["mla"] = "multi-head latent attention"
    kinds = set(model.attention_pattern) - {"full"}
    if kinds:
        found["attention_pattern"] = " and ".join(sorted(kinds)) + " attention layers"
    if model.attn_logit_softcapping is not None:
        found["attn_logit_softcapping"] = "attention-score soft-capping"
    if model.final_logit_softcapping is not None:
        found["final_logit_softcapping"] = "logit soft-capping"
    if model.layer_norms != "pre":
        found["layer_norms"] = f"{model.layer_norms} norms"
    if model.qk_norm and model.qk_norm_scope == "full":
        found["qk_norm_scope"] = "QK norms over the full projection width"
    if model.qk_norm and not model.qk_norm_weight:
        found["qk_norm_weight"] = "weightless (L2) QK norms"
    if model.rope_pattern and not all(model.rope_pattern):
        found["rope_pattern"] = "layers without RoPE (NoPE)"
    if model.partial_rotary_factor != 1.0:
        found["partial_rotary_factor"] = f"RoPE on {model.partial_rotary_factor:g} of each head"
    if model.moe is not None and model.moe.router_score_bias:
        found["moe.router_score_bias"] = "a router score-correction bias"
    return found


def refuse_model_features(model: ModelSpec, target: str, supported: frozenset[str] = frozenset()) -> None:
    """Refuse, by field, the first of ``model_features`` the target's model flags cannot express."""
    for field, what in model_features(model).items():
        if field not in supported:
            raise MemplanError(
                f"{target} cannot express {what} ({model.name}); its model flags describe Llama-style layers",
                field=f"model.{field}",
            )


def fsdp_cpu_load(job: Job) -> bool:
    """Whether an FSDP2 export loads the model on the CPU (``cpu_ram_efficient_loading``): what FSDP users
    do and the Trainer's FSDP plans assume unless given otherwise (``specs.plan.fsdp_build``: ``model_build:
    to_device``); an ``hf`` plan given ``model_build: from_pretrained`` loads onto each rank's GPU with a
    ``device_map`` instead, as estimated (``costmodel/timeline/hf_fsdp.py``)."""
    return not (job.runtime == "hf" and job.plan.model_build == "from_pretrained")


def hf_layer_class(job: Job, target: str) -> str:
    """The transformers decoder-layer class of the job's model (modeling_<arch>.py in transformers)."""
    name = HF_LAYER_CLASS.get(job.model.architecture)
    if name is None:
        known = ", ".join(sorted(HF_LAYER_CLASS))
        raise MemplanError(
            f"{target} wraps transformers decoder layers; no layer class is known for architecture "
            f"{job.model.architecture!r} (known: {known})",
            field="model.architecture",
        )
    return name


# ---- fine-tuning exports (hf-trainer, axolotl) ----

# the plan's adapter fields as they are when finetune is full (the Plan forbids setting them then)
LORA_FIELDS = ("lora_rank", "lora_targets", "lora_dropout", "modules_to_save", "lora_dora")
FINETUNE_FIELDS = ("finetune", *LORA_FIELDS, "quant", "double_quant", "offload_activations")


def lora_defaults() -> dict[str, Any]:
    """The adapter fields of a full fine-tune (Plan's defaults): what an export without adapters reads back to."""
    return {name: Plan.model_fields[name].default for name in LORA_FIELDS}


def canonical_finetune(plan: Plan) -> str:
    """The fine-tuning mode as a trainer's config says it: LoRA over a 4-bit base is QLoRA and
    LoRA over an 8-bit base is LoRA (axolotl's ``adapter: qlora`` needs ``load_in_4bit``; PEFT and
    bitsandbytes configs carry the base's quantization, not the name), whatever the plan calls it."""
    if plan.finetune == "full":
        return "full"
    return "qlora" if plan.quant in ("nf4", "fp4") else "lora"


def finetune_fields(job: Job) -> dict[str, Any]:
    """:func:`fields` with the fine-tuning mode and the Trainer's autocast each in its one form
    (:func:`canonical_finetune`; ``autocast`` False where :func:`autocast_off`, else None: the
    Trainer's ``bf16=True`` over a bf16 model is the ``bf16`` recipe's default)."""
    off = False if autocast_off(job) else None
    return {**fields(job), "finetune": canonical_finetune(job.plan), "autocast": off}


def autocast_off(job: Job) -> bool:
    """A bfloat16 model the Trainer trains without ``bf16=True`` (no autocast): precision ``bf16``
    whose ``autocast`` is off under the job's transformers runtime (``specs.plan.trainer_autocast``:
    the plan's, else the runtime's recipe), on the plain Trainer (no ZeRO: under DeepSpeed accelerate
    runs no autocast, its ``bf16`` section sets the precision; :func:`refuse_autocast_sharded`)."""
    p = job.plan
    if p.precision != "bf16" or p.zero > 0 or job.runtime not in TRANSFORMERS_RUNTIMES:
        return False
    return not trainer_autocast(p, job.runtime)


def refuse_autocast_sharded(p: Plan, target: str) -> None:
    """The plan's ``autocast`` says whether the plain Trainer's ``bf16=True`` is on; under ZeRO the
    precision is DeepSpeed's or FSDP2's section (accelerate's ``Accelerator`` turns native autocast
    on only outside DeepSpeed: ``native_amp``), which the choice does not reach."""
    if p.autocast is not None and p.zero > 0:
        raise refuse(
            "autocast",
            target,
            f"autocast={'on' if p.autocast else 'off'} with zero={p.zero}",
            "the Trainer's bf16=True is accelerate's autocast without sharding; under DeepSpeed or FSDP their own "
            "precision section decides (leave autocast unset)",
        )


def hf_model_id(job: Job) -> str | None:
    """The Hugging Face Hub id a bundled profile was read from (its ``source``: "config.json of
    meta-llama/Meta-Llama-3-8B"), or None when the profile does not name one."""
    match = re.search(r"config\.json of ([\w.-]+/[\w.-]+)", job.model.source or "")
    return match.group(1) if match else None


def header_world(text: str) -> tuple[int, int] | None:
    """GPUs and nodes from an export's header comment (:func:`header`: "on 8 x h100-sxm, 1 node(s)")."""
    match = re.search(r"on (\d+) x \S+, (\d+) node\(s\)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def expressible(job: Job, target: str) -> MemplanError | None:
    """None when ``target`` can express ``job``'s plan, else the refusal its exporter raises.

    The exporter itself is run (its text is discarded, nothing is written): the one set of
    refusal rules decides, for ``memplan tune --export`` as for ``memplan export``.
    """
    from memplan.export import render

    try:
        render(job, target)
    except MemplanError as err:
        return err
    return None
