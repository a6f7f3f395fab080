"""torchtitan: a Python configuration (its current form) or a TOML job file (its legacy form).

Current form (torchtitan/config/README.md, configs.py): a function returning ``Trainer.Config``
with ``TrainingConfig``, ``ParallelismConfig`` and ``ActivationCheckpointConfig``, run with
``MODULE=<module> CONFIG=<function> ./run_train.sh``. Legacy form: the TOML read by
``--job.config_file`` (torchtitan/config/job_config.py before the Python configs: sections
``[model]``, ``[optimizer]``, ``[training]``, ``[parallelism]``, ``[activation_checkpoint]``).

Mapping (parallelize_llama's order: TP, activation checkpointing, FSDP):
- ZeRO-3 / ZeRO-2: FSDP over dp (``data_parallel_shard_degree``) with ``fsdp_reshard_after_forward``
  always / never; ZeRO-0: DDP (``data_parallel_replicate_degree``); torchtitan has no ZeRO-1;
- pipeline: ``pipeline_parallel_layers_per_stage`` = L / (pp x virtual stages) with no layer taken
  off the first and last stages (``*_stage_less_layers`` 0), Megatron's even split as estimated;
  ``local_batch_size`` = micro-batch x micro-batches, ``pipeline_parallel_microbatch_size`` = micro-batch;
- precision: bf16-mixed = fp32 ``dtype`` with ``mixed_precision_param`` bfloat16 (applied by FSDP, or
  autocast under DDP / one device); bf16 = ``dtype`` bfloat16 (no fp32 copy); fp32 = both float32;
- ``enable_cpu_offload``: FSDP2's CPUOffloadPolicy (parameters, gradients, optimizer step together).
- recompute selective-op: ``mode`` selective (per-op SAC; the legacy TOML adds ``selective_ac_option`` op).
Not expressible: ZeRO-1, fp32 master weights (bf16-master, fp16-master), fp8 as estimated,
Korthikanti's selective recomputation (the attention core; torchtitan's selective mode is per-op
SAC or layer-wise), eager attention, optimizers other than AdamW, NVMe offload.
"""

from __future__ import annotations

import ast
import tomllib
from typing import Any, Literal

from memplan.errors import MemplanError
from memplan.export.common import (
    GRADIENT_CLIPPING,
    Exported,
    comment_block,
    fields,
    layers_per_chunk,
    preamble,
    py_literal,
    refuse,
    refuse_split_offload,
)
from memplan.specs.resolve import Job

TARGET = "torchtitan"
Form = Literal["python", "toml"]
CARRIES = frozenset(
    {
        "dp",
        "tp",
        "sequence_parallel",
        "pp",
        "pp_schedule",
        "virtual_stages",
        "cp",
        "ep",
        "zero",
        "offload_optimizer",
        "offload_params",
        "recompute",
        "recompute_layers",
        "precision",
        "seq_len",
        "micro_batch",
        "global_batch",
    }
)
SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe"}
RESHARD = {3: "always", 2: "never", 0: "default"}
# torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py: dim, n_layers, n_heads,
# n_kv_heads; FFN from compute_ffn_hidden_dim with multiple_of / ffn_dim_multiplier; vocab 128256)
FLAVORS: dict[tuple[str, str], dict[str, int]] = {
    ("llama3", "8B"): dict(hidden_size=4096, num_layers=32, num_attention_heads=32, kv_heads=8, ffn_size=14336),
    ("llama3", "70B"): dict(hidden_size=8192, num_layers=80, num_attention_heads=64, kv_heads=8, ffn_size=28672),
    ("llama3", "405B"): dict(hidden_size=16384, num_layers=126, num_attention_heads=128, kv_heads=8, ffn_size=53248),
}
LLAMA3_VOCAB = 128256


def flavor(job: Job, name: str | None = None) -> tuple[str, str]:
    """torchtitan's (model name, flavor) for the job's model, matched on its shape; ``name``
    ("qwen3:8B") names one explicitly for models memplan has no table entry for."""
    if name:
        model, sep, flav = name.partition(":")
        if not sep or not model or not flav:
            raise MemplanError(f"expected NAME:FLAVOR such as llama3:8B, got {name!r}", field="--torchtitan-model")
        return model, flav
    m = job.model
    for key, shape in FLAVORS.items():
        if (
            m.architecture == "llama"
            and all(getattr(m, k) == v for k, v in shape.items())
            and m.vocab_size == LLAMA3_VOCAB
            and not m.tied_embeddings
        ):
            return key
    known = ", ".join(f"{a}:{b}" for a, b in FLAVORS)
    raise MemplanError(
        f"no torchtitan model flavor has the shape of {m.name} (known: {known}); name one with --torchtitan-model",
        field="model",
    )


