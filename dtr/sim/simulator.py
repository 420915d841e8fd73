"""``dtr.simulate``: replay a trace through the engine at another budget or heuristic.

The simulator is a driver, not a model of the engine: it feeds a trace's events (trace.py) to
``dtr.core.Runtime``, the same class the eager driver uses, with an executor whose "replay"
returns placeholder values and the recorded cost of the op. Every eviction, recomputation and
byte count therefore comes from the code that runs under ``dtr.budget``; only the kernels and
the clock are fake (the runtime's logical op clock orders accesses, and recorded costs stand
in for time). Of the eager driver it repeats one rule, the room it makes before an op
(``RoomBeforeOps``), for traces recorded without a budget, which do not record that room.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from dtr.config import parse_bytes
from dtr.core import Counters, Heuristic, OpRecord, Runtime, make_heuristic
from dtr.core.host_tier import HostTier
from dtr.errors import OutOfBudgetError
from dtr.sim.trace import CALLS, CELL, CELLS, VALUE, Trace, load

__all__ = ["SimResult", "simulate"]

_DATA = True  # the placeholder value of every simulated tensor


@dataclass(frozen=True)
class SimResult:
    """What a simulated run cost.

    Attributes:
        feasible: the whole trace ran under the budget (False: the engine raised
            ``OutOfBudgetError``; the other fields count what ran until then).
        total_cost: recorded cost of the trace's ops plus ``remat_cost`` (seconds, as recorded).
        remat_cost: cost of the ops replayed to recompute evicted tensors.
        peak_bytes: the most bytes resident at once (the engine's accounting).
        evictions: storages evicted to meet the budget.
        rematerializations: ops replayed to recompute evicted storages.
        base_cost: recorded cost of the trace's ops alone (the run with no recomputation; an
            op deferred in the recording counts once something has read its output).
        eager_evictions: storages evicted because the program had dropped them.
        error: why the simulation stopped, when it is not feasible.
        swaps_out, swaps_in, prefetches: host-tier traffic (``swap=True``): copies out,
            copies back that the program waited for, copies back ahead of need.
        swap_stall: seconds waited for copies back, at the given bandwidth: synchronous
            swap-ins, and the part of a prefetch's transfer that the ops left before its need
            cannot cover (copies out are assumed to overlap compute); included in ``total_cost``.
    """

    feasible: bool
    total_cost: float
    remat_cost: float
    peak_bytes: int
    evictions: int
    rematerializations: int
    base_cost: float = 0.0
    eager_evictions: int = 0
    error: Optional[str] = None
    swaps_out: int = 0
    swaps_in: int = 0
    prefetches: int = 0
    swap_stall: float = 0.0

    @property
    def slowdown(self) -> float:
        """``total_cost / base_cost``: the compute overhead of the budget (1.0: none)."""
        return self.total_cost / self.base_cost if self.base_cost else 1.0


class SimExecutor:
    """Replays a record by returning placeholders and its recorded cost."""

    views_alias_data = True  # as under torch, so that writes carry view values the same way

    @staticmethod
    def replay(rec: OpRecord):
        return [_DATA] * len(rec.outputs), rec.cost

    @staticmethod
    def forget(rec: OpRecord) -> None:
        pass

    @staticmethod
    def swap_out(value):
        return value

    @staticmethod
    def swap_done(handle) -> bool:
        return True

    @staticmethod
    def swap_wait(handle) -> None:
        pass

    @staticmethod
    def swap_in(handle):
        return handle, 0.0  # the stall is modelled from the bytes (SimResult.swap_stall)

    @staticmethod
    def prefetch(handle):
        return handle, True

    @staticmethod
    def arrive(pending) -> None:
        pass


class _Wrapper:
    """Stands for a tensor object the program held (the runtime keeps a weak reference)."""

    __slots__ = ("__weakref__",)


def simulate(
    trace: Union[str, Path, Trace],
    budget: Union[int, str, None],
    heuristic: Union[str, Heuristic] = "dtr_eq",
    *,
    swap: bool = False,
    bandwidth: Optional[float] = None,
    host_limit: Union[int, str, None] = None,
    max_recompute: Optional[float] = None,
) -> SimResult:
    """Replay ``trace`` (a path or a loaded ``Trace``) through the engine under ``budget``.

    Runs the same eviction and rematerialization code as ``dtr.budget`` with a fake executor:
    recorded op costs stand in for kernel time. Budget changes recorded in the trace are
    ignored (the simulation runs at ``budget`` throughout). An event that failed in the
    recorded run (``OutOfBudgetError``) is tried again: if it fails here too, the simulation
    stops there, infeasible; if it succeeds, its results are dropped at once (the program never
    got them) and the simulation goes on.

    Args:
        trace: path of a trace written by ``dtr.budget(..., trace=path)``, or ``dtr.sim.load(path)``.
        budget: bytes, a size string ("800MB"), or None (no limit).
        heuristic: a registered name (``dtr.heuristic_names()``) or a heuristic object.
        swap: also swap to a host tier (as ``dtr.budget(..., swap=True)``), at ``bandwidth``
            bytes per second (required with swap), holding at most ``host_limit`` bytes.
        max_recompute: stop a block whose replays cost more than this many times its ops, as
            ``dtr.budget`` does (Note [Thrashing]): infeasible, with the ``ThrashingError``'s
            message. None (the default): never; a thrashing budget then runs to its end.

    Returns:
        A ``SimResult``. An infeasible budget gives ``feasible=False``, not an exception.

    Raises:
        ValueError: on a malformed budget, an unknown heuristic or an inconsistent trace.
    """
    tr = load(trace)
    limit = parse_bytes(budget)
    make_heuristic(heuristic)  # fail on an unknown name before running anything
    if swap and not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
        raise ValueError(f"dtr.simulate: swap=True needs a positive bandwidth in bytes per second, got {bandwidth!r}")
    if not swap and (bandwidth is not None or host_limit is not None):
        raise ValueError("dtr.simulate: bandwidth and host_limit apply to swapping; pass swap=True")
    host_bytes = parse_bytes(host_limit)
    log = None
    counts = Counters()
    stall = 0.0
    base = 0.0
    peak = 0
    error = None
    room = RoomBeforeOps()
    for block in tr.blocks:
        host = HostTier(bandwidth, host_bytes, log) if swap else None
        rt = Runtime(
            limit, make_heuristic(heuristic), SimExecutor(), max_recompute=max_recompute, host=host
        )
        try:
            run_block(rt, block, room)
        except OutOfBudgetError as e:
            error = str(e)
        finally:
            base += rt.work
            counts.add(rt.counters)
            peak = max(peak, rt.peak)
            if rt.host is not None:
                log = rt.host.log
                stall += sum(n for _, _, n in log.swap_ins) / bandwidth + rt.host.late_seconds
        if error is not None:
            break
    return SimResult(
        feasible=error is None,
        total_cost=base + counts.remat_seconds + stall,
        remat_cost=counts.remat_seconds,
        peak_bytes=peak,
        evictions=counts.evictions,
        rematerializations=counts.rematerializations,
        base_cost=base,
        eager_evictions=counts.eager_evictions,
        error=error,
        swaps_out=counts.swaps_out,
        swaps_in=counts.swaps_in,
        prefetches=counts.prefetches,
        swap_stall=stall,
    )


class RoomBeforeOps:
    """The eager driver's room before an op (Note [Room before an op] in eager/driver.py), for
    a block recorded without a budget, which carries no ``reserve`` events: simulated under a
    budget, it makes room for an op's new storages before the op when the driver would, that
    is in an engine's first block (until a block with ops has ended) and later where the
    headroom is less than the largest storage an op has made. A block recorded under a budget
    carries the driver's own ``reserve`` events instead (with the meta device's sizes), and
    is replayed as it is.

    Without it, a budget simulated on an unlimited run's trace would evict for each op only
    after the op, with its outputs locked too, where a real run makes room before: the peak
    would pass the budget by an op, and other storages would go (docs/heuristics.md has the
    measurements). One per simulated engine: it carries what it learned from block to block.
    """

    __slots__ = ("largest", "every", "_ops")

    def __init__(self) -> None:
        self.largest = 0  # the largest new storage an op has made
        self.every = True  # no block with ops has ended: every op is sized
        self._ops = False  # the block running has had an op

    @classmethod
    def having_run(cls, blocks: List[List[Dict[str, Any]]]) -> "RoomBeforeOps":
        """The state of an engine that has run ``blocks`` (a trace's earlier blocks)."""
        room = cls()
        for events in blocks:
            for e in events:
                room.saw(e)
        return room

    @staticmethod
    def applies(events: List[Dict[str, Any]]) -> bool:
        """Whether ``events`` (one block) were recorded without a budget and its room."""
        return events[0].get("budget") is None and not any("reserve" in e for e in events)

    def before(self, rt: Runtime, event: Dict[str, Any]) -> None:
        """Make room for the op ``event``'s new storages, if the driver would; its inputs are
        acquired."""
        budget = rt.budget
        if budget is None:
            return
        nbytes = sum(n for n, base in event["new"] if base is None)
        if nbytes and (self.every or rt.memory + self.largest > budget):
            rt.reserve(nbytes, event["name"])

    def saw(self, event: Dict[str, Any]) -> None:
        """Learn from ``event`` once it has run: an op's new storages (also of an op refused
        after it ran, as the driver does), or a block's end."""
        kind = event["e"]
        if kind == "op":
            self._ops = True
            for n, base in event["new"]:
                if base is None and n > self.largest:
                    self.largest = n
        elif kind == "end":
            if self._ops and not event.get("failed"):
                self.every = False
            self._ops = False


def run_block(rt: Runtime, events: List[Dict[str, Any]], room: Optional[RoomBeforeOps] = None) -> None:
    """Feed one block's events to ``rt`` (a fresh runtime with a ``SimExecutor``, whose
    ``work`` is then the recorded cost of the ops, deferred ones once made). ``room``: the
    simulated engine's ``RoomBeforeOps``, which makes room before ops where the block was
    recorded without a budget, and learns from it (None: none is made but what the trace
    records). ``dtr.timeline`` watches a block this way."""
    cells: Dict[int, Any] = {}
    wrappers: Dict[int, _Wrapper] = {}
    emulate = room is not None and room.applies(events)

    def cell(cid: int):
        try:
            return cells[cid]
        except KeyError:
            raise ValueError(f"dtr: inconsistent trace: cell {cid} is used before it was made") from None

    for event in events:
        kind = event["e"]
        failed = "error" in event
        if kind == "op" and event.get("deferred"):
            inputs = [cell(c) for c in event["in"]]
            rec = OpRecord(event["name"], inputs, None, event["cost"], event["replayable"])
            nbytes, base = event["new"][0]
            cells[event["out"][0]] = rt.defer(rec, nbytes) if base is None else rt.defer_view(rec, cell(base))
        elif kind == "op":
            inputs = [cell(c) for c in event["in"]]
            if not event.get("acquired"):
                rt.acquire(inputs)
            if "reserve" in event:
                rt.reserve(event["reserve"], event["name"])
            elif emulate:
                room.before(rt, event)  # type: ignore[union-attr]
            rec = OpRecord(event["name"], inputs, None, event["cost"], event["replayable"])
            mutated = [(cell(c).storage, _DATA) for c in event["mut"]]
            fresh = [(n, _DATA, None if b is None else cell(b)) for n, b in event["new"]]
            outs = rt.complete(rec, mutated, fresh)
            if room is not None:
                room.saw(event)
            if failed:  # the program never got the outputs: nothing refers to them
                rt.acquire(outs)
                rt.unlock(outs)
            else:
                for cid, c in zip(event["out"], outs):
                    cells[cid] = c
        elif kind == "ref":
            # No local name for the wrapper: the dict must hold its only reference.
            rt.track(wrappers.setdefault(event["ref"], _Wrapper()), cell(event["cell"]))
        elif kind == "free":
            del wrappers[event["ref"]]  # its weak reference's callback queues the death
            rt.drain()
        elif kind == "acquire":
            acquired = [cell(c) for c in event["cells"]]
            rt.acquire(acquired)
            if failed:  # the program got an error, and will not unlock them
                rt.unlock(acquired)
        elif kind == "unlock":
            rt.unlock([cell(c) for c in event["cells"]])
        elif kind == "resolve":
            cells[event["to"]] = rt.resolve(cell(event["cell"]))
        elif kind in CALLS:
            call = CALLS[kind]
            if call.replayed:
                getattr(rt, call.method)(**{
                    param: _decoded(event[key], coding, cell) for key, param, coding in call.fields if key in event
                })
        elif kind == "end":
            rt.close(event.get("failed", False))
            if room is not None:
                room.saw(event)
        elif kind != "begin":
            raise ValueError(f"dtr: unknown trace event {kind!r}")


def _decoded(value: Any, coding: str, cell) -> Any:
    """A call's argument from its field in an event (trace.CallEvent); ``cell`` maps a cell id
    to the cell."""
    if coding is VALUE:
        return value
    if coding is CELL:
        return cell(value)
    if coding is CELLS:
        return [cell(c) for c in value]
    return [cell(c).storage for c in value]
