"""The step-time model against published training throughput (docs/accuracy.md).

Each row is a run whose configuration and measured throughput were published, predicted
here with no calibration (``Efficiency()`` defaults):

    python benchmarks/time_vs_published.py [--format json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from memplan.costmodel.time import estimate_time
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

TORCHTITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHTITAN_A100 = "torchtitan docs/performance.md (Llama 3 on 64 A100 80GB)"
MT_NLG = "Smith et al. 2022 (MT-NLG 530B), Sec. 2.4: 60.1 / 50.2 / 44.4 s per iteration"


def mt_nlg() -> ModelSpec:
    """MT-NLG 530B: GPT-3's layout at h 20480, 105 layers, 128 heads, V 50272 (Smith et al. 2022)."""
    return load_model("gpt3-175b").model_copy(
        update=dict(
            name="mt-nlg-530b", hidden_size=20480, num_layers=105, num_attention_heads=128, num_kv_heads=128,
            head_dim=160, ffn_size=81920, vocab_size=50272,
        )
    )  # fmt: skip


@dataclass(frozen=True)
class Row:
    name: str
    model: str | ModelSpec
    gpu: str
    gpus: int
    plan: dict
    seq_len: int
    micro_batch: int
    global_batch: int
    published_tokens_per_s_per_gpu: float
    runtime: str
    source: str
    inter_node_bytes_per_s: float = 50e9  # 400 Gb/s per GPU


def _mt_nlg_row(gpus: int, seconds: float) -> Row:
    tokens = 1920 * 2048 / seconds / gpus
    plan = dict(tp=8, pp=35, dp=gpus // 280, zero=1, recompute="full", precision="bf16-mixed")
    return Row(f"MT-NLG 530B, {gpus} A100 40GB", mt_nlg(), "a100-40gb", gpus, plan, 2048, 1, 1920, tokens,
               "megatron", MT_NLG, inter_node_bytes_per_s=25e9)  # fmt: skip


SELECTIVE = dict(zero=3, recompute="selective", precision="bf16-mixed")
ROWS = [
    Row("Llama 3.1 8B FSDP, 8 H100 (500 W)", "llama3-8b", "h100-sxm", 8, dict(dp=8, **SELECTIVE), 8192, 2, 16,
        5762, "memplan", TORCHTITAN_H100),
    Row("Llama 3.1 8B FSDP, 128 H100 (500 W)", "llama3-8b", "h100-sxm", 128, dict(dp=128, **SELECTIVE), 8192, 2, 256,
        5605, "memplan", TORCHTITAN_H100),
    Row("Llama 3 8B FSDP, 64 A100", "llama3-8b", "a100-80gb", 64, dict(dp=64, **SELECTIVE), 8192, 1, 64, 2973,
        "memplan", TORCHTITAN_A100),
    Row("Llama 3 70B FSDP, 64 A100", "llama3-70b", "a100-80gb", 64,
        dict(dp=64, zero=3, recompute="full", precision="bf16-mixed"), 8192, 1, 64, 331, "memplan", TORCHTITAN_A100),
    _mt_nlg_row(2240, 60.1),
    _mt_nlg_row(2800, 50.2),
    _mt_nlg_row(3360, 44.4),
]  # fmt: skip


def predict(row: Row) -> dict:
    model = row.model if isinstance(row.model, ModelSpec) else load_model(row.model)
    cluster = ClusterSpec(gpus_per_node=8, nodes=row.gpus // 8, inter_node_bytes_per_s=row.inter_node_bytes_per_s)
    workload = TrainingWorkload(seq_len=row.seq_len, micro_batch=row.micro_batch, global_batch=row.global_batch)
    report = estimate_time(model, workload, Plan(**row.plan), load_gpu(row.gpu), cluster, row.runtime)
    predicted, published = report.tokens_per_s_per_gpu, row.published_tokens_per_s_per_gpu
    return {
        "run": row.name,
        "plan": row.plan,
        "published_tokens_per_s_per_gpu": round(row.published_tokens_per_s_per_gpu, 1),
        "predicted_tokens_per_s_per_gpu": round(predicted, 1),
        "error_pct": round(100 * (predicted - published) / published, 1),
        "predicted_mfu": round(report.mfu, 3),
        "source": row.source,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--format", choices=["table", "json"], default="table")
    results = [predict(row) for row in ROWS]
    if parser.parse_args().format == "json":
        print(json.dumps(results, indent=2))
        return
    print("| run | plan | published tokens/s/GPU | predicted | error | predicted MFU |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        plan = ", ".join(f"{k}={v}" for k, v in r["plan"].items())
        published, predicted = r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
        mfu = 100 * r["predicted_mfu"]
        print(f"| {r['run']} | {plan} | {published:,.0f} | {predicted:,.0f} | {r['error_pct']:+.1f}% | {mfu:.1f}% |")


if __name__ == "__main__":
    main()
