"""benchmarks/bench_kernel_rates.py: each case's byte and element counts are those of the tensors it
writes and reads, and the script runs on the CPU (a GPU session reads its rates into the time model)."""

from __future__ import annotations

import pytest
from benchmark_script import load


@pytest.fixture(scope="module")
def bench():
    return load("bench_kernel_rates")


# bytes per written element beside the output's own: the inputs read (a broadcast operand's few aside)
READ_PER_WRITTEN = {
    "copy": 1, "add_fp32": 2, "mul_broadcast_fp32": 1, "mul_cast_strided": 0.5, "cast_bf16_fp32": 0.5,
    "cat_halves": 1,
}  # fmt: skip


def test_each_case_counts_the_bytes_of_its_tensors(bench):
    rows = bench.cases(512, "cpu")
    assert set(rows) == {"gemm_bf16", *READ_PER_WRITTEN}
    for name, ratio in READ_PER_WRITTEN.items():
        fn, nbytes, elements = rows[name]
        out = fn()
        assert out.numel() == elements, name
        assert nbytes == out.numel() * out.element_size() * (1 + ratio), name
    fn, nbytes, flops = rows["gemm_bf16"]
    n = fn().shape[0]
    assert (flops, nbytes) == (2.0 * n**3, 3 * 2 * n * n)


def test_it_runs_and_reports_every_rate(bench, capsys):
    assert bench.main(["--tokens", "512", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert '"mul_broadcast_fp32"' in out and '"flops_per_s"' in out
