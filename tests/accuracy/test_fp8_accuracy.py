"""Accuracy: ``--precision fp8`` (torchao's float8 training) against real steps on CPU.

The bundled trainer's model (``memplan.train.model.Transformer``) in bf16 with fp32 master weights
(``MasterAdamW``, as ``bf16-master``), its linear layers converted by torchao's
``convert_to_float8_training`` as torchtitan does (every ``nn.Linear`` but the LM head, ``output``),
trained for three steps under the trainer's ``PhaseMeter`` (MemTracker); each phase's measured peak
(forward, backward, optimizer) against the phase model's, ``--runtime memplan --device cpu``.

torch._scaled_mm runs on CPU in torch 2.13, so torchao's real fp8 path runs (no emulation). What
MemTracker cannot see are the temporaries inside ``Float8TrainingTensor``'s own dispatch (the
operand copies of ``preprocess_addmm``, rowwise's fp32 output scale): they are modelled from the
source but none is the peak of a case here (``fp8.torchao_linear_backward_extra``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

from memplan.costmodel.memory import estimate_training  # noqa: E402
from memplan.specs.model import ModelSpec  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

# the whole file behind -m slow: torch 2.13's CPU _scaled_mm takes 0.64 s a call at these shapes, 80 s for one
# recipe's three steps (2026-11-28, idle 2-core CPU); the casts' bytes are unit-tested in tests/unit/test_fp8.py
pytestmark = [pytest.mark.accuracy, pytest.mark.slow]

TOLERANCE = 0.03
# a small vocabulary and a wide MLP: the layers' backward, where the fp8 casts live, is the
# backward's peak rather than the loss (with a large vocabulary fp8 changes no peak at all)
MODEL = ModelSpec(
    name="tiny-fp8", hidden_size=192, num_layers=2, num_attention_heads=6, num_kv_heads=2, ffn_size=1024, vocab_size=256
)


@dataclass(frozen=True)
class Case:
    name: str
    recipe: str | None  # None: bf16-master, no conversion
    recompute: str = "none"
    batch: int = 1
    seq: int = 256

    def plan(self) -> Plan:
        if self.recipe is None:
            return Plan(precision="bf16-master", recompute=self.recompute)
        return Plan(precision="fp8", fp8_recipe=self.recipe, recompute=self.recompute)


CASES = [
    Case("tensorwise", "tensorwise"),
    Case("rowwise", "rowwise"),
    Case("tensorwise-recompute-full", "tensorwise", recompute="full"),
]


@cache
def measure(case: Case, steps: int = 3) -> dict[str, int]:
    """Per-phase peaks (bytes) over ``steps`` steps after a warm-up step's worth of building.
    Cached: the delta tests reuse the phase tests' runs (the steps are seeded)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from memplan.train import parallel as par
    from memplan.train.model import Transformer, loss_fn
    from memplan.train.tracker import PhaseMeter

    torch.manual_seed(0)
    with torch.device("meta"):
        net = Transformer(MODEL, list(range(MODEL.num_layers)), first=True, last=True, attention_impl="flash")
        net = net.to(torch.bfloat16)
    if case.recipe is not None:
        config = Float8LinearConfig.from_recipe_name(case.recipe)
        convert_to_float8_training(net, config=config, module_filter_fn=lambda module, fqn: fqn != "output")
    net.to_empty(device="cpu")
    net.tie_weights()
    net.init_weights(0)
    plan = case.plan()
    par.apply_recompute(net, plan)
    optimizer = par.build_optimizer_from(list(net.parameters()), Plan(precision="bf16-master"), None)
    meter = PhaseMeter(net, optimizer, torch.device("cpu"), False, False)
    gen = torch.Generator().manual_seed(0)
    with meter:
        for step in range(steps):
            measured = step >= 1  # the first step creates the optimizer states
            meter.set_phase("forward", measured)
            ids = torch.randint(0, MODEL.vocab_size, (case.batch, case.seq), generator=gen)
            labels = torch.randint(0, MODEL.vocab_size, (case.batch, case.seq), generator=gen)
            loss = loss_fn(net(ids), labels)
            meter.set_phase("backward", measured)
            loss.backward()
            del loss
            meter.set_phase("optimizer", measured)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            meter.set_phase(None, measured)
            meter.end_step()
    return {name: p.allocated for name, p in meter.peaks.items()}


