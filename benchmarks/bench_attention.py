"""Speed of memplan's FlashAttention kernels beside PyTorch's SDPA backends (a benchmark, not a test).

TFLOP/s of the forward, the backward and both, bf16, causal and not, head dims 64 and 128,
sequence lengths 1k to 16k at 16k tokens per batch (batch = 16384 // seq), 2048 // head_dim
heads (query and K/V heads alike, so every SDPA backend runs its own kernel), for
``memplan.kernels.flash_attention`` and ``F.scaled_dot_product_attention`` under each backend
this machine has (flash, cuDNN, memory-efficient). Median time of ``triton.testing.do_bench``.

FLOPs (FlashAttention-2, Dao 2023, Sec. 4): forward ``4 * b * h * s^2 * d`` (two matmuls, 2 FLOPs a
multiply-add), halved when causal; backward 2.5x the forward (five matmuls to its two).

Goal on H100 / H200: forward at least SDPA flash's speed, backward at least 0.9x of it.
The table goes to docs/kernels.md with the header this script prints.

    python benchmarks/bench_attention.py [--seqlens 1024 2048 4096 8192 16384] [--head-dims 64 128]
                                         [--tokens 16384] [--hidden 2048] [--format json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable

MODES = ("fwd", "bwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # x the forward's FLOPs


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool, mode: str) -> float:
    """4 b h s^2 d for the forward (QK^T and PV), halved when causal; x2.5 backward, x3.5 both."""
    forward = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    return forward * FLOP_FACTOR[mode]


def providers() -> dict[str, Callable]:
    """Name -> attention(q, k, v, causal) for memplan's kernels and each SDPA backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memplan import kernels

    def memplan(q, k, v, causal):
        return kernels.flash_attention(q, k, v, causal=causal, backend="triton")

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return run

    return {
        "memplan": memplan,
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }


def time_ms(attn: Callable, q, k, v, causal: bool, mode: str) -> float:
    """Median milliseconds of one forward, one backward, or both."""
    import torch
    from triton.testing import do_bench

    do = torch.randn_like(q)
    if mode == "fwd":
        with torch.no_grad():
            return do_bench(lambda: attn(q, k, v, causal), return_mode="median")
    if mode == "bwd":
        out = attn(q, k, v, causal)
        return do_bench(lambda: out.backward(do, retain_graph=True), grad_to_none=[q, k, v], return_mode="median")
    return do_bench(lambda: attn(q, k, v, causal).backward(do), grad_to_none=[q, k, v], return_mode="median")


def measure(seq: int, head_dim: int, causal: bool, mode: str, tokens: int, hidden: int) -> dict:
    import torch

    batch, heads = tokens // seq, hidden // head_dim
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    flops = attention_flops(batch, heads, seq, head_dim, causal, mode)
    row = {"mode": mode, "causal": causal, "head_dim": head_dim, "seq": seq, "batch": batch, "heads": heads}
    for name, attn in providers().items():
        try:
            row[name] = flops / (time_ms(attn, q, k, v, causal, mode) * 1e-3) / 1e12
        except (RuntimeError, torch.OutOfMemoryError) as e:  # backend not built, unsupported, or out of memory
            row[name] = None
            row.setdefault("errors", {})[name] = str(e).splitlines()[0][:200]
        torch.cuda.empty_cache()
    return row


def header() -> dict:
    import torch
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "dtype": "bfloat16",
        "timing": "triton.testing.do_bench, median",
    }


def render_table(head: dict, rows: list[dict]) -> str:
    names = list(providers())
    lines = [
        f"{head['gpu']}, torch {head['torch']} (CUDA {head['cuda']}), Triton {head['triton']}, "
        f"Python {head['python']}, {head['date']}; {head['dtype']}, {head['timing']}; TFLOP/s",
        "",
        "| mode | causal | head_dim | seq | batch x heads | " + " | ".join(names) + " | memplan / sdpa-flash |",
        "|---|---|---:|---:|---|" + "---:|" * (len(names) + 1),
    ]
    for r in rows:
        cells = ["n/a" if r[n] is None else f"{r[n]:.1f}" for n in names]
        ratio = f"{r['memplan'] / r['sdpa-flash']:.2f}" if r["memplan"] and r["sdpa-flash"] else "n/a"
        lines.append(
            f"| {r['mode']} | {'yes' if r['causal'] else 'no'} | {r['head_dim']} | {r['seq']} | "
            f"{r['batch']} x {r['heads']} | " + " | ".join(cells) + f" | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch: batch = tokens // seq")
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_attention: no CUDA GPU here; this benchmark times GPU kernels and has nothing to measure")
    head, rows = header(), []
    for mode in args.modes:
        for causal in (False, True):
            for head_dim in args.head_dims:
                for seq in args.seqlens:
                    rows.append(measure(seq, head_dim, causal, mode, args.tokens, args.hidden))
    if args.format == "json":
        print(json.dumps({**head, "unit": "TFLOP/s", "results": rows}, indent=2))
    else:
        print(render_table(head, rows))


if __name__ == "__main__":
    main()
