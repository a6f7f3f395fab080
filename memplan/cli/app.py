"""The ``memplan`` command and its one error path.

A user mistake (:class:`MemplanError`, a bad flag) prints one line on stderr and exits 2;
``MEMPLAN_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys

import typer

from memplan.errors import MemplanError

try:  # typer >= 0.20 vendors click as typer._click and no longer depends on click
    from typer._click import exceptions as _cx
except ImportError:  # older typer: click itself
    from click import exceptions as _cx

CLI = "command line"

HELP = "Per-GPU memory of LLM training and inference, and the plans that fit."
# each command's module (memplan.cli.<name>) and function; imported only when it is run or listed
COMMANDS = ("estimate", "profiles", "validate", "export", "check", "tune", "explain")
_NO_ARGS = getattr(_cx, "NoArgsIsHelpError", ())  # click < 8.2 has none


def _group() -> None:
    """Per-GPU memory of LLM training and inference, and the plans that fit."""


def build_app(only: str | None = None) -> typer.Typer:
    """The ``memplan`` command group, with every command or only ``only``.

    ``memplan estimate ...`` needs neither the tuner, the validator nor the checks: registering
    only the command that runs keeps their imports off the cold start (``benchmarks/bench_estimate.py``).
    The callback keeps a one-command app a group, so the command's name is still its first word.
    """
    app = typer.Typer(
        name="memplan", help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False
    )
    app.callback()(_group)
    for name in COMMANDS if only is None else (only,):
        module = importlib.import_module(f"memplan.cli.{name}")
        app.command(name)(getattr(module, name))
    return app


def _invoked(argv: list[str]) -> str | None:
    """The command ``argv`` runs when its first word names one (no global options exist), else None."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def _fail(message: str, code: int) -> int:
    one_line = " ".join(str(message).split())
    print(f"memplan: error: {one_line}", file=sys.stderr)
    return code


def _usage_message(err: Exception) -> str:
    """A click/typer usage error as ``command line: --flag: reason``."""
    param = getattr(err, "param", None)
    if isinstance(err, _cx.MissingParameter) and param is not None:
        what = "argument" if getattr(param, "param_type_name", "") == "argument" else "option"
        return f"{CLI}: {_param_name(param)}: missing {what}"
    if isinstance(err, _cx.BadParameter) and param is not None:
        reason = str(getattr(err, "message", err)).removeprefix("Value error, ")
        return f"{CLI}: {_param_name(param)}: {reason}"
    option = getattr(err, "option_name", None)
    if option and isinstance(err, _cx.NoSuchOption):
        return f"{CLI}: {option}: no such option" + (
            f" (did you mean {', '.join(sorted(err.possibilities))}?)" if err.possibilities else ""
        )
    if option:
        return f"{CLI}: {option}: {getattr(err, 'message', err)}"
    return f"{CLI}: {err.format_message()}"


def _param_name(param: object) -> str:
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    if opts:
        return max(opts, key=len)
    return str(getattr(param, "name", None) or "argument").upper()


