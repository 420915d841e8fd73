"""Memory timelines: resident bytes, budget, evictions and replays against the op clock.

A timeline is sampled after every op of one block by a ``Recorder`` the runtime calls
(``Runtime.on_op``), from what the runtime itself counts: its charged bytes, its budget, its
eviction and replay counters (so the timeline's evictions add up to ``engine.stats()``'s).
Two sources, one recorder:

- a live block: ``dtr.budget(..., timeline=True)``, then ``engine.timeline()`` or
  ``engine.plot_timeline()`` (the last block);
- a trace: ``dtr.Timeline.from_trace(trace)`` (or ``dtr.plot(trace)``) replays one of its
  blocks through the simulator, by default at the budget it was recorded with, which repeats
  the recorded run's decisions (docs/sim.md), so it draws the same timeline without running
  the model again.

The last sample is taken after the block has ended: the engine then charges nothing (what the
program keeps is handed over), and evictions or replays the block's end caused are counted.
Torch-free; plots need matplotlib (``dtr.plot``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple, Union

from dtr.config import parse_bytes
from dtr.core import Heuristic, Runtime, heuristic_names, make_heuristic
from dtr.errors import OutOfBudgetError
from dtr.sim.simulator import RoomBeforeOps, SimExecutor, run_block
from dtr.sim.trace import Trace, load

__all__ = ["Recorder", "Timeline"]


@dataclass(frozen=True)
class Timeline:
    """One block's memory over its op clock: sample ``i`` is taken after the op at
    ``clock[i]`` (the last one after the block's end).

    Attributes:
        clock: the runtime's op clock at each sample (1 for the block's first op).
        resident_bytes: bytes charged to the budget then (resident storages and gradients
            made in the block); the moment inside an op, before evictions make room, is not
            sampled (``engine.stats().peak_resident_bytes`` has it).
        budget: the budget in bytes then (None: no limit).
        evictions: storages evicted to meet the budget since the previous sample.
        replays: ops replayed to recompute evicted storages since the previous sample.
        error: why the block stopped, for a simulated block that ran out of budget.
    """

    clock: Tuple[int, ...]
    resident_bytes: Tuple[int, ...]
    budget: Tuple[Optional[int], ...]
    evictions: Tuple[int, ...]
    replays: Tuple[int, ...]
    error: Optional[str] = None

    def __len__(self) -> int:
        return len(self.clock)

    @property
    def peak_bytes(self) -> int:
        """The most bytes resident at a sample."""
        return max(self.resident_bytes, default=0)

    @property
    def total_evictions(self) -> int:
        return sum(self.evictions)

    @property
    def total_replays(self) -> int:
        return sum(self.replays)

    @classmethod
    def from_trace(
        cls,
        trace: Union[str, Path, Trace],
        budget: Union[int, str, None] = "recorded",
        heuristic: Union[str, Heuristic, None] = None,
        *,
        block: int = -1,
        max_recompute: Optional[float] = 10.0,
    ) -> "Timeline":
        """The memory timeline of one block of ``trace``, replayed through the simulator.

        Args:
            trace: a trace file written by ``dtr.budget(..., trace=path)``, or a loaded ``Trace``.
            budget: ``"recorded"`` (default: the budget the block started with, which repeats
                the recorded run), or bytes, a size string, or None (no limit).
            heuristic: a heuristic name or object; default: the one the trace was recorded with.
            block: which block of the trace (default: the last).
            max_recompute: stop where replays have cost this many times the block's ops, as
                ``dtr.budget`` does by default (Note [Thrashing]); None: never.

        A budget the block cannot run at (or thrashes at) gives a timeline that stops there,
        with ``error`` set. Swapping is not replayed: a block recorded with ``swap=True``
        gives the timeline plain DTR would have had. Raises ``ValueError`` on a bad trace, budget or block index, or a
        recorded heuristic that is not registered here (pass ``heuristic=``).
        """
        tr = load(trace)
        if not tr.blocks:
            raise ValueError("dtr.Timeline.from_trace: the trace has no blocks")
        try:
            events = tr.blocks[block]
        except (IndexError, TypeError):
            raise ValueError(
                f"dtr.Timeline.from_trace: block must index the trace's {len(tr.blocks)} blocks, got {block!r}"
            ) from None
        limit = events[0].get("budget") if budget == "recorded" else parse_bytes(budget)
        if heuristic is None:
            heuristic = tr.header.get("heuristic", "dtr_eq")
            if heuristic not in heuristic_names():
                raise ValueError(
                    f"dtr.Timeline.from_trace: the trace was recorded with heuristic {heuristic!r}, which "
                    "is not registered here; pass heuristic= (a name from dtr.heuristic_names() or an object)"
                )
        rt = Runtime(limit, make_heuristic(heuristic), SimExecutor(), max_recompute=max_recompute)
        recorder = rt.on_op = Recorder()
        error = None
        try:
            run_block(rt, events, RoomBeforeOps.having_run(tr.blocks[: block % len(tr.blocks)]))
        except OutOfBudgetError as e:
            error = str(e)
        recorder.end(rt)
        return recorder.timeline(error)

    def plot(self, path: Union[str, Path, None] = None, *, ax: Any = None) -> Any:
        """Draw the timeline (``dtr.plot``); returns the matplotlib figure."""
        from dtr.figures import plot

        return plot(self, path, ax=ax)

    def __str__(self) -> str:
        budgets = {b for b in self.budget if b is not None}
        budget = "none" if not budgets else ", ".join(f"{b / 2**20:.2f}" for b in sorted(budgets)) + " MiB"
        text = (
            f"Timeline: {self.clock[-1] if self.clock else 0} ops, peak {self.peak_bytes / 2**20:.2f} MiB "
            f"(budget {budget}), {self.total_evictions} evictions, {self.total_replays} replays"
        )
        return text + (f"; stopped: {self.error}" if self.error else "")


class Recorder:
    """Samples a runtime after each op (set as ``Runtime.on_op``); ``end`` takes the last
    sample after the block's end. Integer arrays: a few bytes per op."""

    __slots__ = ("_clock", "_resident", "_budget", "_evictions", "_replays")

    def __init__(self) -> None:
        self._clock = array("q")
        self._resident = array("q")
        self._budget = array("q")  # -1: no limit
        self._evictions = array("q")  # cumulative counters, differenced by ``timeline``
        self._replays = array("q")

    def __call__(self, rt: Runtime) -> None:
        self._clock.append(rt.clock)
        self._resident.append(rt.memory)
        b = rt.budget
        self._budget.append(-1 if b is None else b)
        c = rt.counters
        self._evictions.append(c.evictions)
        self._replays.append(c.rematerializations)

    end = __call__

    def timeline(self, error: Optional[str] = None) -> Timeline:
        return Timeline(
            clock=tuple(self._clock),
            resident_bytes=tuple(self._resident),
            budget=tuple(None if b < 0 else b for b in self._budget),
            evictions=_deltas(self._evictions),
            replays=_deltas(self._replays),
            error=error,
        )


def _deltas(cumulative: array) -> Tuple[int, ...]:
    prev = 0
    out = []
    for v in cumulative:
        out.append(v - prev)
        prev = v
    return tuple(out)
