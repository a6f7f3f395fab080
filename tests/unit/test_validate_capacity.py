"""memplan.validate.capacity: the host's free memory and the refusal of a run that cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.validate.capacity import check_fits_here, host_available_bytes


def test_mem_available_is_read_in_bytes(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert host_available_bytes(meminfo) == 20_000_000 * 1024
    assert host_available_bytes(tmp_path / "missing") is None
    (tmp_path / "odd").write_text("MemAvailable: lots\n")
    assert host_available_bytes(tmp_path / "odd") is None


def test_a_run_beyond_the_free_memory_is_refused_with_the_figures():
    check_fits_here(10 * 2**30, 20 * 2**30, "host", "command line")
    check_fits_here(10 * 2**40, None, "host", "command line")  # unknown: allowed
    with pytest.raises(MemplanError) as err:
        check_fits_here(1577 * 2**30, 22 * 2**30, "host", "command line")
    assert err.value.field == "plan"
    assert "1,577.00 GiB" in err.value.reason and "22.00 GiB is free" in err.value.reason
