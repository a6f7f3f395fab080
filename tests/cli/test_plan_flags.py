"""The plan flags are defined once (memplan.cli.options, memplan.cli.planflags) and every command
that takes a plan takes them all, but those it names as excluded, with the same flag names, types,
defaults and help (issue 26 item 4: explain refused --finetune, estimate and export re-listed them)."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest
import typer

from memplan.cli.app import build_app, run
from memplan.cli.planflags import PLAN_FLAGS, PlanFlags, flag, plan_overrides, takes_plan_flags

COMMANDS = ("estimate", "validate", "explain", "export", "check", "tune")
TRACES = Path(__file__).parents[1] / "data" / "gpu-traces"


def _params(name: str) -> dict:
    command = typer.main.get_command(build_app(name)).commands[name]
    return {p.name: p for p in command.params}


@takes_plan_flags()
def _reference(flags: PlanFlags) -> None:
    """Every plan flag, as the shared module defines it."""


def _shared() -> dict:
    app = typer.Typer(add_completion=False)
    app.command()(_reference)
    return {p.name: p for p in typer.main.get_command(app).params}


def _signature(p) -> tuple:
    kind = p.type_descriptor.annotation
    return (p.opts, p.secondary_opts, p.default, p.param_type_name, p.rich_help_panel, kind, p.is_flag, p.min, p.max)


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_takes_the_shared_plan_flags_but_its_named_exclusions(name: str):
    command = getattr(importlib.import_module(f"memplan.cli.{name}"), name)
    excluded, helps = command.plan_flags_excluded, command.plan_flags_helps
    assert set(excluded) <= set(PLAN_FLAGS) and all(reason.strip() for reason in excluded.values())
    shared, params = _shared(), _params(name)
    assert set(shared) == set(PLAN_FLAGS)
    taken = {n for n in params if n in PLAN_FLAGS and n not in excluded}
    assert taken == set(PLAN_FLAGS) - set(excluded)
    for n in taken:
        assert _signature(params[n]) == _signature(shared[n]), n
        assert params[n].help == helps.get(n, shared[n].help), n
    # a flag excluded that the command still has is its own option of that name, and says so
    for n in set(excluded) & set(params):
        assert excluded[n].startswith(f"{name}'s own {flag(n)}"), (n, excluded[n])


def test_the_commands_agree_where_they_take_the_same_flag():
    """Pairwise: a flag two commands take is the same option in both (help aside where one says more)."""
    shared = _shared()
    for name in COMMANDS:
        params = _params(name)
        excluded = getattr(importlib.import_module(f"memplan.cli.{name}"), name).plan_flags_excluded
        for n in set(PLAN_FLAGS) - set(excluded):
            assert _signature(params[n]) == _signature(shared[n])


def test_plan_overrides_split_the_name_lists_and_leave_inference_out():
    values = dict.fromkeys(PLAN_FLAGS) | {"lora_targets": "q_proj,v_proj", "tp": 2, "inference": True}
    out = plan_overrides(values)
    assert out["lora_targets"] == ("q_proj", "v_proj") and out["tp"] == 2 and "inference" not in out
    assert set(out) == set(PLAN_FLAGS) - {"inference"}


def test_explain_takes_the_fine_tuning_and_offload_flags(capsys):
    """A LoRA plan explained against a snapshot: the prediction is the LoRA plan's (no optimizer
    states or gradients for the frozen base), where explain refused --finetune before."""
    trace = str(TRACES / "t1b_none.pkl.gz")
    base = [str(TRACES / "llama1b.config.json"), "--dp", "1", "--precision", "bf16-mixed", "--seq-len", "4096",
            "--micro-batch", "2", "--global-batch", "2", "--format", "json"]  # fmt: skip
    predicted = {}
    for extra in ([], ["--finetune", "lora", "--runtime", "memplan"], ["--zero", "1", "--offload-optimizer", "cpu"]):
        code = run(["explain", trace, *base, *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        predicted[" ".join(extra)] = json.loads(out)["comparison"]["predicted_allocated"]
    full = predicted[""]
    assert predicted["--finetune lora --runtime memplan"] < full
    assert predicted["--zero 1 --offload-optimizer cpu"] < full
    assert run(["explain", trace, "--finetune", "lora"]) == 2  # still a MODEL's run: the model is needed
    assert "give the model" in capsys.readouterr().err


@pytest.mark.parametrize("name", COMMANDS)
def test_typer_reads_each_option_from_the_signature_not_from_type_hints(name: str):
    """``takes_plan_flags`` gives typer ``__annotations__`` only for parameters without a typer option
    in their ``Annotated`` (none today): typer resolves those alone with ``get_type_hints``, twice a
    run, and reads every option from the signature (``planflags``: ~4.5 M instructions of a cold
    estimate)."""
    from memplan.cli.planflags import _typer_annotated

    command = getattr(importlib.import_module(f"memplan.cli.{name}"), name)
    params = inspect.signature(command).parameters.values()
    plain = {p.name for p in params if not _typer_annotated(p.annotation)}
    assert set(command.__annotations__) == plain
    assert len(plain) < len(params) and all(_typer_annotated(p.annotation) for p in params if p.name not in plain)
