"""The Trainer's ``optim`` in the CPU harnesses: memplan's optimizer names as transformers spells them, and
bitsandbytes' CPU kernels made visible to a dispatch-level tracker.

:func:`trained_with` sets ``TrainingArguments.optim`` and, for the training it wraps, resets bitsandbytes'
``GlobalOptimManager`` as a new process finds it (it keeps each override by (group, index) too:
``check_overrides``' ``index2config``, so an earlier training's embedding override would give the parameter
at the same place 32-bit states) and calls bitsandbytes' CPU optimizer kernels as the Python functions
they are, not through their custom ops (``torch.ops.bitsandbytes.optimizer_update_*``): a tracker that is
a dispatch mode sees a custom op's outputs alone, none of the temporaries its kernel allocates inside (the
same code runs; checked against ``torch.profiler``'s memory events in
tests/unit/test_timeline_hf_optimizers.py).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from unittest import mock

import torch

# memplan's names -> transformers' ``optim``
OPTIM = {
    "adamw": "adamw_torch_fused",
    "sgd": "sgd",
    "adafactor": "adafactor",
    "adamw-8bit": "adamw_bnb_8bit",
    "paged-adamw-8bit": "paged_adamw_8bit",
    "paged-adamw-32bit": "paged_adamw_32bit",
    "paged-lion-8bit": "paged_lion_8bit",
    "paged-lion-32bit": "paged_lion_32bit",
}


@contextlib.contextmanager
def kernels_seen() -> Iterator[None]:
    """bitsandbytes' CPU optimizer kernels called as Python functions (module docstring)."""
    from bitsandbytes.backends.cpu import ops as cpu_ops

    namespace = torch.ops.bitsandbytes
    kernels = {
        "optimizer_update_32bit": cpu_ops._optimizer_update_32bit_cpu,
        "optimizer_update_8bit_blockwise": cpu_ops._optimizer_update_8bit_blockwise_cpu,
    }
    with contextlib.ExitStack() as stack:
        for name, kernel in kernels.items():
            stack.enter_context(mock.patch.object(namespace, name, kernel))
        yield


@contextlib.contextmanager
def trained_with(args, optimizer: str, seen: bool = True) -> Iterator[None]:  # noqa: ANN001 - TrainingArguments
    """``args.optim`` set to memplan's ``optimizer`` (``adamw``: left at the Trainer's default); inside, a fresh
    ``GlobalOptimManager`` and (``seen``) bitsandbytes' CPU kernels as Python functions; bitsandbytes' "Paged
    optimizers are not supported on CPU" silenced."""
    import transformers

    if optimizer != "adamw":  # the default's arguments left as they are
        args.optim = transformers.training_args.OptimizerNames(OPTIM[optimizer])
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if optimizer not in ("adamw", "sgd", "adafactor"):
            import bitsandbytes as bnb

            bnb.optim.GlobalOptimManager.get_instance().initialize()
            if seen:
                stack.enter_context(kernels_seen())
        yield
