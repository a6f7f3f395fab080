"""``transformers.Trainer`` under FSDP2 on CPU: rank 0 of ``dp`` ranks under the fake process group.

What ``torchrun --nproc_per_node N train.py`` does with ``TrainingArguments(fsdp=True, fsdp_config=
{"version": 2, "reshard_after_forward": ...})``, run as rank 0 in this one process: the process group
is torch's fake one (``torch.testing._internal.distributed.fake_pg``, as the bundled trainer's rank
simulation; its collectives allocate nothing and return at once, so no gloo ``AsyncWork`` holds a
reduce-scatter input past its last Python reference: tests/cli/test_validate.py), initialised before
the Trainer, which accelerate then uses as it is (``PartialState``: ``dist.is_initialized()``).

Two things are set by hand, each what a GPU rank has:

- accelerate turns FSDP on only for accelerator ranks (``AcceleratorState.__init__``, accelerate 1.15
  ``state.py:986-1013``: ``MULTI_GPU`` and the other device types, not ``MULTI_CPU``); without it a
  CPU run silently trains under DDP. :func:`_cpu_fsdp` reports the CPU rank as ``MULTI_GPU`` to that
  check (the device stays the CPU), so the Trainer's ``FullyShardedDataParallelPlugin`` is used;
- the rank's device is plain ``cpu`` (as in hf_ddp_steps.py: a CUDA rank's tensors are already on it).

The tracker is :class:`FsdpTracker`: live storages as :class:`StorageTracker` counts them, keyed by
the storage itself (``_cdata``) and following ``UntypedStorage.resize_``, by which FSDP2 frees and
re-allocates the unsharded parameters (``_fsdp_param.free_storage`` / ``alloc_storage``), and counting
a ``DTensor``'s local shard (the sharded parameters, their gradients and the optimizer's states).

    python tests/accuracy/hf_fsdp_steps.py   # prints rank 0's allocation sequence of a small case
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref

import torch
import torch.distributed as dist
from storage_tracker import StorageTracker

WORLD = 2


class FsdpTracker(StorageTracker):
    """Live storages keyed by the storage (not its data pointer, which ``resize_`` changes), sized
    as ``resize_`` leaves them; a ``DTensor`` output counted by its local tensor. ``events`` when
    ``log``: (sign, bytes, op, live bytes after)."""

    def __init__(self, log: bool = False) -> None:
        super().__init__()
        self.log = log
        self.events: list[tuple[str, int, str, int]] = []
        self._op = "track"
        self._resize = torch.UntypedStorage.resize_

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key in self._live or size == 0:
            return
        self._set(key, size)
        weakref.finalize(storage, self._drop, key)

    def _set(self, key: int, size: int) -> None:
        old = self._live.get(key, 0)
        self._live[key] = size
        self.current += size - old
        self.peak = max(self.peak, self.current)
        if self.log:
            self.events.append(("+" if size > old else "-", abs(size - old), self._op, self.current))

    def _drop(self, key: int) -> None:
        if key in self._live:
            self._set(key, 0)
            del self._live[key]

    def track(self, *tensors: torch.Tensor) -> None:  # type: ignore[override]
        super().track(*(_local(t) for t in tensors))

    def __enter__(self):  # noqa: ANN204
        tracker, resize = self, self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> None:
            resize(storage, size)
            if storage._cdata in tracker._live:
                tracker._op = "resize_"
                tracker._set(storage._cdata, storage.nbytes())
            elif size:
                tracker._add(storage)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        self._op = str(func.__name__)
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            t = _local(t)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())
        return out


def _local(t):  # noqa: ANN001, ANN202
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


@contextlib.contextmanager
def _cpu_fsdp():
    """accelerate's FSDP for a CPU rank (module docstring), on a plain ``cpu`` device; undone after."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    set_device = PartialState.set_device

    def as_gpu(self) -> None:  # noqa: ANN001
        set_device(self)
        if self.device.type == "cpu":
            self.device = torch.device("cpu")
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.MULTI_GPU

    PartialState.set_device = as_gpu
    try:
        yield
    finally:
        PartialState.set_device = set_device


@contextlib.contextmanager
def fake_rank(world: int = WORLD):
    """Rank 0 of ``world`` under the fake process group, with torchrun's environment; the
    environment, accelerate's shared state and the process group restored after."""
    from accelerate.state import AcceleratorState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = dict(os.environ)
    os.environ.update(
        WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1"
    )
    AcceleratorState._reset_state(True)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with _cpu_fsdp():
            yield
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(saved)


