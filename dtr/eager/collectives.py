"""Collectives in a block (Note [Collectives] in ops.py): run once, on plain values, recorded
as never replayable, and waited for when they write or make tensors the engine manages."""

from __future__ import annotations

from time import perf_counter
from typing import Any, Dict, List

import torch

from dtr.eager.output_size import flat_tensors
from dtr.eager.tensor import DTRTensor, make_wrapper
from dtr.core import Cell, OpRecord, Storage

__all__ = ["run_collective"]

_Tensor = torch.Tensor
_strided = torch.strided


def run_collective(driver, facts, args, kwargs):
    """Run a collective (Note [Collectives] in ops.py) once, on plain values.

    Its record is not replayable, so what it writes or makes cannot be evicted (a swap can
    still move it). A collective that writes or makes tensors of this engine is waited for
    before it returns: the engine must not swap out or hand over memory that another rank's
    data is still landing in. One that touches only constants (DDP's gradient buckets) keeps
    running asynchronously, as without dtr.
    """
    rt = driver.rt
    cells: List[Any] = []
    originals: Dict[int, Any] = {}  # id(value passed to the kernel) -> the program's tensor

    def scan(a):
        if type(a) in (list, tuple):
            return type(a)(scan(b) for b in a)
        if type(a) is DTRTensor and a._dtr.cell.storage.runtime is rt:
            c = a._dtr.cell = rt.resolve(a._dtr.cell)
            cells.append(c)
            return c
        if isinstance(a, _Tensor):
            a = driver._plain(a)
        return a

    def fill_in(a, program):
        if type(a) in (list, tuple):
            return type(a)(fill_in(b, p) for b, p in zip(a, program))
        if type(a) is Cell or type(a) is Storage:
            originals[id(a.value)] = program
            return a.value
        if isinstance(a, _Tensor):
            originals[id(a)] = program
        return a

    mutated = driver._writes(facts, args, kwargs)[0]
    targs = scan(list(args))
    tkw = {k: scan(v) for k, v in kwargs.items()}
    rt.acquire(cells)
    try:
        vals = fill_in(targs, args)
        kw = {k: fill_in(v, kwargs[k]) for k, v in tkw.items()}
        t0 = perf_counter()
        out = facts.kernel(*vals, **kw)
        fresh = [
            (v.untyped_storage().nbytes(), v, None)
            for v in flat_tensors(out)
            if id(v) not in originals and type(v) is _Tensor and v.layout is _strided
        ]
        if mutated or fresh:
            _wait(out)
        seconds = perf_counter() - t0
    except BaseException:
        rt.unlock(cells)
        raise
    driver.op_seconds += seconds
    rec = OpRecord(facts.name, cells, None, seconds, False)
    made = rt.complete(rec, [(s, s.value) for s in mutated], fresh)[len(mutated):]
    program = {id(v): make_wrapper(v, rt, c) for (_, v, _), c in zip(fresh, made)}
    program.update(originals)
    return _rebuilt(out, program)


def _rebuilt(a, program: Dict[int, Any]):
    """``a`` (a collective's result) with each tensor replaced by the program's object for it."""
    if type(a) in (list, tuple):
        return type(a)(_rebuilt(b, program) for b in a)
    return program.get(id(a), a) if isinstance(a, _Tensor) else a


def _wait(out) -> None:
    """Wait until a collective's data has landed: its ``Work`` (``c10d`` ops) or each of its
    tensors (functional collectives)."""
    works = [w for w in (out if type(out) in (list, tuple) else (out,)) if hasattr(w, "wait")]
    for w in works:
        w.wait()
    if not works:
        for t in flat_tensors(out):
            torch.ops._c10d_functional.wait_tensor(t)
