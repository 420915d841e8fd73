"""``engine.explain()``: what holds the budget, what the engine evicted and replayed, and why
it last failed, as data with a readable ``__str__``.

The report is built from what the runtime owns: its resident storages (``holdings``, read when
the report is made, or kept from the moment a block ended or failed) and the observer of its
last block (``dtr.core.events.Events``: evictions and replays by the op that made each tensor,
the last ``OutOfBudgetError`` that reached the program).

Which moment "holds the budget" describes (``Report.moment``):

- inside a block: now;
- after a block that raised ``OutOfBudgetError`` (or ``ThrashingError``) to the program: the
  moment the engine gave up (also in ``failure.holdings``);
- after a block that ended normally: just before its end handed the live tensors over (what a
  block keeps at its end: typically gradients and outputs, since backward freed the rest);
- before any block: nothing; the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional

from dtr.core.events import GROUPS, Events, Failure, Holding, Tally
from dtr.core.telemetry import Stats
from dtr.errors import format_bytes

__all__ = ["Report", "report"]

_TOP = 8  # rows per section in ``__str__``


@dataclass(frozen=True)
class Report:
    """What one engine's last block did (``engine.explain()``).

    Attributes:
        moment: which moment ``holdings`` describes (module docstring of dtr/explain.py).
        holdings: bytes charged to the budget then, by group (``GROUPS``: locked, protected by
            a plan, loop checkpoints, made in backward, not recomputable, activations,
            gradients, copies to host) and by the op that
            made them, largest first.
        evictions: evictions to meet the budget in the last block, by the op that made the
            evicted tensors, most expensive to recompute first (``seconds``: the op's recorded
            cost, once per eviction).
        replays: replays in the last block, by op, most expensive first (``seconds``: as
            measured or estimated).
        failure: the last ``OutOfBudgetError`` or ``ThrashingError`` of the last block that
            reached the program, or None.
        stats: ``engine.stats()`` (totals over every block of the engine).
    """

    moment: str
    holdings: List[Holding] = field(default_factory=list)
    evictions: List[Tally] = field(default_factory=list)
    replays: List[Tally] = field(default_factory=list)
    failure: Optional[Failure] = None
    stats: Optional[Stats] = None

    def by_group(self) -> List[tuple]:
        """``(group, bytes)`` of ``holdings``, in ``GROUPS`` order, groups with bytes only."""
        return _by_group(self.holdings)

    def __str__(self) -> str:
        s = self.stats
        lines = ["dtr.explain: " + self.moment]
        if s is not None and s.ops:
            budget = "none" if s.budget is None else format_bytes(s.budget)
            lines.append(
                f"  budget {budget}, peak {format_bytes(s.peak_resident_bytes)}, {s.ops} ops, "
                f"{s.evictions} evictions, {s.rematerializations} replays ({s.remat_seconds * 1e3:.1f} ms)"
            )
        if self.holdings:
            total = sum(h.nbytes for h in self.holdings)
            lines.append(f"What holds the budget ({format_bytes(total)}):")
            for group, nbytes in self.by_group():
                lines.append(f"  {group:<20} {format_bytes(nbytes):>12}")
                rows = [h for h in self.holdings if h.group == group]
                for h in rows[:_TOP]:
                    lines.append(f"      {h.op:<34} {h.count:>6} x  {format_bytes(h.nbytes):>12}")
                if len(rows) > _TOP:
                    lines.append(f"      ... {len(rows) - _TOP} more ops")
        for title, tallies in (("Most expensive evictions (to recompute)", self.evictions),
                               ("Most expensive replays", self.replays)):
            if tallies:
                lines.append(f"{title}, by the op that made the tensor:")
                for t in tallies[:_TOP]:
                    lines.append(f"      {t.op:<34} {t.count:>6} x  {format_bytes(t.nbytes):>12}  {t.seconds * 1e3:>9.2f} ms")
        f = self.failure
        if f is not None:
            lines.append(f"Why the last {f.kind}: {f.op} needed {format_bytes(f.needed_bytes)} at once; budget {format_bytes(f.budget)}.")
            if f.ratio is not None:
                lines.append(f"  {f.replays} replays cost {f.ratio:.1f}x the block's own ops.")
            held = _by_group(f.holdings)
            if held:
                lines.append("  held then: " + ", ".join(f"{g} {format_bytes(n)}" for g, n in held))
            lines.append("  " + f.message)
        return "\n".join(lines)


def report(
    moment: str, holdings: List[Holding], events: Optional[Events], stats: Optional[Stats]
) -> Report:
    """A ``Report`` from a block's holdings and its observer (``Engine.explain`` calls this)."""
    evictions: List[Tally] = []
    replays: List[Tally] = []
    failure = None
    if events is not None:
        # Copies: a block still running goes on counting into the observer's tallies.
        evictions = sorted(map(replace, events.evictions.values()), key=lambda t: (-t.seconds, -t.nbytes))
        replays = sorted(map(replace, events.replays.values()), key=lambda t: (-t.seconds, -t.nbytes))
        failure = events.failure
    return Report(moment, list(holdings), evictions, replays, failure, stats)


def _by_group(holdings: List[Holding]) -> List[tuple]:
    sums = {g: 0 for g in GROUPS}
    for h in holdings:
        sums[h.group] += h.nbytes
    return [(g, n) for g, n in sums.items() if n]
