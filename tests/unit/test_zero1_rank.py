"""The rank the estimate describes is the rank ``memplan validate`` runs (``report.peak.rank``).

Under ZeRO-1 the data ranks differ in their optimizer's share alone
(``ZeroRedundancyOptimizer._partition_parameters``: ``timeline/zero1.py``), and the op-level run
follows the largest (``zero1.most_loaded``). The estimate names that rank
(``trainer.followed_rank``, in the trainer's (pp, dp, tp) mesh), so validate measures the rank
whose optimizer states the estimate predicts. On llama3-8b dp 8 in bf16-master that is data rank
2: 1,006,632,960 elements of AdamW's fp32 masters and moments (12 B each) against data rank 0's
1,003,487,232, 37,748,736 B apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.costmodel.timeline import zero1
from memplan.costmodel.timeline.trainer import dims, followed_rank
from memplan.costmodel.timeline.trainer_model import param_shapes
from memplan.estimation import estimate
from memplan.specs.resolve import resolve_job

TINY = """name: tiny
hidden_size: 128
num_layers: 2
num_attention_heads: 4
num_kv_heads: 2
ffn_size: 256
vocab_size: 1000
"""


def _shares(job) -> list[int]:  # noqa: ANN001
    shapes = param_shapes(dims(job.model, job.workload, job.plan), job.model.tied_embeddings)
    return [sum(n for _, n in p) for p in zero1.partition([(k, r * c) for k, (r, c) in shapes.items()], job.plan.dp)]


def test_the_estimate_names_the_zero1_rank_its_run_follows():
    job = resolve_job("llama3-8b", None, dict(dp=8, zero=1, precision="bf16-master", seq_len=4096), inference=False)
    shares = _shares(job)
    assert shares.index(max(shares)) == 2 and shares[2] - shares[0] == 3_145_728
    memory = estimate(job, with_suggestions=False, device="cuda").memory
    assert memory.model == "op-level"
    assert memory.peak.rank == followed_rank(job.model, job.workload, job.plan, 0) == 2
    assert memory.model_states.optimizer_states == shares[2] * 12  # rank 2's masters and moments


def test_tune_validates_the_rank_the_replayed_run_follows():
    """``tune --validate`` runs ``peak_rank`` of the plans a search reports (their runs replayed)."""
    from memplan.search.evaluate import Context, evaluate, replayed
    from memplan.search.space import Candidate
    from memplan.specs.hardware import ClusterSpec
    from memplan.specs.loader import load_gpu, load_model
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    ctx = Context(load_model("llama3-8b"), load_gpu("h200"), ClusterSpec(gpus_per_node=8))
    candidate = Candidate(Plan(dp=8, zero=1, precision="bf16-master"), TrainingWorkload(seq_len=4096))
    screened = evaluate(candidate, ctx)
    assert screened.peak_rank == 0  # the fast form: the phase model's even shares
    assert replayed(screened, ctx).peak_rank == 2


@pytest.mark.parametrize(
    ("changes", "rank"),
    [
        (dict(dp=8, zero=0), 0),
        (dict(dp=8, zero=3), 0),
        (dict(dp=4, tp=2, sequence_parallel=True, zero=3), 0),
        (dict(dp=2, pp=4, zero=2, global_batch=16), None),  # the most-loaded stage's data rank 0
    ],
)
def test_other_plans_name_data_rank_0_of_their_stage(changes, rank):
    job = resolve_job("llama3-8b", None, dict(seq_len=4096, precision="bf16", **changes), inference=False)
    peak = estimate(job, with_suggestions=False, device="cuda").memory.peak
    expected = peak.stage * job.plan.dp * job.plan.tp if rank is None else rank
    assert peak.rank == expected


def test_validate_runs_the_rank_the_estimate_follows(tmp_path: Path):
    """A tiny model at dp 4: data rank 2 holds the largest share (136,576 / 136,448 / 139,264 / 139,264)."""
    pytest.importorskip("torch")
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    job = resolve_job(str(path), None, dict(dp=4, zero=1, precision="bf16", seq_len=64), inference=False)
    assert _shares(job) == [136_576, 136_448, 139_264, 139_264]
    args = ["validate", str(path), "--dp", "4", "--zero", "1", "--precision", "bf16", "--seq-len", "64"]
    r = subprocess.run(
        [sys.executable, "-m", "memplan.cli", *args, "--micro-batch", "2", "--steps", "1", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "ok" and data["rank"] == 2 == data["record"]["rank"]
