"""The host tier: swapping a storage out to host memory as an alternative to evicting it.

Note [Swap or evict]
~~~~~~~~~~~~~~~~~~~~
When the budget is exceeded, every resident unlocked storage is a candidate. A recomputable one
can be evicted, at the cost the heuristic puts in its score (for the DTR family, the replay
cost of the storage and its evicted neighbourhood, per byte and staleness); any one can be
swapped (copied to the host and back later), at ``bytes / bandwidth`` per the same byte and
staleness, if the host tier has room. That is the copy back, which the program may wait for;
the copy out runs beside compute on an accelerator (the simulator counts swaps the same way),
and charging it too would evict tensors whose copy back costs less than their recomputation
(docs/runtime.md, "Swapping"). Each candidate takes the cheaper of the two, and the cheapest
candidate goes first (the keys are ``eviction.Rescoring``'s). Storages the engine cannot
recompute (outputs of ops with side effects, storages whose lineage was cut) can only be
swapped. The comparison is exact for scores of the form cost / (bytes * staleness) (h_DTR,
h_DTR^eq, h_DTR-local, MSPS); other heuristics' scores are compared as they are.

A swapped storage comes back on access (a synchronous swap-in, counted as a stall), or earlier:
each block logs when it had to swap in which storage (by storage id, which the same program
assigns alike every step), and the next block prefetches those storages ahead of that point,
early enough to cover the transfer by the recorded cost of the ops in between, and only if
they fit in the budget without evicting anything. One that does not fit when it falls due
waits for the room that later ops free (a backward pass frees activations as it goes); each op,
every waiting storage that fits is brought back, in the order they are needed. A prefetch
that comes too late to be covered by the ops left before its need costs the uncovered part of
the transfer (``late_seconds``, an estimate from the previous block's op costs, which the
simulator counts as a stall). A prefetched storage that the block then reads is logged too, at
the clock it was needed: a block whose prefetches all arrived in time swaps nothing in
synchronously, and the one after it must still know what to prefetch. One it never reads is
not logged, so a prefetch the program stopped needing is not repeated.

Note [Needed soon]
~~~~~~~~~~~~~~~~~~
A storage whose prefetch clock has passed and whose need has not (by the previous block's log)
is about to be read: swapped out now, it comes back synchronously, since its prefetch is
behind the block, and evicted, it is replayed. So while ``needed_soon`` says so, an ordinary
candidate is a last resort of the swap-or-evict search (``PROTECTED``, Note [Eviction tiers]).
Without it, the room made before an op just ahead of such a need picks those storages first
whenever they are the stalest: on the bench LSTM's trace at 0.4 of its peak, the room made
before the fourth layer would swap out the earlier layers' final hidden states, which the
``stack`` right after reads, in every step after the first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple

from dtr.core.storage import RESIDENT, SWAPPED

if TYPE_CHECKING:
    from dtr.core.runtime import Runtime

__all__ = ["HostTier", "SwapLog"]

Need = Tuple[int, int, int]  # (clock at which it was needed, storage id, bytes)


class SwapLog:
    """What one block did that the next one can learn from: its synchronous swap-ins, and the
    prefetches it then read, each as ``(clock, storage id, bytes)`` with the clock at which
    the storage was needed; and the cost of each op by clock."""

    def __init__(self) -> None:
        self.swap_ins: List[Need] = []
        self.costs: List[float] = []  # costs[t - 1]: cost of the op that advanced the clock to t
        # Prefetched storages not read yet -> their need. A prefetch is logged when the block
        # reads the storage (``read``); one it never reads is forgotten (``seal``).
        self._unread: Dict[Any, Need] = {}
        self.prefetched: List[Need] = []
        self._prefix: Optional[List[float]] = None  # cumulative costs, for cost_between

    def prefetch(self, need: Need, storage: Any) -> None:
        """``storage`` was prefetched for ``need`` (from the previous block)."""
        self._unread[storage] = need

    def read(self, storage: Any) -> None:
        """The block read ``storage`` after prefetching it."""
        need = self._unread.pop(storage, None)
        if need is not None:
            self.prefetched.append(need)

    def seal(self) -> None:
        """At the end of the block: forget the prefetches it never read."""
        self._unread.clear()

    def prefetch_schedule(self, bandwidth: float) -> Dict[int, List[Need]]:
        """clock -> the needs to prefetch once the op that advanced the clock to it has
        completed, in the order they are needed. A storage needed at clock ``t`` (swapped in
        before op ``t + 1`` ran) is prefetched at the latest clock ``c`` such that ops
        ``c + 1 .. t`` cost at least the transfer time (``c = t`` if the transfer costs nothing)."""
        self.seal()
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

    def cost_between(self, start: int, end: int) -> float:
        """Recorded cost of ops ``start + 1 .. end`` (of a finished block)."""
        prefix = self._prefix
        if prefix is None:
            prefix = self._prefix = [0.0]
            for c in self.costs:
                prefix.append(prefix[-1] + c)
        last = len(prefix) - 1
        return prefix[max(0, min(end, last))] - prefix[max(0, min(start, last))]


class HostTier:
    """Host memory of one runtime (one block): swapping out and back in, the swapped storages'
    handles and bytes, the copies in flight each way, and the prefetch schedule learnt from the
    previous block. Given to ``Runtime(..., host=...)``, which ``attach``es it; it changes the
    runtime's state only through the runtime's primitives (``_charge``, ``_uncharge``,
    ``_load``, ``_unload``, ``_evict_to``).

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
        self._by_sid: Dict[int, Any] = {}  # sid -> swapped Storage
        self.log = SwapLog()
        self._previous = previous
        self._schedule = previous.prefetch_schedule(self.bandwidth) if previous is not None else {}
        # sid -> the (prefetch clock, need clock) spans of its needs (Note [Needed soon]).
        self._spans: Dict[int, List[Tuple[int, int]]] = {}
        for start, needs in self._schedule.items():
            for t, sid, _ in needs:
                self._spans.setdefault(sid, []).append((start, t))
        # (storage, need) due for prefetching that did not fit yet, in the order they are needed.
        self._waiting: List[Tuple[Any, Need]] = []
        self.late_seconds = 0.0  # estimated transfer time prefetches left uncovered
        # Swapped out, and still charged until their copy is done (its memory is still read).
        self.outgoing: List[Any] = []
        # Prefetched storages whose copy may still be landing -> the executor's pending handle.
        # The runtime reads it as ``Runtime.arriving``: every read of their values lands them
        # first (``arrive``, Note [Arrival]), and values it drops leave.
        self.arriving: Dict[Any, Any] = {}
        self._rt: Runtime = None  # type: ignore[assignment]  # set by ``attach``
        self._executor: Any = None

    def attach(self, runtime: Runtime) -> None:
        """Serve ``runtime`` (its constructor calls this)."""
        self._rt = runtime
        self._executor = runtime.executor

    def swap_cost(self, nbytes: int) -> float:
        """Seconds the program may wait to get ``nbytes`` back (Note [Swap or evict])."""
        return nbytes / self.bandwidth

    def fits(self, nbytes: int) -> bool:
        return self.limit is None or self.bytes + nbytes <= self.limit

    def needed_soon(self, sid: int, clock: int) -> bool:
        """Whether the previous block needed storage ``sid`` within its prefetch lead of
        ``clock`` (Note [Needed soon])."""
        spans = self._spans.get(sid)
        if spans is None:
            return False
        for start, t in spans:
            if start <= clock <= t:
                return True
        return False

    # ------------------------------------------------------------------ copies

    def arrive(self, cells: Iterable[Any]) -> None:
        """Before the values of ``cells`` are read: wait (on the device, not the host) for the
        copies of those whose storage was prefetched. Callers check ``arriving`` first.

        Note [Arrival]
        ~~~~~~~~~~~~~~
        A prefetch starts the copy back and returns at once, so that the copy overlaps the
        ops before the storage's next read; on CUDA that read must be ordered after the copy.
        So a prefetched storage is in ``arriving`` until its first read, and every read goes
        through here: op inputs (``Runtime.acquire``), replays, swap-outs, the end of the
        block. A storage whose values are dropped first (evicted, swapped out again,
        released) just leaves ``arriving``. The runtime holds the same dict
        (``Runtime.arriving``), so that an op's read checks for copies in flight with one
        lookup.
        """
        arriving = self.arriving
        for c in cells:
            s = c.storage
            pending = arriving.pop(s, None)
            if pending is not None:
                self._executor.arrive(pending)
                self.log.read(s)  # the prefetch was needed: the next block repeats it

    def swap_out(self, s: Any) -> None:
        """Copy the resident ``s`` to the host instead of evicting it (Note [Swap or evict])."""
        ex = self._executor
        pending = self.arriving.pop(s, None)
        if pending is not None:  # prefetched, never read: its copy back lands before this copy out
            ex.arrive(pending)
        handle = ex.swap_out(s.value)
        rt = self._rt
        rt._unload(s, SWAPPED)
        self.handles[s] = handle
        self._by_sid[s.sid] = s
        self.bytes += s.nbytes
        if self.bytes > self.peak:
            self.peak = self.bytes
        c = rt.counters
        c.swaps_out += 1
        c.swap_bytes_out += s.nbytes
        if ex.swap_done(handle):
            rt._uncharge(s.nbytes)
        else:
            self.outgoing.append(s)

    def outgoing_bytes(self) -> int:
        """Bytes swapped out whose copy is still running, and so still charged."""
        return sum(s.nbytes for s in self.outgoing)

    def poll_outgoing(self, wait: bool = False) -> None:
        """Stop charging swapped-out storages whose copy has finished (with ``wait``: the
        oldest one at least, waiting for it)."""
        ex = self._executor
        done = []
        for i, s in enumerate(self.outgoing):
            handle = self.handles.get(s)
            if handle is None or ex.swap_done(handle):
                done.append(i)
            elif wait and not done:
                ex.swap_wait(handle)
                done.append(i)
        for i in reversed(done):
            self._rt._uncharge(self.outgoing.pop(i).nbytes)

    def swap_in(self, s: Any, prefetch: bool) -> None:
        """Bring the swapped ``s`` back: synchronously (the program waits; evicts to the
        budget), or as a prefetch whose copy lands before its first read (``arrive``)."""
        rt, ex = self._rt, self._executor
        if prefetch:
            value, self.arriving[s] = ex.prefetch(self.handles[s])
            waited = 0.0
        else:
            value, waited = ex.swap_in(self.handles[s])
        if s in self.outgoing:  # back before its copy out was done: it was never freed
            self.outgoing.remove(s)
        else:
            rt._charge(s.nbytes)
        self._remove(s)
        rt._load(s, value)
        c = rt.counters
        c.swap_bytes_in += s.nbytes
        if prefetch:
            c.prefetches += 1
            return
        c.swaps_in += 1
        c.swap_stall_seconds += waited
        self.log.swap_ins.append((rt.clock, s.sid, s.nbytes))
        if rt.budget is not None and rt.memory > rt.budget:
            s.locks += 1  # its reader has not locked it yet
            try:
                rt._evict_to(rt.budget, "swapping a tensor back in")
            finally:
                s.locks -= 1

    def leave(self, s: Any) -> None:
        """The swapped ``s`` left the graph: forget its copy."""
        if s in self.outgoing:
            self.outgoing.remove(s)
            self._rt._uncharge(s.nbytes)
        self._remove(s)

    def _remove(self, s: Any) -> None:
        del self.handles[s]
        del self._by_sid[s.sid]
        self.bytes -= s.nbytes

    # ------------------------------------------------------------------ prefetching

    def after_op(self) -> None:
        """After each op: stop charging finished copies out, and prefetch what the previous
        block needed next, as soon as it fits without evicting anything."""
        rt = self._rt
        if self.outgoing:
            self.poll_outgoing()
        due = self._due(rt.clock)
        if due:
            self._waiting += due
            self._waiting.sort(key=_by_need)
        if self._waiting:
            keep = []
            for s, need in self._waiting:
                if s.state is not SWAPPED:  # back already, or gone
                    continue
                if rt.budget is not None and rt.memory + s.nbytes > rt.budget:
                    keep.append((s, need))
                    continue
                self.swap_in(s, prefetch=True)
                self._prefetched(s, need, rt.clock)
            self._waiting = keep

    def _due(self, clock: int) -> List[Tuple[Any, Need]]:
        """Swapped storages the previous block's log says to prefetch at ``clock``, each with
        its need."""
        needs = self._schedule.get(clock)
        if not needs:
            return []
        by_sid = self._by_sid
        return [(by_sid[n[1]], n) for n in needs if n[1] in by_sid]

    def _prefetched(self, storage: Any, need: Need, clock: int) -> None:
        """``storage`` was brought back at ``clock`` for ``need``: note it (the log keeps it
        once the block reads the storage), and charge what the ops left before the need (by
        the previous block's costs) cannot cover."""
        self.log.prefetch(need, storage)
        uncovered = storage.nbytes / self.bandwidth - self._previous.cost_between(clock, need[0])
        if uncovered > 0:
            self.late_seconds += uncovered

    # ------------------------------------------------------------------ end of block

    def land(self) -> None:
        """At the end of the block, also one that failed: land every prefetch (values that
        outlive the block must be readable), and seal the log."""
        for pending in self.arriving.values():
            self._executor.arrive(pending)
        self.arriving.clear()
        self.log.seal()  # the log outlives the block: it drops its storages

    def clear(self) -> None:
        """After the block's lineage was cut: forget the copies, which nothing can read now."""
        self.handles.clear()
        self._by_sid.clear()
        self.bytes = 0
        self.outgoing.clear()

    def check(self, storages: Iterable[Any]) -> None:
        """Assert that the tier agrees with the runtime's ``storages``. O(storages); for tests."""
        for s in self.arriving:  # Note [Arrival]: only resident values can be in flight
            assert s.state is RESIDENT and s.value is not None, f"{s} is arriving but not resident"
        swapped = 0
        for s in storages:
            if s.state is SWAPPED:
                assert s in self.handles, f"{s} is swapped but the host tier has no copy of it"
                swapped += s.nbytes
        assert swapped == self.bytes, f"host tier counts {self.bytes} bytes, swapped storages {swapped}"
        if self.limit is not None:
            assert self.bytes <= self.limit, "host tier over its limit"


def _by_need(entry: Tuple[Any, Need]) -> Need:
    return entry[1]
