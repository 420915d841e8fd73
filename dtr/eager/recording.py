"""What the engine records of an op that ran: its results sorted, and its record.

The general path (``Driver._run``) sorts an op's results by the schema's returns
(``sort_outputs``: new storages, views of its base, inputs returned as they are, outputs
returned plain) and records a ``Call`` (replay.py) when it made or wrote storages, else a bare
``OpRecord`` (``record``). The one-pass paths (simple ops, one-view ops) build the same record
inline; ``DTR_CROSSCHECK=1`` (crosscheck.py) runs these functions beside them and compares.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from dtr.eager.ops import VIEW, WRITTEN
from dtr.eager.replay import Call
from dtr.core import OpRecord
from dtr.errors import DTRError

__all__ = ["record", "returned_input", "sort_outputs"]

_Tensor = torch.Tensor
_strided = torch.strided


def returned_input(v: torch.Tensor, inputs, consts) -> Any:
    """The input cell an op returned as it is although its schema promised a new tensor."""
    for c in inputs:
        if c.value is v:
            return c
    for t in consts:
        if t is v:
            raise DTRError(
                "dtr internal error: an op returned one of its constant inputs as a new tensor; "
                "please report the op"
            )
    return None


def sort_outputs(facts, out, inputs, consts, base) -> Tuple[list, list, dict, list]:
    """The general path's sort of an op's results ``out``, by flat position:
    ``(fresh, fresh_pos, same, plain)``. ``fresh``: one ``(nbytes, value, base)`` per output
    the engine is to manage (a new storage, or a view of the input cell ``base``), at the
    positions ``fresh_pos``; ``same``: position -> input cell returned as it is; ``plain``:
    outputs returned plain (sparse ones, subclasses: driver.py's module docstring). It changes
    nothing."""
    fresh: List[Any] = []
    fresh_pos: List[int] = []
    same: Dict[int, Any] = {}
    plain: List[torch.Tensor] = []
    returns = facts.returns
    if len(returns) == 1:
        pairs: Any = ((returns[0], out),)
    else:  # several returns, or none (out is None: e.g. the profiler's record_function)
        pairs = zip(returns, out) if returns else ()
    pos = 0
    plain_pos = facts.plain_outputs
    for (rk, is_list, _), o in pairs:
        for v in (o if is_list else (o,)):
            if isinstance(v, _Tensor) and rk != WRITTEN and pos not in plain_pos:
                if type(v) is not _Tensor or v.layout is not _strided:
                    plain.append(v)
                elif rk == VIEW:
                    fresh.append((0, v, base))
                    fresh_pos.append(pos)
                else:
                    c = returned_input(v, inputs, consts)
                    if c is not None:
                        same[pos] = c
                    else:
                        nbytes = v.untyped_storage().nbytes()
                        # An empty output holds nothing to manage, and a one-element
                        # uninitialized one is a placeholder (ops.py, _PLACEHOLDERS): plain,
                        # they stay usable by code that swaps storages in (deepcopy,
                        # torch.load).
                        if nbytes and not (facts.placeholder and v.numel() <= 1):
                            fresh.append((nbytes, v, None))
                            fresh_pos.append(pos)
            pos += 1
    return fresh, fresh_pos, same, plain

def record(facts, func, inputs, seconds, *, args, kwargs, slots, grad, rng_state, fresh, mutated, replayable):
    """The general path's record of an op that ran on ``inputs`` (the old roots of the
    ``mutated`` storages first): a ``Call`` (the argument templates ``args`` and ``kwargs``
    with their ``slots``, the grad mode, the RNG state, the ``fresh`` outputs' positions)
    if it made or wrote storages, else an ``OpRecord`` (the dependency edges and the clock
    only)."""
    if not (fresh or mutated):
        return OpRecord(facts.name, inputs, None, seconds, replayable)
    call = Call(facts.name, inputs, seconds, replayable, func, tuple(args), kwargs, tuple(slots), grad)
    call.rng = rng_state
    call.fresh = tuple(fresh)
    nv = len(mutated)
    if nv:
        call.versions = nv
        call.derive = {
            k: mutated.index(inputs[k].storage) for k in range(nv, len(inputs)) if inputs[k].storage in mutated
        } or None
    if facts.hidden_writes:
        # In training mode batch norm's outputs do not depend on the running statistics,
        # and a replay must not update them a second time (ops.py, _HIDDEN_WRITES).
        if facts.replay_stats == "none":
            template = list(call.args)
            for i in facts.hidden_writes:
                template[i] = None
            call.args = tuple(template)
        else:
            call.clone_args = facts.hidden_writes
    return call
