"""Megatron-LM: the arguments of ``pretrain_gpt.py``, as a bash array ``MEMPLAN_ARGS=( ... )``.

Flag names from Megatron-LM's ``megatron/training/arguments.py`` (``_add_network_size_args``,
``_add_training_args``, ``_add_mixed_precision_args``, ``_add_distributed_args``,
``_add_moe_args``, ``_add_megatron_fsdp_args``), core_r0.13-era main.

Mapping: ZeRO-1 = ``--use-distributed-optimizer``; ZeRO-2 / 3 = Megatron-FSDP
(``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``);
interleaved pipeline = ``--num-layers-per-virtual-pipeline-stage`` L / (pp x v) (Megatron's own
virtual_pipeline_model_parallel_size is derived from it); selective recomputation =
``--recompute-granularity selective`` (the attention core, Korthikanti et al. 2022, as estimated);
full = ``--recompute-method uniform --recompute-num-layers 1`` (every layer), or ``block`` with
``recompute_layers`` (the first n layers of a stage); optimizer offload =
``--optimizer-cpu-offload --optimizer-offload-fraction 1.0``; ``--make-vocab-size-divisible-by 1``
pads the vocabulary to a multiple of tp only, as the estimate's layout does.
Not expressible: parameter offload, NVMe, bf16-mixed (autocast), bf16 without fp32 master
weights, Adafactor and 8-bit AdamW, partial recomputation under interleaving.
"""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any

from memplan.errors import MemplanError
from memplan.export.common import (
    GRADIENT_CLIPPING,
    Exported,
    comment_block,
    fields,
    layers_per_chunk,
    preamble,
    refuse,
    refuse_model_features,
)
from memplan.specs.model import ModelSpec
from memplan.specs.resolve import Job

TARGET = "megatron"
CARRIES = frozenset(
    {
        "gpus",
        "nodes",
        "dp",
        "tp",
        "sequence_parallel",
        "pp",
        "pp_schedule",
        "virtual_stages",
        "cp",
        "ep",
        "zero",
        "offload_optimizer",
        "offload_params",
        "recompute",
        "recompute_layers",
        "precision",
        "fp8_recipe",
        "optimizer",
        "attention",
        "seq_len",
        "micro_batch",
        "global_batch",
    }
)
# Megatron's dynamic loss scaling defaults (arguments.py: --initial-loss-scale 2**32, --min-loss-scale 1,
# --loss-scale-window 1000, --hysteresis 2), written out for fp16
FP16_ARGS = [
    ("--fp16", None),
    ("--initial-loss-scale", 4294967296),
    ("--min-loss-scale", 1.0),
    ("--loss-scale-window", 1000),
    ("--hysteresis", 2),
]
PRECISION_ARGS: dict[str, list[tuple[str, Any]]] = {
    "fp32": [],
    "bf16-master": [("--bf16", None)],
    "fp16-master": FP16_ARGS,
    "fp8": [("--bf16", None), ("--fp8-format", "hybrid"), ("--transformer-impl", "transformer_engine")],
}
OPTIMIZERS = {"adamw": "adam", "sgd": "sgd"}  # Megatron's adam is AdamW (decoupled --weight-decay)
SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
Arg = tuple[str, Any]


def _check(job: Job) -> None:
    p = job.plan
    if p.offload_params != "none":
        raise refuse(
            "offload_params", TARGET, f"offload_params={p.offload_params}", "Megatron does not offload parameters"
        )
    if p.offload_optimizer == "nvme":
        raise refuse(
            "offload_optimizer", TARGET, "offload_optimizer=nvme", "--optimizer-cpu-offload offloads to CPU only"
        )
    if p.precision not in PRECISION_ARGS:
        raise refuse(
            "precision",
            TARGET,
            f"precision {p.precision}",
            "Megatron trains fp32, or bf16 / fp16 / fp8 parameters with fp32 main weights (--bf16, --fp16, "
            "--fp8-format); it has no autocast mode and no 16-bit-only optimizer states",
        )
    if p.precision == "fp8" and p.fp8_recipe == "rowwise":
        raise refuse(
            "fp8_recipe", TARGET, "fp8_recipe rowwise", "--fp8-recipe takes tensorwise, delayed, mxfp8 or blockwise"
        )
    if p.fp8_all_gather:
        raise refuse(
            "fp8_all_gather",
            TARGET,
            "fp8_all_gather",
            "the fp8 all-gather modelled is torchao's under FSDP2, not Megatron's",
        )
    if p.optimizer not in OPTIMIZERS:
        raise refuse("optimizer", TARGET, f"optimizer {p.optimizer}", "--optimizer takes adam (AdamW) or sgd")
    if p.pp > 1 and p.pp_schedule == "gpipe":
        raise refuse("pp_schedule", TARGET, "pp_schedule gpipe", "Megatron schedules pipelines 1F1B (or interleaved)")
    if p.recompute_layers is not None and p.virtual_stages > 1:
        raise refuse(
            "recompute_layers",
            TARGET,
            f"recompute_layers={p.recompute_layers} with interleaving",
            "--recompute-num-layers counts layers per virtual chunk, not per stage",
        )


