# ruff: noqa: E501 (one case per line: a table)
"""Plans of tiny Llama models run by the bundled trainer on CPU under rank simulation.

Each case is measured by ``memplan.train.runner.run`` (MemTracker / FSDPMemTracker, the
steady-state peak over the measured steps) and predicted by ``--runtime memplan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        """The run of the most-loaded rank, and memplan's predicted peak.allocated for it."""
        plan = Plan(**self.plan)
        report = estimate_training(self.model, self.workload(), plan, "memplan", device="cpu")
        spec = RunSpec(model=self.model, workload=self.workload(), plan=plan, rank=report.peak.rank, steps=steps)
        return spec, report.peak.allocated


# bf16 matmuls are slow on CPUs without avx512_bf16 / AMX (PyTorch falls back to ATen's own
# GEMM, 0.4 to 2 GFLOP/s on most layouts), so the heaviest bf16, bf16-master and bf16-mixed
# cases (several microbatches, or long sequences) run under ``-m slow`` at the shape they were
# measured at, and the default suite runs each as a twin named <case>-small: the same plan and
# model, the same number of microbatches, fewer tokens per microbatch: 1 x 128 instead of
# 2 x 160, and recompute-selective-op-bf16 keeps its 512-token sequence at 1 sequence instead
# of 4 (test_each_slow_case_has_a_smaller_default_twin). Not smaller: at 1 x 64 tokens the
# measured peak leaves the memory model, under-predicted (the unsafe direction); those shapes run
# by default as the <case>-1x64 cases, each a strict xfail carrying its measured figure (``miss``),
# so a fix turns it into a failure that asks for the mark to go.
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
    Case("pp2-gpipe-bf16-1x64", dict(precision="bf16", pp=2, pp_schedule="gpipe"), micro_batch=1, seq_len=64, global_batch=4, miss="-2.25% (predicted 19,062,400, measured 19,501,420; stage 1, 2026-11-28: -10.13% before the last stage's logits in fwd_cache)"),
    Case("zero3-dp4-bf16-mixed-1x64", dict(precision="bf16-mixed", dp=4, zero=3), micro_batch=1, seq_len=64, miss="-4.61% (predicted 14,623,104, measured 15,330,212; 2026-11-27, after the meter kept FSDP2's group hooks: -6.13% before)"),
    Case("zero3-dp4-fp32-1x64", dict(precision="fp32", dp=4, zero=3), micro_batch=1, seq_len=64, miss="-4.78% (predicted 18,238,976, measured 19,154,660; 2026-11-27, after the meter kept FSDP2's group hooks: -7.15% before)"),
    Case("tied-single-bf16", dict(precision="bf16"), model=TIED),
    Case("tied-tp2-fp32", dict(precision="fp32", tp=2), model=TIED, micro_batch=1),
    Case("tied-dp2-zero3-bf16-mixed", dict(precision="bf16-mixed", dp=2, zero=3), model=TIED, micro_batch=1),
    Case("tied-dp2-tp2-zero3-fp32", dict(precision="fp32", dp=2, tp=2, zero=3), model=TIED, micro_batch=1),
    Case("tied-dp2-tp2-zero3-bf16", dict(precision="bf16", dp=2, tp=2, zero=3), model=TIED, micro_batch=1),
    Case("tied-tp4-fp32", dict(precision="fp32", tp=4), model=TIED, micro_batch=1),
    Case("tied-dp16-tp4-sp-zero3-bf16-mixed-world64", dict(precision="bf16-mixed", dp=16, tp=4, sequence_parallel=True, zero=3), model=TIED, micro_batch=1),
]  # fmt: skip


