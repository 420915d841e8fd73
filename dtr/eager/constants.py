"""The constant and alias table: memory a block's records read without owning it, and managed
memory the program holds as plain tensors.

A *constant* is a tensor that existed before the block (a parameter, a buffer, an input,
optimizer state) or that the engine cannot manage (a sparse tensor, a subclass with a
``__torch_dispatch__`` of its own): recorded ops read it as it is, never wrapped or charged.
A storage *handed out* (EXTERNAL: ``.grad``, ``dtr.materialize``, the parts of a plain output)
is managed memory the program now holds as a plain tensor. ``Constants`` keeps both, per
block, for one question: what must happen before a write (Note [Aliases]).

Note [Aliases]
~~~~~~~~~~~~~~
Recorded ops read memory the engine does not own (constants), and the program can hold
managed memory as a plain tensor (storages handed out, EXTERNAL). A write to either must be
seen before it happens: a recorded op that read the old data cannot be replayed afterwards
(``Runtime.flush``), and the outputs of ops that read a handed-out storage are made permanent
(``Runtime.before_write``). The mode sees every in-place op on the block's thread, but the
written tensor may be an alias with an identity of its own (``x.data``, ``x.detach()``, a
sparse tensor's ``_values()``), unknown to ``key``: so writes are matched by memory address
too. Without that match, a write through ``x.data`` of a constant, or through ``.data``,
``.detach()`` or a sparse part of a handed-out storage, would make a later replay read the
new data: a silent wrong value (tests in test_tensors.py); so would a write through the
wrapper of a handed-out storage that a record read as a constant (``z = dtr.materialize(y) *
3``, then ``y.add_``). Not matched: a write no dispatch sees (another thread, numpy), caught at
replay by the version check only where it shares the version counter; memory a constant
reaches after ``set_`` or ``x.data = y``; the inner tensors of a subclass without
``__tensor_flatten__``; an overlapping view of the same memory made elsewhere (two
``from_numpy`` tensors).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from dtr.eager.replay import Call, own_dispatch
from dtr.core import State

__all__ = ["Constants", "addresses_of", "key"]

_EXTERNAL = State.EXTERNAL
_strided = torch.strided
_no_python_dispatch = torch._C._DisableTorchDispatch
# The parts of a sparse tensor, per layout (the accessors that do not coalesce).
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def key(t: torch.Tensor) -> int:
    """Identity of the tensor a view was taken from (itself if it is not a view).

    Cheaper than asking for its storage (measured: the storage lookup was a tenth of the
    per-op cost). A write through an alias with an identity of its own (``p.data``) is not
    matched here but by memory address (Note [Aliases]).
    """
    b = t._base
    return id(t if b is None else b)


def addresses_of(t: torch.Tensor) -> Optional[tuple]:
    """Addresses of the memory ``t``'s data lives in: its storage's, its parts' for a sparse
    layout, its inner tensors' for a subclass that lists them (``__tensor_flatten__``); none
    for mkldnn (which copies its input); None where they cannot be known."""
    if own_dispatch(t):
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return None
        found: tuple = ()
        for name in flatten()[0]:
            inner = addresses_of(getattr(t, name))
            if inner is None:
                return None
            found += inner
        return found
    try:
        if t.layout is _strided:
            storages = (t.untyped_storage(),)
        else:
            storages = tuple(getattr(t, name)().untyped_storage() for name in _SPARSE_PARTS.get(t.layout, ()))
        # Empty storages all sit at address 0: they hold nothing a write could change.
        return tuple(st.data_ptr() for st in storages if st.nbytes())
    except NotImplementedError:  # "Cannot access storage of BatchedTensorImpl" (vmap)
        return None


class Constants:
    """One block's constants and handed-out storages (module docstring), for its runtime
    ``rt``. ``charge(nbytes, opname)`` charges the bytes of the constants counted so far
    against the limit (``count``; ``Driver``, with ``dtr.budget(total=True)``)."""

    def __init__(self, rt, charge: Optional[Callable[[int, str], None]] = None) -> None:
        self.rt = rt
        self.charge = charge
        self.uses: Dict[int, int] = {}  # key -> live records reading that constant
        # Memory address -> keys of the constants over it: a write through an alias with an
        # identity of its own (x.data, x.detach()) is matched by address (Note [Aliases]).
        self.memory: Dict[int, set] = {}
        self.addresses: Dict[int, tuple] = {}  # key -> its addresses in ``memory``
        # Storage address (a subclass's tensor id) -> (weak reference to it, its bytes), for
        # Stats.constant_bytes: aliases (``w.detach()``, ``w.data``) are one constant; an
        # address whose storage died may come back as another constant's, whose bytes count
        # too (``retired`` keeps the dead one's).
        self.nbytes: Dict[Any, tuple] = {}
        self.retired = 0
        self.external: Dict[int, Any] = {}  # memory address -> EXTERNAL storage handed out
        self.counted: Dict[int, int] = {}  # storage address -> bytes of the constants counted

    @property
    def read_bytes(self) -> int:
        """Bytes of the distinct constants the block's records have read
        (``Stats.constant_bytes``)."""
        return self.retired + sum(n for _, n in self.nbytes.values())

    @property
    def counted_bytes(self) -> int:
        """Bytes of the constants counted against the limit (``count``), by storage."""
        return sum(self.counted.values())

    # ------------------------------------------------------------------ records

    def use(self, consts: List[torch.Tensor]) -> tuple:
        """A new record reads ``consts``: its ``Call.consts``, each constant's key, the tensor
        and its version, flat."""
        uses = self.uses
        info: list = []
        for t in consts:
            b = t._base
            k = id(t if b is None else b)  # key(t), inline: once per constant per op
            n = uses.get(k)
            if n is None:
                uses[k] = 1
                found = self.addresses[k] = addresses_of(t) or ()
                for p in found:
                    self.memory.setdefault(p, set()).add(k)
                if t.layout is _strided:
                    self._read(t, t if b is None else b)
            else:
                uses[k] = n + 1
            info += (k, t, t._version)
        return tuple(info)

    def _read(self, t: torch.Tensor, owner: torch.Tensor) -> None:
        """Count the storage of ``t`` (whose base is ``owner``) in ``read_bytes`` unless it is
        counted already."""
        st = t.untyped_storage()
        if own_dispatch(t):  # a subclass's storage has no address: counted by its tensor
            key, obj = ("tensor", id(owner)), owner
        else:
            key, obj = st.data_ptr(), st
        seen = self.nbytes.get(key)
        if seen is None or seen[0]() is not obj:
            nbytes = st.nbytes()
            if seen is not None:
                self.retired += seen[1]
            self.nbytes[key] = (weakref.ref(obj), nbytes)

    def forget(self, rec) -> None:
        """The runtime's ``Executor.forget``: ``rec`` will never be replayed, so its constants
        lose a use; and whatever still holds the record must not keep its constants (in its
        argument template too) and RNG state alive."""
        if type(rec) is not Call:
            return
        uses = self.uses
        for k in rec.consts[::3]:
            n = uses[k] - 1
            if n:
                uses[k] = n
            else:
                del uses[k]
                # Its id may be reused by another constant: no stale key may stay at its memory.
                for p in self.addresses.pop(k, ()):
                    keys = self.memory[p]
                    keys.discard(k)
                    if not keys:
                        del self.memory[p]
        rec.args = rec.consts = ()
        rec.kwargs = rec.rng = None

    def at(self, found) -> bool:
        """Whether a live record reads a constant over memory at one of the addresses
        ``found``."""
        uses = self.uses
        return any(uses.get(k) for p in found for k in self.memory.get(p, ()))

    # ------------------------------------------------------------------ writes

    def before_writes(self, mutated: list, external_written: list, const_written: list) -> None:
        """Before an op writes storages of the engine (``mutated``, ``external_written`` for
        handed-out ones) and constants (``const_written``): protect what the writes would
        destroy (Note [Aliases])."""
        if const_written:
            self.before_constants_written(const_written)
        if external_written and self.at([s.root.value.untyped_storage().data_ptr() for s in external_written]):
            self.rt.flush()  # the program read that memory as a constant too
        if external_written or mutated:
            self.rt.before_write(external_written + mutated)

    def before_constants_written(self, tensors: List[torch.Tensor]) -> None:
        """Before an op writes the plain tensors ``tensors`` (Note [Aliases])."""
        rt = self.rt
        uses = self.uses
        for t in tensors:
            found = addresses_of(t) or ()
            if uses.get(key(t)) or self.at(found):
                # A recorded op read this tensor; once it changes, that op cannot be replayed.
                rt.flush()
                return
            external = self.external
            handed = [external[p] for p in found if p in external and external[p].state is _EXTERNAL]
            if handed:
                rt.before_write(handed)

    def before_freed(self, tensors: List[torch.Tensor]) -> None:
        """Call before the memory of these constants is freed by their owner (FSDP2 resharding
        its gathered parameters): no recorded op that reads it may run again
        (``Runtime.retire``). Raises ``OutOfBudgetError`` (changing nothing) if what must be
        kept does not fit."""
        memory = self.memory
        keys = {k for t in tensors for p in addresses_of(t) or () for k in memory.get(p, ())}
        if not keys:
            return
        rt = self.rt
        with rt.lock, _no_python_dispatch():
            rt.drain()
            reading = [
                s for s in rt.storages() if type(s.parent) is Call and not keys.isdisjoint(s.parent.consts[::3])
            ]
            rt.retire(reading)

    # ------------------------------------------------------------------ handing out

    def hand_out(self, cell) -> torch.Tensor:
        """Hand ``cell``'s storage to the program (``Runtime.extract``) and remember its memory
        for the writes to come; returns the cell's value."""
        value = self.rt.extract(cell)
        self.external[value.untyped_storage().data_ptr()] = cell.storage
        return value

    def hand_out_parts(self, out: torch.Tensor, inputs) -> None:
        """Hand to the program each managed input whose storage a part of ``out`` (a sparse
        tensor or a tensor subclass, returned plain) shares, or every input if its parts are
        unknown: the engine must not evict or swap memory the program still reads."""
        parts = addresses_of(out)
        for c in inputs:
            shared = parts is None or c.value.untyped_storage().data_ptr() in parts
            if shared and c.storage.state is not _EXTERNAL:
                self.hand_out(c)

    # ------------------------------------------------------------------ counting

    def count(self, consts: List[torch.Tensor], opname: str) -> None:
        """Count constants read for the first time, by storage (aliases such as ``w.detach()``
        and ``w.data`` are one constant), and ``charge`` the new total before the op runs. If
        that raises (``OutOfBudgetError``: the op does not run), they stay uncounted."""
        counted = self.counted
        new = []
        for t in consts:
            if t.layout is _strided:
                st = t.untyped_storage()
                p = st.data_ptr()
                if p not in counted:
                    counted[p] = st.nbytes()
                    new.append(p)
        if new:
            try:
                self.charge(self.counted_bytes, opname)
            except BaseException:
                for p in new:
                    del counted[p]
                raise

    def clear(self) -> None:
        """The block's end: no record reads anything any more (the byte counts stay, for the
        engine's statistics)."""
        self.uses.clear()
        self.memory.clear()
        self.addresses.clear()
        self.external.clear()
