"""The persistent rematerialization DP of rotor (Beaumont et al., ACM TOMS, Algorithms 3 and 4).

State ``P(s, t, m)``, ``1 <= s <= t <= n`` with ``n = L+1`` the loss: ``a^(s-1)`` is stored and not
counted in the budget ``m``; ``δ^t`` is held and counted; run the forwards from ``s`` and the
backwards ``B^t .. B^s``; afterwards ``δ^(s-1)`` is held. The answer is ``P(1, n, M - |a^0|)``::

    P(s, s, m) = tf[s] + tb[s]                                    if m >= Mall(s, s)
    P_all      = (tf[s] + P(s+1, t, m - xb[s])) + tb[s]            if m >= Mall(s, t)
    P_ck       = min over s < s' <= t of
                 ((pre[s'-1] - pre[s-1]) + P(s', t, m - x[s'-1])) + P(s, s'-1, m)
                                                                  if m >= Mnone(s, t)
    Mall(s,t)  = max(g[t] + xb[s] + of[s], g[s] + g[s-1] + xb[s] + ob[s])
    Mnone(s,t) = max(g[t] + x[s] + of[s], max_{s<j<t} g[t] + x[j-1] + x[j] + of[j])

``P_all`` starts with ``F_all^s`` and keeps ``ā^s`` until ``B^s``; ``P_ck`` starts with ``F_ck^s``,
runs ``F_none`` up to ``s'-1``, solves ``s'..t`` holding ``a^(s'-1)``, then ``s..s'-1`` again from
``a^(s-1)``. ``g = x`` (a gradient has its activation's size); ``pre`` holds prefix sums of ``tf``.

Note [Errata followed]
~~~~~~~~~~~~~~~~~~~~~~
From the planner notes: ``Mall`` uses ``xb`` (the paper prints ``x``) and ``g[t]`` (rotor's code
uses ``g[s]``, which admits over-budget plans inside ``P(s, s'-1, .)`` calls); sizes are rounded
*up* to slots (see ``discretize.py``).

Note [Identical backends]
~~~~~~~~~~~~~~~~~~~~~~~~~
``dtr_ext`` fills the same table in C. Both add in the order written above, scan ``s'`` upwards
keeping the first strict minimum, and pick ``F_all`` only when strictly better than the best
``F_ck`` (rotor's tie rule), so both return the same table of choices bit for bit.

Cost: ``(L+1)(L+2)/2 * (S+1)`` states, ``O(L)`` work each: ``O(S * L^3)`` time (about
``S * L^3 / 6`` inner steps) and ``O(S * L^2)`` memory.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dtr.planner.chain import Chain, Number, Op
from dtr.planner.discretize import Units, exact_sizes, to_units

__all__ = ["rotor_table", "remat_plan", "remat_feasible", "remat_lower_bound", "min_memory", "times"]

_MAX_TABLE_BYTES = 8 * 2**30  # refuse to start a fill that cannot finish in memory

#: ``rotor_table(tf, tb, pre, x, xb, of, ob, budget) -> (value, choice)``; see :func:`rotor_table`.
TableFn = Callable[..., Tuple[float, np.ndarray]]


def times(chain: Chain) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tf, tb, pre)`` as float64 arrays indexed ``0..L+1`` (index 0 unused, ``L+1`` the loss).

    ``pre[k] = tf[1] + ... + tf[k]`` summed left to right here, once, so both backends use the
    same rounding.
    """
    tf = np.array([0.0, *chain.forward_time, 0.0])
    tb = np.array([0.0, *chain.backward_time, 0.0])
    pre = [0.0]
    for value in tf[1:]:
        pre.append(pre[-1] + value)
    return tf, tb, np.array(pre)


