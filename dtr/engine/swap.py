"""The host tier: swapping a storage out to host memory as an alternative to evicting it.

Note [Swap or evict]
~~~~~~~~~~~~~~~~~~~~
When the budget is exceeded, every resident unlocked storage is a candidate. A recomputable one
can be evicted, at the cost the heuristic puts in its score (for the DTR family, the replay cost
of the storage and its evicted neighbourhood, per byte and staleness); any one can be swapped
(copied to the host and back later), at ``bytes / bandwidth`` per the same byte and staleness,
if the host tier has room. That is the copy back, which the program may wait for; the copy out
runs beside compute on an accelerator (the simulator counts swaps the same way). An earlier
version charged both directions: in simulation it then evicted tensors whose copy back would
have cost less than their recomputation, and the combination lost to swapping alone. Each candidate takes the cheaper of the two, and the
cheapest candidate goes first. Storages the engine cannot recompute (outputs of ops with side
effects, storages whose lineage was cut) can only be swapped. The comparison is exact for scores
of the form cost / (bytes * staleness) (h_DTR, h_DTR^eq, h_DTR-local, MSPS); other heuristics'
scores are compared as they are.

A swapped storage comes back on access (a synchronous swap-in, counted as a stall), or earlier:
each block logs when it had to swap in which storage (by storage id, which the same program
assigns alike every step), and the next block prefetches those storages ahead of that point,
early enough to cover the transfer by the recorded cost of the ops in between, and only if
they fit in the budget without evicting anything. One that does not fit when it falls due
waits, in order, for the room that ops free (a backward pass frees activations as it goes):
prefetching only at the due clock, the bench transformer at half its peak prefetched nothing
in a whole step and swapped 32 tensors in synchronously.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

__all__ = ["HostTier", "SwapLog"]

Need = Tuple[int, int, int]  # (clock at which it was needed, storage id, bytes)


class SwapLog:
    """What one block did that the next one can learn from: its synchronous swap-ins and its
    prefetches, each as ``(clock, storage id, bytes)`` with the clock at which the storage was
    needed, and the cost of each op by clock."""

    def __init__(self) -> None:
        self.swap_ins: List[Need] = []
        # Prefetched storages, with the clock their schedule entry said they are needed at: a
        # block whose prefetches all arrived in time swaps nothing in synchronously, and the
        # block after it must still know what to prefetch.
        self.prefetched: List[Need] = []
        self.costs: List[float] = []  # costs[t - 1]: cost of the op that advanced the clock to t

    def prefetch_schedule(self, bandwidth: float) -> Dict[int, List[Need]]:
        """clock -> the needs to prefetch once the op that advanced the clock to it has
        completed, in the order they are needed. A storage needed at clock ``t`` (swapped in
        before op ``t + 1`` ran) is prefetched at the latest clock ``c`` such that ops
        ``c + 1 .. t`` cost at least the transfer time (``c = t`` if the transfer costs nothing)."""
        schedule: Dict[int, List[Need]] = {}
        for need in sorted(self.swap_ins + self.prefetched):
            t, _, nbytes = need
            cost = nbytes / bandwidth
            start, covered = t, 0.0
            while start > 0 and covered < cost:
                covered += self.costs[start - 1] if start <= len(self.costs) else 0.0
                start -= 1
            schedule.setdefault(start, []).append(need)
        return schedule


class HostTier:
    """Host memory of one runtime: the swapped storages' handles, their bytes, the swap policy's
    costs, and the prefetch schedule learnt from the previous block.

    Args:
        bandwidth: bytes per second of one transfer direction.
        limit: host bytes allowed (None: no limit); beyond it the engine evicts instead.
        previous: the previous block's log, or None.
    """

    def __init__(self, bandwidth: float, limit: Optional[int], previous: Optional[SwapLog] = None) -> None:
        if not bandwidth > 0:
            raise ValueError(f"dtr: swap bandwidth must be positive, got {bandwidth!r}")
        self.bandwidth = float(bandwidth)
        self.limit = limit
        self.bytes = 0
        self.peak = 0
        self.handles: Dict[Any, Any] = {}  # swapped Storage -> the executor's host handle
        self.by_sid: Dict[int, Any] = {}  # sid -> swapped Storage
        self.log = SwapLog()
        self._schedule = previous.prefetch_schedule(self.bandwidth) if previous is not None else {}
        # (storage, need) due for prefetching that did not fit yet, in the order they fell due.
        self.waiting: Deque[Tuple[Any, Need]] = deque()

    def swap_cost(self, nbytes: int) -> float:
        """Seconds the program may wait to get ``nbytes`` back (Note [Swap or evict])."""
        return nbytes / self.bandwidth

    def fits(self, nbytes: int) -> bool:
        return self.limit is None or self.bytes + nbytes <= self.limit

    def add(self, storage, handle) -> None:
        self.handles[storage] = handle
        self.by_sid[storage.sid] = storage
        self.bytes += storage.nbytes
        if self.bytes > self.peak:
            self.peak = self.bytes

    def remove(self, storage) -> Any:
        handle = self.handles.pop(storage)
        del self.by_sid[storage.sid]
        self.bytes -= storage.nbytes
        return handle

    def due(self, clock: int) -> List[Tuple[Any, Need]]:
        """Swapped storages the previous block's log says to prefetch at ``clock``, each with
        its need."""
        needs = self._schedule.get(clock)
        if not needs:
            return []
        by_sid = self.by_sid
        return [(by_sid[n[1]], n) for n in needs if n[1] in by_sid]
