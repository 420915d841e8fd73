"""The errors dtr raises. Every message says what was observed and what to do next."""

from __future__ import annotations

__all__ = ["DTRError", "OutOfBudgetError", "ThrashingError", "InfeasibleBudgetError"]


# Where a refused step's lowest workable budget is found: the bytes an error names are what had
# to be resident at one moment, and the step may be refused again a little further on.
_LOWEST = (
    "dtr.budget_curve(path), on the trace of an unlimited step (dtr.budget(None, trace=path)), "
    "estimates by simulation the lowest budget the step runs at."
)


class DTRError(RuntimeError):
    """Base class of the errors raised by dtr's runtime."""


class OutOfBudgetError(DTRError):
    """The storages an operation needs at once do not fit in the budget.

    Raised before the operation's result is handed to the program, so the engine and every
    tensor stay usable: raise ``engine.budget`` (or shrink the batch) and go on.

    Attributes:
        needed_bytes: bytes that had to be resident at once (locked inputs, outputs, and
            storages that cannot be recomputed).
        budget: the budget in bytes at the time.
        op: name of the operation (or ``"set budget"``) that could not be accommodated.
    """

    def __init__(self, needed_bytes: int, budget: int, op: str, detail: str = "") -> None:
        self.needed_bytes = int(needed_bytes)
        self.budget = int(budget)
        self.op = op
        msg = (
            f"dtr: {op} needs {_fmt(self.needed_bytes)} resident at once, "
            f"but the budget is {_fmt(self.budget)}."
        )
        if detail:
            msg += " " + detail
        msg += (
            f" Raise the budget to at least {_fmt(self.needed_bytes)} "
            "(engine.budget = ...) or reduce the batch size, then run the step again; it may need "
            f"more further on than at this point. {_LOWEST}"
        )
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.needed_bytes, self.budget, self.op))


class ThrashingError(OutOfBudgetError):
    """The budget is below what the model can run at: recomputation has cost more than
    ``dtr.budget(..., max_recompute=...)`` times the block's own work.

    Below a model's lowest workable budget DTR does not fail, it thrashes: it evicts what it
    will need next and recomputes it over and over (minutes, or hours, for one step). The engine
    stops that as an ``OutOfBudgetError``, so the engine and every tensor stay usable: raise the
    budget and run the step again.

    Attributes:
        replays: operations replayed in the block so far.
        ratio: their cost over the cost of the block's own operations.
        budget, op: as for ``OutOfBudgetError``; ``needed_bytes`` is the budget (the error
            says only that it is not enough).
    """

    def __init__(self, budget: int, op: str, replays: int, ratio: float) -> None:
        self.needed_bytes = self.budget = int(budget)
        self.op = op
        self.replays = int(replays)
        self.ratio = float(ratio)
        DTRError.__init__(
            self,
            f"dtr: {op}: the budget of {_fmt(self.budget)} is below what this model can run at: "
            f"recomputing evicted tensors has cost {self.ratio:.1f}x the block's own operations "
            f"({self.replays} replays), more than dtr.budget(..., max_recompute=...) allows. "
            "Raise the budget (engine.budget = ...), or pass swap=True to copy tensors to host "
            f"memory instead of recomputing them, then run the step again. {_LOWEST}",
        )

    def __reduce__(self):
        return (type(self), (self.budget, self.op, self.replays, self.ratio))


class InfeasibleBudgetError(ValueError):
    """A static plan cannot meet the budget; ``min_budget`` is the smallest feasible one."""

    def __init__(self, message: str, min_budget: float) -> None:
        super().__init__(message)
        self.min_budget = min_budget

    def __reduce__(self):
        return (type(self), (self.args[0], self.min_budget))


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit they fill: ``"4.69 KiB"``, ``"960 B"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt(n: int) -> str:
    """``format_bytes`` with the exact count, for error messages."""
    return f"{format_bytes(n)} ({n} bytes)" if abs(n) >= 1 << 10 else f"{n} bytes"
