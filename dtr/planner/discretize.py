"""Memory discretization for the DPs: sizes become whole memory units, always rounded up.

A budget ``M`` split into ``count`` units gives units of ``M / count``; a size ``v`` takes
``ceil(v * count / M)`` units, computed exactly (``fractions.Fraction`` represents every float and
int exactly). Rounding up means a plan that fits in units fits in bytes: the sum of the true sizes
is at most the sum of the rounded ones. The price is up to one unit per stored value (0.2% of the
budget each at 500 units).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, NamedTuple

from dtr.planner.chain import Chain, Number

__all__ = ["Units", "to_units", "exact_sizes"]


class Units(NamedTuple):
    """A chain in memory units, indexed by stage; index ``L+1`` is the loss (zero sizes).

    ``x`` and ``xb`` run over ``0..L+1``; ``of`` and ``ob`` over ``1..L+1`` (index 0 is 0).
    """

    x: List[int]
    xb: List[int]
    of: List[int]
    ob: List[int]


def _ceil_units(value: Number, count: int, budget: Fraction) -> int:
    return math.ceil(Fraction(value) * count / budget)


def to_units(chain: Chain, budget: Number, count: int) -> Units:
    """Round every size of ``chain`` up to units of ``budget / count``. ``O(L)``."""
    total = Fraction(budget)
    x, xb = chain.activation_sizes()

    def convert(values: List[Number]) -> List[int]:
        return [_ceil_units(v, count, total) for v in values]

    return Units(convert(x) + [0], convert(xb) + [0],
                 [0] + convert(list(chain.forward_overhead)) + [0],
                 [0] + convert(list(chain.backward_overhead)) + [0])


def exact_sizes(chain: Chain) -> Units:
    """The sizes of ``chain`` in the layout of :class:`Units`, not rounded (for exact bounds)."""
    x, xb = chain.activation_sizes()
    return Units(x + [0], xb + [0], [0, *chain.forward_overhead, 0], [0, *chain.backward_overhead, 0])
