"""ZeRO-1 as the bundled trainer applies it (``parallel.build_optimizer_from``: zero 1, dp > 1).

DDP (``ddp.py``, unchanged) and ``ZeroRedundancyOptimizer(params, optimizer_class=AdamW or
MasterAdamW, process_group=dp)``: each rank keeps the optimizer of whole parameters, a partition
of ``model.parameters()``. From PyTorch's ``torch/distributed/optim/zero_redundancy_optimizer.py``
(torch 2.13; no GPU trace yet, held against the trainer on CPU: tests/unit/test_timeline_zero1.py):

- ``_partition_parameters``: the parameters sorted by ``numel``, largest first (a stable sort:
  ties keep their order), each given to the rank holding the fewest elements so far, the
  lowest such rank (``_get_min_index``); the rank's local optimizer is built over its list in
  that order, so its states and the step's temporaries follow it (``_init_local_optimizer``);
- the constructor allocates nothing on the device (``parameters_as_bucket_view=False``: no
  flat buckets, ``_build_param_buckets`` returns at once);
- ``step``: the local optimizer's step over the rank's parameters (``_local_step``), then
  ``_sync_params``: every rank's parameters broadcast in place from their owner
  (``dist.broadcast(param.data, ...)``, one per parameter): no allocation;
- ``zero_grad(set_to_none=True)`` over every parameter: DDP's bucket views, nothing freed.

Every rank holds DDP's full buckets; the ranks differ in their optimizer's share alone, so the
run follows the rank with the most elements (:func:`most_loaded`)."""

from __future__ import annotations


def partition(params: list[tuple[str, int]], dp: int) -> list[list[tuple[str, int]]]:
    """``_partition_parameters`` over one parameter group: per rank, its (name, numel) in the
    order its local optimizer sees them."""
    ranks: list[list[tuple[str, int]]] = [[] for _ in range(dp)]
    sizes = [0] * dp
    for name, numel in sorted(params, key=lambda p: p[1], reverse=True):
        rank = sizes.index(min(sizes))
        ranks[rank].append((name, numel))
        sizes[rank] += numel
    return ranks


def most_loaded(params: list[tuple[str, int]], dp: int) -> int:
    """The data rank whose partition holds the most elements (the lowest of equals)."""
    totals = [sum(n for _, n in shard) for shard in partition(params, dp)]
    return totals.index(max(totals))


def shard(params: list[tuple[str, int]], dp: int, rank: int | None = None) -> list[tuple[str, int]]:
    """The parameters rank ``rank`` (default :func:`most_loaded`) steps, in its optimizer's order."""
    return partition(params, dp)[most_loaded(params, dp) if rank is None else rank]
