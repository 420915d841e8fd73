"""Rematerialization: defining an evicted or swapped cell again by replaying the records it
depends on, under the budget.

Functions of the runtime (``materialize(rt, cell)``, called by ``Runtime.acquire``), not a class:
every piece of state they read and change (the resident set, charged bytes, locks, counters)
is the runtime's, and a second object would only be a second name for it.
"""

from __future__ import annotations

import gc
import weakref
from itertools import chain
from typing import TYPE_CHECKING, Any, List

from dtr.core.storage import (
    EVICTED, EXTERNAL, RELEASED, RESIDENT, SWAPPED, Cell, OpRecord, Storage,
)
from dtr.errors import DTRError, ThrashingError

if TYPE_CHECKING:
    from dtr.core.runtime import Runtime

__all__ = ["keep_for_reads", "let_go", "materialize", "rebuild_after_close"]

_Weak = weakref.ReferenceType

# Note [Thrashing]
# ~~~~~~~~~~~~~~~~
# Below a model's lowest workable budget DTR thrashes: each replay evicts what the next one
# needs, and a step that takes a second eagerly runs for minutes or hours (a child-sum TreeLSTM
# at half its peak ran for 50 minutes; a GRUCell loop at 0.3 took 17.7 minutes). The runtime
# compares the cost of its replays with the cost of the block's own ops (``work``, the same
# measure) and raises ``ThrashingError``, an ``OutOfBudgetError``, once the ratio passes
# ``max_recompute`` (``dtr.budget``'s default: 10; the DTR paper's curves stay under 3x above
# their knee). Not before ``_THRASH_REPLAYS`` replays: early in a block the work is small and a
# few replays would pass any ratio. The check sits where ``_replay`` counts a replay, so it costs
# nothing per op. Raising there unwinds like any failure in a rematerialization (locks
# released, evictions kept), and ``close`` lifts the budget, so nothing is left half done.
_THRASH_REPLAYS = 1000


def materialize(rt: Runtime, target: Cell) -> None:
    """Define ``target`` by replaying the records it depends on, deepest first.

    Iterative (a chain of thousands of evicted ops must not hit the recursion limit).

    Note [Order of rematerialization]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The DTR paper locks all of a record's inputs, then recomputes the missing ones. Done
    depth-first, that keeps every level's inputs locked while deeper levels recompute, so
    a chain of depth d (a running sum of gradients, an RNN's hidden state) needs d levels
    of memory at once, and budgets it could meet fail. This is register allocation, and
    Sethi-Ullman's order fixes it: recompute the input with the deepest recomputation
    first, holding nothing at this level; lock each input once it is defined; then the
    next missing one. Inputs that were already resident are not locked until the first
    missing input is done (they are touched, so the heuristic prefers other victims); if
    one is evicted meanwhile it is simply missing again. Every return to a record locks at
    least one more input, so the loop always makes progress.

    Note [Rebuilt twice in one access]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A storage that one access (one call of this function: one cell) has to rebuild a second
    time is PROTECTED (Note [Eviction tiers]) until the access ends, however it ends. A long
    replay chain can read one input at every level: the embedded sequence of an RNN, read in
    slices by each step's input projection. Its lock ends with each level's replay, and every
    storage the chain touches has staleness 1 (the clock stands still), so the heuristic weighs
    bytes against neighbourhoods and the large shared input is the cheapest victim at every
    level (docs/heuristics.md). The first rebuild is no evidence (the input may not be read
    again); the second is. Protected, not locked: an eviction round still takes it when nothing
    else can go, so the rule never makes a round fail for want of room; over a run it changes
    what is evicted, so slowdowns and feasibility can move either way. Only the storage the
    access needed is counted, not the other outputs its replay brings back.
    """
    stack = [target]
    held: dict = {}  # id(record) -> per-input flags: locked by this call for it
    wanted: dict = {}  # input storage of a record in ``held`` -> how many read it
    rebuilt: dict = {}  # storage this call replayed -> how many times
    try:
        while stack:
            c = stack[-1]
            if c.value is not None:
                stack.pop()
                continue
            if c.storage.state is SWAPPED and c is c.storage.root:
                rt.host.swap_in(c.storage, prefetch=False)  # type: ignore[union-attr]
                stack.pop()
                continue
            rec = c.parent
            if rec is None or not rec.replayable or c.storage.state is RELEASED:
                raise AssertionError(f"dtr internal error: {c} of {c.storage} cannot be recomputed")
            inputs = rec.inputs
            entry = held.get(id(rec))
            if entry is None:
                flags = [False] * len(inputs)
                held[id(rec)] = (rec, flags)
                for i in inputs:
                    wanted[i.storage] = wanted.get(i.storage, 0) + 1
                missing = [i for i in inputs if i.value is None]
                if missing:
                    now = rt.clock
                    for i in inputs:
                        i.storage.last_access = now
                    stack.append(_deepest(missing))
                    continue
            else:
                flags = entry[1]
            missing = None
            for j, i in enumerate(inputs):
                if i.value is None:
                    if missing is None:
                        missing = [i]
                    else:
                        missing.append(i)
                elif not flags[j]:
                    i.storage.locks += 1
                    flags[j] = True
            if missing:
                stack.append(_deepest(missing))
                continue
            out = c.storage
            rebuilding = out.state is EVICTED
            out.locks += 1  # its consumer has not locked it yet: keep the fit from evicting it
            try:
                if rt.budget is not None:
                    _room_for_replay(rt, rec)
                _replay(rt, rec, wanted)
            finally:
                out.locks -= 1
            if rebuilding:
                n = rebuilt[out] = rebuilt.get(out, 0) + 1
                if n == 2:  # Note [Rebuilt twice in one access]
                    out.protected += 1
                    rt.kept_by_access.add(out)
            del held[id(rec)]
            for i in inputs:
                i.storage.locks -= 1
                n = wanted[i.storage] - 1
                if n:
                    wanted[i.storage] = n
                else:
                    del wanted[i.storage]
            if c.value is None:  # pragma: no cover - would be a runtime bug
                raise AssertionError(f"dtr internal error: replaying {rec} did not define {c}")
            stack.pop()
    except BaseException:
        for rec, flags in held.values():
            for i, f in zip(rec.inputs, flags):
                if f:
                    i.storage.locks -= 1
        raise
    finally:
        for s, n in rebuilt.items():
            if n >= 2:
                s.protected -= 1
                rt.kept_by_access.discard(s)


