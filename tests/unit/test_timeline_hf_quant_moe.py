"""QLoRA and LLM.int8 over an MoE base (Mixtral, Qwen3-MoE, Qwen2-MoE) under the real ``transformers.Trainer`` and
the real hand-written loop (``--runtime hf-loop``) on CPU: a tiny random model saved and loaded back through
``BitsAndBytesConfig`` (nf4 with and without double quantization, LLM.int8), ``prepare_model_for_kbit_training``,
``get_peft_model`` (tests/accuracy/peft_steps.py); the peak of live storages over three optimizer steps
(``StorageTracker``) equal to the byte; the hand-written loop under ``save_on_cpu`` too
(tests/accuracy/offload_steps.py's loop, the host copies at most equal as well; without checkpointing, PEFT's
reentrant and transformers' non-reentrant checkpoint).

What loading such a base does (transformers 5.23, bitsandbytes 0.50.2, PEFT 0.21.2): bitsandbytes replaces the
``nn.Linear`` alone, the attention's q/k/v/o_proj and Qwen2-MoE's shared expert with its ``shared_expert_gate``
(``hf_bnb.Bnb4bit.quantized``); the router (``*TopKRouter``, its own module) and the experts' 3-D ``gate_up_proj``
and ``down_proj`` stay in the loaded dtype, and ``prepare_model_for_kbit_training`` casts them to fp32 with the
norms (``test_bitsandbytes_replaces_the_linears_alone``). So the sparse block runs as over a float base
(``hf_moe.py``), in the fp32 stream a quantized base keeps.
"""

from __future__ import annotations

import pytest
from hf_predict import case_quant, hf_predict

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import peft_steps  # noqa: E402
from offload_steps import OffloadCase, measure  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402
from test_timeline_hf_int8_families import _loop_model, measure_loop  # noqa: E402
from test_timeline_hf_loop_families import MLA, ROUTER, V2  # noqa: E402

from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_loop import hf_loop_run  # noqa: E402
from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
MIXTRAL = (("num_local_experts", 4), ("num_experts_per_tok", 2))
QWEN3 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64), ("norm_topk_prob", True))
QWEN2 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))
QWEN2 += (("shared_expert_intermediate_size", 96),)
EXTRA = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3, "qwen2_moe": QWEN2}
# DeepSeek-V3 (q_a / q_b, its sigmoid router, one dense layer first) and V2 (q_proj, greedy softmax router): MLA's
# linears, kv_a_proj_with_mqa among them, and the shared experts and dense MLP quantized
MLA_EXTRA = {"deepseek_v3": MLA + ROUTER, "deepseek_v2": V2}
MLA_TARGETS = {"deepseek_v3": ("q_a_proj", "kv_a_proj_with_mqa"), "deepseek_v2": ("q_proj", "kv_b_proj", "o_proj")}
QUANTS = {"nf4": dict(quant="nf4"), "nf4-dq": dict(quant="nf4", double_quant=True), "int8": dict(quant="int8")}


def _case(arch: str, quant: str, tag: str = "", slow: bool = True, **fields) -> PeftCase:
    name = f"qmoe-{arch}-{quant}" + (f"-{tag}" if tag else "")
    if arch in MLA_EXTRA:  # test_timeline_hf_loop_families' MLA shape: two KV heads
        mla = {"extra": MLA_EXTRA[arch], "kv_heads": 2, "targets": MLA_TARGETS[arch]}
        return PeftCase(name, **{**TINY, "arch": arch, **mla, **QUANTS[quant], "slow": slow, **fields})
    return PeftCase(name, **{**TINY, "arch": arch, "extra": EXTRA[arch], **QUANTS[quant], "slow": slow, **fields})


def _param(case: PeftCase):
    return pytest.param(case, marks=pytest.mark.slow, id=case.name) if case.slow else pytest.param(case, id=case.name)


def _once(cases: list[PeftCase]) -> list[PeftCase]:
    """Each case once, as first listed (the default ones lead)."""
    seen: dict[str, PeftCase] = {}
    for case in cases:
        seen.setdefault(case.name, case)
    return list(seen.values())


