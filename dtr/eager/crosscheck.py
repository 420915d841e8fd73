"""``DTR_CROSSCHECK=1``: compare what each one-pass path records with what the general path
would record for the same op.

The driver registers most ops on one-pass paths that skip the general path's bookkeeping:
simple ops (``Driver._run`` with ``facts.simple``: no writes, one new tensor), ops of several
new tensors (``facts.several``, natively registered: hotpath.c's ``several_outputs``), in-place
ops (``facts.in_place``, hotpath.c's ``in_place_op``: compared through the record of the
written storage's new version, from what the general path would have scanned before the op,
where the native path registered it rather than falling back to the general one),
one-view ops and ops returning a list of views (``Driver._run_view``), gradient sums in place
(``Gradients._sum``) and sums into a permanent running sum (``Gradients._add_to_permanent``). Nothing else checks that they
record what the general path would: a drift shows only as a wrong replay, later, or never. With ``DTR_CROSSCHECK`` set to anything but ``0`` when a block starts, the engine runs
a ``CrosscheckedDriver``: after each op a one-pass path handled, it scans the op's arguments
again, sorts the op's results and builds the general path's record (recording.py) into a
throwaway ``Call``, and compares it with the record the engine now holds: name, inputs,
argument templates and slots, constants, grad mode, RNG source, cost (with ``cost="estimate"``),
fresh outputs and their storages' sizes, views' bases, written versions, and what the program
got back. The kernel never runs twice (in-place ops and random ones would change state): the
comparison reads the op's output where the engine holds it. A difference raises an
``AssertionError`` naming the op, the path and the field. ``crosschecked`` counts the
comparisons by path. A debugging aid: every op pays for a second scan and record.
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from typing import Any

import torch

from dtr.eager import rng
from dtr.eager.cost import estimate_seconds
from dtr.eager.driver import Driver
from dtr.eager.recording import record, sort_outputs
from dtr.eager.output_size import flat_tensors
from dtr.eager.replay import fill, flat
from dtr.eager.tensor import DTRTensor
from dtr.core import State, Storage

__all__ = ["CrosscheckedDriver", "enabled"]

_Tensor = torch.Tensor


def enabled() -> bool:
    """Whether ``DTR_CROSSCHECK`` is set to anything but ``0`` (read as each block starts)."""
    return os.environ.get("DTR_CROSSCHECK", "").strip() not in ("", "0")


class CrosscheckedDriver(Driver):
    """A ``Driver`` that checks each one-pass path against the general one (module
    docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crosschecked: Counter = Counter()  # path -> comparisons made
        self._executed = 0  # calls of the general path, ``_execute``

    def _execute(self, facts, func, args, kwargs):
        self._executed += 1
        return super()._execute(facts, func, args, kwargs)

    def _run(self, facts, func, args, kwargs):
        before = self._before_in_place(args) if facts.in_place and not kwargs else None
        # Ops of several outputs and in-place ops only where the native path registered them:
        # the general path's record of a fallback would be compared with itself. (A simple
        # op's fallback registers on _execute's own one-pass branch, compared too.)
        executed = self._executed
        result = super()._run(facts, func, args, kwargs)
        if facts.simple:
            self._compare("simple op", facts, func, args, kwargs, result, None)
        elif facts.several and self._executed == executed:
            self._compare("several outputs", facts, func, args, kwargs, result, None)
        elif before is not None and self._executed == executed:
            self._compare_in_place(facts, func, args, result, *before)
        return result

    def _before_in_place(self, args):
        """Before an op of ``facts.in_place`` runs, what the general path would record it from
        (``Driver._writes`` and ``_scan``, without their protections): the written storage,
        the inputs (its root first), the template, slots and constants, the input values and
        the root's value. None where the op writes no resident tensor of this engine or reads
        an evicted one (the general path then runs it: nothing to compare)."""
        mutated: list = []
        elsewhere: list = []
        self._sort_written(flat_tensors(args[0]), mutated, elsewhere, elsewhere)
        if elsewhere or len(mutated) != 1 or mutated[0].state is not State.RESIDENT:
            return None
        s = mutated[0]
        inputs = [s.root]
        slots: list = []
        consts: list = []
        targs = list(args)
        self._scan(enumerate(args), targs, list(args), inputs, slots, consts, None)
        if any(c.value is None for c in inputs):
            return None
        vals, _ = fill(targs, None, slots, lambda k: inputs[k].value)
        return s, inputs, targs, slots, consts, vals, s.value

    def _compare_in_place(self, facts, func, args, result, s, inputs, targs, slots, consts, vals, value) -> None:
        """Compare the record of an op of ``facts.in_place`` (the parent of the written
        storage's new version) with the general path's, built from ``_before_in_place``."""
        path = "in place"
        _expect(facts, path, "result", _describe(result), "the program's own tensor", result is args[0])
        new = s.forward
        _expect(facts, path, "new version", new, "a storage", new is not None)
        made = new.parent
        self.crosschecked[path] += 1
        cost = estimate_seconds(func, vals, {}, [vals[0]]) if self.estimate else made.cost
        general = record(facts, func, inputs, cost, args=targs, kwargs=None, slots=slots,
                         grad=torch.is_grad_enabled(), rng_state=None, fresh=(), mutated=[s], replayable=True)
        if not s.recomputable:
            general.replayable = False  # Runtime.complete's decision
        for field in ("name", "func", "cost", "replayable", "grad", "versions", "derive", "fresh", "clone_args",
                      "slots", "inputs", "args", "kwargs", "rng"):
            got, want = getattr(made, field), getattr(general, field)
            _expect(facts, path, field, got, want, _same(got, want))
        got = list(made.consts[1::3])
        _expect(facts, path, "constants", got, consts, _same(got, consts))
        got = [(o.sid, o.nbytes, o.index, o.value is value or o.value is None) for o in made.outputs]
        want = [(new.sid, s.nbytes, 0, True)]
        _expect(facts, path, "outputs (storage, bytes, index, value)", got, want, got == want)

    def _run_view(self, facts, func, base: DTRTensor, args):
        executed = self._executed
        result = super()._run_view(facts, func, base, args)
        # Not handed to the general path (an evicted base), nor deferred (an unmade base).
        if self._executed == executed and not (type(result) is DTRTensor and result._dtr.cell.value is None):
            path = "list-view op" if facts.list_view else "one-view op"
            self._compare(path, facts, func, args, {}, result, facts.view_of)
        return result

    def _sum(self, facts, args) -> Any:
        # No reference to ``args[0]`` is held across the sum: its reference count is what
        # decides whether it may be summed in place (accumulation.exclusive).
        before = args[0]._dtr.cell.storage
        result = super()._sum(facts, args)
        old = args[0]
        if before.forward is not None:  # summed in place (out of place, _run compared it)
            # The general path returns the program's own tensor for a write (``old``); the sum
            # returns a new wrapper, which must stand for the same data.
            cell = self.rt.resolve(old._dtr.cell)
            _expect(facts, "sum in place", "result's cell", result._dtr.cell, cell, result._dtr.cell is cell)
            got = (result.shape, result.stride(), result.storage_offset(), result.dtype)
            want = (old.shape, old.stride(), old.storage_offset(), old.dtype)
            _expect(facts, "sum in place", "result's view", got, want, got == want)
            self.crosschecked["sum in place"] += 1
        elif type(result) is DTRTensor and result._dtr.cell.storage is before:
            # Added to a permanent running sum: no new version; the result stands for ``old``.
            cell = old._dtr.cell
            _expect(facts, "sum into a permanent sum", "result's cell", result._dtr.cell, cell, result._dtr.cell is cell)
            _expect(facts, "sum into a permanent sum", "lineage", before.parent, None, before.parent is None)
            got = (result.shape, result.stride(), result.storage_offset(), result.dtype)
            want = (old.shape, old.stride(), old.storage_offset(), old.dtype)
            _expect(facts, "sum into a permanent sum", "result's view", got, want, got == want)
            self.crosschecked["sum into a permanent sum"] += 1
        return result

    def _compare(self, path: str, facts, func, args, kwargs, result, only) -> None:
        """Rebuild the general path's record of the op just run and compare (module docstring)."""
        writes = self._writes(facts, args, kwargs)  # none, for an op a one-pass path takes
        _expect(facts, path, "writes", writes, ([], [], []), writes == ([], [], []))
        inputs: list = []
        slots: list = []
        consts: list = []
        targs = list(args)
        self._scan(enumerate(args), targs, list(args), inputs, slots, consts, only)
        tkw = dict(kwargs) if kwargs else None
        if kwargs:
            self._scan(kwargs.items(), tkw, dict(kwargs), inputs, slots, consts, only)
        if any(c.value is None for c in inputs):
            raise AssertionError(f"DTR_CROSSCHECK: {facts.name} ({path}): an input was evicted before comparing")
        vals, kw = fill(targs, tkw, slots, lambda k: inputs[k].value)
        results = result if facts.several or facts.list_view else (result,)
        helds = [r._dtr.cell if type(r) is DTRTensor else None for r in results]
        outs = tuple(r if h is None else h.value for r, h in zip(results, helds))
        out = outs if facts.several else list(outs) if facts.list_view else outs[0]
        base = inputs[0] if only is not None else None
        fresh, fresh_pos, same, _ = sort_outputs(facts, out, inputs, consts, base)

        # What the program got back, at each position: a wrapper over a new cell, over the
        # input returned as it is, or the plain result.
        for pos, c in same.items():
            _expect(facts, path, "result's cell", helds[pos], c, helds[pos] is c)
        made = None
        for pos, (r, h, o) in enumerate(zip(results, helds, outs)):
            if pos in same:
                continue
            if pos not in fresh_pos:
                _expect(facts, path, "result", _describe(r), "the plain result", r is o)
                continue
            _expect(facts, path, "result", _describe(r), "a wrapper over a new cell", h is not None)
            made = made or h.parent
        if made is None:  # nothing recorded (plain results, inputs returned): nothing to compare
            return
        self.crosschecked[path] += 1

        cost = estimate_seconds(func, vals, kw, flat(out)) if self.estimate else made.cost
        general = record(facts, func, inputs, cost, args=targs, kwargs=tkw, slots=slots,
                         grad=torch.is_grad_enabled(), rng_state=made.rng, fresh=fresh_pos, mutated=(),
                         replayable=True)
        for field in ("name", "func", "cost", "replayable", "grad", "versions", "derive", "fresh", "clone_args",
                      "slots", "inputs", "args", "kwargs"):
            got, want = getattr(made, field), getattr(general, field)
            _expect(facts, path, field, got, want, _same(got, want))
        got = list(made.consts[1::3])
        _expect(facts, path, "constants", got, consts, _same(got, consts))
        got = None if made.rng is None else made.rng[:2]
        want = rng.capture(vals, kw)[:2] if facts.random else None
        _expect(facts, path, "RNG source", got, want, _same(got, want))
        got = [_output(o() if type(o) is weakref.ref else o) for o in made.outputs]
        want = [(nbytes, id(v), None if base is None else base.storage.sid) for nbytes, v, base in fresh]
        _expect(facts, path, "outputs (bytes, value, base storage)", got, want, got == want)
        got = [helds[pos].index for pos in fresh_pos]
        want = list(range(len(fresh_pos)))
        _expect(facts, path, "result cells' indices", got, want, got == want)


def _output(o) -> tuple:
    """An output cell as ``sort_outputs`` describes it: bytes, value, base storage."""
    if o is None:
        return (None, None, None)
    if type(o) is Storage:
        return (o.nbytes, id(o.value), None)
    return (0, id(o.value), o.storage.sid)


def _describe(result) -> str:
    if type(result) is DTRTensor:
        return f"a wrapper over {result._dtr.cell!r}"
    return f"a plain {type(result).__name__}"


def _same(a, b) -> bool:
    """Equal as records hold them: tensors and cells by identity, containers element by
    element."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, _Tensor) or hasattr(a, "storage"):
        return a is b
    return a is b or a == b


def _expect(facts, path: str, field: str, got, want, ok: bool) -> None:
    if not ok:
        raise AssertionError(
            f"DTR_CROSSCHECK: {facts.name} ({path}): {field} differs from the general path's: "
            f"{got!r} here, {want!r} there"
        )