def _check(job: Job, form: Form) -> None:
    p = job.plan
    if p.zero == 1:
        raise refuse("zero", TARGET, "zero=1", "data parallel is DDP (zero 0) or FSDP (zero 2 or 3)")
    if p.zero == 0 and p.dp > 1 and (p.tp > 1 or p.pp > 1 or p.cp > 1):
        raise refuse(
            "zero",
            TARGET,
            f"zero=0 with dp={p.dp} and tp/pp/cp",
            "torchtitan's DDP supports only 1-D parallelism, and context parallelism always shards with FSDP",
        )
    if p.zero == 0 and p.cp > 1:
        raise refuse("zero", TARGET, f"zero=0 with cp={p.cp}", "FSDP always shards over the context-parallel ranks")
    if p.precision in ("bf16-master", "fp16-master", "fp8"):
        raise refuse(
            "precision",
            TARGET,
            f"precision {p.precision}",
            "torchtitan keeps no fp32 master copy of 16-bit parameters (use bf16-mixed or bf16); fp8 is a "
            "model converter memplan does not model",
        )
    fsdp = p.zero >= 2 and p.dp * p.cp > 1
    if p.precision == "bf16-mixed" and not fsdp and (p.tp > 1 or p.pp > 1):
        raise refuse(
            "precision",
            TARGET,
            "precision bf16-mixed without FSDP under tp/pp",
            "mixed_precision_param applies through fully_shard, or autocast only without other parallelism",
        )
    if p.recompute == "selective":
        raise refuse(
            "recompute",
            TARGET,
            "recompute selective",
            "torchtitan's selective mode is per-op SAC (recompute selective-op) or every n-th layer, not "
            "the attention-core recomputation",
        )
    if p.recompute_layers is not None and p.recompute_layers < job.model.num_layers // p.pp:
        per_rank = job.model.num_layers // p.pp
        if form == "python" or p.virtual_stages > 1 or per_rank % p.recompute_layers:
            raise refuse(
                "recompute_layers",
                TARGET,
                f"recompute_layers={p.recompute_layers}",
                "only the legacy TOML's selective_ac_option checkpoints every n-th layer, and only when "
                f"the count divides the {per_rank} layers of a stage (no interleaving)",
            )
    if p.attention == "eager":
        raise refuse(
            "attention", TARGET, "attention eager", "torchtitan's attention is SDPA / flex (no s x s scores kept)"
        )
    if p.optimizer != "adamw":
        raise refuse("optimizer", TARGET, f"optimizer {p.optimizer}", "torchtitan's optimizer container builds AdamW")
    refuse_split_offload(p, TARGET, "enable_cpu_offload")
    if p.ep > 1 and p.tp > 1 and form == "python":
        raise refuse(
            "ep",
            TARGET,
            f"ep={p.ep} with tp={p.tp}",
            "current torchtitan takes expert-parallel ranks from TP as well (efsdp = dp_shard x cp x tp / ep); "
            "memplan splits experts within dp x cp with expert TP = tp (the legacy TOML can say so)",
        )
    if p.tp > 1 and not p.sequence_parallel and form == "toml":
        raise refuse(
            "sequence_parallel",
            TARGET,
            "tp without sequence parallel in the legacy TOML",
            "the legacy job config always applies sequence parallel with TP; use --torchtitan-form python",
        )


