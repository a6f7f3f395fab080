"""Run one rank of a plan for a few steps and measure it: the heart of ``memplan validate``.

One process runs one rank. Under rank simulation the process group is PyTorch's fake one at
the plan's world size (collectives allocate their buffers but move nothing), so one device
holds exactly what that rank of the real job holds. Otherwise the process joins a real group
set up by torchrun's environment (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from memplan.train import lora
from memplan.train import parallel as par
from memplan.train.model import Transformer, loss_fn
from memplan.train.offload import EmulatedSaveOnCpu, offload_context
from memplan.train.pipeline import StageReplay, chunk_layers, schedule_actions
from memplan.train.tracker import PhaseMeter
from memplan.validate.record import OutOfMemory, PhaseRecord, RunRecord
from memplan.validate.spec import RunSpec
from memplan.validate.support import TrainerUnsupported, check_model, check_workload

Progress = Callable[[int, int], None]


class SimulatedOutOfMemory(RuntimeError):
    """The tracked bytes went over ``--memory-limit`` (a device of that capacity would OOM)."""

    def __init__(self, requested: int, limit: int) -> None:
        super().__init__(f"out of memory: {requested} bytes allocated exceeds the {limit}-byte limit")
        self.requested = requested


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import triton

        out["triton"] = triton.__version__
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


def _forget_dtensor_caches() -> None:
    """Drop DTensor's caches of sharding plans when a run's process groups go away.

    A ``DeviceMesh`` compares equal to any mesh of the same layout, world and dim names, so a
    later run in the same process (rank simulation runs one plan after another) would reuse a
    cached redistribute plan that names the destroyed groups ("Could not resolve the process
    group registered under the name ...")."""
    from torch.distributed.tensor import _redistribute as redistribute
    from torch.distributed.tensor import debug

    debug._clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    redistribute.clear_redistribute_planner_cache()
    redistribute._gen_transform_infos.cache_clear()


def _init_process_group(spec: RunSpec, device: torch.device) -> tuple[int, bool]:
    """Returns (rank, simulated)."""
    world = spec.plan.world_size
    if spec.simulate or world == 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=spec.rank, world_size=world, store=FakeStore())
        return spec.rank, world > 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=_dt.timedelta(seconds=spec.collective_timeout_s))
    return dist.get_rank(), False


def _device(spec: RunSpec) -> torch.device:
    if spec.device == "cuda":
        import os

        index = int(os.environ.get("LOCAL_RANK", "0")) if not spec.simulate else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _build_chunks(
    spec: RunSpec, meshes: par.Meshes, stage: int, device: torch.device
) -> list[tuple[int, torch.nn.Module]]:
    plan, model = spec.plan, spec.model
    dtype = par.param_dtype(plan)
    n_chunks = plan.stages
    out = []
    for k, layer_ids in chunk_layers(model.num_layers, plan.pp, plan.virtual_stages, stage):
        with torch.device("meta"):
            chunk = Transformer(
                model, layer_ids, first=k == 0, last=k == n_chunks - 1, attention_impl=plan.attention
            ).to(dtype)
        if plan.tp > 1:
            par.apply_tp(chunk, meshes.tp, plan.sequence_parallel)
        if plan.finetune != "full":
            lora.apply_lora(chunk, plan)
        par.apply_recompute(chunk, plan)
        if par.uses_fsdp(plan):
            par.apply_fsdp(chunk, plan, meshes.dp)
        chunk.to_empty(device=torch.device("cpu") if plan.offload_params == "cpu" else device)
        if not par.uses_fsdp(plan):  # FSDP2 keeps one sharded parameter for a tied pair
            chunk.tie_weights()
        chunk.init_weights(spec.seed + k)
        lora.init_adapters(chunk)
        if plan.zero < 2 and plan.dp > 1:
            chunk = par.apply_ddp(chunk, meshes.dp)
        out.append((k, chunk))
    return out


