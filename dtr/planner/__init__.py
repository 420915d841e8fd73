"""Static optimal plans for chains of stages: which activations to keep, recompute or offload.

Torch-free: give it a cost table, get an op sequence. The model and the DPs are those of the rotor
papers (Beaumont et al., ACM TOMS; NeurIPS 2021 appendix), with the errata of the planner notes;
``docs/planner.md`` describes them. A quick tour::

    >>> from dtr.planner import Chain, solve, evaluate, checkpoint_sequential
    >>> chain = Chain(forward_time=[1, 2, 2, 1], backward_time=[2, 4, 4, 2],
    ...               output_bytes=[10, 20, 20, 10], saved_bytes=[30, 60, 60, 30],
    ...               forward_overhead=[0, 0, 0, 0], backward_overhead=[5, 5, 5, 5], input_bytes=10)
    >>> plan = solve(chain, budget=140)
    >>> plan.ops
    [('F_ck', 1), ('F_none', 2), ('F_ck', 3), ('F_all', 4), ('B', 4), ('F_all', 3), ('B', 3), ('F_all', 1), ('F_all', 2), ('B', 2), ('B', 1)]
    >>> plan.makespan, plan.peak
    (23.0, 135.0)
    >>> evaluate(chain, checkpoint_sequential(chain, 2))  # PyTorch's schedule: faster, but 155 > 140
    (21.0, 155.0)

Public names:

* :class:`Chain`, :class:`Plan`: the cost model and a solved schedule; ops are ``(kind, stage)``.
* :func:`solve`: optimal persistent remat plan (``O(slots * L^3)``), optionally combined with
  offloading to the host (``O(L^2 levels^3 + L^3 levels^2)``); raises
  :class:`dtr.InfeasibleBudgetError` with the smallest budget that works.
* :func:`evaluate`: exact makespan and peak of any op sequence; rejects invalid ones.
  ``dtr.planner.simulate`` is a deprecated name for it (``dtr.simulate`` replays traces).
* Baselines: :func:`store_all`, :func:`recompute_all`, :func:`checkpoint_sequential`,
  :func:`chen_sqrt`.
* ``HAS_NATIVE``: whether the C solver ``dtr_ext`` is in use (``DTR_PUREPYTHON=1`` disables it).
"""

import warnings

from dtr.errors import InfeasibleBudgetError
from dtr.planner._native import HAS_NATIVE
from dtr.planner.baselines import checkpoint_sequential, chen_sqrt, recompute_all, store_all
from dtr.planner.chain import Chain, Op, Plan
from dtr.planner.evaluate import evaluate
from dtr.planner.solve import solve

__all__ = [
    "Chain",
    "Plan",
    "Op",
    "solve",
    "evaluate",
    "store_all",
    "recompute_all",
    "checkpoint_sequential",
    "chen_sqrt",
    "HAS_NATIVE",
    "InfeasibleBudgetError",
]


def __getattr__(name: str):
    # A deprecated name: ``dtr.simulate`` replays traces, which is another thing.
    if name == "simulate":
        warnings.warn(
            "dtr.planner.simulate is now dtr.planner.evaluate (dtr.simulate replays traces)",
            DeprecationWarning,
            stacklevel=2,
        )
        return evaluate
    raise AttributeError(f"module 'dtr.planner' has no attribute {name!r}")
