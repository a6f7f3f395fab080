"""The op-level run's steady-step peaks as a CPU run of the bundled trainer measures them: what
tests/unit/test_timeline_recompute.py and test_timeline_pipeline.py compare with the trainer."""

from __future__ import annotations

from memplan.costmodel.timeline.cpu import cuda_only, cuda_temporaries
from memplan.costmodel.timeline.events import ALLOC, FREE, MARK, Category, Timeline

# CUDA's kernels' temporaries, which the CPU comparisons leave out (``timeline.cpu``: the same set
# the CPU estimate's view of the run leaves out)
CUDA_TEMPORARIES = cuda_temporaries()


def _cuda_only(tag: str) -> bool:
    return cuda_only(tag, CUDA_TEMPORARIES)


def steady_peaks(timeline: Timeline | None) -> tuple[int, int]:
    """The run's highest live bytes over the steady steps, and outside the optimizer step (the
    forward's and backward's: the live bytes when an optimizer temporary is allocated do not
    count), CUDA's allocations left out: cuBLAS's workspaces, the embedding backward's index
    buffers and the kernels' temporaries (:data:`CUDA_TEMPORARIES`)."""
    assert timeline is not None
    live = best = passes = 0
    steady = False
    for e in timeline:
        if e.op == MARK:
            steady = steady or e.tag == "step0"
        elif _cuda_only(e.tag):
            continue
        elif e.op == ALLOC:
            live += e.size
            best = max(best, live) if steady else best
            if steady and e.category != Category.OPTIMIZER_TEMP:
                passes = max(passes, live)
        elif e.op == FREE:
            live -= e.size
    return best, passes


CPU_BOUND = 0.0001  # 0.01% of the trainer's peak, as test_timeline_recompute.py


def trainer_record(model, workload, plan, rank: int = 0, math: bool = False):  # noqa: ANN001, ANN201 - a RunRecord
    """The bundled trainer on CPU, rank ``rank``, two measured steps; with ``math`` on SDPA's math
    backend (CUDA's kernel for fp32 with GQA, where CPU would take its flash kernel)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memplan.train.runner import run
    from memplan.validate.spec import RunSpec

    with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
        record = run(RunSpec(model=model, workload=workload, plan=plan, rank=rank, steps=2))
    assert record.status == "ok", record.reason
    return record


def measured_peaks(record) -> tuple[int, int]:  # noqa: ANN001 - a RunRecord
    """The meter's steady peak, and the higher of the forward's and backward's."""
    return record.peak_allocated, max(record.phases[p].allocated for p in ("forward", "backward"))


def assert_peaks(name: str, predicted: tuple[int, int], measured: tuple[int, int]) -> None:
    """The run's (step, forward and backward) peaks within :data:`CPU_BOUND` of the trainer's."""
    for what, want, got in zip(("step", "forward and backward"), predicted, measured, strict=True):
        assert abs(want / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {want:,}, measured {got:,}"


def assert_the_trainer_peaks_where_the_run_does(name: str, model, workload, plan):  # noqa: ANN001, ANN201
    """The bundled trainer on CPU (rank 0, two measured steps) against the op-level run the estimate
    replays: the step's steady peak and the forward's and backward's, each within :data:`CPU_BOUND`;
    the trainer's record."""
    from memplan.costmodel.timeline.support import supported
    from memplan.costmodel.timeline.trainer import MICRO_BATCHES_MODELLED, trainer_run

    assert supported(model, workload, plan) is None
    peaks = steady_peaks(trainer_run(model, workload, plan, max_micro_batches=MICRO_BATCHES_MODELLED))
    record = trainer_record(model, workload, plan)
    assert_peaks(name, peaks, measured_peaks(record))
    return record


def ddp_broadcast_flats(model, plan) -> list[tuple[str, int]]:  # noqa: ANN001 - a ModelSpec and a Plan
    """(dtype, bytes) of the flat buffers the real ``DistributedDataParallel`` allocates as the bundled
    trainer wraps ``model`` (``parallel.apply_ddp``, fake process group, on CPU): ``_sync_module_states``'
    ``broadcast_coalesced`` buckets, then the reducer's, each ``cat`` / ``empty`` of more than one
    element seen at the dispatcher, int64 index buffers left out."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from memplan.train import lora, parallel
    from memplan.train.model import Transformer

    seen: list[tuple[str, int]] = []

    class Flats(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.cat.default, torch.ops.aten.empty.memory_format) and out.numel() > 1:
                seen.append((str(out.dtype), out.untyped_storage().nbytes()))
            return out

    dist.init_process_group("fake", rank=0, world_size=plan.dp, store=FakeStore())
    try:
        with torch.device("meta"):
            module = Transformer(model, list(range(model.num_layers)), first=True, last=True).to(torch.bfloat16)
        lora.apply_lora(module, plan)
        module.to_empty(device="cpu")
        module.init_weights(0)
        lora.init_adapters(module)
        with Flats():
            parallel.apply_ddp(module, parallel.build_meshes(plan, "cpu").dp)
    finally:
        dist.destroy_process_group()
    return [(dtype, size) for dtype, size in seen if dtype != "torch.int64"]
