"""Segments of ``dtr.budget(plan=...)`` and what every pass through one shares (Note [Seeding]
in ``dtr/eager/seeding/__init__.py``): its stages in order, the storages the engine made in
a stage, and the gradient hooks that tell where the backward pass is."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dtr.eager.tensor import DTRTensor
from dtr.core import Cell, Runtime, Storage
from dtr.planner import Chain, Plan

if TYPE_CHECKING:
    from dtr.eager.seeding import Seeding

__all__ = ["Pass", "Segment", "at_backward_end", "cells_of", "segments_of", "watch_gradient"]


def segments_of(plan: Any) -> List[List[nn.Module]]:
    """Validate ``dtr.budget(..., plan=...)``: a list of segments, each an ``nn.Sequential``
    or a list of modules called in order."""
    if not isinstance(plan, (list, tuple)) or not plan:
        raise ValueError(f"dtr.budget: plan must be a non-empty list of segments, got {plan!r}")
    out = []
    seen = set()
    for i, seg in enumerate(plan):
        modules = list(seg) if isinstance(seg, (nn.Sequential, nn.ModuleList, list, tuple)) else None
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError(
                f"dtr.budget: plan[{i}] must be an nn.Sequential or a non-empty list of modules "
                f"called in order, got {type(seg).__name__}"
            )
        for m in modules:
            if id(m) in seen:
                raise ValueError(f"dtr.budget: plan[{i}] repeats a module of another stage: {type(m).__name__}")
            seen.add(id(m))
        out.append(modules)
    return out


class Segment:
    """One segment: its modules, what profiling learned of it per input signature, the plans
    solved from that per budget, and its passes whose backward has not begun."""

    def __init__(self, modules: List[nn.Module]) -> None:
        self.modules = modules
        # signature -> (chain, bytes resident before the segment, planning stages)
        self.profiles: Dict[tuple, Tuple[Chain, int, List[Tuple[int, int]]]] = {}
        self.plans: Dict[Tuple[tuple, Optional[int]], Optional[Plan]] = {}  # (signature, budget)
        self.active: Optional[Pass] = None  # the pass whose forward runs (or ran last)
        self.pending: List[Pass] = []  # applied passes whose forward is over and backward has not begun

    def drop_passes(self) -> None:
        """Release what the passes whose backward has not begun hold, and forget them: a new
        forward begins (a forward without backward, a pass that stopped part-way, or a second
        forward before the backward would otherwise hold it forever), or the block ends."""
        for p in self.pending + ([self.active] if self.active is not None else []):
            p.release()
        self.pending = []
        self.active = None


class Pass(ABC):
    """One forward pass through a segment, stage by stage, and its backward pass. The module
    hooks of ``Seeding`` call ``stage_begins`` and ``stage_ends`` for stage ``next`` only, under
    the runtime's lock; the pass registers its own gradient hooks."""

    def __init__(self, seeding: "Seeding", segment: Segment, signature: tuple) -> None:
        self.seeding = seeding
        self.segment = segment
        self.signature = signature
        self.next = 0  # stage expected next
        self.start_sid = 0  # the engine's first storage id since the stage (or planning stage) began
        self.previous: List[Storage] = []  # output storages of the previous (planning) stage

    @property
    def runtime(self) -> Runtime:
        return self.seeding.driver.rt

    def new_storages(self) -> List[Storage]:
        """The storages the engine made since ``start_sid`` and has not released, newest first."""
        return self.runtime.storages_since(self.start_sid)

    @abstractmethod
    def stage_begins(self, k: int) -> None:
        """Module ``k`` is about to run."""

    @abstractmethod
    def stage_ends(self, k: int, args: tuple, output: Any, outs: List[Storage]) -> None:
        """Module ``k`` returned ``output`` (made of the engine's storages ``outs``); sets
        ``next`` and ``previous``."""

    @abstractmethod
    def release(self) -> None:
        """The pass will not be followed through: let go of what it holds in the engine."""


def watch_gradient(output: Any, callback: Callable[[], None]) -> None:
    """Call ``callback`` once, when the gradient of ``output`` (a tensor or the first tensor
    of a tuple) has been computed, i.e. when the backward pass has gone through it."""
    t = output
    if isinstance(t, (tuple, list)):
        t = next((x for x in t if isinstance(x, torch.Tensor)), None)
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return
    fired = []

    def hook(grad):
        if not fired:
            fired.append(True)
            callback()

    t.register_hook(hook)


def at_backward_end(callback: Callable[[], None]) -> None:
    """Call ``callback`` when the running backward pass ends (autograd's queued callback)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def cells_of(rt: Runtime, tensors: Any) -> List[Cell]:
    """The engine cells of ``tensors`` (a tensor, or a tuple or list of them) that ``rt``
    manages (plain tensors have none)."""
    items = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    return [rt.resolve(t._dtr.cell) for t in items if type(t) is DTRTensor and t._dtr.cell.storage.runtime is rt]
