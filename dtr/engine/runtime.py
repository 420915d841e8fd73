"""The DTR runtime: memory accounting, eviction, rematerialization, lineage release.

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
from typing import Any, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

from dtr.engine import collector
from dtr.engine.candidates import CandidateIndex
from dtr.engine.eviction import Rescoring
from dtr.engine.heuristics import Heuristic
from dtr.engine.rematerialize import materialize
from dtr.engine.storage import Cell, OpRecord, State, Storage
from dtr.engine.host_tier import HostTier
from dtr.engine.telemetry import Counters
from dtr.errors import OutOfBudgetError

__all__ = ["Executor", "PeakMeter", "Ref", "Runtime"]

RESIDENT = State.RESIDENT
EVICTED = State.EVICTED
EXTERNAL = State.EXTERNAL
RELEASED = State.RELEASED
SWAPPED = State.SWAPPED


class Executor(Protocol):
    """What a driver gives the runtime so that it can recompute storages.

    ``views_alias_data``: True when a view's value shares memory with its storage, so that an
    in-place write to the storage is visible through the views' existing values (torch);
    the runtime then keeps those values across the write instead of re-deriving them.
    """

    views_alias_data: bool

    def replay(self, record: OpRecord) -> Tuple[Sequence[Any], float]:
        """Run ``record`` again on the values of ``record.inputs`` (all defined).

        Returns the output values, aligned with ``record.outputs``, and the cost of the replay
        in seconds (measured or estimated).
        """

    def forget(self, record: OpRecord) -> None:
        """``record`` will never be replayed again; drop what its payload holds."""

    # Swapping (only with a host tier; engine/host_tier.py):

    def swap_out(self, value: Any) -> Any:
        """Start copying a storage (its root ``value``) to the host; returns a handle."""

    def swap_done(self, handle: Any) -> bool:
        """Whether the copy out has finished, so that the storage's memory is free."""

    def swap_wait(self, handle: Any) -> None:
        """Block until the copy out has finished."""

    def swap_in(self, handle: Any) -> Tuple[Any, float]:
        """The root value back from the host, and the seconds the caller waited for it."""

    def prefetch(self, handle: Any) -> Tuple[Any, Any]:
        """Start bringing the root value back from the host without waiting: the value, which
        must not be read before ``arrive(pending)``, and ``pending``."""

    def arrive(self, pending: Any) -> None:
        """Make the value of a prefetch readable (its copy has landed before any later read)."""


class Ref(weakref.ref):
    """A program-held wrapper's link to its cell; the callback tells the runtime it died."""

    __slots__ = ("cell",)


def _noop(storage: Storage) -> None:
    pass


# Note [Thrashing]
# ~~~~~~~~~~~~~~~~
# Below a model's lowest workable budget DTR thrashes: each replay evicts what the next one
# needs, and a step that takes a second eagerly runs for minutes or hours (a child-sum TreeLSTM
# at half its peak ran for 50 minutes; a GRUCell loop at 0.3 took 17.7 minutes). The runtime
# compares the cost of its replays with the cost of the block's own ops (``work``, the same
# measure) and raises ``ThrashingError``, an ``OutOfBudgetError``, once the ratio passes
# ``max_recompute`` (``dtr.budget``'s default: 10; the DTR paper's curves stay under 3x above
# their knee). Not before ``_THRASH_REPLAYS`` replays (rematerialize.py): early in a block the
# work is small and a few replays would pass any ratio. The check sits where a replay is counted,
# so it costs nothing per op.
# Raising there unwinds like any failure in a rematerialization (locks released, evictions
# kept), and ``close`` lifts the budget, so nothing is left half done.
_CLOSED = float("inf")  # the first storage id of a closed protection window (``protect_new``)
_weak = weakref.ref


def _keyed(heuristic: Any) -> bool:
    """Whether the candidate index may search for ``heuristic``: it defines ``key`` and derives
    its score from it (heuristics.py, Note [Keys])."""
    return callable(getattr(heuristic, "key", None)) and type(heuristic).score is Heuristic.score