# Each pipelined default case's stages run one by one (test_trainer_accuracy.py), measured
# 2026-11-27 (torch 2.13.0+cpu) after StageReplay was made to keep what torch.distributed.pipelining
# keeps (tests/validate/test_pipeline_replay.py: equal byte for byte to the schedules on gloo ranks):
# the last chunk's logits in fwd_cache until their backward (and, under 1F1B, in the schedule's
# ``output`` variable until the next forward returns), the losses until the step ends, the sent
# activations and gradients as long as the schedule's sends hold them. The memory model counts
# them from the op-level run's schedule (memory.cached_logits, memory.pipeline_buffers,
# timeline/schedule.py) since 2026-11-28: every predicted most-loaded stage within 2% (-0.08% .. +0.29%; it
# was -2.94% to -10.26% before), strict xfails for the other stages with their figures.
#
# The predicted most-loaded stage (test_memplan_runtime_within_2pct), case: figure.
PEAK_MISSES: dict[str, str] = {}
# The stages the model examined and did not pick (stage_peaks), (case, stage): figure. Within 2%:
# recompute-selective-op-pp2-bf16-small, 3d-pp4-tp2-sp-dp2-zero2-bf16-2-microbatches (+1.50%),
# pp4-fp32-4-microbatches stage 0 (-0.61%). The middle stages of pp4 (stage 1) peak in their
# first layer's backward with a fresh dW (feed_forward.w2.dW) beside the gradients accumulated
# in place, which the sums leave out; the input gradients they counted before (every one
# back-propagated, where 1F1B's sends hold the latest) covered it: -2.70% to -4.51% on
# pp4-1f1b-bf16-small, within 2% to -4.76% and -2.71% on the other two.
STAGE_MISSES = {
    ("pp2-1f1b-fp32", 0): "-3.54% (predicted 42,419,200, measured 43,975,756)",
    ("pp2-interleaved-fp32", 0): "-2.52% (predicted 50,744,320, measured 52,057,676)",
    ("pp2-gpipe-bf16-small", 0): "-2.37% (predicted 17,568,768, measured 17,994,828)",
    ("pp4-1f1b-bf16-small", 0): "-2.38% (predicted 11,361,280, measured 11,638,824)",
    ("3d-pp4-tp2-sp-dp2-zero2-bf16", 0): "-7.88% (predicted 4,567,424, measured 4,957,864)",
    ("pp2-dp2-zero3-bf16-mixed-4-microbatches-small", 0): "-6.72% (predicted 19,140,864, measured 20,520,524)",
    ("pp2-interleaved-dp2-zero2-bf16-small", 0): "-2.02% (predicted 15,971,072, measured 16,299,852)",
    ("3d-pp2-tp2-dp4-zero2-bf16", 0): "-5.77% (predicted 10,159,104, measured 10,780,876)",
    ("pp4-1f1b-bf16-small", 1): "-4.51% (predicted 6,945,792, measured 7,273,508)",
    ("pp4-full-bf16-small", 1): "-4.76% (predicted 4,922,368, measured 5,168,164)",
    ("pp4-fp32-4-microbatches", 1): "-2.71% (predicted 23,572,480, measured 24,227,876)",
    ("3d-pp4-tp2-sp-dp2-zero2-bf16", 1): "-6.04% (predicted 3,186,304, measured 3,391,140)",
}
# The measured most-loaded stage is not the predicted one, case: figure (none since 2026-11-28:
# pp4-fp32-4-microbatches's stage 3, measured 37,400,896, is now the predicted one, +0.01%).
RANK_MISSES: dict[str, str] = {}


def measured_against_predicted(name: str, model: ModelSpec, workload: TrainingWorkload, plan: Plan, steps: int,
                               tolerance_pct: float = 3.0):  # fmt: skip
    """Run ``plan`` with the bundled trainer (rank simulation, CPU) and assert each phase's measured
    peak within ``tolerance_pct`` of ``--runtime memplan``'s; (report, record) for further checks."""
    from memplan.train.runner import run  # torch: only where a case runs

    report = estimate_training(model, workload, plan, "memplan", device="cpu")
    record = run(RunSpec(model=model, workload=workload, plan=plan, rank=report.peak.rank, steps=steps))
    assert record.status == "ok", record.reason
    assert set(record.phases) == {"forward", "backward", "optimizer"}
    for phase, measured in record.phases.items():
        predicted = report.phases[phase]
        error = 100 * (predicted - measured.allocated) / measured.allocated
        assert abs(error) <= tolerance_pct, (
            f"{name} {phase}: predicted {predicted:,} measured {measured.allocated:,} ({error:+.2f}%)"
        )
    return report, record


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