def model_args(model: ModelSpec) -> list[Arg]:
    """The network-size flags that build the same model (``_add_network_size_args``, ``_add_moe_args``)."""
    refuse_model_features(model, TARGET)
    args: list[Arg] = [
        ("--num-layers", model.num_layers),
        ("--hidden-size", model.hidden_size),
        ("--ffn-hidden-size", model.ffn_size),
        ("--num-attention-heads", model.num_attention_heads),
    ]
    if model.kv_heads != model.num_attention_heads:
        args += [("--group-query-attention", None), ("--num-query-groups", model.kv_heads)]
    if model.head_dim and model.head_dim != model.hidden_size // model.num_attention_heads:
        args.append(("--kv-channels", model.head_dim))
    args.append(("--max-position-embeddings", model.max_position_embeddings))
    positions = {"rope": "rope", "learned": "learned_absolute"}
    if model.position_embedding not in positions:
        raise MemplanError(
            f"Megatron has no {model.position_embedding} position embedding", field="model.position_embedding"
        )
    args.append(("--position-embedding-type", positions[model.position_embedding]))
    args.append(("--normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"))
    if model.mlp == "gated":
        if model.activation != "silu":
            raise MemplanError(
                f"Megatron's gated MLP is SwiGLU; no flag for {model.activation}", field="model.activation"
            )
        args.append(("--swiglu", None))
    biases = (model.qkv_bias, model.attn_out_bias, model.mlp_bias)
    if biases == (False, False, False):
        args.append(("--disable-bias-linear", None))
    elif biases == (True, False, False):
        args += [("--disable-bias-linear", None), ("--add-qkv-bias", None)]
    elif biases != (True, True, True):
        raise MemplanError("Megatron biases are all linears, none, or QKV only", field="model.attn_out_bias")
    if model.qk_norm:
        args.append(("--qk-layernorm", None))
    if not model.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    args.append(("--make-vocab-size-divisible-by", 1))
    if model.moe is not None:
        args += _moe_args(model)
    return args


def _moe_args(model: ModelSpec) -> list[Arg]:
    moe = model.moe
    assert moe is not None
    if moe.shared_expert_gate or moe.router_bias:
        raise MemplanError("no Megatron flag for a gated shared expert or a router bias", field="model.moe")
    args: list[Arg] = [
        ("--num-experts", moe.num_experts),
        ("--moe-router-topk", moe.top_k),
        ("--moe-ffn-hidden-size", moe.expert_ffn_size),
    ]
    if moe.num_shared_experts:
        args.append(("--moe-shared-expert-intermediate-size", moe.num_shared_experts * moe.shared_ffn_size))
    pattern = [int(model.is_moe_layer(i)) for i in range(model.num_layers)]
    if 0 in pattern:
        args.append(("--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"))
    return args