def _thresholds(x: np.ndarray, xb: np.ndarray, of: np.ndarray, ob: np.ndarray,
                n: int) -> Iterator[Tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(d, s, Mall(s, s+d), Mnone(s, s+d))`` for ``d = 0..n-1``, vectors over ``s``."""
    hop = np.zeros(n + 1, dtype=x.dtype)  # hop[j]: a no-grad F^j holding its input and output
    hop[1:] = x[:-1] + x[1:] + of[1:]
    inner = np.full(n + 1, -1, dtype=x.dtype)  # max of hop[j] for s < j < s+d; sizes are >= 0
    for d in range(n):
        s = np.arange(1, n - d + 1)
        t = s + d
        if d >= 2:
            inner[s] = np.maximum(inner[s], hop[s + d - 1])
        mall = np.maximum(x[t] + xb[s] + of[s], x[s] + x[s - 1] + xb[s] + ob[s])
        mnone = np.maximum(x[t] + x[s] + of[s], x[t] + inner[s])
        yield d, s, mall, mnone


def _shifted(table: np.ndarray, first: int, shifts: np.ndarray, pad: int, budget: int) -> np.ndarray:
    """Rows ``first..`` of ``table`` read at budget ``m - shift`` (a fresh array; ``+inf`` below 0).

    ``table`` carries ``pad >= min(shift, budget)`` columns of ``+inf`` on its left, so row ``r``
    shifted by ``c`` is the window starting at column ``pad - c``: one gather of contiguous rows.
    """
    windows = sliding_window_view(table, budget + 1, axis=1)
    out = windows[np.arange(first, first + len(shifts)), pad - np.minimum(shifts, pad)]
    out[shifts > budget] = np.inf
    return out


def rotor_table(tf: np.ndarray, tb: np.ndarray, pre: np.ndarray, x: np.ndarray, xb: np.ndarray,
                of: np.ndarray, ob: np.ndarray, budget: int) -> Tuple[float, np.ndarray]:
    """Fill the persistent DP; return ``(P(1, n, budget), choice)``. Pure NumPy reference.

    Arrays are indexed by stage ``0..n`` (``n = L+1``, the loss; sizes int64 in slots, times
    float64). ``choice`` is int16 of shape ``(n(n+1)/2, budget+1)``, one row per interval
    ``(s, s+d)`` in order of ``d`` then ``s``: ``-1`` infeasible, ``0`` ``F_all``, ``k > 0``
    ``F_ck`` with ``s' = s+k``.

    Cost: ``O(S L^3)`` arithmetic in ``O(L^2)`` NumPy calls, each over all budgets and all
    intervals of one length.
    """
    n = len(tf) - 1
    width = budget + 1
    m = np.arange(width)
    pad = int(min(max(x.max(), xb.max()), budget))
    tables: List[np.ndarray] = []  # tables[d][s-1]: P(s, s+d, .) after `pad` columns of +inf
    choice = np.empty((n * (n + 1) // 2, width), dtype=np.int16)
    row = 0
    for d, s, mall, mnone in _thresholds(x, xb, of, ob, n):
        ns = len(s)
        table = np.full((ns, pad + width), np.inf)
        pick = choice[row:row + ns]
        row += ns
        if d == 0:
            fits = m >= mall[:, None]
            np.copyto(table[:, pad:], (tf[s] + tb[s])[:, None], where=fits)
            pick[...] = np.where(fits, 0, -1)
            tables.append(table)
            continue
        best = np.full((ns, width), np.inf)
        pick.fill(-1)
        better = np.empty((ns, width), dtype=bool)
        for k in range(1, d + 1):
            cand = _shifted(tables[d - k], k, x[s + k - 1], pad, budget)
            np.add(cand, (pre[s + k - 1] - pre[s - 1])[:, None], out=cand)
            np.add(cand, tables[k - 1][:ns, pad:], out=cand)
            np.less(cand, best, out=better)
            np.copyto(best, cand, where=better)
            np.copyto(pick, k, where=better)
        best[m < mnone[:, None]] = np.inf
        p_all = _shifted(tables[d - 1], 1, xb[s], pad, budget)
        p_all = (tf[s][:, None] + p_all) + tb[s][:, None]
        p_all[m < mall[:, None]] = np.inf
        np.less(p_all, best, out=better)
        np.copyto(best, p_all, where=better)
        np.copyto(pick, 0, where=better)
        pick[np.isinf(best)] = -1
        table[:, pad:] = best
        tables.append(table)
    return float(tables[n - 1][0, pad + budget]), choice


def min_memory(sizes: Units) -> np.ndarray:
    """``R[d, s]``: the least budget ``m`` for which ``P(s, s+d, m)`` is feasible.

    Feasibility of the DP only depends on sizes, so this is the DP without its budget axis:
    ``R(s,t) = min(max(Mall, xb[s] + R(s+1,t)), max(Mnone, min_s' max(x[s'-1] + R(s',t), R(s,s'-1))))``.
    Works on slots (exact ints) and on raw sizes alike. ``O(L^3)`` in ``O(L)`` NumPy calls.
    """
    x, xb, of, ob = (np.asarray(v, dtype=np.float64) for v in sizes)
    n = len(x) - 1
    need = np.full((n, n + 2), np.inf)
    for d, s, mall, mnone in _thresholds(x, xb, of, ob, n):
        if d == 0:
            need[0, s] = mall
            continue
        k = np.arange(1, d + 1)[None, :]
        later = x[s[:, None] + k - 1] + need[d - k, s[:, None] + k]
        earlier = need[k - 1, s[:, None]]
        ck = np.maximum(mnone, np.maximum(later, earlier).min(axis=1))
        need[d, s] = np.minimum(np.maximum(mall, xb[s] + need[d - 1, s + 1]), ck)
    return need


def remat_feasible(chain: Chain, budget: Number, slots: int) -> bool:
    """Whether :func:`remat_plan` finds a plan, without filling the table. ``O(L^3)``."""
    units = to_units(chain, budget, slots)
    return min_memory(units)[chain.length, 1] <= slots - units.x[0]


def remat_lower_bound(chain: Chain) -> float:
    """The least budget of any persistent plan with exact sizes (no discretization)."""
    sizes = exact_sizes(chain)
    return float(min_memory(sizes)[chain.length, 1] + sizes.x[0])


def _reconstruct(choice: np.ndarray, units: Units, n: int, budget: int) -> List[Op]:
    """Algorithm 4, iteratively (a recursion would be ``O(L)`` deep). Loss ops (stage n) are implicit."""
    offsets = np.concatenate([[0], np.cumsum(np.arange(n, 0, -1))])
    ops: List[Op] = []
    todo: List[object] = [(1, n, budget)]
    while todo:
        item = todo.pop()
        if isinstance(item[0], str):
            ops.append(item)  # type: ignore[arg-type]
            continue
        s, t, m = item  # type: ignore[misc]
        pick = int(choice[offsets[t - s] + s - 1, m])
        if pick < 0:
            raise AssertionError(f"dtr.planner bug: no choice stored for P({s}, {t}, {m}); please report it")
        if s == t:
            if s < n:
                ops += [("F_all", s), ("B", s)]
        elif pick == 0:
            todo += [("B", s), (s + 1, t, m - units.xb[s]), ("F_all", s)]
        else:
            split = s + pick
            todo += [(s, split - 1, m), (split, t, m - units.x[split - 1])]
            todo += [("F_none", k) for k in range(split - 1, s, -1)] + [("F_ck", s)]
    return ops


def remat_plan(chain: Chain, budget: Number, slots: int, table: TableFn) -> Optional[Tuple[List[Op], float]]:
    """The optimal persistent plan as ``(ops, predicted makespan)``, or None if none fits.

    ``table`` is :func:`rotor_table` or its native twin.
    """
    units = to_units(chain, budget, slots)
    available = slots - units.x[0]  # the input a^0 stays outside the DP's budget
    if available < 0:
        return None
    n = chain.length + 1
    table_bytes = 10 * n * (n + 1) // 2 * (available + 1)  # float64 costs + int16 choices
    if table_bytes > _MAX_TABLE_BYTES:
        raise ValueError(f"dtr.planner.solve: the DP table for {chain.length} stages and {slots} slots needs "
                         f"{table_bytes / 2**30:.1f} GiB; use fewer slots or group stages into blocks")
    tf, tb, pre = times(chain)
    arrays = [np.array(v, dtype=np.int64) for v in units]
    value, choice = table(tf, tb, pre, *arrays, available)
    if math.isinf(value):
        return None
    return _reconstruct(choice, units, chain.length + 1, available), value
