"""The combined remat + offload DP: within budget, never worse than remat alone, honest predictions."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dtr.planner import Chain, InfeasibleBudgetError, _native, evaluate, offload, rotor, solve
from planner_support import BACKENDS, TOY, chains, least_budget, peak_all, solve_checked

TOY_REMAT_85MB = 56.17  # planner notes §1.8


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(chain=chains(max_stages=7, max_size=40, integer_times=False), fraction=st.floats(0.15, 1.0),
       bandwidth=st.sampled_from([0.3, 5.0, 1e4]))
def test_combined_dp_is_no_worse_than_remat_on_the_same_grid(chain, fraction, bandwidth, backend):
    # With as many levels as slots, every remat plan is a combined plan without transfers.
    budget = peak_all(chain) * fraction
    assume(budget > 0)
    impl, grid = _native.backend(backend), 30
    remat = rotor.remat_plan(chain, budget, grid, impl.rotor_table)
    combined = offload.combined_plan(chain, budget, grid, bandwidth, impl.combined_dp)
    assert (combined is not None) == offload.combined_feasible(chain, budget, grid)
    if remat is not None:
        assert combined is not None and combined[1] <= remat[1] * (1 + 1e-9)
    if combined is None:
        return
    ops, predicted = combined
    makespan, peak = evaluate(chain, ops, budget=budget, offload_bandwidth=bandwidth)
    assert peak <= budget
    assert makespan <= predicted * (1 + 1e-9)  # rounding debts up only ever delays the DP's schedule
    if remat is not None:
        assert makespan <= evaluate(chain, remat[0])[0] * (1 + 1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30, deadline=None)
@given(chain=chains(max_stages=8, max_size=100, integer_times=False), fraction=st.floats(0.1, 1.0),
       bandwidth=st.floats(0.1, 100.0))
def test_solve_with_offloading_respects_the_budget(chain, fraction, bandwidth, backend):
    budget = peak_all(chain) * fraction
    assume(budget > 0)
    plan = solve_checked(chain, budget, offload_bandwidth=bandwidth, backend=backend)
    if plan is None:
        return
    try:
        assert plan.makespan <= solve(chain, budget, backend=backend).makespan
    except InfeasibleBudgetError:
        assert any(kind == "offload" for kind, _ in plan.ops)


@pytest.mark.parametrize("backend", BACKENDS)
def test_toy_offloading_at_12_gb_per_s(backend):
    # 12 GB/s = 1200 units of 0.01 MB per ms: the transfers hide almost all of remat's 19 ms.
    plan = solve(TOY, 8500, offload_bandwidth=1200, backend=backend)
    assert plan.makespan < TOY_REMAT_85MB and plan.peak <= 8500 and plan.offload_bandwidth == 1200
    assert ("offload", 1) in plan.ops and ("prefetch", 1) in plan.ops
    assert plan.makespan == pytest.approx(37.3942, abs=1e-4)
    slow = solve(TOY, 8500, offload_bandwidth=120, backend=backend)  # 1.2 GB/s: less to gain
    assert plan.makespan < slow.makespan < TOY_REMAT_85MB


@pytest.mark.parametrize("backend", BACKENDS)
def test_offloading_lowers_the_smallest_budget(backend):
    least = least_budget(TOY, 7000, offload_bandwidth=1200, backend=backend)
    assert least < 8212  # remat alone needs 82.12 MB
    with pytest.raises(InfeasibleBudgetError):
        solve(TOY, least, backend=backend)


@settings(max_examples=30, deadline=None)
@given(chain=chains(max_stages=6, max_size=30), floats=st.booleans())
def test_combined_min_budget_is_the_smallest_that_solves(chain, floats):
    if floats:
        chain = Chain(chain.forward_time, chain.backward_time, [v * 0.37 for v in chain.output_bytes],
                      [v * 0.37 for v in chain.saved_bytes], chain.forward_overhead, chain.backward_overhead,
                      chain.input_bytes * 1.3)
    assume(offload.combined_lower_bound(chain) > 1)
    least = least_budget(chain, offload.combined_lower_bound(chain) * 0.99, offload_bandwidth=2.0)
    assert least >= offload.combined_lower_bound(chain) * (1 - 1e-12)
