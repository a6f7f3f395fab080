"""GPU profiles and the cluster they sit in."""

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from memplan.units import parse_bytes, parse_quantity

Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
"""An int of bytes; YAML may say ``80GiB`` or ``141GB``."""
NonNegativeBytes = Annotated[int, BeforeValidator(parse_bytes), Field(ge=0)]

MiB = 2**20
# The driver's share of device memory on current (R510 and later) drivers: nvidia-smi's total less
# what cudaMemGetInfo reports, the "Reserved" line of `nvidia-smi -q`. Public figures run from 316 MiB
# (RTX 4090) to 881 MiB (A100 80GB) and move with the driver by about +-110 MiB on one part
# (docs/cost-model.md, "The capacity PyTorch sees"). A profile without a capacity of its own is
# derived with the largest, so that "fits" errs towards "does not fit".
DRIVER_RESERVED_BYTES_MAX = 881 * MiB
BytesPerSecond = Annotated[float, BeforeValidator(lambda v: parse_quantity(v, "B")), Field(gt=0)]
FlopsPerSecond = Annotated[float, BeforeValidator(lambda v: parse_quantity(v, "FLOPS")), Field(gt=0)]

ComputeDtype = Literal["fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp4"]


class KernelEfficiency(BaseModel):
    """Fractions of the dense peak that a training step's kernels reach on this part, where
    published measurements exist (``sources['efficiency']`` says which)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul: float = Field(gt=0, le=1, description="Matmul throughput inside training steps / dense peak.")
    attention: float = Field(gt=0, le=1, description="FlashAttention forward + backward throughput / dense peak.")
    cudnn_attention: tuple[tuple[int, float, float], ...] = Field(
        (),
        description="cuDNN's fused attention (SDPA's cuDNN backend) against FlashAttention-2 on this part: "
        "(head dim, forward speed-up, backward speed-up) rows, published throughput over published throughput; "
        "empty: cuDNN priced as FlashAttention-2.",
    )


class GPUSpec(BaseModel):
    """One accelerator: capacity, dense peak throughput, memory and link bandwidths.

    Bandwidths are per direction (NVLink's marketed figure is both directions added).
    Every figure carries its source in ``sources``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Profile name, e.g. 'h100-sxm'.")
    display_name: str = Field(description="Marketing name of the part.")
    vendor: Literal["nvidia", "amd"]
    memory_bytes: Bytes = Field(description="Device memory usable by the framework, bytes.")
    torch_capacity_bytes: Bytes | None = Field(
        None,
        description="Device memory PyTorch sees (torch.cuda.mem_get_info total), bytes; None: derived from "
        "memory_bytes (capacity_bytes says how).",
    )
    torch_capacity_basis: Literal["measured", "published", "derived"] = Field(
        "published",
        description="Where torch_capacity_bytes comes from: measured here, published (public out-of-memory "
        "messages and logs), or derived from another part's figures.",
    )
    torch_capacity_spread_bytes: NonNegativeBytes = Field(
        0,
        description="How far below torch_capacity_bytes the capacity was seen on other drivers (part of the "
        "tight band).",
    )
    hbm_bytes_per_s: BytesPerSecond = Field(description="Memory bandwidth, bytes/s.")
    peak_flops: dict[ComputeDtype, FlopsPerSecond] = Field(
        description="Dense (no structured sparsity) peak FLOP/s per compute dtype."
    )
    nvlink_bytes_per_s: BytesPerSecond | None = Field(
        None, description="GPU-to-GPU link bandwidth per direction (NVLink / Infinity Fabric); None if PCIe only."
    )
    pcie_bytes_per_s: BytesPerSecond = Field(description="Host link bandwidth per direction, bytes/s.")
    compute_capability: tuple[int, int] | None = Field(
        None,
        description="CUDA compute capability (major, minor): which kernels PyTorch's SDPA may pick; None: not CUDA.",
    )
    sm_count: int | None = Field(
        None,
        gt=0,
        description="Streaming multiprocessors (torch.cuda.get_device_properties().multi_processor_count): "
        "bitsandbytes' gemm_4bit picks its kernel by them; None: not known.",
    )
    efficiency: KernelEfficiency | None = Field(
        None, description="Measured kernel efficiencies for the step-time model; None: the model's defaults."
    )
    sources: dict[str, str] = Field(description="Where each figure comes from, keyed by field name.")

    @model_validator(mode="after")
    def _every_figure_has_a_source(self) -> "GPUSpec":
        figures = ["memory_bytes", "hbm_bytes_per_s", "peak_flops", "pcie_bytes_per_s"]
        if self.nvlink_bytes_per_s is not None:
            figures.append("nvlink_bytes_per_s")
        if self.efficiency is not None:
            figures.append("efficiency")
        if self.torch_capacity_bytes is not None:
            figures.append("torch_capacity_bytes")
        if self.compute_capability is not None:
            figures.append("compute_capability")
        if self.sm_count is not None:
            figures.append("sm_count")
        missing = [f for f in figures if f not in self.sources]
        if missing:
            raise ValueError(f"sources: no source given for {', '.join(missing)}")
        return self

    @property
    def capacity_bytes(self) -> int:
        """What the caching allocator and everything outside it share: the total PyTorch
        reports (``torch.cuda.mem_get_info``), else the profile's memory (nvidia-smi's or NVML's
        total) less the largest driver reservation seen (:data:`DRIVER_RESERVED_BYTES_MAX`)."""
        if self.torch_capacity_bytes is not None:
            return self.torch_capacity_bytes
        return self.memory_bytes - min(DRIVER_RESERVED_BYTES_MAX, self.memory_bytes // 50)

    @property
    def capacity_spread_bytes(self) -> int:
        """How far below ``capacity_bytes`` the capacity may be on another driver: the profile's
        spread; 0 when derived (the largest reservation seen is already taken off)."""
        return self.torch_capacity_spread_bytes if self.torch_capacity_bytes is not None else 0

    @property
    def capacity_basis(self) -> str:
        """``measured``, ``published`` or ``derived`` (no figure of the profile's own)."""
        return self.torch_capacity_basis if self.torch_capacity_bytes is not None else "derived"

    @property
    def capacity_note(self) -> str:
        """How the capacity was had, in a line."""
        if self.torch_capacity_bytes is not None:
            return self.sources.get("torch_capacity_bytes", self.torch_capacity_basis)
        return (
            f"derived: the profile's memory less {(self.memory_bytes - self.capacity_bytes) // MiB} MiB, the "
            "largest driver reservation seen (881 MiB on an A100 80GB; at most 2% of the memory, as on an RTX 4090)"
        )


class ClusterSpec(BaseModel):
    """How many GPUs, how they are grouped into nodes, and what the nodes offer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus_per_node: int = Field(8, gt=0, le=1024, description="GPUs in one node (the NVLink domain).")
    nodes: int = Field(1, gt=0, le=1_000_000, description="Number of nodes.")
    inter_node_bytes_per_s: BytesPerSecond = Field(
        50e9, description="Network bandwidth per GPU across nodes, per direction (400 Gb/s IB = 50 GB/s)."
    )
    cpu_memory_bytes: Bytes = Field(2 * 2**40, description="Host memory per node, bytes.")
    nvme_bytes: Bytes = Field(8 * 10**12, description="Local NVMe capacity per node, bytes.")
    nvme_bytes_per_s: BytesPerSecond = Field(
        6.9e9,
        description="Local NVMe bandwidth per node, the slower direction (one PCIe 4.0 x4 SSD: Samsung 990 PRO "
        "datasheet, sequential read 7,450 MB/s, write 6,900 MB/s); shared by the node's ranks.",
    )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes
