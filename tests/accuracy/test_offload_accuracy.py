"""Accuracy: activation offload to CPU (``offload_activations: cpu``) against real PEFT LoRA and full
fine-tuning steps on CPU (offload_steps.py): TRL's own ``OffloadActivations`` through ``transformers.Trainer``
(``--runtime hf``; trl_offload.py, its host copies counted apart; the emulation where TRL's figures depend on the
allocator, ``ALLOCATOR_DEPENDENT``) and ``save_on_cpu`` emulated through the hand-written loop (``--runtime hf-loop``:
saved-tensor hooks that copy each tensor out of torch's allocator and back as a new tensor). The prediction is what
``memplan estimate --device cpu`` answers (``offload_steps.predict_report``: ``memory_verdict(job, "cpu")``): the
op-level run of the Trainer under TRL's hooks (``hf_trainer.py``, ``hf_offload.py``) or of the hand loop under
``save_on_cpu``'s (``hf_loop.py``, ``act_offload.py``), held to 200 B of the measured peak and host copies. Each
case's peak is also held to 3% of the prediction and its host copies to 10% of the predicted ``offload.cpu`` (the
bounds of the phase model that answered before 2026-11-28).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from offload_steps import CASES, OffloadCase, measure, predict_report  # noqa: E402

pytestmark = pytest.mark.accuracy

PEAK_BOUND = 0.03
HOST_BOUND = 0.10
OP_LEVEL_BYTES = 200  # the op-level run against the same steps: what the other op-level CPU comparisons reach
_MEASURED: dict[str, tuple[int, int]] = {}


def _measured(case: OffloadCase) -> tuple[int, int]:
    """(device peak, host peak) of the case, measured once for every test."""
    if case.name not in _MEASURED:
        _MEASURED[case.name] = measure(case)
    return _MEASURED[case.name]


def _params() -> list:
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]


@pytest.mark.parametrize("case", _params())
def test_offload_peak_within_bound(case: OffloadCase):
    report = predict_report(case)
    measured = _measured(case)[0]
    predicted = report.peak.allocated
    error = (predicted - measured) / measured
    line = f"{case.name}: predicted {predicted:,} measured {measured:,} ({100 * error:+.2f}%, {report.peak.phase})"
    assert abs(error) <= PEAK_BOUND, line


@pytest.mark.parametrize("case", _params())
def test_offload_host_copies_within_bound(case: OffloadCase):
    predicted = predict_report(case).offload.cpu
    host = _measured(case)[1]
    assert host > 0, case.name
    error = (predicted - host) / host
    assert abs(error) <= HOST_BOUND, (
        f"{case.name}: host predicted {predicted:,} measured {host:,} ({100 * error:+.2f}%)"
    )


def test_each_mode_is_the_mechanism_memplan_models_for_its_runtime():
    from memplan.costmodel.memory import OFFLOAD_MECHANISM

    mechanism = {"trl-like": "trl", "save_on_cpu": "save_on_cpu"}
    assert {OFFLOAD_MECHANISM[c.runtime] for c in CASES if c.mode == "trl-like"} == {mechanism["trl-like"]}
    assert all(OFFLOAD_MECHANISM[c.runtime] == mechanism[c.mode] for c in CASES)


@pytest.mark.parametrize("case", _params())
def test_the_op_level_run_is_the_measured_step(case: OffloadCase):
    """Both loops under offload are answered by the op-level run (``memory.model``), whose peak and host
    copies (``offload.cpu``: no optimizer or parameter offload here) are the measured ones."""
    report = predict_report(case)
    peak, host = _measured(case)
    assert report.model == "op-level", report.model_reason
    assert abs(report.peak.allocated - peak) <= OP_LEVEL_BYTES, (case.name, report.peak.allocated, peak)
    assert abs(report.offload.cpu - host) <= OP_LEVEL_BYTES, (case.name, report.offload.cpu, host)


def test_offload_lowers_the_measured_peak():
    """The harness itself: offloading a case without checkpointing measures less than the same steps
    without it (the same loop, the hooks replaced by none)."""
    from peft_steps import measure_live

    case = next(c for c in CASES if c.name == "save_on_cpu-lora-fp32-qv")
    assert _measured(case)[0] < 0.8 * measure_live(case.base)


def test_the_trainers_offload_on_cuda_stays_on_the_phase_model_with_its_reason():
    """TRL's hooks are followed on CPU alone (on CUDA its copies keep their strides and run on side
    streams): there ``hf_supported`` declines the plan, so the report says ``phase`` and why; the hand
    loop's ``save_on_cpu`` is followed on both."""

    from memplan.costmodel.timeline.hf_support import hf_supported
    from memplan.specs.loader import model_from_data
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    case = next(c for c in CASES if c.name == "trl-like-lora-fp32-qv")
    model = model_from_data(case.base.hf_config(), "config.json", case.name)
    plan = Plan(finetune="lora", precision="fp32", offload_activations="cpu")
    workload = TrainingWorkload(seq_len=case.base.seq, micro_batch=case.base.batch)
    why = hf_supported(model, plan, workload, "hf", device="cuda")
    assert why is not None and "activation offload under the Trainer" in why
    assert hf_supported(model, plan, workload, "hf", device="cpu") is None
    assert hf_supported(model, plan, workload, "hf-loop", device="cuda") is None
    # over ranks on CPU too (tests/unit/test_timeline_hf_offload_ranks.py), not on CUDA
    two = Plan(finetune="lora", precision="fp32", offload_activations="cpu", dp=2)
    assert hf_supported(model, two, workload, "hf", device="cpu") is None
    assert "activation offload" in (hf_supported(model, two, workload, "hf", device="cuda") or "")
