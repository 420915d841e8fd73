"""How a completed op's outputs join the graph: they fit under the budget (``fit``), their
records get their dependency edges (``wire``), and views become cells of their base
(``new_view``). ``Runtime.complete`` makes the storages and versions and calls these.

Functions of the runtime, like rematerialize.py's: the state they change is the runtime's.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, List, Sequence

from dtr.core.storage import RELEASED, Cell, OpRecord, Storage

if TYPE_CHECKING:
    from dtr.core.runtime import Runtime

__all__ = ["fit", "new_view", "wire"]


def fit(rt: Runtime, rec: OpRecord, new: List[Storage], n_versions: int) -> None:
    """Evict down to the budget with the new outputs locked too; if that fails, drop the
    fresh outputs (as if the op had not happened; versions stay: an in-place write cannot be
    undone) and re-raise."""
    for s in new:
        s.locks += 1
    try:
        rt._evict_to(rt.budget, rec.name)  # type: ignore[arg-type]
    except BaseException:  # OutOfBudgetError, or anything a heuristic raised
        for i, s in enumerate(new[n_versions:], start=n_versions):
            del rt.resident[s]
            rt._leave_graph(s)
            rt.memory -= s.nbytes
            s.state = RELEASED
            s.value = None
            rec.outputs[i] = None
        del new[n_versions:]
        wire(rt, rec, new, rt.clock)
        raise
    finally:
        for s in new:
            s.locks -= 1


def wire(rt: Runtime, rec: OpRecord, new: List[Storage], now: int) -> None:
    """Add the dependency edges of a completed record."""
    rec.live = len(new)
    inputs = rec.inputs
    for c in inputs:
        c.storage.last_access = now
    if not rec.live or not rec.replayable:
        # A view op's outputs live and die with the base's storage; a record that is never
        # replayed needs none of its inputs.
        if not rec.live and rec.outputs and rt._untrack is not None:
            # A view op's record: its cells hold it for as long as they live (Note [Untracked
            # records]).
            rt._untrack(rec, inputs, rec.outputs)
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
    untrack = rt._untrack
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


def new_view(s: Storage, rec: OpRecord, index: int, value: Any) -> Cell:
    """Output ``index`` of ``rec``, a view of ``s`` (a cell of it, Note [Three levels] in
    storage.py)."""
    c = Cell(s, rec, index, value)
    s.add_view(c)
    untrack = s.runtime._untrack
    if untrack is not None:
        untrack(c, weakref.ref(c))  # Note [Untracked records]; the weak reference its record and s hold
    return c