# Note [Peak meters]
# ~~~~~~~~~~~~~~~~~~
# The places that charge bytes keep one high-water mark, ``_high``: the most bytes charged
# since the latest meter started (or since the runtime did). Starting a meter folds ``_high``
# into every open meter and into ``_earlier_peak``, then restarts it from the bytes charged
# now; a peak (the runtime's, or an open meter's) is the larger of what was folded into it and
# ``_high``. So an op pays one comparison whatever the number of meters open, starting a meter
# costs O(open meters), and no meter can lower the runtime's peak: a stage that raises before
# its meter stops leaves ``peak`` right.
class PeakMeter:
    """The most bytes charged to a runtime since ``Runtime.meter()`` made this meter (the
    bytes charged then, at least); ``stop()`` freezes it. Meters may overlap and nest."""

    __slots__ = ("_runtime", "_peak")

    def __init__(self, runtime: "Runtime") -> None:
        self._runtime: Optional[Runtime] = runtime
        self._peak = runtime.memory

    @property
    def peak(self) -> int:
        """The most bytes charged since the meter started, until it stopped."""
        rt = self._runtime
        return self._peak if rt is None or rt._high < self._peak else rt._high

    def stop(self) -> int:
        """Stop measuring (the runtime forgets this meter) and return ``peak``. Idempotent."""
        rt = self._runtime
        if rt is not None:
            self._peak = self.peak
            rt._meters.remove(self)
            self._runtime = None
        return self._peak


