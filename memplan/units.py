"""Human units at the edges: parse ``80GiB``, ``3.35TB/s``, ``989TFLOPS``; render bytes.

Inside memplan every size is an ``int`` of bytes (and rates are per second); GiB (2**30)
and GB (10**9) are kept apart explicitly, as in the IEC / SI prefixes.
"""

from __future__ import annotations

import math
import re

_SI = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_QUANTITY = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
    r"(?P<prefix>Ki|Mi|Gi|Ti|Pi|K|k|M|G|T|P)?\s*(?P<unit>B|FLOPS|FLOP/s)?(?P<rate>/s)?\s*$"
)


def parse_quantity(value: object, unit: str = "B") -> float:
    """Parse a number or a string such as ``80GiB``, ``3.35TB/s`` or ``989.4TFLOPS``.

    ``unit`` is the unit the caller expects ("B" for bytes and bytes/s, "FLOPS" for FLOP/s);
    a string with another unit is rejected. Plain numbers pass through unchanged.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a quantity in {unit}, got a boolean")
    if isinstance(value, int | float):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a number or a string such as '80GiB', got {value!r}")
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(f"cannot read {value!r} as a quantity in {unit}")
    found_unit = match["unit"] or ""
    if found_unit == "FLOP/s":
        found_unit = "FLOPS"
    if found_unit and found_unit != unit:
        raise ValueError(f"{value!r} is in {found_unit}, expected {unit}")
    prefix = match["prefix"] or ""
    scale = _IEC[prefix] if prefix in _IEC else _SI[prefix.upper()]
    return float(match["num"]) * scale


def parse_bytes(value: object) -> int:
    """Bytes as an int: ``parse_bytes('80GiB') == 85899345920``, ``parse_bytes('1GB') == 10**9``;
    a size that is not finite (``1e400GiB``, ``inf``) is a ValueError like any other bad size."""
    quantity = parse_quantity(value, "B")
    if not math.isfinite(quantity):
        raise ValueError(f"{value!r} is not a finite size")
    return int(round(quantity))


def format_bytes(n_bytes: float, unit: str = "GiB") -> str:
    """Render bytes in one explicit unit (GiB by default, never an ambiguous 'GB')."""
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "GB": 10**9}[unit]
    digits = 0 if unit == "B" else 2
    return f"{n_bytes / scale:,.{digits}f} {unit}"
