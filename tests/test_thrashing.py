"""Thrashing is an error, not a hang (Note [Thrashing] in dtr/core/rematerialize.py).

Near its lowest workable budget a model thrashes: replays evict what the next one needs, and a
step can run for minutes or hours (the tiny TreeLSTM at 0.068 of its evictable room is such a
budget: the bound stops it after some 16,000 replays, and without it the step ends after
35,000; a little lower, it is refused).
``dtr.budget``'s ``max_recompute`` stops the block once its replays cost ten times its own
operations, with an error that says what to do, and leaves the engine usable.
"""

import pickle
import random

import pytest
import torch
import torch.nn as nn

import dtr
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step
from dtr.testing.zoo import build


def test_a_thrashing_step_stops_with_a_clear_error_and_the_engine_stays_usable():
    w = build("treelstm")
    eager = run_step(w, fresh_model(w))
    tracked = run_step(w, fresh_model(w), None).stats
    model = fresh_model(w)
    engine = dtr.budget(budget_at(tracked, 0.068), cost="estimate")
    with pytest.raises(dtr.ThrashingError, match="is below what this model can run at") as info:
        run_step(w, model, engine)
    e = info.value
    assert isinstance(e, dtr.OutOfBudgetError) and e.budget == engine.budget
    assert e.replays >= 1000 and e.ratio > 10
    assert "swap=True" in str(e) and "Raise the budget" in str(e) and f"{e.replays} replays" in str(e)
    engine.budget = budget_at(tracked, 0.5)  # what the error says to do
    again = run_step(w, model, engine)
    assert_same(again, eager)
    assert engine.stats().rematerializations > e.replays


def test_max_recompute_bounds_what_it_says():
    """A lower bound stops the same run sooner; None never stops it (here a run that ends)."""
    w = build("treelstm")
    tracked = run_step(w, fresh_model(w), None).stats
    budget = budget_at(tracked, 0.09)
    with pytest.raises(dtr.ThrashingError) as info:
        run_step(w, fresh_model(w), budget, cost="estimate", max_recompute=2.0)
    assert 2.0 < info.value.ratio < 10
    r = run_step(w, fresh_model(w), budget, cost="estimate", max_recompute=None)
    assert r.stats.rematerializations > info.value.replays
    for bad in (0, -1.0, "10", True):
        with pytest.raises(ValueError, match="max_recompute"):
            dtr.budget(None, max_recompute=bad)


def test_thrashing_error_pickles():
    e = dtr.ThrashingError(1 << 20, "aten.mm.default", 1234, 12.5)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is dtr.ThrashingError and str(back) == str(e) and back.replays == 1234


class _ChildSum(nn.Module):
    """A child-sum TreeLSTM cell applied by recursion in Python, as issue 18's report wrote it."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w = nn.Linear(d, 4 * h)
        self.u = nn.Linear(h, 3 * h, bias=False)
        self.uf = nn.Linear(h, h)
        self.h = h

    def forward(self, x, kids):
        hs = [self(*k) for k in kids]
        hsum = sum(h for h, _ in hs) if hs else x.new_zeros(x.shape[0], self.h)
        wi, wo, wu, wf = self.w(x).split(self.h, 1)
        ui, uo, uu = self.u(hsum).split(self.h, 1)
        c = torch.sigmoid(wi + ui) * torch.tanh(wu + uu)
        for h, ck in hs:
            c = c + torch.sigmoid(wf + self.uf(h)) * ck
        return torch.sigmoid(wo + uo) * torch.tanh(c), c


def _tree(nodes: int, batch: int, d: int):
    rng = random.Random(0)
    kids: list = [[] for _ in range(nodes)]
    for i in range(1, nodes):
        kids[rng.randrange(i)].append(i)
    xs = torch.randn(nodes, batch, d)

    def build(i):
        return xs[i], [build(k) for k in kids[i]]

    return build(0)


def _cell_loop(cell: nn.Module, steps: int, batch: int):
    x = torch.randn(steps, batch, cell.input_size)

    def loss():
        h = torch.zeros(batch, cell.hidden_size)
        state = h if isinstance(cell, nn.GRUCell) else (h, h.clone())
        for t in range(steps):
            state = cell(x[t], state)
        return (state if isinstance(cell, nn.GRUCell) else state[0]).sum()

    return loss


def _reported(name: str):
    """The models of issue 18's opening reports: (module, loss function, fraction of the
    unlimited peak the report ran at)."""
    torch.manual_seed(0)
    if name == "tree":  # ran more than 50 minutes at half its peak without ending
        m = _ChildSum(64, 96)
        tree = _tree(100, 8, 64)
        return m, lambda: m(*tree)[0].sum(), 0.5
    if name == "gru_cell":  # took 17.7 minutes at 0.3
        m = nn.GRUCell(96, 96)
        return m, _cell_loop(m, 60, 16), 0.3
    if name == "lstm_cell":  # did not end in 5 minutes at 0.2
        m = nn.LSTMCell(96, 96)
        return m, _cell_loop(m, 60, 16), 0.2
    if name == "gru":  # "needs 2.02 MiB ... locked" at 0.5
        m = nn.GRU(64, 128, num_layers=2, batch_first=True)
        x = torch.randn(8, 50, 64)
        return m, lambda: m(x)[0].sum(), 0.5
    raise ValueError(name)


def _grads(m: nn.Module, loss, engine=None):
    for p in m.parameters():
        p.grad = None
    if engine is None:
        loss().backward()
    else:
        with engine:
            loss().backward()
    return [p.grad for p in m.parameters()]


def _same(got, eager) -> bool:
    """Plain tensors (what ``.grad`` holds after a block), eager's bit for bit."""
    return len(got) == len(eager) and all(type(a) is torch.Tensor and torch.equal(a, b) for a, b in zip(got, eager))


