"""The ``memplan`` command and its one error path.

A user mistake (:class:`MemplanError`, a bad flag) prints one line on stderr and exits 2;
``MEMPLAN_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys

import click
import typer

from memplan.cli import estimate, profiles
from memplan.errors import MemplanError

app = typer.Typer(
    name="memplan",
    help="Per-GPU memory of LLM training and inference, and the plans that fit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("estimate")(estimate.estimate)
app.command("profiles")(profiles.profiles)


def _fail(message: str, code: int) -> int:
    print(f"memplan: error: {message}", file=sys.stderr)
    return code


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (0 ok, 2 bad input, 1 internal error)."""
    debug = os.environ.get("MEMPLAN_DEBUG") == "1"
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="memplan", standalone_mode=False)
    except MemplanError as err:
        if debug:
            raise
        return _fail(str(err), 2)
    except click.exceptions.NoArgsIsHelpError as err:
        print(err.ctx.get_help() if err.ctx else "", file=sys.stderr)
        return 2
    except click.UsageError as err:
        if debug:
            raise
        return _fail(" ".join(err.format_message().split()), 2)
    except click.exceptions.Exit as err:
        return err.exit_code
    except click.exceptions.Abort:
        return _fail("aborted", 130)
    except Exception as err:  # a bug, not a user mistake: still one line unless debugging
        if debug:
            raise
        return _fail(f"internal error: {err.__class__.__name__}: {err} (MEMPLAN_DEBUG=1 shows the traceback)", 1)
    return 0


def main() -> None:
    sys.exit(run())
