"""Lineage: when a storage stops being recomputable, and when it leaves the graph.

A storage's lineage is its parent record and, through the record's inputs, everything it can be
recomputed from (Invariant 3 in runtime.py). ``cut`` ends it (the storage becomes permanent,
and ancestors nothing else needs are released); ``release`` drops a storage nothing can need
any more, and whatever only it kept alive. The operations built on them (``make_permanent``,
``flush``, ``before_write``, ``retire``, ``extract``) are ``Runtime``'s methods of those names,
which drivers call and traces record.

Functions of the runtime, like rematerialize.py's: the state they change is the runtime's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, List

from dtr.core.storage import EXTERNAL, RELEASED, RESIDENT, SWAPPED, Cell, OpRecord, Storage

if TYPE_CHECKING:
    from dtr.core.runtime import Runtime

__all__ = ["before_write", "cut", "extract", "flush", "make_permanent", "release", "retire"]


def release(rt: Runtime, s: Storage) -> None:
    """Drop ``s`` from the graph, then whatever only it kept alive (iteratively). A runtime
    that the native path drives runs hotpath.c's twin (``Runtime.native_release``)."""
    if rt.native_release is not None:
        rt.native_release(rt, s)
        return
    work = [s]
    while work:
        s = work.pop()
        if s.state is RELEASED or s.refs or s.uses or s.locks:
            continue
        if s.state is RESIDENT:
            del rt.resident[s]
            rt.memory -= s.nbytes
        elif s.state is SWAPPED:
            rt.host.leave(s)  # type: ignore[union-attr]
        s.state = RELEASED
        rt._leave_graph(s)
        rec = s.parent
        try:
            rt._on_release(s)  # may read s.parent (h_DTR^eq lowers its inputs' keys)
        finally:
            # Its parent lists it as an output: break that cycle so that reference
            # counting frees both now, not the cyclic collector later (views make none:
            # Note [Views held weakly]), also if the heuristic raised: the record may be
            # untracked (Note [Untracked records]), and ``s`` is no longer in the graph.
            s.parent = None
        rt._drop_values(s)
        s.views = ()
        if rec is not None:
            for i in rec.use_storages:
                if i.dependents:
                    i.dependents.pop(s, None)
            _lose_output(rt, rec, work)


def _lose_output(rt: Runtime, rec: OpRecord, work: list) -> None:
    """One of ``rec``'s output storages no longer names it as parent."""
    rec.live -= 1
    if rec.live:
        return
    for i in rec.use_storages:
        i.uses -= 1
        if i.uses == 0 and i.refs == 0 and not i.locks:
            work.append(i)
    rec.use_storages = ()
    rt.executor.forget(rec)


def cut(rt: Runtime, s: Storage) -> None:
    """Make ``s`` permanent: drop its parent so its ancestors can be released."""
    rec = s.parent
    if rec is None:
        return
    s.parent = None
    for i in rec.use_storages:
        if i.dependents:
            i.dependents.pop(s, None)
    work: list = []
    _lose_output(rt, rec, work)
    for i in work:
        release(rt, i)


def make_permanent(rt: Runtime, roots: List[Cell], yielding: bool = False) -> None:
    """Make these storages resident together, then cut their lineage (or raise
    ``OutOfBudgetError`` with nothing cut). They stay charged and are never evicted
    (swapped at most): for what recomputing would cost more than keeping, such as a sum
    of gradients (Note [Accumulation in place] in dtr/eager/accumulation.py). With
    ``yielding``, each gives way to its dependents once the program drops it
    (``_unreferenced``)."""
    rt.acquire(roots)
    try:
        for c in roots:
            cut(rt, c.storage)
            if yielding:
                rt._yielding.add(c.storage)
    finally:
        rt.unlock(roots)


def flush(rt: Runtime) -> None:
    """Make every storage the program still references resident, and cut its lineage.

    Needed when recorded ops can no longer be replayed faithfully (parameters are about to
    change) and at block exit. Raises ``OutOfBudgetError`` (with nothing cut) if they do
    not fit in the budget together.
    """
    live = [s for s in rt._all if s.refs > 0]
    rt.make_permanent([s.root for s in live if s.state is not SWAPPED])
    for s in live:
        if s.state is SWAPPED:  # its data is safe on the host: no need to bring it back
            cut(rt, s)
    rt.counters.flushes += 1


def before_write(rt: Runtime, storages: Iterable[Storage]) -> None:
    """Call before an op writes ``storages`` in place.

    A recomputable storage simply becomes an evicted old version (Note [Versions]). One
    with no lineage (cut, external, or made by a non-replayable op) could never be rebuilt
    for the records that read it, so those records' outputs are made resident and
    permanent first. Raises ``OutOfBudgetError`` (changing nothing) if they do not fit.
    """
    for s in storages:
        if s.uses and not s.recomputable:
            rt.make_permanent([t.root for t in s.dependents])


def retire(rt: Runtime, storages: Iterable[Storage]) -> None:
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
    rt.make_permanent(roots)
    for s in swapped:  # its data is safe on the host: no need to bring it back
        cut(rt, s)
    for rec in retired:  # whatever still lists it can never need it (see above)
        rec.replayable = False
    rt._yielding.update(o for rec in retired for o in rec.outputs if type(o) is Storage)


def extract(rt: Runtime, cell: Cell) -> Any:
    """Hand ``cell``'s storage to the program: make it resident, stop charging and
    evicting it (state EXTERNAL), drop its lineage. Returns the cell's value."""
    rt.acquire([cell])
    try:
        s = cell.storage
        if s.state is RESIDENT:
            del rt.resident[s]
            rt.memory -= s.nbytes
            s.state = EXTERNAL
            cut(rt, s)
        return cell.value
    finally:
        rt.unlock([cell])
