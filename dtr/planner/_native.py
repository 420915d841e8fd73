"""The only module that knows about ``dtr_ext``, the native twins of the planner's DPs.

``DTR_PUREPYTHON=1`` (read at import) skips it. If it is missing or stale, the pure-Python
reference is used and one warning says why. ``HAS_NATIVE`` tells which is available; every solve
can still pick a backend by name (``"auto"``, ``"python"``, ``"native"``).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

import numpy as np

from dtr.log import logger, warn
from dtr.planner import offload, rotor

__all__ = ["HAS_NATIVE", "Backend", "backend"]

_ABI_VERSION = 1  # must match ABI_VERSION in dtr_ext/planner.c


def _load() -> Optional[object]:
    if os.environ.get("DTR_PUREPYTHON", "") not in ("", "0"):
        logger.debug("dtr.planner: DTR_PUREPYTHON is set: using the pure-Python DPs")
        return None
    try:
        from dtr_ext import _planner as dtr_ext
    except ImportError as exc:
        warn(f"dtr.planner: the native planner dtr_ext is not available ({exc}); using the "
                      "pure-Python DPs (same plans, slower). Reinstall dtr with a C compiler to build it, "
                      "or set DTR_PUREPYTHON=1 to silence this.", RuntimeWarning, stacklevel=3)
        return None
    if getattr(dtr_ext, "ABI_VERSION", None) != _ABI_VERSION:
        warn("dtr.planner: dtr_ext was built from another version of dtr; using the pure-Python "
                      "DPs. Reinstall dtr to rebuild it.", RuntimeWarning, stacklevel=3)
        return None
    return dtr_ext


_EXT = _load()
#: Whether the native planner was loaded (False under ``DTR_PUREPYTHON=1``).
HAS_NATIVE: bool = _EXT is not None


class Backend(NamedTuple):
    """One implementation of the DP hot loops (see ``rotor.rotor_table`` and ``offload.combined_dp``)."""

    name: str
    rotor_table: rotor.TableFn
    combined_dp: offload.CombinedFn


def _native_rotor_table(tf, tb, pre, x, xb, of, ob, budget: int) -> Tuple[float, np.ndarray]:
    value, choice = _EXT.rotor_table(tf, tb, pre, x, xb, of, ob, budget)  # type: ignore[union-attr]
    return value, np.frombuffer(choice, dtype=np.int16).reshape(-1, budget + 1)


_PYTHON = Backend("python", rotor.rotor_table, offload.combined_dp)
_NATIVE = Backend("native", _native_rotor_table, _EXT.combined_dp) if _EXT is not None else None  # type: ignore[attr-defined]


def backend(name: str = "auto") -> Backend:
    """The implementation called ``name``: ``"auto"`` (native if available), ``"python"``, ``"native"``."""
    if name == "python" or (name == "auto" and _NATIVE is None):
        return _PYTHON
    if name in ("native", "auto"):
        if _NATIVE is None:
            why = "DTR_PUREPYTHON=1 is set" if os.environ.get("DTR_PUREPYTHON", "") not in ("", "0") \
                else "dtr_ext did not build or load"
            raise ValueError(f"dtr.planner: backend='native' is not available ({why}); "
                             "use backend='python' or 'auto', or reinstall dtr with a C compiler")
        return _NATIVE
    raise ValueError(f"dtr.planner: backend={name!r}; expected 'auto', 'python' or 'native'")
