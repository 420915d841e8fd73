"""Counters the runtime keeps, and the ``Stats`` snapshot users read."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

__all__ = ["Counters", "Stats"]


class Counters:
    """Monotone event counts of one runtime (one ``dtr.budget`` block), or their sum over
    blocks (``add``). Each is named as the ``Stats`` field it becomes (``fields``); ``dtr.simulate``
    reads the same sums into ``SimResult``."""

    __slots__ = (
        "evictions",
        "eager_evictions",
        "rematerializations",
        "remat_seconds",
        "flushes",
        "swaps_out",
        "swaps_in",
        "prefetches",
        "swap_bytes_out",
        "swap_bytes_in",
        "swap_stall_seconds",
    )

    def __init__(self) -> None:
        self.evictions = 0
        self.eager_evictions = 0
        self.rematerializations = 0
        self.remat_seconds = 0.0
        self.flushes = 0
        self.swaps_out = 0
        self.swaps_in = 0  # synchronous: the program waited for them
        self.prefetches = 0  # swap-ins ahead of need
        self.swap_bytes_out = 0
        self.swap_bytes_in = 0
        self.swap_stall_seconds = 0.0

    def add(self, other: "Counters") -> "Counters":
        """Add ``other``'s counts to these; returns ``self``."""
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def fields(self) -> Dict[str, Any]:
        """The counts by name, as ``Stats`` takes them."""
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True)
class Stats:
    """What an engine has done, summed over its blocks (``Engine.stats()``).

    Attributes:
        ops: operations intercepted.
        evictions: storages evicted to stay under the budget.
        eager_evictions: storages evicted because the program dropped its last reference while
            a recorded op might still need them (DTR's eager eviction; they free memory eager
            PyTorch would free too).
        rematerializations: operations replayed to recompute evicted storages.
        remat_seconds: time spent replaying, as measured (CPU) or estimated (CUDA) by the
            cost model.
        resident_bytes: bytes of managed storages in memory now.
        peak_resident_bytes: highest ``resident_bytes`` seen, including the moment inside an
            op when its outputs exist and evictions have not yet made room.
        constant_bytes: bytes of the distinct pre-existing tensors (parameters, buffers,
            inputs) the block's ops read; never evicted, not charged.
        budget: the budget in bytes, or None for "track, never evict".
        flushes: times the engine made live tensors resident and dropped their lineage
            (block exit, optimizer steps, in-place changes to tensors recorded ops read).
        swaps_out: storages copied to the host tier instead of evicted (``swap=True``).
        swaps_in: swapped storages brought back when the program needed them (it waited).
        prefetches: swapped storages brought back ahead of need (the previous block's order).
        swap_bytes_out, swap_bytes_in: bytes moved each way (prefetches included).
        swap_stall_seconds: time the program waited for swap-ins.
        host_peak_bytes: the most bytes held in the host tier at once.
        gradient_bytes: bytes of the ``.grad`` tensors made in the current block, or in the
            last one if none is active: charged to the budget until their block ends, never
            evicted (gradients that existed before the block are constants).
    """

    ops: int
    evictions: int
    eager_evictions: int
    rematerializations: int
    remat_seconds: float
    resident_bytes: int
    peak_resident_bytes: int
    constant_bytes: int
    budget: Optional[int]
    flushes: int
    swaps_out: int = 0
    swaps_in: int = 0
    prefetches: int = 0
    swap_bytes_out: int = 0
    swap_bytes_in: int = 0
    swap_stall_seconds: float = 0.0
    host_peak_bytes: int = 0
    gradient_bytes: int = 0

    def __str__(self) -> str:
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_bytes") or (f.name == "budget" and v is not None):
                v = f"{v / 2**20:.2f} MiB"
            elif isinstance(v, float):
                v = f"{v:.4f}"
            parts.append(f"{f.name}={v}")
        return "Stats(" + ", ".join(parts) + ")"