def predict(case: Case) -> dict[str, int]:
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    return estimate_training(MODEL, workload, case.plan(), "memplan", device="cpu").phases


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_fp8_phases_within_3_percent(case: Case):
    measured, predicted = measure(case), predict(case)
    for phase, value in measured.items():
        error = (predicted[phase] - value) / value
        assert abs(error) <= TOLERANCE, f"{case.name} {phase}: predicted {predicted[phase]:,} measured {value:,}"


# What torchao's eager fp8 can add over bf16-master at any moment, by hand from its source
# (cost-model.md "FP8 training"): the saved tensors are bf16's (pytorch/ao#1850), so the fp8 run
# holds the bf16 run's bytes plus the running linear's casts. A cast of n elements peaks at 9
# bytes each (fp32 product, fp32 clamp, fp8 result) and leaves 1. b 1, s 256, h 192, f 1024:
B, S, H, F = 1, 256, MODEL.hidden_size, MODEL.ffn_size
# forward: the down projection's input cast, 9 b s f = 2,359,296 B
FORWARD_CAST_BOUND = 9 * B * S * F
# backward: the up/gate projection's grad_output cast along dim 1 (9 b s f) beside its dim-0 fp8
# copy (b s f) and the fp8 weight (h f): 10 b s f + h f = 2,818,048 B
BACKWARD_CAST_BOUND = 10 * B * S * F + H * F
BF16 = Case("bf16-master", None)
FP8 = CASES[:2]  # the two recipes without recompute: bf16-master's baseline is the same run
DELTA_TOLERANCE = 0.05  # of the delta itself (1.5-1.7 MB here), not of the phase's peak


def _deltas(case: Case, phase: str) -> tuple[int, int]:
    measured = measure(case)[phase] - measure(BF16)[phase]
    predicted = predict(case)[phase] - predict(BF16)[phase]
    return measured, predicted


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in FP8])
def test_fp8_forward_rise_over_bf16(case: Case):
    """The forward's rise over bf16-master: measured within the casts' hand bound, and predicted
    within 5% of the measured rise (measured +1,506,300 / +1,507,320, predicted +1,504,256)."""
    measured, predicted = _deltas(case, "forward")
    assert 0 < measured <= FORWARD_CAST_BOUND, f"measured +{measured:,}"
    assert abs(predicted - measured) <= DELTA_TOLERANCE * measured, f"predicted +{predicted:,} measured +{measured:,}"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in FP8])
def test_fp8_backward_rise_within_the_casts_bound(case: Case):
    """torchao's eager casts raise the measured backward peak over bf16-master's, by no more than
    one linear's casts can hold; the predicted rise is held to the same bound."""
    measured, predicted = _deltas(case, "backward")
    assert 0 < measured <= BACKWARD_CAST_BOUND, f"measured +{measured:,}"
    assert 0 < predicted <= BACKWARD_CAST_BOUND, f"predicted +{predicted:,}"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known miss: the predicted backward rise over bf16-master is +2,192,768 B against "
    "+1,736,720 measured (tensorwise; rowwise +1,746,688), +26%: bf16-master's own backward "
    "peak is under-predicted by 1.6% (458,204 B) at this shape, the fp8 one is not",
)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in FP8])
def test_fp8_backward_rise_over_bf16_predicted(case: Case):
    measured, predicted = _deltas(case, "backward")
    assert abs(predicted - measured) <= DELTA_TOLERANCE * measured, f"predicted +{predicted:,} measured +{measured:,}"
