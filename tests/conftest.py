import os

# cuBLAS is deterministic only with a fixed workspace; the variable must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from dtr.core import DTREq  # noqa: E402
from dtr.testing import zoo  # noqa: E402

# The device the zoo tests run on: ``DTR_TEST_DEVICE=cuda pytest tests/test_zoo.py`` runs them on
# a GPU; unset, on CPU.
DEVICE = torch.device(os.environ.get("DTR_TEST_DEVICE", "cpu"))


def workload(name: str, size: str = "tiny", **overrides) -> zoo.Workload:
    """``zoo.build(name, size)`` with its model and batch on the suite's ``DEVICE``."""
    w = zoo.build(name, size, **overrides)
    return w if DEVICE.type == "cpu" else zoo.on_device(w, DEVICE)


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
