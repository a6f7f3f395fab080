"""The plan flags, listed once, and given to every command that takes a plan.

A plan flag sets one plan or workload field (``--tp``, ``--finetune``, ``--seq-len``,
``--inference``...); its option is declared once in :mod:`memplan.cli.options`. A command takes
them all with :func:`takes_plan_flags`, which adds them to its signature (typer reads that) and
hands the command one :class:`PlanFlags`; a flag the command cannot honour is named, with the
reason, in the ``excluded`` mapping the command passes, its one place (``--help`` then has no
such flag, and tests/cli/test_plan_flags.py checks every command's flags against this list).
The hardware flags (``--gpu``, ``--gpus``, ``--nodes``, ``--allocator``) stay each command's own:
their defaults differ by command (auto-detected, a profile, the snapshot's).
"""

# No ``from __future__ import annotations``: the options are objects typer reads from the
# signature built here.
import functools
import inspect
from collections.abc import Callable, Mapping
from copy import copy
from typing import Annotated, Any, get_args, get_origin

from typer.models import ParameterInfo

from memplan.cli import options as o
from memplan.specs.values import name_list

# name -> its option (the order --help lists them in, within their panels)
PLAN_FLAGS: dict[str, Any] = {
    "dp": o.DpOpt, "tp": o.TpOpt, "sequence_parallel": o.SequenceParallelOpt, "pp": o.PpOpt,
    "pp_schedule": o.PpScheduleOpt, "virtual_stages": o.VirtualStagesOpt, "cp": o.CpOpt, "ep": o.EpOpt,
    "zero": o.ZeroOpt, "recompute": o.RecomputeOpt, "recompute_layers": o.RecomputeLayersOpt,
    "precision": o.PrecisionOpt, "autocast": o.AutocastOpt, "fp8_recipe": o.Fp8RecipeOpt,
    "fp8_all_gather": o.Fp8AllGatherOpt,
    "optimizer": o.OptimizerOpt, "offload_optimizer": o.OffloadOptimizerOpt, "offload_params": o.OffloadParamsOpt,
    "attention": o.AttentionOpt, "runtime": o.RuntimeOpt,
    "finetune": o.FinetuneOpt, "lora_rank": o.LoraRankOpt, "lora_targets": o.LoraTargetsOpt,
    "lora_dropout": o.LoraDropoutOpt, "modules_to_save": o.ModulesToSaveOpt,
    "lora_dora": o.LoraDoraOpt, "quant": o.QuantOpt,
    "double_quant": o.DoubleQuantOpt, "offload_activations": o.OffloadActivationsOpt,
    "model_build": o.ModelBuildOpt, "use_reentrant": o.UseReentrantOpt,
    "micro_batch": o.MicroBatchOpt, "global_batch": o.GlobalBatchOpt, "seq_len": o.SeqLenOpt,
    "inference": o.InferenceOpt, "batch": o.BatchOpt, "context": o.ContextOpt, "kv_dtype": o.KvDtypeOpt,
    "block_size": o.BlockSizeOpt, "prefill_chunk": o.PrefillChunkOpt,
}  # fmt: skip
NAME_LISTS = ("lora_targets", "modules_to_save")  # comma-separated on the command line, tuples in a plan
SERVING = ("inference", "batch", "context", "kv_dtype", "block_size", "prefill_chunk")  # a serving workload's
FP8 = ("fp8_recipe", "fp8_all_gather")


def flag(name: str) -> str:
    """``--seq-len``: the flag of plan field ``name``."""
    return "--" + name.replace("_", "-")


def plan_overrides(values: Mapping[str, Any]) -> dict[str, Any]:
    """The plan flags as the plan and workload overrides ``resolve_job`` takes (None: not given):
    the name lists split; ``--inference`` is not a field (``resolve_job``'s ``inference``)."""
    out = {k: v for k, v in values.items() if k != "inference"}
    for name in NAME_LISTS:
        if name in out:
            out[name] = name_list(out[name], flag(name))
    return out


class PlanFlags:
    """The plan flags one command was given: ``values`` by field name, None where not given."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = dict(values)

    @property
    def inference(self) -> bool:
        return bool(self.values.get("inference"))

    def overrides(self) -> dict[str, Any]:
        return plan_overrides(self.values)

    def given(self) -> list[str]:
        """The flags given, as typed (``--tp``)."""
        return [flag(k) for k, v in self.values.items() if v is not None and v is not False]


def takes_plan_flags(
    excluded: Mapping[str, str] | None = None, helps: Mapping[str, str] | None = None, after: str = "plan"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command every plan flag but those ``excluded`` (name -> why the command cannot honour
    it), with the help of ``helps`` (name -> text) where the command says more or less than the
    shared help; the command takes them as one ``flags: PlanFlags`` argument. They follow its own
    parameter ``after`` (the help's panels keep their order), else its last."""
    excluded, helps = dict(excluded or {}), dict(helps or {})
    unknown = sorted(set(excluded) - set(PLAN_FLAGS) | set(helps) - set(PLAN_FLAGS))
    if unknown:
        raise ValueError(f"not plan flags: {', '.join(unknown)}")
    names = [n for n in PLAN_FLAGS if n not in excluded]

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        declared = inspect.signature(command, eval_str=True).parameters
        wants = "flags" in declared  # a command excluding every plan flag takes none
        if names and not wants:
            raise TypeError(f"{command.__name__} takes plan flags: give it a flags: PlanFlags parameter")
        own = [p for p in declared.values() if p.name != "flags"]
        shared = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=_default(n), annotation=_option(n, helps))
            for n in names
        ]
        # keyword-only, all of them (typer takes the arguments in their order, whatever their kind)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        at = next((i + 1 for i, p in enumerate(own) if p.name == after), len(own))
        params = [*own[:at], *shared, *own[at:]]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            flags = PlanFlags({n: kwargs.pop(n) for n in names})
            return command(**kwargs, flags=flags) if wants else command(**kwargs)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        # typer takes an option's type and settings from the signature's ``Annotated[..., Option()]``
        # and resolves ``__annotations__`` (``typing.get_type_hints``) only for a parameter without
        # them, on each of its two reads of the signature a run: given only those, it no longer
        # resolves ~50 options' annotations that it does not use (``typer.utils.get_params_from_function``;
        # ~4.5 M instructions of a cold ``memplan estimate``, benchmarks/bench_estimate.py)
        # (the shared flags are typer options by construction: PLAN_FLAGS)
        run.__annotations__ = {p.name: p.annotation for p in own if not _typer_annotated(p.annotation)}
        run.plan_flags_excluded = excluded  # type: ignore[attr-defined]
        run.plan_flags_helps = helps  # type: ignore[attr-defined]
        return run

    return wrap


def _typer_annotated(annotation: Any) -> bool:
    """``Annotated[T, typer.Option(...)]`` or ``Annotated[T, typer.Argument(...)]``."""
    return any(isinstance(a, ParameterInfo) for a in getattr(annotation, "__metadata__", ()))  # Annotated's extras


def _default(name: str) -> Any:
    return False if name == "inference" else None


def _option(name: str, helps: Mapping[str, str]) -> Any:
    """The flag's ``Annotated`` option, its help replaced where the command gives its own."""
    annotated = PLAN_FLAGS[name]
    if name not in helps:
        return annotated
    assert get_origin(annotated) is Annotated
    kind, info = get_args(annotated)
    info = copy(info)
    info.help = helps[name]
    return Annotated[kind, info]
