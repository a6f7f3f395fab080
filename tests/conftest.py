import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# the accuracy harness (tests/accuracy/hf_steps.py) is imported by its tests and by
# benchmarks/accuracy_table.py
sys.path.insert(0, str(Path(__file__).parent / "accuracy"))

# CI explores the same examples every run; locally each run explores new ones
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


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
