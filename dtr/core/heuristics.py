"""Eviction heuristics: small scoring objects, registered by name.

The runtime evicts the resident, unlocked, recomputable storage with the *lowest* score (ties go
to the lowest storage id). A heuristic sees storages (``nbytes``, ``cost``, ``last_access``,
``deps()``, ``dependents``, ``state``, and its own ``hdata`` slot) and the logical clock; it never
changes runtime state other than ``hdata``, and it keeps no telemetry (the runtime counts).
docs/heuristics.md has the formulas, the paper's names and measured figures.

Note [Heuristic protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~
Duck-typed; subclass ``Heuristic`` for the defaults, and register a factory with
``register_heuristic(name, factory)``.

- ``score(storage, now) -> float``: lower is evicted first. Contract: while the clock stands
  still, evicting *other* storages may only raise a storage's score, never lower it (every
  built-in satisfies it: neighbourhoods only grow as neighbours leave memory). The runtime
  relies on it to re-check a few candidates after an eviction instead of rescoring all.
- ``on_evict(storage)``: a storage just left memory (budget eviction, eager eviction, or an
  in-place op that made it an old version).
- ``on_materialize(storage)``: a storage was recomputed.
- ``on_release(storage)``: a storage left the graph for good (its state already says RELEASED;
  its ``deps()`` are still readable).
- ``check_invariants(runtime)``: optional, for tests.

Staleness is ``now - last_access + 1`` on the runtime's logical op clock, so that a storage
touched by the current op has staleness 1 rather than 0.

Note [Keys]
~~~~~~~~~~~
A heuristic that only defines ``score`` is searched by rescoring every candidate at each
eviction round: O(n log n) for n resident storages, milliseconds at n = 10,000. One that defines
instead

- ``key(storage) -> float``: the part of its score that does not depend on the clock, with the
  class attribute ``staleness`` saying how ``Heuristic.score`` derives the score from it:
  ``key / staleness`` when True, ``key`` itself when False,

gets the runtime's candidate index (core/candidates.py; Note [Candidate index] there), which
finds a victim of the same score (to a relative 1e-5) in microseconds: about 10 µs per eviction
among 10,000 candidates (benchmarks/bench_eviction.py). Both searches look at every candidate:
neither samples (the DTR paper's sampling fails at low budgets). The index caches keys and
trusts a cached key to be a *lower bound* of the current one: a key may rise at any time (the
index re-checks lazily), but a heuristic whose keys can *drop* while a storage stays resident
must report it:

- ``lowered() -> (storages, slack) | None``: the resident storages whose key may have dropped by
  any amount since the previous call, and ``slack``, a bound on how far the key of any other
  storage may have dropped, in units of ``key * max(nbytes, 1)``. None: not known (the index
  then distrusts every cached key). The first call starts the log; ``Heuristic`` keeps it
  (``_lower``), so a subclass only calls ``self._lower(storages, slack)`` from its hooks.
- ``floor(storage) -> float``: a lower bound of ``key`` that holds while the storage is resident;
  the index falls back to it for storages whose key may have dropped.

A subclass that overrides ``score`` too is searched by rescoring (its ``score`` may not be
``key / staleness`` any more).
"""

from __future__ import annotations

from itertools import chain
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

from dtr.core.storage import State, Storage
from dtr.core.unionfind import UFNode, attach, find, union

__all__ = [
    "Heuristic",
    "DTR",
    "DTREq",
    "DTRLocal",
    "LRU",
    "Size",
    "MSPS",
    "Random",
    "register_heuristic",
    "make_heuristic",
    "heuristic_names",
]

_EVICTED = State.EVICTED

# Past this many logged storages the log is dropped and ``lowered()`` answers None (every cached
# key distrusted): a budget that stopped evicting must not make the log grow without end.
_LOG_LIMIT = 1 << 16


