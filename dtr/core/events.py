"""What a block's runtime reports as it runs: evictions, replays, failures; what holds memory.

``Events`` is the observer the engine attaches to each block's runtime (``Runtime.events``).
The runtime calls it where it counts an eviction or a replay and where it builds an
``OutOfBudgetError``, none of which happens per op. It keeps only plain data (op names, byte
counts, seconds), never storages, so that what an engine remembers of its last block keeps
nothing of that block alive. ``dtr.explain`` turns it into a report; with debug logging on when
the block starts (``dtr.log``), each event is also logged.

``holdings(runtime)`` reads the runtime's own state: what is charged to the budget now, by group
and by the op that made it. The runtime is the only owner of that state; this is a view of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from dtr.core.eviction import BACKWARD, ORDINARY, PROTECTED, tier
from dtr.errors import OutOfBudgetError, ThrashingError
from dtr.log import logger

__all__ = ["Events", "Failure", "Holding", "Tally", "holdings", "GROUPS"]

#: The groups of ``holdings``, in the order a storage is classified (the first that applies).
GROUPS = (
    "locked",  # inputs and outputs of the op or replay in flight
    "protected by a plan",  # a plan keeps them (the PROTECTED tier, Note [Eviction tiers])
    "loop checkpoints",  # dtr.budget(loops=...) keeps them (PROTECTED too, Note [Loop checkpoints])
    "made in backward",  # gradients in flight (the BACKWARD tier)
    "not recomputable",  # no replayable lineage: flushed, made permanent, non-replayable ops
    "activations",  # evictable: what DTR can drop and recompute
    "gradients",  # .grad tensors made in the block, charged until it ends (Runtime.hold)
    "copies to host",  # swapped out, charged until the copy is done
)

_UNKNOWN_OP = "(lineage dropped)"  # a storage cut from its op keeps no name


@dataclass(frozen=True)
class Holding:
    """Bytes charged to the budget by the storages of one group made by one op."""

    group: str
    op: str
    count: int
    nbytes: int


@dataclass
class Tally:
    """Evictions or replays of the tensors one op made: how many, their bytes, and the cost
    (seconds) of recomputing them (for evictions: the op's recorded cost, once per eviction)."""

    op: str
    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Failure:
    """An ``OutOfBudgetError`` (or ``ThrashingError``) that reached the program.

    ``holdings`` is what was charged when the engine gave up, before it unwound the failed op
    (for a ``ThrashingError``: after, since the failure is the replays' cost, not room)."""

    kind: str
    op: str
    needed_bytes: int
    budget: int
    message: str
    holdings: List[Holding] = field(default_factory=list)
    replays: Optional[int] = None
    ratio: Optional[float] = None


def holdings(rt: Any) -> List[Holding]:
    """What ``rt`` (a ``Runtime``) charges to its budget now, grouped (``GROUPS``) and by the op
    that made each storage, largest first. O(resident storages)."""
    sums: Dict[tuple, List[int]] = {}
    protected_from = rt._protected_from
    kept = rt.kept_by_access
    for s in rt.resident:
        t = tier(s, 0.0, protected_from)
        if t == PROTECTED and s in kept and s.protected == 1 and s.sid < protected_from:
            t = BACKWARD if s.backward else ORDINARY  # kept by a replay chain, not by a plan
        if s.locks:
            group = "locked"
        elif t == PROTECTED:
            group = "loop checkpoints" if s.sid in rt.checkpoints and s.protected == 1 else "protected by a plan"
        elif t == BACKWARD and s.recomputable:
            group = "made in backward"
        elif not s.recomputable:
            group = "not recomputable"
        else:
            group = "activations"
        rec = s.parent
        key = (group, _UNKNOWN_OP if rec is None else rec.name)
        entry = sums.get(key)
        if entry is None:
            sums[key] = [1, s.nbytes]
        else:
            entry[0] += 1
            entry[1] += s.nbytes
    out = [Holding(g, op, n, b) for (g, op), (n, b) in sums.items()]
    if rt.held_bytes:
        out.append(Holding("gradients", ".grad", len(rt.held), rt.held_bytes))
    outgoing = rt.host.outgoing if rt.host is not None else ()
    if outgoing:
        out.append(Holding("copies to host", "(swap out)", len(outgoing), rt.host.outgoing_bytes()))
    out.sort(key=lambda h: -h.nbytes)
    return out


class Events:
    """The observer of one block's runtime (see the module docstring)."""

    def __init__(self) -> None:
        self.evictions: Dict[str, Tally] = {}
        self.replays: Dict[str, Tally] = {}
        self.failure: Optional[Failure] = None
        self._pending: Optional[tuple] = None  # (id, holdings) of the last error built
        self._raised: Optional[int] = None  # id of the error in ``failure``
        self._debug = logger.isEnabledFor(logging.DEBUG)  # once per block, not per event

    def evicted(self, s: Any) -> None:
        rec = s.parent
        name = _UNKNOWN_OP if rec is None else rec.name
        t = self.evictions.get(name)
        if t is None:
            t = self.evictions[name] = Tally(name)
        t.count += 1
        t.nbytes += s.nbytes
        if rec is not None:
            t.seconds += rec.cost
        if self._debug:
            logger.debug("evict %d bytes made by %s (storage %d)", s.nbytes, name, s.sid)

    def replayed(self, rec: Any, seconds: float, nbytes: int) -> None:
        """``rec`` was replayed in ``seconds``, bringing ``nbytes`` back into memory (the outputs
        that were evicted; others, and views, add none)."""
        t = self.replays.get(rec.name)
        if t is None:
            t = self.replays[rec.name] = Tally(rec.name)
        t.count += 1
        t.nbytes += nbytes
        t.seconds += seconds
        if self._debug:
            logger.debug("replay %s (%.3g ms) to recompute %d bytes", rec.name, seconds * 1e3, nbytes)

    def out_of_budget(self, error: OutOfBudgetError, rt: Any) -> None:
        """The runtime built ``error``; it may still catch it (room made before an op is best
        effort), so it counts as a failure only once ``raised`` confirms it."""
        self._pending = (id(error), holdings(rt))
        if self._debug:
            logger.debug("cannot make room: %s", error)

    def raised(self, error: OutOfBudgetError, rt: Any) -> None:
        """``error`` reached the program (called where it leaves the engine; again, for the
        same error, by every outer boundary it crosses)."""
        if self._raised == id(error) and self.failure is not None and self.failure.op == error.op:
            return
        self._raised = id(error)
        pending, self._pending = self._pending, None
        held = pending[1] if pending is not None and pending[0] == id(error) else holdings(rt)
        thrashing = isinstance(error, ThrashingError)
        self.failure = Failure(
            kind=type(error).__name__,
            op=error.op,
            needed_bytes=error.needed_bytes,
            budget=error.budget,
            message=str(error),
            holdings=held,
            replays=error.replays if thrashing else None,
            ratio=error.ratio if thrashing else None,
        )
        logger.info("%s", error)
