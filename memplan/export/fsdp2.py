"""Plain PyTorch: a module that applies the plan to a transformers model with FSDP2 and DTensor.

The written module holds the plan as constants and the code that applies it, in torchtitan's
order (``parallelize_llama``: TP, then activation checkpointing, then data parallel), with the
same FSDP2 grouping as memplan's trainer (``memplan/train/parallel.py``: each decoder layer, the
embedding, [final norm, LM head] and the root, neither resharded), which is what the ``memplan`` runtime
estimates:

- TP (``torch.distributed.tensor.parallel``): q/k/v, gate/up column-wise, o/down row-wise, the
  embedding and LM head vocabulary-sharded, the loss under ``loss_parallel``;
- recomputation: ``checkpoint_wrapper`` (non-reentrant) on every or the first n decoder layers;
- ZeRO-2 / 3: ``fully_shard(reshard_after_forward=False / True)``, ``MixedPrecisionPolicy`` for
  bf16-mixed, ``CPUOffloadPolicy`` for CPU offload; ZeRO-1: DDP and ``ZeroRedundancyOptimizer``;
  ZeRO-0: DDP (``gradient_as_bucket_view``).
Not expressible here: pipeline, context and expert parallelism, sequence parallelism (the TP plan
keeps activations replicated), selective recomputation, fp32 master weights of 16-bit
parameters, fp8, 8-bit AdamW, NVMe; TP only for the dense Llama-family layout.
"""

from __future__ import annotations

import ast
from typing import Any

from memplan.errors import MemplanError
from memplan.export.common import (
    Exported,
    comment_block,
    fields,
    hf_attention,
    preamble,
    py_literal,
    refuse,
    refuse_split_offload,
)
from memplan.specs.resolve import Job

