"""``Runtime.check_invariants``: the runtime's invariants (runtime.py's docstring), and what its
parts must agree on, asserted over the whole graph. O(graph); for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtr.core.storage import EVICTED, RELEASED, RESIDENT, SWAPPED

if TYPE_CHECKING:
    from dtr.core.runtime import Runtime

__all__ = ["check"]


def check(rt: Runtime) -> None:
    """Assert that ``rt`` holds its invariants between ops."""
    memory = rt.held_bytes + (rt.host.outgoing_bytes() if rt.host is not None else 0)
    assert rt.held_bytes == sum(rt.held.values()), "held bytes disagree with their keys"
    for s in rt.resident:
        assert s.state is RESIDENT, f"{s} is in the resident set"
        memory += s.nbytes
    assert memory == rt.memory, f"memory {rt.memory} != sum of resident {memory}"
    for s in rt._all:
        assert s.state is not RELEASED, f"{s} is released but still registered"
        assert s.locks == 0, f"{s} is still locked between ops"
        assert s.refs >= 0 and s.uses >= 0, f"{s} has a negative count"
        assert (s.state is RESIDENT) == (s in rt.resident), f"{s} resident set mismatch"
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
    for s in rt._all:
        rec = s.parent
        if rec is not None and id(rec) not in counted:
            counted[id(rec)] = rec
    uses: dict = {}
    for rec in counted.values():
        for i in rec.use_storages:
            uses[i] = uses.get(i, 0) + 1
    for s in rt._all:
        assert s.uses == uses.get(s, 0), f"{s} counts {s.uses} uses, the graph has {uses.get(s, 0)}"
    if rt.host is not None:
        rt.host.check(rt._all)
    if rt.budget is not None:
        assert rt.memory <= rt.budget, (
            f"resident {rt.memory} bytes exceed the budget {rt.budget} between ops"
        )
    if rt._index is not None:
        rt._index.check(rt.resident)
    check = getattr(rt.heuristic, "check_invariants", None)
    if check is not None:
        check(rt)
