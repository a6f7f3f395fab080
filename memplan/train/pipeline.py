"""Pipeline stages: which layers a rank holds, the schedules' orders, and an in-process replay.

Under rank simulation there is no neighbour to send activations to: the fake process group
cannot answer ``torch.distributed.pipelining``'s shape exchange (``recv_object_list``). So
the simulated rank replays its stage's schedule in-process: it runs its chunks' forwards and
backwards in the order the schedule gives this rank, with received activations and gradients
that are real tensors of the right shape (synthetic values). The replay keeps the tensors
``torch.distributed.pipelining`` keeps (stage.py, schedules.py, _backward.py, torch 2.13), so its
memory is that stage's, equal byte for byte at every action on gloo ranks
(tests/validate/test_pipeline_replay.py):

- a receive buffer per micro-batch for activations (every chunk but the first) and for
  gradients (every chunk but the last), allocated once and reused each step;
- each in-flight micro-batch's stage output (``fwd_cache``) until its backward, the last
  chunk's logits too: the loss is the schedule's, computed on that output outside the chunk
  and kept (``_internal_losses``) until the step ends;
- the gradient of each received activation, taken off its buffer after its backward
  (``stage_backward``: ``val.grad = None``) and held, like each sent output, as long as the
  schedule's sends hold it (memplan.train.sends);
- the gradients divided by the number of micro-batches after the last backward
  (``scale_grads``), in place;
- with FSDP2, gradient sync and resharding are off for every micro-batch's backward and the
  reduce-scatter runs once after the last (``backward_maybe_with_nosync`` and
  ``perform_reduce_grad``): unsharded parameters and gradients stay for the backward.

It stands for a trainer that calls ``schedule.step(..., return_outputs=False)``: with the
default (True) the last stage also keeps every micro-batch's output until the step ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from memplan.costmodel.timeline.schedule import Action, chunk_layers, schedule_actions  # pure: the estimate's too
from memplan.train.sends import send_holder

__all__ = ["Action", "StageReplay", "chunk_layers", "schedule_actions"]


class StageReplay:
    """Runs one pipeline rank's chunks through a schedule without neighbours."""

    def __init__(
        self,
        chunks: list[tuple[int, nn.Module]],
        num_chunks: int,
        actions: list[Action],
        microbatches: int,
        activation: tuple[tuple[int, ...], torch.dtype],
        device: torch.device,
        schedule: str = "1f1b",
    ) -> None:
        self.chunks = chunks
        self.schedule = schedule
        self.num_chunks = num_chunks
        self.actions = actions
        self.m = microbatches
        self.shape, self.dtype = activation
        self.device = device
        self.recv_act: dict[int, list[torch.Tensor]] = {}
        self.recv_grad: dict[int, list[torch.Tensor]] = {}

    def _first(self, c: int) -> bool:
        return self.chunks[c][0] == 0

    def _last(self, c: int) -> bool:
        return self.chunks[c][0] == self.num_chunks - 1

    def _buffers(self) -> None:
        if self.recv_act or self.recv_grad:
            return
        for c in range(len(self.chunks)):
            if not self._first(c):
                self.recv_act[c] = [
                    torch.zeros(self.shape, dtype=self.dtype, device=self.device).requires_grad_()
                    for _ in range(self.m)
                ]
            if not self._last(c):
                self.recv_grad[c] = [
                    torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.m)
                ]

    def step(
        self,
        batch: Callable[[int, bool, bool], tuple[torch.Tensor | None, torch.Tensor | None]],
        forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        on_phase: Callable[[str], None],
    ) -> None:
        """One schedule step: the actions in order, then the gradient reduction and scaling
        (``perform_reduce_grad``). ``forward`` runs a chunk; ``loss_fn`` is the schedule's loss
        of the last chunk's output, unscaled (the gradients are divided by the micro-batch count
        after the last backward, as ``scale_grads=True`` does)."""
        self._buffers()
        for bufs in self.recv_act.values():  # clear_runtime_states
            for buf in bufs:
                buf.grad = None
        fsdp = [m for _, m in self.chunks if _is_fsdp(m)]
        for module in fsdp:
            _check_fsdp_internals(module)
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        losses: list[torch.Tensor] = []  # the schedule's _internal_losses
        sent = send_holder(self.schedule, self.actions)  # memplan.train.sends
        for kind, c, i in self.actions:
            if kind == "F":
                on_phase("forward")
                self._forward(c, i, batch, forward, loss_fn, cache, losses, sent)
            else:
                on_phase("backward")
                self._backward(c, i, cache, sent)
        losses.clear()
        for module in fsdp:
            _reduce_grads(module)
        self._scale_grads()
        sent.end()

    def _forward(self, c: int, i: int, batch, forward, loss_fn, cache, losses, sent) -> None:  # noqa: ANN001
        """``forward_one_chunk`` then ``_maybe_compute_loss``: the stage output stays in ``fwd_cache``
        until its backward, on the last chunk too (the logits), beside the loss."""
        module = self.chunks[c][1]
        ids, labels = batch(i, self._first(c), self._last(c))
        out = forward(module, ids if self._first(c) else self.recv_act[c][i])
        sent.forward(out, not self._last(c))
        loss = None
        if self._last(c):
            loss = loss_fn(out, labels)
            losses.append(loss)
        cache[(c, i)] = (out, loss)

    def _backward(self, c: int, i: int, cache, sent) -> None:  # noqa: ANN001
        """``backward_one_chunk``: ``stage_backward`` takes each received activation's gradient off
        the buffer (``val.grad = None``) and hands it to the send; the last chunk's output is detached."""
        out, loss = cache.pop((c, i))
        if loss is not None:
            loss.backward()
            if not out._is_view():
                out.detach_()
        else:
            torch.autograd.backward(out, grad_tensors=self.recv_grad[c][i])
        del out, loss
        grad = None
        if not self._first(c):
            buf = self.recv_act[c][i]
            grad, buf.grad = buf.grad, None
        sent.backward(grad)

    def _scale_grads(self) -> None:
        """``scale_grads``: in place, after the reduction."""
        for _, module in self.chunks:
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.div_(self.m)


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


