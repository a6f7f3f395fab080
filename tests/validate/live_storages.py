"""A count of live tensor storages that holds no reference to any of them: the measured side the
bundled trainer's meter (memplan.train.tracker.PhaseMeter) is held to.

``LiveStorages`` is a ``TorchDispatchMode`` and nothing else: no module hook, no gradient hook, no
optimizer hook. Each storage an op outputs is counted (``UntypedStorage.nbytes()``, exact on CPU)
from the op that first returns it until its Python storage object is finalised (a weak reference's
callback: PyTorch keeps one Python object per storage for as long as the storage lives), plus the
storages alive when it starts that the run created (``adopt``). Tensor subclasses that wrap others
(DTensor) are left to desugar into the ops on their local tensors, which the mode then sees;
operations under a fake mode (DTensor's sharding propagation) allocate nothing and are skipped.

Known exclusions, by construction:
- memory a kernel allocates and frees inside one op (workspace, temporaries of a fused kernel):
  a dispatch mode sees an op's outputs, not its insides (torch.profiler's allocator events do,
  tests/validate/test_meter_independent.py compares the two at op boundaries);
- memory outside torch's allocator (the numpy host copies of memplan.train.offload's emulated
  ``save_on_cpu``: host memory on a real device, which neither side counts);
- ``UntypedStorage.resize_`` is no op on CPU (``resize_bytes_cpu`` is called directly), so FSDP2's
  freeing and re-allocating of unsharded parameters would pass unseen: it is wrapped while the
  mode runs, the only hook outside the dispatcher.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s memory: itself, or a wrapper subclass's inner tensors."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()
    inner = [getattr(t, a) for a in attrs]
    return [p for x in inner if isinstance(x, torch.Tensor) for p in _plain_tensors(x)]


def _scan() -> tuple[dict[int, weakref.ref], set[int]]:
    """Weak references to every storage a Python tensor refers to now, by ``id``, and the ids of
    the device meshes' own (a ``DeviceMesh`` keeps its rank layout in a CPU tensor whatever the
    device: host memory). Types are tested once each (``isinstance`` on ~500,000 objects through
    torch's metaclasses costs seconds)."""
    kinds: dict[type, int] = {}
    found, meshes = {}, set()
    for obj in gc.get_objects():
        kind = kinds.get(type(obj))
        if kind is None:
            t = type(obj)
            kind = kinds[t] = 1 if issubclass(t, torch.Tensor) and not issubclass(t, FakeTensor) else (
                2 if issubclass(t, DeviceMesh) else 0
            )  # fmt: skip
        if kind == 1:
            for t in _plain_tensors(obj):
                if t.device.type != "meta":
                    st = t.untyped_storage()
                    found[id(st)] = weakref.ref(st)
        elif kind == 2:
            meshes.update(id(t.untyped_storage()) for t in vars(obj).values() if isinstance(t, torch.Tensor))
    return found, meshes


def storages_alive() -> dict[int, weakref.ref]:
    """The storages alive now (the caller collects garbage first): the baseline a run's own
    storages are told apart from."""
    return _scan()[0]


def new_since(baseline: dict[int, weakref.ref]) -> list[torch.UntypedStorage]:
    """The storages alive now (after a garbage collection) that were not at ``baseline``, but
    for the device meshes' rank layouts."""
    gc.collect()
    now, meshes = _scan()
    return [
        st
        for key, ref in now.items()
        if (st := ref()) is not None and key not in meshes and baseline.get(key, _dead)() is not st
    ]


def _dead() -> None:
    return None


class LiveStorages(TorchDispatchMode):
    """Bytes of live storages, ``current``; the caller reads it after each op through
    ``on_change`` (called after every op and every ``resize_``)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[int, weakref.ref]] = {}  # id(storage) -> (bytes, weak ref)
        self.current = 0
        self.on_change = lambda func, args, kwargs: None  # after every op, and every resize (func None)
        self.on_new = lambda key: None  # a storage counted for the first time (its id)
        self.on_free = lambda key: None  # a counted storage freed (its id, free for reuse now)
        self._resize = torch.UntypedStorage.resize_

    def adopt(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Count storages that exist already (the model's, made before the run starts)."""
        for st in storages:
            self._count(st)

    def counts(self, key: int) -> bool:
        return key in self._live

    def bytes_of_id(self, key: int) -> int:
        return self._live.get(key, (0, None))[0]

    def _count(self, st: torch.UntypedStorage) -> None:
        key, size = id(st), st.nbytes()
        known = self._live.get(key)
        if known is not None:  # an op that resized its output in place (``out=``, ``resize_``)
            self.current += size - known[0]
            self._live[key] = (size, known[1])
            return
        self._live[key] = (size, weakref.ref(st, lambda _, key=key: self._drop(key)))
        self.current += size
        self.on_new(key)

    def _drop(self, key: int) -> None:
        size, _ = self._live.pop(key, (0, None))
        self.current -= size
        self.on_free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a wrapper (DTensor): its local ops come back through the mode
        out = func(*args, **(kwargs or {}))
        from torch._guards import active_fake_mode

        if active_fake_mode() is not None:
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for p in _plain_tensors(t):
                    if p.device.type != "meta":
                        self._count(p.untyped_storage())
        self.on_change(func, args, kwargs or {})
        return out

    def __enter__(self) -> LiveStorages:
        original = self._resize

        def resize_(st: torch.UntypedStorage, size: int) -> None:
            original(st, size)
            self._count(st)
            self.on_change(None, (), {})

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)


