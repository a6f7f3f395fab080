# memplan export --to fsdp2: llama3-8b on 8 x h100-sxm, 1 node(s)
# plan: dp=8 tp=1 pp=1 cp=1 ep=1 zero=3
# recompute=full precision=bf16-mixed optimizer=adamw attention=flash
# workload: seq_len=4096 micro_batch=2 global_batch=64 (gradient accumulation 4); runtime=memplan
# set in the training code:
# - load the model with from_pretrained(..., attn_implementation='sdpa'); launch WORLD_SIZE processes
"""The plan memplan estimated for llama3-8b, applied with FSDP2 / DTensor.

mesh = build_mesh(); model = apply_plan(model, mesh); opt = build_optimizer(model, mesh, lr=...)
each micro-batch: with autocast(): logits = model(input_ids).logits
then: with loss_context(): loss_fn(logits, labels).backward()
"""

import contextlib

import torch
from torch import nn

WORLD_SIZE = 8
NNODES = 1
DP = 8
TP = 1
ZERO = 3
CPU_OFFLOAD = False
RECOMPUTE = "full"
RECOMPUTE_LAYERS = None
PRECISION = "bf16-mixed"
OPTIMIZER = "adamw"
ATTN_IMPLEMENTATION = "sdpa"
SEQ_LEN = 4096
MICRO_BATCH = 2
GLOBAL_BATCH = 64
GRADIENT_ACCUMULATION = 4


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
