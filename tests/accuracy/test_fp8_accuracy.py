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

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

from memplan.costmodel.memory import estimate_training  # noqa: E402
from memplan.specs.model import ModelSpec  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

pytestmark = pytest.mark.accuracy

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


def measure(case: Case, steps: int = 3) -> dict[str, int]:
    """Per-phase peaks (bytes) over ``steps`` steps after a warm-up step's worth of building."""
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


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fp8_phases_within_3_percent(case: Case):
    measured, predicted = measure(case), predict(case)
    for phase, value in measured.items():
        error = (predicted[phase] - value) / value
        assert abs(error) <= TOLERANCE, f"{case.name} {phase}: predicted {predicted[phase]:,} measured {value:,}"


def test_fp8_raises_the_backward_over_bf16():
    """The harness converts: torchao's eager casts raise the measured backward peak over
    bf16-master's (its saved tensors are bf16's, pytorch/ao#1850), and the model predicts a rise too.
    (The amounts differ by bf16-master's own backward miss at this shape, -1.6%.)"""
    bf16, fp8 = Case("bf16-master", None), CASES[0]
    measured = measure(fp8)["backward"] - measure(bf16)["backward"]
    predicted = predict(fp8)["backward"] - predict(bf16)["backward"]
    assert measured > 0 and predicted > 0, f"predicted +{predicted:,} measured +{measured:,}"
