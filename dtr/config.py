"""Parsing of user-facing settings: budgets in bytes or with units, and ``dtr.budget`` options."""

from __future__ import annotations

import math
import re
from typing import Optional, Union

__all__ = ["parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: Union[int, str, None], what: str = "budget") -> Optional[int]:
    """Bytes from an int, a string with SI (kB, MB, GB, TB) or IEC (KiB, MiB, GiB, TiB) units,
    or None (no limit). Units are case-insensitive; a fractional result is rounded down.

    >>> parse_bytes("1.5 GiB")
    1610612736
    >>> parse_bytes("800MB")
    800000000
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"dtr: {what} must be bytes (int), a size string or None, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"dtr: {what} must not be negative, got {value!r}")
        return value
    if isinstance(value, str):
        m = _PATTERN.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"dtr: cannot read {what} {value!r}; write bytes or a number with a unit, "
                "e.g. '800MB', '1.5 GiB', '512 KiB'"
            )
        n = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(n):
            raise ValueError(f"dtr: {what} {value!r} is not finite")
        return int(n)
    raise ValueError(
        f"dtr: {what} must be bytes (int), a size string like '6 GiB', or None; got {value!r}"
    )
