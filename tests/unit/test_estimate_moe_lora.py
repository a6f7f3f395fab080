"""PEFT LoRA over an MoE model through ``memplan estimate`` (issue 28): answered by the op-level run of
transformers' Trainer (``timeline.hf_moe``; the run against the real Trainer on CPU, to the byte:
tests/unit/test_timeline_hf_moe.py, ``test_lora_on_attention_equals_the_trainers``), every other such
plan refused before either model runs (``specs.job.check_moe_lora``), never handed to the phase model,
whose LoRA layer (``lora.hf_layer``) counts a dense MLP of ``ffn_size`` where the experts are. The
callback on a tiny Mixtral: tests/integrations/test_transformers_callback.py; the refusals on the
command line: tests/cli/test_bad_input.py."""

from __future__ import annotations

import json

import pytest

from memplan.cli.app import run
from memplan.costmodel.lora import trainable_params
from memplan.costmodel.reserve import plan_run
from memplan.errors import MemplanError
from memplan.specs.job import check_compatible
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

ATTN = "q_proj,k_proj,v_proj,o_proj"


def _estimate(capsys, *args: str) -> dict:
    code = run(["estimate", *args, "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    ("name", "args", "targets", "saved"),
    [
        ("mixtral-8x7b", ["--lora-targets", ATTN, "--precision", "bf16", "--seq-len", "1024"], ATTN, ()),
        pytest.param(
            "qwen3-30b-a3b",
            ["--precision", "bf16-mixed", "--modules-to-save", "lm_head"],
            "q_proj,v_proj",
            ("lm_head",),
            marks=pytest.mark.slow,  # 48 layers: 3 s on 2 shared cores
        ),
    ],
)
def test_lora_over_moe_is_answered_by_the_run(capsys, name: str, args: list[str], targets: str, saved: tuple):
    data = _estimate(capsys, name, "--runtime", "hf", "--finetune", "lora", "--gpu", "h200", *args)
    memory = data["memory"]
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf"
    # the adapters (and the head copy) alone are trained, in fp32: fp32 gradients, fused AdamW's two fp32
    # moments and its fp32 ``step`` tensor for each (torch/optim/adam.py ``_init_group``: a tensor step when fused)
    model = load_model(name)
    trained = trainable_params(model, tuple(targets.split(",")), 16, saved)
    tensors = 2 * len(targets.split(",")) * model.num_layers + len(saved)
    assert memory["model_states"]["gradients"] == 4 * trained
    assert memory["model_states"]["optimizer_states"] == 8 * trained + 4 * tensors


def test_the_advice_screens_a_change_by_the_run_not_the_phase_model(capsys) -> None:
    """Mixtral's bf16 weights alone overflow an H100: the one change the Trainer's run follows (full
    recomputation) is screened by the run, so its figure is what ``estimate`` says of the changed plan
    (the phase model's, counting a dense MLP, said 100.8 GB where the run says 94.6 GB)."""
    base = ["mixtral-8x7b", "--runtime", "hf", "--finetune", "lora", "--lora-targets", ATTN]
    base += ["--precision", "bf16", "--seq-len", "1024", "--gpu", "h100-sxm"]
    data = _estimate(capsys, *base)
    assert not data["fits"]
    (change,) = [s for s in data["suggestions"] if s["change"] == "full recomputation"]
    changed = _estimate(capsys, *base, "--recompute", "full")
    assert changed["memory"]["model"] == "op-level"
    assert change["reserved_bytes"] == changed["memory"]["peak"]["reserved"]


def test_a_gpu_the_run_declines_stops_the_estimate_rather_than_fall_back() -> None:
    """Below compute capability 8.0 transformers runs its own ``grouped_mm`` fallback, which the run does not
    follow: the plan is refused (the phase model would count a dense MLP), not estimated by the phases."""
    model = load_model("mixtral-8x7b").model_copy(update={"num_layers": 2})
    plan = Plan(precision="bf16", finetune="lora", lora_targets=("q_proj", "v_proj"))
    workload = TrainingWorkload(seq_len=256, micro_batch=1)
    check_compatible(model, workload, plan, "hf")
    old = load_gpu("a100-80gb").model_copy(update={"compute_capability": (7, 0)})
    with pytest.raises(MemplanError) as err:
        plan_run(model, workload, plan, "hf", "cuda", old)
    assert err.value.field == "plan.finetune" and "grouped_mm fallback" in err.value.reason
    _, which = plan_run(model, workload, plan.model_copy(update={"finetune": "full"}), "hf", "cuda", old)
    assert which.startswith("phases (MoE experts below compute capability 8.0")  # full training: the phases


@pytest.mark.parametrize(
    ("runtime", "plan", "field", "reason"),
    [
        ("memplan", {}, "plan.finetune", "under --runtime hf or hf-loop alone"),
        ("megatron", {}, "plan.finetune", "under --runtime hf or hf-loop alone"),
        ("hf-loop", {"lora_targets": ("q_proj", "gate_proj")}, "plan.lora_targets", "matches no module of Mixtral"),
        ("hf", {"lora_targets": ("q_proj", "gate_proj")}, "plan.lora_targets", "matches no module of Mixtral"),
        ("hf", {"lora_targets": ("all-linear",), "lora_dropout": 0.1}, "plan.lora_dropout", "ParamWrapper raises"),
        ("hf", {"lora_targets": ("q_proj", "down_proj")}, "plan.lora_targets", "down_proj over the experts"),
        ("hf", {"recompute": "selective"}, "plan.finetune", "this recompute"),
        ("hf", {"precision": "bf16-master"}, "plan.finetune", "precision bf16-master"),
    ],
)
def test_what_neither_model_answers_is_refused_naming_the_field(runtime: str, plan: dict, field: str, reason: str):
    model = load_model("mixtral-8x7b")
    plan = Plan(**{"precision": "bf16", "finetune": "lora", **plan})
    with pytest.raises(MemplanError) as err:
        check_compatible(model, TrainingWorkload(seq_len=1024, micro_batch=1), plan, runtime)
    assert err.value.field == field and reason in err.value.reason, err.value.reason


def test_another_moe_family_is_refused() -> None:
    with pytest.raises(MemplanError) as err:
        check_compatible(load_model("llama4-scout"), TrainingWorkload(seq_len=64), Plan(finetune="lora"), "hf")
    assert err.value.field == "plan.finetune" and "another MoE family" in err.value.reason