def predict(case: PeftCase, runtime: str = "hf") -> int:
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = plan_of(case, runtime)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, runtime, device="cpu") is None, case.name
    if runtime == "hf":
        return hf_predict(case, plan, subclass_like=True).peak()[0]
    timeline = hf_loop_run(
        hf_dims(model, workload, plan, "hf-loop"), model.tied_embeddings, "cpu_flash", steps=STEPS,
        qkv_bias=model.qkv_bias, arch=model.architecture, extra=family_config(model),
        lora=HfLoraConfig.of(plan, model.architecture, model.moe.num_experts),  # as hf_loop_plan_run builds it
        quant=case_quant(case, plan), inplace_accumulate=False,
        subclass_like=True,  # the tracker's dispatch mode over the experts (hf_moe_ops.zeros_then_put)
    )  # fmt: skip
    return timeline.peak()[0]


CKPT = dict(checkpointing=True)
TRAINER = [
    _case("mixtral", "nf4", slow=False),
    _case("deepseek_v3", "int8", slow=False),  # kv_a_proj_with_mqa an 8-bit linear with its adapters
    _case("qwen2_moe", "int8", "ckpt", slow=False, **CKPT),
    _case("qwen3_moe", "nf4-dq", "bf16", slow=False, dtype="bfloat16"),
    *(_case(arch, q) for arch in EXTRA for q in QUANTS),
    *(_case(arch, q, "ckpt", **CKPT) for arch in EXTRA for q in QUANTS),
    _case("mixtral", "nf4", "fp32-compute", compute_dtype="float32"),
    _case("qwen2_moe", "nf4", "all-linear", targets=("all-linear",)),
    _case("mixtral", "nf4-dq", "bf16-all-linear", dtype="bfloat16", targets=("all-linear",)),  # ParamWrapper
    *(_case(arch, q) for arch in MLA_EXTRA for q in QUANTS),
    _case("deepseek_v3", "nf4-dq", "bf16-ckpt", dtype="bfloat16", **CKPT),
    _case("deepseek_v2", "int8", "ckpt", **CKPT),
    _case("qwen3_moe", "int8", "attn-bf16-ckpt", dtype="bfloat16", targets=("q_proj", "k_proj", "v_proj", "o_proj")),
]
TRAINER = _once(TRAINER)


@pytest.mark.parametrize("case", [_param(c) for c in TRAINER])
def test_the_trainer_over_a_quantized_moe_base_peaks_where_the_run_does(case: PeftCase) -> None:
    measured, predicted = hf_peft_steps.measure(case, steps=STEPS), predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


LOOP = [
    _case("qwen3_moe", "int8", "loop-ckpt", slow=False, **CKPT),
    *(_case(arch, q, "loop") for arch in EXTRA for q in QUANTS),
    *(_case(arch, q, "loop-ckpt", **CKPT) for arch in EXTRA for q in QUANTS),
    _case("mixtral", "nf4", "loop-bf16", dtype="bfloat16"),
    _case("qwen2_moe", "nf4", "loop-all-linear", targets=("all-linear",)),  # nn.Linear adapters alone
    # PEFT's ParamWrapper over the fp32 experts and the router (all-linear on Mixtral, Qwen3-MoE)
    _case("mixtral", "nf4-dq", "loop-bf16-all-linear", dtype="bfloat16", targets=("all-linear",)),
    _case("qwen3_moe", "nf4", "loop-all-linear", targets=("all-linear",)),
    _case("mixtral", "int8", "loop-bf16-all-linear", dtype="bfloat16", targets=("all-linear",)),
    *(_case(arch, q, "loop") for arch in MLA_EXTRA for q in QUANTS),
    _case("deepseek_v3", "nf4", "loop-ckpt", **CKPT),
    _case("deepseek_v2", "nf4-dq", "loop-bf16-ckpt", dtype="bfloat16", **CKPT),
]
LOOP = _once(LOOP)


@pytest.mark.parametrize("case", [_param(c) for c in LOOP])
def test_the_loop_over_a_quantized_moe_base_peaks_where_the_run_does(case: PeftCase) -> None:
    """peft_steps' loop (``out`` kept to the next forward), checkpointing as transformers enables it
    (``use_reentrant=False``) with ``enable_input_require_grads`` (test_timeline_hf_int8_families.measure_loop)."""
    measured, predicted = measure_loop(case), predict(case, "hf-loop")
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


