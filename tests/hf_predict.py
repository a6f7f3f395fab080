"""The op-level run of ``transformers.Trainer`` (``hf_trainer.hf_run``) for a CPU harness case
(tests/accuracy's ``hf_steps.Case`` or ``peft_steps.PeftCase``), as the tests compare it with the real
Trainer (on sys.path: the directory of tests/conftest.py).

What the harness fixes is taken from the case and the plan, as ``hf_trainer.hf_plan_run`` takes it from a
plan: the model from the case's config.json (its family, tied head and q/k/v biases), the workload's shapes,
the plan's adapters, ranks (``dp``, ``zero``; ``bf16=True`` as FSDP2's policy), optimizer and checkpoint
(``use_reentrant``: ``specs.plan.checkpoint_reentrant``), the base quantized as the harness loads it (in the case's
dtype, stored as its ``bnb_4bit_quant_storage``), and a dataset holding the steps' batches (the last prefetch finds
none).
"""

from __future__ import annotations

import dataclasses

from memplan.costmodel.timeline.events import Timeline
from memplan.costmodel.timeline.hf_bnb import Bnb4bit, Bnb8bit
from memplan.costmodel.timeline.hf_families import family_config
from memplan.costmodel.timeline.hf_lora import HfLoraConfig
from memplan.costmodel.timeline.hf_trainer import hf_dims, hf_run
from memplan.specs.loader import model_from_data
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan, checkpoint_reentrant, trainer_autocast
from memplan.specs.workload import TrainingWorkload

STEPS = 3  # the harness's steps (tests/accuracy/hf_steps.py): a first step and two steady ones
QUANT_STORAGE = {"uint8": 1, "bfloat16": 2, "float32": 4}  # bnb_4bit_quant_storage's bytes


def case_model(case) -> ModelSpec:
    """The case's ModelSpec, read from the config.json transformers writes for it."""
    return model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)


def case_workload(case) -> TrainingWorkload:
    return TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)


def case_quant(case, plan: Plan) -> Bnb4bit | Bnb8bit | None:
    """The plan's 4-bit or int8 base as the harness loads it: quantized from the case's dtype, a 4-bit base
    stored as the case's ``bnb_4bit_quant_storage`` (the plan assumes its compute dtype for both)."""
    quant = Bnb4bit.of(plan) or Bnb8bit.of(plan)
    if quant is None:
        return None
    stored = 4 if case.dtype == "float32" else 2
    if isinstance(quant, Bnb8bit):
        return dataclasses.replace(quant, stored=stored)
    return dataclasses.replace(quant, stored=stored, storage=QUANT_STORAGE[case.quant_storage])


def hf_predict(
    case,
    plan: Plan,
    *,
    ga: int = 1,
    steps: int = STEPS,
    host_load: bool = False,
    offload: bool = False,
    kernel: str = "cpu_flash",
    inplace_accumulate: bool = False,
    **tape_flags,
) -> Timeline:
    """The run of ``steps`` optimizer steps of ``ga`` micro-batches for the case under ``plan``, on rank 0 of
    ``plan.dp`` (``host_load``: FSDP2's ``cpu_ram_efficient_loading``; ``offload``: TRL's activation offload
    around each ``training_step``), on ``kernel`` (CPU's flash).
    ``inplace_accumulate`` is False: the harness's ``StorageTracker`` holds each storage's Python object, so
    the engine sums every second gradient out of place (tests/unit/test_timeline_hf.py); ``tape_flags``
    (``subclass_like``: the tracker is a dispatch mode) as ``hf_run`` takes them."""
    model = case_model(case)
    experts = model.moe.num_experts if model.moe else 0
    return hf_run(
        hf_dims(model, case_workload(case), plan),
        model.tied_embeddings,
        kernel,
        steps=steps,
        batches=steps * ga,
        qkv_bias=model.qkv_bias,
        ga=ga,
        arch=model.architecture,
        extra=family_config(model, attention=plan.attention),  # eager attention: hf_eager.py
        lora=HfLoraConfig.of(plan, model.architecture, experts),
        quant=case_quant(case, plan),
        dp=plan.dp,
        zero=plan.zero,
        mixed=trainer_autocast(plan, "hf"),
        host_load=host_load,
        offload=offload,
        optimizer=plan.optimizer,
        reentrant=checkpoint_reentrant(plan, "hf"),
        inplace_accumulate=inplace_accumulate,
        **tape_flags,
    )
