"""``memplan validate`` end to end through the CLI (CPU, rank simulation and real gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

TINY = """name: tiny
hidden_size: 128
num_layers: 2
num_attention_heads: 4
num_kv_heads: 2
ffn_size: 256
vocab_size: 1000
"""
BASE = ["--seq-len", "64", "--micro-batch", "2", "--steps", "1"]


def _memplan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memplan.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_json_contract_and_record(tiny: Path, tmp_path: Path):
    out = tmp_path / "rec" / "run.json"
    r = _memplan("validate", str(tiny), "--dp", "4", "--zero", "3", "--precision", "bf16-mixed", *BASE,
                 "--format", "json", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "ok" and data["simulated"] is True and data["world_size"] == 4
    assert abs(data["error_pct"]) < 2.0
    assert data["error_pct"] == pytest.approx(
        100 * (data["predicted_bytes"] - data["measured_bytes"]) / data["measured_bytes"]
    )
    assert set(data["phases"]) == {"forward", "backward", "optimizer"}
    record = json.loads(out.read_text())
    assert record["peak_allocated"] == data["measured_bytes"] and record["versions"]["torch"]
    assert data["mfu"] is None  # a CPU has no peak FLOP/s, and a simulated rank's time is not the job's
    assert data["predicted_step_time_s"] > 0  # the time model's prediction for the --gpu profile


def test_table_output(tiny: Path):
    r = _memplan("validate", str(tiny), "--tp", "2", "--precision", "fp32", *BASE)
    assert r.returncode == 0, r.stderr
    assert "peak" in r.stdout and "phase backward" in r.stdout and "simulated rank" in r.stdout


def test_out_of_memory_is_a_result(tiny: Path):
    r = _memplan("validate", str(tiny), "--precision", "fp32", "--memory-limit", "4MiB", *BASE, "--format", "json")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "oom"
    oom = data["record"]["oom"]
    assert oom["requested_bytes"] > 4 * 2**20
    # issue 26 item 4: the warm-up step's forward, not "setup" (the meter's exit cleared the label it was in)
    assert (oom["phase"], oom["step"], oom["warmup"]) == ("forward", 1, True)
    r = _memplan("validate", str(tiny), "--precision", "fp32", "--memory-limit", "4MiB", *BASE)
    assert r.returncode == 1 and "out of memory in the forward of the warm-up step (step 1)" in r.stdout


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--cp", "2"], None),  # not a validate flag: a usage error
        (["--tp", "3"], "tp"),  # heads not divisible
        (["--dp", "2", "--tp", "2", "--zero", "0"], "zero"),  # DDP with DTensor params
        (["--pp", "3"], "pp"),  # 2 layers into 3 stages
        (["--precision", "fp8"], "precision"),
        (["--memory-limit", "lots"], "--memory-limit"),
        (["--dp", "2", "--zero", "3", "--offload-params", "cpu"], "offload_params"),
        (["--gpu", "no-such-gpu"], "--gpu"),
    ],
)
def test_plans_the_trainer_cannot_apply(tiny: Path, flags: list[str], field: str | None):
    r = _memplan("validate", str(tiny), *flags, *BASE)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memplan: error:"), r.stderr
    if field:
        assert f"{field}:" in lines[0]


def test_hang_is_ended_and_reported(tiny: Path):
    r = _memplan("validate", str(tiny), "--precision", "fp32", *BASE, "--timeout", "1", "--format", "json")
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert data["status"] == "timeout" and "[0]" in data["reason"]


# what a finished gloo collective can still hold when the next allocation comes (docstring below): the
# largest FSDP2 reduce-scatter input of the tiny model, fp32 at dp 2 (no padding: every dim-0 is even).
# A block: q and o 128 x 128, k and v 64 x 128, three 256 x 128 MLP weights, two 128-wide norms; the
# root group [norm, output]: 128 + 1000 x 128.
_BLOCK_GRADS = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128 + 2 * 128
_ROOT_GRADS = 128 + 1000 * 128
REAL_RANKS_JITTER = 4 * max(_BLOCK_GRADS, _ROOT_GRADS)  # 590,848 B


@pytest.mark.slow
def test_real_gloo_ranks_match_simulation(tiny: Path):
    """Rank simulation, which every ``memplan validate`` figure rests on, against real gloo ranks:
    every rank's measured peak, and the reported rank's every phase, equal to the byte (dp 2 ZeRO-2
    fp32: 9,501,532 B on each rank; forward 8,990,036, backward 9,501,532, optimizer 5,517,652).
    The simulated side runs in this process from the real run's own record (same model, workload
    and plan), one rank at a time; the real side is the CLI under torchrun.

    Until 2026-11-27 this test was ``slow``: once, in the full suite, the CLI printed no JSON. The
    cause: the two ranks share one stdout pipe, and ``print`` under ``PYTHONUNBUFFERED`` writes the
    text and the newline in two ``write(2)`` calls, so two ranks leaving the same collective could
    write ``progress 1 2progress 1 2`` + ``\\n\\n``; the launcher's ``_, step, total = line.split()``
    raised ValueError, the CLI said ``internal error`` on stderr with exit 1 and no JSON, and the
    ranks were left running. Made certain with ``strace -f -e inject=write:delay_exit=30000`` (each
    write returns 30 ms late): that exact line and exit on the first run; without strace, two
    processes leaving a barrier together 20,000 times broke 5,991 of 40,000 such lines. Fixed at
    both ends: a rank writes each line in one ``write(2)`` (memplan.train.worker.say), and the
    launcher skips a line it cannot read and ends the ranks if it fails
    (test_ranks_lines_never_interleave, test_launcher_skips_a_line_it_cannot_read).

    Equal to the byte in 11 of 12 real runs in a row (2026-11-27, 2 cores, torch 2.13.0+cpu); in the
    twelfth, both ranks measured 520 B more at the peak (9,502,052 B) and their forward phase took
    the backward's first moments (9,502,044 B against 8,990,036 B). In CI's full suite on 2 loaded
    cores (2026-11-27), rank 0 measured 512,512 B more (10,014,044 B against 9,501,532 B): exactly the
    fp32 gradients of the root group ``fully_shard([norm, output])``, 128 + 1000 x 128 elements, i.e.
    FSDP2's ``reduce_scatter_input`` for that group (``_fsdp_collectives.foreach_reduce``). FSDP2
    drops its own reference at the next group's post-backward, as the simulation does; but the gloo
    ``AsyncWork`` holds its input and output tensors too, and ProcessGroupGloo's worker thread drops
    the finished work only when it takes the work queue's lock again, after ``wait()`` has already
    returned to Python. On a loaded machine the main thread allocates the next group's buffers first,
    so one finished collective's input outlives its last Python reference by a thread switch. The
    fake process group keeps no such reference, and NCCL's stream-ordered frees on a GPU do not
    depend on a host thread. So the real peak may exceed the simulated one by at most the largest
    reduce-scatter input (:data:`REAL_RANKS_JITTER`), the optimizer phase is equal, and the forward
    lies between the simulated forward and the backward. ``slow`` again since then: a real
    two-process gloo run whose peak depends on thread scheduling is not a default CI case; the
    default suite keeps the launcher's line tests below and the simulated meter checked against a
    hook-free run (tests/validate/test_meter_independent.py).
    """
    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    r = _memplan("validate", str(tiny), "--dp", "2", "--zero", "2", "--precision", "fp32", *BASE, "--format", "json",
                 "--real-ranks")  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    real = json.loads(r.stdout)
    assert real["status"] == "ok" and real["simulated"] is False and real["world_size"] == 2
    by_rank = {int(k): v for k, v in real["measured_bytes_by_rank"].items()}
    assert sorted(by_rank) == [0, 1] and by_rank[real["rank"]] == real["measured_bytes"]
    rec = real["record"]
    for rank, measured in by_rank.items():
        spec = RunSpec(model=rec["model"], workload=rec["workload"], plan=rec["plan"], steps=1, rank=rank)
        simulated = run(spec)
        assert simulated.status == "ok" and simulated.simulated, simulated.reason
        assert 0 <= measured - simulated.peak_allocated <= REAL_RANKS_JITTER, (rank, simulated.peak_allocated, measured)
        if rank == real["rank"]:
            phases = {name: p.allocated for name, p in simulated.phases.items()}
            got = {name: p["allocated"] for name, p in rec["phases"].items()}
            assert got["optimizer"] == phases["optimizer"]
            assert 0 <= got["backward"] - phases["backward"] <= REAL_RANKS_JITTER, (phases, got)
            assert phases["forward"] <= got["forward"] <= got["backward"], (phases, got)


# two processes leave a barrier together and write a progress line each, as two gloo ranks leaving the
# same collective do; the parent counts the lines that are not one whole ``progress I N``
_LOCKSTEP = """
import multiprocessing as mp, os, re, sys
from memplan.train.worker import say

