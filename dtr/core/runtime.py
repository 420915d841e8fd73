"""The DTR runtime: the state machine a driver calls, and the state it keeps (storages, locks,
references, charged bytes, the clock).

The work it delegates lives in modules of its own, as functions of the runtime or objects it
owns: which storage to evict (eviction.py, candidates.py), rematerialization
(rematerialize.py), lineage release (lineage.py), the host tier (host_tier.py), peak meters
(meter.py), and the invariant checks (invariants.py).

A driver calls, under ``runtime.lock``:

1. ``acquire(cells)``: lock the storages an op reads and make the cells defined, replaying
   evicted ancestors as needed (iteratively, with counted locks);
2. run the op itself (the runtime never runs kernels, only ``executor.replay``);
3. ``complete(record, mutated, fresh)``: register the outputs, make room under the budget by
   evicting the lowest-scoring storages, and unlock the inputs (or ``unlock(cells)`` if the op
   failed).

Wrappers are tracked with ``track``; when one dies its storage loses a reference (queued by
a weakref callback and applied by ``drain`` at the next entry, so that a garbage collection
in the middle of runtime code can never re-enter it).

Invariants (checked by ``check_invariants``; cited by number in the code):

1. Charged bytes (resident storages, and the gradients the program holds: ``hold``) ≤ budget,
   except inside one op: its inputs and outputs must be resident at once. The driver makes
   room for an op's outputs before it runs when it can tell their size (``reserve``), and
   ``complete`` evicts after it in any case.
2. A locked storage is never evicted or released, except an old version by the op that
   wrote or rebuilt its successor (its bytes are the successor's; Note [Versions]).
3. Every evicted storage can be recomputed: its parent record is replayable and the record's
   input storages are not released (``uses`` keeps them).
4. Replays are pure (see storage.py, Note [Versions]; the executor restores RNG state).
5. A view cell is defined only while its storage is resident.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from itertools import chain
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from dtr.core import collector, invariants, lineage
from dtr.core.candidates import CandidateIndex
from dtr.core.eviction import Rescoring, keyed, out_of_budget
from dtr.core.executor import Executor
from dtr.core.heuristics import Heuristic
from dtr.core.lineage import release
from dtr.core.meter import PeakMeter
from dtr.core.outputs import fit, new_view, wire
from dtr.core.rematerialize import keep_for_reads, let_go, materialize
from dtr.core.storage import (
    EVICTED, RELEASED, RESIDENT, Cell, OpRecord, State, Storage, carry_views, translate,
)
from dtr.core.host_tier import HostTier
from dtr.core.telemetry import Counters
from dtr.errors import OutOfBudgetError

__all__ = ["Ref", "Runtime"]


class Ref(weakref.ref):
    """A program-held wrapper's link to its cell; the callback tells the runtime it died."""

    __slots__ = ("cell",)


def _noop(storage: Storage) -> None:
    pass


_CLOSED = float("inf")  # the first storage id of a closed protection window (``protect_new``)
_weak = weakref.ref


