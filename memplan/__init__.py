"""memplan: per-GPU memory of LLM training and inference, and the fastest plan that fits.

The public Python API (README, "Using it from Python"): :func:`estimate` and :func:`tune` return
the frozen results ``memplan estimate`` and ``memplan tune`` print as JSON (:class:`EstimateResult`,
:class:`TuneResult`); bad input raises :class:`MemplanError`. The names in ``__all__`` and the
results' keys are stable: added to, never renamed. They are imported on first use, so that
``import memplan`` loads neither pydantic's models nor torch or optuna.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["EstimateResult", "MemplanError", "TuneResult", "estimate", "tune"]

# each public name and the module that defines it, imported when the name is first asked for
_LAZY = {
    "EstimateResult": "memplan.estimation",
    "MemplanError": "memplan.errors",
    "TuneResult": "memplan.search.tuning",
    "estimate": "memplan.api",
    "tune": "memplan.api",
}

if TYPE_CHECKING:
    from memplan.api import estimate, tune
    from memplan.errors import MemplanError
    from memplan.estimation import EstimateResult
    from memplan.search.tuning import TuneResult


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
