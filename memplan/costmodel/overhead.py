"""Memory outside the caching allocator, and the search's fast form of reserved memory.

``peak.reserved`` is what the allocator model holds when it replays the step (``reserve.py``);
what a process holds outside the allocator is subtracted from the capacity PyTorch sees. That
is what the out-of-memory message calls non-PyTorch memory ("this process has X in use" less
PyTorch's reserved bytes), and it is made of:

- **the CUDA context and the kernels' modules** the process loaded (PyTorch's, cuBLAS's,
  cuDNN's, Triton's, bitsandbytes'; CUDA loads modules lazily, so it grows with the kernels a
  run calls). Measured per torch version: ``CONTEXT_BY_TORCH``.
- **NCCL communicators**: each process group of more than one real rank holds one, with its
  buffers in device memory allocated by NCCL, not by PyTorch (the reference's "each NCCL
  communicator ~0.5 GB or more": ../shared/reference/published-figures.md, "Terms that
  estimators often miss"). Not yet measured here. A rank simulated under the fake process group
  (``memplan validate``'s default) starts none.

Not outside: cuBLAS's and cuBLASLt's workspaces. PyTorch allocates them through the caching
allocator (aten/src/ATen/cuda/CublasHandlePool.cpp keeps each handle's workspace as an
``at::DataPtr`` from ``CUDACachingAllocator``), so they are in ``peak.reserved``: the op-level
run allocates them (``timeline/trainer.py``, ``cublas_workspace.*``). cuDNN's attention and
convolution workspaces are tensors PyTorch allocates (``at::empty``) for the call, inside the
allocator too; what cuDNN's and cuBLAS's libraries load as kernels is in the context figure.
"""

from __future__ import annotations

from functools import lru_cache

MiB = 2**20
GiB = 2**30
NCCL_COMMUNICATOR_BYTES = 512 * MiB
ALLOCATOR_SLACK = 0.07  # midpoint-ish of the 1.05-1.10x reserved/allocated range
SEGMENT_BYTES = 2 * MiB
# cuBLAS's workspace per handle and stream without CUBLAS_WORKSPACE_CONFIG: 4096 * 8 * 1024 B on
# compute capability 9 and later (aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize's
# default); the op-level run's ``timeline.trainer.CUBLAS_WORKSPACE`` (tests/search/test_fast_form_grid.py)
CUBLAS_WORKSPACE_BYTES = 32 * MiB


def cublas_workspaces(runtime: str, device: str) -> int:
    """The bytes of cuBLAS's workspaces a training step of the bundled trainer holds on CUDA: the
    forward thread's and the autograd thread's (each its own handle), allocated through the caching
    allocator at each thread's first matmul and never freed (``CublasHandlePool.cpp`` keeps them per
    handle and stream), so beside every phase of the steady steps. The op-level run allocates them
    (``timeline/trainer.py``, ``cublas_workspace.forward`` / ``.backward``); the phase model's sums
    (``memory._stage_phases``) count them for that runtime, where they were the run's largest term
    they lacked (docs/cost-model.md, "The search's fast form against the run"). 0 on CPU."""
    return 2 * CUBLAS_WORKSPACE_BYTES if runtime == "memplan" and device == "cuda" else 0


class ContextFigure:
    """The CUDA context and modules one process held, as measured: the lowest and highest seen.

    A plain class, as :class:`Outside`: a frozen dataclass costs ~3.7 M instructions to build,
    on ``memplan estimate``'s cold start (benchmarks/bench_estimate.py --instructions)."""

    __slots__ = ("low_bytes", "high_bytes", "source")

    def __init__(self, low_bytes: int, high_bytes: int, source: str) -> None:
        self.low_bytes, self.high_bytes, self.source = low_bytes, high_bytes, source


def _gib2(x: float) -> int:
    """A figure printed in GiB with two decimals, as bytes."""
    return round(x * GiB)


