"""Thrashing is an error, not a hang (Note [Thrashing] in dtr/core/rematerialize.py).

Near its lowest workable budget a model thrashes: replays evict what the next one needs, and a
step can run for minutes or hours (the tiny TreeLSTM at 0.086 of its evictable room is such a
budget; at 0.09 it ends, after thousands of replays).
``dtr.budget``'s ``max_recompute`` stops the block once its replays cost ten times its own
operations, with an error that says what to do, and leaves the engine usable.
"""

import pickle

import pytest

import dtr
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step
from dtr.testing.zoo import build


def test_a_thrashing_step_stops_with_a_clear_error_and_the_engine_stays_usable():
    w = build("treelstm")
    eager = run_step(w, fresh_model(w))
    tracked = run_step(w, fresh_model(w), None).stats
    model = fresh_model(w)
    engine = dtr.budget(budget_at(tracked, 0.086), cost="estimate")
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
