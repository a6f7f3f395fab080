"""Guards around private torch attributes that differ between torch versions.

The installed torch is one version; the others are simulated by taking attributes away or
swapping which one exists (fake objects, monkeypatching, proxies), never by installing another.

- ``memplan.train.pipeline.fsdp_param_groups``: FSDP2 keeps a state's param groups in
  ``_fsdp_param_groups`` (a list; torch 2.12+) or ``_fsdp_param_group`` (one or None; torch 2.6 to
  2.11, whose lack made ``--pp`` with FSDP2 fail on torch 2.11 with an AttributeError).
- ``_dynamo_marked_constant``: the attribute ``torch.compiler.assume_constant_result`` sets, which
  ``memplan.kernels`` sets by hand (so importing it does not import torch._dynamo).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from memplan.train import pipeline as pl


class _Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def post_backward(self) -> None:
        self.calls += 1


class _StateWithCompatProperty:
    """torch 2.12+'s layout: the list, and a property that refuses several groups."""

    def __init__(self, groups: list) -> None:
        self._fsdp_param_groups = groups

    @property
    def _fsdp_param_group(self):
        raise AssertionError("Expected at most 1 param group for backward compatibility")


def test_param_groups_of_the_list_layout():
    a, b = _Group("a"), _Group("b")
    assert pl.fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert pl.fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[])) == []
    # the compatibility property is never read where the list exists
    assert pl.fsdp_param_groups(_StateWithCompatProperty([a, b])) == [a, b]


def test_param_groups_of_the_single_group_layout():
    a = _Group("a")
    assert pl.fsdp_param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert pl.fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_param_groups_neither_layout_names_the_torch_version():
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__}")) as info:
        pl.fsdp_param_groups(SimpleNamespace())
    assert "_fsdp_param_groups" in str(info.value) and "_fsdp_param_group`" in str(info.value)


def _fake_root(states: list, callback=lambda: None) -> SimpleNamespace:
    return SimpleNamespace(
        _fsdp_param_groups=[],
        _state_ctx=SimpleNamespace(all_states=states),
        _root_post_backward_final_callback=callback,
    )


class _FakeFSDPModule:
    def __init__(self) -> None:
        self.flags: dict[str, bool] = {}

    def set_is_last_backward(self, value: bool) -> None:
        self.flags["is_last_backward"] = value

    def set_reshard_after_backward(self, value: bool) -> None:
        self.flags["reshard_after_backward"] = value

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.flags["requires_gradient_sync"] = value


@pytest.mark.parametrize("layout", ["list", "single"])
def test_reduce_grads_on_either_layout(layout, monkeypatch):
    """Every group's post_backward once, then the root's final callback, after the public setters."""
    a, b = _Group("a"), _Group("b")
    if layout == "list":
        states = [SimpleNamespace(_fsdp_param_groups=[a, b]), SimpleNamespace(_fsdp_param_groups=[])]
    else:
        states = [SimpleNamespace(_fsdp_param_group=a), SimpleNamespace(_fsdp_param_group=b)]
    order = []
    root = _fake_root(states, callback=lambda: order.append(("final", a.calls, b.calls)))
    monkeypatch.setattr(pl, "_fsdp_state", lambda module: root)
    module = _FakeFSDPModule()
    pl._reduce_grads(module)
    assert (a.calls, b.calls) == (1, 1) and order == [("final", 1, 1)]
    assert module.flags == {"is_last_backward": True, "reshard_after_backward": True, "requires_gradient_sync": True}


@pytest.mark.parametrize(
    "root,missing",
    [
        (SimpleNamespace(_state_ctx=SimpleNamespace(all_states=[]), _root_post_backward_final_callback=print), "_fsdp"),
        (SimpleNamespace(_fsdp_param_groups=[], _root_post_backward_final_callback=print), "_state_ctx"),
        (SimpleNamespace(_fsdp_param_groups=[], _state_ctx=None), "_root_post_backward_final_callback"),
    ],
    ids=["no-param-groups", "no-state-ctx", "no-final-callback"],
)
def test_missing_internals_fail_before_the_first_micro_batch(root, missing, monkeypatch):
    monkeypatch.setattr(pl, "_fsdp_state", lambda module: root)
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__}")) as info:
        pl._check_fsdp_internals(_FakeFSDPModule())
    assert missing in str(info.value)


