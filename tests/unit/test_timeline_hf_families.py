"""The op-level run of ``transformers.Trainer`` for the families of ``costmodel/timeline/hf_families.py``
(Qwen3, Phi-3, OLMo 2, Gemma 3, Gemma 2) against the real Trainer on CPU: tiny random models built from their
config.json (tests/accuracy/family_steps.py's shapes), full fine-tuning in fp32, bf16 and ``bf16=True``
over fp32, with and without gradient checkpointing, a vocabulary-dominated and a layer-dominated shape,
sliding windows the sequence (128) does not reach, Gemma 3 with one and with two layer types; the peak
of live storages over three steps (``StorageTracker``, tests/accuracy/hf_steps.py's harness) equal to
the byte on every case. As in tests/unit/test_timeline_hf.py the run is compared with
``inplace_accumulate=False`` (the tracker's reference makes every second gradient sum out of place).
"""

from __future__ import annotations

import dataclasses

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import family_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.loader import load_model, model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
BASE = {c.name: c for c in family_steps.BASE}
LAYERS = dict(vocab=256, layers=4)  # the layers, not the logits, dominate the peak


def _case(family: str, tag: str, slow: bool = False, config: dict | None = None, **fields) -> hf_steps.Case:
    """family_steps' case of ``family`` with ``fields`` and further config.json keys ``config``."""
    base = BASE[family]
    extra = tuple({**dict(base.extra), **(config or {})}.items())
    return dataclasses.replace(base, name=f"hffam-{family}-{tag}", loop="trainer", slow=slow, extra=extra, **fields)


WINDOW = {"sliding_window": 256}  # longer than the sequence: transformers passes SDPA no mask


BF16 = dict(dtype="bfloat16")
CASES = [
    _case("qwen3", "fp32"),
    _case("qwen3", "bf16-ckpt", **BF16, checkpointing=True),
    _case("qwen3", "layers-fp32-ckpt", **LAYERS, checkpointing=True),
    _case("qwen3", "autocast", slow=True, autocast=True),
    _case("phi3", "fp32"),
    _case("phi3", "bf16", **BF16),
    _case("phi3", "fp32-ckpt", slow=True, checkpointing=True),
    _case("phi3", "layers-bf16", **LAYERS, **BF16),
    _case("phi3", "autocast", slow=True, autocast=True),
    _case("olmo2", "fp32"),
    _case("olmo2", "bf16-ckpt", **BF16, checkpointing=True),
    _case("olmo2", "layers-bf16", **LAYERS, **BF16),
    _case("olmo2", "autocast", autocast=True),
    _case("phi3", "window-bf16-ckpt", **BF16, checkpointing=True, config=WINDOW),
    _case("gemma3", "fp32", config=WINDOW),  # two sliding layers: one pair of rotary tables
    _case("gemma3", "bf16-ckpt", **BF16, checkpointing=True, config=WINDOW),
    _case("gemma3", "layers6-fp32-ckpt", layers=6, checkpointing=True, config=WINDOW),  # 5 sliding, 1 full
    _case("gemma3", "layers-bf16-softcap", **LAYERS, **BF16, config={**WINDOW, "final_logit_softcapping": 30.0}),
    _case("gemma3", "autocast", slow=True, autocast=True, config=WINDOW),
    # Gemma 2: eager attention (transformers' only choice), soft-capped scores and logits, both masks
    _case("gemma2", "fp32", slow=True),
    _case("gemma2", "bf16-ckpt", **BF16, checkpointing=True),
    _case("gemma2", "mha-fp32-ckpt", kv_heads=4, checkpointing=True),  # repeat_kv returns k, v: matmul copies
    _case("gemma2", "mqa-layers-bf16", **LAYERS, **BF16, kv_heads=1),  # one KV head: repeat_kv's view
    _case("gemma2", "autocast-ckpt", autocast=True, checkpointing=True),  # matmul's bf16 casts inside
    _case("gemma2", "autocast-mha", slow=True, autocast=True, kv_heads=4),
]


