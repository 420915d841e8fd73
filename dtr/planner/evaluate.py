"""Exact evaluation of an op sequence: validity, makespan and peak memory with undiscretized sizes.

Every plan the planners return is checked here, and the tests use it as their oracle. Cost is
``O(len(ops) * L)`` (each op sums the stored sizes with ``math.fsum``, so the peak of integer sizes
is exact and the sum of float sizes is correctly rounded).

Note [What each op holds]
~~~~~~~~~~~~~~~~~~~~~~~~~
The memory of a compute op is everything stored on the device while it runs, plus its output,
plus its transient overhead (rotor paper, Defs 3.3/3.4):

* ``F_all^k``: needs ``a^(k-1)`` or ``ā^(k-1)``; adds ``ā^k``.
* ``F_ck^k``: needs ``a^(k-1)`` or ``ā^(k-1)``; adds ``a^k``.
* ``F_none^k``: needs a plain ``a^(k-1)``; adds ``a^k``, then drops ``a^(k-1)``. (On a tape
  ``ā^(k-1)`` it would throw away what ``B^(k-1)`` needs, and ``F_none^1`` would drop ``a^0``,
  which nothing can recompute: both are rejected.)
* ``B^k``: needs ``δ^k``, ``ā^k`` and ``a^(k-1)`` or ``ā^(k-1)``; adds ``δ^(k-1)``, then drops
  ``δ^k``, ``ā^k``, and ``a^(k-1)`` if it is plain (an ``ā^(k-1)`` stays for ``B^(k-1)``).

A stage's output can be held once: recomputing an ``a^k`` that is stored is rejected. The loss step
(see Note [The loss] in ``chain.py``) holds everything stored plus ``δ^L``.

Note [Offload and prefetch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``("offload", k)`` / ``("prefetch", k)`` move the stored input of stage ``k`` (``a^(k-1)`` or
``ā^(k-1)``, whichever is stored) to the host and back. The model is the one of the combined DP
(Beaumont et al., NeurIPS 2021, assumptions OR.1-OR.5), made exact:

1. One channel at ``offload_bandwidth`` bytes per time unit, transfers first-in first-out, fully
   overlapped with compute and not slowing it.
2. All offloads come before the loss, all prefetches after it; each value goes out and comes back
   at most once. Nothing reads a value while it is on the host.
3. An offload is issued when the compute op listed before it ends; it releases device memory
   progressively, at the bandwidth, as it proceeds (so ``pending`` bytes still count).
4. A prefetch is listed before the first op that reads the value and must be complete when that
   op starts; it is issued as late as the channel allows (the time mirror of 3) and allocates
   device memory progressively.
5. Given a ``budget``, a compute op starts only when its memory plus the bytes still held by
   transfers in flight fits. Forward ops start as early as possible; the backward phase is timed
   in reverse (as late as possible), which is the time mirror of the forward phase.
6. Between the phases the channel drains the remaining offloads, then brings back what the
   backward phase needs at its start: makespan = forward phase + (offload debt + prefetch debt) /
   bandwidth + backward phase.

Progressive release (3, 4) is the appendix's relaxation OR.5: a runtime that frees a tensor only
when its copy completes needs up to one tensor of headroom per transfer in flight, or chunked copies.
Without a budget nothing waits, and the peak is what the ops hold as listed.
"""

from __future__ import annotations

import math
import numbers
from typing import List, NamedTuple, Optional, Sequence, Tuple

from dtr.planner.chain import OP_KINDS, Chain, Number, Op

__all__ = ["evaluate"]


class _Event(NamedTuple):
    where: str  # the op, for error messages
    duration: float  # compute ops only
    memory: float  # compute ops: bytes held while it runs, transfers in flight excluded
    transfer: Optional[float]  # transfers only: bytes moved


