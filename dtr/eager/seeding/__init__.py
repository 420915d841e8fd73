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
   checkpoints are protected (``Runtime.protect``: a last resort of eviction, not a lock) until
   their gradient has been computed, and the tapes of ``F_all`` stages until their backward
   ends; so is every stage's tape during its own backward (recomputed as needed). In the
   backward pass, what a planning stage's backward makes (the gradient of its input above all,
   which the next backward step reads) is protected (``Runtime.protect_new``: evicted only when
   no other storage of ordinary size can go) until the next stage's backward begins, and then
   what the finished stage's forward made or recomputed that the program no longer holds is
   evicted (its lineage stays), as the plan's accounting assumed. Everything else, including
   every recomputation in the backward pass, is ordinary DTR: the heuristic handles what the
   plan did not foresee.

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

The package: ``segments.py`` holds what every pass shares (``Segment``, ``Pass``, the gradient
hooks); ``profiling.py`` step 1 (``ProfilePass``, ``Profile``); ``applying.py`` step 3
(``ApplyPass``); this module ``Seeding``: the module hooks that start a pass at each forward
and drive it stage by stage, the protections plans hold, and the backward phase of the passes
that apply a plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch

from dtr.eager.seeding.applying import ApplyPass
from dtr.eager.seeding.profiling import ProfilePass
from dtr.eager.seeding.segments import Segment, at_backward_end, cells_of, segments_of
from dtr.core import Storage
from dtr.errors import InfeasibleBudgetError
from dtr.log import logger, warn
from dtr.planner import Chain, Plan, solve

if TYPE_CHECKING:
    from dtr.eager.driver import Driver

__all__ = ["Seeding", "segments_of"]


class Seeding:
    """The plans of one engine's segments, and the hooks that profile and apply them."""

    def __init__(self, segments: List[List[torch.nn.Module]]) -> None:
        self.segments = [Segment(m) for m in segments]
        self.driver: Optional[Driver] = None
        self._handles: list = []
        self._held: List[List[Storage]] = []  # storage lists protected for a plan and not yet released
        # Applied passes whose backward has begun, the one whose stage protects what it makes,
        # and whether the end-of-backward callback is queued.
        self._open: List[ApplyPass] = []
        self._protecting: Optional[ApplyPass] = None
        self._callback_queued = False
        self._warned = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def budget(self) -> Optional[int]:
        """The budget plans are solved for: the block's runtime's, read as each pass starts
        (plans are cached per budget)."""
        return self.driver.rt.budget

    def attach(self, driver: "Driver") -> None:
        """Hook the segments' modules for the block ``driver`` runs."""
        self.driver = driver
        for seg in self.segments:
            for k, m in enumerate(seg.modules):
                self._handles.append(m.register_forward_pre_hook(self.locked(self._pre_hook(seg, k))))
                self._handles.append(m.register_forward_hook(self.locked(self._post_hook(seg, k))))

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
            for seg in self.segments:
                seg.drop_passes()
        self._callback_queued = False
        self.driver = None

    def plans(self, budget: Optional[int]) -> List[Dict[tuple, Optional[Plan]]]:
        """Per segment: input signature -> the plan solved for ``budget`` (None: the segment
        runs under plain DTR there)."""
        return [{sig: plan for (sig, b), plan in seg.plans.items() if b == budget} for seg in self.segments]

    def locked(self, hook: Callable[..., None]) -> Callable[..., None]:
        """``hook`` as module hooks, gradient hooks and autograd callbacks must run it: under
        the runtime's lock, and not at all once the block has ended. The backward pass can run
        after the block, and on autograd's threads: the driver is read again under the lock
        because ``detach`` may have run while this waited for it."""

        def run(*args: Any) -> None:
            d = self.driver
            if d is None:
                return
            with d.rt.lock:
                if self.driver is not None:
                    hook(*args)

        return run

    # ------------------------------------------------------------------ forward

    def _pre_hook(self, seg: Segment, k: int) -> Callable[..., None]:
        def pre(module, args):
            if not torch.is_grad_enabled():
                return
            if k == 0:
                self._begin(seg, _signature(args), args)
            p = seg.active
            if p is None:
                return
            if p.next != k:  # stages out of order: nothing more from this pass
                seg.active = None
                p.release()
                return
            p.stage_begins(k)

        return pre

    def _begin(self, seg: Segment, signature: Optional[tuple], args: tuple) -> None:
        seg.drop_passes()
        if self.budget is None or signature is None:
            return
        key = (signature, self.budget)
        if key not in seg.plans and signature in seg.profiles:
            chain, before, _ = seg.profiles[signature]
            seg.plans[key] = self.plan_for(chain, before)
        if key not in seg.plans:
            seg.active = ProfilePass(self, seg, signature, args)
        elif seg.plans[key] is not None:
            seg.active = ApplyPass(self, seg, signature, seg.plans[key])

    def _post_hook(self, seg: Segment, k: int) -> Callable[..., None]:
        def post(module, args, output):
            p = seg.active
            if p is not None and p.next == k:
                outs = list(dict.fromkeys(c.storage for c in cells_of(self.driver.rt, output)))
                p.stage_ends(k, args, output, outs)

        return post

    def plan_for(self, chain: Chain, before: int) -> Optional[Plan]:
        """The rotor plan of ``chain`` for what the budget leaves when ``before`` bytes are in
        use, or None (with a warning, once) where none fits."""
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

    # ------------------------------------------------------------------ what plans hold

    def hold(self, storages: List[Storage]) -> None:
        """Protect ``storages`` for a plan (``Runtime.protect``) until ``unhold`` or the block's end."""
        self.driver.rt.protect(storages)
        self._held.append(storages)

    def unhold(self, storages: List[Storage]) -> None:
        """Undo ``hold(storages)``, once (protections nest: a checkpoint is often in a tape)."""
        for i, h in enumerate(self._held):
            if h is storages:
                del self._held[i]
                self.driver.rt.unprotect(storages)
                return

    # ------------------------------------------------------------------ backward of applied passes

    def enter_backward(self, p: ApplyPass) -> None:
        """A stage of ``p`` begins its backward: what the engine makes from now on is protected
        (``Runtime.protect_new``) until the next stage's begins or ``p``'s backward ends."""
        if not self._callback_queued:  # one per backward pass, whatever the segments
            self._callback_queued = True
            at_backward_end(self.locked(self._backward_over))
        if p not in self._open:
            self._open.append(p)
        self._protecting = p
        self.driver.rt.protect_new(True)

    def leave_backward(self, p: ApplyPass) -> None:
        """The gradient of ``p``'s segment input exists: the backward of its first stage is over."""
        if p not in self._open:
            return
        p.finish()
        self._open.remove(p)
        if self._protecting is p:
            self._stop_protecting()

    def _backward_over(self) -> None:
        """End of a backward pass (autograd's queued callback)."""
        self._close_backward()
        self._callback_queued = False

    def _close_backward(self) -> None:
        for p in self._open:
            p.finish()
        self._open = []
        if self._protecting is not None:
            self._stop_protecting()

    def _stop_protecting(self) -> None:
        self._protecting = None
        self.driver.rt.protect_new(False)


def _signature(args: Sequence[Any]) -> Optional[tuple]:
    sig = tuple((tuple(a.shape), a.dtype, a.device.type) for a in args if isinstance(a, torch.Tensor))
    return sig or None