def predict(case: hf_steps.Case, dp: int = 1) -> int:
    """The run's peak for the case's config.json (its family read from it), on CPU's kernels, on one of
    ``dp`` ranks (DDP)."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = Plan(
        precision=case.precision, autocast=case.plan_autocast, recompute="full" if case.checkpointing else "none", dp=dp
    )
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload) is None, case.name
    return hf_predict(case, plan).peak()[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    measured = hf_steps.measure_peak(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_each_family_runs_both_dtypes_and_checkpointing() -> None:
    """Every family has an fp32 and a bf16 case, a checkpointed one and a layer-dominated one."""
    for family in ("qwen3", "phi3", "olmo2", "gemma3", "gemma2"):
        mine = [c for c in CASES if c.arch == family]
        assert {c.precision for c in mine} >= {"fp32", "bf16", "bf16-mixed"}
        assert any(c.checkpointing for c in mine) and any(c.vocab == LAYERS["vocab"] for c in mine)
    assert len({dataclasses.astuple(c)[1:] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("name", "seq"),
    [
        ("qwen3-8b", 1024),
        ("phi4", 1024),
        ("olmo2-7b", 1024),
        ("phi3-mini", 1024),
        ("gemma3-12b", 512),
        ("gemma2-9b", 8192),
    ],
)
def test_estimate_answers_the_families_op_level(capsys, name: str, seq: int) -> None:
    """Phi-3-mini's 2047 and Gemma 3's 1024 windows: not reached by the sequence, no mask; Gemma 2's
    eager attention builds both masks at any length."""
    memory = _estimate(capsys, [name, "--runtime", "hf", "--precision", "bf16", "--seq-len", str(seq)])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf"


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("phi3-mini", "sliding or chunked attention"),  # its 2047-token window, reached by 4096 tokens
        # on an L40S (8.9): the memory-efficient kernel's blocks known on 8.0 / 9.0 (hf_support.sliding_cuda_ok;
        # on an H100 the run follows it: tests/unit/test_timeline_hf_sliding_cuda.py)
        ("gemma3-12b", "outside compute capability 8.0 / 9.0"),
        ("deepseek-v2-lite", "MLA attention on CUDA"),  # on an L40S (8.9): hf_support.mla_cuda_ok
    ],
)
def test_the_families_the_run_does_not_follow_say_so(capsys, name: str, reason: str) -> None:
    gpu = ["--gpu", "l40s"] if name.startswith(("deepseek", "gemma3")) else []
    memory = _estimate(capsys, [name, "--runtime", "hf", "--seq-len", "4096", *gpu])
    assert memory["model"] == "phase" and reason in memory["model_reason"]


@pytest.mark.parametrize(
    ("name", "fields", "reason"),
    [
        ("qwen3-8b", {"qk_norm": False}, "this qwen3 layer layout"),
        ("olmo2-7b", {"qk_norm_scope": "head"}, "this olmo2 layer layout"),
        ("phi4", {"fused_gate_up": False}, "this phi3 layer layout"),
        ("llama3-8b", {"qk_norm": True}, "this llama layer layout"),
        ("phi4", {"partial_rotary_factor": 0.75}, "partial rotary embeddings"),
        ("gemma3-12b", {"layer_norms": "pre"}, "this gemma3 layer layout"),
        ("gemma3-12b", {"activation": "silu"}, "this MLP"),
        ("gemma3-12b", {"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
        ("gemma2-9b", {"qk_norm": True}, "this gemma2 layer layout"),
    ],
)
def test_a_layer_its_family_does_not_write_stays_on_the_phase_model(name: str, fields: dict, reason: str) -> None:
    """A spec whose layer differs from what its family's transformers code runs is not followed."""
    model = load_model(name).model_copy(update=fields)
    assert hf_supported(model, Plan(precision="bf16"), TrainingWorkload(seq_len=512, micro_batch=1)) == reason
