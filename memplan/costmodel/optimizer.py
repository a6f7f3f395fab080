"""Optimizer states per parameter, the optimizer step's temporaries, and bitsandbytes' paged states."""

from __future__ import annotations

from memplan.costmodel import lora as L
from memplan.costmodel import params as P
from memplan.costmodel.layout import StageLayout
from memplan.costmodel.precision import PrecisionPolicy
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan

# bitsandbytes 8-bit blockwise optimizers: 1-byte states with one fp32 absmax per 256 values
# (bitsandbytes/optim/optimizer.py, Optimizer8bit, block size 256).
BNB_BLOCK = 256
# bitsandbytes/optim/optimizer.py, Optimizer8bit.get_state_buffer: a parameter of fewer elements
# gets ``torch.zeros_like`` (the caching allocator), a larger one ``F.get_paged`` (CUDA managed memory)
PAGED_MIN_ELEMENTS = 100_000
PAGED = "paged-"
# bitsandbytes' state buffers per parameter element: (states, bytes each). AdamW keeps m and v
# (Optimizer2State), Lion one momentum (Optimizer1State); 32-bit buffers are fp32 whatever the
# parameters' dtype (get_state_buffer(p, dtype=torch.float32)), 8-bit ones uint8.
_BNB_STATES = {
    "adamw-8bit": (2, 1),
    "paged-adamw-8bit": (2, 1),
    "paged-adamw-32bit": (2, 4),
    "paged-lion-8bit": (1, 1),
    "paged-lion-32bit": (1, 4),
}


def is_paged(optimizer: str) -> bool:
    """bitsandbytes' paged optimizers (``is_paged=True``: PagedAdamW8bit, PagedAdamW32bit,
    PagedLion8bit, PagedLion32bit; transformers' ``paged_*`` names)."""
    return optimizer.startswith(PAGED)


def state_bytes_per_param(optimizer: str, policy: PrecisionPolicy, factored_fraction: float = 0.0) -> float:
    """Optimizer-state bytes per parameter, fp32 master weights included.

    AdamW: m and v (2 x state_bytes); SGD with momentum: one buffer; Adafactor (Shazeer & Stern
    2018): the second moment factored into row + column vectors, no first moment, so
    ``factored_fraction`` (row+col elements / matrix elements, about 0) of a state;
    bitsandbytes (Dettmers et al. 2022): per state 1 byte and one fp32 absmax per 256 values
    (8-bit) or 4 bytes (32-bit), two states for AdamW and one for Lion; the paged variants hold
    the same bytes (where they live: :func:`paged_state_bytes`).
    """
    if optimizer == "adamw":
        states = 2 * policy.state_bytes
    elif optimizer == "sgd":
        states = policy.state_bytes
    elif optimizer == "adafactor":
        states = factored_fraction * policy.state_bytes
    elif optimizer in _BNB_STATES:
        count, size = _BNB_STATES[optimizer]
        states = count * (size + (4 / BNB_BLOCK if size == 1 else 0))
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    return policy.master_bytes + states


def bnb_states(optimizer: str) -> tuple[int, int]:
    """(state buffers per parameter, bytes per element of each) of a bitsandbytes optimizer:
    2 for AdamW, 1 for Lion; 1 byte (8-bit) or 4 (32-bit)."""
    return _BNB_STATES[optimizer]


def paged_bytes_per_param(optimizer: str) -> int:
    """Bytes per element a paged optimizer puts in CUDA managed memory: its state buffers
    (``state1``, ``state2``). The 8-bit absmaxes and quantization maps stay ``torch.zeros``
    tensors in the caching allocator (Optimizer2State.init_state)."""
    if not is_paged(optimizer):
        return 0
    count, size = _BNB_STATES[optimizer]
    return count * size


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


def paged_elements(model: ModelSpec, layout: StageLayout, plan: Plan) -> float:
    """Elements of one rank's trainable tensors whose state bitsandbytes pages: those of at least
    ``PAGED_MIN_ELEMENTS`` elements, as the optimizer sees them (one state buffer per parameter
    tensor, at its TP slice and, under ZeRO >= 1 over dp x cp > 1 ranks, its shard: FSDP's
    per-parameter sharding).

    Full training: every parameter but the norm weights (a hidden-width vector each, under the
    threshold for every bundled model), the matrices taken as above it (a k_proj slice of
    1024 x 4096 falls under it only past 40-way sharding). LoRA: each adapter's lora_A (r x in)
    and lora_B (out x r) on its own (r=16 on a 4096-wide q_proj: 65,536 elements each, so not
    paged), and the ``modules_to_save`` copies (V x h).
    """
    group = plan.dp * plan.cp if plan.zero >= 1 else 1
    if plan.finetune == "full":
        small = layout.layers * (P.layer_norm_params(model) + P.qk_norm_params(model))
        small += P.norm_params(model) if layout.is_last else 0
        return (layout.params - small) / group
    linears = L.layer_linears(model)
    tensors = []
    for name in L.model_targets(model, plan.lora_targets):
        i, o = linears[name]
        tensors += [plan.lora_rank * i / plan.tp / group] * layout.layers
        tensors += [o * plan.lora_rank / plan.tp / group] * layout.layers
    copies = L.saved_module_params(model, plan.modules_to_save)
    tensors.append(copies.get("embed_tokens", 0) / plan.tp / group if layout.is_first else 0)
    tensors.append(copies.get("lm_head", 0) / plan.tp / group if layout.is_last else 0)
    return sum(n for n in tensors if n >= PAGED_MIN_ELEMENTS)


def paged_state_bytes(model: ModelSpec, layout: StageLayout, plan: Plan) -> int:
    """Bytes of a paged optimizer's states on one rank that live in CUDA managed memory:
    ``paged_bytes_per_param`` for each of :func:`paged_elements`. bitsandbytes allocates them
    with ``cudaMallocManaged(ptr, bytes, cudaMemAttachHost)`` (csrc/pythonInterface.cpp,
    ``cget_managed_ptr``), outside PyTorch's caching allocator; with the optimizer offloaded
    (ZeRO-Offload steps on the host) nothing is paged."""
    per = paged_bytes_per_param(plan.optimizer)
    if not per or plan.offload_optimizer != "none":
        return 0
    return int(paged_elements(model, layout, plan) * per)


def paged_residency(paged_bytes: int, headroom_bytes: int) -> tuple[int, int]:
    """(resident, on host) of paged states beside a step whose reserved peak leaves
    ``headroom_bytes`` of the device free: CUDA's unified memory keeps managed pages on the
    device while it has room and evicts them to the host when device allocations need it
    (QLoRA, Dettmers et al. 2023, Sec. 2 "Paged Optimizers"), so what exceeds the headroom is
    on the host at the peak and is paged back for the optimizer step (bitsandbytes prefetches
    each parameter's state before its update: ``Optimizer8bit.prefetch_state``)."""
    resident = min(paged_bytes, max(0, headroom_bytes))
    return resident, paged_bytes - resident
