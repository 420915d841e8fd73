"""dtr: Dynamic Tensor Rematerialization for eager PyTorch."""

from dtr.errors import DTRError, InfeasibleBudgetError, OutOfBudgetError

__all__ = ["DTRError", "InfeasibleBudgetError", "OutOfBudgetError"]
