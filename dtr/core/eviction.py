"""Eviction: which storage goes next when the budget is exceeded.

``Runtime._evict_to`` is one loop: it asks a search for the next victim and evicts it (or, with
a host tier, swaps it out when that is cheaper) until memory is under the target. A search has
``begin(resident, now, small_below, protected_from)``, called once per round, and ``pick()``,
the next victim or None when no candidate is left. Two searches find a victim of the same score:

- the candidate index (candidates.py, Note [Candidate index]), for heuristics that define
  ``key`` (every built-in) when there is no host tier: O(n) vectorized plus a few ``key``
  calls per eviction;
- ``Rescoring`` here, for any heuristic and for the swap-or-evict keys of a host tier: every
  candidate is scored once per round into a heap, and a popped candidate is re-scored and
  re-inserted if its score grew past the next one (sound because of the heuristic contract:
  evictions at a fixed clock only raise other scores). O(n log n) per round for n resident
  storages, plus O(k log n) re-checks for k evictions. Ties go to the lowest storage id.

Note [Eviction tiers]
~~~~~~~~~~~~~~~~~~~~~
Candidates are tried in tiers, and a storage's tier is ``tier`` (the only definition):

- ``ORDINARY`` first;
- then the last resorts ``PROTECTED`` (a plan keeps it: ``Runtime.protect``, and storages made
  in the window of ``Runtime.protect_new``; an access that had to rebuild a storage twice keeps
  it until it ends: Note [Rebuilt twice in one access] in rematerialize.py) and ``BACKWARD``
  (made in a backward pass, for life: Note [Gradients are a last resort]), searched together;
- ``SMALL`` last: storages under 1% of the mean resident size (``small_below``). Evicting one
  frees next to nothing, and recomputing one (a scalar loss, say) can take a long chain.

Among the last resorts, a loop's checkpoints go first, lowest rank first (Note [Loop
checkpoints]). Protection and being made in a backward pass outrank size: a small protected
storage is ``PROTECTED``, not ``SMALL``. With a host tier, the swap-or-evict search also takes
an ordinary storage that the previous block read within its prefetch lead of now as
``PROTECTED`` (Note [Needed soon] in host_tier.py): a rule of that search, which only a host
tier's log informs.

Note [Gradients are a last resort]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What a backward pass makes is gradients, and their lineage runs through the gradients before
them, which die as soon as they are consumed: recomputing one replays the backward pass down to
it, and the forward ops that pass read, where recomputing an activation replays forward ops
from the nearest resident ancestor. The heuristics cannot see the difference. In a backward
pass the dead forward pass and the dead gradients form one evicted neighbourhood, which every
candidate borders, so h_DTR^eq's cost term is the same for all of them and the oldest go first:
the gradients a multi-input node waits for (``nn.GRU``'s per-step input-gate gradients, all
read by one ``stack`` at the end; a tree node's children's). So what the program makes while
``Runtime.set_backward(True)`` is BACKWARD for life (``Storage.backward``): evicted only when
no storage of ordinary size can go. On the shipped traces this changes nothing for the
feed-forward models and saves recurrent ones from thrashing (docs/heuristics.md). Forward ops
that run inside a backward pass (``torch.utils.checkpoint`` recomputing a segment,
``torch.autograd.grad`` called by a hook) are marked too; their results are read within the
pass. It subsumes a plan's ``protect_new`` window over a stage's backward (Note [Seeding]):
what the stage made stays a last resort after the window.

Note [Loop checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~
A loop over time (an RNN cell called once per step) carries a state from step to step, and
its backward pass reads the states in reverse order. h_DTR^eq evicts by staleness first, so
under a tight budget it takes the states the forward pass made long ago, a run of them from the
first step on; each backward step then rebuilds its state from the start of the loop, and the
next step's room evicts the rebuilt ones again. On the bench ``LSTMCell`` loop at 0.3 of eager's
peak one replay rebuilt 902 storages (docs/heuristics.md). ``dtr.budget(loops=[cell])`` hands
the engine each call's inputs as checkpoints instead (``Runtime.checkpoint``): PROTECTED, so
ordinary storages go first, and when the budget forces a checkpoint out the one of the lowest
rank goes, the rank of call ``t`` being the number of times 2 divides ``t`` (call 0 ranks above
all). Odd calls go first, then those at 2 mod 4, and so on: the checkpoints left stay evenly
spread over the loop, every other one, then every fourth (online checkpointing by halving), so
a state is rebuilt from a checkpoint a bounded number of steps back, and what that replay
rebuilds stays for the steps after. Within a rank the heuristic's score decides; checkpoints go
before the other last resorts. Simulated at 0.3 of eager's peak, the bench ``LSTMCell`` and
``GRUCell`` loops run at 1.55x and 1.34x with it, 2.29x and 1.92x without (README).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from dtr.core.heuristics import Heuristic
from dtr.core.storage import RESIDENT, Storage
from dtr.errors import OutOfBudgetError

if TYPE_CHECKING:
    from dtr.core.runtime import Runtime

__all__ = ["BACKWARD", "ORDINARY", "PROTECTED", "Rescoring", "SMALL", "keyed", "out_of_budget", "tier"]

ORDINARY, PROTECTED, BACKWARD, SMALL = range(4)  # Note [Eviction tiers]

_NEVER = float("inf")  # the key of a candidate that can neither be evicted nor swapped


def keyed(heuristic: Any) -> bool:
    """Whether the candidate index may search for ``heuristic``: it defines ``key`` and derives
    its score from it (heuristics.py, Note [Keys])."""
    return callable(getattr(heuristic, "key", None)) and type(heuristic).score is Heuristic.score


def tier(s: Storage, small_below: float, protected_from: float) -> int:
    """``s``'s eviction tier (Note [Eviction tiers]); ``protected_from``: the first storage id
    of ``Runtime.protect_new``'s window."""
    if s.protected or s.sid >= protected_from:
        return PROTECTED
    if s.backward:
        return BACKWARD
    return SMALL if s.nbytes < small_below else ORDINARY


