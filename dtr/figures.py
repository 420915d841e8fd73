"""Figures: a block's memory timeline, and the slowdown-vs-budget curve of the advisor.

matplotlib is an optional dependency (``pip install 'dtr[plot]'``), imported on the first plot.
Figures are made without ``pyplot`` (no global state, no display needed) unless an ``ax`` is
given, so that a figure can be drawn into the program's own layout or a notebook's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from dtr.advisor import BudgetCurve
from dtr.sim.trace import Trace
from dtr.timeline import Timeline

__all__ = ["plot"]

_MIB = 2**20


def plot(
    source: Union[Timeline, BudgetCurve, Trace, str, Path],
    path: Union[str, Path, None] = None,
    *,
    ax: Any = None,
    **options: Any,
) -> Any:
    """Draw a memory timeline or a budget curve; returns the matplotlib ``Figure``.

    Args:
        source: a ``Timeline`` (``engine.timeline()``, ``dtr.Timeline.from_trace``), a trace (path
            or ``Trace``: its timeline, ``options`` passed to ``Timeline.from_trace``: ``budget``,
            ``heuristic``, ``block``), or a ``BudgetCurve`` (``dtr.budget_curve(trace)``).
        path: also save the figure there (PNG, SVG, PDF, ... by extension).
        ax: a matplotlib ``Axes`` to draw into instead of a new figure.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'dtr[plot]'``).
    """
    if isinstance(source, (str, Path, Trace)):
        source = Timeline.from_trace(source, **options)
    elif options:
        raise TypeError(f"dtr.plot: options {sorted(options)} apply to a trace, not to a {type(source).__name__}")
    if isinstance(source, Timeline):
        draw = _draw_timeline
    elif isinstance(source, BudgetCurve):
        draw = _draw_curve
    else:
        raise TypeError(
            "dtr.plot: expected a Timeline, a BudgetCurve, or a trace (path or dtr.sim.Trace), "
            f"got {type(source).__name__}"
        )
    if ax is None:
        ax = _figure().add_subplot()
    draw(source, ax)
    fig = ax.figure
    if path is not None:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "dtr.plot: plots need matplotlib, an optional dependency: pip install 'dtr[plot]'"
        ) from None
    fig = Figure(figsize=(8, 4))
    fig.set_layout_engine("constrained")
    return fig


def _draw_timeline(t: Timeline, ax: Any) -> None:
    x = t.clock
    ax.step(x, [b / _MIB for b in t.resident_bytes], where="post", color="C0", label="resident")
    if any(b is not None for b in t.budget):
        budget = [float("nan") if b is None else b / _MIB for b in t.budget]
        ax.step(x, budget, where="post", color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("op clock")
    ax.set_ylabel("resident (MiB)")
    ax.set_ylim(bottom=0)
    events = ax.twinx()
    for counts, color, label in ((t.evictions, "C3", "evictions"), (t.replays, "C2", "replays")):
        at = [(c, n) for c, n in zip(x, counts) if n]
        if at:
            events.vlines([c for c, _ in at], 0, [n for _, n in at], color=color, alpha=0.6, label=label)
    events.set_ylabel("evictions, replays per op")
    events.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = events.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, loc="upper left", fontsize="small")
    title = f"memory timeline: {t.total_evictions} evictions, {t.total_replays} replays"
    ax.set_title(title + (" (ran out of budget)" if t.error else ""))


def _draw_curve(curve: BudgetCurve, ax: Any) -> None:
    ok = [p for p in curve.points if p.feasible]
    bad = [p for p in curve.points if not p.feasible]
    ax.plot([p.budget / _MIB for p in ok], [p.slowdown for p in ok], "o-", color="C0", label="feasible")
    if bad:
        top = max([p.slowdown for p in ok], default=1.0)
        ax.plot([p.budget / _MIB for p in bad], [top] * len(bad), "x", color="C3", label="infeasible")
    if curve.lowest_feasible is not None:
        ax.axvline(curve.lowest_feasible / _MIB, color="black", linestyle="--", linewidth=1,
                   label=f"lowest feasible {curve.lowest_feasible / _MIB:.2f} MiB")
    ax.set_xlabel("budget (MiB)")
    ax.set_ylabel("slowdown (compute with replays / without)")
    ax.set_title(f"budget curve ({curve.heuristic}); unlimited peak {curve.peak_bytes / _MIB:.2f} MiB")
    ax.legend(fontsize="small")
