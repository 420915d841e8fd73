"""Profiling a segment (step 1 of Note [Seeding] in ``dtr/eager/seeding/__init__.py``): a pass
under plain DTR that measures each stage, forward and backward, and leaves a rotor chain."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from dtr.eager.seeding.segments import Pass, Segment, at_backward_end, cells_of, watch_gradient
from dtr.core import PeakMeter, State, Storage
from dtr.planner import Chain

if TYPE_CHECKING:
    from dtr.eager.seeding import Seeding

__all__ = ["Profile", "ProfilePass"]


class Profile:
    """Measurements of one forward and backward pass of a segment (lists indexed by stage)."""

    def __init__(self, stages: int) -> None:
        z = [0] * stages
        self.forward, self.backward = [0.0] * stages, [0.0] * stages
        self.output, self.saved, self.forward_peak, self.backward_peak = list(z), list(z), list(z), list(z)
        self.storages: List[List[Storage]] = [[] for _ in range(stages)]
        self.fused = [False] * stages  # stage k's output was written in place by stage k + 1
        self.input_bytes = 0
        self.before = 0  # bytes resident outside the segment when it started
        self.held = 0  # gradient bytes held then (Note [Held gradients])

    def groups(self) -> List[Tuple[int, int]]:
        """Planning stages as ``(first, last)`` module indexes: a module whose output the next
        one writes in place (``ReLU(inplace=True)``) forms one stage with it, because its
        output never exists apart from the next one's (it cannot be a checkpoint)."""
        groups, first = [], 0
        for k, fused in enumerate(self.fused):
            if not fused or k == len(self.fused) - 1:
                groups.append((first, k))
                first = k + 1
        return groups

    def chain(self) -> Chain:
        """The rotor chain of the planning stages (``groups``)."""
        cols: Dict[str, list] = {name: [] for name in ("f", "b", "out", "saved", "fo", "bo")}
        before = self.input_bytes
        for first, last in self.groups():
            r = range(first, last + 1)
            saved = sum(self.saved[k] for k in r)
            # A module's forward peak was measured from its own start: add what the group's
            # earlier modules keep.
            fpeak = max(sum(self.saved[i] for i in range(first, k)) + self.forward_peak[k] for k in r)
            cols["f"].append(sum(self.forward[k] for k in r))
            cols["b"].append(sum(self.backward[k] for k in r))
            cols["out"].append(self.output[last])
            cols["saved"].append(saved)
            cols["fo"].append(max(0, fpeak - max(saved, self.output[last])))
            cols["bo"].append(max(0, max(self.backward_peak[k] for k in r) - before))
            before = self.output[last]
        return Chain(cols["f"], cols["b"], cols["out"], cols["saved"], cols["fo"], cols["bo"], self.input_bytes)


class ProfilePass(Pass):
    """The first pass with a signature: measures each stage (the engine's op seconds, and its
    peak with a ``PeakMeter``) into a ``Profile``; when its backward ends, the segment keeps the
    chain and the plan solved from it."""

    def __init__(self, seeding: "Seeding", segment: Segment, signature: tuple, args: tuple) -> None:
        super().__init__(seeding, segment, signature)
        rt = self.runtime
        prof = Profile(len(segment.modules))
        self.profile: Optional[Profile] = prof  # None: measuring stopped
        inputs = cells_of(rt, args[:1])
        if inputs:
            prof.input_bytes = inputs[0].storage.nbytes
        prof.before = rt.memory - prof.input_bytes
        prof.held = rt.held_bytes
        self.stage: Optional[int] = None  # stage whose backward is running (-1: none is left)
        self._t0 = 0.0
        self._m0 = 0
        self._meter: Optional[PeakMeter] = None

    def _measure(self) -> None:
        """Start measuring a stage from now."""
        rt = self.runtime
        if self._meter is not None:  # the stage measured last raised
            self._meter.stop()
        self._t0, self._m0, self._meter = self.seeding.driver.op_seconds, rt.memory, rt.meter()

    def _measured(self) -> Tuple[float, int]:
        """The stage's seconds, and how far its peak rose above ``_m0``."""
        peak = self._meter.stop()
        self._meter = None
        return self.seeding.driver.op_seconds - self._t0, peak - self._m0

    def stage_begins(self, k: int) -> None:
        self.start_sid = self.runtime.next_sid
        self._measure()

    def stage_ends(self, k: int, args: tuple, output: Any, outs: List[Storage]) -> None:
        prof = self.profile
        prof.forward[k], prof.forward_peak[k] = self._measured()
        prof.output[k] = sum(s.nbytes for s in outs)
        prof.storages[k] = self.new_storages()
        if k and any(s.forward is not None for s in self.previous):
            prof.fused[k - 1] = True
        locked = self.seeding.locked
        watch_gradient(output, locked(lambda: self._backward_reached(k)))
        if k == 0:
            watch_gradient(args[0] if args else None, locked(lambda: self._backward_reached(-1)))
        self.previous = outs
        self.next = k + 1

    def release(self) -> None:
        if self._meter is not None:  # a stage raised
            self._meter.stop()

    def _backward_reached(self, k: int) -> None:
        """The gradient of stage ``k``'s output exists (``k = -1``: the segment's input), so
        stage ``k + 1``'s backward is over and stage ``k``'s begins."""
        prof = self.profile
        if prof is None:
            return
        if self.stage is None:
            if k != len(self.segment.modules) - 1:
                self.profile = None  # the backward pass did not enter at the segment's end
                return
            # A stage's tape: what it made that the program (autograd) still holds. Old
            # versions of storages written in place are lineage, not tape.
            prof.storages = [[s for s in made if s.refs and s.state is not State.RELEASED]
                             for made in prof.storages]
            for j, kept in enumerate(prof.storages):
                prof.saved[j] = sum(s.nbytes for s in kept)
            at_backward_end(self.seeding.locked(self._backward_done))
        else:
            self._close_stage()
        self.stage = k
        if k >= 0:
            self._measure()
            # Tape that DTR evicted comes back during this backward: not an overhead.
            self._m0 += sum(s.nbytes for s in prof.storages[k] if s.state is State.EVICTED)

    def _close_stage(self) -> None:
        j = self.stage
        if j is not None and j >= 0:
            self.profile.backward[j], self.profile.backward_peak[j] = self._measured()

    def _backward_done(self) -> None:
        prof = self.profile
        if prof is None:
            return
        self._close_stage()
        prof.before += self.runtime.held_bytes - prof.held  # Note [Seeding]
        prof.storages = []
        self.profile = None
        seg = self.segment
        if seg.active is self:
            seg.active = None
        if any(prof.backward) or any(prof.forward):
            chain = prof.chain()
            seg.profiles[self.signature] = (chain, prof.before, prof.groups())
            seg.plans[(self.signature, self.seeding.budget)] = self.seeding.plan_for(chain, prof.before)
