"""TRL's activation offload under the Trainer over MoE and MLA models (``timeline/hf_offload.py``), against the real
``transformers.Trainer`` on CPU (transformers 5.23, peft 0.21.2, accelerate 1.15).

The Trainer's ``training_step`` under TRL's own ``OffloadActivations`` (what ``SFTConfig(activation_offloading=True)``
runs; tests/accuracy/offload_steps.py's emulation under FSDP2 and where TRL's figures depend on the allocator,
``ALLOCATOR_DEPENDENT``), over Mixtral, Qwen3-MoE, Qwen2-MoE (its gated shared expert) and
DeepSeek-V2 / V3, full fine-tuning and PEFT LoRA, fp32, bf16 and ``bf16=True``, with and without the Trainer's
checkpointing: the peak of live storages over three steps and the host copies at most (``Timeline.host_peak``)
against the op-level run with ``offload=True`` (tests/hf_predict.py; ``subclass_like``: the tracker is a dispatch
mode, ``hf_moe_ops.zeros_then_put``). Three mechanisms beyond the dense models' decide the figures:

- TRL keys a storage it has offloaded by its data pointer plus the view's offset (``_get_unique_tensor_key``), so
  the two halves of the experts' ``gate_up`` output (``chunk(2)``: ``silu`` saves the first, the product the
  second) are two copies, not one (``autograd.Tensor.offset``, set by ``hf_families.split``);
- DeepSeek-V3's router saves indices and a mask in nodes that die in the forward (``hf_offload.orphaned``): TRL
  offloads them and never unpacks them (their host copies stay in its tracker), and the ``gather`` of the top-k's
  indices, a second save of an offloaded storage, stays on the device;
- TRL clones a non-contiguous or offset save before it copies it (PEFT's parametrized expert and router weights as
  ``grouped_mm`` / ``F.linear`` save them transposed, both halves of the ``chunk(2)``), and frees a brought-back copy
  whose views outlive its node at once (the checkpoint's re-run of a layer: DeepSeek-V2 / V3 under checkpointing).

Shapes: tests/unit/test_timeline_hf_loop_families.py's (the hand loop's ``save_on_cpu`` suite over the same
families), LoRA as test_timeline_hf_optimizers_peft_moe.py builds it. Default: two cases (one full, one LoRA; 2-5 s
each); the rest under ``-m slow``.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import test_timeline_hf_loop_families as F  # noqa: E402
from hf_predict import case_model, case_workload, hf_predict  # noqa: E402
from offload_steps import OffloadCase, measure  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402
from test_timeline_hf_moe import QWEN3_DENSE  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402


def _full(tag: str, arch: str, extra: tuple, shape: dict, slow: bool = True, **fields) -> hf_steps.Case:
    name = f"hfoffmoe-{arch}-{tag}"
    return hf_steps.Case(name, arch=arch, loop="trainer", extra=extra, slow=slow, **{**shape, **fields})


def _lora(tag: str, arch: str, extra: tuple, slow: bool = True, **fields) -> PeftCase:
    base = {**TINY, "rank": 8} if not arch.startswith("deepseek") else {**TINY, **F.MLA_SHAPE, "rank": 8}
    return PeftCase(f"hfoffmoe-{arch}-lora-{tag}", **{**base, "arch": arch, "extra": extra, "slow": slow, **fields})


V3 = F.MLA + F.ROUTER
CKPT, BF16 = dict(checkpointing=True), dict(dtype="bfloat16")
FULL = [
    _full("fp32", "mixtral", F.MIXTRAL, F.MOE, slow=False),  # the experts' gate / up halves: two host copies
    _full("fp32", "deepseek_v3", V3, F.MLA_SHAPE, slow=False),  # the router's orphaned saves
    _full("autocast", "mixtral", F.MIXTRAL, F.MOE, autocast=True, layers=2),
    _full("bf16-ckpt", "mixtral", F.MIXTRAL, F.MOE, **BF16, **CKPT),
    _full("fp32", "qwen3_moe", F.QWEN3, F.MOE),
    _full("bf16-ckpt", "qwen3_moe", F.QWEN3, F.MOE, **BF16, **CKPT),
    _full("dense-fp32", "qwen3_moe", QWEN3_DENSE, F.MOE),
    _full("fp32", "qwen2_moe", F.QWEN2, F.MOE),
    _full("fp32-ckpt", "qwen2_moe", F.QWEN2, F.MOE, **CKPT),
    _full("bf16-autocast", "qwen2_moe", F.QWEN2, F.MOE, **BF16, autocast=True, layers=2),
    _full("fp32", "deepseek_v2", F.V2, F.MLA_SHAPE),
    _full("autocast-ckpt", "deepseek_v2", F.V2, F.MLA_SHAPE, autocast=True, **CKPT),
    _full("fp32-ckpt", "deepseek_v3", V3, F.MLA_SHAPE, **CKPT),
    _full("autocast", "deepseek_v3", V3, F.MLA_SHAPE, autocast=True),
]
ALL, MLP = ("all-linear",), ("gate_proj", "up_proj", "down_proj")
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LORA = [
    _lora("experts-fp32", "qwen3_moe", QWEN3_DENSE, slow=False, targets=MLP),  # the experts' ParamWrapper adapters
    _lora("all-linear-fp32", "mixtral", F.MIXTRAL, targets=ALL),
    _lora("all-linear-bf16-ckpt", "mixtral", F.MIXTRAL, targets=ALL, **BF16, **CKPT),
    _lora("all-linear-autocast", "qwen2_moe", F.QWEN2, targets=ALL, autocast=True),
    _lora("mla-fp32", "deepseek_v3", V3, targets=MLA_LINEARS),
    _lora("mla-fp32-ckpt", "deepseek_v3", V3, targets=MLA_LINEARS, **CKPT),
    _lora("q-o-fp32", "deepseek_v2", F.V2, targets=("q_proj", "o_proj")),
]


def _plan(case) -> Plan:
    if isinstance(case, PeftCase):
        return plan_of(case).model_copy(update={"offload_activations": "cpu"})
    recompute = "full" if case.checkpointing else "none"
    return Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, offload_activations="cpu")


# Against TRL's own hooks every case equals the run since 2026-11-29 (docs/accuracy.md, "TRL's offload over MoE and
# MLA models traced against TRL's code"): the three that differed were TRL's ``record_stream`` branch (DeepSeek-V2 /
# V3 under the checkpoint) and its contiguous clone (Mixtral's LoRA over all linears, whose figure also moves with
# the allocator: offload_steps.ALLOCATOR_DEPENDENT)


def _params(cases: list) -> list:
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


@pytest.mark.parametrize("case", _params([*FULL, *LORA]))
def test_peak_and_host_copies_equal_the_trainers(case) -> None:  # noqa: ANN001 - hf_steps.Case or PeftCase
    plan = _plan(case)
    assert hf_supported(case_model(case), plan, case_workload(case), device="cpu") is None, case.name
    peak, host = measure(OffloadCase(f"trl-like-{case.name}", case))
    run = hf_predict(case, plan, offload=True, subclass_like=True)
    assert run.peak()[0] == peak, f"{case.name}: {run.peak()[0]:,} B predicted, {peak:,} B measured"
    assert run.host_peak == host, f"{case.name}: host {run.host_peak:,} B predicted, {host:,} B measured"


def test_phi3s_fused_gate_up_halves_are_two_host_copies() -> None:
    """The same key over a dense family: Phi-3's ``gate_up_proj`` output split by ``chunk(2)`` (``hf_families.
    HfPhi3``). Keyed by the storage alone, the second half stayed on the device: +1,409,024 B at the peak (+8.06%)
    and -704,512 B of host copies on this case before 2026-11-28."""
    import family_steps

    case = dataclasses.replace({c.name: c for c in family_steps.BASE}["phi3"], name="hfoff-phi3-fp32", loop="trainer")
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, offload_activations="cpu")
    assert hf_supported(case_model(case), plan, case_workload(case), device="cpu") is None
    peak, host = measure(OffloadCase(f"trl-like-{case.name}", case))
    run = hf_predict(case, plan, offload=True)
    assert (run.peak()[0], run.host_peak) == (peak, host)


def _ranks(case, kind: str, slow: bool = True):  # noqa: ANN001, ANN202
    return pytest.param(case, kind, id=f"{case.name}-{kind}", marks=[pytest.mark.slow] if slow else [])


BY_NAME = {c.name: c for c in [*FULL, *LORA]}
# FSDP2's harness measures with the emulation (offload_steps.py), which clones every non-contiguous or offset save as
# TRL does. Over the Qwen3-MoE experts' LoRA the run was 14,336 B under it at rank 0's peak (zero3 2,710,920 against
# 2,725,256, zero2 2,776,456 against 2,790,792) until 2026-11-29: PEFT's ``lhs`` factor, lora_B reshaped and permuted
# to (experts, out, rank), is strided; on one rank (and under DDP) a parameter's view TRL keeps, under FSDP2 a view of
# the gathered factor TRL offloads, so clones (``hf_moe_lora.factors``; docs/cost-model.md, "Which CPU saves TRL
# clones")
# FSDP2 under the fake process group (1-2 s a case), DDP over two gloo ranks (40-70 s): rank 0's peak
RANKS = [
    _ranks(BY_NAME["hfoffmoe-mixtral-fp32"], "zero3", slow=False),
    _ranks(BY_NAME["hfoffmoe-mixtral-fp32"], "zero2"),
    _ranks(BY_NAME["hfoffmoe-qwen2_moe-fp32-ckpt"], "zero3"),
    _ranks(BY_NAME["hfoffmoe-qwen3_moe-bf16-ckpt"], "zero2"),
    _ranks(BY_NAME["hfoffmoe-mixtral-lora-all-linear-bf16-ckpt"], "zero3"),
    _ranks(BY_NAME["hfoffmoe-mixtral-fp32"], "ddp"),
    _ranks(BY_NAME["hfoffmoe-qwen3_moe-lora-experts-fp32"], "ddp"),
    # layer 0's post_backward in the root's final callback (hf_fsdp.HfFsdp.finish_backward): both -131,096 B
    # before 2026-11-28 (the run's step 1 peak against the Trainer's step 2)
    _ranks(BY_NAME["hfoffmoe-qwen3_moe-lora-experts-fp32"], "zero3"),
    _ranks(BY_NAME["hfoffmoe-qwen3_moe-lora-experts-fp32"], "zero2"),
]


@pytest.mark.parametrize(("case", "kind"), RANKS)
def test_rank_0s_peak_over_ddp_and_fsdp2_equals_the_trainers(case, kind: str) -> None:  # noqa: ANN001
    """TRL's hooks compose with the Trainer's DDP and FSDP2 over the experts as over a dense model (the saved views
    of FSDP2's unsharded weights offloaded: ``Storage.gathered``; the 3-D experts' too)."""
    import hf_ddp_steps
    import hf_fsdp_steps

    if kind == "ddp":
        measured, ranks = hf_ddp_steps.measure(case, offload=True), dict(dp=hf_ddp_steps.WORLD)
    else:
        zero = int(kind[-1])
        measured = hf_fsdp_steps.measure(case, reshard=zero >= 3, offload=True)
        ranks = dict(dp=hf_fsdp_steps.WORLD, zero=zero)
    plan = _plan(case).model_copy(update=ranks)
    assert hf_supported(case_model(case), plan, case_workload(case), device="cpu") is None, case.name
    predicted = hf_predict(case, plan, offload=True, subclass_like=True).peak()[0]
    assert predicted == measured, f"{case.name} {kind}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_estimate_answers_offload_over_moe_and_mla_on_cpu(capsys, tmp_path) -> None:
    """``--runtime hf --offload-activations cpu --device cpu`` over a DeepSeek-V3 config.json: the op-level run
    answers (before: the phase model); on CUDA (TRL's strided copies on side streams) it does not."""
    import json

    from estimate_json import estimate_memory

    path = tmp_path / "config.json"
    path.write_text(json.dumps(BY_NAME["hfoffmoe-deepseek_v3-fp32"].hf_config()))
    args = [str(path), "--runtime", "hf", "--offload-activations", "cpu", "--seq-len", "64", "--precision", "fp32"]
    memory = estimate_memory(capsys, [*args, "--device", "cpu"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    memory = estimate_memory(capsys, args)
    assert memory["model"] == "phase" and "activation offload under the Trainer on CUDA" in memory["model_reason"]


def test_the_cases_span_the_families_precisions_and_checkpointing() -> None:
    families = {"mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"}
    assert {c.arch for c in FULL} == families == {c.arch for c in LORA}
    for cases in (FULL, LORA):
        assert {c.precision for c in cases} >= {"fp32", "bf16", "bf16-mixed"}
        assert any(c.checkpointing for c in cases) and any(not c.checkpointing for c in cases)
    assert [c.name for c in [*FULL, *LORA] if not c.slow] == [
        "hfoffmoe-mixtral-fp32",
        "hfoffmoe-deepseek_v3-fp32",
        "hfoffmoe-qwen3_moe-lora-experts-fp32",
    ]
    assert len({dataclasses.astuple(c)[1:].__repr__() for c in [*FULL, *LORA]}) == len(FULL) + len(LORA)
