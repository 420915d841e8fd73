"""Eviction heuristics: small scoring objects, registered by name.

The runtime evicts the resident, unlocked, recomputable storage with the *lowest* score.
A heuristic sees storages (``nbytes``, ``cost``, ``last_access``, ``deps()``,
``dependents``, ``state``, and its own ``hdata`` slot) and the logical clock; it never changes
runtime state other than ``hdata``, and it keeps no telemetry (the runtime counts).

Protocol (duck-typed; subclass ``Heuristic`` for the no-op hooks):

- ``score(storage, now) -> float``: lower is evicted first. Contract: while the clock stands
  still, evicting *other* storages may only raise a storage's score, never lower it. The
  runtime relies on this to re-check a few candidates instead of rescoring all of them after
  each eviction (all the paper's heuristics satisfy it: e~* only grows as neighbours leave).
- ``on_evict(storage)``: a storage just left memory (budget eviction, eager eviction, or an
  in-place op that made it an old version).
- ``on_materialize(storage)``: a storage was recomputed.
- ``on_release(storage)``: a storage left the graph for good.
- ``check_invariants(runtime)``: optional, for tests.

Staleness is ``now - last_access + 1`` on the runtime's logical op clock, so that a storage
touched by the current op has staleness 1 rather than 0.
"""

from __future__ import annotations

from itertools import chain
from typing import Callable, Dict, Union

from dtr.engine.storage import State, Storage
from dtr.engine.unionfind import UFNode, find, union

__all__ = [
    "Heuristic",
    "DTREq",
    "LRU",
    "register_heuristic",
    "make_heuristic",
    "heuristic_names",
]

_EVICTED = State.EVICTED


class Heuristic:
    """Base class with no-op lifecycle hooks. Subclasses define ``name`` and ``score``."""

    name = "base"

    def score(self, storage: Storage, now: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

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


class DTREq(Heuristic):
    """h_DTR^eq: (c0(S) + cost of S's evicted neighbourhood) / (bytes(S) · staleness(S)).

    The evicted neighbourhood is approximated by union-find over evicted storages (paper
    C.2): evicting S merges its set with its evicted neighbours' sets; rematerializing S
    subtracts its cost from its set. ``score`` sums the distinct sets adjacent to S.

    Complexity: ``score`` is O(deg(S)) finds; ``on_evict`` O(deg(S)) unions; the other hooks
    O(α(n)).
    """

    name = "dtr_eq"

    def score(self, s: Storage, now: int) -> float:
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
        return cost / ((s.nbytes or 1) * (now - s.last_access + 1))

    def on_evict(self, s: Storage) -> None:
        node = s.hdata = UFNode(s.cost)
        for n in s.deps():
            if n.state is _EVICTED and n.hdata is not None:
                node = union(node, n.hdata)
        for n in s.dependents:
            if n.state is _EVICTED and n.hdata is not None:
                node = union(node, n.hdata)

    def on_materialize(self, s: Storage) -> None:
        self._leave(s)

    def on_release(self, s: Storage) -> None:
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


class LRU(Heuristic):
    """Least recently used: evict the storage whose last access is oldest. O(1) per score."""

    name = "lru"

    def score(self, s: Storage, now: int) -> float:
        return float(s.last_access)


_REGISTRY: Dict[str, Callable[[], Heuristic]] = {}


def register_heuristic(name: str, factory: Callable[[], Heuristic]) -> None:
    """Make ``dtr.budget(..., heuristic=name)`` build its heuristic with ``factory()``.

    ``factory`` is called once per ``dtr.budget`` block, so heuristics may keep per-run state
    (like ``DTREq``'s union-find sets in ``storage.hdata``).
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


register_heuristic("dtr_eq", DTREq)
register_heuristic("lru", LRU)