TARGET = "fsdp2"
CARRIES = frozenset(
    {
        "gpus",
        "nodes",
        "dp",
        "tp",
        "zero",
        "offload_optimizer",
        "offload_params",
        "recompute",
        "recompute_layers",
        "precision",
        "optimizer",
        "attention",
        "seq_len",
        "micro_batch",
        "global_batch",
    }
)
# transformers models whose decoder layers are model.model.layers; TP also needs the Llama layout
DECODERS = {
    "llama", "mistral", "qwen2", "mixtral", "qwen2-moe", "qwen3-moe",
    "qwen3", "gemma2", "gemma3", "phi3", "deepseek-v2", "deepseek-v3", "olmo2", "llama4",
}  # fmt: skip
TP_DECODERS = {"llama", "mistral", "qwen2"}
OPTIMIZERS = {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD", "adafactor": "torch.optim.Adafactor"}

IMPORTS = """
import contextlib

import torch
from torch import nn
"""
BODY = '''

def build_mesh(device_type: str = "cuda"):
    """The (dp, tp) device mesh over the world (torch.distributed initialised, e.g. by torchrun)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (DP, TP), mesh_dim_names=("dp", "tp"))


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Megatron-style TP: attention and MLP column- then row-wise, vocabulary-sharded embedding and head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    root = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp_mesh, root)
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)


def apply_recompute(model: nn.Module) -> None:
    """Full recomputation: each (or each of the first RECOMPUTE_LAYERS) decoder layer keeps only its input."""
    if RECOMPUTE == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    count = len(layers) if RECOMPUTE_LAYERS is None else RECOMPUTE_LAYERS
    for i in range(count):
        layers[i] = checkpoint_wrapper(layers[i])


def apply_fsdp(model: nn.Module, dp_mesh) -> None:
    """FSDP2 per decoder layer, the embedding, [norm, lm_head] and the root (neither resharded)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if PRECISION == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if CPU_OFFLOAD else OffloadPolicy()
    reshard = ZERO == 3
    kw = dict(mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if not tied:
        fully_shard(model.model.embed_tokens, reshard_after_forward=reshard, **kw)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **kw)
    if not tied:
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False, **kw)
    # the root keeps its parameters (the tied embedding and LM head) for the backward: FSDP2's default for a root
    fully_shard(model, reshard_after_forward=False, **kw)


def apply_plan(model: nn.Module, mesh) -> nn.Module:
    """Apply the plan to a transformers causal LM (built on its device, or on meta then materialised)."""
    if PRECISION == "bf16":
        model.to(torch.bfloat16)
    if TP > 1:
        apply_tp(model, mesh["tp"])
    apply_recompute(model)
    if ZERO >= 2 and DP > 1:
        apply_fsdp(model, mesh["dp"])
    elif DP > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=mesh["dp"].get_group(), gradient_as_bucket_view=True)
    return model


def build_optimizer(model: nn.Module, mesh, lr: float, momentum: float | None = None) -> torch.optim.Optimizer:
    """The plan's optimizer (ZeRO-1: partitioned over dp by ZeroRedundancyOptimizer)."""
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor}[OPTIMIZER]
    kwargs = {"lr": lr}
    if OPTIMIZER == "sgd":
        kwargs["momentum"] = momentum  # the estimate counts one momentum state
    if OPTIMIZER == "adamw":
        kwargs["foreach"] = True  # the estimate's optimizer step: one state-sized temporary
    params = [p for p in model.parameters() if p.requires_grad]
    if ZERO == 1 and DP > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=mesh["dp"].get_group(), **kwargs)
    return cls(params, **kwargs)


def autocast(device_type: str = "cuda"):
    """bf16-mixed without FSDP computes under torch.autocast (FSDP2 casts by its policy instead)."""
    if PRECISION == "bf16-mixed" and not (ZERO >= 2 and DP > 1):
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_context():
    """Compute the loss and run backward inside this: under TP the logits stay vocabulary-sharded."""
    if TP > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of (B, S, V) logits against (B, S) next-token labels, in fp32."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
'''


def _check(job: Job) -> None:
    p, f = job.plan, fields(job)
    arch = job.model.architecture
    simple = {
        "pp": (p.pp > 1, f"pp={p.pp}", "the snippet has no pipeline schedule (use torchtitan or megatron)"),
        "cp": (p.cp > 1, f"cp={p.cp}", "the snippet has no context parallelism (use torchtitan)"),
        "ep": (p.ep > 1, f"ep={p.ep}", "the snippet has no expert parallelism"),
        "sequence_parallel": (
            f["sequence_parallel"],
            "sequence parallel",
            "its TP plan for transformers layers keeps activations replicated; use torchtitan",
        ),
        "recompute": (
            p.recompute in ("selective", "selective-op"),
            f"recompute {p.recompute}",
            "it checkpoints whole layers; use none or full",
        ),
        "precision": (
            p.precision in ("bf16-master", "fp16-master", "fp8"),
            f"precision {p.precision}",
            "plain PyTorch optimizers keep no fp32 master copy of 16-bit parameters (use bf16-mixed or bf16)",
        ),
        "optimizer": (
            p.optimizer not in OPTIMIZERS,
            f"optimizer {p.optimizer}",
            "8-bit AdamW is bitsandbytes, not PyTorch",
        ),
    }
    for field, (bad, what, why) in simple.items():
        if bad:
            raise refuse(field, TARGET, what, why)
    if arch not in DECODERS:
        raise MemplanError(
            f"{TARGET} applies the plan to transformers decoders of {sorted(DECODERS)}, not {arch!r}",
            field="model.architecture",
        )
    if p.tp > 1 and (arch not in TP_DECODERS or job.model.tied_embeddings or job.model.kv_heads % p.tp):
        raise refuse(
            "tp",
            TARGET,
            f"tp={p.tp} for {job.model.name}",
            "its TP plan covers untied dense Llama-family layers whose KV heads tp divides",
        )
    if p.tp > 1 and p.zero < 2 and p.dp > 1:
        raise refuse(
            "zero", TARGET, f"zero={p.zero} with tp={p.tp}", "DDP does not take DTensor parameters; use zero 2 or 3"
        )
    refuse_split_offload(p, TARGET, "FSDP2's CPUOffloadPolicy")


def constants(job: Job) -> dict[str, Any]:
    """The plan as the module's constants (what :func:`parse` reads back)."""
    _check(job)
    p, f = job.plan, fields(job)
    return {
        "WORLD_SIZE": f["gpus"],
        "NNODES": f["nodes"],
        "DP": p.dp,
        "TP": p.tp,
        "ZERO": p.zero,
        "CPU_OFFLOAD": p.offload_params == "cpu",
        "RECOMPUTE": p.recompute,
        "RECOMPUTE_LAYERS": f["recompute_layers"],
        "PRECISION": p.precision,
        "OPTIMIZER": p.optimizer,
        "ATTN_IMPLEMENTATION": hf_attention(job),
        "SEQ_LEN": f["seq_len"],
        "MICRO_BATCH": f["micro_batch"],
        "GLOBAL_BATCH": f["global_batch"],
        "GRADIENT_ACCUMULATION": f["gradient_accumulation"],
    }


def export(job: Job) -> Exported:
    consts = constants(job)
    attn = consts["ATTN_IMPLEMENTATION"]
    notes = (f"load the model with from_pretrained(..., attn_implementation='{attn}'); launch WORLD_SIZE processes",)
    doc = (
        f'"""The plan memplan estimated for {job.model.name}, applied with FSDP2 / DTensor.\n\n'
        "mesh = build_mesh(); model = apply_plan(model, mesh); opt = build_optimizer(model, mesh, lr=...)\n"
        "each micro-batch: with autocast(): logits = model(input_ids).logits\n"
        "then: with loss_context(): loss_fn(logits, labels).backward()\n"
        '"""\n'
    )
    lines = "".join(f"{k} = {py_literal(v)}\n" for k, v in consts.items())
    text = comment_block(preamble(job, TARGET, notes)) + doc + IMPORTS + "\n" + lines + BODY
    return Exported(target=TARGET, text=text, suffix=".py", notes=notes)


def parse(text: str) -> dict[str, Any]:
    """The plan fields of the module's constants (read with ``ast``, never run)."""
    c: dict[str, Any] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper():
                c[name] = ast.literal_eval(node.value)
    offload = "cpu" if c["CPU_OFFLOAD"] else "none"
    return {
        "gpus": c["WORLD_SIZE"],
        "nodes": c["NNODES"],
        "dp": c["DP"],
        "tp": c["TP"],
        "zero": c["ZERO"],
        "offload_optimizer": offload,
        "offload_params": offload,
        "recompute": c["RECOMPUTE"],
        "recompute_layers": c["RECOMPUTE_LAYERS"],
        "precision": c["PRECISION"],
        "optimizer": c["OPTIMIZER"],
        "attention": "flash" if c["ATTN_IMPLEMENTATION"] == "sdpa" else "eager",
        "seq_len": c["SEQ_LEN"],
        "micro_batch": c["MICRO_BATCH"],
        "global_batch": c["GLOBAL_BATCH"],
    }
