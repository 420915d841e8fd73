"""On a GPU (``DTR_TEST_DEVICE=cuda``; skipped elsewhere): the true peak of a step under a budget,
measured by the caching allocator, and the CUDA cost mode's promise not to synchronize.

The rest of the suite's device-aware tests (the zoo, swapping, seeding, Hugging Face models)
read the same variable through ``conftest.workload``.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtr
from dtr.testing.memory import measured_peak
from dtr.testing.step import budget_at, fresh_model, run_step, training_step

from conftest import DEVICE, workload

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs DTR_TEST_DEVICE=cuda")

# The caching allocator rounds every block up to a multiple of 512 bytes.
ROUNDING = 512


class _WorkingSets(TorchDispatchMode):
    """The largest op's working set in an eager step: its inputs made during the step plus the
    most its kernel allocated while it ran (outputs and scratch), from the allocator's counters."""

    def __init__(self, preexisting):
        super().__init__()
        self.preexisting = preexisting
        self.largest = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {}
        for a in list(args) + list(kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else [a]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.preexisting:
                    inputs[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **kwargs)
        self.largest = max(self.largest, sum(inputs.values()) + torch.cuda.max_memory_allocated() - before)
        self.ops += 1
        return out


def _true_peak(model, fn):
    """``measured_peak(fn)``, the gradients of ``model``'s previous step already dropped."""
    model.zero_grad()
    return measured_peak(fn, DEVICE)


@pytest.mark.parametrize("name", ["mlp", "transformer", "resnet"])
def test_true_peak_on_cuda_within_budget_plus_one_op(name):
    # The bench MLP's gradients are 32 of its 33 MiB: a batch of 2048 makes its activations
    # what a budget can act on.
    w = workload(name, "bench", **({"batch": 2048} if name == "mlp" else {}))
    model = fresh_model(w)
    preexisting = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    preexisting |= {t.untyped_storage().data_ptr() for t in (w.batch if isinstance(w.batch, (list, tuple)) else [w.batch])}
    sets = _WorkingSets(preexisting)
    with sets:
        training_step(w, model)
    eager_peak = _true_peak(model, lambda: training_step(w, model))
    probe = dtr.budget(None)
    unlimited = _true_peak(model, lambda: training_step(w, model, probe))
    slack = sets.largest + ROUNDING * sets.ops
    assert unlimited <= eager_peak + slack
    for fraction in (0.7, 0.5):
        budget = budget_at(probe.stats(), fraction)
        engine = dtr.budget(budget)
        training_step(w, model, engine)  # the engine learns its ops' output sizes (Note [Room before an op])
        before = engine.stats().evictions
        peak = _true_peak(model, lambda: training_step(w, model, engine))
        assert engine.stats().evictions > before
        assert peak <= budget + slack, (
            f"{name} at {fraction}: true peak {peak} > budget {budget} + largest op {sets.largest} + rounding"
        )
        assert peak < eager_peak


@pytest.mark.parametrize("name", ["mlp", "transformer", "resnet", "treelstm_batch"])
def test_the_cuda_cost_mode_does_not_synchronize(name):
    """Costs on CUDA are roofline estimates (Note [Cost without synchronization]): a step that
    eager runs without synchronizing runs so under dtr too, evicting and replaying."""
    w = workload(name)
    model = fresh_model(w)
    stats = run_step(w, model, None).stats
    engine = dtr.budget(budget_at(stats, 0.5))
    training_step(w, model, engine)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        training_step(w, model)
        before = engine.stats().rematerializations
        training_step(w, model, engine)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.stats().rematerializations > before


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_a_refused_step_raises_out_of_budget_while_memory_history_records(name):
    """With the allocator's history recorded (``stacks="python"``), freeing a refused output
    runs Python inside the deallocator, which cleared the pending error: the native path then
    returned NULL with no error set (``SystemError``). Its error exits hold the error aside
    while they let go (Note [Letting go with an error pending] in dtr_ext/hotpath.c)."""
    w = workload(name)
    unlimited = run_step(w, fresh_model(w), None, cost="estimate").stats
    model = fresh_model(w)
    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        with pytest.raises(dtr.OutOfBudgetError):
            run_step(w, model, dtr.budget(budget_at(unlimited, 0.1), cost="estimate"))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
