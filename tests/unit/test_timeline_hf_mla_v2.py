"""The op-level run of DeepSeek-V2 under ``transformers.Trainer`` (``hf_mla_v2.py``: V3's MLA layer with
RoPE in complex form, the softmax router, greedy or group-limited, the ungated shared experts, the dense
first layers) against the real Trainer on CPU: tiny random models from their config.json (DeepSeek-V2-Lite's
layout: no ``q_lora_rank``, two shared experts fused in one MLP, greedy routing; and the variants), full
fine-tuning in fp32, bf16, ``bf16=True`` over fp32 and over bf16, with and without gradient checkpointing,
one and two micro-batches an update; PEFT LoRA on MLA's linears. The peak of live storages over three
steps (``StorageTracker``, tests/accuracy/hf_steps.py's harness) equal to the byte on every case; the run
is compared with ``inplace_accumulate=False`` and ``subclass_like=True`` (the tracker is a dispatch mode),
as in tests/unit/test_timeline_hf_mla.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)

from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims  # noqa: E402
from memplan.specs.loader import load_model, model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
# MLA with q and k heads (16 + 8) wider than the values (16), one plain q_proj (V2-Lite's q_lora_rank null)
MLA = (("q_lora_rank", None), ("kv_lora_rank", 16), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8))
MLA += (("v_head_dim", 16),)
# 8 experts, top-2, two shared experts (one MLP of 2 x 32), layer 0 dense, greedy routing (V2's default)
ROUTER = (("n_routed_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))
ROUTER += (("n_shared_experts", 2), ("first_k_dense_replace", 1))
LITE = MLA + ROUTER
Q_LORA = (("q_lora_rank", 32), *LITE[1:])  # q_a_proj, q_a_layernorm, q_b_proj
# group_limited_greedy: 8 experts in 2 groups, the top-2 from the best group
GROUPED = (*LITE, ("topk_method", "group_limited_greedy"), ("n_group", 2), ("topk_group", 1))
SHAPE = dict(hidden=64, layers=3, heads=2, kv_heads=2, ffn=128, vocab=64, batch=2, seq=64)
BF16 = dict(dtype="bfloat16")


def _case(tag: str, extra: tuple = LITE, slow: bool = False, **fields) -> hf_steps.Case:
    fields = {**SHAPE, **fields}
    return hf_steps.Case(f"hfmla2-{tag}", arch="deepseek_v2", loop="trainer", extra=extra, slow=slow, **fields)


CASES = [
    _case("fp32"),
    _case("bf16-ckpt", **BF16, checkpointing=True),
    _case("autocast", autocast=True),  # bf16=True over fp32 weights (bf16-mixed)
    _case("grouped-bf16-autocast", GROUPED, **BF16, autocast=True),  # --precision bf16's recipe
    _case("bf16", slow=True, **BF16),
    _case("fp32-ckpt", slow=True, checkpointing=True),
    _case("autocast-ckpt", slow=True, autocast=True, checkpointing=True),
    _case("q-lora-rank-fp32", Q_LORA, slow=True),
    _case("grouped-fp32", GROUPED, slow=True),
]
GA_CASES = [  # gradient_accumulation_steps 2: two micro-batches an update, ``.grad`` added into
    (_case("ga2-fp32"), 2),
    (_case("ga2-bf16-ckpt", slow=True, **BF16, checkpointing=True), 2),
    (_case("ga2-grouped-autocast", GROUPED, slow=True, autocast=True), 2),
]


def _slow(case: hf_steps.Case, *rest):
    values = (case, *rest) if rest else (case,)
    return pytest.param(*values, marks=[pytest.mark.slow] if case.slow else [], id=case.name)


def predict(case: hf_steps.Case, ga: int = 1, plan: Plan | None = None) -> int:
    """The run's peak for the case's config.json on CPU's kernels."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    recompute = "full" if case.checkpointing else "none"
    plan = plan or Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    return hf_predict(case, plan, ga=ga, subclass_like=True).peak()[0]