class _Walk:
    """Replays ops against the stored state; collects the events of the two phases."""

    def __init__(self, chain: Chain) -> None:
        self.L = chain.length
        self.x, self.xb = chain.activation_sizes()
        self.chain = chain
        self.stored: List[Optional[str]] = ["a"] + [None] * self.L  # None, "a" or "abar"
        self.on_host = [False] * (self.L + 1)
        self.offloaded = [False] * (self.L + 1)
        self.grad: Optional[int] = None
        self.loss_done = False
        self.done = False
        self.forward: List[_Event] = []
        self.backward: List[_Event] = []

    def _size(self, k: int) -> Number:
        return self.xb[k] if self.stored[k] == "abar" else self.x[k]

    def _compute(self, where: str, duration: float, *extra: Number) -> None:
        held = [self._size(k) for k in range(self.L + 1) if self.stored[k] and not self.on_host[k]]
        if self.grad is not None:
            held.append(self.x[self.grad])
        events = self.backward if self.loss_done else self.forward
        events.append(_Event(where, duration, math.fsum(held + list(extra)), None))

    def _need(self, where: str, k: int, what: str) -> None:
        if self.stored[k] is None:
            raise ValueError(f"evaluate: {where} needs a^{k} ({what}), which is not stored")
        if self.on_host[k]:
            raise ValueError(f"evaluate: {where} needs a^{k} ({what}), which is on the host; "
                             f"put ('prefetch', {k + 1}) before it")

    def apply(self, index: int, op: Op) -> None:
        if not (isinstance(op, (tuple, list)) and len(op) == 2):
            raise ValueError(f"evaluate: ops[{index}] = {op!r} is not a (kind, stage) pair")
        kind, stage = op
        where = f"ops[{index}] = {tuple(op)!r}"
        if kind not in OP_KINDS:
            raise ValueError(f"evaluate: {where}: unknown kind {kind!r}; expected one of {', '.join(OP_KINDS)}")
        if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 1 <= stage <= self.L:
            raise ValueError(f"evaluate: {where}: stage must be an int in 1..{self.L}")
        if self.done:
            raise ValueError(f"evaluate: {where} comes after B^1, which already computed δ^0")
        if kind == "B":
            self._backward(where, int(stage))
        elif kind in ("offload", "prefetch"):
            self._transfer(where, kind, int(stage))
        else:
            self._forward(where, kind, int(stage))

    def _forward(self, where: str, kind: str, k: int) -> None:
        self._need(where, k - 1, f"the input of stage {k}")
        if self.stored[k] is not None:
            raise ValueError(f"evaluate: {where}: a^{k} is already stored; a stage's output is held once")
        if kind == "F_none" and k == 1:
            raise ValueError(f"evaluate: {where} would drop the chain input a^0, which B^1 needs and "
                             "nothing can recompute; use F_ck or F_all")
        if kind == "F_none" and self.stored[k - 1] == "abar":
            raise ValueError(f"evaluate: {where} would drop ā^{k - 1}, the tape B^{k - 1} needs; use F_ck")
        out = self.xb[k] if kind == "F_all" else self.x[k]
        self._compute(where, self.chain.forward_time[k - 1], out, self.chain.forward_overhead[k - 1])
        self.stored[k] = "abar" if kind == "F_all" else "a"
        if kind == "F_none":
            self.stored[k - 1] = None
        if k == self.L and not self.loss_done:
            self.loss_done = True  # Note [The loss]: the backward phase starts with the loss step
            self._compute(f"the loss after {where}", 0.0, self.x[self.L])
            self.grad = self.L
            if self.stored[self.L] == "a":
                self.stored[self.L] = None

    def _backward(self, where: str, k: int) -> None:
        if not self.loss_done:
            raise ValueError(f"evaluate: {where} comes before the loss (the first forward of stage {self.L})")
        if self.grad != k:
            raise ValueError(f"evaluate: {where} needs δ^{k}, but the gradient held is δ^{self.grad}")
        if self.stored[k] != "abar":
            have = "is not stored" if self.stored[k] is None else "is stored without its tape"
            raise ValueError(f"evaluate: {where} needs ā^{k} (run F_all^{k} first); a^{k} {have}")
        if self.on_host[k]:
            raise ValueError(f"evaluate: {where} needs ā^{k}, which is on the host; "
                             f"put ('prefetch', {k + 1}) before it")
        self._need(where, k - 1, f"the input of stage {k}")
        self._compute(where, self.chain.backward_time[k - 1], self.x[k - 1], self.chain.backward_overhead[k - 1])
        self.stored[k] = None
        self.grad = k - 1
        if self.stored[k - 1] == "a":
            self.stored[k - 1] = None
        self.done = k == 1

    def _transfer(self, where: str, kind: str, stage: int) -> None:
        k = stage - 1
        if self.stored[k] is None:
            raise ValueError(f"evaluate: {where}: the input of stage {stage} (a^{k}) is not stored")
        if kind == "offload":
            if self.loss_done:
                raise ValueError(f"evaluate: {where}: offloads must come before the loss "
                                 f"(the first forward of stage {self.L})")
            if self.offloaded[k]:
                raise ValueError(f"evaluate: {where}: a^{k} was offloaded already; each value goes out once")
            self.on_host[k] = self.offloaded[k] = True
            self.forward.append(_Event(where, 0.0, 0.0, self._size(k)))
        else:
            if not self.loss_done:
                raise ValueError(f"evaluate: {where}: prefetches must come after the loss "
                                 f"(the first forward of stage {self.L})")
            if not self.on_host[k]:
                raise ValueError(f"evaluate: {where}: a^{k} is not on the host")
            self.on_host[k] = False
            self.backward.append(_Event(where, 0.0, 0.0, self._size(k)))

    def finish(self) -> None:
        if not self.done:
            state = "before the loss" if not self.loss_done else f"holding δ^{self.grad}"
            raise ValueError(f"evaluate: the ops end {state}, before B^1 computed δ^0")


