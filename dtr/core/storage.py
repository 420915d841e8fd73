"""Storages, cells and op records: the graph the runtime evicts from and replays.

Note [Three levels]
~~~~~~~~~~~~~~~~~~~
- A ``Storage`` is one allocation: the unit of accounting, eviction, locking and reference
  counting. It is also its own *root* cell (``s.root is s``): the tensor its parent op
  computed. (A separate root object would be one more object per op for the cyclic collector
  to visit, and one more cycle to break.)
- A *cell* is one tensor over a storage: the root, or a ``Cell``, a view derived from another
  cell of the same storage by a view op. Both have ``storage``, ``parent``, ``index``,
  ``value`` and ``forward``. A cell is *defined* when its ``value`` is set. Evicting a
  storage undefines all its cells; a view cell is rematerialized by replaying its view op on
  its base (Invariant 5).
- An ``OpRecord`` is one executed operation: its input cells, its output cells and an opaque
  payload that the driver's executor knows how to replay.

The program holds *wrappers* (tensor objects); each points to one cell. Reference counts
live on storages, never on wrappers or cells: autograd saves outputs through ``detach()``,
which makes new wrappers over the same data.

Note [Versions]
~~~~~~~~~~~~~~~
An in-place op on a storage S does not change S: it makes a new storage S' (a new version)
whose parent op is "clone S, then apply the op", and S becomes evicted (its old contents can
still be recomputed from its own parent). ``S.forward`` points to S'; wrappers over cells of
S find their cell of S' lazily (``Runtime.resolve``). Every recorded op therefore stays a
pure function of its inputs (Invariant 4).

Note [Views held weakly]
~~~~~~~~~~~~~~~~~~~~~~~~
A view cell names its record as parent, and the record lists its outputs: a reference cycle
per view, which reference counting never frees. Views come and go with the program (autograd
takes ``y.t()`` in every matmul backward), and the cyclic collector reclaiming them costs as
much as the rest of the engine (~20 us per op in a 1,000-layer forward + backward with
torch's usual heap, mostly full collections over every object of the process). So a
record holds its view outputs through weak references: a view cell lives while the program
holds it, or a view derived from it, and dies with its last wrapper. A root cell's cycle
(storage, root, record) is broken when the storage is released.

Nothing here imports torch: values are opaque objects supplied by a driver.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, List, Optional, Sequence, Union

__all__ = ["State", "Storage", "Cell", "OpRecord", "carry_views", "translate"]

_weak = weakref.ref
_Ref = weakref.ReferenceType


class State(enum.IntEnum):
    """Where a storage's data is."""

    RESIDENT = 0
    """In memory and counted against the budget."""
    EVICTED = 1
    """Freed; recomputable by replaying its parent op (Invariant 3)."""
    EXTERNAL = 2
    """Handed to the program as a plain tensor (e.g. a parameter's ``.grad``): still held,
    no longer counted, never evicted."""
    RELEASED = 3
    """Gone from the graph: the program dropped it and nothing can need it again."""
    SWAPPED = 4
    """Copied to the host tier (``dtr.budget(..., swap=True)``): not counted against the
    budget, brought back on access (core/host_tier.py)."""


# The states under their own names, for the engine's modules that test them in loops.
RESIDENT = State.RESIDENT
EVICTED = State.EVICTED
EXTERNAL = State.EXTERNAL
RELEASED = State.RELEASED
SWAPPED = State.SWAPPED


