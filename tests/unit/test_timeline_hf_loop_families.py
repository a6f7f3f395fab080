"""The op-level run of the hand-written transformers loop (``costmodel/timeline/hf_loop.py``, ``--runtime
hf-loop``) over the families beyond Llama's layout (Qwen3, Phi-3, OLMo 2, Gemma 2 / 3, Mixtral, Qwen3-MoE,
Qwen2-MoE, DeepSeek-V2 / V3): the family modules of the Trainer's run (``hf_families.py``, ``hf_gemma.py``,
``hf_moe.py``, ``hf_mla*.py``) under the loop's step, against the loop itself on CPU (tests/accuracy/hf_steps.py's
``hand`` loop, PEFT's through peft_steps' loop), the peak of live storages over three steps (``StorageTracker``)
equal to the byte on every case. What the loop adds per family: each attention's ``past_key_values.update``
(``HfLlama.cached``; DeepSeek's caches its latents, not the expanded keys and values), and the window tensors
of the sliding cache layers the config.json's ``layer_types`` make (Gemma 2 / 3).

Shapes: tests/accuracy/family_steps.py's tiny families (Gemma 3 with a window the sequence does not reach, as
tests/unit/test_timeline_hf_families.py), tests/unit/test_timeline_hf_moe.py's and test_timeline_hf_mla.py's.
As there, the run is compared with ``inplace_accumulate=False`` and, over MoE models, ``subclass_like=True``
(the tracker is a dispatch mode). A handful of cases run by default (about 15 s of CPU); the rest under
``-m slow`` (every LoRA case: PEFT's import and checkpointed MoE runs). Gradient accumulation in the loop
(``loss = out.loss / ga``, ``opt.step()`` every ``ga`` iterations) over Llama, Qwen3, Gemma 2, Mixtral and
LoRA, likewise.
"""

from __future__ import annotations

import dataclasses

import pytest
from estimate_json import estimate_memory as _estimate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import family_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
import peft_steps  # noqa: E402
from storage_tracker import StorageTracker  # noqa: E402

from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_loop import hf_loop_run  # noqa: E402
from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
BASE = {c.name: c for c in family_steps.BASE}
WINDOW = (("sliding_window", 256),)  # longer than the sequence: no mask (test_timeline_hf_families.py)


def _family(name: str, tag: str, slow: bool = False, config: tuple = (), **fields) -> hf_steps.Case:
    base = BASE[name]
    extra = tuple({**dict(base.extra), **dict(config)}.items())
    return dataclasses.replace(base, name=f"loop-{name}-{tag}", loop="hand", slow=slow, extra=extra, **fields)


# tests/unit/test_timeline_hf_moe.py's and test_timeline_hf_mla.py's shapes
MOE = dict(hidden=64, layers=3, heads=2, kv_heads=1, ffn=128, vocab=64, batch=2, seq=64)
MLA_SHAPE = {**MOE, "kv_heads": 2}
MIXTRAL = (("num_local_experts", 4), ("num_experts_per_tok", 2))
QWEN3 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64), ("norm_topk_prob", True))
QWEN2 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))
QWEN2 += (("shared_expert_intermediate_size", 96),)
MLA = (("q_lora_rank", 32), ("kv_lora_rank", 16), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8))
MLA += (("v_head_dim", 16),)
ROUTER = (("n_routed_experts", 8), ("num_experts_per_tok", 2), ("n_group", 2), ("topk_group", 1))
ROUTER += (("moe_intermediate_size", 32), ("n_shared_experts", 1), ("first_k_dense_replace", 1))
V2 = (*MLA[1:], ("q_lora_rank", None), *ROUTER[:2], *ROUTER[4:], ("topk_method", "greedy"))


def _case(name: str, arch: str, extra: tuple, shape: dict, slow: bool = False, **fields) -> hf_steps.Case:
    return hf_steps.Case(f"loop-{name}", arch=arch, extra=extra, slow=slow, **{**shape, **fields})


BF16 = dict(dtype="bfloat16")
CASES = [
    _family("phi3", "fp32"),
    _family("gemma2", "fp32"),  # eager attention, one sliding cache layer of two
    _case("mixtral-autocast", "mixtral", MIXTRAL, MOE, autocast=True, layers=2),
    _case("deepseek-v2-fp32", "deepseek_v2", V2, MLA_SHAPE),
    _family("qwen3", "bf16-ckpt", slow=True, **BF16, checkpointing=True),
    _case("qwen2-moe-fp32", "qwen2_moe", QWEN2, MOE, slow=True),
    _family("qwen3", "fp32", slow=True),
    _family("olmo2", "fp32", slow=True),
    _family("olmo2", "autocast", slow=True, autocast=True),
    _family("gemma3", "fp32", slow=True, config=WINDOW),  # both layers sliding: two window tensors
    _family("gemma2", "bf16", slow=True, **BF16),
    _case("mixtral-fp32", "mixtral", MIXTRAL, MOE, slow=True),
    _case("qwen3-moe-bf16", "qwen3_moe", QWEN3, MOE, slow=True, **BF16, seq=128, hidden=32, layers=2),
    _case("deepseek-v3-fp32", "deepseek_v3", MLA + ROUTER, MLA_SHAPE, slow=True),
    # under autocast the cache's cat promotes the bf16 latent's values to its fp32 RoPE'd key
    _case("deepseek-v3-autocast", "deepseek_v3", MLA + ROUTER, MLA_SHAPE, slow=True, autocast=True),
    _case("deepseek-v3-bf16", "deepseek_v3", MLA + ROUTER, MLA_SHAPE, slow=True, **BF16),
]