class Runtime:
    """One DTR engine instance: the storages of one ``dtr.budget`` block.

    Args:
        budget: the user's limit in bytes, or None to track without evicting for budget.
        heuristic: scoring object (see heuristics.py).
        executor: replays records (see ``Executor``).
        untracked: keep records out of Python's cyclic collector (Note [Untracked records]);
            the caller must then ``close()`` the runtime.
        max_recompute: raise ``ThrashingError`` once replays have cost more than this many
            times the block's own ops (Note [Thrashing] in rematerialize.py); None: never.
        host: a host tier to swap to as well as evict (``dtr.budget(swap=True)``), or None.
        outside: bytes outside the engine that the limit covers too (Note [The budget]).
    """

    # Note [Runtime slots]
    # ~~~~~~~~~~~~~~~~~~~~
    # Every field is a slot, declared here: each op reads and writes a dozen of them
    # (``memory``, ``clock``, ``resident``, ...), and dtr_ext/hotpath.c does so at the offsets
    # ``bind`` takes from their member descriptors, with no attribute lookup (in a subclass,
    # which may shadow a field, by attribute). A field hotpath.c reads that is not a slot
    # turns the native path off (``dtr.eager.native.WHY_NOT`` says which).
    __slots__ = (
        "limit",
        "outside",
        "budget",
        "max_recompute",
        "work",
        "heuristic",
        "_score",
        "_on_evict",
        "_on_materialize",
        "_on_release",
        "_keyed",
        "_index",
        "native_ordinary",
        "native_release",
        "executor",
        "_views_alias_data",
        "lock",
        "memory",
        "_high",
        "_earlier_peak",
        "_meters",
        "held",
        "held_bytes",
        "clock",
        "counters",
        "closed",
        "resident",
        "_all",
        "_refs",
        "_dead",
        "_sid",
        "_protected_from",
        "checkpoints",
        "_backward",
        "kept_by_access",
        "versions_after_close",
        "wrappers_after_close",
        "kept_after_close",
        "host",
        "arriving",
        "_yielding",
        "unmade",
        "_untrack",
        "_wrapper_died",
        "events",
        "on_op",
        "__weakref__",
    )

    def __init__(
        self,
        budget: Optional[int],
        heuristic: Heuristic,
        executor: Executor,
        *,
        untracked: bool = False,
        max_recompute: Optional[float] = None,
        host: Optional[HostTier] = None,
        outside: int = 0,
    ) -> None:
        # Note [The budget]
        # ~~~~~~~~~~~~~~~~~
        # ``limit`` is the user's limit (None: none). With ``dtr.budget(total=True)`` it also
        # covers ``outside`` bytes the engine does not manage (allocated on the device before
        # the block, or the constants the block reads); ``budget``, what the runtime evicts
        # down to, is what is left of it. The runtime is the one owner of the three
        # (``set_budget``, ``set_outside``): a driver, a plan or an ``Engine`` reads them here.
        # ``budget`` is a field, not a property, as every op reads it.
        if budget is not None and budget < outside:
            raise ValueError(f"dtr: a limit of {budget} bytes is below the {outside} bytes outside the engine")
        self.limit = budget
        self.outside = outside
        self.budget = None if budget is None else budget - outside
        self.max_recompute = max_recompute
        self.work = 0.0  # cost of the ops completed in the block (not replays)
        self.heuristic = heuristic
        self._score = heuristic.score
        self._on_evict = getattr(heuristic, "on_evict", _noop)
        self._on_materialize = getattr(heuristic, "on_materialize", _noop)
        self._on_release = getattr(heuristic, "on_release", _noop)
        self._keyed = keyed(heuristic)
        self._index: Optional[CandidateIndex] = None  # made by the first eviction round
        # The native twins of the index's search (``CandidateIndex``'s ``ordinary``) and of
        # ``lineage.release``, set by a driver whose native path is on before its first op.
        self.native_ordinary: Optional[Callable] = None
        self.native_release: Optional[Callable] = None
        self.executor = executor
        self._views_alias_data = bool(getattr(executor, "views_alias_data", False))
        self.lock = threading.RLock()
        self.memory = 0  # charged bytes: resident storages, copies out in flight, ``held``
        self._high = 0  # Note [Peak meters] in meter.py
        self._earlier_peak = 0
        self._meters: List[PeakMeter] = []
        # Note [Held gradients]
        # ~~~~~~~~~~~~~~~~~~~~~
        # A parameter's ``.grad`` made in the block is handed to the program as a plain tensor
        # (optimizers and DDP must never see a wrapper), so it leaves the graph; but its bytes
        # are memory the step uses, and cannot be evicted. They stay charged, per parameter
        # (``hold``: a new gradient of the same parameter replaces the old one's bytes), until
        # the block ends. A gradient that existed before the block is a constant and is not
        # charged, whatever is accumulated into it.
        self.held: dict = {}  # key (the driver's: a parameter) -> bytes charged for it
        self.held_bytes = 0
        self.clock = 0
        self.counters = Counters()
        self.closed = False
        self.resident: dict = {}  # Storage -> None, in order of becoming resident
        self._all: dict = {}  # every storage not yet released
        self._refs: dict = {}  # id(Ref) -> Ref, for live wrappers
        self._dead: deque = deque()  # cells whose wrapper died, applied by drain()
        self._sid = 0
        self._protected_from = _CLOSED  # storages with a sid from this one on: PROTECTED
        self.checkpoints: Dict[int, int] = {}  # sid -> rank of a loop's checkpoint (``checkpoint``)
        self._backward = False  # the program's ops run in a backward pass (``set_backward``)
        # Storages PROTECTED by the access in flight, not by a plan (Note [Rebuilt twice in one
        # access] in rematerialize.py): ``events.holdings`` tells the two apart.
        self.kept_by_access: set = set()
        # After a failed block, the version counters its later reads compare with (written by
        # ``rematerialize.keep_for_reads``, Note [A failed block's exit]); None otherwise.
        self.versions_after_close: Optional[weakref.WeakKeyDictionary] = None
        self.wrappers_after_close: Optional[weakref.WeakKeyDictionary] = None
        # ... and the storages it kept, dropped with the last wrapper it left (``let_go``).
        self.kept_after_close: "Optional[weakref.WeakSet[Storage]]" = None
        self.host = host
        # The host tier's prefetches in flight (Note [Arrival] in host_tier.py), here so that a read checks for
        # them in one lookup and lands or drops them with no call into the tier; without a
        # host tier, a dict that stays empty.
        self.arriving: dict = host.arriving if host is not None else {}
        # Storages without lineage that give way to their dependents once dead (``_unreferenced``):
        # outputs of ops ``retire`` ended, sums made permanent with ``yielding=True``.
        self._yielding: "weakref.WeakSet[Storage]" = weakref.WeakSet()
        # Outputs of ``defer`` not yet made: their first replay is the op's own work, not a
        # rematerialization (rematerialize._replay).
        self.unmade: "weakref.WeakSet[Storage]" = weakref.WeakSet()
        self._untrack = collector.untrack if untracked else None
        # One bound method for every Ref's callback, not a new one (a kept object) per wrapper.
        self._wrapper_died = self._on_wrapper_death
        # Observers (dtr/core/events.py): ``events`` hears of evictions, replays and failures,
        # which are not per op (every ``dtr.budget`` block sets it, for ``explain``);
        # ``on_op(runtime)`` runs after every op (a memory timeline, ``timeline=True`` only).
        # None unless someone watches, so that each costs one check.
        self.events: Optional[Any] = None
        self.on_op: Optional[Any] = None
        if host is not None:
            host.attach(self)

    @property
    def peak(self) -> int:
        """The most bytes charged at once since the runtime started."""
        return self._high if self._high > self._earlier_peak else self._earlier_peak

    def meter(self) -> PeakMeter:
        """A ``PeakMeter`` of the bytes charged from now on, e.g. during one stage of a program
        (Note [Peak meters] in meter.py); ``stop()`` it when done. O(meters open)."""
        return PeakMeter(self)

    # ------------------------------------------------------------------ wrappers

    def track(self, wrapper: Any, cell: Cell) -> Ref:
        """Count ``wrapper`` as a program reference to ``cell``'s storage until it dies."""
        ref = Ref(wrapper, self._wrapper_died)
        ref.cell = cell
        self._refs[id(ref)] = ref
        cell.storage.refs += 1
        # The ref stays tracked (Note [Untracked records]): a weakref with a callback whose
        # referent dies in a garbage cycle is handled by the collector, which assumes it tracked.
        return ref

    def _on_wrapper_death(self, ref: Ref) -> None:
        # May run on any thread, inside any code (garbage collection): only queue, except for
        # the last wrapper a failed block left, which nothing of this runtime can be using.
        # A runtime the native path drives has hotpath.c's twin as its ``_wrapper_died``.
        if self._refs.pop(id(ref), None) is None:
            return
        if not self.closed:
            self._dead.append(ref.cell)
        elif not self._refs:
            let_go(self)

    def live_refs(self) -> List[Ref]:
        """Refs of wrappers that are still alive."""
        return [r for r in list(self._refs.values()) if r() is not None]

    def drain(self) -> None:
        """Apply queued wrapper deaths: eager eviction or release of unreferenced storages."""
        dead = self._dead
        while dead:
            self._death(dead.popleft())

    def _death(self, cell: Cell) -> None:
        """A wrapper over ``cell`` died: its storage (the newest version) loses a reference."""
        s = cell.storage
        while s.forward is not None:
            s = s.forward
        s.refs -= 1
        if s.refs == 0:
            self._unreferenced(s)

    def _unreferenced(self, s: Storage) -> None:
        if s.locks:
            return
        if s.uses == 0:
            release(self, s)
        elif s.state is RESIDENT and s.recomputable:
            # Eager eviction (paper C.5): the program is done with it, but a recorded op may
            # still need it, so keep the lineage and free the memory. Not when a tensor the
            # program still holds was evicted and is recomputed from this one: evicting it now
            # would turn that one-op recompute into a chain (seen in backward passes, where a
            # gradient dies right after the next one was evicted). It stays a candidate, and
            # the heuristic counts that evicted dependent in its neighbourhood.
            for t in s.dependents:
                if t.refs and t.state is EVICTED:
                    return
            self._evict(s)
            self.counters.eager_evictions += 1
        elif s.state is RESIDENT and s.dependents and s in self._yielding:
            # It cannot be recomputed (FSDP2 freed the parameters it was made from, ``retire``;
            # a permanent sum of gradients, ``make_permanent``) and is kept only for its
            # dependents' replays. When they are resident and no larger, making them permanent
            # instead frees it now: a layer's pre-activation goes, its activation, saved for
            # backward anyway, stays. Only for those: a permanent dependent written in place
            # later makes its own dependents permanent (``before_write``), which can cost more
            # than keeping ``s``; after FSDP2 freed the parameters, or along a backward pass,
            # keeping ``s`` would hold what it made until the block ends.
            deps = list(s.dependents)
            if sum(t.nbytes for t in deps) <= s.nbytes and all(t.state is RESIDENT and not t.locks for t in deps):
                for t in deps:
                    lineage.cut(self, t)

    # ------------------------------------------------------------------ versions

    def resolve(self, cell: Cell) -> Cell:
        """The cell that now stands for ``cell``, following in-place versions (Note [Versions])."""
        while cell.storage.forward is not None:
            if cell.forward is None:
                translate(cell)
            cell = cell.forward  # type: ignore[assignment]
        return cell

    # ------------------------------------------------------------------ ops

    def acquire(self, cells: Sequence[Cell]) -> None:
        """Lock the storages of ``cells`` and make every cell defined and readable (Invariant 2).

        On error (``OutOfBudgetError``, or a failing replay) every lock taken here is undone.
        """
        missing = False
        for c in cells:
            c.storage.locks += 1
            if c.value is None:
                missing = True
        if missing:  # one pass where all are defined: the driver acquires every op's inputs
            try:
                for c in cells:
                    if c.value is None:
                        materialize(self, c)
            except BaseException:
                self.unlock(cells)
                self._settle()
                raise
        if self.arriving:
            self.host.arrive(cells)  # type: ignore[union-attr]

    def unlock(self, cells: Iterable[Cell]) -> None:
        """Undo ``acquire`` (used directly when the op itself failed)."""
        for c in cells:
            s = c.storage
            s.locks -= 1
            if s.locks == 0 and s.refs == 0 and s.uses == 0 and s.state is not RELEASED:
                release(self, s)

    def complete(
        self,
        rec: OpRecord,
        mutated: Sequence[Tuple[Storage, Any]],
        fresh: Sequence[Tuple[int, Any, Optional[Cell]]],
    ) -> List[Cell]:
        """Register the outputs of an op that just ran on acquired inputs ``rec.inputs``.

        ``mutated``: ``(storage, new root value)`` for each storage the op wrote in place; each
        gets a new version, output first in ``rec.outputs`` (Note [Versions]). A storage with no
        lineage cannot be rebuilt for a replay, so mutating one makes ``rec`` non-replayable.
        ``fresh``: one ``(nbytes, value, base)`` per other tensor output; ``base`` is the input
        cell it is a view of, or None for a new storage.

        Evicts down to the budget with inputs and outputs locked (Invariant 1). If that is
        impossible, the fresh outputs are dropped, the inputs unlocked, and
        ``OutOfBudgetError`` raised: as far as the program can tell, the op did not happen
        (an in-place op cannot be undone, but it adds no bytes, so it never lands here).
        """
        try:
            now = self.clock = self.clock + 1
            self.work += rec.cost
            outs: List[Optional[Cell]] = []
            new: List[Storage] = []
            for s, value in mutated:
                if not s.recomputable:
                    rec.replayable = False
            for s, value in mutated:
                s2 = self._new_storage(s.nbytes, rec, len(outs), value, now)
                s2.refs, s.refs = s.refs, 0
                s2.protected, s.protected = s.protected, 0  # the same tensor for the program and a plan
                s.forward = s2
                if self._views_alias_data:
                    carry_views(s)
                # The old version's bytes now belong to the new one: no memory is freed.
                self._evict(s)
                outs.append(s2)
                new.append(s2)
            added = 0
            views = False
            for nbytes, value, base in fresh:
                if base is None:
                    s = self._new_storage(nbytes, rec, len(outs), value, now)
                    outs.append(s)
                    new.append(s)
                    added += nbytes
                else:
                    outs.append(new_view(base.storage, rec, len(outs), value))
                    views = True
            # Note [Views held weakly]
            rec.outputs = [c if type(c) is Storage else _weak(c) for c in outs] if views else outs
            if self.memory > self._high:
                self._high = self.memory
            if added and self.budget is not None and self.memory > self.budget:
                fit(self, rec, new, len(mutated))
            wire(self, rec, new, now)
        finally:
            self.unlock(rec.inputs)
            if self.host is not None:  # the clock moved, also for an op that failed here
                self.host.log.costs.append(rec.cost)
        if self.host is not None:
            self.host.after_op()
        if self.on_op is not None:
            self.on_op(self)
        return outs  # type: ignore[return-value]

    def defer(self, rec: OpRecord, nbytes: int) -> Storage:
        """Register an op that has not run: its one output, ``nbytes`` of a new storage, is born
        evicted, to be computed by replaying ``rec`` if anything reads it (Note [Scattered
        gradients] in eager/scattered.py). ``rec.inputs`` are not acquired: nothing reads them
        now, but the lineage keeps them recomputable for as long as the output lives."""
        now = self.clock = self.clock + 1
        s = self._new_storage(nbytes, rec, 0, None, now)
        self.unmade.add(s)
        rec.outputs = [s]
        wire(self, rec, [s], now)
        self._evict(s)  # never charged beyond this call: it holds no data
        self._after_deferred_op()
        return s

    def defer_view(self, rec: OpRecord, base: Cell) -> Cell:
        """Register a view op that has not run, of ``base``, a cell of an output ``defer`` made
        that has not been made since: its one output is a view cell without a value, made by
        replaying ``rec`` on the base if anything reads it (Note [Outer products] in
        eager/scattered.py). ``base`` is not acquired, so it stays unmade."""
        now = self.clock = self.clock + 1
        c = new_view(base.storage, rec, 0, None)
        rec.outputs = [_weak(c)]  # Note [Views held weakly]
        wire(self, rec, [], now)
        self._after_deferred_op()
        return c

    def _after_deferred_op(self) -> None:
        if self.host is not None:
            self.host.log.costs.append(0.0)  # the clock moved; the op cost nothing yet
            self.host.after_op()
        if self.on_op is not None:
            self.on_op(self)

    def _new_storage(self, nbytes: int, rec: OpRecord, index: int, value: Any, now: int) -> Storage:
        self._sid += 1
        s = Storage(self, self._sid, nbytes, rec.cost, now, rec, index, value)
        if self._backward:
            s.backward = True  # Note [Gradients are a last resort] in eviction.py
        self.resident[s] = None
        self._all[s] = None
        if self._untrack is not None:
            self._untrack(s)  # while it is in the graph: Note [Untracked records]
        self.memory += nbytes
        return s

    def _leave_graph(self, s: Storage) -> None:
        """``s`` is no longer in ``_all``: it goes back to the collector (Note [Untracked
        records]), since whoever still holds it may hold it in a cycle of their own."""
        del self._all[s]
        if self._untrack is not None:
            collector.track(s)

    # ------------------------------------------------------------------ eviction

    def _evict_to(self, target: int, opname: str, best_effort: bool = False) -> None:
        """Evict (or swap out) the next victim of a search until ``memory <= target``
        (eviction.py). With ``best_effort`` the caller catches the ``OutOfBudgetError``
        (``reserve``), so no observer snapshots the failure: under a tight budget that happens
        before most ops.

        Note [Copies in flight]
        ~~~~~~~~~~~~~~~~~~~~~~~
        A storage swapped out stays charged until its copy to the host is done (on a GPU it
        runs on a side stream), so memory does not fall as a round swaps. Once the copies in
        flight would bring memory to the target, the round waits for them instead of picking
        more: the copies run in order on one stream, so another swap-out frees nothing sooner,
        and the storages it takes are what the program reads next. Without the wait, a round
        on CUDA would swap out every candidate before waiting for one."""
        if self.memory <= target:
            return
        host = self.host
        if host is None and self._keyed:
            search = self._index
            if search is None:
                search = self._index = CandidateIndex(self.heuristic, self.native_ordinary, self.checkpoints)
        else:
            search = Rescoring(self._score, host, self.checkpoints)
        search.begin(self.resident, self.clock, self._small_below(), self._protected_from)
        while self.memory > target:
            if host is not None and host.outgoing and self.memory - host.outgoing_bytes() <= target:
                host.poll_outgoing(wait=True)  # Note [Copies in flight]
                continue
            s = search.pick()
            if s is None:
                if host is not None and host.outgoing:  # copies out in flight: wait for one
                    host.poll_outgoing(wait=True)
                    continue
                raise out_of_budget(self, target, opname, best_effort)
            if host is not None and search.swaps(s):
                host.swap_out(s)
            else:
                self._evict_for_budget(s)

    def _small_below(self) -> float:
        """The size under which a storage is in the SMALL tier (Note [Eviction tiers]): 1% of
        the mean resident storage. O(1)."""
        n = len(self.resident)
        return (self.memory - self.held_bytes) / (100 * n) if n else 0.0

    def _settle(self) -> None:
        """After a failure, evict what the failed op had locked until back under the budget
        (Invariant 1), so that the engine is left as if the op had not been attempted."""
        if self.budget is not None and self.memory > self.budget:
            try:
                self._evict_to(self.budget, "cleanup")
            except Exception:  # best effort: the original error is the one to report
                pass

    def _evict_for_budget(self, s: Storage) -> None:
        """Evict ``s`` as a decision of the budget (or a plan): counted, and told to ``events``."""
        self._evict(s)
        self.counters.evictions += 1
        if self.events is not None:
            self.events.evicted(s)

    def _evict(self, s: Storage) -> None:
        if s.slot is not None:  # it has a row in the candidate index
            self._index.drop(s)  # type: ignore[union-attr]
        del self.resident[s]
        self.memory -= s.nbytes
        s.state = EVICTED
        self._drop_values(s)
        self._on_evict(s)

    # The primitives the host tier changes the runtime's state with.

    def _charge(self, nbytes: int) -> None:
        self.memory += nbytes
        if self.memory > self._high:
            self._high = self.memory

    def _uncharge(self, nbytes: int) -> None:
        self.memory -= nbytes

    def _load(self, s: Storage, value: Any) -> None:
        """``s`` is back in memory with ``value`` (charged by the caller)."""
        s.state = RESIDENT
        self.resident[s] = None
        s.value = value
        s.last_access = self.clock

    def _unload(self, s: Storage, state: State) -> None:
        """``s`` leaves memory for ``state`` (uncharged by the caller)."""
        del self.resident[s]
        s.state = state
        self._drop_values(s)

    def _drop_values(self, s: Storage) -> None:
        if self.arriving:
            self.arriving.pop(s, None)  # never read: nothing waits for its copy
        s.value = None
        for w in s.views:
            c = w()
            if c is not None:
                c.value = None
        s.views = ()

    # ------------------------------------------------------------------ lineage (lineage.py)

    def before_write(self, storages: Iterable[Storage]) -> None:
        """Call before an op writes ``storages`` in place (``lineage.before_write``)."""
        lineage.before_write(self, storages)

    def retire(self, storages: Iterable[Storage]) -> None:
        """Call before memory that the parent ops of ``storages`` read, and the engine does not
        own, is freed: those ops can never run again (``lineage.retire``)."""
        lineage.retire(self, storages)

    def flush(self) -> None:
        """Make every storage the program still references resident, and cut its lineage
        (``lineage.flush``)."""
        lineage.flush(self)

    def make_permanent(self, roots: List[Cell], yielding: bool = False) -> None:
        """Make these storages resident together, then cut their lineage
        (``lineage.make_permanent``)."""
        lineage.make_permanent(self, roots, yielding)

    def extract(self, cell: Cell) -> Any:
        """Hand ``cell``'s storage to the program, resident and no longer charged; returns its
        value (``lineage.extract``)."""
        return lineage.extract(self, cell)

    # ------------------------------------------------------------------ last resorts

    def set_backward(self, on: bool) -> None:
        """Say whether the program's ops now run in a backward pass (the driver calls it when
        that changes): storages made while ``on`` are a last resort of eviction for as long
        as they live (Note [Gradients are a last resort] in eviction.py)."""
        self._backward = on

    def protect_new(self, on: bool) -> None:
        """With ``on``, storages made from this call on are evicted (or swapped) only when no
        other storage of ordinary size can go (before the small ones), until the next call: a
        plan's backward stage keeps what it makes (its input's gradient above all) until the
        stage ends, as the plan's accounting assumed. Each call with ``on`` starts a new
        protection window; ``on=False`` ends it."""
        self._protected_from = self.next_sid if on else _CLOSED

    def protect(self, storages: Iterable[Storage]) -> None:
        """Make ``storages`` PROTECTED (Note [Eviction tiers]), as ``protect_new`` does for new
        ones, until ``unprotect``: what a plan holds that the heuristic should leave alone if it
        can (checkpoints, a whole stage's tape; locking them would make budgets infeasible).
        Protections nest, and follow a storage to its newest version (Note [Versions])."""
        for s in storages:
            while s.forward is not None:
                s = s.forward
            s.protected += 1

    def checkpoint(self, storages: Iterable[Storage], rank: int) -> None:
        """Keep ``storages`` as checkpoints of a loop (Note [Loop checkpoints] in eviction.py):
        PROTECTED, and among the last resorts evicted in order of ``rank`` (lowest first).
        A storage checkpointed again keeps its one protection and the higher rank. Ranks are
        kept by storage id until the block ends; the protection follows a storage written in
        place to its newest version (``protect``), the rank does not: that version is kept as
        a plan's checkpoints are, after every ranked one."""
        for s in storages:
            while s.forward is not None:
                s = s.forward
            was = self.checkpoints.get(s.sid)
            if was is None:
                s.protected += 1
                self.checkpoints[s.sid] = rank
            elif rank > was:
                self.checkpoints[s.sid] = rank

    def unprotect(self, storages: Iterable[Storage]) -> None:
        """Undo one ``protect(storages)``."""
        for s in storages:
            while s.forward is not None:
                s = s.forward
            if s.protected:
                s.protected -= 1

    def evict(self, storages: Iterable[Storage]) -> int:
        """Evict those of ``storages`` that can go now (resident, unlocked, recomputable): a
        plan's "drop this once consumed". Returns the bytes freed."""
        freed = 0
        for s in storages:
            if s.state is RESIDENT and not s.locks and s.recomputable:
                self._evict_for_budget(s)
                freed += s.nbytes
        return freed

    def reserve(self, nbytes: int, opname: str) -> None:
        """Make room for ``nbytes`` of outputs an op is about to make (its inputs locked):
        evict down to ``budget - nbytes``, as far as candidates allow. Best effort: where
        nothing more can go the op runs anyway, and ``complete`` decides."""
        if self.budget is not None and self.memory + nbytes > self.budget:
            try:
                self._evict_to(max(self.budget - nbytes, 0), opname, best_effort=True)
            except OutOfBudgetError:
                pass

    def reserve_scratch(self, nbytes: int, opname: str) -> bool:
        """Make room, as ``reserve`` does, for ``nbytes`` of working memory the op about to
        complete allocates and frees itself (an outer product's block of rows: Note [Outer
        products] in eager/scattered.py); whether it fits within the budget. It counts in the
        peak, as charged while the op runs, so that a budget of an unlimited run's peak makes
        room for it without evicting; nothing stays charged. Where it does not fit the caller
        takes another way (the driver makes the product, which ``complete`` refuses loudly if
        that does not fit either). Traces record it in unlimited blocks too, so that a
        simulation under a budget makes the same room."""
        self.reserve(nbytes, opname)
        if self.budget is not None and self.memory + nbytes > self.budget:
            return False
        if self.memory + nbytes > self._high:
            self._high = self.memory + nbytes
        return True

    def hold(self, key: Any, nbytes: int) -> None:
        """Charge ``nbytes`` the program holds under ``key`` (a parameter's gradient made in
        the block) until the block ends, replacing what ``key`` held before (Note [Held
        gradients]); evicts to fit. Raises ``OutOfBudgetError`` (charging nothing new) if the
        rest cannot make room."""
        old = self.held.get(key, 0)
        self.held[key] = nbytes
        self.held_bytes += nbytes - old
        self.memory += nbytes - old
        if self.memory > self._high:
            self._high = self.memory
        if nbytes > old and self.budget is not None and self.memory > self.budget:
            try:
                self._evict_to(self.budget, "keeping a gradient made in the block")
            except BaseException:
                self.held[key] = old
                self.held_bytes -= nbytes - old
                self.memory -= nbytes - old
                raise

    def set_budget(self, limit: Optional[int], opname: str = "set budget") -> None:
        """Change the user's limit, evicting at once down to what it leaves beside ``outside``
        (Note [The budget]); on failure (``OutOfBudgetError``) the old limit stays."""
        self._limit(limit, self.outside, opname)

    def set_outside(self, nbytes: int, opname: str) -> None:
        """The bytes outside the engine that the limit covers are now ``nbytes``: evict down to
        what they leave (Note [The budget]); on failure the old count stays."""
        self._limit(self.limit, nbytes, opname)

    def _limit(self, limit: Optional[int], outside: int, opname: str) -> None:
        if limit is not None and limit < outside:
            raise OutOfBudgetError(
                outside, limit, opname,
                f"{outside} bytes outside the engine count against the total limit "
                "(dtr.budget(total=True)): tensors from before the block.",
            )
        old = self.limit, self.outside, self.budget
        budget = self.budget = None if limit is None else limit - outside
        self.limit, self.outside = limit, outside
        if budget is not None and self.memory > budget:
            try:
                self._evict_to(budget, opname)
            except OutOfBudgetError:
                self.limit, self.outside, self.budget = old
                raise

    def close(self, failed: bool = False) -> None:
        """End of block: define every live wrapper's cell, cut all lineage, stop tracking.

        Recomputation stays under the budget when the live tensors fit in it; otherwise the
        budget is lifted (the block is over, and they must all be resident from now on). After
        a block that ``failed`` (an exception left it), live cells that are not defined stay
        so, with their lineage, until the program reads them, and the lineage goes with the
        last of their wrappers (Note [A failed block's exit] in rematerialize.py); with a host
        tier they are defined as after any block."""
        saved = self.budget
        try:  # whatever fails here (a heuristic's hook in drain), the finally ends the block
            self.drain()
            cells = []
            for ref in self.live_refs():
                ref.cell = self.resolve(ref.cell)
                cells.append(ref.cell)
            if not failed or self.host is not None:
                try:
                    self.acquire(cells)
                except OutOfBudgetError:
                    self.budget = None
                    self.acquire(cells)
                self.budget = None
                self.unlock(cells)
                self.flush()
            else:  # Note [A failed block's exit]
                self.make_permanent([c.storage.root for c in cells if c.storage.state is RESIDENT])
                keep_for_reads(self)
        finally:
            self.budget = saved
            self.closed = True
            self._backward = False
            self.checkpoints.clear()
            if self.host is not None:
                self.host.land()
            if self._untrack is not None:
                collector.give_back(self._all, chain((r.cell for r in self._refs.values()), self._dead))
        if self.kept_after_close is None:
            self._refs.clear()
        elif not self._refs:  # the program holds none of the failed block's tensors
            let_go(self)
        self.resident.clear()
        self._all.clear()
        self._index = None
        # The heuristic's log of lowered keys, which only the index reads, holds storages:
        # tensors that escape the block would keep them (and this runtime's metadata) alive.
        lowered = getattr(self.heuristic, "lowered", None)
        if lowered is not None:
            lowered()
        self.memory = 0
        self.held.clear()
        self.held_bytes = 0
        if self.host is not None:
            self.host.clear()

    # ------------------------------------------------------------------ introspection

    def storages(self) -> Iterator[Storage]:
        """Every storage not yet released."""
        return iter(list(self._all))

    @property
    def next_sid(self) -> int:
        """The id the next new storage will get (ids grow with creation order)."""
        return self._sid + 1

    def storages_since(self, sid: int) -> List[Storage]:
        """Storages created, and not released, since id ``sid`` was next: newest first.
        O(their number): the registry keeps creation order."""
        made = []
        for s in reversed(self._all):
            if s.sid < sid:
                break
            made.append(s)
        return made

    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (``invariants.check``). O(graph); for
        tests."""
        invariants.check(self)
