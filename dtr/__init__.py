"""dtr: Dynamic Tensor Rematerialization for eager PyTorch.

Train models that do not fit in memory by evicting activations under a budget and
recomputing them when needed, at run time, with no tracing and no changes to the model::

    import dtr
    with dtr.budget("6 GiB") as engine:
        loss = model(batch).loss
        loss.backward()          # parameters' .grad are plain tensors
    engine.budget = "4 GiB"      # change it at run time
    print(engine.stats())
    print(engine.explain())      # what holds the budget, what was evicted and replayed, why it failed

The torch-facing names (and the planner, which needs NumPy) are imported on first use, so
that the torch-free parts (``dtr.core``, ``dtr.planner``) can be imported, and tested,
without torch. ``dtr.HAS_NATIVE`` says whether the planner's native solver is in use.

To see what the engine does: ``engine.explain()``; ``dtr.budget(..., timeline=True)`` then
``engine.plot_timeline()``, or ``dtr.plot(trace)`` for a recorded trace; ``dtr.budget_curve(trace)``
to pick a budget before training; the ``dtr`` logger (``DTR_DEBUG=1`` turns on debug logging).
"""

from importlib import import_module

from dtr.core import Heuristic, Stats, heuristic_names, register_heuristic
from dtr.errors import DTRError, InfeasibleBudgetError, OutOfBudgetError, ThrashingError

__all__ = [
    "BudgetCurve",
    "DTRError",
    "DTRTensor",
    "Engine",
    "HAS_NATIVE",
    "Heuristic",
    "InfeasibleBudgetError",
    "OutOfBudgetError",
    "SimResult",
    "Stats",
    "ThrashingError",
    "Timeline",
    "budget",
    "budget_curve",
    "heuristic_names",
    "materialize",
    "planner",
    "plot",
    "register_heuristic",
    "simulate",
]

_LAZY = {
    "budget": "dtr.scope",
    "Engine": "dtr.scope",
    "materialize": "dtr.eager.materialize",
    "DTRTensor": "dtr.eager.tensor",
    "HAS_NATIVE": "dtr.planner",
    "simulate": "dtr.sim",
    "SimResult": "dtr.sim",
    "Timeline": "dtr.timeline",
    "plot": "dtr.figures",
    "budget_curve": "dtr.advisor",
    "BudgetCurve": "dtr.advisor",
}


def __getattr__(name: str):
    if name == "planner":
        return import_module("dtr.planner")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dtr' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