class Runtime:
    """One DTR engine instance: the storages of one ``dtr.budget`` block.

    Args:
        budget: bytes, or None to track without evicting for budget.
        heuristic: scoring object (see heuristics.py).
        executor: replays records (see ``Executor``).
        untracked: keep records out of Python's cyclic collector (Note [Untracked records]);
            the caller must then ``close()`` the runtime.
        host: a host tier to swap to as well as evict (``dtr.budget(swap=True)``), or None.
        max_recompute: raise ``ThrashingError`` once replays have cost more than this many
            times the block's own ops (Note [Thrashing]); None: never.
    """

    def __init__(
        self,
        budget: Optional[int],
        heuristic: Heuristic,
        executor: Executor,
        *,
        untracked: bool = False,
        max_recompute: Optional[float] = None,
        host: Optional[HostTier] = None,
    ) -> None:
        self.budget = budget
        self.max_recompute = max_recompute
        self.work = 0.0  # cost of the ops completed in the block (not replays)
        self.heuristic = heuristic
        self._score = heuristic.score
        self._on_evict = getattr(heuristic, "on_evict", _noop)
        self._on_materialize = getattr(heuristic, "on_materialize", _noop)
        self._on_release = getattr(heuristic, "on_release", _noop)
        self._keyed = _keyed(heuristic)
        self._index: Optional[CandidateIndex] = None  # made by the first eviction round
        self.executor = executor
        self._views_alias_data = bool(getattr(executor, "views_alias_data", False))
        self.lock = threading.RLock()
        self.memory = 0  # charged bytes: resident storages, copies out in flight, ``held``
        self._high = 0  # Note [Peak meters]
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
        # Bytes outside the engine that the user's limit covers besides ``budget``
        # (``dtr.budget(total=True)``); only errors report them.
        self.outside = 0
        self.clock = 0
        self.counters = Counters()
        self.closed = False
        self.resident: dict = {}  # Storage -> None, in order of becoming resident
        self._all: dict = {}  # every storage not yet released
        self._refs: dict = {}  # id(Ref) -> Ref, for live wrappers
        self._dead: deque = deque()  # cells whose wrapper died, applied by drain()
        self._sid = 0
        self._protected_from = _CLOSED  # storages with a sid from this one on: PROTECTED
        self._backward = False  # the program's ops run in a backward pass (``set_backward``)
        self.host = host
        # The host tier's prefetches in flight (Note [Arrival]), here so that a read checks for
        # them in one lookup; without a host tier, a dict that stays empty.
        self.arriving: dict = host.arriving if host is not None else {}
        # Storages without lineage that give way to their dependents once dead (``_unreferenced``):
        # outputs of ops ``retire`` ended, sums made permanent with ``yielding=True``.
        self._yielding: "weakref.WeakSet[Storage]" = weakref.WeakSet()
        self._untrack = collector.untrack if untracked else None
        # One bound method for every Ref's callback, not a new one (a kept object) per wrapper.
        self._wrapper_died = self._on_wrapper_death
        # Observers (dtr/engine/events.py): ``events`` hears of evictions, replays and failures,
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
        (Note [Peak meters]); ``stop()`` it when done. O(meters open)."""
        high = self._high
        for m in self._meters:
            if high > m._peak:
                m._peak = high
        if high > self._earlier_peak:
            self._earlier_peak = high
        self._high = self.memory
        m = PeakMeter(self)
        self._meters.append(m)
        return m

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
        # May run on any thread, inside any code (garbage collection): only queue.
        if self._refs.pop(id(ref), None) is not None and not self.closed:
            self._dead.append(ref.cell)

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
            self._release(s)
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
                    self.cut(t)

    # ------------------------------------------------------------------ versions

    def resolve(self, cell: Cell) -> Cell:
        """The cell that now stands for ``cell``, following in-place versions (Note [Versions])."""
        while cell.storage.forward is not None:
            if cell.forward is None:
                self._translate(cell)
            cell = cell.forward  # type: ignore[assignment]
        return cell

    def _translate(self, cell: Cell) -> None:
        """Give ``cell`` (on S) its counterpart on S's next version, replaying the same views."""
        s2 = cell.storage.forward
        chain = []
        c = cell
        while c.forward is None:  # the root's is the new version itself: the walk stops there
            chain.append(c)
            c = c.parent.inputs[0]
        base = c.forward
        for c in reversed(chain):
            rec = c.parent
            rec2 = rec.retarget([base])
            rec2.outputs = [None] * len(rec.outputs)
            c2 = Cell(s2, rec2, c.index, None)
            rec2.outputs[c.index] = _weak(c2)  # Note [Views held weakly]
            c.forward = c2
            base = c2

    def _carry_views(self, s: Storage) -> None:
        """Before ``s`` becomes an old version, give its defined views counterparts on the new
        version holding the same values (the data was changed in place, so they are current),
        sparing a replay of each view when the program touches it next."""
        s2 = s.forward
        for w in s.views:
            c = w()
            if c is not None and c.value is not None and c.forward is None:
                self._translate(c)
                c2 = c.forward
                c2.value = c.value
                s2.add_view(c2)

    # ------------------------------------------------------------------ ops

    def acquire(self, cells: Sequence[Cell]) -> None:
        """Lock the storages of ``cells`` and make every cell defined and readable (Invariant 2).

        On error (``OutOfBudgetError``, or a failing replay) every lock taken here is undone.
        """
        for c in cells:
            c.storage.locks += 1
        try:
            for c in cells:
                if c.value is None:
                    materialize(self, c)
        except BaseException:
            self.unlock(cells)
            self._settle()
            raise
        if self.arriving:
            self.arrive(cells)

    def arrive(self, cells: Iterable[Cell]) -> None:
        """Before the values of ``cells`` are read: wait (on the device, not the host) for the
        copies of those whose storage was prefetched. Callers check ``arriving`` first.

        Note [Arrival]
        ~~~~~~~~~~~~~~
        A prefetch starts the copy back and returns at once, so that the copy overlaps the
        ops before the storage's next read; on CUDA that read must be ordered after the copy.
        So a prefetched storage is in ``arriving`` until its first read, and every read goes
        through here: op inputs (``acquire``, the driver's one-pass paths), replays, swap-outs,
        the end of the block. A storage whose values are dropped first (evicted, swapped out
        again, released) just leaves ``arriving``.
        """
        self.host.arrive(cells)  # type: ignore[union-attr]

    def before_write(self, storages: Iterable[Storage]) -> None:
        """Call before an op writes ``storages`` in place.

        A recomputable storage simply becomes an evicted old version (Note [Versions]). One
        with no lineage (cut, external, or made by a non-replayable op) could never be rebuilt
        for the records that read it, so those records' outputs are made resident and
        permanent first. Raises ``OutOfBudgetError`` (changing nothing) if they do not fit.
        """
        for s in storages:
            if s.uses and not s.recomputable:
                self.make_permanent([t.root for t in s.dependents])

    def retire(self, storages: Iterable[Storage]) -> None:
        """Call before memory that the parent ops of ``storages`` read, and the engine does not
        own, is freed (FSDP2 freeing gathered parameters): those ops can never run again.

        Every storage the program references whose rematerialization could replay one of them
        is made resident and permanent first; one it does not reference passes the duty on to
        its dependents. Unreferenced storages then lose their last uses and are released, so
        no record that reads the freed memory stays alive. Cheaper than ``flush`` by what does
        not depend on the freed memory, which keeps its lineage. Raises ``OutOfBudgetError``
        (changing nothing) if the storages made permanent do not fit together.
        """
        retired = list(dict.fromkeys(s.parent for s in storages if s.parent is not None))
        roots: List[Storage] = []
        swapped: List[Storage] = []
        seen = set()
        # Every output of a retired op, not only those passed: none can be recomputed after.
        stack = [o for rec in retired for o in rec.outputs if type(o) is Storage]
        while stack:
            s = stack.pop()
            if s in seen or s.state is RELEASED:
                continue
            seen.add(s)
            if s.refs > 0:
                (swapped if s.state is SWAPPED else roots).append(s)
            elif s.dependents:
                stack.extend(s.dependents)
        self.make_permanent(roots)
        for s in swapped:  # its data is safe on the host: no need to bring it back
            self.cut(s)
        for rec in retired:  # whatever still lists it can never need it (see above)
            rec.replayable = False
        self._yielding.update(o for rec in retired for o in rec.outputs if type(o) is Storage)

    def unlock(self, cells: Iterable[Cell]) -> None:
        """Undo ``acquire`` (used directly when the op itself failed)."""
        for c in cells:
            s = c.storage
            s.locks -= 1
            if s.locks == 0 and s.refs == 0 and s.uses == 0 and s.state is not RELEASED:
                self._release(s)

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
                    self._carry_views(s)
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
                    outs.append(self._new_view(base.storage, rec, len(outs), value))
                    views = True
            # Note [Views held weakly]
            rec.outputs = [c if type(c) is Storage else _weak(c) for c in outs] if views else outs
            if self.memory > self._high:
                self._high = self.memory
            if added and self.budget is not None and self.memory > self.budget:
                self._fit_outputs(rec, new, len(mutated))
            self._wire(rec, new, now)
        finally:
            self.unlock(rec.inputs)
            if self.host is not None:  # the clock moved, also for an op that failed here
                self.host.log.costs.append(rec.cost)
        if self.host is not None:
            self.host.after_op()
        if self.on_op is not None:
            self.on_op(self)
        return outs  # type: ignore[return-value]

    def _fit_outputs(self, rec: OpRecord, new: List[Storage], n_versions: int) -> None:
        for s in new:
            s.locks += 1
        try:
            self._evict_to(self.budget, rec.name)  # type: ignore[arg-type]
        except BaseException:  # OutOfBudgetError, or anything a heuristic raised
            for i, s in enumerate(new[n_versions:], start=n_versions):
                del self.resident[s]
                self._leave_graph(s)
                self.memory -= s.nbytes
                s.state = RELEASED
                s.value = None
                rec.outputs[i] = None
            del new[n_versions:]
            self._wire(rec, new, self.clock)
            raise
        finally:
            for s in new:
                s.locks -= 1

    def _wire(self, rec: OpRecord, new: List[Storage], now: int) -> None:
        """Add the dependency edges of a completed record."""
        rec.live = len(new)
        inputs = rec.inputs
        for c in inputs:
            c.storage.last_access = now
        if not rec.live or not rec.replayable:
            # A view op's outputs live and die with the base's storage; a record that is never
            # replayed needs none of its inputs.
            return
        # Inputs that are distinct roots are their own storages: the input list then doubles as
        # the edges (one object fewer per op kept for the collector, docs/runtime.md).
        n = len(inputs)
        if n == 1:
            ins: Sequence[Storage] = inputs if type(inputs[0]) is Storage else (inputs[0].storage,)
        elif n == 2 and inputs[0] is not inputs[1] and type(inputs[0]) is type(inputs[1]) is Storage:
            ins = inputs
        else:
            ins = tuple(dict.fromkeys([c.storage for c in inputs]))
        rec.use_storages = ins
        untrack = self._untrack
        for s in ins:
            s.uses += 1
            deps = s.dependents
            if not deps:
                deps = s.dependents = {}
            for t in new:
                deps[t] = None
            if untrack is not None:
                untrack(deps)  # again: adding a storage makes a dict tracked
        if untrack is not None:
            untrack(rec, inputs, rec.outputs, ins)

    # Note [Untracked records]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # A replayable record keeps four containers alive for as long as its outputs may be
    # recomputed, often a whole forward pass: the record, its input and output lists, and the
    # dependents dicts of its inputs (plus ``use_storages`` when it is a tuple; the driver adds
    # its record's argument tuples). They outlive the collector's young generations, so every
    # full collection visits them, and they bring those collections on: ~0.6 us per object per
    # op amortized (docs/runtime.md). With ``untracked=True`` the runtime takes them out of the
    # collector once wired (``collector``; a no-op without dtr_ext). Safe, because every cycle
    # through them passes through the ``parent`` link of a storage the record made (an output
    # lists its record, a dependents dict and a forward version lead to a record's output), and
    # the runtime clears that link itself when it releases or cuts the storage (Note [Views held
    # weakly]); for storages still in the graph at ``close``, their records' containers go back
    # to the collector there. A runtime left open would never be collected, hence the flag: the
    # driver always closes its runtime. A storage, which every record keeps too, is untracked
    # only while it is in ``_all``: the runtime's dicts hold it there, so it is not garbage; it
    # goes back to the collector as it leaves (release, an output dropped by ``_fit_outputs``)
    # or at ``close``, so that a heuristic, a swap log or the program that still holds it may
    # hold it in a cycle of their own, as before. Cells, wrappers and their ``Ref``s stay
    # tracked: a ``Ref`` is a weakref with a callback, and when its wrapper dies in a garbage
    # cycle the collector moves the ref onto its list of callbacks to call, which it can only do
    # for a tracked object (an untracked one crashed the process: a training loop keeping a
    # caught exception, whose traceback holds a wrapper, in a local; ``collector.untrack`` now
    # refuses weakrefs).

    def _new_storage(self, nbytes: int, rec: OpRecord, index: int, value: Any, now: int) -> Storage:
        self._sid += 1
        s = Storage(self, self._sid, nbytes, rec.cost, now, rec, index, value)
        if self._backward:
            s.backward = True  # Note [Gradients are a last resort]
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

    @staticmethod
    def _new_view(s: Storage, rec: OpRecord, index: int, value: Any) -> Cell:
        c = Cell(s, rec, index, value)
        s.add_view(c)
        return c

    # ------------------------------------------------------------------ eviction

    def _evict_to(self, target: int, opname: str, best_effort: bool = False) -> None:
        """Evict (or swap out) the next victim of a search until ``memory <= target``
        (eviction.py). With ``best_effort`` the caller catches the ``OutOfBudgetError``
        (``reserve``), so no observer snapshots the failure: under a tight budget that happens
        before most ops."""
        if self.memory <= target:
            return
        host = self.host
        if host is None and self._keyed:
            search = self._index
            if search is None:
                search = self._index = CandidateIndex(self.heuristic)
        else:
            search = Rescoring(self._score, host)
        search.begin(self.resident, self.clock, self._small_below(), self._protected_from)
        while self.memory > target:
            s = search.pick()
            if s is None:
                if host is not None and host.outgoing:  # copies out in flight: wait for one
                    host.poll_outgoing(wait=True)
                    continue
                raise self._out_of_budget(target, opname, best_effort)
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
            self.host.dropped(s)  # type: ignore[union-attr]
        s.value = None
        for w in s.views:
            c = w()
            if c is not None:
                c.value = None
        s.views = ()

    def _out_of_budget(self, target: int, opname: str, best_effort: bool = False) -> OutOfBudgetError:
        locked = unrecomputable = 0
        for s in self.resident:
            if s.locks:
                locked += s.nbytes
            elif not s.recomputable:
                unrecomputable += s.nbytes
        needed = locked + unrecomputable + self.held_bytes + self.outside
        detail = (
            f"{locked} bytes are locked (inputs and outputs of the operations in flight), "
            f"{unrecomputable} bytes cannot be recomputed (no replayable lineage) and "
            f"{self.held_bytes} bytes are gradients made in this block (charged until it ends)."
        )
        if self.outside:
            detail += (
                f" Besides, {self.outside} bytes outside the engine count against the total limit "
                "(dtr.budget(total=True)): tensors from before the block."
            )
        error = OutOfBudgetError(needed, target + self.outside, opname, detail)
        if self.events is not None and not best_effort:  # a caller that swallows it: no snapshot
            self.events.out_of_budget(error, self)
        return error

    # ------------------------------------------------------------------ release

    def _release(self, s: Storage) -> None:
        """Drop ``s`` from the graph, then whatever only it kept alive (iteratively)."""
        work = [s]
        while work:
            s = work.pop()
            if s.state is RELEASED or s.refs or s.uses or s.locks:
                continue
            if s.state is RESIDENT:
                del self.resident[s]
                self.memory -= s.nbytes
            elif s.state is SWAPPED:
                self.host.leave(s)  # type: ignore[union-attr]
            s.state = RELEASED
            self._leave_graph(s)
            rec = s.parent
            try:
                self._on_release(s)  # may read s.parent (h_DTR^eq lowers its inputs' keys)
            finally:
                # Its parent lists it as an output: break that cycle so that reference
                # counting frees both now, not the cyclic collector later (views make none:
                # Note [Views held weakly]), also if the heuristic raised: the record may be
                # untracked (Note [Untracked records]), and ``s`` is no longer in the graph.
                s.parent = None
            self._drop_values(s)
            s.views = ()
            if rec is not None:
                for i in rec.use_storages:
                    if i.dependents:
                        i.dependents.pop(s, None)
                self._lose_output(rec, work)

    def _lose_output(self, rec: OpRecord, work: list) -> None:
        """One of ``rec``'s output storages no longer names it as parent."""
        rec.live -= 1
        if rec.live:
            return
        for i in rec.use_storages:
            i.uses -= 1
            if i.uses == 0 and i.refs == 0 and not i.locks:
                work.append(i)
        rec.use_storages = ()
        self.executor.forget(rec)

    # ------------------------------------------------------------------ last resorts

    def set_backward(self, on: bool) -> None:
        """Say whether the program's ops now run in a backward pass (the driver calls it when
        that changes): storages made while ``on`` are a last resort of eviction for as long
        as they live.

        Note [Gradients are a last resort]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        What a backward pass makes is gradients, and their lineage runs through the
        gradients before them, which die as soon as they are consumed: recomputing one
        replays the backward pass down to it, and the forward ops that pass read, where
        recomputing an activation replays forward ops from the nearest resident ancestor.
        The heuristics cannot see the difference. In a backward pass the dead forward pass
        and the dead gradients form one evicted neighbourhood, which every candidate
        borders, so h_DTR^eq's cost term is the same for all of them and the oldest go
        first: the gradients a multi-input node waits for (``nn.GRU``'s per-step input-gate
        gradients, all read by one ``stack`` at the end; a tree node's children's). So
        they are a last resort for life (``Storage.backward``: the BACKWARD tier, searched with
        what ``protect`` keeps; Note [Eviction tiers] in eviction.py):
        evicted only when no activation of ordinary size can go. On the shipped traces this
        changes nothing for the feed-forward models and saves recurrent ones from thrashing
        (docs/heuristics.md).
        Forward ops that run inside a backward pass (``torch.utils.checkpoint`` recomputing a
        segment, ``torch.autograd.grad`` called by a hook) are marked too; their results are
        read within the pass. It subsumes a plan's ``protect_new`` window over a stage's
        backward (Note [Seeding]): what the stage made stays a last resort after the window.
        """
        self._backward = on

    def protect_new(self, on: bool) -> None:
        """With ``on``, storages made from this call on are evicted (or swapped) only when no
        other storage of ordinary size can go (before the small ones), until the next call: a
        plan's backward stage keeps what it makes (its input's gradient above all) until the
        stage ends, as the plan's accounting assumed. Each call with ``on`` starts a new
        protection window; ``on=False`` ends it."""
        self._protected_from = self.next_sid if on else _CLOSED

    def protect(self, storages: Iterable[Storage]) -> None:
        """Make ``storages`` a last resort of eviction, as ``protect_new`` does for new ones,
        until ``unprotect``: what a plan holds that the heuristic should leave alone if it can
        (checkpoints, a whole stage's tape: pinning them made budgets infeasible). Protections
        nest, and follow a storage to its newest version (Note [Versions])."""
        for s in storages:
            while s.forward is not None:
                s = s.forward
            s.protected += 1

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

    def cut(self, s: Storage) -> None:
        """Make ``s`` permanent: drop its parent so its ancestors can be released."""
        rec = s.parent
        if rec is None:
            return
        s.parent = None
        for i in rec.use_storages:
            if i.dependents:
                i.dependents.pop(s, None)
        work: list = []
        self._lose_output(rec, work)
        for i in work:
            self._release(i)

    def flush(self) -> None:
        """Make every storage the program still references resident, and cut its lineage.

        Needed when recorded ops can no longer be replayed faithfully (parameters are about to
        change) and at block exit. Raises ``OutOfBudgetError`` (with nothing cut) if they do
        not fit in the budget together.
        """
        live = [s for s in self._all if s.refs > 0]
        self.make_permanent([s.root for s in live if s.state is not SWAPPED])
        for s in live:
            if s.state is SWAPPED:  # its data is safe on the host: no need to bring it back
                self.cut(s)
        self.counters.flushes += 1

    def make_permanent(self, roots: List[Cell], yielding: bool = False) -> None:
        """Make these storages resident together, then cut their lineage (or raise
        ``OutOfBudgetError`` with nothing cut). They stay charged and are never evicted
        (swapped at most): for what recomputing would cost more than keeping, such as a sum
        of gradients (Note [Accumulation in place] in dtr/eager/accumulation.py). With
        ``yielding``, each gives way to its dependents once the program drops it
        (``_unreferenced``)."""
        self.acquire(roots)
        try:
            for c in roots:
                self.cut(c.storage)
                if yielding:
                    self._yielding.add(c.storage)
        finally:
            self.unlock(roots)

    def extract(self, cell: Cell) -> Any:
        """Hand ``cell``'s storage to the program: make it resident, stop charging and
        evicting it (state EXTERNAL), drop its lineage. Returns the cell's value."""
        self.acquire([cell])
        try:
            s = cell.storage
            if s.state is RESIDENT:
                del self.resident[s]
                self.memory -= s.nbytes
                s.state = EXTERNAL
                self.cut(s)
            return cell.value
        finally:
            self.unlock([cell])

    def reserve(self, nbytes: int, opname: str) -> None:
        """Make room for ``nbytes`` of outputs an op is about to make (its inputs locked):
        evict down to ``budget - nbytes``, as far as candidates allow. Best effort: where
        nothing more can go the op runs anyway, and ``complete`` decides."""
        if self.budget is not None and self.memory + nbytes > self.budget:
            try:
                self._evict_to(max(self.budget - nbytes, 0), opname, best_effort=True)
            except OutOfBudgetError:
                pass

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

    def set_budget(self, budget: Optional[int], opname: str = "set budget") -> None:
        """Change the budget, evicting at once down to it; on failure the old one stays."""
        old = self.budget
        self.budget = budget
        if budget is not None and self.memory > budget:
            try:
                self._evict_to(budget, opname)
            except OutOfBudgetError:
                self.budget = old
                raise

    def close(self) -> None:
        """End of block: define every live wrapper's cell, cut all lineage, stop tracking.

        Recomputation stays under the budget when the live tensors fit in it; otherwise the
        budget is lifted (the block is over, and they must all be resident from now on)."""
        saved = self.budget
        try:  # whatever fails here (a heuristic's hook in drain), the finally ends the block
            self.drain()
            cells = []
            for ref in self.live_refs():
                ref.cell = self.resolve(ref.cell)
                cells.append(ref.cell)
            try:
                self.acquire(cells)
            except OutOfBudgetError:
                self.budget = None
                self.acquire(cells)
            self.budget = None
            self.unlock(cells)
            self.flush()
        finally:
            self.budget = saved
            self.closed = True
            self._backward = False
            if self.host is not None:
                self.host.land()
            if self._untrack is not None:
                self._give_back()
        self._refs.clear()
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

    def _give_back(self) -> None:
        """Return the storages still in the graph and the containers of their records to the
        cyclic collector (Note [Untracked records])."""
        track = collector.track
        for s in self._all:
            track(s)
            rec = s.parent
            if rec is not None:
                track(rec, rec.inputs, rec.outputs, rec.use_storages)
            if s.dependents:
                track(s.dependents)

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
        """Assert the invariants of the module docstring. O(graph); for tests."""
        memory = self.held_bytes + (sum(s.nbytes for s in self.host.outgoing) if self.host is not None else 0)
        assert self.held_bytes == sum(self.held.values()), "held bytes disagree with their keys"
        for s in self.resident:
            assert s.state is RESIDENT, f"{s} is in the resident set"
            memory += s.nbytes
        assert memory == self.memory, f"memory {self.memory} != sum of resident {memory}"
        for s in self._all:
            assert s.state is not RELEASED, f"{s} is released but still registered"
            assert s.locks == 0, f"{s} is still locked between ops"
            assert s.refs >= 0 and s.uses >= 0, f"{s} has a negative count"
            assert (s.state is RESIDENT) == (s in self.resident), f"{s} resident set mismatch"
            if s.state is EVICTED:
                assert s.value is None, f"{s} is evicted but its root holds a value"
                rec = s.parent
                assert rec is not None and rec.replayable, f"{s} is evicted but cannot be recomputed"
                for i in rec.use_storages:
                    assert i.state is not RELEASED, f"{s} needs {i}, which was released"
            elif s.state is SWAPPED:
                assert s.value is None, f"{s} is swapped but its root holds a value"
            else:
                assert s.value is not None, f"{s} is {s.state.name} but its root is undefined"
            if s.refs == 0 and s.uses == 0:
                raise AssertionError(f"{s} is unreferenced and unused but was not released")
            if s.state is EVICTED or s.state is SWAPPED:  # Invariant 5 (handed-out ones keep theirs)
                for w in s.views:
                    c = w()
                    assert c is None or c.value is None, f"a view of {s} is defined"
            rec = s.parent
            if rec is not None:
                assert rec.live > 0, f"{rec} is the parent of {s} but counts no live output"
                for i in rec.use_storages:
                    assert i.dependents and s in i.dependents, f"{s} is missing from the dependents of {i}"
        counted: dict = {}
        for s in self._all:
            rec = s.parent
            if rec is not None and id(rec) not in counted:
                counted[id(rec)] = rec
        uses: dict = {}
        for rec in counted.values():
            for i in rec.use_storages:
                uses[i] = uses.get(i, 0) + 1
        for s in self._all:
            assert s.uses == uses.get(s, 0), f"{s} counts {s.uses} uses, the graph has {uses.get(s, 0)}"
        if self.host is not None:
            self.host.check(self._all)
        if self.budget is not None:
            assert self.memory <= self.budget, (
                f"resident {self.memory} bytes exceed the budget {self.budget} between ops"
            )
        if self._index is not None:
            self._index.check(self.resident)
        check = getattr(self.heuristic, "check_invariants", None)
        if check is not None:
            check(self)