class Heuristic:
    """Base class: ``score`` from ``key`` (Note [Keys]), no-op hooks, and the lowering log.

    Subclasses define ``name`` and either ``key`` (with ``staleness``) or ``score``.
    """

    name = "base"
    staleness = True
    # The lowering log (Note [Keys]). Class-level defaults, so that subclasses need not call
    # ``__init__``; None until the candidate index first asks, so a run that never evicts for
    # its budget pays one attribute test per hook.
    _log: Optional[List[Storage]] = None
    _slack = 0.0

    def score(self, storage: Storage, now: int) -> float:
        """``key / staleness`` (or ``key`` when ``staleness`` is False). O(cost of ``key``)."""
        k = self.key(storage)  # type: ignore[attr-defined]
        return k / (now - storage.last_access + 1) if self.staleness else k

    def floor(self, storage: Storage) -> float:
        """A lower bound of ``key`` while ``storage`` is resident (none known: -inf)."""
        return float("-inf")

    def lowered(self) -> Optional[Tuple[List[Storage], float]]:
        """Storages whose key may have dropped since the last call, and the slack for the
        others (Note [Keys]); None on the first call and after the log overflowed. O(1)."""
        log, slack = self._log, self._slack
        self._log, self._slack = [], 0.0
        return None if log is None else (log, slack)

    def _lower(self, storages: Iterable[Storage], slack: float = 0.0) -> None:
        """Log a drop of keys: ``storages`` by any amount, every other one by ``slack``."""
        log = self._log
        if log is None:
            return
        log.extend(storages)
        self._slack += slack
        if len(log) > _LOG_LIMIT:
            self._log = None

    def on_evict(self, storage: Storage) -> None:
        pass

    def on_materialize(self, storage: Storage) -> None:
        pass

    def on_release(self, storage: Storage) -> None:
        pass

    def check_invariants(self, runtime) -> None:
        pass

    def __repr__(self) -> str:
        return f"<heuristic {self.name}>"


# ---------------------------------------------------------------------------- graph searches
#
# The evicted neighbourhood of the paper (C.2): a storage's evicted ancestors reachable through
# evicted storages only (what recomputing it would replay), and its evicted descendants reachable
# the same way (what would need it resident to be recomputed). Iterative: chains can be long.


def _evicted_closure_cost(s: Storage, up: bool) -> float:
    """Sum of costs of the evicted storages reachable from ``s`` through evicted storages, by
    ``deps()`` (``up``) or by ``dependents``. Each counted once. O(region + its edges)."""
    total = 0.0
    seen = None
    stack = [s]
    while stack:
        t = stack.pop()
        for n in (t.deps() if up else t.dependents):
            if n.state is _EVICTED:
                if seen is None:
                    seen = {n}
                elif n in seen:
                    continue
                else:
                    seen.add(n)
                total += n.cost
                stack.append(n)
    return total


def _evicted_frontier(s: Storage, up: bool) -> List[Storage]:
    """The non-evicted storages adjacent to the region ``_evicted_closure_cost`` walks: those
    whose own closure (the other way) reaches ``s``. O(region + its edges)."""
    found: List[Storage] = []
    seen = {s}
    stack = [s]
    while stack:
        t = stack.pop()
        for n in (t.deps() if up else t.dependents):
            if n in seen:
                continue
            seen.add(n)
            if n.state is _EVICTED:
                stack.append(n)
            else:
                found.append(n)
    return found


# ---------------------------------------------------------------------------- h_DTR family


class DTR(Heuristic):
    """h_DTR with the exact evicted neighbourhood e* (paper, section 2 and C.2):
    (c0(S) + cost of e*(S)) / (bytes(S) · staleness(S)).

    e*(S) is S's evicted ancestors reachable through evicted storages (replayed to recompute S)
    and its evicted descendants reachable the same way (which need S resident to be recomputed),
    found by graph search at each evaluation.

    Complexity: ``key`` O(|e*(S)| + their edges); ``on_materialize`` the same search around the
    recomputed storage (only while the candidate index listens); the other hooks O(1).
    """

    name = "dtr"

    def key(self, s: Storage) -> float:
        return (s.cost + _evicted_closure_cost(s, True) + _evicted_closure_cost(s, False)) / (
            s.nbytes or 1
        )

    def floor(self, s: Storage) -> float:
        return s.cost / (s.nbytes or 1)

    def on_evict(self, s: Storage) -> None:
        s.hdata = True  # marks it evicted for on_release, whose state already says RELEASED

    def on_materialize(self, s: Storage) -> None:
        s.hdata = None
        if self._log is not None:
            # Exactly the storages whose e* held s: it no longer counts, nor what lay beyond.
            self._lower(chain(_evicted_frontier(s, True), _evicted_frontier(s, False)))

    def on_release(self, s: Storage) -> None:
        if s.hdata is not None:
            s.hdata = None
            # Nothing depends on a released storage: the storages above it lose its cost only.
            self._lower((), s.cost)

    def check_invariants(self, runtime) -> None:
        for s in runtime.storages():
            assert (s.hdata is not None) == (s.state is _EVICTED), f"{s}: evicted mark is {s.hdata}"