def _fp32_score_bias(model) -> None:
    """DeepSeek-V3's routers' ``e_score_correction_bias`` in fp32, as ``from_pretrained`` keeps it (and the run)."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()


def _run(
    model,
    plan: Plan,
    workload: TrainingWorkload,
    lora: HfLoraConfig | None = None,
    ga: int = 1,
    quant=None,
    reentrant: bool = False,
) -> int:
    """The loop's run as ``hf_loop_plan_run`` composes it (the spec's sliding layers, the family and the plan's
    attention; ``quant``: the base's ``Bnb4bit``), on CPU."""
    assert hf_supported(model, plan, workload, runtime="hf-loop", device="cpu") is None
    timeline = hf_loop_run(
        hf_dims(model, workload, plan, "hf-loop"),
        model.tied_embeddings,
        "cpu_flash",
        steps=STEPS,
        qkv_bias=model.qkv_bias,
        window_layers=tuple(i for i, kind in enumerate(model.layer_attention_kinds) if kind == "sliding"),
        arch=model.architecture,
        extra=family_config(model, attention=plan.attention),
        lora=lora,
        quant=quant,
        inplace_accumulate=False,
        subclass_like=model.moe is not None,  # the tracker's dispatch mode (hf_moe_ops.zeros_then_put)
        ga=ga,
        reentrant=reentrant,  # torch's reentrant checkpoint (reentrant.py)
    )
    return timeline.peak()[0]


def predict(case: hf_steps.Case) -> int:
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    recompute = "full" if case.checkpointing else "none"
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute)
    return _run(model, plan, TrainingWorkload(seq_len=case.seq, micro_batch=case.batch))


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_loops(case: hf_steps.Case) -> None:
    prepare = _fp32_score_bias if case.arch == "deepseek_v3" else None
    measured = hf_steps.measure_hand(case, STEPS, prepare)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_cases_span_the_families() -> None:
    """Every family the Trainer's run follows has a case, and the default suite one of each kind of
    attention (SDPA, eager, MLA) and of MLP (dense, routed experts)."""
    dense = {"qwen3", "phi3", "olmo2", "gemma2", "gemma3"}
    assert {c.arch for c in CASES} == {*dense, "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"}
    default = [c for c in CASES if not c.slow]
    assert {"phi3", "gemma2", "deepseek_v2", "mixtral"} <= {c.arch for c in default}
    assert len({repr(dataclasses.astuple(c)[1:]) for c in CASES}) == len(CASES)


# PEFT LoRA under the loop where the Trainer's run follows it on the family (hf_support: MOE_LORA_TARGETS, MLA's
# linears): peft_steps' loop (AdamW over the adapters), measured as tests/unit/test_timeline_hf_loop.py measures it
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("gate_proj", "up_proj", "down_proj")
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LORA_CASES = [
    ("qwen2-moe-attn-fp32", "qwen2_moe", QWEN2, MOE, {"targets": ATTN, "slow": True}),
    ("mixtral-qv-fp32", "mixtral", MIXTRAL, MOE, {"slow": True}),
    ("qwen3-moe-experts-fp32", "qwen3_moe", QWEN3, MOE, {"targets": EXPERTS, "slow": True}),
    ("qwen3-moe-experts-bf16-ckpt", "qwen3_moe", QWEN3, MOE, {"targets": EXPERTS, **BF16, "checkpointing": True}),
    ("deepseek-v3-all-fp32", "deepseek_v3", MLA + ROUTER, MLA_SHAPE, {"targets": MLA_LINEARS, "slow": True}),
    (
        "deepseek-v3-kv-b-o-autocast-ckpt",
        "deepseek_v3",
        MLA + ROUTER,
        MLA_SHAPE,
        {"targets": ("kv_b_proj", "o_proj"), "autocast": True, "checkpointing": True},
    ),
]


@pytest.mark.parametrize(
    ("tag", "arch", "extra", "shape", "fields"),
    [
        pytest.param(*c, marks=[pytest.mark.slow] if c[4].get("slow") or c[4].get("checkpointing") else [], id=c[0])
        for c in LORA_CASES
    ],
)
def test_lora_peak_equals_the_loops(tag: str, arch: str, extra: tuple, shape: dict, fields: dict) -> None:
    pytest.importorskip("peft")
    case = peft_steps.PeftCase(f"loop-lora-{tag}", arch=arch, extra=extra, **{**shape, **fields})
    model, opt, ids = peft_steps._setup(case)
    tracker = StorageTracker()
    tracker.track_module(model)
    tracker.track(ids)
    with tracker:
        peft_steps._steps(case, model, opt, ids, STEPS)
    spec = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = peft_steps.plan_of(case, "hf-loop")
    lora = HfLoraConfig.of(plan, spec.architecture, spec.moe.num_experts if spec.moe else 0)
    predicted = _run(spec, plan, TrainingWorkload(seq_len=case.seq, micro_batch=case.batch), lora)
    assert predicted == tracker.peak, f"{case.name}: {predicted:,} B predicted, {tracker.peak:,} B measured"


