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
from dtr.engine import Stats
from dtr.testing.zoo import Workload

__all__ = ["StepResult", "run_step", "timed_step", "fresh_model", "assert_same"]


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
    **options,
) -> StepResult:
    """Run one forward + backward step of ``w`` on ``model`` (see module docstring)."""
    for p in model.parameters():
        p.grad = None
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
        [p.grad for p in model.parameters()],
        [b.detach().clone() for b in model.buffers()],
        stats,
    )


def timed_step(w: Workload, model: torch.nn.Module, engine: Optional["dtr.Engine"] = None) -> float:
    """Wall seconds of one forward + backward step of ``w`` (in ``engine``'s block when given),
    for benchmarks: gradients are cleared first and the RNG seeded as in ``run_step``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    t0 = time.perf_counter()
    if engine is None:
        w.loss_fn(model, w.batch).backward()
    else:
        with engine:
            w.loss_fn(model, w.batch).backward()
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
