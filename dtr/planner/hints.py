"""What a plan asks of a runtime that recomputes on demand: per-stage hints for the forward pass.

A dynamic runtime does not execute a plan's op sequence; it runs the program's forward pass
once and recomputes what the backward pass misses. What it can take from a plan is which
activations to hold and which to drop during that first forward sweep (the ops before the first
``B``); the recomputations of the backward phase then follow from what is missing:

* ``F_all^k``: stage ``k`` keeps its tape ``ā^k`` (nothing to do);
* ``F_ck^k``: it keeps only its output ``a^k``: drop the stage's other tensors when it ends;
* ``F_none^k``: as ``F_ck^k``, and it also drops its input ``a^(k-1)`` once it has been read.

Every output the sweep keeps (the next stage is not ``F_none``) is held until the backward
pass has used it, so that the heuristic does not evict what the plan's memory accounting assumed
resident: the checkpoints of ``F_ck``/``F_none`` stages, and the outputs of ``F_all`` stages,
from which the plan recomputes the next stage's tape. Holding only the checkpoints lets DTR
evict ``F_all`` outputs (on the bench MLP the seeded step then recomputed 1.13-1.22x the plan's
compute at 0.7-0.5 of peak, against 1.00-1.01x at 0.9-0.6 with every kept output held). Held
means *protected*, a last resort of eviction, not locked (dtr/eager/seeding/applying.py):
locking them, or whole ``F_all`` tapes as well, makes some budgets infeasible, because DTR needs
room to move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from dtr.planner.chain import Op

__all__ = ["StageHint", "forward_hints"]


@dataclass(frozen=True)
class StageHint:
    """What to do when stage ``k`` (1-based) finishes its forward pass."""

    drop_tape: bool  # drop the tensors the stage made, except its output
    drop_input: bool  # drop the stage's input a^(k-1) (the previous stage's output)
    pin_output: bool  # hold a^k until its gradient has been computed (the runtime protects it)


def forward_hints(ops: Sequence[Op], stages: int) -> List[StageHint]:
    """Hints for stages ``1..stages`` (index ``k - 1``) from a plan's op sequence.

    Raises ValueError if the first sweep does not run every stage once, in order.
    """
    kinds = []
    for kind, stage in ops:
        if kind == "B":
            break
        if kind in ("offload", "prefetch"):
            continue
        if stage != len(kinds) + 1:
            raise ValueError(f"forward_hints: the plan's first sweep runs stage {stage} after {len(kinds)} stages")
        kinds.append(kind)
    if len(kinds) != stages:
        raise ValueError(f"forward_hints: the plan's first sweep runs {len(kinds)} of {stages} stages")
    hints = []
    for k, kind in enumerate(kinds):
        dropped_by_next = k + 1 < stages and kinds[k + 1] == "F_none"
        partial = kind != "F_all"
        hints.append(StageHint(drop_tape=partial, drop_input=kind == "F_none",
                               pin_output=not dropped_by_next))
    return hints