@pytest.mark.parametrize(
    ("name", "seq"),
    [
        ("phi3-mini", 1024),
        ("mixtral-8x7b", 512),
        ("qwen3-30b-a3b", 512),
        ("deepseek-v2-lite", 512),
        pytest.param("qwen3-8b", 1024, marks=pytest.mark.slow),
        pytest.param("olmo2-7b", 1024, marks=pytest.mark.slow),
        pytest.param("gemma2-9b", 2048, marks=pytest.mark.slow),
        pytest.param("gemma3-12b", 512, marks=pytest.mark.slow),
    ],
)
def test_estimate_answers_the_families_op_level(capsys, name: str, seq: int) -> None:
    """The families the issue lists, answered by the loop's run on a GPU (no longer by the phase model)."""
    memory = _estimate(capsys, [name, "--gpus", "1", "--runtime", "hf-loop", "--seq-len", str(seq)])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf-loop"


# gradient accumulation in the loop (hf_steps.measure_hand, peft_steps._steps: ``loss = out.loss / ga``,
# ``opt.step()`` every ``ga`` iterations), its gradients summed out of place under the tracker
TINY_LLAMA = dict(hidden=64, heads=2, kv_heads=1, ffn=172, vocab=512, layers=2, seq=64)
GA_CASES = [
    hf_steps.Case("loop-ga2-llama-fp32", **TINY_LLAMA, ga=2),
    hf_steps.Case("loop-ga3-llama-fp32-ckpt", ga=3, checkpointing=True, kv_heads=2, slow=True),
    hf_steps.Case("loop-ga2-autocast-small", **hf_steps.BASE_SMALL, autocast=True, ga=2, slow=True),
    hf_steps.Case("loop-ga2-llama-bf16-small", **hf_steps.BASE_SMALL, dtype="bfloat16", ga=2, slow=True),
    _family("qwen3", "ga2-bf16-ckpt", slow=True, **BF16, checkpointing=True, ga=2),
    _family("gemma2", "ga2-fp32", slow=True, ga=2),
    _case("mixtral-ga2-fp32", "mixtral", MIXTRAL, MOE, slow=True, ga=2),
]


def predict_accumulated(case: hf_steps.Case) -> int:
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = Plan(
        precision=case.precision, autocast=case.plan_autocast, recompute="full" if case.checkpointing else "none"
    )
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch, global_batch=case.batch * case.ga)
    return _run(model, plan, workload, ga=case.ga)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in GA_CASES], ids=lambda c: c.name
)
def test_accumulation_peak_equals_the_loops(case: hf_steps.Case) -> None:
    measured, predicted = hf_steps.measure_hand(case, STEPS), predict_accumulated(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize("save", [(), ("lm_head",)], ids=["adapters", "save-head"])
def test_lora_accumulation_under_checkpointing_equals_the_loops(save: tuple) -> None:
    """LoRA under checkpointing over two iterations a step: ``enable_input_require_grads``' leaf lives with the
    divided ``loss``'s graph (``hf_loop._graph``)."""
    pytest.importorskip("peft")
    fields = dict(hidden=64, heads=2, kv_heads=1, ffn=128, vocab=512, checkpointing=True, modules_to_save=save)
    case = peft_steps.PeftCase("loop-lora-ga2-ckpt", **fields)
    model, opt, ids = peft_steps._setup(case)
    tracker = StorageTracker()
    tracker.track_module(model)
    tracker.track(ids)
    with tracker:
        peft_steps._steps(case, model, opt, ids, STEPS, ga=2)
    spec = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = peft_steps.plan_of(case, "hf-loop")
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch, global_batch=2 * case.batch)
    predicted = _run(spec, plan, workload, HfLoraConfig.of(plan), ga=2)
    assert predicted == tracker.peak, f"{predicted:,} B predicted, {tracker.peak:,} B measured"


def test_lora_over_moe_is_answered_by_the_loops_run(capsys) -> None:
    """LoRA over an MoE model has no phase model (``reserve.run_only``): under ``hf-loop`` the loop's run
    answers it (``specs.job.check_moe_lora``), and the search's fast form takes that run too."""
    from memplan.costmodel import fast_run
    from memplan.specs.loader import load_model

    args = ["mixtral-8x7b", "--runtime", "hf-loop", "--finetune", "lora", "--lora-targets", "q_proj,v_proj"]
    memory = _estimate(capsys, [*args, "--seq-len", "512"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf-loop"
    plan = Plan(finetune="lora", lora_targets=("q_proj", "v_proj"))
    assert fast_run.applies(load_model("mixtral-8x7b"), plan, "hf-loop", "cuda")