@dataclass
class Peak:
    """A phase's peak as the runner reads it (``memplan.train.runner._phases``)."""

    allocated: int = 0
    reserved: int | None = None
    categories: dict[str, int] = field(default_factory=dict)


class DispatchMeter:
    """memplan.train.tracker.PhaseMeter's interface over :class:`LiveStorages`: the bundled
    trainer runs with it in the meter's place (``runner.PhaseMeter`` patched by the test).

    Per phase, the highest count seen after an op. With FSDP2's CPU offload the host holds each
    parameter's shard, its gradient's shard and what the optimizer step makes (its states and
    temporaries: FSDP2's ``CPUOffloadPolicy`` steps the optimizer on the host), so those are
    left out, as a device would not hold them."""

    def __init__(self, model, optimizer, device, fsdp, offloaded, limit=None, *, baseline) -> None:  # noqa: ANN001
        self.tracker = LiveStorages()
        self.tracker.on_change = self._observe
        self.tracker.on_new = self._made
        self.offloaded = offloaded
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.phase: str | None = None
        self.label: str | None = None
        self.steps = 0
        self.failed_in = None
        self.peaks: dict[str, Peak] = {}
        self._host: set[int] = set()  # id(storage) of what the host holds (offload), counted ones
        self.tracker.on_free = self._host.discard  # a freed id may come back as another storage's
        self._new = new_since(baseline)

    def _host_bytes(self) -> int:
        for p in self.params:  # a shard and its gradient's shard, as FSDP2 sets them
            for t in (p, p.grad):
                if t is not None:
                    self._host.update(k for x in _plain_tensors(t) if self.tracker.counts(k := id(x.untyped_storage())))
        return sum(self.tracker.bytes_of_id(k) for k in self._host)

    def _made(self, key: int) -> None:
        if self.offloaded and self.label == "optimizer":
            self._host.add(key)

    def _observe(self, *op: object) -> None:
        if self.phase is None:
            return
        total = self.tracker.current
        if self.offloaded:
            total -= self._host_bytes()
        peak = self.peaks.setdefault(self.phase, Peak())
        peak.allocated = max(peak.allocated, total)

    def set_phase(self, phase: str | None, record: bool = True) -> None:
        self.label = phase
        self.phase = phase if record else None

    def end_step(self) -> None:
        self.steps += 1

    def __enter__(self) -> DispatchMeter:
        self.tracker.adopt(self._new)
        self._new = []  # no reference kept
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.set_phase(None)
        self.tracker.__exit__(*exc)
