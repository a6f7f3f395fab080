"""The rates the step-time model's terms need, measured on one GPU, not fitted to steps (issue 26).

    python benchmarks/bench_kernel_rates.py [--tokens 32768] [--format json]

Times, with CUDA events (the mean of ``REPEATS`` after ``WARMUP`` launches), one kernel of each kind
the kernel profiles of 2026-11-28 found in a bundled-trainer step (docs/cost-model.md, "The step time
against kernel profiles"), at the shapes of Llama-3.2-1B's layers (h 2048, 32 query and 8 KV heads of
64) over ``--tokens`` tokens:

- ``gemm_bf16``: an 8192^3 bf16 matrix product (cuBLAS; FLOP/s);
- ``copy``: a contiguous fp32 copy (bytes read and written per second: the HBM ceiling);
- ``add_fp32``: a contiguous fp32 add, ATen's vectorised element-wise kernel (the residual adds);
- ``mul_broadcast_fp32``: an fp32 (tokens, h) tensor times a (tokens, 1) one, the non-vectorised
  ``elementwise_kernel`` (RMSNorm's scale and weight multiplies, RoPE's backward);
- ``mul_cast_strided``: a bf16 (b, heads, s, 64) view of a (b, s, heads x 64) tensor times an fp32
  (s, 64) table, the casting ``gpu_kernel_impl`` (RoPE's forward under autocast);
- ``cast_bf16_fp32``: ``.float()`` of a contiguous bf16 tensor (``direct_copy`` with a cast);
- ``cat_halves``: RoPE's ``rotate_half`` (``CatArrayBatchedCopy``) on the bf16 query view.

Each row gives seconds per launch, bytes moved (each input read once, the output written once) per
second and elements per second. On a CPU it runs the same operations and its figures are the CPU's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

WARMUP, REPEATS = 3, 10
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 8, 64


def timed(fn: Callable[[], object], cuda: bool) -> float:
    """Mean seconds of ``fn`` over ``REPEATS`` launches after ``WARMUP``: CUDA events on a GPU."""
    import torch

    for _ in range(WARMUP):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPEATS):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / REPEATS
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    return (time.perf_counter() - t0) / REPEATS


def cases(tokens: int, device: str) -> dict[str, tuple[Callable[[], object], float, float]]:
    """name -> (the launch, bytes it moves, elements it writes, or FLOPs for the GEMM)."""
    import torch

    f32, bf16 = torch.float32, torch.bfloat16
    seq = 8192 if tokens % 8192 == 0 else tokens
    batch = tokens // seq
    x = torch.randn(tokens, HIDDEN, device=device, dtype=f32)
    y, out = torch.randn_like(x), torch.empty_like(x)
    rstd = torch.randn(tokens, 1, device=device, dtype=f32)
    q = torch.randn(batch, seq, HEADS * HEAD_DIM, device=device, dtype=bf16)
    q_heads = q.view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)  # as Attention.forward's view
    cos = torch.randn(seq, HEAD_DIM, device=device, dtype=f32)
    xb = x.to(bf16)
    n = 8192 if device == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=bf16), torch.randn(n, n, device=device, dtype=bf16)
    h_elems, q_elems = tokens * HIDDEN, tokens * HEADS * HEAD_DIM
    half = HEAD_DIM // 2
    return {
        "gemm_bf16": (lambda: a @ b, 3 * 2 * n * n, 2.0 * n**3),
        "copy": (lambda: out.copy_(x), 8 * h_elems, h_elems),
        "add_fp32": (lambda: torch.add(x, y, out=out), 12 * h_elems, h_elems),
        "mul_broadcast_fp32": (lambda: torch.mul(x, rstd, out=out), 8 * h_elems, h_elems),
        "mul_cast_strided": (lambda: q_heads * cos, 6 * q_elems, q_elems),
        "cast_bf16_fp32": (lambda: xb.float(), 6 * h_elems, h_elems),
        "cat_halves": (lambda: torch.cat((-q_heads[..., half:], q_heads[..., :half]), dim=-1), 4 * q_elems, q_elems),
    }


def measure(tokens: int) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows = {}
    for name, (fn, nbytes, work) in cases(tokens, device).items():
        seconds = timed(fn, cuda)
        rate = "flops_per_s" if name == "gemm_bf16" else "elements_per_s"
        rows[name] = {"seconds": seconds, "bytes_per_s": nbytes / seconds, rate: work / seconds}
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {"device": name, "torch": torch.__version__, "tokens": tokens, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="tokens of the element-wise cases")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    result = measure(args.tokens)
    if args.format == "json":
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['device']} (torch {result['torch']}), {result['tokens']} tokens")
    for name, r in result["rows"].items():
        gemm = "flops_per_s" in r
        rate = f"{r['flops_per_s'] / 1e12:.0f} TFLOP/s" if gemm else f"{r['elements_per_s'] / 1e9:.0f} G/s"
        print(f"  {name:20s} {r['seconds'] * 1e3:9.3f} ms  {r['bytes_per_s'] / 1e12:6.2f} TB/s  {rate}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
