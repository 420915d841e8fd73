"""``dtr.budget(loops=[cell])``: a loop's carried states kept as ranked checkpoints (Note [Loop
checkpoints] in dtr/core/eviction.py): the order the runtime evicts them in (both searches),
eager's gradients bit for bit on the zoo's cell loops, the trace's ``checkpoint`` events, and
bad arguments."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from test_heuristics import ScoreOnly, held_runtime

import dtr
from dtr.core import State
from dtr.eager.loops import rank
from dtr.testing import zoo
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step


def test_rank_is_how_often_two_divides_the_call():
    assert [rank(t) for t in range(1, 9)] == [0, 1, 0, 2, 0, 1, 0, 3]
    assert rank(0) > rank(1 << 40)  # the loop's first state outranks every other


@pytest.mark.parametrize("name", ["dtr_eq", "lru", ScoreOnly.name])
def test_checkpoints_are_last_resorts_evicted_by_rank(name):
    """Ordinary storages go first; then checkpoints, the lowest rank first (the heuristic
    decides within a rank); then the other protected storages. Both searches (the candidate
    index for ``dtr_eq`` and ``lru``, rescoring for a heuristic with only ``score``)."""
    rt, make = held_runtime(name)
    plain = make()
    ranked = [make() for _ in range(5)]
    other = make()  # protected by a plan, not a loop
    for s, r in zip(ranked, [64, 0, 1, 0, 2]):
        rt.checkpoint([s], r)
    rt.protect([other])
    order = []
    for _ in range(7):
        before = {s: s.state for s in [plain, *ranked, other]}
        rt.set_budget(rt.memory - 10_000)
        order += [s for s, st in before.items() if st is State.RESIDENT and s.state is State.EVICTED]
    by_rank_first = order[1:3]
    assert order[0] is plain, name
    assert set(by_rank_first) == {ranked[1], ranked[3]}, name
    assert order[3:] == [ranked[2], ranked[4], ranked[0], other], name
    rt.check_invariants()


def test_a_storage_checkpointed_again_keeps_one_protection_and_the_higher_rank():
    rt, make = held_runtime("dtr_eq")
    s = make()
    rt.checkpoint([s], 1)
    rt.checkpoint([s], 0)
    rt.checkpoint([s], 3)
    assert s.protected == 1 and rt.checkpoints[s.sid] == 3
    rt.close()
    assert rt.checkpoints == {}


# Between the presets: 40 steps of a 16 x 64 state. At "tiny" (12 steps of 6 x 8) the states are
# too small a part of the step for checkpoints to matter either way.
MID = dict(vocab=50, d_emb=16, hidden=64, batch=16, lengths=(20, 40), padded=40)


@pytest.mark.parametrize("name", ["gru_cell", "lstm_cell_masked"])
def test_loops_train_with_eagers_gradients_and_replay_less(name):
    """At 0.3 of what the step could evict, the cell loop with its states as checkpoints has
    eager's loss and gradients bit for bit, and replays fewer ops than without them (about
    half: 423 against 963 for the GRU cell, 561 against 1,067 for the LSTM cell)."""
    w = zoo.build(name, **MID)
    model = fresh_model(w)
    eager = run_step(w, model)
    free = run_step(w, fresh_model(w), None).stats
    budget = budget_at(free, 0.3)
    plain = run_step(w, fresh_model(w), budget, cost="estimate")
    model = fresh_model(w)
    looped = run_step(w, model, budget, cost="estimate", loops=[model.cell])
    assert_same(eager, looped)
    assert looped.stats.evictions > 0
    assert looped.stats.rematerializations < plain.stats.rematerializations, (
        looped.stats.rematerializations, plain.stats.rematerializations)


def test_the_trace_records_checkpoints_and_the_simulation_repeats_the_run(tmp_path):
    """Each call of the cell in a pass that records gradients checkpoints what it reads, with
    the call's rank; replaying the trace at the run's budget repeats its evictions."""
    w = zoo.build("gru_cell")
    free = run_step(w, fresh_model(w), None).stats
    budget = budget_at(free, 0.5)
    model = fresh_model(w)
    path = tmp_path / "loop.jsonl.gz"
    engine = dtr.budget(budget, cost="estimate", loops=[model.cell], trace=path)
    run = run_step(w, model, engine)
    with torch.no_grad(), dtr.budget(None, loops=[model.cell], trace=tmp_path / "nograd.jsonl"):
        w.loss_fn(model, w.batch)
    with gzip.open(path, "rt") as f:
        events = [json.loads(line) for line in f]
    ranks = [e["rank"] for e in events if e.get("e") == "checkpoint"]
    assert ranks[:8] == [rank(t) for t in range(8)]
    assert not any('"checkpoint"' in line for line in (tmp_path / "nograd.jsonl").read_text().splitlines())
    sim = dtr.simulate(path, budget)
    assert sim.feasible and sim.evictions == run.stats.evictions


@pytest.mark.parametrize(
    "loops, error",
    [(torch.nn.GRUCell(2, 2), TypeError), ([object()], TypeError), ("cell", TypeError)],
)
def test_bad_loops_are_refused_by_name(loops, error):
    with pytest.raises(error, match="loops"):
        dtr.budget(None, loops=loops)


def test_a_module_named_twice_is_refused():
    cell = torch.nn.GRUCell(2, 2)
    with pytest.raises(ValueError, match="twice"):
        dtr.budget(None, loops=[cell, cell])


def test_after_a_refused_step_the_engine_runs_the_next_with_eagers_gradients():
    """A block that ends in ``OutOfBudgetError`` leaves no hook on the cell; the same engine,
    given more room, runs the next step with eager's gradients."""
    w = zoo.build("lstm_cell_masked", **MID)
    eager = run_step(w, fresh_model(w))
    free = run_step(w, fresh_model(w), None).stats
    model = fresh_model(w)
    engine = dtr.budget(free.gradient_bytes, cost="estimate", loops=[model.cell])
    with pytest.raises(dtr.OutOfBudgetError):
        run_step(w, model, engine)
    assert not model.cell._forward_pre_hooks
    engine.budget = budget_at(free, 0.3)
    assert_same(eager, run_step(w, model, engine))
    assert not model.cell._forward_pre_hooks
