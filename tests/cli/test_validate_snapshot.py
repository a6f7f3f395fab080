"""``memplan validate --snapshot DIR``: the folder checked before any run, the CPU refused in one
line, and the recording itself (a small function, run here against a fake ``torch.cuda.memory``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memplan.cli.app import run
from memplan.specs.resolve import resolve_job
from memplan.validate.launch import worker_command
from memplan.validate.snapshot import main, recording, snapshot_path
from memplan.validate.spec import RunSpec

SMALL = ["llama3-8b", "--dp", "1", "--seq-len", "128", "--micro-batch", "1"]


def _error(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("memplan: error: ")
    return err


def test_cpu_runs_are_refused_before_any_work(capsys, tmp_path, monkeypatch):
    import memplan.cli.validate as cli

    monkeypatch.setattr(cli, "run_estimate", lambda *a, **k: pytest.fail("estimated before refusing"))
    assert run(["validate", *SMALL, "--device", "cpu", "--snapshot", str(tmp_path / "snaps")]) == 2
    err = _error(capsys)
    assert "command line: --snapshot: memory snapshots need CUDA" in err
    assert not (tmp_path / "snaps").exists()


@pytest.mark.parametrize("case", ["file", "missing-parent"])
def test_the_folder_is_checked_first(capsys, tmp_path, case):
    target = tmp_path / "a-file" if case == "file" else tmp_path / "no" / "such"
    if case == "file":
        target.write_text("")
    assert run(["validate", *SMALL, "--device", "cpu", "--snapshot", str(target)]) == 2
    err = _error(capsys)
    assert err.startswith(f"memplan: error: {target}: --snapshot: ")
    assert ("is a file" if case == "file" else "does not exist") in err


class FakeMemory:
    """What ``recording`` calls of ``torch.cuda.memory``, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _record_memory_history(self, enabled=None, context=None, max_entries=0):
        self.calls.append(("record", enabled, context, max_entries))

    def _dump_snapshot(self, path):
        self.calls.append(("dump", path))
        Path(path).write_bytes(b"snapshot")


def test_recording_starts_before_and_dumps_after_even_on_failure(tmp_path):
    memory, path = FakeMemory(), tmp_path / "out" / "run.rank0.pickle"
    with pytest.raises(RuntimeError), recording(memory, path, max_entries=10):
        memory.calls.append(("run",))
        raise RuntimeError("CUDA out of memory")
    assert memory.calls == [("record", "all", None, 10), ("run",), ("dump", str(path)), ("record", None, None, 0)]
    assert path.read_bytes() == b"snapshot"


def test_main_runs_the_worker_module_and_fills_in_the_rank(tmp_path, monkeypatch):
    memory = FakeMemory()
    fake_torch = type(sys)("torch")
    fake_torch.cuda = type(sys)("torch.cuda")
    fake_torch.cuda.memory = memory
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    (tmp_path / "fake_worker.py").write_text("import sys\nprint(sys.argv)\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RANK", "5")
    argv = sys.argv[:]
    try:
        code = main([str(tmp_path / "run.rank{rank}.pickle"), "fake_worker", "spec.json", "out"])
    finally:
        sys.argv = argv
    assert code == 3  # the worker's own exit code
    assert (tmp_path / "run.rank5.pickle").exists()
    assert [c[0] for c in memory.calls] == ["record", "dump", "record"]


def test_the_launcher_wraps_the_worker_when_asked():
    job = resolve_job("llama3-8b", None, dict(dp=2, seq_len=128, micro_batch=1), inference=False)
    spec = RunSpec(model=job.model, workload=job.workload, plan=job.plan)
    target = snapshot_path(Path("/snaps"), "llama3-8b-dp2", None)
    cmd = worker_command(spec, Path("spec.json"), Path("out"), 2, target)
    i = cmd.index("memplan.validate.snapshot")
    assert cmd[i - 1 : i + 5] == ["-m", "memplan.validate.snapshot", "/snaps/llama3-8b-dp2.rank{rank}.pickle",
                                  "memplan.train.worker", "spec.json", "out"]  # fmt: skip
    assert "memplan.validate.snapshot" not in worker_command(spec, Path("spec.json"), Path("out"), 2)


def test_on_cuda_the_launcher_gets_the_snapshot_path_and_json_reports_it(capsys, tmp_path, monkeypatch):
    """The CUDA path end to end with the launcher faked: the rank's file is named after the plan."""
    import json

    import memplan.cli.validate as cli
    from memplan.validate.launch import LaunchResult
    from memplan.validate.record import RunRecord

    asked: dict = {}

    def fake_launch(spec, workdir, timeout, progress=None, snapshot=None):
        asked["snapshot"] = snapshot
        record = RunRecord(status="ok", device_name="fake H100", versions={}, started="", finished="",
                           peak_allocated=1, **spec.record_fields())  # fmt: skip
        return LaunchResult({spec.rank: record}, [], False, 0, "")

    monkeypatch.setattr(cli, "auto_device", lambda *a: "cuda")
    monkeypatch.setattr(cli, "require_cuda", lambda *a: None)  # a GPU, as far as validate can tell
    monkeypatch.setattr(cli, "launch", fake_launch)
    folder = tmp_path / "snaps"
    assert run(["validate", *SMALL, "--device", "cuda", "--snapshot", str(folder), "--format", "json"]) == 0
    expected = folder / "llama3-8b-dp1-tp1-pp1-zero0.rank0.pickle"
    assert asked["snapshot"] == expected
    assert json.loads(capsys.readouterr().out)["snapshot_path"] == str(expected)
