"""Apply a memplan Plan to the trainer's model with PyTorch's own parallelism.

The order (torchtitan's, for the same reasons): pipeline split (the stage's chunk of layers,
``pipeline.py``), then tensor / sequence parallel (DTensor ``parallelize_module`` on the
``tp`` mesh), then recomputation (``torch.utils.checkpoint`` per layer), then data parallel
on the ``dp`` mesh:

- ZeRO-0: ``DistributedDataParallel`` (``gradient_as_bucket_view``: the buckets are the grads);
- ZeRO-1: DDP and ``ZeroRedundancyOptimizer`` (optimizer states partitioned over dp);
- ZeRO-2 / ZeRO-3: FSDP2 ``fully_shard`` per layer and on the root, ``reshard_after_forward``
  False / True, ``MixedPrecisionPolicy`` for ``bf16-mixed`` and ``CPUOffloadPolicy`` when
  parameters and optimizer are offloaded.

Precision: ``fp32`` and ``bf16`` keep the model in that dtype; ``bf16-master`` keeps a bf16
model with fp32 master weights inside the optimizer (:class:`MasterAdamW`); ``bf16-mixed``
keeps fp32 parameters and computes in bf16, by FSDP2's mixed-precision policy when sharded,
else by ``torch.autocast``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from memplan.specs.plan import Plan
from memplan.train.model import FLASH_ATTENTION_OPS, Block, Transformer, op_name
from memplan.validate.support import check_plan  # noqa: F401 (re-exported)


@dataclass
class Meshes:
    world: DeviceMesh
    pp: DeviceMesh
    dp: DeviceMesh
    tp: DeviceMesh


def build_meshes(plan: Plan, device_type: str) -> Meshes:
    """One (pp, dp, tp) mesh over the world; rank = stage x dp x tp + dp_rank x tp + tp_rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (plan.pp, plan.dp, plan.tp), mesh_dim_names=("pp", "dp", "tp"))
    return Meshes(mesh, mesh["pp"], mesh["dp"], mesh["tp"])


def compute_dtype(plan: Plan) -> torch.dtype:
    return torch.float32 if plan.precision == "fp32" else torch.bfloat16


def param_dtype(plan: Plan) -> torch.dtype:
    return torch.bfloat16 if plan.precision in ("bf16", "bf16-master") else torch.float32


def uses_fsdp(plan: Plan) -> bool:
    return plan.zero >= 2 and plan.dp > 1


def uses_autocast(plan: Plan) -> bool:
    """bf16-mixed computes under torch.autocast unless FSDP2's policy casts the params."""
    return plan.precision == "bf16-mixed" and not uses_fsdp(plan)