@pytest.mark.parametrize("case", [_slow(c) for c in CASES])
def test_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    measured = hf_steps._measure_trainer(case, STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.parametrize(("case", "ga"), [_slow(c, ga) for c, ga in GA_CASES])
def test_peak_with_gradient_accumulation(case: hf_steps.Case, ga: int) -> None:
    import ga_log

    measured = ga_log.measure(case, ga, steps=STEPS)
    predicted = predict(case, ga=ga)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


LORA_CASES = [
    ("q-o-fp32", LITE, {"targets": ("q_proj", "o_proj")}),
    ("all-bf16-autocast-ckpt", LITE, {"targets": ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}),
    ("kv-b-bf16", LITE, {"targets": ("kv_b_proj",), "dtype": "bfloat16", "slow": True}),
    ("q-lora-rank-dropout", Q_LORA, {"targets": ("q_a_proj", "q_b_proj"), "dropout": 0.1, "slow": True}),
]
LORA_CASES[1][2].update(dtype="bfloat16", autocast=True)


@pytest.mark.parametrize(
    ("tag", "extra", "fields"),
    [pytest.param(*c, marks=[pytest.mark.slow] if c[2].get("slow") else [], id=c[0]) for c in LORA_CASES],
)
def test_lora_on_the_attention_linears_equals_the_trainers(tag: str, extra: tuple, fields: dict) -> None:
    """PEFT LoRA on MLA's linears under the real Trainer (tests/accuracy/hf_peft_steps.py), the experts,
    router and shared experts frozen: equal to the byte (V2 has no fp32 score bias for the harness's
    ``.to(bfloat16)`` to cast)."""
    pytest.importorskip("peft")
    import hf_peft_steps
    from peft_steps import PeftCase, plan_of

    fields = {**SHAPE, **fields, "checkpointing": "ckpt" in tag}
    case = PeftCase(f"hfmla2-lora-{tag}", arch="deepseek_v2", extra=extra, **fields)
    plan = plan_of(case)
    predicted = predict(case, plan=plan)
    measured = hf_peft_steps.measure(case, steps=STEPS)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_cases_cover_the_precisions_checkpointing_routing_and_accumulation() -> None:
    fast = [c for c in CASES if not c.slow]
    assert {c.precision for c in fast} >= {"fp32", "bf16", "bf16-mixed"}
    assert any(c.checkpointing for c in fast) and any(c.checkpointing for c in CASES if c.autocast)
    assert any(dict(c.extra).get("topk_method") == "group_limited_greedy" for c in fast)
    assert any(dict(c.extra)["q_lora_rank"] for c in CASES)
    assert any(not c.slow for c, _ in GA_CASES)


def test_the_reader_takes_the_routing_and_the_profile_is_the_config() -> None:
    """DeepSeek-V2-Lite's config.json: greedy routing (no groups), two shared experts as one MLP, no score
    bias, no renormalisation; the bundled profile reads the same. ``group_limited_greedy`` gives the groups."""
    data = json.loads(Path("tests/data/hf/deepseek-v2-lite.json").read_text())
    lite = model_from_data(data, "lite/config.json", "deepseek-v2-lite")
    moe = lite.moe
    assert (moe.router_groups, moe.router_topk_groups) == (1, 1)
    assert not (moe.norm_topk_prob or moe.router_score_bias)
    assert (moe.num_shared_experts, moe.shared_expert_ffn_size, lite.mla.q_lora_rank) == (1, 2 * 1408, None)
    bundled = load_model("deepseek-v2-lite")
    assert bundled.model_dump(exclude={"source"}) == lite.model_dump(exclude={"source"})
    grouped = {**data, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}
    assert model_from_data(grouped, "g/config.json", "g").moe.router_groups == 8
    assert model_from_data(grouped, "g/config.json", "g").moe.router_topk_groups == 3
    greedy = {**data, "n_group": 8, "topk_group": 3}  # topk_method greedy: the groups are not read
    assert model_from_data(greedy, "g/config.json", "g").moe.router_groups == 1


def test_the_parameters_and_buffers_are_the_models() -> None:
    """The run's parameters (names, sizes, order) are ``named_parameters()`` of the real model, with and
    without ``q_lora_rank``; its buffers the rotary ones alone."""
    from memplan.costmodel.timeline.hf_families import family
    from memplan.costmodel.timeline.hf_model import param_shapes
    from memplan.costmodel.timeline.hf_moe import layer_params, moe_sizes

    for extra in (LITE, Q_LORA):
        case = _case("params", extra)
        cfg = case.hf_config()
        model = model_from_data(cfg, "p/config.json", "p")
        plan, workload = Plan(precision="fp32"), TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
        d, config = hf_dims(model, workload, plan), family_config(model)
        cls, _ = family(model.architecture)
        layers = layer_params(model.architecture, (), config)
        shapes = param_shapes(d, model.tied_embeddings, False, layers, moe_sizes(config, d.h))
        real = transformers.DeepseekV2ForCausalLM(
            transformers.DeepseekV2Config(**{k: v for k, v in cfg.items() if k != "architectures"})
        )
        expected = [
            (n if n.endswith(("weight", "bias")) else f"{n}.weight", p.numel()) for n, p in real.named_parameters()
        ]
        assert [(n, r * c) for n, (r, c) in shapes.items()] == expected
        buffers = cls(tape=None, d=d, weights={}, extra=config).buffers()
        assert buffers == [(n, b.numel()) for n, b in real.named_buffers()]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_estimate_answers_deepseek_v2_lite_op_level_on_cpu(capsys, precision: str) -> None:
    """The bundled DeepSeek-V2-Lite (27 layers, 64 experts) under ``--runtime hf``: op-level on CPU, and on
    CUDA (q/k heads of 192 against values of 128: SDPA's memory-efficient kernel, hf_support.mla_cuda_ok) on
    the default GPU; on an L40S (compute capability 8.9) the phase model with the reason."""
    args = ["deepseek-v2-lite", "--runtime", "hf", "--precision", precision, "--seq-len", "256"]
    memory = _estimate(capsys, [*args, "--device", "cpu"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf"
    cuda = _estimate(capsys, args)
    assert cuda["model"] == "op-level" and cuda["model_reason"] is None
    l40s = _estimate(capsys, [*args, "--gpu", "l40s"])
    assert l40s["model"] == "phase" and l40s["model_reason"].startswith("MLA attention on CUDA")


@pytest.mark.parametrize(
    ("moe", "mla", "plan", "reason"),
    [
        ({"router_score_bias": True}, {}, {}, "this MoE block"),  # V3's score bias on a V2 router
        ({"num_shared_experts": 2}, {}, {}, "this MoE block"),
        ({"dense_layers": (1,)}, {}, {}, "this MoE block"),
        ({}, {"down_proj_bias": True}, {}, "MLA other than"),
        ({}, {}, {"finetune": "lora", "lora_targets": ("q_a_proj", "o_proj")}, "MLA other than"),  # no q_lora_rank
        ({}, {}, {"dp": 2, "zero": 1}, "ZeRO over more than one rank at stage 1"),  # DDP, FSDP2 followed
    ],
)
def test_a_deepseek_v2_plan_the_run_does_not_follow_stays_on_the_phase_model(
    moe: dict, mla: dict, plan: dict, reason: str
) -> None:
    model = load_model("deepseek-v2-lite")
    model = model.model_copy(update={"moe": model.moe.model_copy(update=moe), "mla": model.mla.model_copy(update=mla)})
    why = hf_supported(model, Plan(precision="bf16", **plan), TrainingWorkload(seq_len=512), device="cpu")
    assert why is not None and why.startswith(reason), why


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32", "fp32-ckpt", "bf16", "bf16-ckpt", "autocast"])
def test_the_family_cases_equal_the_trainers(name: str) -> None:
    """tests/accuracy/family_steps.py's DeepSeek-V2 under the Trainer (4 experts, one shared, no
    ``q_lora_rank``, a 2,000-token vocabulary), held to the byte here (within 3% there, under -m slow)."""
    import family_steps

    case = next(c for c in family_steps.CASES if c.name == f"trainer-deepseek-v2-{name}")
    measured = hf_steps._measure_trainer(case, STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