def _train(spec: RunSpec, device: torch.device, rank: int, progress: Progress | None, box: dict) -> list[float]:
    """Run warm-up and measured steps; the meter goes into ``box`` as soon as it exists, so
    an out-of-memory error still finds the peaks measured so far. Returns the step times."""
    plan = spec.plan
    meshes = par.build_meshes(plan, device.type)
    stage = spec.stage_of(rank)
    chunks = _build_chunks(spec, meshes, stage, device)
    params = lora.trainable([p for _, m in chunks for p in m.parameters()])
    container = torch.nn.ModuleList([m for _, m in chunks])
    optimizer = par.build_optimizer_from(params, plan, meshes.dp.get_group() if plan.dp > 1 else None)
    fsdp = par.uses_fsdp(plan) and len(chunks) == 1
    meter = PhaseMeter(
        chunks[0][1] if fsdp else container, optimizer, device, fsdp, plan.offload_params == "cpu", spec.memory_limit
    )
    box["meter"] = meter
    b, s, vocab = spec.workload.micro_batch, spec.workload.seq_len, spec.model.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if par.uses_autocast(plan) else contextlib.nullcontext()
    )

    def loss_context():  # noqa: ANN202
        if plan.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def batch(i: int, ids: bool = True, labels: bool = True) -> tuple:
        """Synthetic token ids (first chunk) and pre-shifted labels (last chunk)."""
        x = torch.randint(0, vocab, (b, s), generator=gen).to(device) if ids else None
        y = torch.randint(0, vocab, (b, s), generator=gen).to(device) if labels else None
        return x, y

    offload = offload_context(device) if plan.offload_activations == "cpu" else contextlib.nullcontext()
    box["offload"] = offload

    def forward_of(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with offload, autocast:  # the forward's saved tensors (memplan.train.offload)
            return module(x)

    def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with offload:  # the loss's saved tensors
            return loss_fn(logits, labels)

    m = spec.accumulation
    replay = None
    if plan.pp > 1:
        actions = schedule_actions(plan.pp_schedule, plan.pp, plan.virtual_stages, stage, m)
        s_local = s // plan.tp if plan.sequence_parallel and plan.tp > 1 else s
        dtype = par.compute_dtype(plan) if not par.uses_autocast(plan) else torch.float32
        replay = StageReplay(
            chunks, plan.stages, actions, m, ((b, s_local, spec.model.hidden_size), dtype), device, plan.pp_schedule
        )
    model = chunks[0][1]
    times: list[float] = []
    total_steps = spec.warmup + spec.steps
    with meter, loss_context():
        for step in range(total_steps):
            measured = step >= spec.warmup

            def phase(name: str | None, measured: bool = measured) -> None:
                meter.set_phase(name, measured)

            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            if replay is not None:
                replay.step(batch, forward_of, loss_of, phase)
            else:
                for i in range(m):
                    sync = contextlib.nullcontext()
                    if i < m - 1 and hasattr(model, "no_sync"):
                        sync = model.no_sync()
                    with sync:
                        phase("forward")
                        ids, labels = batch(i)
                        loss = loss_of(forward_of(model, ids), labels) / m
                        phase("backward")
                        loss.backward()
                        del loss
            phase("optimizer")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            phase(None)
            meter.end_step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if measured:
                times.append(time.perf_counter() - start)
            if progress is not None:
                progress(step + 1, total_steps)
    return times


_REQUESTED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _requested_bytes(message: str) -> int | None:
    match = _REQUESTED.search(message)
    return int(float(match.group(1)) * _UNIT[match.group(2)]) if match else None


def _phases(meter: PhaseMeter) -> dict[str, PhaseRecord]:
    return {
        name: PhaseRecord(allocated=p.allocated, reserved=p.reserved, categories=p.categories)
        for name, p in meter.peaks.items()
    }


def _nvml_used(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # noqa: BLE001 - NVML is optional; the record says None
        return None


def run(spec: RunSpec, progress: Progress | None = None) -> RunRecord:
    """Build, run and measure one rank; every outcome is a record, never an exception."""
    started = _now()
    device = torch.device(spec.device)
    fields: dict = dict(
        spec.record_fields(),
        device_name=torch.cuda.get_device_name() if spec.device == "cuda" else platform.processor() or "cpu",
        versions=versions(),
        started=started,
    )
    box: dict = {}
    try:
        check_model(spec.model)
        par.check_plan(spec.plan)
        check_workload(spec)
        device = _device(spec)
        rank, simulated = _init_process_group(spec, device)
        fields.update(spec.record_fields(rank, simulated))
        times = _train(spec, device, rank, progress, box)
    except TrainerUnsupported as err:
        return RunRecord(status="unsupported", reason=str(err), finished=_now(), **fields)
    except (torch.OutOfMemoryError, SimulatedOutOfMemory) as err:
        meter = box.get("meter")
        message = str(err).splitlines()[0]
        requested = err.requested if isinstance(err, SimulatedOutOfMemory) else _requested_bytes(str(err))
        peaks = _phases(meter) if meter else {}
        peak = max((p.allocated for p in peaks.values()), default=0)
        phase, step = (meter.failed_in if meter else None) or ("setup", None)
        oom = OutOfMemory(
            phase=phase,
            step=step,
            warmup=None if step is None else step <= spec.warmup,
            requested_bytes=requested,
            peak_bytes=peak,
            message=message,
        )
        return RunRecord(status="oom", reason=message, oom=oom, phases=peaks, finished=_now(), **fields)
    except Exception as err:  # noqa: BLE001 - recorded
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return RunRecord(status="error", reason=reason, finished=_now(), **fields)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_dtensor_caches()
    phases = _phases(box["meter"])
    offload = box.get("offload")
    host = offload.host_peak if isinstance(offload, EmulatedSaveOnCpu) else None
    peak_phase = max(phases, key=lambda k: phases[k].allocated) if phases else None
    step_time = statistics.median(times) if times else None
    tokens = spec.workload.micro_batch * spec.workload.seq_len * spec.accumulation
    tokens_per_s = tokens / step_time if step_time else None
    mfu = None
    if step_time and spec.peak_flops and not fields["simulated"]:
        mfu = spec.flops_per_step / step_time / spec.peak_flops
    return RunRecord(
        status="ok",
        phases=phases,
        peak_allocated=phases[peak_phase].allocated if peak_phase else None,
        peak_reserved=phases[peak_phase].reserved if peak_phase else None,
        peak_phase=peak_phase,
        nvml_used_bytes=_nvml_used(device),
        offload_host_bytes=host,
        step_times_s=times,
        step_time_s=step_time,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        finished=_now(),
        **fields,
    )
