"""The ``dtr`` logger: evictions, replays, fallbacks and warnings, through ``logging``.

Quiet by default, as a library should be: the logger has only a ``NullHandler``, so nothing is
printed unless the program configures logging (``logging.basicConfig(level=logging.DEBUG)``, or
``logging.getLogger("dtr").setLevel(...)`` with a handler of its own). ``DTR_DEBUG=1`` in the
environment (any value but ``0``) turns debug logging on without code: the logger gets level DEBUG and, if it has no
handler of its own yet, one that writes to stderr. The variable is read when this module is
first imported (by the first block, or the planner) and again as each ``dtr.budget`` block
starts; ``DTR_DEBUG=0`` or unset changes nothing (a level the program set stays).

Per-event messages (an eviction, a replay) are written only when debug logging is on at the
start of a block: the engine checks once per block, never per op.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["logger", "apply_env", "warn"]

logger = logging.getLogger("dtr")
logger.addHandler(logging.NullHandler())


def apply_env() -> None:
    """Turn on debug logging if ``DTR_DEBUG`` is set to anything but ``0`` or nothing."""
    if os.environ.get("DTR_DEBUG", "").strip() in ("", "0"):
        return
    logger.setLevel(logging.DEBUG)
    if not any(type(h) is not logging.NullHandler for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def warn(message: str, category: type = UserWarning, stacklevel: int = 2) -> None:
    """Warn the user (``warnings.warn``) and log the same message at WARNING."""
    logger.warning(message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


apply_env()