def sections(job: Job, form: Form, gradient_clipping: float) -> dict[str, dict[str, Any]]:
    """training / parallelism / activation_checkpoint keys, in torchtitan's names."""
    _check(job, form)
    p, f = job.plan, fields(job)
    microbatches = f["gradient_accumulation"] if p.pp > 1 else 1
    training = {
        "local_batch_size": f["micro_batch"] * microbatches,
        "global_batch_size": f["global_batch"],
        "seq_len": f["seq_len"],
        "max_norm": gradient_clipping,
        "enable_cpu_offload": p.offload_params == "cpu",
        "dtype": "bfloat16" if p.precision == "bf16" else "float32",
        "mixed_precision_param": "float32" if p.precision == "fp32" else "bfloat16",
        "mixed_precision_reduce": "float32",
    }
    ddp = p.zero == 0 and p.dp > 1
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": p.dp if ddp else 1,
        "data_parallel_shard_degree": 1 if ddp else p.dp,
        "fsdp_reshard_after_forward": RESHARD[p.zero],
        "tensor_parallel_degree": p.tp,
    }
    if form == "python":
        par["enable_sequence_parallel"] = p.sequence_parallel
    par["enable_async_tensor_parallel"] = False
    par["pipeline_parallel_degree"] = p.pp
    if p.pp > 1:
        par.update(
            pipeline_parallel_schedule=SCHEDULES[p.pp_schedule],
            pipeline_parallel_layers_per_stage=layers_per_chunk(job),
            pipeline_parallel_first_stage_less_layers=0,
            pipeline_parallel_last_stage_less_layers=0,
            pipeline_parallel_microbatch_size=f["micro_batch"],
        )
    par["context_parallel_degree"] = p.cp
    par["expert_parallel_degree"] = p.ep
    if form == "toml" and p.ep > 1:
        par["expert_tensor_parallel_degree"] = p.tp  # memplan: expert tensor parallelism = tp
    ac: dict[str, Any] = {"mode": "none" if p.recompute == "none" else "full"}
    if p.recompute == "selective-op":
        # per-op SAC: the current configs' only selective mode; the legacy TOML names it "op"
        ac = {"mode": "selective"} if form == "python" else {"mode": "selective", "selective_ac_option": "op"}
    if p.recompute_layers is not None and p.recompute_layers < job.model.num_layers // p.pp:
        # legacy layer-wise SAC: every n-th block of the stage is checkpointed (n = layers / count)
        ac = {"mode": "selective", "selective_ac_option": str(job.model.num_layers // p.pp // p.recompute_layers)}
    return {"training": training, "parallelism": par, "activation_checkpoint": ac}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def to_toml(job: Job, gradient_clipping: float, model: tuple[str, str]) -> str:
    secs = sections(job, "toml", gradient_clipping)
    doc = {
        "model": {"name": model[0], "flavor": model[1]},
        "optimizer": {"name": "AdamW", "implementation": "foreach"},
        **secs,
    }
    out = [comment_block(preamble(job, TARGET, notes(job, "toml")))]
    for name, keys in doc.items():
        out.append(f"\n[{name}]\n")
        out.extend(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())
    return "".join(out)


def _call(name: str, keys: dict[str, Any], indent: str) -> str:
    inner = "".join(f"{indent}    {k}={py_literal(v)},\n" for k, v in keys.items())
    return f"{name}(\n{inner}{indent})"


def to_python(job: Job, gradient_clipping: float, model: tuple[str, str]) -> str:
    secs = sections(job, "python", gradient_clipping)
    pad = " " * 8
    head = comment_block(preamble(job, TARGET, notes(job, "python")))
    body = (
        f"\n\ndef memplan_plan() -> Trainer.Config:\n"
        f'    """{job.model.name}: the plan memplan estimated.\n\n'
        f"    Run with MODULE=<this module> CONFIG=memplan_plan NGPU={job.plan.world_size} ./run_train.sh\n"
        f'    """\n'
        f"    return Trainer.Config(\n"
        f"        model_spec=model_registry({py_literal(model[1])}),\n"
        f"        training={_call('TrainingConfig', secs['training'], pad)},\n"
        f"        parallelism={_call('ParallelismConfig', secs['parallelism'], pad)},\n"
        f"        activation_checkpoint={_call('ActivationCheckpointConfig', secs['activation_checkpoint'], pad)},\n"
        f"    )\n"
    )
    imports = (
        "\nfrom torchtitan.config import ActivationCheckpointConfig, ParallelismConfig, TrainingConfig\n"
        f"from torchtitan.models.{model[0]} import model_registry\n"
        "from torchtitan.trainer import Trainer\n"
    )
    return head + imports + body


def notes(job: Job, form: Form) -> tuple[str, ...]:
    out = [f"NGPU={job.plan.world_size}: the launch's world size must equal the product of the degrees"]
    if form == "python":
        out.append(
            "optimizer AdamW: the estimate's optimizer step assumes implementation='foreach' (one state-sized "
            "temporary); set it on the config's optimizer, where your torchtitan version has that field"
        )
    out.append("optimizer lr, lr_scheduler, dataloader, steps and checkpointing are not part of the plan: set them")
    return tuple(out)


def export(
    job: Job, form: Form = "python", gradient_clipping: float = GRADIENT_CLIPPING, model: str | None = None
) -> Exported:
    """torchtitan's Python config (``form="python"``) or legacy TOML (``form="toml"``)."""
    ref = flavor(job, model)
    if form == "toml":
        return Exported(
            target=TARGET, text=to_toml(job, gradient_clipping, ref), suffix=".toml", notes=notes(job, form)
        )
    return Exported(target=TARGET, text=to_python(job, gradient_clipping, ref), suffix=".py", notes=notes(job, form))


def _from_sections(
    training: dict[str, Any], par: dict[str, Any], ac: dict[str, Any], num_layers: int
) -> dict[str, Any]:
    """memplan's plan fields from torchtitan's three sections (the inverse of :func:`sections`)."""
    replicate, shard = par.get("data_parallel_replicate_degree", 1), par["data_parallel_shard_degree"]
    pp = par.get("pipeline_parallel_degree", 1)
    tp = par.get("tensor_parallel_degree", 1)
    schedule = {v: k for k, v in SCHEDULES.items()}[par.get("pipeline_parallel_schedule", "1F1B")]
    virtual = num_layers // (pp * par["pipeline_parallel_layers_per_stage"]) if pp > 1 else 1
    micro = par["pipeline_parallel_microbatch_size"] if pp > 1 else training["local_batch_size"]
    zero = {v: k for k, v in RESHARD.items()}[par["fsdp_reshard_after_forward"]]
    if replicate > 1:
        zero = 0
    recompute, layers = {"none": ("none", None), "full": ("full", None)}.get(ac["mode"], ("full", None))
    if ac["mode"] == "selective" and ac.get("selective_ac_option", "op") == "op":
        recompute = "selective-op"
    elif ac["mode"] == "selective":  # the legacy layer-wise option written for a partial full recompute
        layers = num_layers // pp // int(ac["selective_ac_option"])
    dtype, param = training["dtype"], training["mixed_precision_param"]
    precision = "bf16" if dtype == "bfloat16" else ("fp32" if param == "float32" else "bf16-mixed")
    offload = "cpu" if training.get("enable_cpu_offload") else "none"
    return {
        "dp": replicate * shard,
        "tp": tp,
        "sequence_parallel": par.get("enable_sequence_parallel", tp > 1),
        "pp": pp,
        "pp_schedule": schedule,
        "virtual_stages": virtual,
        "cp": par.get("context_parallel_degree", 1),
        "ep": par.get("expert_parallel_degree", 1),
        "zero": zero,
        "offload_optimizer": offload,
        "offload_params": offload,
        "recompute": recompute,
        "recompute_layers": layers,
        "precision": precision,
        "seq_len": training["seq_len"],
        "micro_batch": micro,
        "global_batch": training["global_batch_size"],
    }


def parse_toml(text: str, num_layers: int) -> dict[str, Any]:
    """The plan fields of a legacy TOML, read with the standard library's TOML parser."""
    doc = tomllib.loads(text)
    return _from_sections(doc["training"], doc["parallelism"], doc["activation_checkpoint"], num_layers)


def config_calls(text: str) -> dict[str, dict[str, Any]]:
    """Every ``Name(key=literal, ...)`` call of a Python config, by callee name (read with ``ast``, never run)."""
    calls: dict[str, dict[str, Any]] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            calls[name] = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
    return calls


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def parse_python(text: str, num_layers: int) -> dict[str, Any]:
    calls = config_calls(text)
    return _from_sections(
        calls["TrainingConfig"], calls["ParallelismConfig"], calls["ActivationCheckpointConfig"], num_layers
    )


def parse(text: str, num_layers: int) -> dict[str, Any]:
    """Either form, told apart by its syntax (a TOML file has ``[sections]``)."""
    if "\n[training]\n" in text:
        return parse_toml(text, num_layers)
    return parse_python(text, num_layers)