def rebuild_after_close(rt: Runtime, target: Cell) -> Any:
    """Define ``target``, a cell of a closed runtime left undefined by a failed block, by
    replaying the records it depends on (deepest first, iteratively); returns its value.

    Note [A failed block's exit]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A block that ends defines every live cell (``Runtime.close``), lifting the budget if they
    do not fit: the program may read any of them afterwards. While an exception leaves a block
    the live cells are mostly the failed step's: its frames and its autograd graph, which the
    traceback holds until the program is done with the error. Defining them all would make the
    whole step resident at the moment the budget has just refused it (on a GPU near capacity,
    an out-of-memory error inside the handling of dtr's own). So a failed block's close defines
    nothing: what is undefined stays so, its lineage held by its cell, and what is resident
    stays resident (no more than the budget held); live cells that are defined lose their
    lineage, as at any block's end, so that keeping one (a logged loss) keeps nothing else. A
    cell the program reads afterwards (an op on the wrapper, ``dtr.materialize``, autograd
    unpacking a saved tensor) is rebuilt here on first use, outside any budget as after any
    block. Records and storages refer to each other, so reference counting alone would leave
    what was kept to the cyclic collector, and a retry at a smaller batch would start with the
    refused try's memory allocated: when the last wrapper the block left dies, ``let_go`` drops
    it all. A rebuild reads only data as it was: a constant written in
    place since (an optimizer step) is caught at replay, as within a block, and the block's own
    tensors by the version counters ``Runtime.versions_after_close`` took when each was last
    defined; either is a ``DTRError``. Writes through ``.data`` move no counter that dtr can
    see (as autograd cannot see them), so a rebuild reads what such a write left.
    """
    if rt.versions_after_close is None:  # its close itself failed: nothing was kept for this
        raise DTRError(f"dtr: {target} of a closed block is undefined and cannot be recomputed")
    stack = [target]
    while stack:
        c = stack[-1]
        if c.value is not None:
            stack.pop()
            continue
        rec = c.parent
        if rec is None or not rec.replayable or c.storage.state is RELEASED:
            raise DTRError(f"dtr: {c} of a failed block cannot be recomputed: its lineage was dropped")
        missing = [i for i in rec.inputs if i.value is None]
        if missing:
            stack.extend(missing)
            continue
        for i in rec.inputs:
            if _written_after_close(rt, i):
                raise DTRError(
                    f"dtr: a tensor of a dtr.budget block that failed cannot be recomputed: "
                    f"{rec.name} would read a tensor of that block that was written in place "
                    "since. Read what you need of a failed step before writing to its tensors."
                )
        try:
            values, _ = rt.executor.replay(rec)
        except DTRError as e:
            raise DTRError(
                f"dtr: a tensor of a dtr.budget block that failed was read after one it is computed "
                f"from changed in place (an optimizer step?), so it cannot be recomputed ({e}). Read "
                "what you need of a failed step before changing what it read."
            ) from e
        for cell, v in zip(rec.outputs, values):
            if type(cell) is _Weak:
                cell = cell()
            if cell is None or cell.value is not None:
                continue
            s = cell.storage
            if s.state is RELEASED:
                continue
            if cell is s.root:
                s.state = RESIDENT
            else:
                s.add_view(cell)
            cell.value = v
            rt.versions_after_close[cell] = _version_of(v)
        if c.value is None:  # pragma: no cover - would be a runtime bug
            raise AssertionError(f"dtr internal error: replaying {rec} did not define {c}")
        stack.pop()
    return target.value


