"""One pipeline rank measured two ways: PyTorch's own schedule on real gloo ranks, and memplan's StageReplay.

``measure`` starts ``pp`` processes (``torch.multiprocessing``, a gloo group of ``pp`` ranks), forked by a
fork server of one thread (never from a pytest-xdist worker, whose other threads' locks a forked child
can find held for ever). Each runs
its chunks of the bundled trainer's model wrapped in ``torch.distributed.pipelining.PipelineStage`` and
stepped by ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (the classes torchtitan maps
``gpipe``, ``1f1b`` and ``interleaved`` to), activations and gradients really sent between the ranks;
then, the group gone, the same chunks (same seeds, same batch) through
``memplan.train.pipeline.StageReplay``, which has no neighbours.

Both sides count live tensor storages with ``StorageTracker`` (a dispatch mode that holds no reference to
any tensor, tests/accuracy/storage_tracker.py), switched on before the chunks' weights exist, over a
warm-up step and a measured step, and record at the entry of every forward and backward a ``Mark``: the
action, the live bytes there and the highest live bytes since the previous mark; and one after the step.
Both hold the step's whole batch (token ids and labels, ``(m b, s)``) as a trainer handing it to
``schedule.step`` does, each micro-batch a view of it.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from memplan.specs.model import ModelSpec
from memplan.train.model import Transformer, loss_fn
from memplan.train.pipeline import StageReplay, chunk_layers, schedule_actions
from tests.accuracy.storage_tracker import StorageTracker

MODEL = ModelSpec(
    name="tiny-pp", hidden_size=64, num_layers=1, num_attention_heads=4, num_kv_heads=2, ffn_size=160, vocab_size=512
)
MICRO_BATCH, SEQ_LEN, SEED = 2, 32, 0
TIMEOUT_S = 120  # a rank left waiting on its neighbour longer fails the run


@dataclass(frozen=True)
class Mark:
    action: str  # "F0.1": forward of local chunk 0, micro-batch 1; "end": after the step
    live: int  # bytes of live storages at the entry of the action
    peak: int  # the highest live bytes since the previous mark


@dataclass(frozen=True)
class Case:
    schedule: str  # memplan's name: gpipe, 1f1b, interleaved
    pp: int
    virtual: int = 1
    microbatches: int = 4

    @property
    def name(self) -> str:
        return f"{self.schedule}-pp{self.pp}" + (f"-v{self.virtual}" if self.virtual > 1 else "")

    @property
    def chunks(self) -> int:
        return self.pp * self.virtual


class Marker:
    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.marks: list[Mark] = []

    def mark(self, action: str) -> None:
        self.marks.append(Mark(action, self.tracker.current, self.tracker.peak))
        self.tracker.reset_peak()

    def start_step(self) -> None:
        self.marks.clear()
        self.tracker.reset_peak()


def build_chunks(case: Case, rank: int) -> list[tuple[int, torch.nn.Module]]:
    """The rank's chunks, one layer each, fp32, weights seeded by global chunk index
    (memplan.train.runner._build_chunks)."""
    spec = MODEL.model_copy(update={"num_layers": case.chunks})
    out = []
    for k, layers in chunk_layers(spec.num_layers, case.pp, case.virtual, rank):
        chunk = Transformer(spec, layers, first=k == 0, last=k == case.chunks - 1)
        chunk.init_weights(SEED + k)
        out.append((k, chunk))
    return out


def full_batch(step: int, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's token ids and pre-shifted labels, ``(m b, s)`` each, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    shape = (case.microbatches * MICRO_BATCH, SEQ_LEN)
    ids = torch.randint(0, MODEL.vocab_size, shape, generator=gen)
    return ids, torch.randint(0, MODEL.vocab_size, shape, generator=gen)


def _schedule(case: Case, stages: list):  # noqa: ANN202 - a torch schedule
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if case.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, case.microbatches, loss_fn=loss_fn)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case.schedule]
    return cls(stages[0], case.microbatches, loss_fn=loss_fn)


def _stage_meta(k: int, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk k's example input and output on the meta device (static metadata: no shape inference)."""
    b, s, h = MICRO_BATCH, SEQ_LEN, MODEL.hidden_size
    with torch.device("meta"):
        x = torch.empty(b, s, dtype=torch.long) if k == 0 else torch.empty(b, s, h, requires_grad=True)
        y = torch.empty(b, s, MODEL.vocab_size if k == case.chunks - 1 else h, requires_grad=True)
    return x, y


