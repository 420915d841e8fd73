"""``dtr.materialize``: the plain tensor a wrapper stands for."""

from __future__ import annotations

import torch

from dtr.eager.tensor import DTRTensor

__all__ = ["materialize"]


def materialize(t: torch.Tensor) -> torch.Tensor:
    """Return a plain ``torch.Tensor`` with the value of ``t``, recomputing it if it was evicted.

    The result is detached (no autograd history) and shares memory with ``t``. Inside a block
    the engine hands the storage over to the program: it stops counting it against the budget
    and never evicts it again (``Stats.resident_bytes`` drops by its size). A plain tensor is
    returned as it is.
    """
    if type(t) is not DTRTensor:
        if isinstance(t, torch.Tensor):
            return t
        raise ValueError(f"dtr.materialize expects a tensor, got {type(t).__name__}")
    return t._plain()
