"""FSDPMemTracker that keeps FSDP2's group forward hooks: the meter's tracker under FSDP2.

``fully_shard([norm, output])`` (memplan.train.parallel.apply_fsdp, torchtitan's grouping) makes
one FSDP state for two modules, whose forward hooks run as a group (``_register_group_forward_hooks``,
pytorch/pytorch#127786): the state's pre-forward on the first module to run, its post-forward once
the last has run. FSDPMemTracker (torch 2.13, ``_instrument_fsdp_module``; its TODO names that PR)
removes those hooks and registers its wrappers on each module alone, so the group's post-forward
runs after the norm and a new pass begins at the head: the post-backward hook is attached to the
head's input and the pre-backward hook to the norm's output. The gradients of the head are then
reduced before the norm's backward, which all-gathers the group again (measured on the tiny Llama
at ZeRO-2, 1 x 32 tokens: +2,353,856 B in the backward against a run without the tracker,
tests/validate/test_meter_independent.py). This subclass wraps each FSDP state once, with FSDP2's
own group registration where the state holds several modules, and restores FSDP2's hooks on exit.

FSDPMemTracker's post-backward wrapper also keeps its loop variable (the group's last unsharded
gradient) alive through ``FSDPParamGroup.post_backward``, which drops that gradient before the
reduce-scatter: with tensor parallelism the gradient is a DTensor whose local tensor is cloned for
the reduce-scatter, so the original stays (the vocabulary-parallel embedding's, 1,152,000 B, at
tp 2, dp 2, ZeRO-3: +364,032 B on the backward's peak). This one tags the gradients in a helper
whose frame ends before FSDP2's method runs.
"""

from __future__ import annotations

import inspect
from functools import wraps

from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import (
    FSDPMemTracker,
    _FSDPModState,
    _FSDPRefType,
    _FSDPState,
    _SavedFSDPMethods,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks


def _states(root: nn.Module) -> list[tuple[object, FSDPModule]]:
    """(FSDP state, its first module) for each state with parameters, each once."""
    seen: dict[int, tuple[object, FSDPModule]] = {}
    for module in root.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if state._fsdp_param_group is not None:
                seen.setdefault(id(state), (state, module))
    return list(seen.values())


def _register(state: object, pre, post, always_call: bool) -> None:  # noqa: ANN001 - forward hooks
    """Register ``pre`` / ``post`` as FSDP2's ``FSDPState.init`` registers its own hooks (a single
    module's post-hook with ``always_call`` as FSDPMemTracker registers its wrapper). The group
    registration takes the output-dtype cast as a fifth argument in torch 2.13, not in earlier ones."""
    modules = state._modules
    if len(modules) == 1:
        state._pre_forward_hook_handle = modules[0].register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        state._post_forward_hook_handle = modules[0].register_forward_hook(post, prepend=False, always_call=always_call)
        return
    extra = [state._cast_output_dtype] if len(inspect.signature(_register_group_forward_hooks).parameters) > 4 else []
    handle = _register_group_forward_hooks(modules, pre, post, state._modules_to_run_forward, *extra)
    state._pre_forward_hook_handle = state._post_forward_hook_handle = handle


def _grads(group: object, unsharded: bool) -> list:
    """A param group's unsharded (or sharded) gradients that exist."""
    params = [p._unsharded_param if unsharded else p.sharded_param for p in group.fsdp_params]
    return [p.grad for p in params if p.grad is not None]


class GroupedFSDPMemTracker(FSDPMemTracker):
    """FSDPMemTracker with each FSDP state wrapped once, as FSDP2 hooks it (see the module docstring)."""

    def _instrument_fsdp_module(self) -> None:
        for state, first in _states(self._root_mod):
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            group = state._fsdp_param_group
            self._instrument_fsdp_sharded_params_grads(group)

            def pre(module, args, kwargs, state=state):  # noqa: ANN001, ANN202 - a forward pre-hook
                self._restart_root(module)
                return self._fsdp_state_pre_forward(module, state._pre_forward)(module, args, kwargs)

            def post(module, args, output, state=state):  # noqa: ANN001, ANN202 - a forward hook
                return self._fsdp_state_post_forward(module, state._post_forward)(module, args, output)

            _register(state, pre, post, always_call=True)
            self._fsdp_mod_to_saved_methods[first] = _SavedFSDPMethods(group.pre_backward, group.post_backward)
            group.pre_backward = self._fsdp_param_group_pre_backward(first, group.pre_backward)
            group.post_backward = self._fsdp_param_group_post_backward(first, group.post_backward)
        for buffer in self._root_mod.buffers():
            self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

    def _restart_root(self, module: nn.Module) -> None:
        """A top-level module with parameters (the root group of a tied model, which holds the
        embedding) called again in the forward is the next micro-batch of gradient accumulation:
        restart its per-module stats, as the meter does for MemTracker's module hooks
        (``tracker._tracker_class``), where FSDPMemTracker refuses it ("multiple iterative calls",
        ``_fsdp_state_pre_forward``, torch 2.13). Per-module snapshots alone go; the totals the
        meter reads are the dispatch mode's and are unaffected."""
        if module not in self.memory_tracking or self._mod_tracker.is_bw:
            return
        name = self._mod_tracker.get_known_fqn(module)
        if set(self._mod_tracker.parents) - {name} == {"Global"}:
            del self.memory_tracking[module]

    def _tag_grads(self, group: object, unsharded: bool) -> None:
        """FSDPMemTracker's tagging of a group's gradients, holding none after it returns."""
        kind = _FSDPRefType.UNSHARDED_GRAD if unsharded else _FSDPRefType.SHARDED_GRAD
        for grad in _grads(group, unsharded):
            self._update_and_maybe_create_winfos(grad, kind, update_existing=unsharded)

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig):  # noqa: ANN001, ANN202 - torch's signature
        """FSDPMemTracker's wrapper (torch 2.13) with the gradients tagged by :meth:`_tag_grads`."""

        @wraps(orig)
        def inner(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            if group:
                self._tag_grads(group, unsharded=True)
            mod_stat = self.memory_tracking[fsdp_mod]
            mod_stat.snapshots.setdefault(_FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
            self._fsdp_state = _FSDPState.POST_BW
            orig(*args, **kwargs)
            if group:
                self._tag_grads(group, unsharded=False)
            mod_stat.snapshots.setdefault(_FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())

        return inner

    def _deregister_module_and_optimizer_hooks(self) -> None:
        for first, saved in self._fsdp_mod_to_saved_methods.items():
            state = first._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            _register(state, state._pre_forward, state._post_forward, always_call=False)
            state._fsdp_param_group.pre_backward = saved.pre_backward
            state._fsdp_param_group.post_backward = saved.post_backward
        self._fsdp_mod_to_saved_methods.clear()
        for handle in self._optimizer_hook_handles or ():
            handle.remove()
        self._optimizer_hook_handles = None
