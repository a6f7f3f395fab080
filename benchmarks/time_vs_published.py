"""The step-time model against published training throughput (docs/accuracy.md).

Two sets of published runs, kept apart:

* the **fit set**: MosaicML's llm-foundry MPT benchmark tables (A100 80GB and H100 80GB,
  FSDP, 2023), the rows of models of 7B and up (hidden size 4096 or more, the sizes memplan
  plans for) whose attention is at most a fifth of the step's FLOPs. Each GPU
  profile's ``efficiency.matmul`` is the value that puts the median error of its rows at
  zero (``--fit`` recomputes it; the profile stores it rounded to two places);
* the **test set**: runs by other groups on other software (torchtitan, Megatron-LM, MT-NLG), predicted
  with the profiles as they are. The issue's target (within 15%) is judged on these.

    python benchmarks/time_vs_published.py [--fit] [--format json]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from memplan.costmodel.attention import sdpa_backend
from memplan.costmodel.flops import attention_flops_per_token, training_flops_per_token
from memplan.costmodel.time import Efficiency, estimate_time
from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

HERE = Path(__file__).parent
LLM_FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (MPT, FSDP, 2023)"
TORCHTITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHTITAN_A100 = "torchtitan docs/performance.md (Llama 3 on 64 A100 80GB)"
MEGATRON_T1 = "Narayanan et al. 2021 (arXiv 2104.04473), Table 1"
MEGATRON_T2 = "Narayanan et al. 2021 (arXiv 2104.04473), Table 2 (PTD-P)"
MT_NLG = "Smith et al. 2022 (MT-NLG 530B), Sec. 2.4: 60.1 / 50.2 / 44.4 s per iteration"
FIT_MAX_ATTENTION_SHARE = 0.2
FIT_MIN_HIDDEN = 4096
gpu_profile = cache(load_gpu)  # each profile read once, however many rows use it
model_profile = cache(load_model)

# MPT sizes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): d_model, n_heads, n_layers
MPT_SIZES = {
    "125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
    "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}  # fmt: skip


@cache
def mpt(size: str, seq_len: int) -> ModelSpec:
    """MPT: GPT layout without biases, LayerNorm, a 4h GELU MLP, tied embeddings over a
    50,368-token vocabulary, learned positions up to the sequence length."""
    h, heads, layers = MPT_SIZES[size]
    return ModelSpec(
        name=f"mpt-{size}", architecture="gpt2", hidden_size=h, num_layers=layers, num_attention_heads=heads,
        ffn_size=4 * h, mlp="plain", activation="gelu", norm="layernorm", vocab_size=50368,
        tied_embeddings=True, position_embedding="learned", max_position_embeddings=seq_len,
    )  # fmt: skip


def megatron_gpt(hidden: int, layers: int, heads: int, vocab: int = 51200, name: str | None = None) -> ModelSpec:
    """Narayanan et al. 2021's GPT models: GPT-3's layout at V 51,200, s 2048, f = 4h."""
    return model_profile("gpt3-175b").model_copy(
        update=dict(
            name=name or f"gpt-h{hidden}-l{layers}", hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
            num_kv_heads=heads, head_dim=hidden // heads, ffn_size=4 * hidden, vocab_size=vocab,
        )
    )  # fmt: skip


def mt_nlg() -> ModelSpec:
    """MT-NLG 530B: GPT-3's layout at h 20480, 105 layers, 128 heads, V 50272 (Smith et al. 2022)."""
    return megatron_gpt(20480, 105, 128, vocab=50272, name="mt-nlg-530b")


@dataclass(frozen=True)
class Row:
    name: str
    model: ModelSpec
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
    note: str = field(default="", compare=False)
    # the GPU's figures as the source states them, where its parts differ from the profile's
    hardware: dict = field(default_factory=dict, compare=False)
    # the fused attention kernel the run ran, where it is not the one torch 2.11 would pick (None: that one)
    attention_kernel: str | None = None

    @property
    def gpu_spec(self) -> GPUSpec:
        profile = gpu_profile(self.gpu)
        return profile.model_validate({**profile.model_dump(), **self.hardware}) if self.hardware else profile

    @property
    def attention_share(self) -> float:
        """Attention's share of the step's model FLOPs (causal)."""
        model = self.model
        return attention_flops_per_token(model, self.seq_len, True) / training_flops_per_token(
            model, self.seq_len, True
        )


