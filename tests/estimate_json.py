"""``memplan estimate ARGS --format json`` run in-process by the tests (on sys.path: the directory of
tests/conftest.py)."""

from __future__ import annotations

import json


def estimate_memory(capsys, args: list[str]) -> dict:
    """The JSON's ``memory`` object of ``memplan estimate ARGS``; the exit code must be 0 (else stderr)."""
    from memplan.cli.app import run

    code = run(["estimate", *args, "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["memory"]


def run_cli(*argv: str) -> tuple[int, str, str]:
    """Any ``memplan ARGV`` run in-process: its exit code, stdout and stderr."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from memplan.cli.app import run

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(list(argv))
    return code, out.getvalue(), err.getvalue()
