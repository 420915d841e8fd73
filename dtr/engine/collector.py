"""The only module that knows about ``dtr_ext._collector``: taking the engine's records out of
Python's cyclic collector (Note [Untracked records] in runtime.py).

``untrack(*objs)`` stops the collector from visiting ``objs``; ``track(*objs)`` makes it visit
them again. Without the native module (no C compiler at install, or ``DTR_PUREPYTHON=1`` at
import) both do nothing: the engine behaves the same, and the collector does more work per op.
``NATIVE`` tells which is in use.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["NATIVE", "track", "untrack"]


def _ignore(*objs: Any) -> None:
    pass


def _load():
    if os.environ.get("DTR_PUREPYTHON", "") not in ("", "0"):
        return None
    try:
        from dtr_ext import _collector
    except ImportError:
        return None
    return _collector if getattr(_collector, "ABI_VERSION", None) == 1 else None


_EXT = _load()
NATIVE: bool = _EXT is not None
untrack = _EXT.untrack if _EXT is not None else _ignore
track = _EXT.track if _EXT is not None else _ignore
