"""``solve``: the planners' front door. Picks the DP, checks its plan, explains infeasible budgets.

Note [Every plan is evaluated]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A returned plan's ``makespan`` and ``peak`` come from :func:`evaluate` with exact sizes, never from
the DP's own arithmetic: the DP works in rounded memory units, and its float sums run in another
order. Solving also asserts what the DPs promise (peak within the budget; remat makespan equal to
the DP value; combined makespan no worse than its DP value), so a bug cannot hand out a plan
that overflows.

Note [Smallest feasible budget]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Whether a DP finds a plan depends only on sizes, not times, and is monotone in the budget: a
larger budget shrinks every rounded size and the unit count stays fixed. So the smallest budget
``solve`` accepts is found by bisection on a cheap ``O(L^3)`` feasibility test, between the exact
(undiscretized) lower bound and the store-all peak (always accepted). With integer sizes it is the
exact smallest integer; with float sizes, the smallest float, to one ulp.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, List, Optional, Tuple

from dtr.errors import InfeasibleBudgetError
from dtr.planner import _native, offload, rotor
from dtr.planner.baselines import store_all
from dtr.planner.chain import Chain, Number, Op, Plan
from dtr.planner.evaluate import evaluate

__all__ = ["solve"]

_MAX_COMBINED = 1000  # the native combined DP packs stages and levels in 10 bits


def _check(name: str, value: object, integral: bool = False, upper: float = math.inf) -> None:
    kind = numbers.Integral if integral else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not (0 < value <= upper) or value == math.inf:
        what = f"an int in 1..{int(upper)}" if integral else "a positive finite number"
        raise ValueError(f"dtr.planner.solve: {name} = {value!r}; it must be {what}")


def _checked(chain: Chain, found: Tuple[List[Op], float], budget: Number,
             bandwidth: Optional[float]) -> Plan:
    """Evaluate a DP plan and assert the DP's promises; see Note [Every plan is evaluated]."""
    ops, predicted = found
    try:
        makespan, peak = evaluate(chain, ops, budget=budget if bandwidth else None, offload_bandwidth=bandwidth)
    except ValueError as exc:
        raise AssertionError(f"dtr.planner bug: the DP returned an invalid plan ({exc}); please report it") from exc
    slack = 1e-9 * max(1.0, abs(predicted))
    exact = abs(makespan - predicted) <= slack if bandwidth is None else makespan <= predicted + slack
    if peak > budget or not exact:
        raise AssertionError(f"dtr.planner bug: plan evaluates to makespan {makespan}, peak {peak}; the DP "
                             f"predicted {predicted} within budget {budget}; please report it")
    return Plan(ops, makespan, peak, budget, bandwidth)


def _smallest(feasible: Callable[[Number], bool], lower: float, upper: Number, integral: bool) -> Number:
    """The least budget in ``(lower, upper]`` that is ``feasible`` (``upper`` is); see Note [Smallest feasible budget]."""
    if integral:
        lo, hi = max(0, math.floor(lower) - 1), int(upper)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
        return hi
    lo, hi = lower * (1 - 1e-9), float(upper)
    if lo <= 0 or feasible(lo):  # the bound is a float sum; never trust it past its rounding
        lo = 0.0
    while True:
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            return hi
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)


def _infeasible(chain: Chain, budget: Number, slots: int, levels: int, bandwidth: Optional[float],
                peak_all: Number) -> InfeasibleBudgetError:
    lower = rotor.remat_lower_bound(chain)
    if bandwidth is not None:
        lower = min(lower, offload.combined_lower_bound(chain))

    def feasible(candidate: Number) -> bool:
        return candidate > 0 and (candidate >= peak_all or rotor.remat_feasible(chain, candidate, slots) or (
            bandwidth is not None and offload.combined_feasible(chain, candidate, levels)))

    x, xb = chain.activation_sizes()
    integral = all(isinstance(v, int) for v in [*x, *xb, *chain.forward_overhead, *chain.backward_overhead])
    least = _smallest(feasible, lower, peak_all, integral)
    grid = f"slots={slots}" + (f" (levels={levels} with offloading)" if bandwidth is not None else "")
    return InfeasibleBudgetError(
        f"dtr.planner.solve: no plan of this chain fits in a budget of {budget}. The smallest budget that "
        f"works with {grid} is {least}; with exact sizes no plan can go below {lower:.6g}. Raise the "
        f"budget to at least {least}, or raise slots{' and levels' if bandwidth is not None else ''} to get closer "
        "to the exact bound.", least)


def solve(chain: Chain, budget: Number, *, slots: int = 500, offload_bandwidth: Optional[float] = None,
          levels: int = 50, backend: str = "auto") -> Plan:
    """The fastest plan for ``chain`` whose peak memory stays within ``budget``.

    Without ``offload_bandwidth``: the optimal *persistent* rematerialization plan (rotor's DP;
    the persistent optimum can be up to 1.5x the unrestricted one on contrived chains, and equals
    it on the networks the paper measured). With it: also the combined remat + offload DP, and the
    faster of the two evaluated plans (the combined DP's coarser memory grid can lose to rotor's).
    If the store-all schedule fits, it is returned: nothing is faster.

    Args:
        chain: the stages' costs.
        budget: memory for activations, gradients and transients, including the input ``a^0``.
        slots: memory units of the remat DP; sizes are rounded up to ``budget / slots``.
        offload_bandwidth: bytes per time unit between device and host; None disables offloading.
        levels: memory units of the combined DP (the paper found 50 enough), at most 1000.
        backend: ``"auto"`` (native if built), ``"python"`` or ``"native"``; all give the same plan.

    Returns:
        A :class:`Plan` whose ``makespan`` and ``peak`` are those :func:`evaluate` gives it.

    Raises:
        dtr.InfeasibleBudgetError: no plan fits; ``min_budget`` is the smallest budget ``solve``
            accepts with these ``slots``/``levels``.
        ValueError: bad arguments.

    Complexity: remat DP ``O(slots * L^3)`` time, ``O(slots * L^2)`` memory; combined DP
    ``O(L^2 levels^3 + L^3 levels^2)`` time over reachable states.
    """
    if not isinstance(chain, Chain):
        raise ValueError(f"dtr.planner.solve: chain must be a dtr.planner.Chain, got {type(chain).__name__}")
    _check("budget", budget)
    _check("slots", slots, integral=True, upper=10**6)
    _check("levels", levels, integral=True, upper=_MAX_COMBINED)
    if offload_bandwidth is not None:
        _check("offload_bandwidth", offload_bandwidth)
        if chain.length >= _MAX_COMBINED:
            raise ValueError(f"dtr.planner.solve: offloading plans support up to {_MAX_COMBINED - 1} stages, "
                             f"the chain has {chain.length}; group stages into blocks")
    impl = _native.backend(backend)
    baseline = store_all(chain)
    makespan, peak_all = evaluate(chain, baseline)
    if peak_all <= budget:
        return Plan(baseline, makespan, peak_all, budget)
    plans = []
    found = rotor.remat_plan(chain, budget, slots, impl.rotor_table)
    if found is not None:
        plans.append(_checked(chain, found, budget, None))
    if offload_bandwidth is not None:
        found = offload.combined_plan(chain, budget, levels, offload_bandwidth, impl.combined_dp)
        if found is not None:
            plans.append(_checked(chain, found, budget, offload_bandwidth))
    if not plans:
        raise _infeasible(chain, budget, slots, levels, offload_bandwidth, peak_all)
    return min(plans, key=lambda plan: plan.makespan)
