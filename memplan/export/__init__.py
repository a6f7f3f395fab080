"""Export a resolved plan as the configuration of a real trainer.

``export(job, "deepspeed")`` returns the text; :func:`render` returns it with its file suffix and
the notes on what the target leaves to the training code; :func:`parse` reads an export back
into memplan's plan fields (the round trip the tests check). A plan a target cannot express
raises :class:`~memplan.errors.MemplanError` naming the field and what would be lost.

Targets, one module each: ``deepspeed`` (JSON), ``accelerate`` (Accelerate FSDP2 YAML),
``torchtitan`` (Python config, or the legacy TOML with ``form="toml"``), ``megatron``
(Megatron-LM arguments), ``fsdp2`` (a plain PyTorch FSDP2 / DTensor module), and for
fine-tuning ``hf-trainer`` (one YAML of the kwargs of ``TrainingArguments`` / TRL's ``SFTConfig``,
``peft.LoraConfig``, ``BitsAndBytesConfig`` and ``from_pretrained``) and ``axolotl`` (its config
YAML). Options: ``gradient_clipping`` (deepspeed, torchtitan, megatron, hf-trainer, axolotl),
``nvme_path`` (deepspeed), ``form`` and ``model`` (torchtitan), ``sharding`` (hf-trainer and
axolotl: ``deepspeed``, the default for ZeRO, or ``fsdp``).

Only the fine-tuning targets say adapters, a quantized base or activation offload; the others
train every weight and refuse ``finetune``, ``quant`` and ``offload_activations`` by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from memplan.errors import MemplanError
from memplan.export import accelerate, axolotl, deepspeed, fsdp2, hf_trainer, megatron, torchtitan
from memplan.export.common import Exported, fields, refuse, training
from memplan.specs.resolve import Job

TARGETS: dict[str, Any] = {
    "deepspeed": deepspeed,
    "accelerate": accelerate,
    "torchtitan": torchtitan,
    "megatron": megatron,
    "fsdp2": fsdp2,
    "hf-trainer": hf_trainer,
    "axolotl": axolotl,
}

__all__ = ["TARGETS", "Exported", "export", "fields", "options", "parse", "render"]


def options(target: str) -> set[str]:
    """The keyword options a target's exporter takes."""
    return set(inspect.signature(_module(target).export).parameters) - {"job"}


def _module(target: str) -> Any:
    if target not in TARGETS:
        raise MemplanError(f"unknown target {target!r} ({', '.join(TARGETS)})", field="--to")
    return TARGETS[target]


def render(job: Job, target: str, **opts: Any) -> Exported:
    """The target's configuration of ``job``: text, file suffix and notes.

    Options a target does not take are an error (a silently ignored option would be a
    different config than the one asked for); ``None`` means "not given".
    """
    module = _module(target)
    given = {k: v for k, v in opts.items() if v is not None}
    unknown = sorted(set(given) - options(target))
    if unknown:
        flag = "--" + unknown[0].replace("_", "-")
        raise MemplanError(f"does not apply to --to {target}", field=flag)
    training(job, target)
    if job.plan.attention == "triton":
        raise refuse(
            "attention", target, "attention=triton", "memplan's Triton kernel runs only in the bundled trainer"
        )
    if not getattr(module, "FINETUNE", False):
        refuse_finetune(job, target)
    exporter: Callable[..., Exported] = module.export
    return with_allocator_note(exporter(job, **given), job)


def refuse_finetune(job: Job, target: str) -> None:
    """Targets whose configs train every weight in full cannot say adapters, a quantized base or
    activation offload: a config that silently trains a different plan is never written."""
    p = job.plan
    if p.finetune != "full":
        what = f"finetune {p.finetune}" + (f" over a {p.quant} base" if p.quant != "none" else "")
        raise refuse("finetune", target, what, "its configuration trains every weight; export to hf-trainer or axolotl")
    if p.offload_activations != "none":
        raise refuse(
            "offload_activations",
            target,
            f"offload_activations={p.offload_activations}",
            "its configuration keeps saved activations on the GPU; export to hf-trainer (TRL) or axolotl",
        )


def with_allocator_note(exported: Exported, job: Job) -> Exported:
    """A plan predicted under expandable segments fits only when its ranks run with them: no
    target's config file carries PYTORCH_CUDA_ALLOC_CONF, so the export says to set it."""
    if not job.allocator.expandable_segments:
        return exported
    note = (
        "memory was predicted with PyTorch's expandable segments: launch every rank with "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in its environment"
    )
    return exported.model_copy(update={"notes": (*exported.notes, note)})


def export(job: Job, target: str, **opts: Any) -> str:
    """The configuration text of ``job`` for ``target`` (what ``memplan export`` writes)."""
    return render(job, target, **opts).text


def parse(target: str, text: str, num_layers: int | None = None) -> dict[str, Any]:
    """memplan's plan fields read back from an export (torchtitan needs the model's layer count)."""
    module = _module(target)
    if target == "torchtitan":
        if num_layers is None:
            raise ValueError("torchtitan's layers per stage need the model's num_layers to give virtual stages")
        return module.parse(text, num_layers)
    return module.parse(text)
