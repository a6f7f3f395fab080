"""Option parsing shared by the commands that run the bundled trainer (validate, tune, check)."""

from __future__ import annotations

from memplan.errors import MemplanError
from memplan.specs.resolve import CLI
from memplan.units import parse_bytes


def auto_device(requested: str, needs: str, field: str) -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``, for ``auto``; torch is imported only here.
    ``needs`` names what wants torch, for the error where the train extra is missing."""
    if requested != "auto":
        return requested
    try:
        import torch
    except ImportError:  # pragma: no cover - the train extra brings torch
        raise MemplanError(
            f"{needs} needs the train extra: pip install 'memplan[train]'", source=CLI, field=field
        ) from None
    return "cuda" if torch.cuda.is_available() else "cpu"


def memory_limit_bytes(text: str | None) -> int | None:
    """``--memory-limit`` (e.g. ``2GiB``) in bytes; None when not given."""
    if text is None:
        return None
    try:
        limit = parse_bytes(text)
    except ValueError as err:
        raise MemplanError(str(err), source=CLI, field="--memory-limit") from None
    if limit <= 0:
        raise MemplanError("must be a positive size, e.g. 2GiB", source=CLI, field="--memory-limit")
    return limit


def name_list(text: str | None, field: str) -> tuple[str, ...] | None:
    """A comma-separated flag value (``--lora-targets q_proj,v_proj``) as a tuple; None when not given."""
    if text is None:
        return None
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise MemplanError("an empty name in the list (write names separated by commas)", source=CLI, field=field)
    return names
