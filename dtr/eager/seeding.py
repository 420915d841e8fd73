"""Static plans for sequential segments, applied by the dynamic runtime (``dtr.budget(plan=...)``).

Note [Seeding]
~~~~~~~~~~~~~~
A segment is a chain of stages (modules called in order, each on the previous one's output).
For each input signature (shapes and dtypes of the first stage's tensor arguments):

1. The first training step with that signature runs under plain DTR and is *profiled* with
   module and gradient hooks: per stage, the cost of its forward and backward ops as the engine
   measured (or estimated) them, the bytes of its output, of what it kept for backward (its
   storages still alive when the backward pass reaches it) and of its transient peaks.
2. The rotor DP (``dtr.planner.solve``) gives the optimal persistent schedule for the budget
   share the segment can use: the budget minus what was resident when the segment started.
3. From the next step with that signature on, the first forward sweep of the plan is applied
   as hints (``dtr.planner.hints``): stages the plan runs ``F_ck``/``F_none`` have their other
   tensors evicted when they end, ``F_none`` stages also evict their input once read,
   checkpoints are protected (``Runtime.protect``: a last resort of eviction, not a pin) until
   their gradient has been computed, and the tapes of ``F_all`` stages until their backward
   ends; so is every stage's tape during its own backward (recomputed as needed). In the backward pass, what a planning stage's backward makes (the gradient of its
   input above all, which the next backward step reads) is protected (``Runtime.protect_new``:
   evicted only when no other storage of ordinary size can go) until the next stage's backward
   begins, and then what the finished stage's forward made or recomputed that the program no
   longer holds is evicted (its lineage stays), as the plan's accounting assumed. Everything
   else, including every recomputation in the backward pass, is ordinary DTR: the heuristic
   handles what the plan did not foresee.

A pass that does not run the stages in order (control flow that skips one, a stage called
twice) applies nothing more from that point; a new signature is profiled, never given another
signature's plan. An infeasible share leaves the segment to plain DTR (with a warning).
The backward phase is tracked per backward pass, not per segment: one autograd callback at
its end turns protection off and finishes every pass still open (two chained segments share a
gradient, and its hooks fire in the first segment's favour before the second's input is done).
Profiled sizes are the engine's: constants (parameters, a segment input made before the block)
cost nothing, and the transient overheads are approximations (peak during the stage minus what
it kept). The gradients the step holds by the end of the segment's backward (Note [Held
gradients] in runtime.py) count as in use before the segment: the rotor DPs do not model them,
and they cannot be evicted, so the plan gets what is left.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from dtr.eager.tensor import DTRTensor
from dtr.engine import State, Storage
from dtr.errors import InfeasibleBudgetError
from dtr.log import logger, warn
from dtr.planner import Chain, Plan, solve
from dtr.planner.hints import StageHint, forward_hints

__all__ = ["Seeding", "segments_of"]

def segments_of(plan: Any) -> List[List[nn.Module]]:
    """Validate ``dtr.budget(..., plan=...)``: a list of segments, each an ``nn.Sequential``
    or a list of modules called in order."""
    if not isinstance(plan, (list, tuple)) or not plan:
        raise ValueError(f"dtr.budget: plan must be a non-empty list of segments, got {plan!r}")
    out = []
    seen = set()
    for i, seg in enumerate(plan):
        modules = list(seg) if isinstance(seg, (nn.Sequential, nn.ModuleList, list, tuple)) else None
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError(
                f"dtr.budget: plan[{i}] must be an nn.Sequential or a non-empty list of modules "
                f"called in order, got {type(seg).__name__}"
            )
        for m in modules:
            if id(m) in seen:
                raise ValueError(f"dtr.budget: plan[{i}] repeats a module of another stage: {type(m).__name__}")
            seen.add(id(m))
        out.append(modules)
    return out


class _Profile:
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
        self.stage: Optional[int] = None  # stage whose backward is running
        self.t0 = 0.0
        self.m0 = 0
        self.saved_peak = 0

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


class _Pass:
    """One forward pass of a segment in progress."""

    def __init__(self, signature: tuple, mode: str, hints: Dict[int, StageHint], starts: set) -> None:
        self.signature = signature
        self.mode = mode  # "profile" or "apply"
        self.hints = hints  # last module index of a planning stage -> its hint
        self.starts = starts  # first module indexes of the planning stages
        self.next = 0  # stage expected next
        self.start_sid = 0
        self.t0 = 0.0
        self.m0 = 0
        self.saved_peak = 0
        self.previous: List[Storage] = []  # output storages of the previous (planning) stage
        self.made: Dict[int, List[Storage]] = {}  # planning stage (last module) -> what its forward made
        self.kept: Dict[int, List[Storage]] = {}  # F_all stage -> its tape, protected until its backward ends
        self.outputs: List[List[Storage]] = []  # checkpoints held until their gradient exists
        self.in_backward: Optional[int] = None  # planning stage whose backward is running
        self.profile: Optional[_Profile] = None


class _Segment:
    def __init__(self, modules: List[nn.Module]) -> None:
        self.modules = modules
        # signature -> (chain, bytes resident before the segment, planning stages)
        self.profiles: Dict[tuple, Tuple[Chain, int, List[Tuple[int, int]]]] = {}
        self.plans: Dict[Tuple[tuple, Optional[int]], Optional[Plan]] = {}  # (signature, budget)
        self.active: Optional[_Pass] = None
        self.pending: List[_Pass] = []  # applied passes whose backward has not begun


class Seeding:
    """The plans of one engine's segments, and the hooks that profile and apply them."""

    def __init__(self, segments: List[List[nn.Module]]) -> None:
        self.segments = [_Segment(m) for m in segments]
        self.driver = None
        self.budget: Optional[int] = None
        self._handles: list = []
        self._held: List[list] = []  # storage lists protected for a plan and not yet released
        # Applied passes whose backward has begun, the one whose stage protects what it makes,
        # and whether the end-of-backward callback is queued.
        self._open: List[_Pass] = []
        self._protecting: Optional[_Pass] = None
        self._callback_queued = False
        self._warned = False

    # ------------------------------------------------------------------ lifecycle

    def attach(self, driver, budget: Optional[int]) -> None:
        self.driver = driver
        self.budget = budget
        for seg in self.segments:
            seg.active = None
            for k, m in enumerate(seg.modules):
                self._handles.append(m.register_forward_pre_hook(self._pre_hook(seg, k)))
                self._handles.append(m.register_forward_hook(self._post_hook(seg, k)))

    def detach(self) -> None:
        """Remove the hooks and release what a backward pass did not get to (before the block's
        runtime closes)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        rt = self.driver.rt
        with rt.lock:
            for held in self._held:
                rt.unprotect(held)
            self._close_backward()
        self._held = []
        self._callback_queued = False
        for seg in self.segments:
            seg.active = None
        self.driver = None

    def plans(self) -> List[Dict[tuple, Optional[Plan]]]:
        """Per segment: input signature -> the plan in use for the current budget (None: the
        segment runs under plain DTR)."""
        return [{sig: plan for (sig, b), plan in seg.plans.items() if b == self.budget} for seg in self.segments]

    # ------------------------------------------------------------------ forward hooks

    def _pre_hook(self, seg: _Segment, k: int):
        def pre(module, args):
            if self.driver is None or not torch.is_grad_enabled():
                return
            rt = self.driver.rt
            with rt.lock:
                if k == 0:
                    self._begin(seg, _signature(args), args)
                p = seg.active
                if p is None:
                    return
                if p.next != k:  # stages out of order: apply nothing more in this pass
                    seg.active = None
                    self._release(p)
                    return
                if p.mode == "profile" or k in p.starts:
                    p.start_sid = rt.next_sid
                p.t0 = self.driver.op_seconds
                p.m0 = rt.memory
                if p.mode == "profile":
                    p.saved_peak, rt.peak = rt.peak, rt.memory

        return pre

    def _begin(self, seg: _Segment, signature: tuple, args) -> None:
        # Earlier passes whose backward never began (a forward without backward, a pass that
        # stopped part-way, or a second forward before the backward): their protections
        # would otherwise outlive them.
        for p in seg.pending + ([seg.active] if seg.active is not None else []):
            self._release(p)
        seg.pending = []
        seg.active = None
        if self.budget is None or signature is None:
            return
        rt = self.driver.rt
        key = (signature, self.budget)
        if key not in seg.plans and signature in seg.profiles:
            chain, before, _ = seg.profiles[signature]
            seg.plans[key] = self._solve(chain, before)
        if key in seg.plans:
            plan = seg.plans[key]
            if plan is not None:
                groups = seg.profiles[signature][2]
                hints = forward_hints(plan.ops, len(groups))
                seg.active = _Pass(signature, "apply", {last: h for (_, last), h in zip(groups, hints)},
                                   {first for first, _ in groups})
            return
        p = seg.active = _Pass(signature, "profile", {}, set())
        prof = p.profile = _Profile(len(seg.modules))
        x = args[0] if args else None
        if type(x) is DTRTensor and x._dtr.cell.storage.runtime is rt:
            prof.input_bytes = rt.resolve(x._dtr.cell).storage.nbytes
        prof.before = rt.memory - prof.input_bytes
        prof.held = rt.held_bytes

    def _post_hook(self, seg: _Segment, k: int):
        def post(module, args, output):
            p = seg.active
            if p is None or self.driver is None or p.next != k:
                return
            rt = self.driver.rt
            with rt.lock:
                cells = _cells(rt, output)
                outs = list(dict.fromkeys(c.storage for c in cells))
                made = rt.storages_since(p.start_sid)
                if p.mode == "profile":
                    prof = p.profile
                    prof.forward[k] = self.driver.op_seconds - p.t0
                    prof.output[k] = sum(s.nbytes for s in outs)
                    prof.forward_peak[k] = rt.peak - p.m0
                    rt.peak = max(rt.peak, p.saved_peak)
                    prof.storages[k] = made
                    if k and any(s.forward is not None for s in p.previous):
                        prof.fused[k - 1] = True
                    self._watch_gradient(output, lambda: self._backward_reached(seg, p, k))
                    if k == 0:
                        self._watch_gradient(args[0] if args else None, lambda: self._backward_reached(seg, p, -1))
                else:
                    if k == 0:
                        self._watch_gradient(args[0] if args else None, lambda: self._segment_backward_done(p))
                    hint = p.hints.get(k)
                    if hint is None:  # inside a planning stage
                        p.next = k + 1
                        return
                    if hint.drop_tape:
                        keep = set(outs)
                        rt.evict([s for s in made if s not in keep])
                    if hint.drop_input and k > 0:
                        rt.evict(p.previous)
                    if hint.pin_output and outs:  # a checkpoint: held until its gradient exists
                        held = list(outs)
                        self._hold(held)
                        p.outputs.append(held)
                        self._watch_gradient(output, lambda: self._release_output(held))
                    tape = [s for s in made if s.refs] if not hint.drop_tape else None
                    if tape:  # F_all: the plan holds the tape until the stage's backward
                        p.kept[k] = tape
                        self._hold(tape)
                    p.made[k] = made
                    self._watch_gradient(output, lambda: self._stage_backward(seg, p, k))
                p.previous = outs
                p.next = k + 1
            if p.next == len(seg.modules) and p.mode == "apply":
                seg.active = None
                seg.pending.append(p)

        return post

    # ------------------------------------------------------------------ backward

    def _watch_gradient(self, output, callback) -> None:
        """Call ``callback`` once, when the gradient of ``output`` (a tensor or the first tensor
        of a tuple) has been computed, i.e. when the backward pass has gone through it."""
        t = output
        if isinstance(t, (tuple, list)):
            t = next((x for x in t if isinstance(x, torch.Tensor)), None)
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return
        fired = []

        def hook(grad):
            if not fired:
                fired.append(True)
                callback()

        t.register_hook(hook)

    def _hold(self, storages: List[Storage]) -> None:
        self.driver.rt.protect(storages)
        self._held.append(storages)

    def _unhold(self, storages: List[Storage]) -> None:
        """Undo ``_hold(storages)``, once (protections nest: a checkpoint is often in a tape)."""
        for i, h in enumerate(self._held):
            if h is storages:
                del self._held[i]
                self.driver.rt.unprotect(storages)
                return

    def _release_output(self, held: List[Storage]) -> None:
        """A checkpoint's gradient exists: the plan no longer holds it."""
        d = self.driver
        if d is None:
            return
        with d.rt.lock:
            if self.driver is not None:
                self._unhold(held)

    def _stage_backward(self, seg: _Segment, p: _Pass, k: int) -> None:
        """A planned stage's backward begins (its output's gradient exists): the previous
        stage's is over (``_stage_done``), and what this one makes, its input's gradient above
        all, is evicted only as a last resort until the next stage's backward begins, as the
        plan's accounting assumed (Note [Seeding])."""
        d = self.driver
        if d is None or p.next != len(seg.modules):  # a pass the plan did not hold for
            return
        with d.rt.lock:
            if self.driver is None:
                return
            if p in seg.pending:
                seg.pending.remove(p)
            if not self._callback_queued:  # one per backward pass, whatever the segments
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_over)
            self._stage_done(p)
            p.in_backward = k
            if k not in p.kept:  # the tape this backward reads, recomputed as needed: held until it ends
                tape = [s for s in p.made.get(k, ()) if s.refs]
                if tape:
                    p.kept[k] = tape
                    self._hold(tape)
            if p not in self._open:
                self._open.append(p)
            self._protecting = p
            d.rt.protect_new(True)

    def _finish(self, p: _Pass) -> None:
        """Pass ``p``'s backward is over: its last stage is done, and what stages whose
        gradient never came (an output that needs none) still hold is released."""
        self._stage_done(p)
        self._release(p)
        p.made = {}

    def _release(self, p: _Pass) -> None:
        """Drop what pass ``p`` holds for its plan (checkpoints, tapes): the plan will not be
        followed through (stages ran out of order, or no backward came)."""
        for held in p.outputs + list(p.kept.values()):
            self._unhold(held)
        p.outputs = []
        p.kept = {}

    def _stage_done(self, p: _Pass) -> None:
        """The backward of the stage ``p.in_backward`` is over: what its forward made (or
        recomputed) and the program no longer holds leaves memory (evicted: its lineage stays),
        as the plan assumed. Left resident, it is lineage of the gradients downstream, and
        its large evicted neighbourhood makes the heuristic keep it and evict the next
        stage's fresh tape instead."""
        k = p.in_backward
        if k is None:
            return
        p.in_backward = None
        tape = p.kept.pop(k, None)
        if tape is not None:
            self._unhold(tape)
        done = p.made.pop(k, None)
        if done:
            self.driver.rt.evict([s for s in done if not s.refs])

    def _segment_backward_done(self, p: _Pass) -> None:
        """The gradient of the segment's input exists: the backward of pass ``p``'s first
        stage is over."""
        d = self.driver
        if d is None:
            return
        with d.rt.lock:
            if self.driver is None or p not in self._open:
                return
            self._finish(p)
            self._open.remove(p)
            if self._protecting is p:
                self._protecting = None
                d.rt.protect_new(False)

    def _backward_over(self) -> None:
        """End of a backward pass (autograd's queued callback)."""
        d = self.driver
        if d is None:
            return
        with d.rt.lock:
            if self.driver is not None:
                self._close_backward()
                self._callback_queued = False

    def _close_backward(self) -> None:
        for p in self._open:
            self._finish(p)
        self._open = []
        if self._protecting is not None:
            self._protecting = None
            self.driver.rt.protect_new(False)

    def _backward_reached(self, seg: _Segment, p: _Pass, k: int) -> None:
        """Profiling: the gradient of stage ``k``'s output exists (``k = -1``: the segment's
        input), so stage ``k + 1``'s backward is over and stage ``k``'s begins."""
        prof = p.profile
        if self.driver is None or prof is None:
            return
        d = self.driver
        rt = d.rt
        with rt.lock:
            if prof.stage is None:
                if k != len(seg.modules) - 1:
                    p.profile = None  # the backward pass did not enter at the segment's end
                    return
                # A stage's tape: what it made that the program (autograd) still holds. Old
                # versions of storages written in place are lineage, not tape.
                prof.storages = [[s for s in made if s.refs and s.state is not State.RELEASED]
                                 for made in prof.storages]
                for j, kept in enumerate(prof.storages):
                    prof.saved[j] = sum(s.nbytes for s in kept)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(seg, p))
            else:
                self._close_stage(prof, rt)
            if k >= 0:
                prof.stage, prof.t0, prof.m0 = k, d.op_seconds, rt.memory
                prof.saved_peak, rt.peak = rt.peak, rt.memory
                # Tape that DTR evicted comes back during this backward: not an overhead.
                prof.m0 += sum(s.nbytes for s in prof.storages[k] if s.state is State.EVICTED)
            else:
                prof.stage = -1

    def _close_stage(self, prof: _Profile, rt) -> None:
        j = prof.stage
        if j is None or j < 0:
            return
        prof.backward[j] = self.driver.op_seconds - prof.t0
        prof.backward_peak[j] = rt.peak - prof.m0
        rt.peak = max(rt.peak, prof.saved_peak)

    def _backward_done(self, seg: _Segment, p: _Pass) -> None:
        prof = p.profile
        if self.driver is None or prof is None:
            return
        rt = self.driver.rt
        with rt.lock:
            self._close_stage(prof, rt)
            prof.before += rt.held_bytes - prof.held  # module docstring
            prof.storages = []
            p.profile = None
            if seg.active is p:
                seg.active = None
            if any(prof.backward) or any(prof.forward):
                chain = prof.chain()
                seg.profiles[p.signature] = (chain, prof.before, prof.groups())
                seg.plans[(p.signature, self.budget)] = self._solve(chain, prof.before)

    def _solve(self, chain: Chain, before: int) -> Optional[Plan]:
        share = self.budget - before
        try:
            if share <= 0:
                raise InfeasibleBudgetError(f"the segment has no room: {before} bytes are in use before it", 0)
            return solve(chain, share)
        except InfeasibleBudgetError as e:
            logger.debug("no plan fits a segment's share of the budget (%d bytes): plain DTR there", max(share, 0))
            if not self._warned:
                self._warned = True
                warn(
                    f"dtr: no plan fits the segment's share of the budget ({max(share, 0)} bytes; "
                    f"{e}); it runs under plain DTR",
                    stacklevel=2,
                )
            return None


def _signature(args: Sequence[Any]) -> Optional[tuple]:
    sig = tuple((tuple(a.shape), a.dtype, a.device.type) for a in args if isinstance(a, torch.Tensor))
    return sig or None


def _cells(rt, output) -> list:
    """The engine cells of a stage's output tensors (plain tensors have none)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    cells = []
    for t in items:
        if type(t) is DTRTensor and t._dtr.cell.storage.runtime is rt:
            ref = t._dtr
            cells.append(rt.resolve(ref.cell))
    return cells