def keep_for_reads(rt: Runtime) -> None:
    """At a failed block's close, record what ``_written_after_close`` compares with (Note [A
    failed block's exit]): the version counter of every defined cell's value, views included
    (a view's value was made below autograd: it has a counter of its own), and of every wrapper
    the program holds (a write through a wrapper bumps only the wrapper's). Both held weakly, so
    that a kept tensor keeps no more than what rebuilding it needs; the wrappers by plain weak
    references (a ``Ref`` holds its cell, and so would hold the key)."""
    versions = rt.versions_after_close = weakref.WeakKeyDictionary()
    for s in rt._all:
        for c in chain((s,), (w() for w in s.views)):
            if c is not None and c.value is not None:
                versions[c] = _version_of(c.value)
    held = rt.wrappers_after_close = weakref.WeakKeyDictionary()
    for ref in rt.live_refs():
        w = ref()
        if w is not None:
            held.setdefault(ref.cell.storage, []).append((weakref.ref(w), _version_of(w)))
    rt.kept_after_close = weakref.WeakSet(rt._all)


def let_go(rt: Runtime) -> None:
    """Note [A failed block's exit]: the last wrapper a failed block left has died, so the
    program can no longer read what its close kept: drop the kept storages' data and cut their
    lineage, which frees the records, their payloads and the storages by reference counting.
    It runs inside the dying wrapper's weakref callback (any thread, any code) without the
    runtime's lock: with no wrapper left, only a finalizer of the same garbage can still reach
    them, and a collection runs those after the weakref callbacks, so during one the drop waits
    for its end (Note [Letting go after a collection])."""
    if _collecting:
        _after_collection.append(rt)
    else:
        _drop_kept(rt)


def _drop_kept(rt: Runtime) -> None:
    kept, rt.kept_after_close = rt.kept_after_close, None
    if kept is None:
        return
    for s in list(kept):
        s.state = RELEASED
        s.parent = None
        s.dependents = ()
        rt._drop_values(s)


# Note [Letting go after a collection]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In a collection CPython clears the weakrefs to the garbage and calls their callbacks before
# it runs the garbage's finalizers; a ``__del__`` there may still read a failed block's tensor
# (a logger's, a generator's ``finally``). The wrapper's callback comes first, and the runtime
# may sit in an older generation than the cycle, so nothing else delays it. So while a
# collection runs, ``let_go`` only queues; the collection's "stop" callback drops what was
# queued. A tensor a finalizer resurrects is still dropped: reading it is a ``DTRError``.
_collecting = False
_after_collection: List[Any] = []


