"""The plan's ``use_reentrant``: which of torch's checkpoints transformers' gradient checkpointing runs (issue 28).

Default: what a user gets without saying (``specs.plan.checkpoint_reentrant``): under ``hf`` the Trainer's
``use_reentrant=False``; under ``hf-loop`` over a quantized base PEFT's ``prepare_model_for_kbit_training(model)``
(no ``use_reentrant`` reaches torch, which takes True), else ``gradient_checkpointing_enable()`` (False). The flag,
the plan file, the resolved plan, the exporters and ``MemplanCallback`` say it; a bad value is one stderr line
naming the file (or flag) and the field, exit 2. The run's bytes: tests/unit/test_timeline_reentrant.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from estimate_json import run_cli as _cli

from memplan.specs.plan import Plan, checkpoint_reentrant

PREFIX = "memplan: error: "


def _export(target: str, flags: list[str], given: bool | None) -> str:
    """``memplan export`` of llama3-8b under the Trainer's runtime, fully recomputed at 1,024 tokens."""
    reentrant = ["--use-reentrant"] * bool(given)
    args = ["--model", "llama3-8b", "--to", target, "--runtime", "hf", "--recompute", "full", "--seq-len", "1024"]
    code, out, err = _cli("export", *args, *flags, *reentrant)
    assert code == 0, err
    return out


def test_each_runtime_s_default_unless_the_plan_says():
    table = {
        (quant, given, runtime): checkpoint_reentrant(
            Plan(recompute="full", use_reentrant=given, **({"finetune": "qlora"} if quant else {})), runtime
        )
        for quant in (False, True)
        for given in (None, True, False)
        for runtime in ("hf", "hf-loop")
    }
    assert table == {
        (False, None, "hf"): False, (False, None, "hf-loop"): False,
        (False, True, "hf"): True, (False, True, "hf-loop"): True,
        (False, False, "hf"): False, (False, False, "hf-loop"): False,
        (True, None, "hf"): False, (True, None, "hf-loop"): True,
        (True, True, "hf"): True, (True, True, "hf-loop"): True,
        (True, False, "hf"): False, (True, False, "hf-loop"): False,
    }  # fmt: skip
    assert not checkpoint_reentrant(Plan(finetune="qlora"), "hf-loop")  # nothing checkpointed


def _estimate(*flags: str, model: str = "llama3-8b") -> dict:
    code, out, err = _cli("estimate", model, "--gpu", "h100-sxm", "--seq-len", "512", "--format", "json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_the_resolved_plan_says_which_checkpoint_ran():
    """The Trainer's QLoRA recipe runs the non-reentrant checkpoint, the loop's the reentrant one (op-level both)."""
    qlora = ("--finetune", "qlora", "--recompute", "full")
    trainer, loop = _estimate("--runtime", "hf", *qlora), _estimate("--runtime", "hf-loop", *qlora)
    assert trainer["plan"]["use_reentrant"] is False and loop["plan"]["use_reentrant"] is True
    assert trainer["memory"]["model"] == loop["memory"]["model"] == "op-level"
    assert _estimate("--runtime", "hf", "--finetune", "lora")["plan"]["use_reentrant"] is None  # nothing checkpointed


def test_a_plan_that_says_it_is_answered_so():
    """Phi-3-mini's full fine-tuning under the Trainer peaks in a layer's backward: with ``--use-reentrant`` the
    recomputed layer output (b, s, h bf16: 512 x 3072 x 2 = 3,145,728 B) is held through the layer's nested backward,
    and no layer's saves are made in the forward; other bytes, op-level both."""
    base = ("--runtime", "hf", "--recompute", "full")
    plain, said = _estimate(*base, model="phi3-mini"), _estimate(*base, "--use-reentrant", model="phi3-mini")
    assert (plain["plan"]["use_reentrant"], said["plan"]["use_reentrant"]) == (False, True)
    assert plain["memory"]["model"] == said["memory"]["model"] == "op-level"
    assert said["memory"]["peak"]["allocated"] != plain["memory"]["peak"]["allocated"]


def test_under_activation_offload_and_over_ranks_the_run_answers():
    """Under activation offload (TRL's hooks under the Trainer, ``save_on_cpu`` under the hand-written loop: QLoRA's
    default checkpoint there; followed on CPU) the reentrant checkpoint is followed since 2026-11-29
    (tests/unit/test_timeline_hf_reentrant_offload.py; declined to the phase model in one line before), and over two
    ranks (test_timeline_hf_reentrant_ranks.py)."""
    base = ("--recompute", "full", "--use-reentrant", "--offload-activations", "cpu", "--device", "cpu")
    for runtime in ("hf", "hf-loop"):
        memory = _estimate("--runtime", runtime, *base)["memory"]
        assert memory["model"] == "op-level" and memory["model_reason"] is None, memory["model_reason"]
    memory = _estimate("--runtime", "hf-loop", "--finetune", "qlora", *base)
    assert memory["plan"]["use_reentrant"] is True and memory["memory"]["model"] == "op-level"
    assert _estimate("--runtime", "hf", "--recompute", "full", "--use-reentrant", "--gpus", "2")["memory"]["model"] == (
        "op-level"
    )


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--use-reentrant"], "only meaningful under runtime hf or hf-loop (got memplan)"),
        (["--runtime", "hf", "--no-use-reentrant"], "only meaningful with recompute: full"),
    ],
    ids=["bundled-trainer", "no-checkpointing"],
)
def test_a_meaningless_flag_is_one_line(flags, words):
    code, out, err = _cli("estimate", "llama3-8b", *flags)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{PREFIX}command line: --use-reentrant: ") and words in err, err