def apply_tp(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron-style TP with DTensor: attention and MLP matrices column- then row-wise,
    vocabulary-sharded embedding and LM head (the loss stays vocab-parallel); with SP the
    norms and residuals are sharded on the sequence dimension."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    root = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        if sequence_parallel:
            root["norm"] = SequenceParallel()
        root["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, root)
    # each module got its own DTensor copy of a tied matrix; both are vocab-sharded (Shard(0)
    # of V x h), so they can share one again
    model.tie_weights()
    if sequence_parallel:
        model.sp_degree = mesh.size()
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)


class Checkpointed(nn.Module):
    """A block under non-reentrant ``torch.utils.checkpoint``: only its input is kept."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, cos, sin, use_reentrant=False)


# per-op selective recomputation (torchtitan's ``op`` SAC): the matmuls alternate, the rest
# of the save list is kept, everything else is recomputed
_OP_SAC_MATMULS = frozenset({"mm", "addmm"})
_OP_SAC_SAVED = FLASH_ATTENTION_OPS | {"reduce_scatter_tensor"}


def op_sac_policy(counts: dict[str, int]):  # noqa: ANN201 - a torch.utils.checkpoint policy
    """torchtitan's per-op policy: save the outputs of the attention kernels, the reduce-
    scatters and every odd-numbered matmul of the layer; recompute everything else. Matmuls
    are counted separately in the forward and in the recompute, so that a torch that asks the
    policy again in the recompute (``ctx.is_recompute``) gets the same answers; torch 2.13
    replays the forward's decisions without asking. memplan counts
    ``addmm`` (a linear with bias) as a matmul too; torchtitan's models have no biases."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        name = op_name(op)
        if name in _OP_SAC_MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            odd = counts[key] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in _OP_SAC_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class OpCheckpointed(Checkpointed):
    """A block under per-op selective checkpointing (:func:`op_sac_policy`)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from collections import defaultdict

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        def context():  # noqa: ANN202 - fresh counts for each forward and its recompute
            return create_selective_checkpoint_contexts(op_sac_policy(defaultdict(int)))

        return checkpoint(self.block, x, cos, sin, use_reentrant=False, context_fn=context)


def apply_recompute(model: Transformer, plan: Plan) -> None:
    """full: wrap the stage's layers (all, or the first ``recompute_layers``) in checkpoint;
    selective: recompute each layer's attention core under a save-list policy;
    selective-op: each layer under the per-op policy."""
    if plan.recompute == "selective-op":
        for key in list(model.layers.keys()):
            model.layers[key] = OpCheckpointed(model.layers[key])
        return
    if plan.recompute == "selective":
        for block in model.layers.values():
            block.attention.recompute_core = True
        return
    if plan.recompute == "none":
        return
    keys = list(model.layers.keys())
    if plan.recompute_layers is not None:
        keys = keys[: plan.recompute_layers]
    for key in keys:
        model.layers[key] = Checkpointed(model.layers[key])


def apply_fsdp(model: Transformer, plan: Plan, mesh: DeviceMesh) -> None:
    """FSDP2 per layer, the embedding and the head, then the root (torchtitan's grouping)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if plan.precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = OffloadPolicy()
    if plan.offload_params == "cpu":
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    reshard = plan.zero >= 3
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    tied = model.tok_embeddings is not None and model.output is not None and model.spec.tied_embeddings
    if model.tok_embeddings is not None and not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kw)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **kw)
    if model.output is not None and not tied:
        assert model.norm is not None
        # the head runs last in the forward and first in the backward: never resharded between
        fully_shard([model.norm, model.output], reshard_after_forward=False, **kw)
    # the root (with tied embeddings it holds the embedding, the final norm and the LM head)
    # is not resharded after the forward either: FSDP2's own default for a root, whose
    # parameters the backward needs at once. Resharding it cost a re-all-gather at the start
    # of the backward, with the all-gather buffer and the unsharded copy alive together
    fully_shard(model, reshard_after_forward=False, **kw)


def _allreduce_mean(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's default hook written out (divide, all-reduce in place, hand the bucket back), so
    that it also runs on the fake process group, whose futures carry no value."""
    buffer = bucket.buffer().div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda _: buffer)


_allreduce_mean.__annotations__ = {
    "group": dist.ProcessGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    group = mesh.get_group()
    ddp = DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True)
    ddp.register_comm_hook(group, _allreduce_mean)
    return ddp


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (foreach copy has no DTensor sharding rule), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class MasterAdamW(torch.optim.Optimizer):
    """AdamW on fp32 master copies of 16-bit parameters (mixed-precision Adam, ZeRO Sec. 3.1).

    ``step`` casts every gradient to fp32 (all alive together, the foreach path), runs the
    functional AdamW on the masters and copies them back into the 16-bit parameters.
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1):  # noqa: ANN001
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        from torch.optim.adamw import adamw

        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    # an fp32 parameter (a LoRA adapter) is its own master
                    state["master"] = p.detach() if p.dtype == torch.float32 else p.detach().float().clone()
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
            masters = [self.state[p]["master"] for p in params]
            grads = [p.grad.float() for p in params]
            beta1, beta2 = group["betas"]
            adamw(
                masters,
                grads,
                [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params],
                [],
                [self.state[p]["step"] for p in params],
                foreach=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            del grads
            torch._foreach_copy_([_local(p) for p in params], [_local(m) for m in masters])
        return None


def build_optimizer_from(
    params: list[nn.Parameter], plan: Plan, dp_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    """AdamW (foreach), or MasterAdamW for bf16-master; ZeRO-1 partitions it over dp."""
    # LoRA adapters are fp32 whatever the precision: plain AdamW, no master copies, unless a
    # 16-bit module is trained beside them (modules_to_save); MasterAdamW steps fp32 ones in place
    masters = plan.finetune == "full" or bool(plan.modules_to_save)
    cls = MasterAdamW if plan.precision == "bf16-master" and masters else torch.optim.AdamW
    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if cls is torch.optim.AdamW:
        kwargs["foreach"] = True
    if plan.zero == 1 and plan.dp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=dp_group, **kwargs)
    # foreach kernels cannot mix DTensor and plain tensors (TP without FSDP leaves the norms
    # plain): one parameter group of each
    from torch.distributed.tensor import DTensor

    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return cls([{"params": g} for g in groups if g], **kwargs)
