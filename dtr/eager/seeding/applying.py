"""Applying a plan (step 3 of Note [Seeding] in ``dtr/eager/seeding/__init__.py``): a pass that
follows the first forward sweep of its segment's plan as hints, and ends each planned stage's
backward as the plan's accounting assumed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from dtr.eager.seeding.segments import Pass, Segment, watch_gradient
from dtr.core import Storage
from dtr.planner import Plan
from dtr.planner.hints import StageHint, forward_hints

if TYPE_CHECKING:
    from dtr.eager.seeding import Seeding

__all__ = ["ApplyPass"]


class ApplyPass(Pass):
    """A pass with a plan for its signature. Its protections are ``Seeding.hold``'s, so that
    the block's end can lift every one; its backward is one of ``Seeding``'s open passes."""

    def __init__(self, seeding: "Seeding", segment: Segment, signature: tuple, plan: Plan) -> None:
        super().__init__(seeding, segment, signature)
        groups = segment.profiles[signature][2]
        hints = forward_hints(plan.ops, len(groups))
        self.hints: Dict[int, StageHint] = {last: h for (_, last), h in zip(groups, hints)}  # by last module
        self.starts = {first for first, _ in groups}  # first module indexes of the planning stages
        self.made: Dict[int, List[Storage]] = {}  # planning stage (last module) -> what its forward made
        self.kept: Dict[int, List[Storage]] = {}  # F_all stage -> its tape, protected until its backward ends
        self.outputs: List[List[Storage]] = []  # checkpoints held until their gradient exists
        self.in_backward: Optional[int] = None  # planning stage whose backward is running

    def stage_begins(self, k: int) -> None:
        if k in self.starts:
            self.start_sid = self.runtime.next_sid

    def stage_ends(self, k: int, args: tuple, output: Any, outs: List[Storage]) -> None:
        seeding = self.seeding
        locked = seeding.locked
        if k == 0:
            watch_gradient(args[0] if args else None, locked(lambda: seeding.leave_backward(self)))
        hint = self.hints.get(k)
        if hint is None:  # inside a planning stage
            self.next = k + 1
            return
        rt = self.runtime
        made = self.new_storages()
        if hint.drop_tape:
            keep = set(outs)
            rt.evict([s for s in made if s not in keep])
        if hint.drop_input and k > 0:
            rt.evict(self.previous)
        if hint.pin_output and outs:  # a checkpoint: held until its gradient exists
            held = list(outs)
            seeding.hold(held)
            self.outputs.append(held)
            watch_gradient(output, locked(lambda: seeding.unhold(held)))
        tape = [s for s in made if s.refs] if not hint.drop_tape else None
        if tape:  # F_all: the plan holds the tape until the stage's backward
            self.kept[k] = tape
            seeding.hold(tape)
        self.made[k] = made
        watch_gradient(output, locked(lambda: self._stage_backward(k)))
        self.previous = outs
        self.next = k + 1
        seg = self.segment
        if self.next == len(seg.modules):
            seg.active = None
            seg.pending.append(self)

    def release(self) -> None:
        """Drop what the pass holds for its plan (checkpoints, tapes): the plan will not be
        followed through (stages ran out of order, or no backward came)."""
        for held in self.outputs + list(self.kept.values()):
            self.seeding.unhold(held)
        self.outputs = []
        self.kept = {}

    def finish(self) -> None:
        """The pass's backward is over: its last stage is done, and what stages whose
        gradient never came (an output that needs none) still hold is released."""
        self._stage_done()
        self.release()
        self.made = {}

    def _stage_backward(self, k: int) -> None:
        """A planned stage's backward begins (its output's gradient exists): the previous
        stage's is over (``_stage_done``), and what this one makes, its input's gradient above
        all, is evicted only as a last resort until the next stage's backward begins, as the
        plan's accounting assumed (Note [Seeding])."""
        seg = self.segment
        if self.next != len(seg.modules):  # a pass the plan did not hold for
            return
        if self in seg.pending:
            seg.pending.remove(self)
        self._stage_done()
        self.in_backward = k
        if k not in self.kept:  # the tape this backward reads, recomputed as needed: held until it ends
            tape = [s for s in self.made.get(k, ()) if s.refs]
            if tape:
                self.kept[k] = tape
                self.seeding.hold(tape)
        self.seeding.enter_backward(self)

    def _stage_done(self) -> None:
        """The backward of the stage ``in_backward`` is over: what its forward made (or
        recomputed) and the program no longer holds leaves memory (evicted: its lineage stays),
        as the plan assumed. Left resident, it is lineage of the gradients downstream, and
        its large evicted neighbourhood makes the heuristic keep it and evict the next
        stage's fresh tape instead."""
        k = self.in_backward
        if k is None:
            return
        self.in_backward = None
        tape = self.kept.pop(k, None)
        if tape is not None:
            self.seeding.unhold(tape)
        done = self.made.pop(k, None)
        if done:
            self.runtime.evict([s for s in done if not s.refs])
