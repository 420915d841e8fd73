"""The combined rematerialization + offloading DP ("pofo", Beaumont et al., NeurIPS 2021, App. B).

The schedule model is Note [Offload and prefetch] in ``evaluate.py``: persistent remat plans whose
stored sub-chain inputs may go to the host during the forward phase and come back during the
backward phase, over one channel of ``rate`` memory levels per time unit. Memory is in ``N`` levels
(about 50 suffice, per the paper).

Forward state ``OC(i, x, A, F, B)``: sub-chain ``i..L`` starts with its input ``I`` stored (``a^(i-1)``
if ``x = 0``, ``ā^(i-1)`` if ``x = 1``); ``A`` levels of earlier values stay on the device; ``F``
levels of earlier offloads are still in flight when ``F^i`` may start; ``B`` levels of earlier
prefetches are still in flight, in reverse time, when the backward of this sub-chain ends. Value:
time from ``F^i`` to the end of ``B^i``, transfer waits and the loss junction included. Choices:

* ``F_all^i`` then sub-chain ``i+1`` (input ``ā^i``) then ``B^i``;
* ``F_ck^i, F_none^(i+1..j)``, sub-chain ``j+1`` (input ``a^j``), then the backward segment
  ``CΔ(i, j, A + I, B)``, a remat-only sub-problem that recomputes from ``I``;

each with ``I`` kept on the device (``A' = A + I``) or offloaded after ``F^i`` and prefetched before
its first use after the loss. The loss (``i = L+1``) costs ``(F + B) / rate``: the channel drains the
offloads, then brings back what the backward phase needs at its start (assumption OR.3).

Backward state ``CΔ(s, t, A, D)``: rotor's ``P(s, t, N - A)`` while ``D`` levels of prefetch for
earlier stages must still come in. The backward phase is timed in reverse, so ``D`` drains from the
op executed *last*: Lemma 1 of the appendix gives the wait of each block of forwards from the
largest ``memory - rate * (time after the op)``.

Note [Departures from the appendix]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
1. The appendix lets ``I`` start leaving during ``F^i`` (``ΔF' = max(ΔF + I - D_F, 0)``), i.e. frees
   memory of a tensor the op is still reading. Here ``I`` is issued after ``F^i`` ends and must be
   back before the op that reads it starts, in both phases (``ΔF' = max(ΔF - D_F, 0) + I``).
2. Debts (in levels) are rounded up to whole levels after every step (within 1e-9 of a level, so
   that float noise does not add a level). Rounding up only delays things, so the evaluated plan is
   never slower than the DP's value, nor over the budget.
3. Forward blocks (``F_ck^i, F_none...``) are timed op by op: the input joins the transfer queue
   after ``F_ck^i``, so one Lemma-1 wait from the block start would not be exact. Backward blocks
   use Lemma 1's closed form, with each op's distance to the block end (prefetch mirror).

Note [Identical backends]
~~~~~~~~~~~~~~~~~~~~~~~~~
``dtr_ext.combined_dp`` is a line-by-line C twin of :class:`_Combined` (same float expressions,
same evaluation order, same tie rules: keep before offload, smaller ``j``/``s'`` first, ``F_all``
only when strictly better), so both return the same value and ops.

Cost: ``O(L N^3)`` forward states with ``O(L)`` choices and ``O(L^2 N^2)`` backward states with
``O(L)`` choices: ``O(L^2 N^3 + L^3 N^2)`` time; only states reachable from ``OC(1, 0, 0, 0, 0)``
are visited.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dtr.planner.chain import Chain, Number, Op
from dtr.planner.discretize import Units, exact_sizes, to_units
from dtr.planner.rotor import min_memory

__all__ = ["combined_dp", "combined_plan", "combined_feasible", "combined_lower_bound"]

#: ``combined_dp(tf, tb, x, xb, of, ob, levels, rate) -> (value, ops or None)``.
CombinedFn = Callable[..., Tuple[float, Optional[List[Op]]]]

_INF = math.inf
_SLACK = 1e-9  # see Note [Departures from the appendix], 2


def _round_up(debt: float) -> int:
    return max(0, math.ceil(debt - _SLACK))


class _Combined:
    """Top-down DP with memo tables; mirrors ``dtr_ext/planner.c`` (see Note [Identical backends])."""

    def __init__(self, tf: Sequence[float], tb: Sequence[float], x: Sequence[int], xb: Sequence[int],
                 of: Sequence[int], ob: Sequence[int], levels: int, rate: float) -> None:
        self.tf, self.tb = [float(v) for v in tf], [float(v) for v in tb]
        self.x, self.xb = [int(v) for v in x], [int(v) for v in xb]
        self.of, self.ob = [int(v) for v in of], [int(v) for v in ob]
        self.L = len(tf) - 1
        self.N = int(levels)
        self.rate = float(rate)
        self.forward: Dict[Tuple[int, ...], Tuple[float, tuple]] = {}
        self.backward: Dict[Tuple[int, ...], Tuple[float, tuple]] = {}

    def _wait(self, memory: int, pending: float) -> float:
        """Lemma 1 for one op: how long until ``pending`` has drained enough for ``memory``."""
        return max(0.0, (memory + pending - self.N) / self.rate)

    def _drain(self, pending: float, duration: float) -> float:
        return max(0.0, pending - self.rate * duration)

    def segment(self, s: int, t: int, A: int, D: int) -> float:
        """``CΔ(s, t, A, D)``; the choice is ``(0, d1)`` for ``F_all`` or ``(split - s, d2)``."""
        key = (s, t, A, D)
        if key in self.backward:
            return self.backward[key][0]
        x, xb, tf, tb, N = self.x, self.xb, self.tf, self.tb, self.N
        rb = A + xb[s] + x[s] + x[s - 1] + self.ob[s]
        rf = A + x[t] + xb[s] + self.of[s]
        best, pick = _INF, ()
        if s == t:
            if rb <= N and rf <= N:
                eb = self._wait(rb, D)
                ef = self._wait(rf, self._drain(D, tb[s] + eb))
                best, pick = ((tb[s] + eb) + tf[s]) + ef, (0, 0)
            self.backward[key] = (best, pick)
            return best
        q, top, forwards = 0.0, -1, 0.0
        for split in range(s + 1, t + 1):
            k = split - 1  # the block gains F_none^k (F_ck^s when k == s) at its end
            r = x[t] + x[s] + self.of[s] if k == s else x[t] + x[k - 1] + x[k] + self.of[k]
            q = float(r) if k == s else max(float(r), q - self.rate * tf[k])
            top = max(top, r)
            forwards = forwards + tf[k]
            if A + top > N:
                break
            if A + x[split - 1] > N:
                continue
            c2 = self.segment(s, split - 1, A, D)
            if c2 == _INF:
                continue
            d2 = _round_up(D - self.rate * c2)
            c3 = self.segment(split, t, A + x[split - 1], d2)
            if c3 == _INF:
                continue
            ef = max(0.0, (A + q + self._drain(d2, c3) - N) / self.rate)
            cand = ((c2 + c3) + forwards) + ef
            if cand < best:
                best, pick = cand, (split - s, d2)
        if rb <= N and rf <= N and A + xb[s] <= N:
            eb = self._wait(rb, D)
            d1 = _round_up(D - self.rate * (tb[s] + eb))
            c1 = self.segment(s + 1, t, A + xb[s], d1)
            if c1 != _INF:
                ef = self._wait(rf, self._drain(d1, c1))
                cand = (((tb[s] + eb) + c1) + tf[s]) + ef
                if cand < best:
                    best, pick = cand, (0, d1)
        self.backward[key] = (best, pick)
        return best

    def chain(self, i: int, xk: int, A: int, F: int, B: int) -> float:
        """``OC_x(i, A, F, B)``; the choice is ``(j, offload, F', B')``, ``j = 0`` for ``F_all``."""
        key = (i, xk, A, F, B)
        if key in self.forward:
            return self.forward[key][0]
        x, xb, tf, tb, N, L = self.x, self.xb, self.tf, self.tb, self.N, self.L
        I = xb[i - 1] if xk else x[i - 1]
        best, pick = _INF, ()
        if i == L + 1:
            if A + I + x[L] <= N:
                best = (F + B) / self.rate
            self.forward[key] = (best, pick)
            return best
        rck = A + I + x[i] + self.of[i]
        if rck <= N:
            for off in (0, 1):
                kept = A if off else A + I
                now = self._wait(rck, F) + tf[i]
                pend = self._drain(F, now) + (I if off else 0)
                for j in range(i, L + 1):
                    if j > i:
                        r = kept + x[j - 1] + x[j] + self.of[j]
                        if r > N:
                            break
                        step = self._wait(r, pend) + tf[j]
                        now = now + step
                        pend = self._drain(pend, step)
                    c = self.segment(i, j, A + I, B)
                    if c == _INF:
                        continue
                    fn = _round_up(pend)
                    bn = _round_up(B - self.rate * c) + (I if off else 0)
                    if fn > N or bn > N:
                        continue
                    cand = (now + c) + self.chain(j + 1, 0, kept, fn, bn)
                    if cand < best:
                        best, pick = cand, (j, off, fn, bn)
        rf = A + I + xb[i] + self.of[i]
        rb = A + I + xb[i] + x[i] + x[i - 1] + self.ob[i]
        if rf <= N and rb <= N:
            ef, eb = self._wait(rf, F), self._wait(rb, B)
            best_all, pick_all = _INF, ()
            for off in (0, 1):
                fn = _round_up(F - self.rate * (tf[i] + ef)) + (I if off else 0)
                bn = _round_up(B - self.rate * (tb[i] + eb)) + (I if off else 0)
                if fn > N or bn > N:
                    continue
                cand = ((tf[i] + ef) + (tb[i] + eb)) + self.chain(i + 1, 1, A if off else A + I, fn, bn)
                if cand < best_all:
                    best_all, pick_all = cand, (0, off, fn, bn)
            if best_all < best:
                best, pick = best_all, pick_all
        self.forward[key] = (best, pick)
        return best

    def ops(self) -> List[Op]:
        """The plan of ``OC_0(1, 0, 0, 0)``; call after :meth:`chain` found it finite."""
        out: List[Op] = []
        self._chain_ops(1, 0, 0, 0, 0, out)
        return out

    def _chain_ops(self, i: int, xk: int, A: int, F: int, B: int, out: List[Op]) -> None:
        if i == self.L + 1:
            return
        I = self.xb[i - 1] if xk else self.x[i - 1]
        j, off, fn, bn = self.forward[(i, xk, A, F, B)][1]
        kept = A if off else A + I
        if j == 0:
            out += [("F_all", i)] + [("offload", i)] * off
            self._chain_ops(i + 1, 1, kept, fn, bn, out)
            out += [("prefetch", i)] * off + [("B", i)]
            return
        out += [("F_ck", i)] + [("offload", i)] * off + [("F_none", k) for k in range(i + 1, j + 1)]
        self._chain_ops(j + 1, 0, kept, fn, bn, out)
        out += [("prefetch", i)] * off
        self._segment_ops(i, j, A + I, B, out)

    def _segment_ops(self, s: int, t: int, A: int, D: int, out: List[Op]) -> None:
        step, debt = self.backward[(s, t, A, D)][1]
        if s == t:
            out += [("F_all", s), ("B", s)]
        elif step == 0:
            out.append(("F_all", s))
            self._segment_ops(s + 1, t, A + self.xb[s], debt, out)
            out.append(("B", s))
        else:
            split = s + step
            out += [("F_ck", s)] + [("F_none", k) for k in range(s + 1, split)]
            self._segment_ops(split, t, A + self.x[split - 1], debt, out)
            self._segment_ops(s, split - 1, A, D, out)


def combined_dp(tf: Sequence[float], tb: Sequence[float], x: Sequence[int], xb: Sequence[int],
                of: Sequence[int], ob: Sequence[int], levels: int, rate: float) -> Tuple[float, Optional[List[Op]]]:
    """Solve the combined DP; return ``(value, ops)``, ``(inf, None)`` if nothing fits.

    Pure-Python reference. Arrays are indexed by stage ``0..L`` (sizes in levels, times as
    floats; index 0 of times and overheads unused); ``rate`` is the bandwidth in levels per time
    unit. Cost: ``O(L^2 N^3 + L^3 N^2)`` over the reachable states.
    """
    dp = _Combined(tf, tb, x, xb, of, ob, levels, rate)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * dp.L + 100))  # the memoized recursion is O(L) deep
    try:
        value = dp.chain(1, 0, 0, 0, 0)
        return value, (dp.ops() if value < _INF else None)
    finally:
        sys.setrecursionlimit(limit)


def _min_memory(sizes: Units, L: int) -> float:
    """The least ``N`` for which ``OC(1, 0, 0, 0, 0)`` is finite: offload every input, keep nothing.

    Waiting resolves every transfer debt, so only what an op holds with no transfer in flight
    matters, and an offloaded input is held by nothing but its own ``F`` and the segment that
    recomputes from it. ``O(L^3)``.
    """
    x, xb, of, ob = sizes
    need = min_memory(sizes)  # need[t - s, s]: rotor's least budget for P(s, t)
    best = [[math.inf, math.inf] for _ in range(L + 2)]  # best[i][xk]
    for xk in (0, 1):
        best[L + 1][xk] = (xb if xk else x)[L] + x[L]
    for i in range(L, 0, -1):
        for xk in (0, 1):
            I = (xb if xk else x)[i - 1]
            cand = max(I + xb[i] + of[i], I + xb[i] + x[i] + x[i - 1] + ob[i], best[i + 1][1])
            hops = I + x[i] + of[i]
            for j in range(i, L + 1):
                if j > i:
                    hops = max(hops, x[j - 1] + x[j] + of[j])
                cand = min(cand, max(hops, I + need[j - i, i], best[j + 1][0]))
            best[i][xk] = cand
    return best[1][0]


def combined_feasible(chain: Chain, budget: Number, levels: int) -> bool:
    """Whether :func:`combined_plan` finds a plan, without running it. ``O(L^3)``."""
    return _min_memory(to_units(chain, budget, levels), chain.length) <= levels


def combined_lower_bound(chain: Chain) -> float:
    """The least budget of any plan of this model with exact sizes (any bandwidth)."""
    return float(_min_memory(exact_sizes(chain), chain.length))


def combined_plan(chain: Chain, budget: Number, levels: int, bandwidth: float,
                  dp: CombinedFn) -> Optional[Tuple[List[Op], float]]:
    """The DP's plan as ``(ops, predicted makespan)``, or None; ``dp`` is :func:`combined_dp` or its twin."""
    units = to_units(chain, budget, levels)
    L = chain.length
    tf = [0.0, *map(float, chain.forward_time)]
    tb = [0.0, *map(float, chain.backward_time)]
    rate = float(bandwidth) * levels / float(budget)
    value, ops = dp(np.array(tf), np.array(tb), *(np.array(v[:L + 1], dtype=np.int64) for v in units),
                    levels, rate)
    if ops is None:
        return None
    return ops, value
