"""Optimizer states per parameter and the optimizer step's temporaries."""

from __future__ import annotations

from memplan.costmodel.precision import PrecisionPolicy

# bitsandbytes 8-bit blockwise optimizers: 1-byte states with one fp32 absmax per 256 values
# (bitsandbytes/optim/optimizer.py, Optimizer8bit, block size 256).
_BNB_BLOCK = 256


def state_bytes_per_param(optimizer: str, policy: PrecisionPolicy, factored_fraction: float = 0.0) -> float:
    """Optimizer-state bytes per parameter, fp32 master weights included.

    AdamW: m and v (2 x state_bytes); SGD with momentum: one buffer; Adafactor (Shazeer & Stern
    2018): the second moment factored into row + column vectors, no first moment, so
    ``factored_fraction`` (row+col elements / matrix elements, about 0) of a state;
    8-bit AdamW (Dettmers et al. 2022): 2 x (1 + 4/256) bytes.
    """
    if optimizer == "adamw":
        states = 2 * policy.state_bytes
    elif optimizer == "sgd":
        states = policy.state_bytes
    elif optimizer == "adafactor":
        states = factored_fraction * policy.state_bytes
    elif optimizer == "adamw-8bit":
        states = 2 * (1 + 4 / _BNB_BLOCK)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    return policy.master_bytes + states


def foreach_temp_bytes_per_param(optimizer: str, policy: PrecisionPolicy) -> int:
    """Temporaries of PyTorch's foreach ``step()`` per parameter (torch/optim/adamw.py).

    ``_multi_tensor_adam`` allocates ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``,
    one state-sized tensor per parameter, live until ``_foreach_addcdiv_``; measured with
    MemTracker as exactly one state-sized buffer. SGD (no weight decay) and the fused 8-bit
    kernels update in place; Adafactor keeps a param-sized update.
    """
    if optimizer == "adamw":
        return policy.state_bytes
    if optimizer == "adafactor":
        return policy.state_bytes
    return 0
