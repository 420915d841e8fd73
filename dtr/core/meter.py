"""Peak meters: the most bytes a runtime charged during a stretch of a program
(``Runtime.meter()``; seeding measures each stage's peak with one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from dtr.core.runtime import Runtime

__all__ = ["PeakMeter"]

# Note [Peak meters]
# ~~~~~~~~~~~~~~~~~~
# The places that charge bytes keep one high-water mark, ``_high``: the most bytes charged
# since the latest meter started (or since the runtime did). Starting a meter folds ``_high``
# into every open meter and into ``_earlier_peak``, then restarts it from the bytes charged
# now; a peak (the runtime's, or an open meter's) is the larger of what was folded into it and
# ``_high``. So an op pays one comparison whatever the number of meters open, starting a meter
# costs O(open meters), and no meter can lower the runtime's peak: a stage that raises before
# its meter stops leaves ``peak`` right.


class PeakMeter:
    """The most bytes charged to a runtime since ``Runtime.meter()`` made this meter (the
    bytes charged then, at least); ``stop()`` freezes it. Meters may overlap and nest."""

    __slots__ = ("_runtime", "_peak")

    def __init__(self, runtime: Runtime) -> None:
        high = runtime._high
        for m in runtime._meters:
            if high > m._peak:
                m._peak = high
        if high > runtime._earlier_peak:
            runtime._earlier_peak = high
        runtime._high = runtime.memory
        self._runtime: Optional[Runtime] = runtime
        self._peak = runtime.memory
        runtime._meters.append(self)

    @property
    def peak(self) -> int:
        """The most bytes charged since the meter started, until it stopped."""
        rt = self._runtime
        return self._peak if rt is None or rt._high < self._peak else rt._high

    def stop(self) -> int:
        """Stop measuring (the runtime forgets this meter) and return ``peak``. Idempotent."""
        rt = self._runtime
        if rt is not None:
            self._peak = self.peak
            rt._meters.remove(self)
            self._runtime = None
        return self._peak