# save_on_cpu around the hand-written loop's forward and backward (tests/accuracy/offload_steps.py's loop and
# emulation: every save copied to the host, the fp32 experts' grouped_mm saves too), with and without the
# checkpointing prepare_model_for_kbit_training turns on (reentrant: its re-runs' saves packed in the backward), and
# under transformers' non-reentrant checkpoint (``_NON_REENTRANT``: the checkpoint's own hooks, innermost, keep the
# layers' saves; save_on_cpu copies what lies outside them)
SOC = "soc"
SAVE_ON_CPU = [
    _case("deepseek_v3", "int8", SOC, slow=False),
    _case("qwen2_moe", "int8", f"{SOC}-ckpt", slow=False, **CKPT),
    _case("mixtral", "nf4", SOC),
    _case("mixtral", "nf4", f"{SOC}-ckpt", **CKPT),
    _case("mixtral", "nf4-dq", f"{SOC}-recipe", dtype="bfloat16", autocast=True, **CKPT),  # QLoRA's recipe
    _case("qwen3_moe", "int8", SOC),
    _case("qwen3_moe", "int8", f"{SOC}-autocast-ckpt", autocast=True, **CKPT),
    _case("qwen3_moe", "nf4-dq", f"{SOC}-ckpt", **CKPT),
    _case("qwen2_moe", "nf4", SOC),
    _case("qwen2_moe", "nf4-dq", f"{SOC}-recipe", dtype="bfloat16", autocast=True, **CKPT),
    _case("deepseek_v2", "nf4-dq", f"{SOC}-bf16", dtype="bfloat16"),
    _case("deepseek_v2", "int8", f"{SOC}-ckpt", **CKPT),
    _case("deepseek_v3", "nf4-dq", f"{SOC}-bf16-ckpt", dtype="bfloat16", **CKPT),
    _case("deepseek_v3", "nf4-dq", f"{SOC}-recipe", dtype="bfloat16", autocast=True, **CKPT),
]
_NON_REENTRANT = [
    _case("mixtral", "nf4", f"{SOC}-nonreentrant", slow=False, **CKPT),
    _case("qwen3_moe", "int8", f"{SOC}-nonreentrant", **CKPT),
    _case("qwen2_moe", "nf4-dq", f"{SOC}-recipe-nonreentrant", dtype="bfloat16", autocast=True, **CKPT),
    _case("deepseek_v3", "nf4", f"{SOC}-nonreentrant", **CKPT),
    _case("deepseek_v2", "int8", f"{SOC}-bf16-nonreentrant", dtype="bfloat16", **CKPT),
]


def predict_save_on_cpu(case: PeftCase, reentrant: bool | None = None) -> tuple[int, int]:
    """(peak, host copies at most) of the loop's run under ``save_on_cpu`` (``reentrant``: the plan's
    ``use_reentrant``, None for the loop's default, PEFT's reentrant checkpoint over a quantized base)."""
    from memplan.specs.plan import checkpoint_reentrant

    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    update = {"offload_activations": "cpu"} | ({} if reentrant is None else {"use_reentrant": reentrant})
    plan = plan_of(case, "hf-loop").model_copy(update=update)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, "hf-loop", device="cpu") is None, case.name
    timeline = hf_loop_run(
        hf_dims(model, workload, plan, "hf-loop"), model.tied_embeddings, "cpu_flash", steps=STEPS,
        qkv_bias=model.qkv_bias, arch=model.architecture, extra=family_config(model),
        lora=HfLoraConfig.of(plan, model.architecture, model.moe.num_experts), quant=case_quant(case, plan),
        inplace_accumulate=False, offload=True, reentrant=checkpoint_reentrant(plan, "hf-loop"), subclass_like=True,
    )  # fmt: skip
    return timeline.peak()[0], timeline.host_peak


def _soc_params():
    cases = [(c, None) for c in SAVE_ON_CPU] + [(c, False) for c in _NON_REENTRANT]
    return [pytest.param(c, r, id=c.name, marks=pytest.mark.slow if c.slow else ()) for c, r in cases]


