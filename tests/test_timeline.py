"""Memory timelines (engine.timeline(), Timeline.from_trace) and their figures (dtr.plot)."""

from __future__ import annotations

import sys

import pytest

import dtr
from dtr.testing import zoo
from dtr.testing.step import budget_at, fresh_model, run_step

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tiny transformer's step at 0.4 of its evictable room, with a timeline and a trace."""
    w = zoo.build("transformer", "tiny")
    tracked = run_step(w, fresh_model(w), None, cost="estimate").stats
    path = tmp_path_factory.mktemp("timeline") / "step.jsonl"
    engine = dtr.budget(budget_at(tracked, 0.4), cost="estimate", timeline=True, trace=path)
    run_step(w, fresh_model(w), engine)
    return engine, path


def test_the_timeline_follows_the_budget_and_counts_what_the_engine_counted(recorded):
    engine, _ = recorded
    t, stats = engine.timeline(), engine.stats()
    assert list(t.clock[:-1]) == list(range(1, len(t))) and t.clock[-1] == t.clock[-2]  # one sample per op
    budget = stats.budget
    assert set(t.budget) == {budget}
    # Sampled after each op's evictions: within the budget at every op, close to it at the peak,
    # and never above the engine's own peak (which includes the moment inside an op).
    assert max(t.resident_bytes) <= budget
    assert t.peak_bytes > 0.8 * budget and t.peak_bytes <= stats.peak_resident_bytes
    assert t.resident_bytes[-1] == 0  # the block is over: nothing charged
    assert stats.evictions > 0 and stats.rematerializations > 0
    assert (t.total_evictions, t.total_replays) == (stats.evictions, stats.rematerializations)


def test_a_trace_gives_the_same_timeline_as_the_engine(recorded):
    engine, path = recorded
    assert dtr.Timeline.from_trace(path) == engine.timeline()
    # Another budget gives another timeline; one too small stops with the reason.
    half = dtr.Timeline.from_trace(path, budget=engine.budget // 2)
    assert half.error is not None and "needs" in half.error
    assert max(half.resident_bytes) <= engine.budget // 2


def test_the_timeline_png_is_written_with_labelled_axes(recorded, tmp_path):
    engine, path = recorded
    for fig, out in ((engine.plot_timeline(tmp_path / "engine.png"), tmp_path / "engine.png"),
                     (dtr.plot(path, tmp_path / "trace.png"), tmp_path / "trace.png")):
        data = out.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
        ax, events = fig.axes
        assert (ax.get_xlabel(), ax.get_ylabel(), events.get_ylabel()) == (
            "op clock", "resident (MiB)", "evictions, replays per op")
        assert f"{engine.stats().evictions} evictions" in ax.get_title()


def test_plots_without_matplotlib_say_what_to_install(recorded, monkeypatch):
    engine, _ = recorded
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'dtr\[plot\]'"):
        engine.plot_timeline()


def test_a_timeline_needs_to_be_asked_for():
    engine = dtr.budget(None)
    with pytest.raises(dtr.DTRError, match=r"timeline=True"):
        engine.timeline()
    with pytest.raises(dtr.DTRError, match="no block has run yet"):
        dtr.budget(None, timeline=True).timeline()
    with pytest.raises(ValueError, match="timeline must be True or False"):
        dtr.budget(None, timeline=1)


def test_bad_sources_are_refused(recorded):
    _, path = recorded
    with pytest.raises(TypeError, match="expected a Timeline, a BudgetCurve, or a trace"):
        dtr.plot(42)
    with pytest.raises(ValueError, match="block must index"):
        dtr.Timeline.from_trace(path, block=5)


def test_a_trace_timeline_stops_where_it_would_thrash(tmp_path):
    """At a budget that thrashes, ``from_trace`` stops as ``dtr.budget`` would (the error says
    so) instead of replaying for minutes; ``max_recompute=None`` runs it to the end."""
    w = zoo.build("treelstm")
    path = tmp_path / "t.jsonl.gz"
    tracked = run_step(w, fresh_model(w), None, cost="estimate", trace=path).stats
    budget = budget_at(tracked, 0.085)  # thrashes there, and ends without a bound (lower, it can fail)
    stopped = dtr.Timeline.from_trace(path, budget)
    assert stopped.error is not None and "below what this model can run at" in stopped.error
    ended = dtr.Timeline.from_trace(path, budget, max_recompute=None)
    assert ended.error is None and sum(ended.replays) > sum(stopped.replays)