class Storage:
    """One allocation tracked by the runtime.

    ``refs`` counts live wrappers over any cell of the storage; ``uses`` counts live op records
    that read it (other than view ops on itself); ``locks`` counts in-flight needs (an op
    running, a rematerialization in progress) and is a counter so nested needs compose.
    """

    __slots__ = (
        "sid",
        "nbytes",
        "state",
        "locks",
        "refs",
        "uses",
        "last_access",
        "cost",
        "parent",
        "index",
        "value",
        "views",
        "dependents",
        "forward",
        "runtime",
        "hdata",
        "slot",
        "protected",
        "backward",
        "__weakref__",
    )

    def __init__(
        self,
        runtime: Any,
        sid: int,
        nbytes: int,
        cost: float,
        now: int,
        parent: Optional["OpRecord"] = None,
        index: int = 0,
        value: Any = None,
    ) -> None:
        self.runtime = runtime
        self.sid = sid
        self.nbytes = nbytes
        self.state = RESIDENT
        self.locks = 0
        self.refs = 0
        self.uses = 0
        self.last_access = now
        self.cost = cost
        # As the root cell: the op that computes it (None once it cannot be recomputed), its
        # output position there, and its data while resident.
        self.parent = parent
        self.index = index
        self.value = value
        # Weak references to view cells that may hold values; cleared on eviction. Weak,
        # because a view cell nobody refers to any more must not be kept alive by its storage.
        # Both containers start as an empty tuple and become a list / dict on first use: most
        # storages never get a view, and fewer objects per op is less work for the GC.
        self.views: Union[tuple, List[weakref.ref]] = ()
        # Storages whose parent op reads this one (insertion-ordered, for determinism).
        self.dependents: Union[tuple, dict] = ()
        self.forward: Optional[Storage] = None
        self.hdata: Any = None  # owned by the heuristic (e.g. a union-find node)
        self.slot: Optional[int] = None  # its row in the runtime's candidate index, if any
        # Protections held (Runtime.protect), and whether it was made in a backward pass
        # (Runtime.set_backward): what its eviction tier depends on (eviction.tier).
        self.protected = 0
        self.backward = False

    @property
    def root(self) -> "Storage":
        """The storage's root cell: the storage itself (Note [Three levels])."""
        return self

    @property
    def storage(self) -> "Storage":
        """As for every cell, the storage it is over: here itself."""
        return self

    @property
    def recomputable(self) -> bool:
        rec = self.parent
        return rec is not None and rec.replayable

    def add_view(self, c: "Cell") -> None:
        """Remember a defined view cell (weakly), so that eviction can undefine it."""
        views = self.views
        if not views:
            views = self.views = []
            untrack = self.runtime._untrack
            if untrack is not None:
                untrack(views)  # weak references only: Note [Untracked records]
        views.append(_weak(c))  # the record's own weak reference to ``c``, if it has one
        if len(views) & 63 == 0:  # drop the weakrefs of dead view cells now and then
            views[:] = [w for w in views if w() is not None]

    def deps(self) -> Sequence["Storage"]:
        """Storages this one is computed from (excluding itself)."""
        rec = self.parent
        return rec.use_storages if rec is not None else ()

    def __repr__(self) -> str:
        name = self.parent.name if self.parent is not None else "-"
        return (
            f"Storage(#{self.sid} {self.state.name} {self.nbytes}B refs={self.refs} "
            f"uses={self.uses} locks={self.locks} op={name})"
        )


class Cell:
    """A view: one tensor over a storage, derived from another cell of the same storage (a
    storage is its own root cell)."""

    __slots__ = ("storage", "parent", "index", "value", "forward", "__weakref__")

    def __init__(
        self, storage: Storage, parent: Optional["OpRecord"], index: int, value: Any
    ) -> None:
        self.storage = storage
        self.parent = parent
        self.index = index
        self.value = value
        self.forward: Optional[Cell] = None

    def __repr__(self) -> str:
        state = "defined" if self.value is not None else "undefined"
        return f"Cell(view of #{self.storage.sid}, {state})"


