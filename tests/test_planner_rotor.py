"""The persistent remat DP through ``solve``: optimality, reference values, budgets, baselines."""

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dtr.planner import (Chain, InfeasibleBudgetError, checkpoint_sequential, chen_sqrt, evaluate,
                         recompute_all, solve, store_all)
from dtr.planner.rotor import remat_lower_bound
from planner_support import (BACKENDS, TOY, chains, counterexample, least_budget, peak_all, search,
                             solve_checked)
from test_planner_model import TOY_90MB


# Planner notes §1.8, budgets in 0.01 MB with one slot per unit (no rounding): both ends of every
# step of the curve. Clamping ā^4 up to a^4 moves the steps by up to 0.02 MB and adds the 39.82 one.
@pytest.mark.parametrize("budget, makespan", [
    (10701, 37.38), (10700, 39.82), (10698, 41.18), (9747, 41.18), (9746, 42.02), (9631, 42.02),
    (9630, 43.62), (9166, 43.62), (9165, 47.42), (8677, 47.42), (8676, 56.17), (8212, 56.17),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_toy_makespan_curve(budget, makespan, backend):
    plan = solve(TOY, budget, slots=budget, backend=backend)
    assert plan.makespan == pytest.approx(makespan)
    assert plan.peak <= budget


@pytest.mark.parametrize("backend", BACKENDS)
def test_toy_optimal_sequence_at_90mb(backend):
    plan = solve(TOY, 9000, slots=9000, backend=backend)
    assert plan.ops == TOY_90MB
    assert (plan.makespan, plan.peak) == evaluate(TOY, TOY_90MB)


@pytest.mark.parametrize("backend", BACKENDS)
def test_toy_smallest_budget(backend):
    # B^3 alone needs a^0 + a^2 + ā^3 + δ^3 + δ^2 + ob[3] = 82.12 MB: nothing fits below it.
    assert remat_lower_bound(TOY) == 8212
    with pytest.raises(InfeasibleBudgetError, match="no plan can go below 8212"):
        solve(TOY, 8000, backend=backend)
    assert least_budget(TOY, 8000, backend=backend) >= 8212


@pytest.mark.parametrize("n", [5, 6, 7])
@pytest.mark.parametrize("backend", BACKENDS)
def test_persistence_counterexample(n, backend):
    # Fig. 4 of the rotor paper; planner notes §1.2: persistent 3n-2 against 2n+2 without persistence.
    chain = counterexample(n)
    assert solve(chain, 15, slots=15, backend=backend).makespan == 3 * n - 2
    assert search(chain, 15, persistent=True)[0] == 3 * n - 2
    if n < 7:
        assert search(chain, 15, persistent=False)[0] == 2 * n + 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_threshold_counts_the_held_gradient(backend):
    # Erratum 7 of the planner notes: rotor's code checks F_all^s against δ^s instead of δ^t, the
    # gradient actually held. On this chain that rule returns a plan peaking at 13 in a budget of 12,
    # where no sequence fits at all.
    chain = Chain([1, 1, 1], [1, 2, 1], [1, 3, 1], [1, 3, 1], [7, 1, 0], [1, 2, 2], 2)
    assert search(chain, 12, persistent=False)[0] == math.inf
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(chain, 12, slots=12, backend=backend)
    assert info.value.min_budget == 13
    assert solve(chain, 13, slots=13, backend=backend).makespan == search(chain, 13, persistent=True)[0]


@settings(max_examples=120, deadline=None)
@given(chain=chains(max_stages=5), where=st.floats(0, 1))
def test_dp_is_optimal_among_persistent_sequences(chain, where):
    # One slot per unit of memory: the DP sees exact sizes, the search is the oracle.
    low, high = max(1, math.floor(remat_lower_bound(chain)) - 1), max(1, int(peak_all(chain)))
    budget = low + round(where * (high - low))
    best, ops = search(chain, budget, persistent=True)
    try:
        plan = solve(chain, budget, slots=budget, backend="python")
    except InfeasibleBudgetError:
        assert best == math.inf
        return
    assert plan.makespan == best
    assert evaluate(chain, ops) == (best, evaluate(chain, ops)[1])
    assert search(chain, budget, persistent=False)[0] <= plan.makespan


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(chain=chains(max_stages=12, max_size=1000, integer_times=False), fraction=st.floats(0.05, 1.2),
       slots=st.sampled_from([7, 50, 500]))
def test_plans_never_exceed_the_budget(chain, fraction, slots, backend):
    budget = peak_all(chain) * fraction
    assume(budget > 0)
    plan = solve_checked(chain, budget, slots=slots, backend=backend)
    if plan is not None:
        assert plan.makespan >= math.fsum([*chain.forward_time, *chain.backward_time])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(chain=chains(max_stages=8, max_size=50), floats=st.booleans())
def test_min_budget_is_the_smallest_that_solves(chain, floats, backend):
    if floats:  # float sizes: the answer is exact to one float
        chain = Chain(chain.forward_time, chain.backward_time, [v * 0.37 for v in chain.output_bytes],
                      [v * 0.37 for v in chain.saved_bytes], chain.forward_overhead, chain.backward_overhead,
                      chain.input_bytes * 1.3)
    assume(remat_lower_bound(chain) > 1)
    least = least_budget(chain, remat_lower_bound(chain) * 0.99, backend=backend)
    assert isinstance(least, float if floats else int)
    assert least >= remat_lower_bound(chain) * (1 - 1e-12)  # the bound is a float sum


def test_store_all_when_it_fits():
    plan = solve(TOY, 20000)
    assert plan.ops == store_all(TOY)
    assert plan.makespan == pytest.approx(37.38)


def test_single_stage_chain():
    chain = Chain([1.5], [2.5], [4], [6], [1], [3], 2)
    plan = solve(chain, 17)
    assert plan.ops == [("F_all", 1), ("B", 1)] and plan.peak == 17
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(chain, 16)
    assert info.value.min_budget == 17


def test_baseline_sequences():
    chain = Chain([1] * 5, [2] * 5, [3] * 5, [4] * 5, [0] * 5, [0] * 5, 3)
    assert checkpoint_sequential(chain, 2) == [
        ("F_ck", 1), ("F_none", 2), ("F_all", 3), ("F_all", 4), ("F_all", 5), ("B", 5), ("B", 4), ("B", 3),
        ("F_all", 1), ("F_all", 2), ("B", 2), ("B", 1)]
    assert checkpoint_sequential(chain, 1) == store_all(chain)
    assert chen_sqrt(chain) == [  # ceil(sqrt(5)) = 3 stages per segment
        ("F_ck", 1), ("F_none", 2), ("F_none", 3), ("F_all", 4), ("F_all", 5), ("B", 5), ("B", 4),
        ("F_all", 1), ("F_all", 2), ("F_all", 3), ("B", 3), ("B", 2), ("B", 1)]
    assert evaluate(chain, recompute_all(chain))[0] == 5 + 10 + sum(range(1, 6))  # F^1..F^k again per B^k
    with pytest.raises(ValueError, match="segments = 6"):
        checkpoint_sequential(chain, 6)


@settings(max_examples=60, deadline=None)
@given(chain=chains(max_stages=7, max_size=9), segments=st.integers(1, 7))
def test_dp_beats_every_baseline_at_its_peak(chain, segments):
    segments = min(segments, chain.length)
    for ops in (store_all(chain), recompute_all(chain), checkpoint_sequential(chain, segments), chen_sqrt(chain)):
        makespan, peak = evaluate(chain, ops)
        assume(peak > 0)
        assert solve(chain, peak, slots=int(peak)).makespan <= makespan


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "budget = 0"),
    (dict(budget=math.nan), "budget = nan"),
    (dict(budget=10, slots=0), "slots = 0"),
    (dict(budget=10, slots=2.5), "slots = 2.5"),
    (dict(budget=10, levels=5000, offload_bandwidth=1.0), "levels = 5000"),
    (dict(budget=10, offload_bandwidth=-1.0), "offload_bandwidth = -1.0"),
    (dict(budget=10, backend="gpu"), "backend='gpu'"),
])
def test_solve_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        solve(TOY, **kwargs)


def test_solve_refuses_tables_that_cannot_fit_in_memory():
    chain = Chain([1] * 300, [1] * 300, [2] * 300, [3] * 300, [0] * 300, [0] * 300, 2)
    with pytest.raises(ValueError, match="needs 41.5 GiB; use fewer slots"):
        solve(chain, 100, slots=10**5)
