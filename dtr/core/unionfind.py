"""Union-find over evicted storages with a running cost per set (the DTR paper's e~*).

Evicted neighbours are merged into one set whose ``cost`` is the sum of its members' compute
costs. Union-find cannot split, so the paper approximates a split when a member is
rematerialized: subtract its cost from its set and give it a fresh set next time it is
evicted. The links it leaves behind are the "phantom dependencies" of section 4.1.

Everything is iterative (remat chains can be thousands long) and unions are by size, so
``find`` is amortized near-constant. A storage evicted next to an evicted neighbour joins that
set through its root (``attach``) instead of bringing a node of its own: one object fewer per
eviction, and every object the engine keeps costs time in the cyclic collector's full passes
(docs/runtime.md). The sets and their costs are the same.
"""

from __future__ import annotations

from typing import Optional

from dtr.core.collector import untrack

__all__ = ["UFNode", "attach", "find", "union"]


class UFNode:
    """A member of a set; the set's data (``cost``, ``size``) is valid on its root only."""

    __slots__ = ("parent", "cost", "size")

    def __init__(self, cost: float) -> None:
        self.parent: Optional[UFNode] = None
        self.cost = cost
        self.size = 1
        # Nodes point only up their trees, so they are never in a cycle: reference counting
        # frees them, and the cyclic collector need not visit them (dtr/core/collector.py).
        untrack(self)


def find(node: UFNode) -> UFNode:
    """The root of ``node``'s set, compressing the path on the way. O(α(n)) amortized."""
    root = node
    while root.parent is not None:
        root = root.parent
    while node is not root:
        nxt = node.parent
        node.parent = root
        node = nxt  # type: ignore[assignment]
    return root


def union(a: UFNode, b: UFNode) -> UFNode:
    """Merge the sets of ``a`` and ``b`` (summing their costs); returns the new root."""
    ra, rb = find(a), find(b)
    if ra is rb:
        return ra
    if ra.size < rb.size:
        ra, rb = rb, ra
    rb.parent = ra
    ra.size += rb.size
    ra.cost += rb.cost
    return ra


def attach(node: UFNode, cost: float) -> UFNode:
    """Add a member of compute cost ``cost`` to ``node``'s set; returns the set's root, which
    the member keeps as its handle (it has no node of its own)."""
    root = find(node)
    root.cost += cost
    root.size += 1
    return root
