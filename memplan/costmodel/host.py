"""Host memory: what a plan keeps in the RAM of each node, and whether the node has it.

Three things live in host memory during a step:

- CPU offload of optimizer states and parameters (ZeRO-Offload, ZeRO-Infinity's CPU tier, FSDP2's
  CPUOffloadPolicy): DeepSpeed allocates them pinned (``offload_optimizer.pin_memory`` /
  ``offload_param.pin_memory``, which memplan's DeepSpeed export sets), FSDP2 pins its CPU shards;
- activation offload (TRL's ``OffloadActivations``, ``save_on_cpu(pin_memory=True)``): pinned;
- the part of bitsandbytes' paged optimizer states that does not stay on the device beside the
  step's peak (``optimizer.paged_residency``): pageable, evicted there by the CUDA driver.

``MemoryReport.offload.cpu`` is the first two for the most-loaded rank; a node runs
``gpus_per_node`` ranks, so the node needs that many times it (an upper bound under pipeline
parallelism, whose stages differ). Pinned pages cannot be swapped out: a node without the RAM
fails to pin them (``cudaHostAlloc`` out of memory) or is stopped by the kernel's OOM killer, so a
plan whose host bytes exceed the node's memory does not fit. Nothing here counts the training
process's own host memory (the Python process, the data loader, the checkpoint it loads).

The node's memory is ``--host-memory`` (per node), else, where the GPU was detected on this
machine (``--gpu auto`` found it), this machine's ``MemTotal`` (/proc/meminfo); elsewhere it is
unknown and not checked.
"""

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from memplan.costmodel.optimizer import paged_residency
from memplan.costmodel.report import MemoryReport
from memplan.units import format_bytes

MEMINFO = Path("/proc/meminfo")


class HostMemory(BaseModel):
    """One node's host memory against what the plan keeps there (bytes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    needed_bytes: int  # pinned + paged, for every rank of the node
    pinned_bytes: int  # CPU offload of states and activations, every rank of the node
    paged_bytes: int  # paged optimizer states evicted to the host, every rank of the node
    available_bytes: int | None  # the node's memory; None: unknown (not checked)
    source: str  # where available_bytes comes from: "--host-memory", "MemTotal of this machine", ""
    ranks_per_node: int

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.needed_bytes <= self.available_bytes

    def reason(self) -> str:
        """The refusal, with the figures (empty when it fits)."""
        if self.fits:
            return ""
        per = f" ({self.ranks_per_node} ranks x {format_bytes(self.needed_bytes // self.ranks_per_node, 'GiB')})"
        return (
            f"host memory: the plan keeps {format_bytes(self.needed_bytes, 'GiB')} in each node's RAM"
            f"{per if self.ranks_per_node > 1 else ''} (offloaded states and activations, pinned"
            f"{', and paged optimizer states' if self.paged_bytes else ''}) and the node has "
            f"{format_bytes(self.available_bytes or 0, 'GiB')} ({self.source}): offload to NVMe or less to the CPU"
        )


def mem_total_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemTotal`` of /proc/meminfo in bytes (Linux); None where there is none."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory(
    report: MemoryReport, ranks_per_node: int, headroom_bytes: int, available_bytes: int | None, source: str
) -> HostMemory:
    """What one node keeps in host memory (module docstring) against ``available_bytes``:
    ``ranks_per_node x (offload.cpu + paged states beyond the device's headroom)``."""
    _, paged_host = paged_residency(report.paged_optimizer_states, headroom_bytes)
    pinned, paged = ranks_per_node * report.offload.cpu, ranks_per_node * paged_host
    return HostMemory(
        needed_bytes=pinned + paged,
        pinned_bytes=pinned,
        paged_bytes=paged,
        available_bytes=available_bytes,
        source=source if available_bytes is not None else "",
        ranks_per_node=ranks_per_node,
    )