@cache
def llm_foundry_rows() -> tuple[Row, ...]:
    """Every bf16 row of llm-foundry's A100 80GB and H100 80GB tables (benchmarks/published)."""
    rows = []
    with open(HERE / "published" / "llm_foundry_mpt.csv") as f:
        lines = [line for line in f if not line.startswith("#")]
    for r in csv.DictReader(lines):
        seq, gpus, mbs, ga = (int(r[k]) for k in ("seq", "gpus", "micro_batch", "grad_accum"))
        plan = dict(dp=gpus, zero=3, recompute="full" if r["act_ckpt"] == "1" else "none", precision="bf16-mixed")
        name = f"MPT-{r['size']} seq {seq}, {gpus} {r['gpu']}, mb {mbs}{', AC' if r['act_ckpt'] == '1' else ''}"
        # 1600 Gb/s RoCE per A100 node (200 Gb/s per GPU); 3.2 Tb/s InfiniBand per H100 node
        network = 25e9 if r["gpu"].startswith("a100") else 50e9
        rows.append(Row(name, mpt(r["size"], seq), r["gpu"], gpus, plan, seq, mbs, mbs * ga * gpus,
                        float(r["tokens_per_s_per_gpu"]), "memplan", LLM_FOUNDRY, network,
                        attention_kernel="flash"))  # fmt: skip
    return tuple(rows)


def in_fit_set(row: Row) -> bool:
    return row.model.hidden_size >= FIT_MIN_HIDDEN and row.attention_share <= FIT_MAX_ATTENTION_SHARE


def fit_rows(gpu: str) -> list[Row]:
    """The fit set of one GPU: its llm-foundry rows of 7B and up where attention is a small share."""
    return [r for r in llm_foundry_rows() if r.gpu == gpu and in_fit_set(r)]


def _mt_nlg_row(gpus: int, seconds: float) -> Row:
    """One MT-NLG run on Selene: "Each cluster node has 8 NVIDIA 80-GB A100 GPUs" and eight
    200 Gb/s HDR InfiniBand HCAs (Smith et al. 2022, Sec. 2.4)."""
    tokens = 1920 * 2048 / seconds / gpus
    # 2021: Megatron's fused scale-mask-softmax on materialised scores, attention dropout
    plan = dict(tp=8, pp=35, dp=gpus // 280, zero=1, recompute="full", precision="bf16-mixed", attention="eager")
    return Row(f"MT-NLG 530B, {gpus} A100 80GB", mt_nlg(), "a100-80gb", gpus, plan, 2048, 1, 1920, tokens,
               "megatron", MT_NLG, inter_node_bytes_per_s=25e9)  # fmt: skip


def megatron_tokens_per_s(teraflops: float, hidden: int, layers: int, seq: int = 2048, vocab: int = 51200) -> float:
    """Tokens/s per GPU from Narayanan et al.'s achieved teraFLOP/s, by their Eq. 3: an
    iteration of B sequences costs 96 B s l h^2 (1 + s / 6h + V / 16lh) FLOPs (with full
    recomputation), so one token 96 l h^2 (1 + s / 6h + V / 16lh)."""
    per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return teraflops * 1e12 / per_token


def _megatron_row(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
                  teraflops: float, micro_batch: int, source: str, note: str) -> Row:  # fmt: skip
    """One PTD-P run on Selene (DGX A100 80GB, 8 x 200 Gb/s HDR InfiniBand per node): fp16
    with fp32 master weights, full recomputation, 1F1B, 2021 eager attention (fused softmax,
    dropout), no distributed optimizer."""
    plan = dict(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, recompute="full", precision="fp16-master",
                attention="eager")  # fmt: skip
    return Row(f"Megatron GPT {params}, {gpus} A100 (t{tp} p{pp})", megatron_gpt(hidden, layers, heads), "a100-80gb",
               gpus, plan, 2048, micro_batch, batch, megatron_tokens_per_s(teraflops, hidden, layers), "megatron",
               source, inter_node_bytes_per_s=25e9, note=note)  # fmt: skip


# Table 1 (weak scaling): params, heads, hidden, layers, t, p, GPUs, batch, teraFLOP/s per GPU
MEGATRON_TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]  # fmt: skip
# Table 2 (PTD-P rows; micro-batch 1): the same model on more GPUs at a fixed batch
MEGATRON_TABLE_2 = [
    ("174.6B", 96, 12288, 96, 8, 12, 384, 1536, 153), ("174.6B", 96, 12288, 96, 8, 12, 768, 1536, 149),
    ("174.6B", 96, 12288, 96, 8, 12, 1536, 1536, 141), ("529.6B", 128, 20480, 105, 8, 35, 560, 2240, 171),
    ("529.6B", 128, 20480, 105, 8, 35, 1120, 2240, 167), ("529.6B", 128, 20480, 105, 8, 35, 2240, 2240, 159),
]  # fmt: skip
MICRO_BATCH_UNPUBLISHED = "micro-batch not published for Table 1: 1 assumed"
MEGATRON_ROWS = [_megatron_row(*r, 1, MEGATRON_T1, MICRO_BATCH_UNPUBLISHED) for r in MEGATRON_TABLE_1] + [
    _megatron_row(*r, 1, MEGATRON_T2, "") for r in MEGATRON_TABLE_2
]