CONTEXT_BY_TORCH: dict[str, ContextFigure] = {
    "2.11": ContextFigure(
        _gib2(0.73),
        _gib2(0.81),
        "measured: non-PyTorch memory in four out-of-memory messages of one process with no NCCL, torch "
        "2.11.0+cu130, driver 580: 0.75, 0.81 and 0.73 GiB on an H200 (2026-11-27), 0.73 GiB on an H100 80GB "
        "HBM3 (2026-11-22) (../shared/gpu-traces/README.md)",
    ),
}
MEASURED_TORCH = "2.11"  # the version whose figure a plan gets when the torch it runs is not given


class Outside:
    """What one rank holds outside the allocator: its total is ``MemoryReport.overhead``.

    ``cuda_context`` is the highest figure measured (so that "fits" holds on every run seen);
    ``spread`` is how far the measured figures went below it (what the tight band adds)."""

    __slots__ = ("cuda_context", "nccl", "communicators", "torch_version", "spread", "source")

    def __init__(
        self, cuda_context: int, nccl: int, communicators: int, torch_version: str, spread: int, source: str
    ) -> None:
        self.cuda_context, self.nccl, self.communicators = cuda_context, nccl, communicators
        self.torch_version, self.spread, self.source = torch_version, spread, source

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl

    def detail(self) -> dict[str, int | str]:
        """As ``MemoryReport.outside`` carries it."""
        return {name: getattr(self, name) for name in self.__slots__}


def communicators(dp: int, tp: int, pp: int, cp: int, ep: int) -> int:
    """Process groups with more than one rank each hold an NCCL communicator."""
    return (dp > 1) + (tp > 1) + (pp > 1) + (cp > 1) + (ep > 1)


def context_figure(torch_version: str | None = None) -> tuple[str, ContextFigure]:
    """The measured CUDA context of ``torch_version`` (``"2.11"`` or ``"2.11.0+cu130"``), else the
    nearest measured version's (said in the source); ``None``: the measured version."""
    minor = ".".join((torch_version or MEASURED_TORCH).split("+")[0].split(".")[:2])
    if minor in CONTEXT_BY_TORCH:
        return minor, CONTEXT_BY_TORCH[minor]

    def distance(v: str) -> tuple[int, ...]:
        try:
            return tuple(abs(int(a) - int(b)) for a, b in zip(v.split("."), minor.split("."), strict=False))
        except ValueError:
            return (0,)

    nearest = min(CONTEXT_BY_TORCH, key=distance)
    fig = CONTEXT_BY_TORCH[nearest]
    note = f"torch {minor} not measured: torch {nearest}'s figure, {fig.source}"
    return minor, ContextFigure(fig.low_bytes, fig.high_bytes, note)


def outside_memory(n_communicators: int, torch_version: str | None = None) -> Outside:
    """The CUDA context and modules (measured per torch version) plus ``n_communicators`` NCCL
    communicators (the reference's 512 MiB each)."""
    version, fig = context_figure(torch_version)
    nccl = n_communicators * NCCL_COMMUNICATOR_BYTES
    source = fig.source
    if n_communicators:
        source += f"; {n_communicators} NCCL communicator(s) at 512 MiB each (reference figure, not measured here)"
    return Outside(fig.high_bytes, nccl, n_communicators, version, fig.high_bytes - fig.low_bytes, source)


@lru_cache(maxsize=64)  # the search asks for it once per plan, with a handful of distinct arguments
def fixed_overhead_bytes(n_communicators: int, torch_version: str | None = None) -> int:
    """Bytes outside the allocator: :func:`outside_memory`'s total."""
    return outside_memory(n_communicators, torch_version).total


def fast_reserved_bytes(allocated: int) -> int:
    """The search's screen: allocated x (1 + slack), rounded up to 2 MiB segments. Plans
    that are reported are replayed through the allocator model instead (``reserve.py``)."""
    with_slack = int(allocated * (1 + ALLOCATOR_SLACK))
    segments = -(-with_slack // SEGMENT_BYTES)
    return segments * SEGMENT_BYTES