def parallel_args(job: Job) -> list[Arg]:
    """Degrees, batch, recomputation, ZeRO, offload, precision, optimizer, attention."""
    p, f = job.plan, fields(job)
    args: list[Arg] = [
        ("--tensor-model-parallel-size", p.tp),
        ("--pipeline-model-parallel-size", p.pp),
        ("--context-parallel-size", p.cp),
        ("--expert-model-parallel-size", p.ep),
    ]
    if job.model.moe is not None:
        args.append(("--expert-tensor-parallel-size", p.tp))  # memplan: expert tensor parallelism = tp
    if p.pp_schedule == "interleaved":
        args.append(("--num-layers-per-virtual-pipeline-stage", layers_per_chunk(job)))
    if f["sequence_parallel"]:
        args.append(("--sequence-parallel", None))
    args += [
        ("--micro-batch-size", f["micro_batch"]),
        ("--global-batch-size", f["global_batch"]),
        ("--seq-length", f["seq_len"]),
    ]
    if p.recompute == "selective-op":
        raise refuse(
            "recompute",
            TARGET,
            "recompute selective-op",
            "Megatron-LM's selective granularity recomputes the attention core (recompute selective), "
            "not every second matmul",
        )
    if p.recompute == "selective":
        args.append(("--recompute-granularity", "selective"))
    elif p.recompute == "full":
        layers = f["recompute_layers"]
        method = ("uniform", 1) if layers is None else ("block", layers)
        args += [
            ("--recompute-granularity", "full"),
            ("--recompute-method", method[0]),
            ("--recompute-num-layers", method[1]),
        ]
    if p.zero >= 1:
        args.append(("--use-distributed-optimizer", None))
    if p.zero >= 2:
        args += [
            ("--use-megatron-fsdp", None),
            ("--data-parallel-sharding-strategy", SHARDING[p.zero]),
            ("--no-gradient-accumulation-fusion", None),
            ("--ckpt-format", "fsdp_dtensor"),
        ]
    if p.offload_optimizer == "cpu":
        args += [("--optimizer-cpu-offload", None), ("--optimizer-offload-fraction", 1.0)]
    args += PRECISION_ARGS[p.precision]
    if p.precision == "fp8" and p.fp8_recipe != "auto":
        args.append(("--fp8-recipe", p.fp8_recipe))  # Transformer Engine's scaling (default delayed)
    args.append(("--optimizer", OPTIMIZERS[p.optimizer]))
    args.append(("--attention-backend", "flash" if p.attention == "flash" else "unfused"))
    return args


def _render(args: list[Arg]) -> str:
    lines = [f"    {flag}" if value is None else f"    {flag} {shlex.quote(str(value))}" for flag, value in args]
    return "\n".join(lines)


def notes(job: Job) -> tuple[str, ...]:
    out = [
        f"vocabulary {job.model.vocab_size}: the --tokenizer-* arguments must yield it",
        "add data, tokenizer, learning-rate, iteration and checkpoint arguments to MEMPLAN_ARGS",
    ]
    if job.plan.precision in ("bf16-master", "fp8"):
        out.append(
            "--bf16 accumulates and all-reduces gradients in fp32 main_grad buffers (4 bytes per parameter "
            "where the estimate's bf16-master counts 2)"
        )
    return tuple(out)


def export(job: Job, gradient_clipping: float = GRADIENT_CLIPPING) -> Exported:
    _check(job)
    f = fields(job)
    args = model_args(job.model) + parallel_args(job) + [("--clip-grad", gradient_clipping)]
    per_node = f["gpus"] // f["nodes"]
    text = (
        "#!/usr/bin/env bash\n"
        + comment_block(preamble(job, TARGET, notes(job)))
        + f"GPUS_PER_NODE={per_node}\nNNODES={f['nodes']}\n"
        + f"MEMPLAN_ARGS=(\n{_render(args)}\n)\n"
        + "# on every node (add data, tokenizer, learning-rate and checkpoint arguments):\n"
        + '# torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \\\n'
        + '#     --master-addr "$MASTER_ADDR" --master-port 6000 pretrain_gpt.py "${MEMPLAN_ARGS[@]}"\n'
    )
    return Exported(target=TARGET, text=text, suffix=".sh", notes=notes(job))


def parser() -> argparse.ArgumentParser:
    """The subset of Megatron-LM's argument parser that the export writes (same names, types, actions)."""
    ap = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    ints = [
        "--num-layers",
        "--hidden-size",
        "--ffn-hidden-size",
        "--num-attention-heads",
        "--num-query-groups",
        "--kv-channels",
        "--max-position-embeddings",
        "--make-vocab-size-divisible-by",
        "--num-experts",
        "--moe-router-topk",
        "--moe-ffn-hidden-size",
        "--moe-shared-expert-intermediate-size",
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--micro-batch-size",
        "--global-batch-size",
        "--seq-length",
        "--recompute-num-layers",
        "--loss-scale-window",
        "--hysteresis",
    ]
    for name in ints:
        ap.add_argument(name, type=int)
    for name in ["--initial-loss-scale", "--min-loss-scale", "--optimizer-offload-fraction", "--clip-grad"]:
        ap.add_argument(name, type=float)
    choices = {
        "--position-embedding-type": ["learned_absolute", "rope", "mrope", "relative", "none"],
        "--normalization": ["LayerNorm", "RMSNorm"],
        "--recompute-granularity": ["full", "selective"],
        "--recompute-method": ["uniform", "block"],
        "--data-parallel-sharding-strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"],
        "--fp8-format": ["e4m3", "hybrid"],
        "--fp8-recipe": ["tensorwise", "delayed", "mxfp8", "blockwise"],
        "--transformer-impl": ["local", "transformer_engine", "inference_optimized"],
        "--optimizer": ["adam", "sgd", "muon", "dist_muon"],
        "--attention-backend": ["flash", "fused", "unfused", "local", "auto"],
    }
    for name, options in choices.items():
        ap.add_argument(name, choices=options)
    ap.add_argument("--moe-layer-freq", type=str)
    ap.add_argument("--ckpt-format", type=str)
    flags = [
        "--group-query-attention",
        "--swiglu",
        "--disable-bias-linear",
        "--add-qkv-bias",
        "--qk-layernorm",
        "--untie-embeddings-and-output-weights",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--use-megatron-fsdp",
        "--optimizer-cpu-offload",
        "--bf16",
        "--fp16",
    ]
    for name in flags:
        ap.add_argument(name, action="store_true")
    ap.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    return ap


