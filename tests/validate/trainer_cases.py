# ruff: noqa: E501 (one case per line: a table)
"""Plans of tiny Llama models run by the bundled trainer on CPU under rank simulation.

Each case is measured by ``memplan.train.runner.run`` (MemTracker / FSDPMemTracker, the
steady-state peak over the measured steps) and predicted as ``memplan estimate --device cpu
--runtime memplan`` answers it (:func:`predict`): from the op-level run wherever it models the plan
(every case here), from the phase model elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from memplan.costmodel.memory import estimate_training
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload
from memplan.validate.spec import RunSpec

TINY = ModelSpec(
    name="tiny-gqa", hidden_size=192, num_layers=4, num_attention_heads=6, num_kv_heads=2, ffn_size=512, vocab_size=3000
)
WIDE = ModelSpec(
    name="tiny-tp4", hidden_size=256, num_layers=2, num_attention_heads=8, num_kv_heads=4, ffn_size=512,
    vocab_size=4096,
)  # fmt: skip
TIED = WIDE.model_copy(update=dict(name="tiny-tied", tied_embeddings=True))


@dataclass(frozen=True)
class Case:
    name: str
    plan: dict = field(default_factory=dict)
    model: ModelSpec = TINY
    micro_batch: int = 2
    seq_len: int = 160
    global_batch: int | None = None
    slow: bool = False  # runs under ``-m slow`` only; a smaller twin runs by default (see CASES)
    miss: str = ""  # a measured miss outside the bound, not yet modelled: a strict xfail naming its figure

    def workload(self) -> TrainingWorkload:
        return TrainingWorkload(seq_len=self.seq_len, micro_batch=self.micro_batch, global_batch=self.global_batch)

    def spec(self, steps: int = 2) -> tuple[RunSpec, int]:
        """The run of the rank memplan follows, and its predicted steady peak (:func:`predict`)."""
        plan = Plan(**self.plan)
        p = predict(self.model, self.workload(), plan)
        spec = RunSpec(model=self.model, workload=self.workload(), plan=plan, rank=p.rank, steps=steps)
        return spec, p.peak


class Predicted(NamedTuple):
    """What ``memplan estimate --device cpu`` predicts for one pipeline rank of a plan."""

    stage: int
    rank: int  # the global rank memplan follows on that stage (the one ``memplan validate`` runs)
    phases: dict[str, int]  # the steady steps' peak of each phase, as the trainer's meter takes them
    model: str  # "op-level" or "phase"
    host: int = 0  # host bytes of activation offload (``offload.cpu`` of the report)

    @property
    def peak(self) -> int:
        return max(self.phases.values())


def predict(model: ModelSpec, workload: TrainingWorkload, plan: Plan, stage: int | None = None) -> Predicted:
    """memplan's prediction on CPU for pipeline rank ``stage`` (by default the one the estimate
    follows), as ``memory_verdict(job, "cpu")`` makes it: where the bundled trainer's op-level run
    models the plan, the CPU view of that run (``plan_run``: CPU's kernels, CUDA's temporaries left
    out) and its phases' steady peaks (``cpu_reserve``); else the phase model's report."""
    from memplan.costmodel.cpu_reserve import cpu_replay
    from memplan.costmodel.timeline.cpu import cpu_view
    from memplan.costmodel.timeline.support import supported
    from memplan.costmodel.timeline.trainer import followed_rank, most_loaded_stage, trainer_run

    if supported(model, workload, plan) is not None:
        report = estimate_training(model, workload, plan, "memplan", device="cpu")
        stage = report.peak.stage if stage is None else stage
        phases = report.phases if stage == report.peak.stage else {"step": report.stage_peaks[stage]}
        return Predicted(stage, stage * plan.dp * plan.tp, dict(phases), "phase", report.offload.cpu)
    stage = most_loaded_stage(model, workload, plan, "cpu") if stage is None else stage
    run = trainer_run(model, workload, plan, stage=stage, cuda=False, cpu_sdpa=True)
    phases = cpu_replay(cpu_view(run), 1 << 62).phase_peaks
    return Predicted(stage, followed_rank(model, workload, plan, stage), dict(phases), "op-level", run.host_peak)


# bf16 matmuls are slow on CPUs without avx512_bf16 / AMX (PyTorch falls back to ATen's own
# GEMM, 0.4 to 2 GFLOP/s on most layouts), so the heaviest bf16, bf16-master and bf16-mixed
# cases (several microbatches, or long sequences) run under ``-m slow`` at the shape they were
# measured at, and the default suite runs each as a twin named <case>-small: the same plan and
# model, the same number of microbatches, fewer tokens per microbatch: 1 x 128 instead of
# 2 x 160, and recompute-selective-op-bf16 keeps its 512-token sequence at 1 sequence instead
# of 4 (test_each_slow_case_has_a_smaller_default_twin). The <case>-1x64 cases are the shapes
# the phase model's sums under-predicted by 2.25% to 4.78% (the op-level run holds them).
CASES = [
    Case("single-fp32", dict(precision="fp32")),
    Case("single-bf16", dict(precision="bf16")),
    Case("single-bf16-master", dict(precision="bf16-master")),
    Case("single-bf16-mixed-autocast", dict(precision="bf16-mixed")),
    Case("recompute-full-fp32", dict(precision="fp32", recompute="full")),
    Case("recompute-selective-bf16", dict(precision="bf16", recompute="selective")),
    Case("recompute-selective-op-bf16", dict(precision="bf16", recompute="selective-op"), micro_batch=4, seq_len=512, slow=True),
    Case("recompute-selective-op-bf16-small", dict(precision="bf16", recompute="selective-op"), micro_batch=1, seq_len=512),
    Case("recompute-selective-op-tp2-sp-fp32", dict(precision="fp32", tp=2, sequence_parallel=True, recompute="selective-op"), micro_batch=4, seq_len=512),
    Case("recompute-selective-op-dp4-zero3-bf16-mixed", dict(precision="bf16-mixed", dp=4, zero=3, recompute="selective-op")),
    Case("recompute-selective-op-pp2-bf16", dict(precision="bf16", pp=2, recompute="selective-op"), global_batch=8, slow=True),
    Case("recompute-selective-op-pp2-bf16-small", dict(precision="bf16", pp=2, recompute="selective-op"), micro_batch=1, seq_len=128, global_batch=4),
    Case("ddp4-fp32", dict(precision="fp32", dp=4)),
    Case("ddp2-bf16-accum4", dict(precision="bf16", dp=2), global_batch=16, slow=True),
    Case("ddp2-bf16-accum4-small", dict(precision="bf16", dp=2), micro_batch=1, seq_len=128, global_batch=8),
    Case("zero1-dp4-fp32", dict(precision="fp32", dp=4, zero=1)),
    Case("zero1-dp2-bf16-master", dict(precision="bf16-master", dp=2, zero=1), global_batch=16, slow=True),
    Case("zero1-dp2-bf16-master-small", dict(precision="bf16-master", dp=2, zero=1), micro_batch=1, seq_len=128, global_batch=8),
    Case("zero2-dp4-fp32", dict(precision="fp32", dp=4, zero=2)),
    Case("zero2-dp2-bf16-master", dict(precision="bf16-master", dp=2, zero=2), global_batch=16, slow=True),
    Case("zero2-dp2-bf16-master-small", dict(precision="bf16-master", dp=2, zero=2), micro_batch=1, seq_len=128, global_batch=8),
    Case("zero3-dp4-fp32", dict(precision="fp32", dp=4, zero=3)),
    Case("zero3-dp4-bf16-mixed", dict(precision="bf16-mixed", dp=4, zero=3), slow=True),
    Case("zero3-dp4-bf16-mixed-small", dict(precision="bf16-mixed", dp=4, zero=3), micro_batch=1, seq_len=128),
    Case("zero3-dp4-cpu-offload", dict(precision="fp32", dp=4, zero=3, offload_params="cpu", offload_optimizer="cpu")),
    Case("tp2-fp32", dict(precision="fp32", tp=2)),
    Case("tp2-bf16", dict(precision="bf16", tp=2)),
    Case("tp2-sp-fp32", dict(precision="fp32", tp=2, sequence_parallel=True)),
    Case("tp2-sp-dp2-zero3-bf16-mixed", dict(precision="bf16-mixed", tp=2, sequence_parallel=True, dp=2, zero=3)),
    Case("tp2-sp-dp2-zero2-full-bf16", dict(precision="bf16", tp=2, sequence_parallel=True, dp=2, zero=2, recompute="full")),
    Case("pp2-1f1b-fp32", dict(precision="fp32", pp=2), global_batch=8),
    Case("pp2-interleaved-fp32", dict(precision="fp32", pp=2, pp_schedule="interleaved", virtual_stages=2), global_batch=8),
    Case("pp2-gpipe-bf16", dict(precision="bf16", pp=2, pp_schedule="gpipe"), global_batch=8, slow=True),
    Case("pp2-gpipe-bf16-small", dict(precision="bf16", pp=2, pp_schedule="gpipe"), micro_batch=1, seq_len=128, global_batch=4),
    Case("pp4-1f1b-bf16", dict(precision="bf16", pp=4), global_batch=8, slow=True),
    Case("pp4-1f1b-bf16-small", dict(precision="bf16", pp=4), micro_batch=1, seq_len=128, global_batch=4),
    Case("pp4-full-bf16", dict(precision="bf16", pp=4, recompute="full"), global_batch=8, slow=True),
    Case("pp4-full-bf16-small", dict(precision="bf16", pp=4, recompute="full"), micro_batch=1, seq_len=128, global_batch=4),
    Case("3d-pp4-tp2-sp-dp2-zero2-bf16", dict(precision="bf16", pp=4, tp=2, sequence_parallel=True, dp=2, zero=2), global_batch=4),
    Case("2d-dp16-tp4-sp-zero3-world64", dict(precision="bf16-mixed", dp=16, tp=4, sequence_parallel=True, zero=3), model=WIDE, micro_batch=1),
    Case("pp4-fp32-4-microbatches", dict(precision="fp32", pp=4), global_batch=8),
    Case("pp2-dp2-zero3-bf16-mixed-4-microbatches", dict(precision="bf16-mixed", pp=2, dp=2, zero=3), global_batch=16, slow=True),
    Case("pp2-dp2-zero3-bf16-mixed-4-microbatches-small", dict(precision="bf16-mixed", pp=2, dp=2, zero=3), micro_batch=1, seq_len=128, global_batch=8),
    Case("pp2-interleaved-dp2-zero2-bf16", dict(precision="bf16", pp=2, dp=2, zero=2, pp_schedule="interleaved", virtual_stages=2), global_batch=16, slow=True),
    Case("pp2-interleaved-dp2-zero2-bf16-small", dict(precision="bf16", pp=2, dp=2, zero=2, pp_schedule="interleaved", virtual_stages=2), micro_batch=1, seq_len=128, global_batch=8),
    Case("3d-pp4-tp2-sp-dp2-zero2-bf16-2-microbatches", dict(precision="bf16", pp=4, tp=2, sequence_parallel=True, dp=2, zero=2), global_batch=8),
    Case("3d-pp2-tp2-dp4-zero2-bf16", dict(precision="bf16", pp=2, tp=2, dp=4, zero=2), global_batch=16),
    Case("pp2-gpipe-bf16-1x64", dict(precision="bf16", pp=2, pp_schedule="gpipe"), micro_batch=1, seq_len=64, global_batch=4),
    Case("zero3-dp4-bf16-mixed-1x64", dict(precision="bf16-mixed", dp=4, zero=3), micro_batch=1, seq_len=64),
    Case("zero3-dp4-fp32-1x64", dict(precision="fp32", dp=4, zero=3), micro_batch=1, seq_len=64),
    Case("tied-single-bf16", dict(precision="bf16"), model=TIED),
    Case("tied-tp2-fp32", dict(precision="fp32", tp=2), model=TIED, micro_batch=1),
    Case("tied-dp2-zero3-bf16-mixed", dict(precision="bf16-mixed", dp=2, zero=3), model=TIED, micro_batch=1),
    Case("tied-dp2-tp2-zero3-fp32", dict(precision="fp32", dp=2, tp=2, zero=3), model=TIED, micro_batch=1),
    Case("tied-dp2-tp2-zero3-bf16", dict(precision="bf16", dp=2, tp=2, zero=3), model=TIED, micro_batch=1),
    Case("tied-tp4-fp32", dict(precision="fp32", tp=4), model=TIED, micro_batch=1),
    Case("tied-dp16-tp4-sp-zero3-bf16-mixed-world64", dict(precision="bf16-mixed", dp=16, tp=4, sequence_parallel=True, zero=3), model=TIED, micro_batch=1),
]  # fmt: skip


# Each pipelined default case's stages run one by one (test_trainer_accuracy.py): the stage the
# estimate follows (test_memplan_runtime_within_2pct) and the first, the second (from four stages) and
# the last. Predicted by the op-level run since 2026-11-28, every stage of every default case is within
# the bound, and the followed stage is the measured most-loaded one; the phase model's sums, which
# predicted them before, were -2.02% to -7.88% under on twelve stages (the fresh dW of a middle stage's
# first layer, the sends' buffers), and remain the search's fast form (tests/search/test_fast_form_grid.py).
#
# The stage the estimate follows, case: figure.
PEAK_MISSES: dict[str, str] = {}
# The other stages, (case, stage): figure.
STAGE_MISSES: dict[tuple[str, int], str] = {}
# The measured most-loaded stage is not the followed one, case: figure.
RANK_MISSES: dict[str, str] = {}


def measured_against_predicted(name: str, model: ModelSpec, workload: TrainingWorkload, plan: Plan, steps: int,
                               tolerance_pct: float = 3.0):  # fmt: skip
    """Run ``plan`` with the bundled trainer (rank simulation, CPU) and assert each phase's measured
    peak within ``tolerance_pct`` of memplan's CPU prediction (:func:`predict`); (prediction, record)
    for further checks."""
    from memplan.train.runner import run  # torch: only where a case runs

    p = predict(model, workload, plan)
    record = run(RunSpec(model=model, workload=workload, plan=plan, rank=p.rank, steps=steps))
    assert record.status == "ok", record.reason
    assert set(record.phases) == {"forward", "backward", "optimizer"}
    for phase, measured in record.phases.items():
        predicted = p.phases[phase]
        error = 100 * (predicted - measured.allocated) / measured.allocated
        assert abs(error) <= tolerance_pct, (
            f"{name} {phase}: predicted {predicted:,} measured {measured.allocated:,} ({error:+.2f}%)"
        )
    return p, record


TINY_FILE = {"name": "tiny", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 2, "num_kv_heads": 2,
             "ffn_size": 128, "vocab_size": 256}  # fmt: skip


def validate_tiny_on_cpu(tmp_path, monkeypatch, capsys, *flags: str) -> dict:  # noqa: ANN001 - pytest fixtures
    """``memplan validate`` of a tiny model file as a user runs it (fp32, 32 tokens, one step, CPU,
    ``--format json``) with ``flags``; its JSON result (the command must succeed)."""
    import json

    import yaml

    from memplan.cli.app import run as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_FILE))
    args = ["validate", "tiny.yaml", "--precision", "fp32", "--seq-len", "32", "--steps", "1", "--device", "cpu"]
    code = cli([*args, *flags, "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)