def rank(barrier, n):
    for i in range(n):
        barrier.wait()
        say(f"progress {i} {n}")

n = int(sys.argv[1])
read, write = os.pipe()
if os.fork() == 0:
    os.close(read)
    os.dup2(write, 1)
    barrier = mp.get_context("fork").Barrier(2)
    ranks = [mp.get_context("fork").Process(target=rank, args=(barrier, n)) for _ in range(2)]
    [p.start() for p in ranks]
    [p.join() for p in ranks]
    os._exit(0)
os.close(write)
lines = os.fdopen(read).read().splitlines()
print(len(lines), sum(not re.fullmatch(r"progress \\d+ \\d+", line) for line in lines))
"""


def test_ranks_lines_never_interleave():
    """Each progress line is one ``write(2)``, which a pipe keeps whole (POSIX, PIPE_BUF). With
    ``print`` in ``say``, under ``PYTHONUNBUFFERED`` as the ranks run (``worker_env``), 2,142 and
    3,592 of the 6,000 lines broke in two runs here (and 5,991 of 40,000 at n = 20,000)."""
    n = 3000
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # as worker_env runs the ranks: print's two writes go out apart
    r = subprocess.run([sys.executable, "-c", _LOCKSTEP, str(n)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(2 * n), "0"]


def test_launcher_skips_a_line_it_cannot_read():
    """A line that is not ``progress STEP TOTAL`` (the interleaving above, a library printing on the
    ranks' stdout) is skipped: the run goes on, its record decides the outcome."""
    import queue

    from memplan.validate.launch import _watch

    lines: queue.Queue[str | None] = queue.Queue()
    for line in ("progress 1 2progress 1 2\n", "\n", "progress 2 2\n", "done ok\n", None):
        lines.put(line)
    seen: list[tuple[int, int]] = []
    assert _watch(lines, float("inf"), lambda step, total: seen.append((step, total))) is False
    assert seen == [(2, 2)]


def test_real_ranks_report_every_rank(tiny: Path, capsys, monkeypatch):
    """``--real-ranks`` reports each rank's measured peak (``measured_bytes_by_rank``, and a line
    under the table); rank simulation runs one rank and says None. The launcher is faked here."""
    import memplan.cli.validate as cli
    from memplan.cli.app import run as cli_run
    from memplan.validate.launch import LaunchResult
    from memplan.validate.record import RunRecord

    def fake_launch(spec, workdir, timeout, progress=None, snapshot=None):
        ranks = [spec.rank] if spec.simulate else [0, 1]
        records = {
            r: RunRecord(
                status="ok",
                device_name="cpu",
                versions={},
                started="",
                finished="",
                peak_allocated=3 * 2**20 + r * 2**20,
                **spec.record_fields(rank=r),
            )  # fmt: skip
            for r in ranks
        }
        return LaunchResult(records, [], False, 0, "")

    monkeypatch.setattr(cli, "launch", fake_launch)
    flags = ["validate", str(tiny), "--dp", "2", "--zero", "2", "--precision", "fp32", *BASE]
    assert cli_run([*flags, "--real-ranks", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_bytes_by_rank"] == {"0": 3 * 2**20, "1": 4 * 2**20}
    assert cli_run([*flags, "--real-ranks"]) == 0
    assert "measured peak of every rank: rank 0 3.00 MiB, rank 1 4.00 MiB" in capsys.readouterr().out
    assert cli_run([*flags, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_bytes_by_rank"] is None