LLAMA3_8B, LLAMA3_70B = model_profile("llama3-8b"), model_profile("llama3-70b")
SELECTIVE = dict(zero=3, recompute="selective-op", precision="bf16-mixed")  # torchtitan: selective_ac_option "op"
# torchtitan's H100s (Grand Teton): "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", 500 W;
# their tensor peak "is between SXM and NVL, and we don't know its exact value": the SXM's is kept
GRAND_TETON_H100 = {"hbm_bytes_per_s": 2.4e12}
# llm-foundry ran FlashAttention (the flash-attn package or its Triton port; its CSV header), not SDPA.
# torch at 1963fc8 (2024/12/23, the source's "Versions and Dates"): the 2.7 development line, whose SDPA puts
# flash before cuDNN on H100 (memplan.costmodel.attention.cuda_priority); torchtitan repeats K/V (repeat_kv)
TORCHTITAN_H100_KERNEL = sdpa_backend("cuda", "bf16", 128, 32, 32, enable_gqa=False, torch_version=(2, 7))
H100_500W = "H100 SXM at 500 W with HBM2e at 2.4 TB/s (the source's figure); its peak is unknown: the SXM's is used"
TEST_ROWS = [
    Row("Llama 3.1 8B FSDP, 8 H100 (500 W)", LLAMA3_8B, "h100-sxm", 8, dict(dp=8, **SELECTIVE), 8192, 2, 16,
        5762, "memplan", TORCHTITAN_H100, note=H100_500W, hardware=GRAND_TETON_H100,
        attention_kernel=TORCHTITAN_H100_KERNEL),
    Row("Llama 3.1 8B FSDP, 128 H100 (500 W)", LLAMA3_8B, "h100-sxm", 128, dict(dp=128, **SELECTIVE), 8192, 2, 256,
        5605, "memplan", TORCHTITAN_H100, note=H100_500W, hardware=GRAND_TETON_H100,
        attention_kernel=TORCHTITAN_H100_KERNEL),
    Row("Llama 3 8B FSDP, 64 A100", LLAMA3_8B, "a100-80gb", 64, dict(dp=64, **SELECTIVE), 8192, 1, 64, 2973,
        "memplan", TORCHTITAN_A100),
    Row("Llama 3 70B FSDP, 64 A100", LLAMA3_70B, "a100-80gb", 64,
        dict(dp=64, zero=3, recompute="full", precision="bf16-mixed"), 8192, 1, 64, 331, "memplan", TORCHTITAN_A100),
    _mt_nlg_row(2240, 60.1),
    _mt_nlg_row(2800, 50.2),
    _mt_nlg_row(3360, 44.4),
    *MEGATRON_ROWS,
]  # fmt: skip


