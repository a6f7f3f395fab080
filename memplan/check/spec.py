"""The budgets file ``memplan check`` reads, its budgets and thresholds, and the baseline file.

Sizes say their unit: ``80GB`` is 80 x 10^9 bytes (SI, as GPU datasheets print), ``80GiB`` is
80 x 2^30 bytes (IEC, what ``nvidia-smi`` and PyTorch's allocator count in); a size without the
``B`` (``80G``, ``80``) is refused rather than guessed. A plain YAML integer is bytes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt

from memplan.specs.job import AllocatorName, RuntimeName
from memplan.units import parse_quantity

Metric = Literal["reserved", "allocated"]
_HAS_UNIT = re.compile(r"^\s*[0-9.eE+-]+\s*(Ki|Mi|Gi|Ti|Pi|K|k|M|G|T|P)?B\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
MAX_SIZE = 2**50  # 1 PiB: no GPU's memory comes near; a larger budget is a typo (1e30GiB)
UNITS_HINT = "write bytes with their unit: 80GiB = 80 x 2^30 bytes, 80GB = 80 x 10^9 bytes"


def parse_size(value: object) -> int:
    """Bytes from ``"80GiB"``, ``"80GB"``, ``"512 MiB"`` or a plain integer of bytes; > 0."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a size such as '70GiB', got {value!r}")
    given = value
    if isinstance(value, str):
        if not _HAS_UNIT.match(value):
            raise ValueError(f"cannot read {value!r} as a size: {UNITS_HINT}")
        try:
            value = int(round(parse_quantity(value, "B")))
        except (ValueError, OverflowError):
            raise ValueError(f"cannot read {value!r} as a size: {UNITS_HINT}") from None
    if value <= 0:
        raise ValueError(f"a size must be positive, got {value}")
    if value > MAX_SIZE:
        raise ValueError(f"{given!r} is beyond any GPU's memory (a size here is at most 1 PiB)")
    return value


def parse_share(value: object) -> float | int:
    """``"10%"`` as the fraction 0.10, or a size as bytes (int)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        match = _PERCENT.match(value)
        if match is None:
            try:
                float(value.strip()[:-1])
            except ValueError:
                raise ValueError(f"cannot read {value!r} as a percentage (write e.g. '2%')") from None
        share = float(match[1]) / 100 if match else float(value.strip()[:-1]) / 100
        if not 0 <= share < 1:
            raise ValueError(f"a percentage must be at least 0% and below 100%, got {value!r}")
        return share
    if isinstance(value, float):
        raise ValueError(f"write a share as a percentage ('10%') or a size ('4GiB'), got {value!r}")
    if value == 0 and not isinstance(value, bool):
        return 0
    return parse_size(value)


Share = Annotated[float | int, BeforeValidator(parse_share)]


class Budget(BaseModel):
    """Either a fixed limit (``bytes``) or "fits on the GPU with ``headroom`` to spare"
    (the limit is then capacity minus headroom; headroom a share of capacity or bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bytes: StrictInt | None = Field(None, gt=0, description="A fixed limit in bytes.")
    headroom: float | int | None = Field(None, ge=0, description="Fits with this to spare: a share or bytes.")
    tight: bool | None = Field(
        None,
        description="false: fail when the estimate fits only within the tight band (less headroom than the "
        "model's measured error for the plan); None or true: a tight fit passes.",
    )

    def limit(self, capacity_bytes: int) -> int:
        if self.bytes is not None:
            return self.bytes
        spare = self.headroom or 0
        return capacity_bytes - (int(capacity_bytes * spare) if isinstance(spare, float) else spare)

    def describe(self) -> str:
        if self.bytes is not None:
            return "limit"
        spare = self.headroom or 0
        text = f"fits, {spare:.0%} headroom" if isinstance(spare, float) else "fits, headroom"
        return text + (", not tight" if self.tight is False else "")


def parse_budget(value: object) -> dict[str, Any]:
    """``"70GiB"`` / bytes -> a fixed limit; ``{fits: true, headroom: "10%" | "4GiB"}`` -> fits;
    ``tight: false`` beside them fails a fit within the tight band."""
    if not isinstance(value, dict):
        return {"bytes": parse_size(value)}
    unknown = sorted(set(value) - {"fits", "headroom", "tight"})
    if unknown:
        raise ValueError(
            f"{unknown[0]}: unknown field (a budget is a size, or fits: true with a headroom and tight: false)"
        )
    if value.get("fits") is not True:
        raise ValueError("fits: a budget mapping says fits: true (a size such as '70GiB' is a fixed limit)")
    tight = value.get("tight")
    if tight is not None and not isinstance(tight, bool):
        raise ValueError(f"tight: {tight!r} is not true or false (false: fail a fit within the tight band)")
    try:
        return {"headroom": parse_share(value.get("headroom", 0)), "tight": tight}
    except ValueError as err:
        raise ValueError(f"headroom: {err}") from None


class Entry(BaseModel):
    """One configuration under a budget: a model, workload, plan and GPU, as in a plan file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Unique; the key of the baseline and the JUnit test name.")
    model: str = Field(description="Bundled profile, memplan model YAML or HF config.json (relative to the file).")
    gpu: str | None = Field(None, description="GPU profile name or YAML (default h100-sxm).")
    gpus: StrictInt | None = Field(None, gt=0, le=10_000_000)
    nodes: StrictInt | None = Field(None, gt=0, le=1_000_000)
    runtime: RuntimeName | None = None
    allocator: AllocatorName | None = Field(
        None, description="CUDA caching allocator: default or expandable (else memplan check --allocator)."
    )
    workload: dict | None = Field(None, description="Training or inference workload fields, as in a plan file.")
    plan: dict | None = Field(None, description="Plan fields, as in a plan file.")
    budget: Annotated[Budget, BeforeValidator(parse_budget)] = Field(
        description="A size ('70GiB', '75GB', bytes) or {fits: true, headroom: '10%' or '4GiB', tight: false}."
    )
    metric: Metric | None = Field(None, description="Overrides the file's metric for this entry.")


class BudgetsFile(BaseModel):
    """``memplan check``'s input: entries, the metric compared, the regression threshold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: Metric = Field("reserved", description="reserved (must stay under capacity) or allocated.")
    threshold: Share = Field(0.02, description="A regression: above the baseline by this share ('2%') or size.")
    entries: list[Entry] = Field(min_length=1)


class BaselineEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: Metric
    bytes: StrictInt = Field(ge=0)
    measured: StrictBool = False


class Baseline(BaseModel):
    """The last accepted numbers, by entry name (``--update-baseline`` writes it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    entries: dict[str, BaselineEntry]
