"""One training step run eagerly or under ``dtr.budget``, with everything needed to compare.

``run_step(workload, model, budget)`` seeds the RNG, clears gradients, runs forward and
backward (inside the block when a budget, or an ``Engine`` to enter again, is given: pass
``"eager"`` for no dtr at all) and
returns the loss, the gradients, the buffers and the engine's stats, so that tests can
assert bitwise equality with eager and benchmarks can time it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

import dtr
from dtr.core import Stats
from dtr.testing.zoo import Workload

__all__ = ["StepResult", "run_step", "training_step", "timed_step", "fresh_model", "assert_same", "budget_at", "zero_grads"]


@dataclass
class StepResult:
    loss: torch.Tensor
    grads: List[Optional[torch.Tensor]]
    buffers: List[torch.Tensor]
    stats: Optional[Stats]


def fresh_model(w: Workload) -> torch.nn.Module:
    """An independent copy of the workload's model (parameters, buffers, no grads)."""
    return copy.deepcopy(w.model)


def run_step(
    w: Workload,
    model: torch.nn.Module,
    budget: Union[int, str, None, "dtr.Engine"] = "eager",
    *,
    seed: int = 1,
    set_to_none: bool = True,
    **options,
) -> StepResult:
    """Run one forward + backward step of ``w`` on ``model`` (see module docstring).

    ``set_to_none`` clears gradients as ``optimizer.zero_grad`` does: True (its default) drops
    them, so the step makes new ones (charged to the budget until the block ends); False
    zeroes them in place, allocating them first where missing, so they exist before the block
    (constants, never charged)."""
    zero_grads(model.parameters(), set_to_none)
    torch.manual_seed(seed)
    stats = None
    if budget == "eager":
        loss = w.loss_fn(model, w.batch)
        loss.backward()
        loss = loss.detach()
    else:
        engine = budget if isinstance(budget, dtr.Engine) else dtr.budget(budget, **options)
        with engine:
            loss = w.loss_fn(model, w.batch)
            loss.backward()
            loss = dtr.materialize(loss)
        stats = engine.stats()
    return StepResult(
        loss,
        [p.grad if set_to_none or p.grad is None else p.grad.clone() for p in model.parameters()],
        [b.detach().clone() for b in model.buffers()],
        stats,
    )


def zero_grads(params, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad(set_to_none)`` for ``params``; with ``set_to_none=False`` a missing
    gradient is allocated (zeros), as a loop that zeroes in place has it from its first step."""
    for p in params:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
        elif p.requires_grad:
            p.grad = torch.zeros_like(p)


def budget_at(stats: Stats, fraction: float) -> int:
    """A budget that leaves ``fraction`` of what a step could evict: the gradients the step
    made (``stats.gradient_bytes``: charged until its block ends, never evicted) plus
    ``fraction`` of the rest of its unconstrained peak (``stats`` of a ``dtr.budget(None)``
    block). Tests and benchmarks size their budgets so; for tiny models whose gradients are
    most of the peak, a plain fraction of the peak would leave nothing to evict."""
    grads = stats.gradient_bytes
    return grads + int((stats.peak_resident_bytes - grads) * fraction)


def training_step(w: Workload, model: torch.nn.Module, engine: Optional["dtr.Engine"] = None) -> None:
    """One forward + backward step of ``w`` as a training loop runs it: ``model.zero_grad()``
    (PyTorch's default, ``set_to_none=True``: the step makes its gradients), the RNG seeded as
    in ``run_step``, inside ``engine``'s block when given. To measure a step's memory, drop the
    previous step's gradients before the measurement starts: freed inside it, they would lower
    the level the step's allocations are counted from."""
    model.zero_grad()
    torch.manual_seed(1)
    _forward_backward(w, model, engine)


def _forward_backward(w: Workload, model: torch.nn.Module, engine: Optional["dtr.Engine"]) -> None:
    if engine is None:
        w.loss_fn(model, w.batch).backward()
    else:
        with engine:
            w.loss_fn(model, w.batch).backward()


def timed_step(w: Workload, model: torch.nn.Module, engine: Optional["dtr.Engine"] = None) -> float:
    """Wall seconds of one forward + backward step of ``w`` (in ``engine``'s block when given),
    for benchmarks: gradients are cleared first and the RNG seeded as in ``run_step``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    t0 = time.perf_counter()
    _forward_backward(w, model, engine)
    return time.perf_counter() - t0


def assert_same(a: StepResult, b: StepResult) -> None:
    """Bitwise equality of loss, gradients and buffers (running statistics)."""
    assert torch.equal(a.loss, b.loss), f"loss differs: {a.loss.item()} vs {b.loss.item()}"
    assert len(a.grads) == len(b.grads)
    for i, (x, y) in enumerate(zip(a.grads, b.grads)):
        assert (x is None) == (y is None), f"gradient {i}: one is None"
        if x is not None:
            assert type(x) is torch.Tensor and type(y) is torch.Tensor, f"gradient {i} is not plain"
            assert torch.equal(x, y), f"gradient {i} differs (max diff {(x - y).abs().max().item()})"
    for i, (x, y) in enumerate(zip(a.buffers, b.buffers)):
        assert torch.equal(x, y), f"buffer {i} differs"
