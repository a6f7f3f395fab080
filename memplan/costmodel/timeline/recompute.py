"""Which layers the bundled trainer checkpoints, and how (``parallel.apply_recompute``).

- ``full``: each layer (or the first ``recompute_layers`` of them; the others run plainly)
  under non-reentrant ``checkpoint`` (``parallel.Checkpointed``): only its input is kept;
- ``selective``: the attention core alone (``trainer_model.Model.attention``);
- ``selective-op``: each layer under ``create_selective_checkpoint_contexts`` with
  :func:`op_policy` (``parallel.OpCheckpointed``): the forward keeps the outputs of the odd
  matmuls (wq, wv, w1, w2), of the attention kernel (out, lse, philox seed and offset) and,
  under sequence parallel, of funcol's reduce-scatters (``tensor_parallel.reduce_scatter``)
  beside the layer's input; the backward's re-run hands those back instead of computing them
  and recomputes every other op. It stops at the last tensor the layer's graph saved, w2's
  inputs, before w2's own matmul: w2's kept output is never taken back and goes with the
  checkpoint's frame, after the layer's backward (h200_a_selop1b).

A re-run (either kind) runs in a fresh autocast context (``torch.utils.checkpoint`` restores
the forward's autocast state): its weight casts are its own, freed as it ends.
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.trainer_model import Model

OP_SAVED = frozenset({"sdpa", "reduce_scatter"})  # parallel._OP_SAC_SAVED: attention kernels, funcol reduce-scatters


def op_policy() -> Callable[[str, bool], bool]:
    """``parallel.op_sac_policy`` with fresh counts (one per checkpoint call): saved are the
    attention kernel and every odd-numbered ``mm`` of the layer, counted apart in the forward
    and in the re-run."""
    counts = {False: 0, True: 0}

    def policy(op: str, recompute: bool) -> bool:
        if op == "mm":
            counts[recompute] += 1
            return counts[recompute] % 2 == 1
        return op in OP_SAVED

    return policy


def checkpointed(recompute: str, layer: int, recompute_layers: int | None) -> bool:
    """Whether layer ``layer`` runs as a whole under checkpoint (full: the first
    ``recompute_layers`` of the stage; selective-op: every layer)."""
    if recompute == "selective-op":
        return True
    return recompute == "full" and (recompute_layers is None or layer < recompute_layers)


def layer(
    tape: Tape, m: Model, x: Tensor, cos: Tensor, sin: Tensor, i: int, recompute_layers: int | None = None
) -> Tensor:
    """``Block``, ``Checkpointed(Block)`` or ``OpCheckpointed(Block)`` on layer ``i``."""
    mode = m.d.recompute
    if not checkpointed(mode, i, recompute_layers):
        return m.block(x, cos, sin, i)

    def rerun(x: Tensor, cos: Tensor, sin: Tensor) -> None:  # the frame's inputs (act_offload.py: copies)
        cache, m.cache = m.cache, ({} if m.d.autocast else None)
        try:
            m.block(x, cos, sin, i)
        finally:
            m.cache = cache

    policy = op_policy() if mode == "selective-op" else None
    return tape.checkpoint(lambda: m.block(x, cos, sin, i), [x, cos, sin], rerun=rerun, policy=policy)
