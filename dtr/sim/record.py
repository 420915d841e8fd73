"""``RecordingRuntime``: a runtime that writes the calls its driver makes to a trace.

The runtime's public methods are the trace's vocabulary (trace.py, Note [Trace format, version 5]): the
recorder logs each call the driver makes, with tensors named by cell ids, then runs it. The
calls that are one method each (``trace.CALLS``) are logged by overrides made from that table;
the others (an op, acquires, references) are written here. Calls
the runtime makes on itself (``close`` acquires and flushes, ``complete`` unlocks) are part of
the outer call and are not logged, or a replay would run them twice.

One saving: the driver acquires an op's inputs, runs the kernel, then completes the record over
the same input list; the ``op`` event implies that acquire, so it is held back and dropped
when the matching ``complete`` comes.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from dtr.core import Cell, OpRecord, Runtime, Storage
from dtr.errors import OutOfBudgetError
from dtr.sim.trace import CALLS, CELL, CELLS, VALUE, CallEvent, TraceWriter

__all__ = ["RecordingRuntime"]


class RecordingRuntime(Runtime):
    """A ``Runtime`` that logs its driver's calls to ``writer`` (one block)."""

    def __init__(self, budget: Optional[int], heuristic, executor, writer: TraceWriter, **options) -> None:
        super().__init__(budget, heuristic, executor, **options)
        self.writer = writer
        self._depth = 0  # > 0 inside a logged call: nested calls are part of it
        self._cids: "weakref.WeakKeyDictionary[Cell, int]" = weakref.WeakKeyDictionary()
        self._next_cid = 0
        self._rids: Dict[int, int] = {}  # id(Ref) -> ref id, for live refs
        self._next_rid = 0
        self._pending: Optional[Tuple[Sequence[Cell], Dict[str, Any]]] = None
        self._acquired: Dict[tuple, int] = {}  # ids of acquired cells -> open acquires
        self._reserved = 0  # bytes made room for before the op now running (its op event says so)
        writer.write({"e": "begin", "budget": budget})

    # ------------------------------------------------------------------ naming

    def _cid(self, cell: Cell) -> int:
        cid = self._cids.get(cell)
        if cid is None:
            cid = self._cids[cell] = self._next_cid
            self._next_cid += 1
        return cid

    def _emit(self, event: Dict[str, Any]) -> None:
        self._flush_pending()
        self.writer.write(event)

    # ------------------------------------------------------------------ logged calls

    def track(self, wrapper: Any, cell: Cell):
        ref = super().track(wrapper, cell)
        rid = self._rids[id(ref)] = self._next_rid
        self._next_rid += 1
        self._emit({"e": "ref", "ref": rid, "cell": self._cid(cell)})
        return ref

    def _on_wrapper_death(self, ref) -> None:
        # Queue the ref id with the cell, so that the free is logged when it is applied; after
        # the close, as any runtime (a failed block's last wrapper lets go of what it kept).
        if self.closed:
            super()._on_wrapper_death(ref)
        elif self._refs.pop(id(ref), None) is not None:
            self._dead.append((ref.cell, self._rids.pop(id(ref))))

    def drain(self) -> None:
        dead = self._dead
        while dead:
            cell, rid = dead.popleft()
            if not self._depth:
                self._emit({"e": "free", "ref": rid})
            self._death(cell)

    def resolve(self, cell: Cell) -> Cell:
        out = super().resolve(cell)
        if out is not cell and not self._depth:
            self._emit({"e": "resolve", "cell": self._cid(cell), "to": self._cid(out)})
        return out

    def acquire(self, cells: Sequence[Cell]) -> None:
        if self._depth:
            return super().acquire(cells)
        self._flush_pending()
        event = {"e": "acquire", "cells": [self._cid(c) for c in cells]}
        self._pending = (cells, event)
        self._depth += 1
        try:
            super().acquire(cells)
        except BaseException as e:
            event["error"] = _error(e)
            self._flush_pending()
            raise
        finally:
            self._depth -= 1
        key = _key(cells)
        self._acquired[key] = self._acquired.get(key, 0) + 1

    def unlock(self, cells: Iterable[Cell]) -> None:
        if self._depth:
            return super().unlock(cells)
        cells = list(cells)
        key = _key(cells)
        n = self._acquired.pop(key, 0)
        if n > 1:
            self._acquired[key] = n - 1
        self._emit({"e": "unlock", "cells": [self._cid(c) for c in cells]})
        self._reserved = 0  # the op failed: no op event will carry it
        self._call(None, super().unlock, cells)

    def complete(
        self,
        rec: OpRecord,
        mutated: Sequence[Tuple[Storage, Any]],
        fresh: Sequence[Tuple[int, Any, Optional[Cell]]],
    ) -> List[Cell]:
        if self._depth:
            return super().complete(rec, mutated, fresh)
        key = _key(rec.inputs)
        acquired = self._acquired.pop(key, 0)
        if acquired > 1:
            self._acquired[key] = acquired - 1
        if self._pending is not None and self._pending[0] is rec.inputs:
            self._pending = None  # the op event implies it
            acquired = 0
        event = self._op_event(
            rec,
            [self._cid(s.root) for s, _ in mutated],
            [[n, None if base is None else self._cid(base)] for n, _, base in fresh],
        )
        if acquired:
            event["acquired"] = True  # its acquire was logged on its own: do not repeat it
        if self._reserved:
            event["reserve"] = self._reserved
            self._reserved = 0
        outs = self._call(event, super().complete, rec, mutated, fresh, emit=False)
        event["out"] = [self._cid(c) for c in outs]
        self._emit(event)
        return outs

    def defer(self, rec: OpRecord, nbytes: int) -> Storage:
        if self._depth:
            return super().defer(rec, nbytes)
        return self._deferred(rec, [nbytes, None], super().defer, nbytes)

    def defer_view(self, rec: OpRecord, base: Cell) -> Cell:
        if self._depth:
            return super().defer_view(rec, base)
        return self._deferred(rec, [0, self._cid(base)], super().defer_view, base)

    def _deferred(self, rec: OpRecord, new: List[Any], run, arg):
        """Log a deferred op (``defer``, ``defer_view``: its one ``new`` output) and run it."""
        event = self._op_event(rec, [], [new])
        event["deferred"] = True
        out = self._call(event, run, rec, arg, emit=False)
        event["out"] = [self._cid(out)]
        self._emit(event)
        return out

    def reserve(self, nbytes: int, opname: str) -> None:
        if self._depth:
            return super().reserve(nbytes, opname)
        # Made with the op's inputs locked, between its acquire and its completion: the op
        # event carries it, so that a replay makes room at the same point.
        self._reserved = nbytes
        self._call(None, super().reserve, nbytes, opname)

    def close(self, failed: bool = False) -> None:
        try:
            self.drain()  # log the frees the program made, so that a replay's close sees the same refs
        finally:  # the block ends even if that failed (Runtime.close gives back untracked records)
            self._depth += 1
            try:
                super().close(failed)
            finally:
                self._depth -= 1
                self._emit({"e": "end", "failed": True} if failed else {"e": "end"})
                self.writer.flush()
                self._rids.clear()

    # ------------------------------------------------------------------ helpers

    def _call(self, event: Optional[Dict[str, Any]], fn, *args, emit: bool = True):
        """Run ``fn`` as one logged call: nested calls are not logged; ``event`` is written
        after it (or, with ``emit=False``, only if it raised, carrying the error)."""
        self._depth += 1
        try:
            out = fn(*args)
        except BaseException as e:
            if event is not None:
                event["error"] = _error(e)
                self._emit(event)
            raise
        finally:
            self._depth -= 1
        if emit and event is not None:
            self._emit(event)
        return out

    def _op_event(self, rec: OpRecord, mut: List[int], new: List[list]) -> Dict[str, Any]:
        """The ``op`` event of ``rec`` (its outputs' ids are added once they exist)."""
        return {"e": "op", "name": rec.name, "cost": rec.cost, "replayable": rec.replayable,
                "in": [self._cid(c) for c in rec.inputs], "mut": mut, "new": new}

    def _flush_pending(self) -> None:
        if self._pending is not None:
            self.writer.write(self._pending[1])
            self._pending = None


def _logged(event: CallEvent):
    """``RecordingRuntime``'s override of the method ``event`` records: log the call, with its
    arguments coded as the event says, then run it."""
    run = getattr(Runtime, event.method)
    signature = inspect.signature(run)

    def logged(self, *args, **kwargs):
        if self._depth:
            return run(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        logged_event = {"e": event.name}
        for key, param, coding in event.fields:
            v = values[param]
            if coding is CELL:
                v = self._cid(v)
            elif coding is not VALUE:
                values[param] = v = list(v)  # an iterable is read twice: here and by the call
                v = [self._cid(c if coding is CELLS else c.root) for c in v]
            logged_event[key] = v
        return self._call(logged_event, run, *bound.args)

    logged.__name__ = logged.__qualname__ = event.method
    logged.__doc__ = run.__doc__
    return logged


for _event in CALLS.values():
    setattr(RecordingRuntime, _event.method, _logged(_event))


def _key(cells: Iterable[Cell]) -> tuple:
    return tuple(map(id, cells))


def _error(e: BaseException) -> str:
    return "out of budget" if isinstance(e, OutOfBudgetError) else type(e).__name__
