"""The budget advisor: from a trace, the slowdown at each budget and the lowest that runs.

``dtr.budget_curve(trace)`` simulates the trace (``dtr.simulate``: the engine's own eviction
code, recorded costs, no tensors) over a range of budgets, so that a budget can be picked before
training: ``curve.lowest_feasible`` is where the model stops running at all, and
``curve.pick(max_slowdown=1.2)`` the lowest budget whose recomputation costs at most 20% more
compute. Slowdown is ``dtr.SimResult.slowdown``: recorded compute plus replays over recorded
compute (the ratio of a step's time, not counting what dtr adds per op; docs/sim.md).

Note [Lowest feasible budget]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The grid gives the lowest feasible budget on it; bisection between it and the next lower grid
budget (or 0) then narrows it to ``granularity`` bytes: ``lowest_feasible`` runs, and
``infeasible_below`` (at most ``granularity`` lower) was simulated and does not. Feasibility need
not be monotone in the budget (a heuristic's choices change with it), so a budget between two
that run may fail: the bisection reports one boundary, the one under the grid's lowest feasible
budget, and every simulated budget is in ``points``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

from dtr.config import parse_bytes
from dtr.core import Heuristic, make_heuristic
from dtr.sim.simulator import simulate
from dtr.sim.trace import Trace, load

__all__ = ["BudgetCurve", "BudgetPoint", "budget_curve"]


@dataclass(frozen=True)
class BudgetPoint:
    """One simulated budget (fields as in ``dtr.SimResult``)."""

    budget: int
    feasible: bool
    slowdown: float
    evictions: int
    rematerializations: int
    peak_bytes: int


@dataclass(frozen=True)
class BudgetCurve:
    """Slowdown against budget for one trace and heuristic (``dtr.budget_curve``).

    Attributes:
        points: every simulated budget, ascending.
        peak_bytes: the peak without a limit (what eager dtr tracking would charge).
        lowest_feasible: the lowest budget found to run (Note [Lowest feasible budget] in
            dtr/advisor.py), or None if none of the budgets ran.
        infeasible_below: a budget at most ``granularity`` below ``lowest_feasible`` that does
            not run, or None (none was found: the grid's lowest budget ran and 0 was not tried).
        granularity: the bisection's resolution in bytes.
        heuristic: the heuristic's name.
    """

    points: List[BudgetPoint]
    peak_bytes: int
    lowest_feasible: Optional[int]
    infeasible_below: Optional[int]
    granularity: int
    heuristic: str

    def pick(self, max_slowdown: float) -> Optional[int]:
        """The lowest simulated budget that runs with at most ``max_slowdown`` (e.g. 1.2), or
        None if none does."""
        ok = [p.budget for p in self.points if p.feasible and p.slowdown <= max_slowdown]
        return min(ok, default=None)

    def plot(self, path: Union[str, Path, None] = None, *, ax: Any = None) -> Any:
        """Draw the curve (``dtr.plot``); returns the matplotlib figure."""
        from dtr.figures import plot

        return plot(self, path, ax=ax)

    def __str__(self) -> str:
        lines = [
            f"BudgetCurve ({self.heuristic}): unlimited peak {_mib(self.peak_bytes)}, lowest feasible "
            + ("none" if self.lowest_feasible is None else _mib(self.lowest_feasible))
            + f" (to {_mib(self.granularity)})",
            f"{'budget':>12} {'of peak':>8} {'slowdown':>9} {'evictions':>10} {'replays':>8}",
        ]
        for p in self.points:
            slowdown = f"{p.slowdown:.3f}" if p.feasible else "fails"
            lines.append(
                f"{_mib(p.budget):>12} {p.budget / (self.peak_bytes or 1):>8.2f} {slowdown:>9} "
                f"{p.evictions:>10} {p.rematerializations:>8}"
            )
        return "\n".join(lines)


def budget_curve(
    trace: Union[str, Path, Trace],
    budgets: Optional[Iterable[Union[int, str]]] = None,
    *,
    heuristic: Union[str, Heuristic] = "dtr_eq",
    points: int = 10,
    granularity: Union[int, str, None] = None,
    max_recompute: Optional[float] = 10.0,
) -> BudgetCurve:
    """Simulate ``trace`` over a range of budgets: the slowdown curve and the lowest feasible
    budget.

    Args:
        trace: a trace file (``dtr.budget(..., trace=path)``) or a loaded ``Trace``.
        budgets: the budgets to simulate (bytes or size strings); default: ``points`` budgets
            evenly spaced from ``peak / points`` to the unlimited peak.
        heuristic: a heuristic name or object, as for ``dtr.simulate``.
        granularity: resolution of the search for the lowest feasible budget (bytes or a size
            string); default: 0.5% of the unlimited peak. 0 skips the search.
        max_recompute: a budget whose replays cost more than this many times the block's ops
            (after 1,000 replays) counts as infeasible, as ``dtr.budget`` would stop it with
            ``ThrashingError`` (same default); None: only budgets that cannot fit at all are.

    Every simulation replays the whole trace, so the time is about ``points`` plus ``log2(peak
    / points / granularity)`` simulations; ``max_recompute`` also keeps a thrashing budget from
    running for minutes.

    Raises:
        ValueError: on a bad trace, budget, heuristic, ``points`` or ``granularity``.
    """
    tr = load(trace)
    make_heuristic(heuristic)  # fail on an unknown name before simulating
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise ValueError(f"dtr.budget_curve: points must be a positive int, got {points!r}")
    peak = simulate(tr, None, heuristic).peak_bytes
    if budgets is None:
        grid = sorted({max(1, peak * i // points) for i in range(1, points + 1)})
    else:
        grid = sorted({parse_bytes(b) for b in budgets})
        if not grid:
            raise ValueError("dtr.budget_curve: budgets is empty")
    step = parse_bytes(granularity, "granularity") if granularity is not None else max(1, peak // 200)
    results: Dict[int, BudgetPoint] = {}

    def run(budget: int) -> BudgetPoint:
        if budget not in results:
            r = simulate(tr, budget, heuristic, max_recompute=max_recompute)
            results[budget] = BudgetPoint(budget, r.feasible, r.slowdown, r.evictions, r.rematerializations, r.peak_bytes)
        return results[budget]

    for b in grid:
        run(b)
    lowest = next((b for b in grid if results[b].feasible), None)
    below = None
    if lowest is not None and step > 0:
        lower = [b for b in grid if b < lowest]
        lo = lower[-1] if lower else 0
        below = lo if lower else None
        while lowest - lo > step:
            mid = (lo + lowest) // 2
            if run(mid).feasible:
                lowest = mid
            else:
                lo = below = mid
    name = heuristic if isinstance(heuristic, str) else getattr(heuristic, "name", type(heuristic).__name__)
    return BudgetCurve(
        points=[results[b] for b in sorted(results)],
        peak_bytes=peak,
        lowest_feasible=lowest,
        infeasible_below=below,
        granularity=step,
        heuristic=name,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
