"""The budget advisor: dtr.budget_curve over a shipped trace, checked against dtr.simulate."""

from __future__ import annotations

from pathlib import Path

import pytest

import dtr

TRACE = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "cnn.jsonl.gz"


@pytest.fixture(scope="module")
def curve():
    return dtr.budget_curve(TRACE, points=8)


def test_the_lowest_feasible_budget_runs_and_one_granularity_below_does_not(curve):
    low, below = curve.lowest_feasible, curve.infeasible_below
    assert low is not None and below is not None
    assert 0 < low - below <= curve.granularity == curve.peak_bytes // 200
    assert dtr.simulate(TRACE, low, max_recompute=10.0).feasible
    assert not dtr.simulate(TRACE, below, max_recompute=10.0).feasible
    # The search is in the curve, and narrowed the grid's answer.
    assert [p.budget for p in curve.points] == sorted(p.budget for p in curve.points)
    assert {low, below} <= {p.budget for p in curve.points}
    grid = {curve.peak_bytes * i // 8 for i in range(1, 9)}
    on_grid = [p for p in curve.points if p.budget in grid]
    first = min(p.budget for p in on_grid if p.feasible)
    assert max(p.budget for p in on_grid if p.budget < first) < low <= first


def test_the_curve_is_the_simulator_s(curve):
    assert curve.peak_bytes == dtr.simulate(TRACE, None).peak_bytes
    for p in curve.points[::3]:
        r = dtr.simulate(TRACE, p.budget, max_recompute=10.0)
        assert (p.feasible, p.slowdown, p.evictions, p.rematerializations) == (
            r.feasible, r.slowdown, r.evictions, r.rematerializations)
    top = curve.points[-1]
    assert top.budget == curve.peak_bytes and top.slowdown == 1.0 and top.evictions == 0


def test_pick_is_the_lowest_budget_within_the_slowdown(curve):
    feasible = [p for p in curve.points if p.feasible]
    limit = sorted(p.slowdown for p in feasible)[len(feasible) // 2]  # a slowdown some budgets meet
    chosen = curve.pick(limit)
    assert chosen is not None
    assert all(p.budget >= chosen for p in feasible if p.slowdown <= limit)
    assert curve.pick(0.5) is None  # nothing runs faster than without recomputation
    assert "lowest feasible" in str(curve)


def test_the_curve_png_is_written_with_labelled_axes(curve, tmp_path):
    fig = curve.plot(tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "budget (MiB)" and ax.get_ylabel().startswith("slowdown")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="points must be a positive int"):
        dtr.budget_curve(TRACE, points=0)
    with pytest.raises(ValueError, match="budgets is empty"):
        dtr.budget_curve(TRACE, budgets=[])
    with pytest.raises(ValueError, match="unknown heuristic|heuristic"):
        dtr.budget_curve(TRACE, heuristic="nope")