@pytest.mark.parametrize(
    ("plan", "words"),
    [
        ({"recompute": "full", "use_reentrant": "yes"}, "valid boolean"),
        ({"use_reentrant": True}, "only meaningful with recompute: full"),
    ],
    ids=["not-a-boolean", "no-checkpointing"],
)
def test_a_bad_value_in_a_plan_file_names_the_file_and_field(tmp_path, plan, words):
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps({"runtime": "hf", "plan": plan}))
    code, out, err = _cli("estimate", "llama3-8b", "--plan", str(path))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{PREFIX}{path}: plan.use_reentrant: ") and words in err, err


@pytest.mark.parametrize("target", ["hf-trainer", "axolotl"])
@pytest.mark.parametrize("given", [None, True])
def test_the_exporters_write_what_the_plan_says(tmp_path, target, given):
    """``gradient_checkpointing_kwargs``' ``use_reentrant``: the plan's (the Trainer's False by default), read back."""
    import yaml

    from memplan.export import axolotl, hf_trainer

    out = _export(target, ["--finetune", "qlora"], given)
    cfg = yaml.safe_load(out)
    kwargs = (cfg["training_arguments"] if target == "hf-trainer" else cfg)["gradient_checkpointing_kwargs"]
    assert kwargs == {"use_reentrant": bool(given)}
    assert (hf_trainer if target == "hf-trainer" else axolotl).parse(out)["use_reentrant"] == given


@pytest.mark.parametrize("target", ["hf-trainer", "axolotl"])
@pytest.mark.parametrize(
    ("finetune", "given", "off"), [("qlora", True, True), ("qlora", None, False), ("full", True, False)]
)
def test_a_peft_model_over_ddp_under_the_reentrant_checkpoint_finds_no_unused_parameters(target, finetune, given, off):
    """The Trainer turns ``find_unused_parameters`` on over a PEFT model, which fails in the first backward under the
    reentrant checkpoint (tests/unit/test_timeline_hf_reentrant_ranks.py): the export turns it off, as estimated."""
    import yaml

    out = _export(target, ["--finetune", finetune, "--gpus", "2"], given)
    cfg = yaml.safe_load(out)
    args = cfg["training_arguments"] if target == "hf-trainer" else cfg
    assert ("ddp_find_unused_parameters" in args) is off
    if off:
        assert args["ddp_find_unused_parameters"] is False


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (None, False),  # transformers' default: {"use_reentrant": False}
        ({}, False),  # `kwargs or None`
        ({"use_reentrant": True}, True),
        ({"use_reentrant": False}, False),
        ({"preserve_rng_state": True}, True),  # no use_reentrant reaches torch: its default
        ({"every_n_layers": 1}, False),  # popped by the Trainer, then `or None`
    ],
)
def test_the_callback_reads_the_trainer_s_checkpoint(kwargs, expected):
    from memplan.integrations.transformers import _checkpointing

    args = SimpleNamespace(activation_checkpointing=True, activation_checkpointing_kwargs=kwargs)
    assert _checkpointing(args) == {"recompute": "full", "use_reentrant": expected}
    assert _checkpointing(SimpleNamespace(gradient_checkpointing=False)) == {"recompute": "none"}


