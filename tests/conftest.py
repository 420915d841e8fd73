import pytest
import torch

from dtr.core import DTREq


@pytest.fixture(autouse=True, scope="session")
def deterministic():
    # Bitwise comparisons with eager need deterministic kernels; two threads matches CI.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    yield


class Thrashing(Exception):
    """Raised by ``GuardedDTREq`` when a run evicts far more than a sane one would."""


class GuardedDTREq(DTREq):
    """h_DTR^eq that gives up after ``limit`` scored candidates.

    Below some budget DTR thrashes (recomputes the same tensors over and over; see the README's
    notes on budgets). Searches for the lowest budget that runs use this to stop such runs early
    instead of waiting minutes; the exception also exercises the engine's unwinding.
    """

    name = "dtr_eq_guarded"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def score(self, s, now):
        self.limit -= 1
        if self.limit < 0:
            raise Thrashing()
        return super().score(s, now)
