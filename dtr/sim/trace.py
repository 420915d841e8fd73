"""The trace format: what a runtime saw, as versioned JSON lines.

A trace is a file of JSON objects, one per line (gzip-compressed when the name ends in
``.gz``). The first line is the header; then come blocks, one per ``dtr.budget`` block run
with the engine, each a ``begin`` event, the events of the block and an ``end`` event.

Note [Trace format, version 5]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Header: ``{"format": "dtr-trace", "version": 5, "heuristic": name, "cost": "auto"|"estimate",
"budget": bytes or null, "meta": {...}}`` (``meta`` is free-form: torch version, model, ...).

Events are the calls the driver made on its runtime, in order, so that replaying them through
``dtr.core.Runtime`` repeats every decision the engine took (``dtr.sim.simulator``). Tensors
are named by *cell ids* (small integers, in order of first appearance; a cell is one tensor
over a storage: its root or a view) and program references by *ref ids*. The events that are
one runtime call each are described once, in ``CALLS``, which the recorder (record.py) and the
simulator (simulator.py) both follow.

- ``{"e": "begin", "budget": b}`` / ``{"e": "end"}``: a block starts (with its budget) / ends
  (``Runtime.close``: live tensors made resident, lineage dropped); ``"failed": true`` when an
  exception left the block (Note [A failed block's exit]: nothing is made resident).
- ``{"e": "op", "name": n, "cost": seconds, "replayable": bool, "in": [cid...],
  "mut": [cid...], "new": [[nbytes, base_cid or null], ...], "out": [cid...]}``: an op ran on
  the defined inputs ``in`` (acquired, i.e. recomputed first if needed) and completed. ``mut``
  are root cells of storages it wrote in place (each gets a new version, first in ``out``);
  ``new`` are its other tensor outputs: a new storage of ``nbytes``, or a view of ``base``.
  ``out`` names the resulting cells. ``"acquired": true`` when the inputs were acquired by a
  separate ``acquire`` event just before (not again by the op). ``"reserve": nbytes`` when
  room was made for the outputs before the kernel ran (``Runtime.reserve``, inputs locked).
  ``"deferred": true`` when the op did not run: its one ``new`` storage is born evicted, to be
  computed by a replay if anything reads it, and ``in`` were not acquired (``Runtime.defer``:
  a gradient scattered into zeros or an outer product, Notes [Scattered gradients] and [Outer
  products] in eager/scattered.py); where its one ``new`` is a view of a base, the view is a
  cell without a value over that unmade output (``Runtime.defer_view``).
- ``{"e": "acquire", "cells": [...]}`` / ``{"e": "unlock", "cells": [...]}``: the program read
  tensors outside an op (``dtr.materialize``, a plain read); ``unlock`` also follows an op
  whose kernel failed.
- ``{"e": "ref", "ref": rid, "cell": cid}``: the program got a tensor object over ``cell``;
  ``{"e": "free", "ref": rid}``: that object died (the engine learned it at this point).
- ``{"e": "resolve", "cell": cid, "to": cid}``: a tensor written in place elsewhere was moved
  to the newest version of its storage.
- ``{"e": "write", "cells": [...]}``: about to write these storages (roots) in place.
- ``{"e": "retire", "cells": [...]}``: the parent ops of these storages (roots) can never run
  again: memory they read is about to be freed (FSDP2 resharding, ``Runtime.retire``).
- ``{"e": "permanent", "cells": [...], "yielding": bool}``: these storages (roots) made
  resident and cut from their lineage (``Runtime.make_permanent``: a sum of gradients made in
  place).
- ``{"e": "extract", "cell": cid}``: a storage handed to the program (``.grad``, materialize).
- ``{"e": "hold", "key": k, "bytes": n}``: the program holds ``n`` bytes under ``k`` (a
  parameter's gradient made in the block), charged until the block ends (``Runtime.hold``).
- ``{"e": "scratch", "bytes": n, "name": opname}``: room made for ``n`` bytes of working
  memory the op about to complete allocates itself (``Runtime.reserve_scratch``: an outer
  product summed a block at a time), recorded with or without a budget.
- ``{"e": "flush"}``: lineage dropped (``optimizer.step()``, a write to a recorded constant).
- ``{"e": "evict", "cells": [roots]}``: a plan drops these storages (those that can go) as
  soon as they are consumed.
- ``{"e": "backward", "on": bool}``: the program's ops run in a backward pass from here on,
  or no longer (``Runtime.set_backward``); traces without it ran none as such.
- ``{"e": "protect_new", "on": bool}``: storages made from here on are a last resort (a plan's
  backward stage began), or no longer (``Runtime.protect_new``).
- ``{"e": "protect", "cells": [roots]}`` / ``{"e": "unprotect", ...}``: these storages are a
  last resort from here on (a tape the plan holds), or no longer (``Runtime.protect``).
- ``{"e": "checkpoint", "cells": [roots], "rank": r}``: these storages are a loop's
  checkpoints of rank ``r`` (``Runtime.checkpoint``, ``dtr.budget(loops=...)``).
- ``{"e": "budget", "budget": b}``: the program changed the budget (simulations at another
  budget ignore it).

An event that raised ``OutOfBudgetError`` in the recorded run carries ``"error"``.

Version 4 is version 5 without ``checkpoint`` events, version 3 is version 4 without deferred
views and ``scratch`` events, and version 2 is version 3 without deferred ops: they load as they
are. Version 1 is version 2 with two more ways to say what a plan holds, which ``load`` rewrites
into version 5's:
``{"e": "pin", "cells": [...]}`` / ``"unpin"`` (a plan's checkpoints locked resident between
ops) become ``protect`` / ``unprotect`` of the cells' storages (the engine protects a plan's
checkpoints rather than locking them: a lock can make a budget infeasible), and
``{"e": "protect", "on": bool}`` is ``protect_new``. A version 1 trace therefore replays as
the current engine would run the program.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

__all__ = ["CALLS", "FORMAT", "VERSION", "CallEvent", "Trace", "TraceWriter", "load"]

FORMAT = "dtr-trace"
VERSION = 5

# How a runtime call's argument is written in an event: a cell by its id, a list of cells by
# their ids, a list of storages by their root cells' ids, or a JSON value as it is.
CELL, CELLS, STORAGES, VALUE = "cell", "cells", "storages", "value"


@dataclass(frozen=True)
class CallEvent:
    """An event that is one call of a ``Runtime`` method, logged as it was made: the recorder
    writes and the simulator replays every such event from this one description.

    ``fields`` are ``(field, parameter, coding)``: the event's key, the method's parameter it
    holds, and how it is written (``CELL``, ``CELLS``, ``STORAGES`` or ``VALUE``). Parameters
    not listed (``set_budget``'s op name) are not recorded. ``replayed=False``: simulations
    skip the event (they run at a budget of their own).
    """

    name: str
    method: str
    fields: Tuple[Tuple[str, str, str], ...] = ()
    replayed: bool = True


# Events with a logic of their own are not calls of one method: ``begin``/``end`` (a block),
# ``op`` (acquire, reserve and complete), ``acquire``/``unlock`` (held back and paired),
# ``ref``/``free`` (program references) and ``resolve`` (logged only when it moves a cell).
CALLS: Dict[str, CallEvent] = {
    e.name: e
    for e in (
        CallEvent("write", "before_write", (("cells", "storages", STORAGES),)),
        CallEvent("retire", "retire", (("cells", "storages", STORAGES),)),
        CallEvent("permanent", "make_permanent", (("cells", "roots", CELLS), ("yielding", "yielding", VALUE))),
        CallEvent("extract", "extract", (("cell", "cell", CELL),)),
        CallEvent("hold", "hold", (("key", "key", VALUE), ("bytes", "nbytes", VALUE))),
        CallEvent("scratch", "reserve_scratch", (("bytes", "nbytes", VALUE), ("name", "opname", VALUE))),
        CallEvent("flush", "flush"),
        CallEvent("budget", "set_budget", (("budget", "limit", VALUE),), replayed=False),
        CallEvent("backward", "set_backward", (("on", "on", VALUE),)),
        CallEvent("protect_new", "protect_new", (("on", "on", VALUE),)),
        CallEvent("protect", "protect", (("cells", "storages", STORAGES),)),
        CallEvent("unprotect", "unprotect", (("cells", "storages", STORAGES),)),
        CallEvent("checkpoint", "checkpoint", (("cells", "storages", STORAGES), ("rank", "rank", VALUE))),
        CallEvent("evict", "evict", (("cells", "storages", STORAGES),)),
    )
}


def _open(path: Path, mode: str):
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")
    return open(path, mode, encoding="utf-8")


class TraceWriter:
    """Writes a trace file: a new one with ``header``, or (``header=None``) appends blocks to
    an existing one (a gzip file then gets another member, which readers join)."""

    def __init__(self, path: Union[str, Path], header: Optional[Dict[str, Any]]) -> None:
        self.path = Path(path)
        self._file = _open(self.path, "w" if header is not None else "a")
        self._dump = json.JSONEncoder(separators=(",", ":")).encode
        if header is not None:
            self.write({"format": FORMAT, "version": VERSION, **header})

    def write(self, event: Dict[str, Any]) -> None:
        self._file.write(self._dump(event))
        self._file.write("\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class Trace:
    """A loaded trace: the header and, per block, its events (``begin`` and ``end`` included)."""

    header: Dict[str, Any]
    blocks: List[List[Dict[str, Any]]] = field(default_factory=list)

    @property
    def ops(self) -> int:
        """Op events in all blocks."""
        return sum(1 for b in self.blocks for e in b if e["e"] == "op")

    @property
    def compute_cost(self) -> float:
        """Sum of the recorded ops' costs (seconds): the run without any recomputation. Deferred
        ops are left out, since they ran only where something read their output, which a
        simulation finds out (``SimResult.base_cost`` counts those)."""
        return sum(
            e["cost"] for b in self.blocks for e in b if e["e"] == "op" and "out" in e and not e.get("deferred")
        )


def load(source: Union[str, Path, Trace]) -> Trace:
    """Read a trace file (or return a loaded ``Trace`` as it is).

    Raises ``ValueError`` naming the file if it is not a trace, or is of a newer version.
    """
    if isinstance(source, Trace):
        return source
    path = Path(source)
    with _open(path, "r") as f:
        first = f.readline()
        try:
            header = json.loads(first)
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"dtr: {path} is not a dtr trace (no '{FORMAT}' header line)")
        version = header.get("version")
        upgrade = _UPGRADES.get(version)
        if version != VERSION and version not in _UPGRADES:
            raise ValueError(
                f"dtr: {path} is a version {version} trace; this dtr reads versions 1 to {VERSION}"
            )
        trace = Trace(header)
        block: Optional[List[Dict[str, Any]]] = None
        for n, line in enumerate(f, start=2):
            event = json.loads(line)
            if upgrade is not None:
                event = upgrade(event)
            kind = event.get("e")
            if kind == "begin":
                block = [event]
                trace.blocks.append(block)
            elif block is None:
                raise ValueError(f"dtr: {path}:{n}: event {kind!r} outside a block")
            else:
                block.append(event)
                if kind == "end":
                    block = None
    return trace


def _from_version_1(event: Dict[str, Any]) -> Dict[str, Any]:
    """A version 1 event in version 5's words (Note [Trace format, version 5])."""
    kind = event.get("e")
    if kind == "pin" or kind == "unpin":
        return dict(event, e="protect" if kind == "pin" else "unprotect")
    if kind == "protect" and "on" in event:
        return dict(event, e="protect_new")
    return event


# version -> its events in the current version's words (None: they are already)
_UPGRADES = {1: _from_version_1, 2: None, 3: None, 4: None}