class DTREq(Heuristic):
    """h_DTR^eq: (c0(S) + cost of S's evicted neighbourhood) / (bytes(S) · staleness(S)).

    The evicted neighbourhood is approximated by union-find over evicted storages (paper
    C.2): evicting S merges its set with its evicted neighbours' sets; rematerializing S
    subtracts its cost from its set. ``key`` sums the distinct sets adjacent to S. The sets
    treat edges as undirected and never split, so e~* over-approximates e* ("phantom"
    members left by rematerializations).

    Complexity: ``key`` is O(deg(S)) finds; ``on_evict`` O(deg(S)) unions; the other hooks
    O(α(n)), plus O(deg(S)) to log neighbours while the candidate index listens.
    """

    name = "dtr_eq"

    def key(self, s: Storage) -> float:
        cost = s.cost
        seen = None
        for n in chain(s.deps(), s.dependents):
            if n.state is _EVICTED and n.hdata is not None:
                r = find(n.hdata)
                if seen is None:
                    seen = [r]
                    cost += r.cost
                elif r not in seen:
                    seen.append(r)
                    cost += r.cost
        return cost / (s.nbytes or 1)

    def floor(self, s: Storage) -> float:
        return s.cost / (s.nbytes or 1)

    def on_evict(self, s: Storage) -> None:
        node = None
        for n in s.deps():
            if n.state is _EVICTED and n.hdata is not None:
                node = n.hdata if node is None else union(node, n.hdata)
        for n in s.dependents:
            if n.state is _EVICTED and n.hdata is not None:
                node = n.hdata if node is None else union(node, n.hdata)
        s.hdata = UFNode(s.cost) if node is None else attach(node, s.cost)

    def on_materialize(self, s: Storage) -> None:
        if self._log is not None and s.hdata is not None:
            # Its set loses its cost (every storage next to the set, by that much); its own
            # neighbours may lose the whole set.
            self._lower(chain(s.deps(), s.dependents), s.cost)
        self._leave(s)

    def on_release(self, s: Storage) -> None:
        if s.hdata is not None:
            if self._log is not None:
                self._lower(s.deps(), s.cost)  # nothing reads a released storage
            self._leave(s)

    @staticmethod
    def _leave(s: Storage) -> None:
        if s.hdata is not None:
            find(s.hdata).cost -= s.cost
            s.hdata = None

    def check_invariants(self, runtime) -> None:
        for s in runtime.storages():
            if s.state is _EVICTED:
                assert s.hdata is not None, f"{s} is evicted but has no union-find set"
            else:
                assert s.hdata is None, f"{s} is {s.state.name} but still in a union-find set"


class DTRLocal(Heuristic):
    """h_DTR^local: c0(S) / (bytes(S) · staleness(S)), no neighbourhood (paper 4.1).

    Complexity: ``key`` O(1); no hooks.
    """

    name = "dtr_local"

    def key(self, s: Storage) -> float:
        return s.cost / (s.nbytes or 1)

    floor = key