def _instrument(stage, c: int, marker: Marker) -> None:  # noqa: ANN001 - a PipelineStage
    """A mark at the entry of each of the stage's forwards and backwards."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(mb: int, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        marker.mark(f"F{c}.{mb}")
        return forward(mb, *args, **kwargs)

    def backward_one_chunk(mb: int, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        marker.mark(f"B{c}.{mb}")
        return backward(mb, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def torch_marks(case: Case, rank: int) -> list[Mark]:
    """The measured step of PyTorch's schedule on this rank (the gloo group is up)."""
    from torch.distributed.pipelining import PipelineStage

    tracker = StorageTracker()
    marker = Marker(tracker)
    with tracker:
        chunks = build_chunks(case, rank)
        for _, chunk in chunks:
            tracker.track_module(chunk)
        cpu = torch.device("cpu")
        stages = [PipelineStage(chunk, k, case.chunks, cpu, *_stage_meta(k, case)) for k, chunk in chunks]
        for c, stage in enumerate(stages):
            _instrument(stage, c, marker)
        schedule = _schedule(case, stages)
        first, last = chunks[0][0] == 0, chunks[-1][0] == case.chunks - 1
        for step in range(2):
            marker.start_step()
            ids, labels = full_batch(step, case)
            schedule.step(*((ids,) if first else ()), target=labels if last else None, return_outputs=False)
            del ids, labels
            marker.mark("end")
            for _, chunk in chunks:
                chunk.zero_grad(set_to_none=True)
    return marker.marks


def replay_marks(case: Case, rank: int) -> list[Mark]:
    """The measured step of StageReplay for the same rank, in this process."""
    tracker = StorageTracker()
    marker = Marker(tracker)
    with tracker:
        chunks = build_chunks(case, rank)
        for _, chunk in chunks:
            tracker.track_module(chunk)
        actions = schedule_actions(case.schedule, case.pp, case.virtual, rank, case.microbatches)
        activation = ((MICRO_BATCH, SEQ_LEN, MODEL.hidden_size), torch.float32)
        replay = StageReplay(
            chunks, case.chunks, actions, case.microbatches, activation, torch.device("cpu"), case.schedule
        )
        for step in range(2):
            marker.start_step()
            names = iter(f"{kind}{c}.{i}" for kind, c, i in actions)
            ids, labels = full_batch(step, case)

            def batch(i: int, want_ids: bool, want_labels: bool, ids=ids, labels=labels) -> tuple:  # noqa: ANN001
                rows = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
                return (ids[rows] if want_ids else None, labels[rows] if want_labels else None)

            def phase(_name: str, names=names) -> None:  # noqa: ANN001
                marker.mark(next(names))

            replay.step(batch, lambda module, x: module(x), loss_fn, phase)
            del ids, labels, batch, phase
            marker.mark("end")
            for _, chunk in chunks:
                chunk.zero_grad(set_to_none=True)
    return marker.marks


def _rank(rank: int, case: Case, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=case.pp, timeout=timeout)
    try:
        measured = torch_marks(case, rank)
    finally:
        dist.destroy_process_group()
    replayed = replay_marks(case, rank)
    result = {"torch": [asdict(m) for m in measured], "replay": [asdict(m) for m in replayed]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def measure(case: Case) -> dict[int, dict[str, list[Mark]]]:
    """{rank: {"torch": marks, "replay": marks}}. The ranks are forked by a fork server that imported
    this module once (``set_forkserver_preload``), so what it imports they need not redo."""
    import torch.multiprocessing as mp

    mp.set_forkserver_preload(["torch", "torch.distributed.pipelining", __name__])
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank, args=(case, os.path.join(tmp, "store"), tmp), nprocs=case.pp, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + 2 * TIMEOUT_S
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{case.name}: the ranks did not finish in {2 * TIMEOUT_S} s")
        out = {}
        for rank in range(case.pp):
            raw = json.loads(Path(tmp, f"rank{rank}.json").read_text())
            out[rank] = {side: [Mark(**m) for m in marks] for side, marks in raw.items()}
        return out