def run(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (0 ok, 2 bad input, 1 internal error)."""
    debug = os.environ.get("MEMPLAN_DEBUG") == "1"
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        command = typer.main.get_command(build_app(_invoked(args)))
        rv = command.main(args=args, prog_name="memplan", standalone_mode=False)
    except MemplanError as err:
        if debug:
            raise
        return _fail(str(err), 2)
    except _NO_ARGS as err:
        # the help was rendered when the error was built (typer's rich help prints it right away)
        help_text = err.format_message()
        if help_text:
            print(help_text, file=sys.stderr)
        return 2
    except _cx.UsageError as err:
        if debug:
            raise
        return _fail(_usage_message(err), 2)
    except typer.Exit as err:
        return err.exit_code
    except typer.Abort:
        return _fail("aborted", 130)
    except Exception as err:  # a bug, not a user mistake: still one line unless debugging
        if debug:
            raise
        return _fail(f"internal error: {err.__class__.__name__}: {err} (MEMPLAN_DEBUG=1 shows the traceback)", 1)
    # standalone_mode=False: an Exit raised inside a command comes back as its exit code
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0


def main() -> None:
    """The ``memplan`` process: :func:`run`, with two savings a short-lived command can make.

    The command's module is imported with the cyclic garbage collector paused, and what it created
    is then frozen out of the collector's way (``gc.freeze``): importing pydantic's schemas and the
    cost model makes tens of thousands of long-lived objects and no garbage, and the ~80 collections
    they would trigger cost ~15 ms of a cold ``memplan estimate``. And the process leaves without the
    interpreter's teardown (:func:`_leave`), which frees every object one by one (~50 ms).
    For the commands of :data:`_COLLECTOR_OFF` the collector stays off to the end, and pydantic looks
    for no plugins (:data:`_NO_PLUGINS`).
    ``run`` itself, which the tests call in one process, keeps the collector as it is."""
    command = _invoked(sys.argv[1:])
    if command in _COLLECTOR_OFF:
        os.environ.setdefault(*_NO_PLUGINS)
        global _KEPT
        _KEPT = []  # keep_to_exit holds from now on
    if command is not None:
        enabled = gc.isenabled()
        gc.disable()
        try:
            importlib.import_module(f"memplan.cli.{command}")
        except Exception:  # run() imports it again and reports the failure in one line
            pass
        finally:
            gc.freeze()
            if enabled and command not in _COLLECTOR_OFF:
                gc.enable()
    _leave(run())


# Commands that make a bounded set of objects and exit: the cyclic collector stays off for the whole
# process. The collections an estimate triggers walk the run it built and replayed (~30,000 events,
# their tensors and blocks, all acyclic) for ~29 M instructions of a cold ``memplan estimate
# llama3-8b --gpus 8 --zero 3`` (1.5%, benchmarks/bench_estimate.py --instructions), and find
# 1,700-8,700 objects of cyclic garbage to free (the 8B plan, a 70B run, a plan that does not fit and
# re-estimates its suggestions: ``gc.collect()`` after each), which the process's exit frees instead.
# The tuner and the validator keep it: they run for long, building run after run.
_COLLECTOR_OFF = ("estimate",)
# What the commands of :data:`_COLLECTOR_OFF` made, held until :func:`_leave`'s ``os._exit`` when
# :func:`main` runs them (``run`` alone, as the tests call it, holds nothing): the objects go with the
# process's memory rather than one by one as the command's frame returns. ``memplan estimate``'s run
# (the 8B plan's 31,878 event tuples, its snapshots' live sets) freed that way cost ~9 M instructions
# (0.6%) of a cold ``memplan estimate llama3-8b --gpus 8 --zero 3``, after the output was written.
_KEPT: list[object] | None = None


def keep_to_exit(*objects: object) -> None:
    """Hold ``objects`` to the process's exit when :func:`main` runs a command of
    :data:`_COLLECTOR_OFF` (:data:`_KEPT`); else nothing."""
    if _KEPT is not None:
        _KEPT.extend(objects)


# pydantic's plugin discovery (``pydantic.plugin._loader.get_plugins``, on the first model class built):
# ``importlib.metadata.entry_points`` reads the entry points of every installed distribution, ~19 M
# instructions (1%) of a cold ``memplan estimate llama3-8b --gpus 8 --zero 3``, for plugins that would only
# observe memplan's own internal models. Off as typer turns it off for its own adapters
# (``typer._adapters.disabled_pydantic_plugins``); a value the user set is kept.
_NO_PLUGINS = ("PYDANTIC_DISABLE_PLUGINS", "__all__")


# Modules whose clean-up may live in C (static destructors, the C library's atexit: CUDA, NCCL,
# Triton's caches) or in processes and threads of their own: with any of them loaded, the normal exit.
_NORMAL_EXIT = ("torch", "triton", "optuna", "multiprocessing", "concurrent.futures")


def _leave(code: int) -> None:
    """Exit with ``code``, without the interpreter's teardown where that only frees memory: stdout and
    stderr are flushed, the functions registered with :mod:`atexit` run (logging's flush: what a
    normal exit runs first), then ``os._exit``. The teardown it skips frees every object one by
    one: ~50 ms of a cold estimate.
    With another thread running or one of :data:`_NORMAL_EXIT` loaded (the tuner, the validator's
    trainer), the normal exit."""
    _flush()
    threading = sys.modules.get("threading")
    alone = threading is None or threading.active_count() == 1
    run_registered = getattr(atexit, "_run_exitfuncs", None)  # CPython's: what Py_Finalize calls
    if alone and run_registered is not None and not any(name in sys.modules for name in _NORMAL_EXIT):
        run_registered()
        _flush()
        os._exit(code)
    sys.exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``| head``) or stream: nothing more to say
            pass
