"""The plan's ``autocast``: a bfloat16 model with or without the Trainer's ``bf16=True`` (issue 28).

Under ``--runtime hf`` precision ``bf16`` is the Trainer's usual recipe, a bf16 model under
``bf16=True`` (accelerate's autocast); ``autocast: false`` names the other run, the bf16 model
trained as it is, which users get when they load a bf16 model and leave ``bf16`` off. Under
``hf-loop`` the default is the other way round, and ``autocast: true`` puts the hand loop's forward
under ``torch.autocast``: checked here against the real loop on CPU, equal to the byte (the
Trainer's cases without ``bf16=True`` run through the plan field in tests/unit/test_timeline_hf*.py).
Anything else (another precision, another runtime, not a boolean) is one line naming the field, exit 2.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from estimate_json import run_cli as _cli

from memplan.specs.plan import Plan, trainer_autocast

PREFIX = "memplan: error: "


def test_the_runtimes_recipe_unless_the_plan_says():
    table = {
        (precision, autocast, runtime): trainer_autocast(Plan(precision=precision, autocast=autocast), runtime)
        for precision, autocast in [
            ("bf16", None), ("bf16", True), ("bf16", False), ("bf16-mixed", None), ("fp32", None),
        ]
        for runtime in ("hf", "hf-loop")
    }  # fmt: skip
    assert table == {
        ("bf16", None, "hf"): True, ("bf16", None, "hf-loop"): False,
        ("bf16", True, "hf"): True, ("bf16", True, "hf-loop"): True,
        ("bf16", False, "hf"): False, ("bf16", False, "hf-loop"): False,
        ("bf16-mixed", None, "hf"): True, ("bf16-mixed", None, "hf-loop"): True,
        ("fp32", None, "hf"): False, ("fp32", None, "hf-loop"): False,
    }  # fmt: skip


def _estimate(*flags: str) -> dict:
    code, out, err = _cli("estimate", "llama3-8b", "--gpu", "h100-sxm", "--format", "json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_no_autocast_is_an_op_level_plan_of_its_own():
    """``--no-autocast`` is answered by the Trainer's run, with more bytes than the recipe's LoRA: each
    adapter's matmuls run in fp32 on PEFT's fp32 cast of the bf16 input, saved for the backward, where
    autocast runs them in bf16 (``hf_lora.py``); the resolved plan says which ran."""
    recipe = _estimate("--finetune", "lora", "--lora-targets", "all-linear")
    plain = _estimate("--finetune", "lora", "--lora-targets", "all-linear", "--no-autocast")
    assert recipe["plan"]["autocast"] is True and plain["plan"]["autocast"] is False
    assert recipe["memory"]["model"] == plain["memory"]["model"] == "op-level"
    assert plain["memory"]["peak"]["allocated"] > recipe["memory"]["peak"]["allocated"]
    loop = _estimate("--runtime", "hf-loop")
    assert loop["plan"]["precision"] == "bf16" and loop["plan"]["autocast"] is False
    assert _estimate()["plan"]["autocast"] is None  # the bundled trainer: not the Trainer's switch


@pytest.mark.parametrize(
    ("flags", "field", "words"),
    [
        (["--finetune", "lora", "--precision", "bf16-mixed", "--no-autocast"], "--autocast", "by definition"),
        (["--finetune", "lora", "--precision", "fp32", "--autocast"], "--autocast", "bf16-mixed"),
        (["--finetune", "lora", "--precision", "bf16-master", "--autocast"], "--autocast", "DeepSpeed"),
        (["--no-autocast"], "--autocast", "runtime hf or hf-loop (got memplan)"),
        (["--runtime", "megatron", "--precision", "bf16", "--autocast"], "--autocast", "(got megatron)"),
    ],
    ids=["bf16-mixed", "fp32", "bf16-master", "bundled-trainer", "megatron"],
)
def test_a_meaningless_autocast_flag_is_one_line(flags, field, words):
    code, out, err = _cli("estimate", "llama3-8b", *flags)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{PREFIX}command line: {field}: ") and words in err, err


@pytest.mark.parametrize(
    ("plan", "words"),
    [
        ({"finetune": "lora", "autocast": "yes"}, "valid boolean"),
        ({"finetune": "lora", "precision": "fp32", "autocast": False}, "only meaningful with precision: bf16"),
        ({"autocast": True}, "only meaningful under runtime hf or hf-loop"),
    ],
    ids=["not-a-boolean", "fp32", "bundled-trainer"],
)
def test_a_bad_autocast_in_a_plan_file_names_the_file_and_field(tmp_path, plan, words):
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps({"plan": plan}))
    code, out, err = _cli("estimate", "llama3-8b", "--plan", str(path))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{PREFIX}{path}: plan.autocast: ") and words in err, err


def test_validate_refuses_it_with_the_reason():
    from memplan.validate.support import TrainerUnsupported, check_plan

    with pytest.raises(TrainerUnsupported, match="autocast: the transformers Trainer's bf16=True"):
        check_plan(Plan(precision="bf16", autocast=False))


# ---- the hand loop under autocast over a bf16 model, against the loop itself on CPU ----


def _hand_cases():
    hf_steps = pytest.importorskip("hf_steps")
    base = {c.name: c for c in hf_steps.HAND}
    return [
        dataclasses.replace(base[name], name=f"{name}-autocast", autocast=True)
        for name in ("llama-bf16-mha-small", "llama-bf16-gqa-ckpt-small", "qwen2-bf16-tied-small")
    ]


@pytest.mark.parametrize("name", ["llama-bf16-mha-small", "llama-bf16-gqa-ckpt-small", "qwen2-bf16-tied-small"])
def test_the_hand_loop_under_autocast_over_a_bf16_model_peaks_where_the_run_does(name):
    pytest.importorskip("transformers")
    import hf_steps

    from memplan.costmodel.timeline.hf_loop import hf_loop_run
    from memplan.costmodel.timeline.hf_trainer import hf_dims
    from memplan.specs.loader import model_from_data
    from memplan.specs.workload import TrainingWorkload

    case = next(c for c in _hand_cases() if c.name == f"{name}-autocast")
    assert (case.precision, case.plan_autocast, case.runtime) == ("bf16", True, "hf-loop")
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = Plan(precision="bf16", autocast=True, recompute="full" if case.checkpointing else "none")
    d = hf_dims(model, TrainingWorkload(seq_len=case.seq, micro_batch=case.batch), plan, "hf-loop")
    assert d.autocast and d.pd == 2
    run_ = hf_loop_run(
        d, model.tied_embeddings, "cpu_flash", steps=3, qkv_bias=model.qkv_bias, window_layers=False,
        inplace_accumulate=False,
    )  # fmt: skip
    predicted, measured = run_.peak()[0], hf_steps.measure_peak(case, steps=3)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