@pytest.mark.parametrize("name", ["tree", "gru_cell", "lstm_cell"])
def test_the_reports_that_hung_run_to_the_end(name):
    """Issue 18's reports, as a user wrote them, at the fraction of the unlimited peak each
    ran at: the ``GRUCell`` loop ended after 17.7 minutes, the others did not end in 5 and 50;
    now each ends with eager's gradients under the default ``max_recompute`` (a thrashing
    step would raise ``ThrashingError`` instead)."""
    m, loss, fraction = _reported(name)
    eager = _grads(m, loss)
    unlimited = dtr.budget(None, cost="estimate")
    _grads(m, loss, unlimited)
    engine = dtr.budget(int(fraction * unlimited.stats().peak_resident_bytes), cost="estimate")
    assert _same(_grads(m, loss, engine), eager)
    assert engine.stats().evictions > 0 and engine.stats().peak_resident_bytes <= engine.budget


def test_the_reported_gru_says_what_it_needs(tmp_path):
    """``nn.GRU`` at half its peak cannot run under h_DTR^eq (it runs from about 0.72 of it:
    docs/heuristics.md):
    rebuilding any step's gates reads a slice of the layer's input projection (one ``add``
    over the whole sequence), so the replay needs all of it and the ``mm`` it adds to, while
    the backward pass's per-step gate gradients, which eager holds too, wait for their
    ``stack``. It raises a plain ``OutOfBudgetError`` that names the op and the bytes, not a
    thrash. Those bytes are what had to be resident when the replay was refused, and the step
    needs more further on: the lowest budget it runs at is the one ``dtr.budget_curve``
    estimates, as the error says (exactly here, where the trace's costs are the estimates the
    engine uses)."""
    m, loss, fraction = _reported("gru")
    eager = _grads(m, loss)
    trace = tmp_path / "gru.jsonl.gz"
    unlimited = dtr.budget(None, cost="estimate", trace=trace)
    _grads(m, loss, unlimited)
    peak = unlimited.stats().peak_resident_bytes
    engine = dtr.budget(int(fraction * peak), cost="estimate")
    with pytest.raises(dtr.OutOfBudgetError) as info:
        _grads(m, loss, engine)
    e = info.value
    assert not isinstance(e, dtr.ThrashingError) and e.needed_bytes > e.budget == engine.budget
    assert f"({e.needed_bytes} bytes)" in str(e) and e.op.startswith("aten.") and "budget_curve" in str(e)
    lowest = dtr.budget_curve(trace).lowest_feasible
    assert e.needed_bytes < lowest < peak
    engine.budget = lowest
    assert _same(_grads(m, loss, engine), eager)