def predict(row: Row, eff: Efficiency | None = None) -> dict:
    """The row predicted with ``eff`` (default: the GPU profile's efficiencies, no calibration)."""
    cluster = ClusterSpec(
        gpus_per_node=8, nodes=max(1, row.gpus // 8), inter_node_bytes_per_s=row.inter_node_bytes_per_s
    )
    workload = TrainingWorkload(seq_len=row.seq_len, micro_batch=row.micro_batch, global_batch=row.global_batch)
    plan = Plan(**row.plan)
    report = estimate_time(
        row.model, workload, plan, row.gpu_spec, cluster, row.runtime, eff, attention_kernel=row.attention_kernel
    )
    predicted, published = report.tokens_per_s_per_gpu, row.published_tokens_per_s_per_gpu
    return {
        "run": row.name,
        "gpu": row.gpu,
        "plan": row.plan,
        "seq_len": row.seq_len,
        "published_tokens_per_s_per_gpu": round(published, 1),
        "predicted_tokens_per_s_per_gpu": round(predicted, 1),
        "error_pct": round(100 * (predicted - published) / published, 1),
        "predicted_mfu": round(report.mfu, 3),
        "attention_share": round(row.attention_share, 3),
        "source": row.source,
        "note": row.note,
    }


def _median_log_error(rows: list[Row], eff: Efficiency) -> float:
    errors = [math.log(p["predicted_tokens_per_s_per_gpu"] / p["published_tokens_per_s_per_gpu"])
              for p in (predict(r, eff) for r in rows)]  # fmt: skip
    return statistics.median(errors)


def fit_matmul(gpu_name: str) -> float:
    """The matmul efficiency that puts the median log error of the GPU's fit rows at zero,
    with the profile's attention efficiency held (bisection: throughput rises with it)."""
    rows = fit_rows(gpu_name)
    attention = Efficiency.for_gpu(gpu_profile(gpu_name)).attention
    lo, hi = 0.2, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _median_log_error(rows, Efficiency(matmul=mid, attention=attention)) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def summary(results: list[dict]) -> dict:
    errors = [abs(r["error_pct"]) for r in results]
    return {
        "rows": len(results),
        "median_abs_error_pct": round(statistics.median(errors), 1),
        "within_15_pct": sum(e <= 15 for e in errors),
        "worst_pct": max((r["error_pct"] for r in results), key=abs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.add_argument("--fit", action="store_true", help="recompute each profile's fitted matmul efficiency")
    args = parser.parse_args()
    gpus = ("a100-80gb", "h100-sxm")
    fitted = {g: round(fit_matmul(g), 4) for g in gpus} if args.fit else {}
    fit = {g: [predict(r) for r in fit_rows(g)] for g in gpus}
    rest = [r for r in llm_foundry_rows() if not in_fit_set(r)]
    small = [predict(r) for r in rest if r.attention_share <= FIT_MAX_ATTENTION_SHARE]  # so: under 7B
    heavy = [predict(r) for r in rest if r.attention_share > FIT_MAX_ATTENTION_SHARE]
    test = [predict(r) for r in TEST_ROWS]
    if args.format == "json":
        out = {"fitted_matmul": fitted, "fit": {g: summary(v) for g, v in fit.items()}, "test": test,
               "test_summary": summary(test), "small_models": summary(small),
               "attention_heavy": summary(heavy)}  # fmt: skip
        print(json.dumps(out, indent=2))
        return
    for g in gpus:
        line = f"fit set {g}: {summary(fit[g])}"
        if fitted:
            line += f"; fitted matmul {fitted[g]} (profile {Efficiency.for_gpu(gpu_profile(g)).matmul})"
        print(line)
    print(f"llm-foundry models under 7B (not fitted): {summary(small)}")
    print(f"llm-foundry attention-heavy rows (not fitted): {summary(heavy)}")
    print(f"test set: {summary(test)}\n")
    print("| run | plan | published tokens/s/GPU | predicted | error | predicted MFU |")
    print("|---|---|---:|---:|---:|---:|")
    for r in test:
        plan = ", ".join(f"{k}={v}" for k, v in r["plan"].items())
        published, predicted = r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
        mfu = 100 * r["predicted_mfu"]
        print(f"| {r['run']} | {plan} | {published:,.0f} | {predicted:,.0f} | {r['error_pct']:+.1f}% | {mfu:.1f}% |")


if __name__ == "__main__":
    main()
