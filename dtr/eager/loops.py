"""Loops over time: ``dtr.budget(limit, loops=[cell])`` keeps each call's inputs as checkpoints.

A module called once per step of a loop (``nn.LSTMCell``, ``nn.GRUCell``, a cell of one's own)
reads the state the previous step carried. Before each call in a pass that records gradients,
the tensors it reads that the engine made in the block (the state, and the step's input where
the block made it) become checkpoints of rank ``trailing_zeros(t)`` for the module's ``t``-th
call of the block (``Runtime.checkpoint``; why and how the ranks are used: Note [Loop
checkpoints] in core/eviction.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence

import torch
from torch import nn

from dtr.eager.output_size import flat_tensors
from dtr.eager.seeding.segments import cells_of

if TYPE_CHECKING:
    from dtr.eager.driver import Driver

__all__ = ["Loops", "rank", "loop_modules"]

_FIRST = 64  # the rank of a loop's first call: above every other


def rank(t: int) -> int:
    """The rank of a loop's call ``t`` (from 0): how many times 2 divides ``t``."""
    return _FIRST if t == 0 else (t & -t).bit_length() - 1


def loop_modules(loops: Any) -> List[nn.Module]:
    """``loops`` checked: a sequence of distinct ``nn.Module``s."""
    if isinstance(loops, nn.Module) or not isinstance(loops, (list, tuple)):
        raise TypeError(
            "dtr.budget: loops must be a list of modules called once per step of a loop, "
            f"got {type(loops).__name__}"
        )
    for m in loops:
        if not isinstance(m, nn.Module):
            raise TypeError(f"dtr.budget: loops must hold nn.Module objects, got {type(m).__name__}")
    if len({id(m) for m in loops}) != len(loops):
        raise ValueError("dtr.budget: loops names a module twice")
    return list(loops)


class Loops:
    """The hooks of ``dtr.budget(loops=...)`` for one engine, attached for each block."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self.driver: "Driver | None" = None
        self._calls: Dict[int, int] = {}  # id(module) -> its calls in the block
        self._handles: list = []

    def attach(self, driver: "Driver") -> None:
        """Hook the modules for the block ``driver`` runs."""
        self.driver = driver
        self._calls = {}
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(m), with_kwargs=True))

    def detach(self) -> None:
        """Remove the hooks (the block has ended)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.driver = None

    def _pre_hook(self, module: nn.Module) -> Callable[..., None]:
        key = id(module)

        def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
            d = self.driver
            if d is None or not torch.is_grad_enabled():  # no backward pass reads the states back
                return
            t = self._calls.get(key, 0)
            self._calls[key] = t + 1
            tensors = flat_tensors([*args, *kwargs.values()])
            rt = d.rt
            with rt.lock:
                storages = list({id(c.storage): c.storage for c in cells_of(rt, tensors)}.values())
                if storages:
                    rt.checkpoint(storages, rank(t))

        return pre

