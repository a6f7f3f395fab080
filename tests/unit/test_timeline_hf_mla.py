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
# 16 experts in 4 groups, top-4 from 2 groups, 4 heads over 128 tokens: the scores and the experts' rows larger
WIDE = (*MLA, ("n_routed_experts", 16), ("num_experts_per_tok", 4), ("n_group", 4), ("topk_group", 2))
WIDE += ROUTER[4:]
CASES = [
    _case("fp32"),
    _case("bf16-ckpt", **BF16, checkpointing=True),
    _case("autocast", autocast=True),  # bf16=True over fp32 weights (bf16-mixed)
    _case("bf16-autocast", **BF16, autocast=True),  # bf16=True over bf16 weights: --precision bf16's recipe
    _case("plain-q-fp32", PLAIN_Q, slow=True),  # a plain q_proj by default: the LoRA case on it
    _case("rotate-half-bf16", (*V3, ("rope_interleave", False)), **BF16),
    _case("wide-fp32", WIDE, hidden=32, heads=4, kv_heads=4, seq=128),
    _case("bf16", slow=True, **BF16),
    _case("fp32-ckpt", slow=True, checkpointing=True),
    _case("autocast-ckpt", slow=True, autocast=True, checkpointing=True),
    _case("plain-q-bf16-autocast-ckpt", PLAIN_Q, slow=True, **BF16, autocast=True, checkpointing=True),
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
    return hf_predict(case, plan, subclass_like=True).peak()[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    measured = hf_steps._measure_trainer(case, STEPS, _fp32_score_bias)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LORA_CASES = [
    ("all-fp32", V3, {"targets": MLA_LINEARS}),
    # the first layer's frozen queries take no gradient: the scores' bmm keeps the query alone
    ("kv-b-o-bf16", V3, {"targets": ("kv_b_proj", "o_proj"), "dtype": "bfloat16"}),
    ("plain-q-autocast-ckpt-dropout", PLAIN_Q, {"targets": ("q_proj", "o_proj"), "autocast": True, "dropout": 0.1}),
    ("all-bf16-autocast", V3, {"targets": MLA_LINEARS, "dtype": "bfloat16", "autocast": True, "slow": True}),
]


def _bias_cast_bytes(case) -> int:
    """What the harness's ``.to(bfloat16)`` takes off the routers' fp32 score bias (``from_pretrained``
    keeps it fp32, and so does the run): 2 B per expert per sparse layer over a bf16 base."""
    if case.dtype != "bfloat16":
        return 0
    extra = dict(case.extra)
    return 2 * extra["n_routed_experts"] * (case.layers - extra["first_k_dense_replace"])


@pytest.mark.parametrize(
    ("tag", "extra", "fields"),
    [pytest.param(*c, marks=[pytest.mark.slow] if c[2].get("slow") else [], id=c[0]) for c in LORA_CASES],
)
def test_lora_on_the_attention_linears_equals_the_trainers(tag: str, extra: tuple, fields: dict) -> None:
    """PEFT LoRA on MLA's linears under the real Trainer (tests/accuracy/hf_peft_steps.py), the experts,
    router and shared experts frozen: equal to the byte but for the score bias the harness casts."""
    pytest.importorskip("peft")
    import hf_peft_steps
    from peft_steps import PeftCase, plan_of

    fields = {**SHAPE, **fields, "checkpointing": "ckpt" in tag}
    case = PeftCase(f"hfmla-lora-{tag}", arch="deepseek_v3", extra=extra, **fields)
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan, workload = plan_of(case), TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None
    timeline = hf_predict(case, plan, subclass_like=True)
    measured, predicted = hf_peft_steps.measure(case, steps=STEPS), timeline.peak()[0]
    expected = measured + _bias_cast_bytes(case)
    assert predicted == expected, f"{case.name}: {predicted:,} B predicted, {expected:,} B measured (fp32 bias)"


def test_estimate_answers_lora_over_deepseek_v3_on_cpu_and_refuses_it_on_cuda(capsys, tmp_path) -> None:
    """LoRA over an MoE model has no phase model (``reserve.run_only``): on CPU the run answers it, and on CUDA on
    compute capability 8.0 / 9.0 (the memory-efficient kernel, ``hf_support.mla_cuda_ok``); on an L40S (8.9), where
    the run declines MLA, one line naming the field, exit 2."""
    from memplan.cli.app import run

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_case("cli-lora").hf_config()))
    args = [str(path), "--runtime", "hf", "--finetune", "lora", "--lora-targets", "kv_b_proj,o_proj"]
    memory = _estimate(capsys, [*args, "--seq-len", "64", "--device", "cpu"])
    assert memory["model"] == "op-level"
    assert _estimate(capsys, [*args, "--seq-len", "64"])["model"] == "op-level"
    assert run(["estimate", *args, "--seq-len", "64", "--gpu", "l40s"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MLA attention on CUDA" in err[0], err


def test_the_cases_cover_the_precisions_checkpointing_and_the_attention_variants() -> None:
    assert {c.precision for c in CASES} >= {"fp32", "bf16", "bf16-mixed"}
    assert any(c.checkpointing and not c.slow for c in CASES)
    extras = [dict(c.extra) for c in CASES if not c.slow]
    assert any(dict(extra).get("q_lora_rank", 1) is None for _, extra, f in LORA_CASES if not f.get("slow"))
    assert any(e.get("rope_interleave") is False for e in extras)


def test_the_reader_takes_what_the_run_needs() -> None:
    """DeepSeek-V3's config.json: the router's groups, ``norm_topk_prob``, ``rope_interleave`` (the config's
    defaults where the file leaves them out) and the dense first layers transformers builds; the bundled
    profile reads the same."""
    model = model_from_data(json.loads(Path("tests/data/hf/deepseek-v3.json").read_text()), "v3/config.json", "v3")
    moe, mla = model.moe, model.mla
    assert (moe.router_groups, moe.router_topk_groups, moe.norm_topk_prob, mla.rope_interleave) == (8, 4, True, True)
    bundled = load_model("deepseek-v3")
    assert (bundled.moe, bundled.mla) == (moe, mla)
    cfg = _case("reader", (*V3, ("rope_interleave", False), ("norm_topk_prob", False))).hf_config()
    tiny = model_from_data(cfg, "tiny/config.json", "tiny")
    assert (tiny.moe.router_groups, tiny.moe.router_topk_groups) == (2, 1)
    assert not tiny.mla.rope_interleave and not tiny.moe.norm_topk_prob
    extra = family_config(tiny)
    real = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    built = [type(layer.mlp).__name__ for layer in transformers.DeepseekV3ForCausalLM(real).model.layers]
    assert [i for i, name in enumerate(built) if name == "DeepseekV3MLP"] == list(extra["dense"]) == [0]


def test_the_parameters_are_the_models() -> None:
    """The run's parameters (names, sizes, order) are ``named_parameters()`` of the real model, with and
    without ``q_lora_rank``."""
    from memplan.costmodel.timeline.hf_families import family
    from memplan.costmodel.timeline.hf_model import param_shapes
    from memplan.costmodel.timeline.hf_moe import layer_params, moe_sizes

    for extra in (V3, PLAIN_Q):
        case = _case("params", extra)
        cfg = case.hf_config()
        model = model_from_data(cfg, "p/config.json", "p")
        plan, workload = Plan(precision="fp32"), TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
        d, config = hf_dims(model, workload, plan), family_config(model)
        layers = layer_params(model.architecture, family(model.architecture)[1], config)
        shapes = param_shapes(d, model.tied_embeddings, False, layers, moe_sizes(config, d.h))
        real = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
        named = transformers.DeepseekV3ForCausalLM(real).named_parameters()
        expected = [(n if n.endswith(("weight", "bias")) else f"{n}.weight", p.numel()) for n, p in named]
        assert [(n, r * c) for n, (r, c) in shapes.items()] == expected


def _answered(capsys, args: list[str], cuda_followed: bool) -> None:
    """Op-level on CPU; on CUDA op-level where SDPA's memory-efficient kernel over unequal head dims is
    followed (fp32 or 16 bits at any head dims on compute capability 8.0 / 9.0: ``hf_support.mla_cuda_ok``), else
    the phase model with the reason."""
    memory = _estimate(capsys, [*args, "--device", "cpu"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf"
    cuda = _estimate(capsys, args)
    if cuda_followed:
        assert cuda["model"] == "op-level" and cuda["model_reason"] is None
    else:
        assert cuda["model"] == "phase" and cuda["model_reason"].startswith("MLA attention on CUDA")


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed", "fp32"])
def test_estimate_answers_a_tiny_deepseek_v3_op_level_on_cpu(capsys, tmp_path, precision: str) -> None:
    """The tiny model's 24-wide heads: on CUDA followed in fp32 and in 16 bits (the register-resident kernels,
    ``mem_efficient_half.py``)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_case("cli").hf_config()))
    args = [str(path), "--runtime", "hf", "--precision", precision, "--seq-len", "64"]
    _answered(capsys, args, cuda_followed=True)


@pytest.mark.slow
def test_estimate_answers_deepseek_v3_op_level_on_cpu(capsys) -> None:
    """The bundled DeepSeek-V3 (61 layers, 256 experts) under ``--runtime hf``: on CUDA too (192-wide heads)."""
    _answered(capsys, ["deepseek-v3", "--runtime", "hf", "--precision", "bf16", "--seq-len", "512"], True)


@pytest.mark.parametrize(
    ("moe", "mla", "plan", "reason"),
    [
        ({}, {"down_proj_bias": True}, {}, "MLA other than"),
        ({}, {}, {"finetune": "lora", "lora_targets": ("q_proj", "o_proj")}, "MLA other than"),  # q_lora_rank set
        ({}, {}, {"finetune": "lora", "lora_targets": ("o_proj",), "modules_to_save": ("lm_head",)}, "MLA other"),
        ({}, {}, {"dp": 2, "zero": 1}, "ZeRO over more than one rank at stage 1"),  # DDP, FSDP2: test_..._fsdp_mla
        ({"dense_layers": (1,)}, {}, {}, "this MoE block"),  # DeepseekV3DecoderLayer: the first k dense
        ({"shared_expert_gate": True}, {}, {}, "this MoE block"),
        ({"router_bias": True}, {}, {}, "this MoE block"),
        ({}, {"down_proj_bias": True}, {"dp": 2, "zero": 3}, "MLA other than"),  # FSDP2 without: test_..._fsdp_mla
    ],
)
def test_a_deepseek_plan_the_run_does_not_follow_stays_on_the_phase_model(
    moe: dict, mla: dict, plan: dict, reason: str
) -> None:
    model = load_model("deepseek-v3")
    model = model.model_copy(update={"moe": model.moe.model_copy(update=moe), "mla": model.mla.model_copy(update=mla)})
    workload = TrainingWorkload(seq_len=512, micro_batch=1)
    why = hf_supported(model, Plan(precision="bf16", **plan), workload, device="cpu")
    assert why is not None and why.startswith(reason), why


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32", "fp32-ckpt", "bf16", "bf16-ckpt", "autocast"])
def test_the_family_cases_equal_the_trainers(name: str) -> None:
    """tests/accuracy/family_steps.py's DeepSeek-V3 under the Trainer (one expert group, ``q_lora_rank`` 48,
    a 2,000-token vocabulary), held to the byte here (within 3% there, under -m slow)."""
    import family_steps

    case = next(c for c in family_steps.CASES if c.name == f"trainer-deepseek-v3-{name}")
    measured = hf_steps._measure_trainer(case, STEPS, _fp32_score_bias)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
