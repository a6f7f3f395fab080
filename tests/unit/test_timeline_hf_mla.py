"""The op-level run of ``transformers.Trainer`` over DeepSeek-V3 (``costmodel/timeline/hf_mla.py``: MLA, the
sigmoid router with ``e_score_correction_bias`` and its groups, the ungated shared experts, the dense first
layers) against the real Trainer on CPU: tiny random models from their config.json, full fine-tuning in fp32
and bf16, with and without gradient checkpointing, with ``q_lora_rank`` and without it (one ``q_proj``), with
interleaved RoPE (the config's default) and without; the peak of live storages over three steps
(``StorageTracker``, tests/accuracy/hf_steps.py's harness) equal to the byte on every case. As in
tests/unit/test_timeline_hf_moe.py the run is compared with ``inplace_accumulate=False`` and
``subclass_like=True`` (the tracker is a dispatch mode).

The harness builds the model with ``from_config`` and ``.to(dtype)``, which casts the routers' score bias
too; ``from_pretrained`` keeps it fp32 (``_keep_in_fp32_modules_strict``), and so does the run: each case
casts it back to fp32 before the Trainer is built.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)

from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims, hf_run  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
# MLA with q and k heads (16 + 8) wider than the values (16): the CPU's SDPA runs its math path
MLA = (("q_lora_rank", 32), ("kv_lora_rank", 16), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8))
MLA += (("v_head_dim", 16),)
# 8 experts in 2 groups, top-2 from 1 group, one shared expert, layer 0 dense
ROUTER = (("n_routed_experts", 8), ("num_experts_per_tok", 2), ("n_group", 2), ("topk_group", 1))
ROUTER += (("moe_intermediate_size", 32), ("n_shared_experts", 1), ("first_k_dense_replace", 1))
V3 = MLA + ROUTER
PLAIN_Q = (*V3[1:], ("q_lora_rank", None))  # one q_proj
SHAPE = dict(hidden=64, layers=3, heads=2, kv_heads=2, ffn=128, vocab=64, batch=2, seq=64)


def _case(tag: str, extra: tuple = V3, slow: bool = False, **fields) -> hf_steps.Case:
    fields = {**SHAPE, **fields}
    return hf_steps.Case(f"hfmla-{tag}", arch="deepseek_v3", loop="trainer", extra=extra, slow=slow, **fields)


BF16 = dict(dtype="bfloat16")
CASES = [
    _case("fp32"),
    _case("bf16", **BF16),
    _case("fp32-ckpt", checkpointing=True),
    _case("bf16-ckpt", **BF16, checkpointing=True),
]


def _fp32_score_bias(model, args, ids) -> None:
    """The routers' ``e_score_correction_bias`` in fp32, as ``from_pretrained`` keeps it."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()


def predict(case: hf_steps.Case) -> int:
    """The run's peak for the case's config.json on CPU's kernels."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    recompute = "full" if case.checkpointing else "none"
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    timeline = hf_run(
        hf_dims(model, workload, plan),
        model.tied_embeddings,
        "cpu_flash",
        steps=STEPS,
        batches=STEPS,
        arch=model.architecture,
        extra=family_config(model),
        inplace_accumulate=False,
        subclass_like=True,
    )
    return timeline.peak()[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    measured = hf_steps._measure_trainer(case, STEPS, _fp32_score_bias)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