class OpRecord:
    """One executed op, kept so that its outputs can be recomputed.

    ``inputs`` are the cells the replay reads (for a view op, ``inputs[0]`` is the base).
    ``use_storages`` are the distinct input storages other than the outputs' own, i.e. the
    edges of the dependency graph (a sequence: ``inputs`` itself when those are distinct
    roots). ``live`` counts output storages that still name this record as their parent; when
    it drops to zero the record is released and its inputs lose a use.
    ``payload`` belongs to the executor that replays the record (which may instead subclass
    the record, as the eager driver does: one object per op instead of two). ``outputs`` holds root cells
    and weak references to view cells (Note [Views held weakly]); None for outputs dropped.
    """

    __slots__ = (
        "name",
        "inputs",
        "use_storages",
        "outputs",
        "cost",
        "payload",
        "replayable",
        "live",
    )

    def __init__(
        self,
        name: str,
        inputs: List[Cell],
        payload: Any,
        cost: float,
        replayable: bool = True,
    ) -> None:
        self.name = name
        self.inputs = inputs
        self.use_storages: Sequence[Storage] = ()
        self.outputs: List[Union[Cell, weakref.ref, None]] = []
        self.cost = cost
        self.payload = payload
        self.replayable = replayable
        self.live = 0

    def retarget(self, inputs: List[Cell]) -> "OpRecord":
        """A record of the same op on other inputs, with no outputs yet (a view taken again on
        a storage's new version, Note [Versions]). Executors whose records subclass this one
        to carry what a replay needs override it."""
        return OpRecord(self.name, inputs, self.payload, self.cost, self.replayable)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {len(self.inputs)} in, {len(self.outputs)} out)"


def translate(cell: Union[Storage, Cell]) -> None:
    """Give ``cell`` (on S) its counterpart on S's next version, replaying the same views
    (Note [Versions]).

    Note [Translated siblings]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~
    Views that one op made together (the three gates ``unsafe_split`` cuts from a GRU cell's
    ``addmm``) get counterparts that share one record, as the originals do: replaying it for
    one defines every sibling still alive. With a record each, the split would be replayed once
    per gate (docs/runtime.md counts the replays this saves on the ``GRUCell`` loop).
    """
    s2 = cell.storage.forward
    chain = []
    c = cell
    while c.forward is None:  # the root's is the new version itself: the walk stops there
        chain.append(c)
        c = c.parent.inputs[0]
    base = c.forward
    untrack = s2.runtime._untrack
    for c in reversed(chain):
        rec = c.parent
        rec2 = _sibling_record(rec, base, c.index)
        made = rec2 is None
        if made:
            rec2 = rec.retarget([base])
            rec2.outputs = [None] * len(rec.outputs)
        c2 = Cell(s2, rec2, c.index, None)
        rec2.outputs[c.index] = _weak(c2)  # Note [Views held weakly]
        if untrack is not None:
            # As new_view's, the weak reference to the cell included: Note [Untracked records]
            if made:
                untrack(c2, rec2, rec2.inputs, rec2.outputs, rec2.outputs[c.index])
            else:
                untrack(c2, rec2.outputs[c.index])
        c.forward = c2
        base = c2


def _sibling_record(rec: OpRecord, base: Cell, index: int) -> Optional[OpRecord]:
    """The record on ``base`` that a sibling of ``rec``'s output ``index`` was translated with,
    if the nearest live sibling on either side was (Note [Translated siblings]). Nearest only:
    siblings are translated in order, and a scan of every output for each (an ``unbind`` of
    thousands, most of them dead) made translating them quadratic."""
    outs = rec.outputs
    for step in (-1, 1):
        j = index + step
        while 0 <= j < len(outs):
            w = outs[j]
            d = w() if type(w) is _Ref else None
            if d is not None:
                f = d.forward
                if f is not None and f.parent.inputs[0] is base:
                    return f.parent
                break
            j += step
    return None


def carry_views(s: Storage) -> None:
    """Before ``s`` becomes an old version, give its defined views counterparts on the new
    version holding the same values (the data was changed in place, so they are current),
    sparing a replay of each view when the program touches it next."""
    s2 = s.forward
    for w in s.views:
        c = w()
        if c is not None and c.value is not None and c.forward is None:
            translate(c)
            c2 = c.forward
            c2.value = c.value
            s2.add_view(c2)
