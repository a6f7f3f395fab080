"""Which saves TRL's offload clones contiguous before it copies them out (``pack_tensor``: ``activation.contiguous()``
of a non-contiguous save), in TRL's own code on CPU against the op-level run (``hf_offload.CLONE``), per family.

The run decides it from each save's layout (``autograd.Tensor.transposed``), which it takes from the ops as torch
lays them out (docs/cost-model.md, "Which CPU saves TRL clones"): a heads view ``view(b, s, -1, d).transpose(1, 2)``
is not contiguous unless one head (a single KV head's key and value) or one position; RoPE's output is laid out as
its input (TensorIterator); CPU's flash kernel's output as its query (``empty_like(query)``) and its log-sum-exp
``(b, s, heads)`` transposed; Qwen3's q / k norm runs on the plain view (contiguous), Gemma 3's on the heads view
(its saves and output laid out as it). Until 2026-11-29 the run cloned Qwen3's norm inputs and a single KV head's
value, and none of the query, output and log-sum-exp: -31,744 B on the reentrant Qwen3 LoRA case
(test_timeline_hf_reentrant_offload.py).

One forward and backward of a tiny model under TRL's context (tests/accuracy/trl_offload.py) against the run's
three steps of the same model (no checkpoint: every save packed in the forward). Seconds in all.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("transformers")

import family_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
from hf_predict import STEPS, hf_predict  # noqa: E402

from memplan.costmodel.timeline.events import ALLOC  # noqa: E402
from memplan.costmodel.timeline.hf_offload import CLONE  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402

SMALL = {**family_steps.TINY, "vocab": 256, "seq": 64}
_BASE = {c.name: c for c in family_steps.BASE}
CASES = [
    pytest.param(hf_steps.Case("layout-llama", **SMALL), id="llama-gqa"),  # q, k, v, out, lse all strided
    pytest.param(hf_steps.Case("layout-mqa", **{**SMALL, "heads": 2, "kv_heads": 1}), id="llama-one-kv-head"),
    pytest.param(dataclasses.replace(_BASE["qwen3"], name="layout-qwen3", **SMALL), id="qwen3"),
    pytest.param(dataclasses.replace(_BASE["gemma3"], name="layout-gemma3", **SMALL), id="gemma3"),
]


def _trl_clones(case: hf_steps.Case) -> Counter:
    """The bytes of each save TRL's ``pack_tensor`` cloned in one forward: the tensor it stashed is not the save."""
    from trl_offload import trl_offload

    model = hf_steps._model(case)
    model.train()
    ctx = trl_offload(model)
    pack, cloned = ctx.pack_hook, Counter()

    def logged(t: torch.Tensor) -> int:
        ident = pack(t)
        stashed = ctx.fwd_stash.get(ident)
        if stashed is not None and stashed[0].untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            cloned[t.numel() * t.element_size()] += 1
        return ident

    ctx.pack_hook = logged
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    with mock.patch.object(torch.Tensor, "record_stream", lambda *_: None), ctx:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # the Trainer's use_cache=False
    return cloned


def _run_clones(case: hf_steps.Case) -> Counter:
    """The bytes of each clone in the run's steps, per step."""
    plan = Plan(precision=case.precision, offload_activations="cpu")
    timeline = hf_predict(case, plan, offload=True)
    clones = Counter(e[2] for e in timeline.raw if e[0] == ALLOC and e[5].endswith(CLONE))
    assert all(n % STEPS == 0 for n in clones.values()), clones
    return Counter({size: n // STEPS for size, n in clones.items()})


@pytest.mark.parametrize("case", CASES)
def test_the_run_clones_the_saves_trl_clones(case: hf_steps.Case) -> None:
    trl = _trl_clones(case)
    assert trl, case.name  # every family here saves a strided query, output and log-sum-exp
    assert _run_clones(case) == trl