def _timeline(events: Sequence[_Event], bandwidth: float, budget: Optional[Number]) -> Tuple[float, float, float]:
    """Time one phase: returns (duration, transfer bytes still pending at its end, peak).

    ``queued`` bytes were pending at time ``since``; the channel drains them continuously.
    """
    now = since = queued = 0.0
    peak = 0.0
    for event in events:
        pending = max(queued - bandwidth * (now - since), 0.0) if queued else 0.0
        if event.transfer is not None:
            queued, since = pending + event.transfer, now
            continue
        start, held = now, event.memory + pending if pending else event.memory
        if budget is not None:
            if event.memory > budget:
                raise ValueError(f"evaluate: {event.where} holds {event.memory} even with no transfer "
                                 f"in flight, more than the budget {budget}")
            if held > budget:
                # It starts when the transfers in flight have freed just enough: at exactly the budget
                # (recomputing the pending bytes at that time could round above it).
                start = max(now, since + (queued + event.memory - budget) / bandwidth)
                held = budget
        peak = max(peak, held)
        now = start + event.duration
    pending = max(queued - bandwidth * (now - since), 0.0) if queued else 0.0
    return now, pending, peak


def _check_positive(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
        raise ValueError(f"evaluate: {name} = {value!r}; it must be a positive finite number or None")


def evaluate(chain: Chain, ops: Sequence[Op], *, budget: Optional[Number] = None,
             offload_bandwidth: Optional[float] = None) -> Tuple[float, float]:
    """Replay ``ops`` on ``chain`` with exact sizes; return ``(makespan, peak)``.

    ``peak`` is the largest memory any op (or the loss step) holds, including the input ``a^0``;
    ``makespan`` is the sum of op durations plus any wait for transfers. See Note [What each op
    holds] and Note [Offload and prefetch] in this module for the model.

    Args:
        chain: the chain's costs.
        ops: ``(kind, stage)`` pairs; kinds ``F_all``, ``F_ck``, ``F_none``, ``B``, ``offload``,
            ``prefetch``; stages ``1..L``.
        budget: with transfers, ops wait until they fit in it. With or without, an op that cannot
            fit even when no transfer is in flight raises ValueError.
        offload_bandwidth: bytes per time unit of the host link; required when ``ops`` transfer.

    Raises:
        ValueError: naming the first op that is invalid (its inputs are missing or on the host,
            it recomputes a stored output, it comes after ``B^1``...) and why, or saying that the
            sequence ends before ``δ^0`` is computed.

    Complexity: ``O(len(ops) * L)``.
    """
    if not isinstance(chain, Chain):
        raise ValueError(f"evaluate: chain must be a dtr.planner.Chain, got {type(chain).__name__}")
    _check_positive("budget", budget)
    _check_positive("offload_bandwidth", offload_bandwidth)
    walk = _Walk(chain)
    for index, op in enumerate(ops):
        walk.apply(index, op)
    walk.finish()
    transfers = any(e.transfer is not None for e in walk.forward + walk.backward)
    if transfers and offload_bandwidth is None:
        raise ValueError("evaluate: the ops offload and prefetch; pass offload_bandwidth=<bytes per time unit>")
    bandwidth = float(offload_bandwidth or 1.0)  # without transfers nothing waits on it
    forward_time, forward_debt, forward_peak = _timeline(walk.forward, bandwidth, budget)
    backward_time, backward_debt, backward_peak = _timeline(walk.backward[::-1], bandwidth, budget)
    if transfers:
        makespan = forward_time + (forward_debt + backward_debt) / bandwidth + backward_time
    else:
        makespan = math.fsum(e.duration for e in walk.forward + walk.backward)
    return makespan, max(forward_peak, backward_peak)