class MSPS(Heuristic):
    """MSPS ("memory saved per second", Peng et al. 2020, as the paper's 4.1 defines it):
    (c0(S) + cost of e_R(S)) / bytes(S), no staleness.

    e_R(S) is the evicted ancestors that recomputing S would replay: those reachable through
    evicted storages by ``deps()``.

    Complexity: ``key`` O(|e_R(S)| + their edges); ``on_materialize`` a search of the evicted
    descendants of the recomputed storage (only while the candidate index listens); no other
    hooks (a released storage has no dependents, so it is in nobody's e_R).
    """

    name = "msps"
    staleness = False

    def key(self, s: Storage) -> float:
        return (s.cost + _evicted_closure_cost(s, True)) / (s.nbytes or 1)

    def floor(self, s: Storage) -> float:
        return s.cost / (s.nbytes or 1)

    def on_materialize(self, s: Storage) -> None:
        if self._log is not None:
            self._lower(_evicted_frontier(s, False))


# ---------------------------------------------------------------------------- baselines


class LRU(Heuristic):
    """Least recently used: evict the storage whose last access is oldest (the paper's
    h_LRU = 1/staleness orders the same way). ``key`` O(1)."""

    name = "lru"
    staleness = False

    def key(self, s: Storage) -> float:
        return float(s.last_access)


class Size(Heuristic):
    """GreedyRemat (Kumar et al. 2019; the paper's h_size = 1/bytes): largest first, oldest
    first among equals. ``key`` O(1)."""

    name = "size"
    staleness = False

    def key(self, s: Storage) -> float:
        return 1.0 / (s.nbytes or 1)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scrambles every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Random(Heuristic):
    """The paper's h_rand, X ~ U(0, 1), reproducible: a storage's score is a hash of
    (``seed``, its id, how many times it was rematerialized), so it draws afresh each time it
    becomes resident and the same run evicts the same storages for the same seed, whatever
    order anything scores in.

    Complexity: ``key`` O(1); ``on_materialize`` O(1).
    """

    name = "random"
    staleness = False

    def __init__(self, seed: int = 0) -> None:
        if not isinstance(seed, int):
            raise ValueError(f"dtr: Random(seed=...) takes an int, got {seed!r}")
        self.seed = seed
        self._salt = _mix64(seed & _M64)

    def key(self, s: Storage) -> float:
        x = _mix64(self._salt ^ _mix64(s.sid) ^ (s.hdata or 0))
        return (x >> 11) * (1.0 / (1 << 53))

    def on_materialize(self, s: Storage) -> None:
        s.hdata = (s.hdata or 0) + 1

    def __repr__(self) -> str:
        return f"<heuristic random seed={self.seed}>"


# ---------------------------------------------------------------------------- registry

_REGISTRY: Dict[str, Callable[[], Heuristic]] = {}


def register_heuristic(name: str, factory: Callable[[], Heuristic]) -> None:
    """Make ``dtr.budget(..., heuristic=name)`` build its heuristic with ``factory()``.

    ``factory`` is called once per ``dtr.budget`` block, so heuristics may keep per-run state
    (like ``DTREq``'s union-find sets in ``storage.hdata``). The object follows Note
    [Heuristic protocol] in this module; define ``key`` rather than ``score`` for the fast
    search (Note [Keys]).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"dtr.register_heuristic: name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise ValueError(f"dtr.register_heuristic: factory for {name!r} is not callable")
    _REGISTRY[name] = factory


def heuristic_names() -> list:
    """Names accepted by ``dtr.budget(..., heuristic=...)``."""
    return sorted(_REGISTRY)


def make_heuristic(spec: Union[str, Heuristic]) -> Heuristic:
    """A fresh heuristic from a registered name, or ``spec`` itself if it already is one."""
    if isinstance(spec, str):
        try:
            factory = _REGISTRY[spec]
        except KeyError:
            raise ValueError(
                f"dtr: unknown heuristic {spec!r}; choose one of {heuristic_names()} "
                "or register your own with dtr.register_heuristic"
            ) from None
        return factory()
    if callable(getattr(spec, "score", None)):
        return spec
    raise ValueError(f"dtr: heuristic must be a registered name or an object with .score, got {spec!r}")


register_heuristic("dtr", DTR)
register_heuristic("dtr_eq", DTREq)
register_heuristic("dtr_local", DTRLocal)
register_heuristic("msps", MSPS)
register_heuristic("lru", LRU)
register_heuristic("size", Size)
register_heuristic("random", Random)