_MISSING = object()


def _fsdp_internals_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"torch {torch.__version__}: FSDP2 has no {what}, which the pipeline replay needs to reduce "
        "gradients after the last micro-batch (what torch.distributed.pipelining's perform_reduce_grad does); "
        "memplan knows torch 2.6 to 2.13 (memplan/train/pipeline.py, fsdp_param_groups)"
    )


def fsdp_param_groups(state: object) -> list:
    """The ``FSDPParamGroup``s of one FSDP2 state (``fully_shard`` of one module), across torch versions.

    There is no public API for them. torch 2.12 and later (per-parameter meshes, pytorch#173509) keep a
    list, ``_fsdp_param_groups``, beside a compatibility property ``_fsdp_param_group`` that raises where
    there are several; torch 2.6 to 2.11 keep one group or None in ``_fsdp_param_group``. The list is
    tried first; RuntimeError, naming the torch version, where neither exists.
    """
    groups = getattr(state, "_fsdp_param_groups", _MISSING)
    if groups is not _MISSING:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", _MISSING)
    if group is not _MISSING:
        return [] if group is None else [group]
    raise _fsdp_internals_error(f"`_fsdp_param_groups` or `_fsdp_param_group` on {type(state).__name__}")


def _fsdp_state(module: nn.Module) -> object:
    from torch.distributed.fsdp import fully_shard

    state_of = getattr(fully_shard, "state", None)  # the composable API's contract (torch 2.4+)
    if state_of is None:
        raise _fsdp_internals_error("`fully_shard.state`")
    return state_of(module)


def _check_fsdp_internals(module: nn.Module) -> None:
    """Fails before the first micro-batch, not after the last, where this torch lacks what ``_reduce_grads``
    uses (the states of the module tree are listed only at the first forward, so only the root's is checked)."""
    state = _fsdp_state(module)
    fsdp_param_groups(state)
    if not hasattr(state, "_state_ctx"):
        raise _fsdp_internals_error(f"`_state_ctx` on {type(state).__name__}")
    if not callable(getattr(state, "_root_post_backward_final_callback", None)):
        raise _fsdp_internals_error(f"`_root_post_backward_final_callback` on {type(state).__name__}")


def _reduce_grads(module: nn.Module) -> None:
    """What ``PipelineStage.perform_reduce_grad`` does for FSDP2 after the last backward: the public setters,
    then each param group's ``post_backward`` (reduce-scatter, reshard) and the root's final callback, which
    have no public API (``FSDPModule.reshard()`` would free the unsharded parameters but not reduce the
    gradients). The private names are those of torch 2.6 to 2.13, looked up through ``fsdp_param_groups``."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = _fsdp_state(module)
    all_states = getattr(getattr(state, "_state_ctx", None), "all_states", None)
    if all_states is None:
        raise _fsdp_internals_error(f"`_state_ctx.all_states` on {type(state).__name__}")
    for sub in all_states:
        for group in fsdp_param_groups(sub):
            group.post_backward()
    final = getattr(state, "_root_post_backward_final_callback", None)
    if not callable(final):
        raise _fsdp_internals_error(f"`_root_post_backward_final_callback` on {type(state).__name__}")
    final()
