"""Shared helpers of the planner tests: chain generators and an exhaustive-search oracle.

The search re-implements the op semantics from the rotor paper's table on its own (it does not
call the simulator), so that the DP, the simulator and the search check one another.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import strategies as st

from dtr.planner import HAS_NATIVE, Chain, InfeasibleBudgetError, Plan, evaluate, solve, store_all

#: Both DP backends in one pytest run (parametrize, not a fixture: Hypothesis tests use it too).
BACKENDS = ["python", pytest.param("native", marks=pytest.mark.skipif(
    not HAS_NATIVE, reason="dtr_ext is not built, or DTR_PUREPYTHON=1"))]

# The paper's toy network (rotor, Table 2) in units of 0.01 MB and ms; stage 7 (the loss) is implicit.
TOY = Chain(forward_time=[1.60, 2.20, 2.44, 2.51, 2.10, 1.43],
            backward_time=[3.05, 4.48, 5.09, 4.93, 4.21, 3.34],
            output_bytes=[954, 1068, 1106, 1068, 954, 763],
            saved_bytes=[954, 1068, 1108, 1066, 954, 763],  # ā^4 < a^4 is measurement noise: clamped to 1068
            forward_overhead=[0] * 6,
            backward_overhead=[2001, 2764, 3099, 3099, 2764, 1908],
            input_bytes=763)


def counterexample(n: int) -> Chain:
    """Fig. 4 of the rotor paper: persistent plans are ~1.5x slower than the optimum (budget 15)."""
    L = n + 2
    x = [1] + [3] * (L - 2) + [4]
    tf = [n - 2, 2] + [0] * (L - 2)
    return Chain(tf, [0] * L, x, x, [0] * L, [0] * L, 0)


@st.composite
def chains(draw, max_stages: int = 6, max_size: int = 6, integer_times: bool = True) -> Chain:
    """Small chains with integer sizes (exact memory arithmetic)."""
    L = draw(st.integers(1, max_stages))
    size = st.integers(0, max_size)
    time = st.integers(0, 5) if integer_times else st.floats(0, 10, allow_nan=False, allow_infinity=False)
    out = draw(st.lists(size, min_size=L, max_size=L))
    return Chain(draw(st.lists(time, min_size=L, max_size=L)), draw(st.lists(time, min_size=L, max_size=L)),
                 out, [o + draw(size) for o in out], draw(st.lists(size, min_size=L, max_size=L)),
                 draw(st.lists(size, min_size=L, max_size=L)), draw(size))


def peak_all(chain: Chain) -> float:
    return evaluate(chain, store_all(chain))[1]


def solve_checked(chain: Chain, budget: float, **kwargs) -> Optional[Plan]:
    """``solve``, asserting its contract: a plan fits and replays to its own numbers; an
    infeasible budget reports a larger ``min_budget``. Returns None when infeasible."""
    try:
        plan = solve(chain, budget, **kwargs)
    except InfeasibleBudgetError as error:
        assert error.min_budget > budget
        return None
    assert plan.peak <= budget
    assert evaluate(chain, plan.ops, budget=budget, offload_bandwidth=plan.offload_bandwidth) == (
        plan.makespan, plan.peak)
    return plan


def least_budget(chain: Chain, too_small: float, **kwargs) -> float:
    """The ``min_budget`` reported for ``too_small``, asserting it solves and one step below does not
    (one unit for integer answers, one float otherwise)."""
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(chain, too_small, **kwargs)
    least = info.value.min_budget
    assert solve(chain, least, **kwargs).peak <= least
    with pytest.raises(InfeasibleBudgetError):
        solve(chain, least - 1 if isinstance(least, int) else np.nextafter(least, 0), **kwargs)
    return least


def search(chain: Chain, budget: float, persistent: bool) -> Tuple[float, Optional[List[tuple]]]:
    """Least makespan of a valid sequence within ``budget`` (and its ops), by Dijkstra over states.

    A state is (stored kind of each ``a^k``: 0 none / 1 plain / 2 tape, pinned mask, gradient held,
    loss done). With ``persistent``, memory persistence (rotor paper, §4.1) is enforced: a forward
    may only read the highest stored activation, and an activation that was the input of an
    ``F_ck``/``F_all`` ("pinned", a checkpoint) can only be freed by its backward.
    """
    L = chain.length
    x, xb = chain.activation_sizes()
    tf, tb = chain.forward_time, chain.backward_time
    of, ob = chain.forward_overhead, chain.backward_overhead

    def held(stored, grad):
        return sum(xb[k] if s == 2 else x[k] for k, s in enumerate(stored) if s) + (x[grad] if grad >= 0 else 0)

    start = ((1,) + (0,) * L, 0, -1, False)
    best = {start: 0.0}
    parent = {start: None}
    tie = itertools.count()
    heap = [(0.0, next(tie), start)]
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        stored, pins, grad, loss = state
        if loss and grad == 0:
            ops = []
            while parent[state] is not None:
                state, op = parent[state]
                ops.append(op)
            return cost, ops[::-1]
        moves = []
        for k in range(1, L + 1):
            if not stored[k - 1] or stored[k] or (persistent and any(stored[k:])):
                continue
            for kind in ("F_all", "F_ck", "F_none"):
                if kind == "F_none" and (k == 1 or stored[k - 1] == 2 or (persistent and pins >> (k - 1) & 1)):
                    continue
                if held(stored, grad) + (xb[k] if kind == "F_all" else x[k]) + of[k - 1] > budget:
                    continue
                new = list(stored)
                new[k] = 2 if kind == "F_all" else 1
                new_pins, new_grad, new_loss = pins, grad, loss
                if kind == "F_none":
                    new[k - 1] = 0
                elif persistent:
                    new_pins |= 1 << (k - 1)
                if k == L and not loss:
                    if held(new, grad) + x[L] > budget:
                        continue
                    new_grad, new_loss = L, True
                    if new[L] == 1:
                        new[L] = 0
                moves.append(((kind, k), tf[k - 1], (tuple(new), new_pins, new_grad, new_loss)))
        if loss and grad >= 1 and stored[grad] == 2 and stored[grad - 1]:
            k = grad
            if held(stored, grad) + x[k - 1] + ob[k - 1] <= budget:
                new = list(stored)
                new[k] = 0
                new_pins = pins & ~(1 << k)
                if new[k - 1] == 1:
                    new[k - 1] = 0
                    new_pins &= ~(1 << (k - 1))
                moves.append((("B", k), tb[k - 1], (tuple(new), new_pins, k - 1, loss)))
        for op, duration, nxt in moves:
            if cost + duration < best.get(nxt, math.inf):
                best[nxt] = cost + duration
                parent[nxt] = (state, op)
                heapq.heappush(heap, (cost + duration, next(tie), nxt))
    return math.inf, None
