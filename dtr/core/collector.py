"""The only module that knows about ``dtr_ext._collector``: taking the engine's records out of
Python's cyclic collector (Note [Untracked records]).

``untrack(*objs)`` stops the collector from visiting ``objs``; ``track(*objs)`` makes it visit
them again. ``untrack`` refuses a weakref with a callback (``TypeError``): when its referent
dies in a garbage cycle, the collector handles the callback only if the weakref is tracked
(an untracked one crashes the process); the native module refuses a weak proxy with one too,
whose callback Python code cannot see (the engine makes no proxies). Without the native module
(no C compiler at install, or ``DTR_PUREPYTHON=1`` at import) both do nothing else: the engine
behaves the same, and the collector does more work per op. ``NATIVE`` tells which is in use.

Note [Untracked records]
~~~~~~~~~~~~~~~~~~~~~~~~
A replayable record keeps four containers alive for as long as its outputs may be recomputed,
often a whole forward pass: the record, its input and output lists, and the dependents dicts of
its inputs (plus ``use_storages`` when it is a tuple; the driver adds its record's argument
tuples). They outlive the collector's young generations, so every full collection visits them,
and they bring those collections on: ~0.6 us per object per op amortized (docs/runtime.md).
With ``Runtime(untracked=True)`` the runtime takes them out of the collector once wired (a
no-op without dtr_ext). Safe, because every cycle through them passes through the ``parent``
link of a storage the record made (an output lists its record, a dependents dict and a forward
version lead to a record's output), and the runtime clears that link itself when it releases
or cuts the storage (Note [Views held weakly]); for storages still in the graph at ``close``,
``give_back`` returns their records' containers to the collector. A runtime left open would
never be collected, hence the flag: the driver always closes its runtime. A storage, which
every record keeps too, is untracked only while it is in the runtime's graph, whose dicts hold
it, so it is not garbage; it goes back to the collector as it leaves (release, an output
dropped by a failed fit) or at ``close``, so that a heuristic, a swap log or the program that
still holds it may hold it in a cycle of their own. A view's cell, the record that made it
(with its input and output lists) and a storage's list of weak references to its views are
untracked as they are made (``outputs.new_view``, ``wire``, ``translate``, ``add_view``): a
cycle through a view cell also passes through a storage's ``parent`` link (the cell is the
input of a record whose output's dependents lead back to it), and ``give_back`` returns at
``close`` the views of the storages left, the view chains their records read, and the cells
of live wrappers and of deaths not yet applied, each with the cells ``translate`` made from it
on newer versions of its storage (untracked as they are made, as views are): a failed
``close`` keeps the runtime's tables, and a cycle through the runtime and one of them would
keep it alive for good. Views are most of what the collector still saw in loops whose cells
split their gates into views and write them in place (the LSTMCell loop's ``gc ms`` in
``bench_runtime.py --sections models``, README), and so are the weak references that a
record's outputs and a storage's list hold them by, untracked with their cells: a weakref
without a callback refers to nothing the collector follows, and the collector only clears it
when its referent dies. Wrappers and their ``Ref``s stay tracked: a ``Ref`` is a weakref with
a callback, and when its wrapper dies in a garbage cycle the collector moves the ref onto its
list of callbacks to call, which it can only do for a tracked object; hence ``untrack``
refusing weakrefs with a callback.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterable

__all__ = ["NATIVE", "give_back", "track", "untrack"]


def _untrack_nothing(*objs: Any) -> None:
    for o in objs:
        if isinstance(o, weakref.ReferenceType) and o.__callback__ is not None:
            raise TypeError("dtr_ext._collector.untrack: weakrefs with a callback must stay tracked")


def _ignore(*objs: Any) -> None:
    pass


def _load():
    if os.environ.get("DTR_PUREPYTHON", "") not in ("", "0"):
        return None
    try:
        from dtr_ext import _collector
    except ImportError:
        return None
    return _collector if getattr(_collector, "ABI_VERSION", None) == 2 else None


_EXT = _load()
NATIVE: bool = _EXT is not None
untrack = _EXT.untrack if _EXT is not None else _untrack_nothing
track = _EXT.track if _EXT is not None else _ignore


def give_back(storages: Iterable[Any], cells: Iterable[Any] = ()) -> None:
    """Return to the collector ``storages`` (those still in a runtime's graph at its ``close``)
    with the containers of their records and their views, and the view ``cells`` the runtime
    still holds (live wrappers', deaths not yet applied), with the records each is derived by
    (Note [Untracked records]). After a failed ``close`` the runtime keeps them all, and a
    cycle through any of them would otherwise keep the runtime alive."""
    seen: set = set()  # view cells given back: each once, however many paths lead to it
    for s in storages:
        track(s)
        if s.parent is not None:
            _give_back_record(s.parent, seen)
        if s.dependents:
            track(s.dependents)
        if s.views:
            track(s.views)
            for w in s.views:
                c = w()
                if c is not None:
                    _give_back_view(c, seen)
    for c in cells:
        _give_back_view(c, seen)


def _give_back_record(rec: Any, seen: set) -> None:
    track(rec, rec.inputs, rec.outputs, rec.use_storages)
    for c in rec.inputs:
        _give_back_view(c, seen)


def _give_back_view(c: Any, seen: set) -> None:
    """``c`` and the records up to its storage, when it is a view cell (a storage is its own
    root cell), and the same for the cells it was translated to on newer versions of its
    storage (``translate``, which untracks them as it makes them); none twice (``seen``)."""
    work = [c]
    while work:
        c = work.pop()
        while c.storage is not c and id(c) not in seen:
            seen.add(id(c))
            track(c)
            if c.forward is not None:
                work.append(c.forward)
            rec = c.parent
            if rec is None:
                break
            track(rec, rec.inputs, rec.outputs)
            if not rec.inputs:
                break
            c = rec.inputs[0]
