"""benchmarks/derived_layer.py, the study of a fast form derived from the op-level run (docs/cost-model.md,
"Deriving the search's fast form from the run: one layer's template"): one template layer's bytes, solved
from builds at three sizes, equal the run's at sizes never built, except for CUDA's staging buffer of the
norms' weight gradients (a cap, not a polynomial), which a fourth build at the largest size finds. Under
sequence parallelism the layer's structure differs between ``b = 1`` and ``b > 1``, and each branch is derived
on its own. A study the search does not use: under ``-m slow``."""

from __future__ import annotations

import pytest
from benchmark_script import load

from memplan.costmodel.timeline.autograd import REDUCE_WORKSPACE_CAP
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan

pytestmark = pytest.mark.slow

STAGING = "reduce_workspace"


@pytest.fixture(scope="module")
def study():
    return load("derived_layer")


@pytest.fixture(scope="module")
def model():
    return load_model("llama3-70b")


@pytest.mark.parametrize(("tp", "recompute", "precision"), [(1, "none", "bf16"), (8, "full", "bf16-mixed")])
def test_layer_bytes_are_affine_in_tokens_but_the_staging_buffer(study, model, tp, recompute, precision):
    plan = Plan(tp=tp, recompute=recompute, precision=precision)
    derived = study.derive(model, plan)
    coefficients = [c for part in derived for _, c, _ in part]
    assert all(c[2] == 0 and all(v.denominator == 1 for v in c) for c in coefficients)  # flash: no s^2
    missed = study.misses(model, plan, derived)
    assert missed and {tag.rsplit(".", 1)[-1] for _, _, tag, _, _ in missed} == {STAGING}
    # 8 B an element of the (b, s, h) gradient summed to the norm's weight, capped: 8 x 4,096 x 8,192 > 132 MiB
    assert all(run == REDUCE_WORKSPACE_CAP < size for _, _, _, size, run in missed)
    assert (1, 4096, f"layers.{study.DEPTH - 2}.ffn_norm.out.{STAGING}", 268_435_456, 138_412_032) in missed
    capped = study.derive(model, plan, study.SIZES, study.LARGEST)  # the cap read from the run at the largest size
    assert [cap for part in capped for _, _, cap in part if cap is not None] == [REDUCE_WORKSPACE_CAP] * 4
    assert study.misses(model, plan, capped) == []


def test_sequence_parallel_is_two_branches(study, model):
    plan = Plan(tp=2, sequence_parallel=True, recompute="none")
    with pytest.raises(ValueError, match="event counts"):  # b > 1 copies the gathered input batch-major
        study.derive(model, plan)
    for sizes, held, largest in study.BRANCHES:
        held = tuple(x for x in held if x[1] % plan.tp == 0)  # specs.job: SP needs seq_len divisible by tp
        assert study.misses(model, plan, study.derive(model, plan, sizes, largest), held) == []
