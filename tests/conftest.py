import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# Under pytest-xdist (the README's ``-n 2``) each worker takes one core: one OpenMP thread each, set
# before torch is imported, and inherited by the processes the tests start. Two workers of two
# threads each on CI's two cores ran the suite no faster than one process (955 s against 953 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# the accuracy harness (tests/accuracy/hf_steps.py) is imported by its tests and by
# benchmarks/accuracy_table.py
sys.path.insert(0, str(Path(__file__).parent / "accuracy"))

# CI explores the same examples every run; locally each run explores new ones
if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:  # imported by a plugin first
    sys.modules["torch"].set_num_threads(1)

# MEMPLAN_TEST_CPU=path appends one line per test: its node id and the CPU seconds it took (this
# process and the processes it waited for, set-up and teardown included; a module's shared fixture
# counts in its first test), to find where the suite's time goes under any load: summarise with
# ``benchmarks/suite_cpu.py path``. A pytest that a test starts (the Triton interpreter's run) inherits
# MEMPLAN_TEST_CPU_NESTED and records nothing: its time is already its parent test's.
_CPU_REPORT = None if os.environ.get("MEMPLAN_TEST_CPU_NESTED") else os.environ.get("MEMPLAN_TEST_CPU")
if _CPU_REPORT:

    def _cpu_seconds() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        os.environ["MEMPLAN_TEST_CPU_NESTED"] = "1"  # for the processes this test starts
        start = _cpu_seconds()
        yield
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_CPU_REPORT}.{worker}", "a") as out:
            out.write(f"{_cpu_seconds() - start:.3f}\t{item.nodeid}\n")


settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves what the imports and the collection made (torch, transformers, the test modules: ~500k
    objects, nearly all alive until the end) out of the cyclic collector's way (``gc.freeze``, as
    ``memplan.cli.app.main`` does): a full collection then scans only what the tests make. The
    Trainer calls ``gc.collect()`` at the start of every ``train()`` (accelerate's ``free_memory``),
    which took ~0.33 s of CPU over that heap, a third of a tiny model's three steps.
    ``MEMPLAN_TEST_NO_FREEZE=1`` leaves it out, to compare."""
    if os.environ.get("MEMPLAN_TEST_NO_FREEZE"):
        return
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture()
def postgres_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database on a server of its own, on a Unix socket.

    The server is the one the ``pgserver`` wheel carries (a dev dependency), so no system
    PostgreSQL is needed; it starts in about a second and is stopped after the test.
    """
    pgserver = pytest.importorskip("pgserver", reason="the PostgreSQL server wheel (pgserver) is not installed")
    with warnings.catch_warnings():  # platformdirs warns that XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        server = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