def test_reduce_grads_without_all_states_is_a_clear_error(monkeypatch):
    root = SimpleNamespace(
        _fsdp_param_groups=[], _state_ctx=SimpleNamespace(), _root_post_backward_final_callback=print
    )
    monkeypatch.setattr(pl, "_fsdp_state", lambda module: root)
    with pytest.raises(RuntimeError, match=r"all_states.*pipeline replay|pipeline replay.*all_states"):
        pl._reduce_grads(_FakeFSDPModule())


def test_fully_shard_state_missing(monkeypatch):
    from torch.distributed.fsdp import fully_shard

    monkeypatch.delattr(fully_shard, "state")
    with pytest.raises(RuntimeError, match=r"fully_shard\.state"):
        pl._fsdp_state(nn.Linear(2, 2))


# the installed torch's FSDP2, on a fake process group of two ranks (CPU)


@pytest.fixture
def fsdp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def _accumulate_without_sync(model: nn.Module) -> None:
    """What StageReplay.step does: two micro-batches' backwards with sync and resharding off."""
    model.set_is_last_backward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()


def _assert_reduced(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters()]
    assert all(isinstance(g, DTensor) for g in grads), [type(g) for g in grads]


def test_installed_torch_layout_is_known(fsdp_model):
    from torch.distributed.fsdp import fully_shard

    pl._check_fsdp_internals(fsdp_model)
    _accumulate_without_sync(fsdp_model)
    states = fully_shard.state(fsdp_model)._state_ctx.all_states
    # the root holds no parameters of its own; each layer's state one group
    assert [len(pl.fsdp_param_groups(s)) for s in states] == [0, 1, 1]
    pl._reduce_grads(fsdp_model)
    _assert_reduced(fsdp_model)


class _SingleGroupState:
    """A real FSDP2 state seen as torch 2.6 to 2.11 show it: ``_fsdp_param_group`` only."""

    def __init__(self, state) -> None:
        groups = list(state._fsdp_param_groups) if hasattr(state, "_fsdp_param_groups") else [state._fsdp_param_group]
        assert len(groups) <= 1
        self._fsdp_param_group = groups[0] if groups else None


def test_real_state_through_the_single_group_layout(fsdp_model, monkeypatch):
    """The installed torch's groups and final callback, reached through the layout of torch 2.11
    (where ``_fsdp_param_groups`` raised AttributeError)."""
    from torch.distributed.fsdp import fully_shard

    real = fully_shard.state(fsdp_model)
    _accumulate_without_sync(fsdp_model)
    calls = []
    for state in real._state_ctx.all_states:
        for group in pl.fsdp_param_groups(state):
            original = group.post_backward
            monkeypatch.setattr(group, "post_backward", lambda original=original: calls.append(1) or original())
    old_style = SimpleNamespace(
        _fsdp_param_group=None,
        _state_ctx=SimpleNamespace(all_states=[_SingleGroupState(s) for s in real._state_ctx.all_states]),
        _root_post_backward_final_callback=real._root_post_backward_final_callback,
    )
    assert not hasattr(old_style._state_ctx.all_states[1], "_fsdp_param_groups")
    monkeypatch.setattr(pl, "_fsdp_state", lambda module: old_style)
    pl._check_fsdp_internals(fsdp_model)
    pl._reduce_grads(fsdp_model)
    assert len(calls) == 2
    _assert_reduced(fsdp_model)


# torch._dynamo's constant marker, set by hand in memplan.kernels


def test_dynamo_constant_marker_is_what_assume_constant_result_sets():
    """``kernels/__init__.py`` (``_kernels_run_on``) and ``kernels/fused_attention.py``
    (``compile_unsupported``) set ``_dynamo_marked_constant`` instead of calling
    ``torch.compiler.assume_constant_result``: a torch that renames it fails here."""

    def probe() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(probe)
    assert getattr(marked, "_dynamo_marked_constant", False) is True
