"""The only module that knows about ``dtr_ext._collector``: taking the engine's records out of
Python's cyclic collector (Note [Untracked records] in runtime.py).

``untrack(*objs)`` stops the collector from visiting ``objs``; ``track(*objs)`` makes it visit
them again. ``untrack`` refuses a weakref (``TypeError``): when a weakref's referent dies in a
garbage cycle, the collector handles the weakref's callback only if it is tracked (an
untracked one crashed the process). Without the native module (no C compiler at install, or
``DTR_PUREPYTHON=1`` at import) both do nothing else: the engine behaves the same, and the
collector does more work per op. ``NATIVE`` tells which is in use.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

__all__ = ["NATIVE", "track", "untrack"]


def _untrack_nothing(*objs: Any) -> None:
    for o in objs:
        if isinstance(o, weakref.ReferenceType):
            raise TypeError("dtr_ext._collector.untrack: weakrefs must stay tracked")


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
untrack = _EXT.untrack if _EXT is not None else _untrack_nothing
track = _EXT.track if _EXT is not None else _ignore
