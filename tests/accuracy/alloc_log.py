"""StorageTracker that also logs each storage's size and the op that created it, in order.

A tool to read a real run's allocation sequence against the op-level run's (issue 28): each
event is ``("+", bytes, op)`` when an op's output creates a storage and ``("-", bytes, op)`` when
that storage is finalised. Like :class:`StorageTracker` it holds no reference to any tensor.

    python tests/accuracy/alloc_log.py trainer-llama-fp32-mha   # prints the sequence of one case
"""

from __future__ import annotations

import sys
import weakref

import torch
from storage_tracker import StorageTracker


class AllocLog(StorageTracker):
    """:class:`StorageTracker` with ``events``: (sign, bytes, op name, live bytes after)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, str, int]] = []
        self._op = "track"
        self._names: dict[int, str] = {}

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._live or size == 0:
            return
        self._live[key] = size
        self._names[key] = self._op
        self.current += size
        self.peak = max(self.peak, self.current)
        self.events.append(("+", size, self._op, self.current))
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        size = self._live.pop(key, 0)
        self.current -= size
        self.events.append(("-", size, self._names.pop(key, "?"), self.current))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._op = str(func.__name__)
        return super().__torch_dispatch__(func, types, args, kwargs)


def main(name: str) -> None:
    import hf_steps

    case = next(c for c in hf_steps.CASES if c.name == name)
    log = AllocLog()
    hf_steps.StorageTracker = lambda: log  # the harness builds its tracker by this name
    peak = hf_steps.measure_peak(case)
    for i, (sign, size, op, live) in enumerate(log.events):
        print(f"{i:6d} {sign} {size:12d} {op:40s} {live:12d}")
    print("peak", peak)


if __name__ == "__main__":
    main(sys.argv[1])
