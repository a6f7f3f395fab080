"""docs/cost-model.md, "What the op-level run does not reach yet", is the one list of the plans the phase model
answers (issue 27, item 2): every refusal of ``timeline.support.supported`` (the bundled trainer's run) and
``timeline.hf_support.hf_supported`` (transformers' Trainer and the hand-written loop) is named there, by the
key :func:`refusal_keys` reads from the code, so that a check added to either is listed with why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memplan.costmodel.timeline import hf_support, support

DOC = Path(__file__).parents[2] / "docs" / "cost-model.md"
SECTION = "### What the op-level run does not reach yet"


def _key(node: ast.expr) -> str:
    """A refusal reason's key: a constant's name, a called function's name, or the reason's first words
    (before its parenthesis; placeholders as ``{}``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
    if isinstance(node, ast.Lambda):
        return _key(node.body)
    if isinstance(node, ast.BinOp):
        return _key(node.left)
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    else:
        assert isinstance(node, ast.Constant) and isinstance(node.value, str), ast.unparse(node)
        text = node.value
    head = text.split(" (")[0]
    return " ".join((head if len(head) >= 8 else text).split()[:6])


def refusal_keys(module, function: str) -> list[str]:
    """The keys of the reasons in ``function``'s ``checks`` list (``(ok, reason)`` pairs)."""
    tree = ast.parse(Path(module.__file__).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    checks = next(n for n in ast.walk(fn) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "checks")
    return [_key(pair.elts[1]) for pair in checks.value.elts]


def _section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n### ", start + len(SECTION))
    return text[start:end]


@pytest.mark.parametrize("module, function", [(support, "supported"), (hf_support, "hf_supported")])
def test_every_refusal_of_the_op_level_runs_is_listed(module, function):
    keys = refusal_keys(module, function)
    assert len(keys) > 10  # the checks list was found
    section = _section()
    missing = [k for k in keys if f"`{k}`" not in section]
    assert not missing, f"docs/cost-model.md {SECTION!r} lacks {function}'s refusals {missing}"