@pytest.mark.parametrize(("case", "reentrant"), _soc_params())
def test_save_on_cpu_around_the_loop_over_a_quantized_moe_base_equals_the_loops(case: PeftCase, reentrant) -> None:
    """The peak and the host copies of offload_steps' ``save_on_cpu`` loop (``reentrant`` False: transformers'
    non-reentrant checkpoint with ``enable_input_require_grads``, test_timeline_hf_int8_families._loop_model)."""
    model = _loop_model(case) if reentrant is False else None
    peak, host = measure(OffloadCase(case.name, case, "save_on_cpu"), steps=STEPS, model=model)
    predicted = predict_save_on_cpu(case, reentrant)
    assert predicted == (peak, host), f"{case.name}: {predicted} predicted (peak, host), {(peak, host)} measured"


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_bitsandbytes_replaces_the_linears_alone(arch: str) -> None:
    """A tiny Qwen2-MoE or DeepSeek-V3 loaded in 4 bits: ``Linear4bit`` where ``Bnb4bit.quantized`` says (the
    attention's projections, MLA's ``kv_a_proj_with_mqa``, the shared experts', Qwen2-MoE's
    ``shared_expert_gate``, DeepSeek's dense MLP), the router and the 3-D experts fp32 after
    ``prepare_model_for_kbit_training`` over a bf16 load, as the norms."""
    import bitsandbytes as bnb
    import peft

    from memplan.costmodel.timeline.hf_bnb import Bnb4bit

    case = _case(arch, "nf4", dtype="bfloat16", layers=2 if arch == "deepseek_v3" else 1)
    model = peft.prepare_model_for_kbit_training(peft_steps._quantized_base(case), use_gradient_checkpointing=False)
    layer = dict(model.named_modules())
    linears = {n for n, m in layer.items() if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)}
    four_bit = {n for n in linears if isinstance(layer[n], bnb.nn.Linear4bit)}
    assert four_bit == linears == {n for n in linears if Bnb4bit.quantized(n)}
    named = {
        "qwen2_moe": "model.layers.0.mlp.shared_expert_gate",
        "deepseek_v3": "model.layers.1.self_attn.kv_a_proj_with_mqa",
    }
    assert named[arch] in four_bit and not any(n.endswith(".mlp.gate") for n in linears)
    floats = {n: p.dtype for n, p in model.named_parameters() if ".mlp.gate." in n or ".experts." in n}
    assert floats and set(floats.values()) == {torch.float32} and not any(Bnb4bit.quantized(n) for n in floats)


@pytest.mark.parametrize(
    ("update", "runtime", "device", "why"),
    [
        ({}, "hf", "cuda", "a quantized MoE base other than"),  # the fp32 experts' grouped_mm on CUDA: not checked
        ({"dp": 2}, "hf", "cpu", None),  # DDP and FSDP2: test_timeline_hf_quant_moe_ranks.py
        ({"dp": 2, "zero": 3}, "hf", "cpu", None),
        ({"dp": 2, "zero": 2, "quant": "int8"}, "hf", "cpu", "an LLM.int8 base under the Trainer's FSDP"),
        ({"dp": 2}, "hf", "cuda", "a quantized MoE base other than"),
        ({"dp": 2, "offload_activations": "cpu"}, "hf", "cpu", None),  # TRL's: test_timeline_hf_quant_moe_ranks.py
        ({"offload_activations": "cpu"}, "hf-loop", "cpu", None),  # save_on_cpu around the hand loop: followed
        ({"offload_activations": "cpu"}, "hf-loop", "cuda", "a quantized MoE base other than"),
        ({}, "hf", "cpu", None),
        ({"quant": "int8"}, "hf-loop", "cpu", None),
    ],
)
def test_what_the_run_follows_over_a_quantized_moe_base(update: dict, runtime: str, device: str, why) -> None:
    from memplan.specs.loader import load_model
    from memplan.specs.plan import Plan

    model = load_model("mixtral-8x7b")
    fields = dict(precision="bf16", finetune="qlora", quant="nf4", lora_targets=("q_proj", "v_proj"))
    plan = Plan(**{**fields, **update})
    reason = hf_supported(model, plan, TrainingWorkload(seq_len=512, micro_batch=1), runtime, device=device)
    assert reason == why or (why is not None and reason.startswith(why)), reason


def test_save_on_cpu_over_a_quantized_moe_base_is_estimated_by_the_run() -> None:
    """``save_on_cpu`` around the hand-written loop over a quantized MoE base (refused until 2026-11-29): exit 0,
    the op-level run's answer, the host copies counted (the fp32 experts among the saves copied)."""
    import json
    import subprocess
    import sys

    args = ["estimate", "mixtral-8x7b", "--runtime", "hf-loop", "--finetune", "qlora", "--quant", "nf4"]
    args += ["--lora-targets", "q_proj", "--device", "cpu", "--seq-len", "256"]
    args += ["--offload-activations", "cpu", "--format", "json"]
    proc = subprocess.run([sys.executable, "-m", "memplan.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    memory = json.loads(proc.stdout)["memory"]
    assert memory["model"] == "op-level" and memory["offload"]["cpu"] > 0, memory["model_reason"]