def _on_collection(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"
    if not _collecting:
        while _after_collection:
            _drop_kept(_after_collection.pop())


gc.callbacks.append(_on_collection)


def _version_of(t: Any) -> int:
    """A value's or wrapper's version counter (torch's ``_version``), duck-typed: the
    simulator's placeholders have none, and nothing writes them."""
    return getattr(t, "_version", 0)


def _written_after_close(rt: Runtime, cell: Cell) -> bool:
    """Whether ``cell``'s data was written in place since it was last defined after its failed
    block: through its data (a plain view of it) or through a wrapper the program held then."""
    s = cell.storage
    versions = rt.versions_after_close
    for c in chain((s,), (w() for w in s.views)):
        if c is not None and c.value is not None:
            version = versions.get(c)
            if version is not None and _version_of(c.value) != version:
                return True
    for ref, version in rt.wrappers_after_close.get(s, ()):
        w = ref()
        if w is not None and _version_of(w) != version:
            return True
    return False


def _room_for_replay(rt: Runtime, rec: OpRecord) -> None:
    """Evict for the storages a replay of ``rec`` will bring back, before it runs: their
    sizes are known, so the replay need not pass the budget (Invariant 1)."""
    need = 0
    for c in rec.outputs:
        if type(c) is Storage and c.state is EVICTED:
            need += c.nbytes
    if need:
        rt.reserve(need, f"{rec.name} (recomputing an evicted tensor)")


def _replay(rt: Runtime, rec: OpRecord, wanted: dict) -> None:
    if rt.arriving:
        rt.host.arrive(rec.inputs)  # type: ignore[union-attr]
    values, cost = rt.executor.replay(rec)
    now = rt.clock
    added = False
    made = False  # an output of ``Runtime.defer`` computed for the first time
    brought = 0  # bytes back in memory
    for cell, v in zip(rec.outputs, values):
        if type(cell) is _Weak:  # a view (Note [Views held weakly])
            cell = cell()
        if cell is None or cell.value is not None:
            continue
        s = cell.storage
        state = s.state
        if state is RELEASED or state is SWAPPED:
            continue  # a swapped sibling stays on the host: no room was made for it
        if cell is s.root:
            if state is EVICTED:
                if rt.unmade and s in rt.unmade:
                    rt.unmade.discard(s)
                    made = True
                s.state = RESIDENT
                rt.resident[s] = None
                rt.memory += s.nbytes
                rt._on_materialize(s)
                added = True
                brought += s.nbytes
            cell.value = v
        elif state is RESIDENT or state is EXTERNAL:
            cell.value = v
            s.add_view(cell)
        s.last_access = now
    for s in rec.use_storages:
        s.last_access = now
    if made:  # the op runs for the first time (Runtime.defer): its work, as if it had run then
        rt.work += cost
    elif added:  # re-deriving a view of a resident storage is not a rematerialization
        _retire_old_versions(rt, rec, wanted)
        c = rt.counters
        c.rematerializations += 1
        c.remat_seconds += cost
        if rt.events is not None:
            rt.events.replayed(rec, cost, brought)
        if (
            rt.max_recompute is not None
            and c.rematerializations >= _THRASH_REPLAYS
            and c.remat_seconds > rt.max_recompute * rt.work
            and rt.budget is not None
        ):
            raise ThrashingError(rt.budget, rec.name, c.rematerializations, c.remat_seconds / (rt.work or 1e-12))
    if rt.memory > rt._high:
        rt._high = rt.memory
    if added and rt.budget is not None and rt.memory > rt.budget:
        rt._evict_to(rt.budget, f"{rec.name} (recomputing an evicted tensor)")


def _retire_old_versions(rt: Runtime, rec: OpRecord, wanted: dict) -> None:
    """After replaying an in-place op: evict the old versions it rebuilt a new version
    from, when nothing else needs them now.

    Note [Old versions after a replay]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Eagerly an in-place op reuses its storage, and ``complete`` evicts the old version
    at once (its bytes are the new one's). A replay rebuilds the new version in fresh
    memory, so recomputing a chain of k in-place writes (aten's GRU cell writes one
    ``addmm`` output five times) would leave k storages resident where the program had
    one. Old versions are read only to rebuild their successor or by ops that ran while
    they were current, yet the heuristic scores them like live activations, and they
    crowd out what the program still holds (docs/heuristics.md has the measurements). So
    each goes as soon as its successor is back, as in ``complete`` (which also evicts it
    under the lock of the op that consumed it: Invariant 2's one exception), unless
    something in flight or held still needs it: a replay in flight has locked it for
    itself (``materialize`` locks every input of ``rec`` once per cell), or an evicted
    dependent is held by the program (the eager eviction rule of ``_unreferenced``),
    locked by the op in flight, or read by a replay in flight (``wanted``), and so about
    to be rebuilt from it. Like ``complete``'s, these evictions are no budget decision and
    are not counted as evictions.
    """
    for c in rec.inputs:
        old = c.storage
        new = old.forward
        if new is None or new.parent is not rec or new.state is not RESIDENT or old.state is not RESIDENT:
            continue
        if not old.recomputable:  # made permanent since (Invariant 3)
            continue
        if old.locks != sum(1 for i in rec.inputs if i.storage is old):
            continue
        if any(t.state is EVICTED and (t.refs or t.locks or t in wanted) for t in old.dependents):
            continue
        rt._evict(old)


def _deepest(cells: List[Cell]) -> Cell:
    """The missing input whose recomputation looks deepest: the most missing inputs of its
    own parent (one level of lookahead; Note [Order of rematerialization])."""
    if len(cells) == 1:
        return cells[0]
    best, depth = cells[0], -1
    for c in cells:
        rec = c.parent
        d = 0 if rec is None else sum(1 for i in rec.inputs if i.value is None)
        if d > depth:
            best, depth = c, d
    return best
