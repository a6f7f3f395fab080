"""Precision policies: bytes per element of each kind of tensor, by policy name.

Sources: ZeRO (Rajbhandari et al. 2020) Sec. 3.1 for mixed-precision Adam (K = 12: fp32 master
weights, momentum and variance beside 16-bit params and grads); PyTorch autocast docs for
``bf16-mixed`` (fp32 params, bf16 compute); Megatron-LM / TransformerEngine for ``fp8`` (bf16
params with fp32 main weights, ``--bf16 --fp8-format hybrid``). What the fp8 linears themselves
keep (saved fp8 inputs, cached fp8 weights, scaling state, cast temporaries, the FSDP2 fp8
all-gather) depends on the library and recipe: ``fp8.py``.
"""

from __future__ import annotations

from memplan.records import record


@record(slots=True)
class PrecisionPolicy:
    """Element sizes in bytes. ``master_bytes`` is 0 when the params are the master copy."""

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    compute_bytes: int
    fp8_matmuls: bool = False

    def __init__(
        self,
        name: str,
        param_bytes: int,
        grad_bytes: int,
        master_bytes: int,
        state_bytes: int,
        compute_bytes: int,
        fp8_matmuls: bool = False,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "name", name)
        _set(self, "param_bytes", param_bytes)
        _set(self, "grad_bytes", grad_bytes)
        _set(self, "master_bytes", master_bytes)
        _set(self, "state_bytes", state_bytes)
        _set(self, "compute_bytes", compute_bytes)
        _set(self, "fp8_matmuls", fp8_matmuls)


POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", 4, 4, 0, 4, 4),
    "bf16-mixed": PrecisionPolicy("bf16-mixed", 4, 4, 0, 4, 2),
    "bf16-master": PrecisionPolicy("bf16-master", 2, 2, 4, 4, 2),
    "fp16-master": PrecisionPolicy("fp16-master", 2, 2, 4, 4, 2),
    "bf16": PrecisionPolicy("bf16", 2, 2, 0, 2, 2),
    "fp8": PrecisionPolicy("fp8", 2, 2, 4, 4, 2, fp8_matmuls=True),
}

KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
