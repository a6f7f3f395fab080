"""Plans ``memplan validate`` accepted but the bundled trainer could not run as asked (issue 27: every
plan the trainer runs, the op-level run follows; what it cannot run, ``validate.support`` refuses
in one line and the estimate's reason says so).

Measured on CPU (torch 2.13, 2026-11-28, a 2-layer GQA model at 64 tokens, ``runner.run`` rank 0):
LoRA under ZeRO-1 over dp 2 with a bf16 ``lm_head`` copy (precision bf16 or bf16-master) ended in
``ValueError: ZeroRedundancyOptimizer only supports using the same dense type for all parameters``;
FSDP2's CPU offload (``zero: 3``, both sides on the host) on one data rank trained without offload
(``parallel.uses_fsdp`` is False at dp 1: 5,908,948 B, the peak of the same plan without offload).
"""

from __future__ import annotations

import pytest

from memplan.costmodel.timeline.support import supported
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload
from memplan.validate.support import TrainerUnsupported, check_plan

MODEL = ModelSpec(
    name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_size=128, vocab_size=256
)
HEAD_COPY = dict(finetune="lora", dp=2, zero=1, modules_to_save=("lm_head",))
OFFLOAD = dict(zero=3, offload_params="cpu", offload_optimizer="cpu")
WORKLOAD = TrainingWorkload(seq_len=2048)  # over 1536 tokens a 4-bit base takes one kernel on every GPU


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        (dict(HEAD_COPY, precision="bf16"), "modules_to_save", "16-bit modules_to_save copy (the trainer refuses it)"),
        (dict(HEAD_COPY, precision="bf16-master"), "modules_to_save", "16-bit modules_to_save copy"),
        (dict(OFFLOAD, precision="bf16"), "offload_params", "CPU offload on one data rank (the trainer refuses it"),
    ],
    ids=["lora-zero1-bf16-head-copy", "lora-zero1-bf16-master-head-copy", "fsdp2-offload-one-rank"],
)
def test_the_trainer_refuses_what_it_cannot_run_and_the_estimate_says_why(changes, field, reason):
    plan = Plan(**changes)
    with pytest.raises(TrainerUnsupported) as err:
        check_plan(plan)
    assert err.value.field == field and "\n" not in str(err.value)
    assert reason in (supported(MODEL, WORKLOAD, plan) or "")


@pytest.mark.parametrize(
    "changes",
    [
        dict(HEAD_COPY, precision="bf16-mixed"),  # an fp32 copy beside fp32 adapters
        dict(HEAD_COPY, precision="fp32"),
        dict(HEAD_COPY, finetune="qlora", precision="bf16"),  # prepare_model_for_kbit_training: an fp32 copy
        dict(OFFLOAD, dp=2, precision="bf16"),  # FSDP2 over two ranks
    ],
    ids=["bf16-mixed-head-copy", "fp32-head-copy", "qlora-head-copy", "offload-dp2"],
)
def test_the_trainer_still_runs_their_neighbours(changes):
    plan = Plan(**changes)
    check_plan(plan)
    assert supported(MODEL, WORKLOAD, plan) is None