def fsdp_args(out: str, case, steps: int, ga: int, reshard: bool, fsdp_ac: bool = False, config: dict | None = None):  # noqa: ANN001, ANN201, E501
    """hf_steps.training_args with FSDP2 as the Trainer's docs configure it (``fsdp=True``,
    ``fsdp_config={"version": 2, "reshard_after_forward": ...}``: ``full_shard`` is True,
    ``shard_grad_op`` False; the decoder layer class from ``_no_split_modules``); with ``fsdp_ac`` a
    checkpointed case checkpoints through ``fsdp_config["activation_checkpointing"]`` (accelerate's
    ``fsdp2_apply_ac``, as ``memplan export --to hf-trainer --sharding fsdp`` writes it) instead of the
    Trainer's ``gradient_checkpointing``; ``config``: further ``fsdp_config`` entries (an exported one)."""
    import dataclasses

    import hf_steps

    ac = fsdp_ac and case.checkpointing
    args = hf_steps.training_args(
        out, dataclasses.replace(case, checkpointing=case.checkpointing and not ac), steps, ga
    )
    args.fsdp = True
    args.fsdp_config = {
        "version": 2,
        "reshard_after_forward": reshard,
        "activation_checkpointing": ac,
        **(config or {}),
    }
    args.fsdp_plugin_args = args._process_fsdp_args()
    return args


def run(
    case,
    ga: int = 1,
    steps: int = 3,
    reshard: bool = True,
    world: int = WORLD,
    log: bool = False,
    fsdp_ac: bool = False,
    config: dict | None = None,
    offload: bool = False,
    step_peaks: bool = False,
    args_update: dict | None = None,
):  # noqa: ANN001, ANN201, E501
    """Rank 0's tracker after ``steps`` optimizer steps of ``ga`` micro-batches (its ``peak``; with
    ``log`` its ``events``), counted from ``trainer.train()`` on: the sharding inside
    ``accelerator.prepare`` is counted. ``offload``: the Trainer under TRL-like activation offload
    (offload_steps.trl_trainer). ``args_update``: ``TrainingArguments`` fields set after they are built.
    ``step_peaks``: the tracker's ``step_peaks`` holds each optimizer step's
    own peak (the highest live bytes logged from the previous ``on_step_end``, after ``zero_grad``, to this
    one's), so a later step that stays below the first's peak is compared too, and ``step_ends`` the live
    bytes at each ``on_step_end``."""
    import transformers
    from hf_ddp_steps import _build, _quant_state

    with fake_rank(world):
        model = _build(case)
        torch.manual_seed(1)
        ids = torch.randint(0, case.vocab, (case.batch * ga * steps * world, case.seq))
        rows = [{"input_ids": row, "labels": row} for row in ids]
        with tempfile.TemporaryDirectory() as tmp:
            args = fsdp_args(tmp, case, steps, ga, reshard, fsdp_ac, config)
            for key, value in (args_update or {}).items():
                setattr(args, key, value)
            if offload:
                from offload_steps import trl_trainer

                # the emulation: TRL keeps saves at the freed addresses of the parameters it recorded before FSDP2
                # sharded them, 20 to 27 a run, the peak changing from run to run (docs/cost-model.md, "Measured
                # with TRL's own code")
                trainer = trl_trainer(model, args, rows, emulated=True)
            else:
                trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
            tracker = FsdpTracker(log or step_peaks)
            if step_peaks:
                trainer.add_callback(_StepPeaks(tracker))
            tracker.track_module(model)
            tracker.track(*_quant_state(model))
            with tracker:
                trainer.train()
            del trainer, model
    return tracker


def _StepPeaks(tracker: FsdpTracker):  # noqa: ANN202, N802 - a TrainerCallback made where transformers is imported
    """A ``TrainerCallback`` that closes each optimizer step at ``on_step_end`` (after ``zero_grad``): the
    tracker's ``step_peaks``, each step's highest live bytes over its logged events, and ``step_ends``, the
    live bytes there."""
    import transformers

    class StepPeaks(transformers.TrainerCallback):
        end = 0

        def on_step_end(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            start, self.end = self.end, len(tracker.events)
            tracker.step_peaks.append(max((live for *_, live in tracker.events[start : self.end]), default=0))
            tracker.step_ends.append(tracker.current)

    tracker.step_peaks, tracker.step_ends = [], []
    return StepPeaks()


def measure(
    case,
    ga: int = 1,
    steps: int = 3,
    reshard: bool = True,
    world: int = WORLD,
    fsdp_ac: bool = False,
    offload: bool = False,
    args_update: dict | None = None,
) -> int:  # noqa: ANN001, E501
    """Rank 0's peak live bytes over ``steps`` optimizer steps of ``ga`` micro-batches."""
    return run(case, ga, steps, reshard, world, fsdp_ac=fsdp_ac, offload=offload, args_update=args_update).peak


if __name__ == "__main__":
    import sys

    import hf_steps

    small = hf_steps.Case("hffsdp-small", loop="trainer", **hf_steps.BASE_SMALL)
    tracker = run(small, *(int(a) for a in sys.argv[1:2]), log=True)
    for i, (sign, size, op, live) in enumerate(tracker.events):
        print(f"{i:6d} {sign} {size:12d} {op:40s} {live:12d}")
    print("peak", tracker.peak)
