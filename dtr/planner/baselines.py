"""Baseline schedules in the planners' vocabulary, for comparison with the DP.

Each returns an op list; :func:`dtr.planner.evaluate` gives its makespan and peak. All are ``O(L)``
ops long except :func:`recompute_all` (``O(L^2)``).
"""

from __future__ import annotations

import math
from typing import List, Sequence

from dtr.planner.chain import Chain, Op

__all__ = ["store_all", "recompute_all", "checkpoint_sequential", "chen_sqrt"]


def store_all(chain: Chain) -> List[Op]:
    """Plain autograd: ``F_all`` every stage, then every backward. Fastest, largest peak."""
    L = chain.length
    return [("F_all", k) for k in range(1, L + 1)] + [("B", k) for k in range(L, 0, -1)]


def recompute_all(chain: Chain) -> List[Op]:
    """Keep only ``a^0``; before each ``B^k`` recompute ``a^(k-1)`` from the input (smallest memory
    of the single-checkpoint schedules, ``L(L+1)/2`` forwards)."""
    L = chain.length
    ops: List[Op] = [("F_ck", 1)] + [("F_none", k) for k in range(2, L + 1)]
    for k in range(L, 0, -1):
        if k > 1:
            ops += [("F_ck", 1)] + [("F_none", j) for j in range(2, k)]
        ops += [("F_all", k), ("B", k)]
    return ops


def _single_pass(L: int, starts: Sequence[int]) -> List[Op]:
    """Segments beginning at ``starts`` (ascending, first 1): every segment but the last runs
    ``F_ck`` + ``F_none`` forward and is recomputed with ``F_all`` just before its backward; the last
    runs ``F_all`` once. Each forward outside the last segment runs twice (Chen et al. 2016)."""
    bounds = list(starts) + [L + 1]
    ops: List[Op] = []
    for lo, hi in zip(bounds[:-2], bounds[1:-1]):
        ops += [("F_ck", lo)] + [("F_none", k) for k in range(lo + 1, hi)]
    ops += [("F_all", k) for k in range(bounds[-2], L + 1)] + [("B", k) for k in range(L, bounds[-2] - 1, -1)]
    for lo, hi in zip(reversed(bounds[:-2]), reversed(bounds[1:-1])):
        ops += [("F_all", k) for k in range(lo, hi)] + [("B", k) for k in range(hi - 1, lo - 1, -1)]
    return ops


def checkpoint_sequential(chain: Chain, segments: int) -> List[Op]:
    """``torch.utils.checkpoint.checkpoint_sequential(functions, segments)``: ``L // segments``
    stages per checkpointed segment, the remainder in the last (plain) segment."""
    L = chain.length
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= L:
        raise ValueError(f"checkpoint_sequential: segments = {segments!r}; it must be an int in 1..{L}")
    size = L // segments
    return _single_pass(L, [1 + size * i for i in range(segments)])


def chen_sqrt(chain: Chain) -> List[Op]:
    """Chen et al.'s ``√L`` schedule: a checkpoint every ``ceil(√L)`` stages."""
    L = chain.length
    size = math.ceil(math.sqrt(L))
    return _single_pass(L, list(range(1, L + 1, size)))