def arguments(text: str) -> list[str]:
    """The words of the ``MEMPLAN_ARGS=( ... )`` array, split as bash would."""
    match = re.search(r"^MEMPLAN_ARGS=\((.*?)^\)", text, re.S | re.M)
    if match is None:
        raise ValueError("no MEMPLAN_ARGS=( ... ) array")
    return shlex.split(match[1], comments=True)


def parse(text: str) -> dict[str, Any]:
    """The plan fields the arguments carry, read back through :func:`parser`."""
    a = parser().parse_args(arguments(text))
    per_node = int(re.search(r"^GPUS_PER_NODE=(\d+)$", text, re.M)[1])  # type: ignore[index]
    nodes = int(re.search(r"^NNODES=(\d+)$", text, re.M)[1])  # type: ignore[index]
    gpus = per_node * nodes
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    virtual = (
        a.num_layers // (pp * a.num_layers_per_virtual_pipeline_stage) if a.num_layers_per_virtual_pipeline_stage else 1
    )
    zero = {None: 0, "optim_grads": 2, "optim_grads_params": 3}[a.data_parallel_sharding_strategy]
    if zero == 0 and a.use_distributed_optimizer:
        zero = 1
    precision = "fp32"
    if a.fp8_format:
        precision = "fp8"
    elif a.bf16:
        precision = "bf16-master"
    elif a.fp16:
        precision = "fp16-master"
    recompute = a.recompute_granularity or "none"
    return {
        "gpus": gpus,
        "nodes": nodes,
        "dp": gpus // (tp * pp * cp),
        "tp": tp,
        "sequence_parallel": a.sequence_parallel,
        "pp": pp,
        "pp_schedule": "interleaved" if virtual > 1 else "1f1b",
        "virtual_stages": virtual,
        "cp": cp,
        "ep": a.expert_model_parallel_size,
        "zero": zero,
        "offload_optimizer": "cpu" if a.optimizer_cpu_offload else "none",
        "offload_params": "none",
        "recompute": recompute,
        "recompute_layers": a.recompute_num_layers if a.recompute_method == "block" else None,
        "precision": precision,
        "fp8_recipe": a.fp8_recipe if a.fp8_recipe in ("tensorwise", "delayed") else "auto",
        "optimizer": {v: k for k, v in OPTIMIZERS.items()}[a.optimizer],
        "attention": "flash" if a.attention_backend == "flash" else "eager",
        "seq_len": a.seq_length,
        "micro_batch": a.micro_batch_size,
        "global_batch": a.global_batch_size,
    }


def parse_model(text: str) -> dict[str, Any]:
    """The model shape the network-size arguments carry, in ModelSpec's names."""
    a = parser().parse_args(arguments(text))
    return {
        "num_layers": a.num_layers,
        "hidden_size": a.hidden_size,
        "ffn_size": a.ffn_hidden_size,
        "num_attention_heads": a.num_attention_heads,
        "kv_heads": a.num_query_groups if a.group_query_attention else a.num_attention_heads,
        "max_position_embeddings": a.max_position_embeddings,
        "norm": a.normalization.lower(),
        "mlp": "gated" if a.swiglu else "plain",
        "tied_embeddings": not a.untie_embeddings_and_output_weights,
        "qkv_bias": not a.disable_bias_linear or a.add_qkv_bias,
    }