class Rescoring:
    """The heap search (module docstring). With a host tier, every resident unlocked storage is a
    candidate, keyed by the lower of its eviction and swap keys (Note [Swap or evict] in
    host_tier.py), and ``swaps`` tells which of the two the victim's key came from.

    Args:
        score: the heuristic's ``score(storage, now)``.
        host: the runtime's host tier, or None.
    """

    def __init__(self, score: Callable[[Storage, int], float], host: Optional[Any] = None,
                 checkpoints: Optional[Dict[int, int]] = None) -> None:
        self._score = score
        self._checkpoints = {} if checkpoints is None else checkpoints  # the runtime's: sid -> rank
        self._host = host
        self._key = score if host is None else self._swap_or_evict_key
        self._now = 0
        self._heap: list = []
        self._later: list = []  # the last resorts' heaps, popped from the end

    def begin(
        self, resident: Dict[Storage, None], now: int, small_below: float, protected_from: float
    ) -> None:
        self._now = now
        key, host = self._key, self._host
        soon = host.needed_soon if host is not None else None
        ranks = self._checkpoints
        heap: list = []
        small: list = []
        last: list = []
        ranked: Dict[int, list] = {}  # a loop's checkpoints, by rank (Note [Loop checkpoints])
        for s in resident:
            if s.locks == 0:
                rec = s.parent
                if (rec is not None and rec.replayable) or host is not None:
                    t = tier(s, small_below, protected_from)
                    if t == ORDINARY and soon is not None and soon(s.sid, now):
                        t = PROTECTED  # Note [Needed soon] in host_tier.py
                    row = (key(s, now), s.sid, s)
                    if t == ORDINARY:
                        heap.append(row)
                    elif t == SMALL:
                        small.append(row)
                    elif s.sid in ranks:
                        ranked.setdefault(ranks[s.sid], []).append(row)
                    else:
                        last.append(row)
        heapify(heap)
        self._heap = heap
        self._later = [small, last] + [ranked[r] for r in sorted(ranked, reverse=True)]

    def pick(self) -> Optional[Storage]:
        """The candidate with the lowest (key, sid) in the first tier that has one; None when
        no candidate is left. The caller evicts (or swaps out) it before the next ``pick``."""
        heap, key, now = self._heap, self._key, self._now
        while True:
            if not heap:
                if not self._later:
                    return None
                heap = self._heap = self._later.pop()
                heapify(heap)
                continue
            old, sid, s = heappop(heap)
            if s.state is not RESIDENT or s.locks:
                continue
            cur = key(s, now)
            if cur == _NEVER:
                continue
            if cur > old and heap and (cur, sid) > heap[0][:2]:
                heappush(heap, (cur, sid, s))
                continue
            return s

    def swaps(self, s: Storage) -> bool:
        """Whether the victim ``s`` is cheaper to swap out than to evict (with a host tier)."""
        swap = self._swap_key(s, self._now)
        return swap != _NEVER and swap < self._evict_key(s, self._now)

    def _swap_or_evict_key(self, s: Storage, now: int) -> float:
        """The lower of the heuristic's score (if ``s`` can be recomputed) and the swap's,
        transfer time per byte and staleness (if the host has room)."""
        return min(self._evict_key(s, now), self._swap_key(s, now))

    def _evict_key(self, s: Storage, now: int) -> float:
        return self._score(s, now) if s.recomputable else _NEVER

    def _swap_key(self, s: Storage, now: int) -> float:
        host = self._host
        if not host.fits(s.nbytes):
            return _NEVER
        return host.swap_cost(s.nbytes) / ((s.nbytes or 1) * (now - s.last_access + 1))


def out_of_budget(rt: Runtime, target: int, opname: str, best_effort: bool = False) -> OutOfBudgetError:
    """The error of a search that ran out of candidates before ``rt`` was down to ``target``,
    saying what holds the memory. Told to ``rt.events`` unless ``best_effort`` (a caller that
    catches it: no snapshot)."""
    locked = unrecomputable = from_backward = 0
    for s in rt.resident:
        if s.locks:
            locked += s.nbytes
        elif not s.recomputable:
            unrecomputable += s.nbytes
            if s.backward:
                from_backward += s.nbytes
    needed = locked + unrecomputable + rt.held_bytes + rt.outside
    # What a backward pass made and cannot recompute is mostly the running sums of gradients
    # (Note [Accumulation in place]), which eager holds too: saying so tells the user that the
    # model, not the heuristic, sets that part of the floor.
    why = (
        f"no replayable lineage; {from_backward} of them made by the backward pass, such as the "
        "running sums of the gradients of tensors used several times, which eager holds too"
        if from_backward
        else "no replayable lineage"
    )
    detail = (
        f"{locked} bytes are locked (inputs and outputs of the operations in flight), "
        f"{unrecomputable} bytes cannot be recomputed ({why}) and "
        f"{rt.held_bytes} bytes are gradients made in this block (charged until it ends)."
    )
    if rt.outside:
        detail += (
            f" Besides, {rt.outside} bytes outside the engine count against the total limit "
            "(dtr.budget(total=True)): tensors from before the block."
        )
    error = OutOfBudgetError(needed, target + rt.outside, opname, detail)
    if rt.events is not None and not best_effort:
        rt.events.out_of_budget(error, rt)
    return error
