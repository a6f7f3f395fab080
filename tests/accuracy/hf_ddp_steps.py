"""``transformers.Trainer`` under DDP on CPU: two ranks over gloo, rank 0 measured by live storages.

What ``torchrun --nproc_per_node 2 train.py`` does with a Trainer on CPU (``use_cpu=True``): accelerate
sees ``WORLD_SIZE=2`` (``DistributedType.MULTI_CPU``, backend gloo) and wraps the model in
``DistributedDataParallel`` with the Trainer's arguments (``Trainer._build_accelerator_args``:
``find_unused_parameters`` unless checkpointing a ``PreTrainedModel``; everything else accelerate's
defaults). Each rank is forked by a fork server (``torch.multiprocessing.start_processes`` with
``start_method="forkserver"``; one intra-op thread per rank): a process of one thread that imported torch
and transformers once (``_PRELOAD``), so a case costs ~8 s instead of ~30 s spawned, and no rank is
forked from a process with other threads (a pytest-xdist worker's, whose locks a forked child can find
held for ever); rank 0
counts its live storages with :class:`StorageTracker` (the model's parameters and buffers, then
whatever an op creates) from
``trainer.train()`` on, so DDP's construction (inside ``accelerator.prepare``) is counted too. The
rank's device is plain ``cpu`` (:func:`_plain_cpu_device`), as a GPU rank's is the tensors' own.
The case is an ``hf_steps.Case`` (full fine-tuning) or a ``peft_steps.PeftCase`` (LoRA); ``optim``: memplan's
optimizer name, as the Trainer builds it (optim_steps.py).

    python tests/accuracy/hf_ddp_steps.py NAME [GA]   # prints rank 0's allocation sequence
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp

WORLD = 2
# what the fork server imports once, before it forks any rank (multiprocessing.set_forkserver_preload)
_PRELOAD = ["torch", "transformers", "accelerate", "hf_steps"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(case):
    """The model as the single-rank harnesses build it (hf_steps._model / hf_peft_steps.build)."""
    import hf_steps

    if isinstance(case, hf_steps.Case):
        return hf_steps._model(case)
    import hf_peft_steps

    return hf_peft_steps.build(case)


def _plain_cpu_device() -> None:
    """accelerate's ``PartialState.set_device`` gives a CPU rank ``torch.device("cpu", local_rank)``,
    an index no CPU tensor has, so every ``.to(device)`` copies (the model in ``prepare_model``, each
    batch, the token count); on CUDA the model and batches are already on ``cuda:<rank>`` and only
    host memory is copied. The device is set to plain ``cpu`` so that rank 0's live storages are what
    a GPU's allocator would hold."""
    from accelerate.state import PartialState

    set_device = PartialState.set_device

    def plain(self) -> None:
        set_device(self)
        if self.device.type == "cpu":
            self.device = torch.device("cpu")

    PartialState.set_device = plain


def _quant_state(model) -> list[torch.Tensor]:
    """A 4-bit base's quantization state (not parameters or buffers: handed to the tracker, as
    hf_peft_steps.measure does)."""
    from peft_steps import quant_state_tensors

    return quant_state_tensors(model)


def _rank(
    rank: int,
    case,
    ga: int,
    steps: int,
    port: int,
    out: str,
    log: bool,
    optim: str = "adamw",
    offload: bool | str = False,
    args_update: dict | None = None,
) -> None:
    """One rank: the environment torchrun sets, the Trainer (``offload``: under TRL-like activation offload,
    offload_steps.trl_trainer; ``args_update``: ``TrainingArguments`` fields set after they are built), rank 0's
    tracker."""
    import hf_steps
    import transformers
    from alloc_log import AllocLog
    from optim_steps import trained_with
    from storage_tracker import StorageTracker

    torch.set_num_threads(1)
    _plain_cpu_device()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
    )
    model = _build(case)
    torch.manual_seed(1)
    ids = torch.randint(0, case.vocab, (case.batch * ga * steps * WORLD, case.seq))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as tmp:
        args = hf_steps.training_args(tmp, case, steps, ga)
        for key, value in (args_update or {}).items():
            setattr(args, key, value)
        with trained_with(args, optim):
            if offload:
                from offload_steps import trl_trainer

                trainer = trl_trainer(model, args, rows, emulated=offload == "emulated")
            else:
                trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
            tracker = (AllocLog() if log else StorageTracker()) if rank == 0 else None
            if tracker is None:
                trainer.train()
            else:
                tracker.track_module(model)
                tracker.track(*_quant_state(model))
                with tracker:
                    trainer.train()
    if tracker is not None:
        context = getattr(trainer, "maybe_activation_offload_context", None)
        reused = context.host.reused_addresses if hasattr(context, "host") else 0  # TRL's own hooks
        with open(out, "w") as f:
            f.write(f"{tracker.peak} {reused}\n")
            for i, (sign, size, op, live) in enumerate(getattr(tracker, "events", [])):
                f.write(f"{i:6d} {sign} {size:12d} {op:40s} {live:12d}\n")
    torch.distributed.destroy_process_group()


def run(
    case,
    ga: int = 1,
    steps: int = 3,
    log: bool = False,
    optim: str = "adamw",
    offload: bool | str = False,
    args_update: dict | None = None,
) -> list[str]:
    """Rank 0's peak (first line) and, with ``log``, its allocation sequence (``args_update``: ``_rank``'s)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.txt")
        args = (case, ga, steps, _free_port(), out, log, optim, offload, args_update)
        mp.set_forkserver_preload(_PRELOAD)
        mp.start_processes(_rank, args=args, nprocs=WORLD, join=True, start_method="forkserver")
        with open(out) as f:
            return f.read().splitlines()


def measure(
    case,
    ga: int = 1,
    steps: int = 3,
    optim: str = "adamw",
    offload: bool | str = False,
    args_update: dict | None = None,
) -> int:
    """Rank 0's peak live bytes over ``steps`` optimizer steps of ``ga`` micro-batches (``offload``: under TRL's own
    hooks, or the emulation where TRL's figures depend on the allocator, as ``offload_steps.measure`` chooses)."""
    from offload_steps import ALLOCATOR_DEPENDENT

    if offload is True and case.name in ALLOCATOR_DEPENDENT:
        offload = "emulated"
    peak, reused = run(case, ga, steps, optim=optim, offload=offload, args_update=args_update)[0].split()
    if offload is True and int(reused):
        return measure(case, ga, steps, optim, "emulated", args_update)
    return int(peak)


if __name__ == "__main__":
    import hf_steps

    name = sys.argv[1]
    lines = run(hf_steps.Case(name, loop="trainer"), *(int(a) for a in sys.argv[2:3]), log=True)
    print("\n".join(lines[1:]))
    print("peak", lines[0].split()[0])