def test_the_callback_reads_real_training_arguments(tmp_path):
    """5.x's ``gradient_checkpointing_kwargs``: an alias ``__post_init__`` moves to the new name."""
    transformers = pytest.importorskip("transformers")
    from memplan.integrations.transformers import _checkpointing

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True}, report_to=[],
    )  # fmt: skip
    assert _checkpointing(args) == {"recompute": "full", "use_reentrant": True}


def test_the_callback_reads_a_model_peft_checkpointed():
    """``prepare_model_for_kbit_training(model)`` before a Trainer without ``gradient_checkpointing=True``: the model's
    layers checkpoint with ``functools.partial(checkpoint)`` and no ``use_reentrant`` (torch: True); a model enabled
    with transformers' default kwargs runs the non-reentrant one; one enabled with none of it, nothing."""
    transformers = pytest.importorskip("transformers")
    from memplan.integrations.transformers import _checkpointing

    args = SimpleNamespace(gradient_checkpointing=False)
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    )
    model = transformers.LlamaForCausalLM(config)
    assert _checkpointing(args, model) == {"recompute": "none"}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})  # what PEFT passes
    assert _checkpointing(args, model) == {"recompute": "full", "use_reentrant": True}
    model.gradient_checkpointing_enable()
    assert _checkpointing(args, model) == {"recompute": "full", "use_reentrant": False}


@pytest.mark.parametrize(
    ("finetune", "use_reentrant", "zero", "args", "field"),
    [
        ("lora", True, 0, {}, "ddp_find_unused_parameters"),  # the Trainer's default: True over a PEFT model
        ("lora", True, 0, {"ddp_find_unused_parameters": True}, "ddp_find_unused_parameters"),
        ("lora", True, 0, {"ddp_find_unused_parameters": False, "ddp_static_graph": True}, "ddp_static_graph"),
        ("lora", True, 0, {"ddp_find_unused_parameters": False}, None),  # what the run estimates
        ("lora", False, 0, {}, None),  # the non-reentrant checkpoint: the Trainer's default runs
        ("full", True, 0, {}, None),  # a checkpointed PreTrainedModel: find_unused_parameters off already
        ("lora", True, 3, {}, None),  # FSDP2: no reducer
    ],
)
def test_the_callback_says_what_a_peft_model_over_ddp_needs(finetune, use_reentrant, zero, args, field):
    """A PEFT model under DDP and the reentrant checkpoint: the Trainer's ``find_unused_parameters=True`` fails in the
    first backward (tests/unit/test_timeline_hf_reentrant_ranks.py), ``ddp_static_graph`` is not followed: one line
    naming the argument, no estimate."""
    from types import SimpleNamespace

    from memplan.errors import MemplanError
    from memplan.integrations.transformers import _check_ddp_reentrant

    plan = {"dp": 2, "zero": zero, "recompute": "full", "use_reentrant": use_reentrant, "finetune": finetune}
    training = SimpleNamespace(deepspeed=None, **args)
    if field is None:
        _check_ddp_reentrant(training, plan)
        return
    with pytest.raises(MemplanError) as err:
        _check_ddp_reentrant(training, plan)
    assert err.value.field == field and "\n" not in str(err.value)
