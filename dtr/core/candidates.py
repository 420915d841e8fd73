"""The candidate index: the runtime's incremental search for the storage to evict (every
candidate is bounded, none is sampled; the victim's score is the lowest to a relative 1e-5).

Note [Candidate index]
~~~~~~~~~~~~~~~~~~~~~~
The h_DTR family divides a key by staleness, and staleness grows with the clock for every
storage at once, at different rates relative to each other: no order of the candidates stays
sorted from one op to the next, so a sorted container would have to be re-sorted, or bounded
loosely, at every op. The index instead keeps one row per resident storage in float32 numpy
arrays (a lower bound of its key, and the last access that bound assumes), and an eviction
round computes a lower bound of every score at the current clock in one vectorized pass (two
array operations: about 5 µs for 10,000 rows on the project's 2-core VM). It then examines rows
in order of that bound: an examined row gets its exact key and score from the heuristic and
goes into a small heap; the round's victim is the heap's top once no unexamined bound can
match it. Often two rows are examined per eviction; many more where rows are parked, set aside
or loosely bounded (Note [Examination order]).

The bounds stay lower bounds with no work on the per-op hot path:

- a storage's last access only grows, and an access makes it *less* evictable: the cached one
  is older;
- keys may grow at any time (neighbours evicted): the cached one is lower;
- keys that can drop are reported by the heuristic (``lowered()``, heuristics.py Note [Keys]):
  the listed storages fall back to their ``floor``, and every other bound is lowered by the
  reported slack in one more vectorized pass;
- storages that became resident since the last round are the tail of the runtime's
  insertion-ordered ``resident`` dict; the runtime clears a storage's row when it evicts it
  (``drop``), so a rematerialized storage reads as new.

Exactness: the victim's score (the heuristic's own, ``key / staleness`` in float64) is the
lowest of all candidates', up to a relative ``_TOL`` (1e-5): float32 only orders the
examination, and an unexamined row is skipped once its bound is no lower than the best exact
score less that margin, which is far above float32's rounding (slack is rounded up too). Among
candidates that close (ties above all: LRU's clock, equal sizes for "size"), the lowest storage
id among those examined wins; requiring the lowest id of *all* tied candidates would examine
every one of them: milliseconds per eviction for "size" on models whose activations share a
shape. A brute-force scan therefore agrees on the score, not always on the storage. Within a
round (fixed clock) an examined score only rises as others are evicted (the scoring contract),
so the heap's entries stay lower bounds and its top is re-scored before it wins a later pick.

Inactive rows hold +inf: free slots; storages that cannot be recomputed ("dead", until they
leave memory); locked storages found while examining ("parked": re-checked at each round start,
so long-held locks cost O(locks) per round); and the last resorts of Note [Eviction tiers]
(eviction.py), scanned only when no ORDINARY storage can go: SMALL storages ("stashed", scanned
last), PROTECTED ones ("protected": re-checked at each round start, back to their tier once the
window has moved past them and ``Runtime.unprotect`` named them, or the access that kept them
ended (Note [Rebuilt twice in one access]); a row protected while active moves when examined,
before it can be picked), and BACKWARD ones ("gradients": scanned with the protected ones,
never re-checked, since a storage stays BACKWARD until it leaves memory).

A runtime driven by the native path (eager/native.py) searches with hotpath.c's ``ordinary``,
the statement-for-statement twin of ``_ordinary`` (h_DTR^eq's ``key`` in C too);
tests/test_native.py checks that both evict the same storages in the same order.

Note [Examination order]
~~~~~~~~~~~~~~~~~~~~~~~~
Within a round the bounds at the current clock (``_buf``) change only as rows are examined,
each set to +inf as it is taken, so the rows come up in the order of a sort by (bound, slot):
the order in which repeated ``argmin`` calls (the first of equal bounds) would find them. A
round that examines few rows finds each with ``argmin`` (one vectorized pass, a few µs for
tens of thousands of rows); past ``_ARGMINS`` of them, the round sorts the next rows of that
order in chunks (``_sort_next``: a partition and a sort of the chunk, each chunk twice the last)
and reads them off one by one. The batched TreeLSTM at 0.67 of its peak examined 12 rows per
eviction on average, 143,000 in a step, most of them in rounds of thousands: parked, protected
and small rows, and rows whose loose bounds lie below their exact scores. Both ways give the
same rows in the same order; only the cost differs.

Complexity per eviction round over n rows: O(n) vectorized, plus O(k log k) Python for the k
rows examined (and O(n log k) vectorized for their order) and one ``key`` per row registered,
lowered, unparked, unstashed or unprotected, plus O(protected rows) per round to re-check them:
the few a plan holds, and what a long replay chain keeps, which can be a few hundred rows.
"""

from __future__ import annotations

from heapq import heappop, heappush
from itertools import chain
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np

from dtr.core.eviction import BACKWARD, ORDINARY, PROTECTED, SMALL, tier
from dtr.core.storage import RESIDENT, Storage

__all__ = ["CandidateIndex"]

_INF = float("inf")
_F32_MAX = float(np.finfo(np.float32).max)
# Relative margin between a float32 bound and an exact float64 score: float32 rounds to 2^-24
# (about 6e-8) per operation, and a bound goes through two.
_TOL = 1e-5
# Slack is applied rounded up by this factor, so that float32 rounding cannot leave a lowered
# bound above the true key.
_SLACK_UP = 1.0 + 2.0**-20
# Last accesses are stored relative to a base clock, rebased before they lose float32's
# integer precision (2^24).
_REBASE = 1 << 22
# Note [Examination order]: rows a round finds by argmin before it sorts them in chunks (a
# chunk costs about as much as 15-20 argmins at any size), and its first chunk's size.
_ARGMINS = 16
_FIRST_CHUNK = 64
_NO_ROWS = np.empty(0, np.intp)


def _margin(score: float) -> float:
    """The bound at or above which an unexamined row cannot beat ``score`` by more than
    ``_TOL`` (relative)."""
    if score - score != 0.0:  # +-inf or nan: no margin to take
        return score
    return score - abs(score) * _TOL


class CandidateIndex:
    """Rows of per-storage bounds, over which an eviction round finds the lowest score.

    The runtime calls ``begin`` once per eviction round, then ``pick`` for each victim, and
    ``drop`` whenever it evicts a storage that has a row (``storage.slot``).

    Args:
        heuristic: one that defines ``key`` (heuristics.py, Note [Keys]).
        ordinary: the native twin of ``_ordinary`` (hotpath.c's ``ordinary``, which a driver
            whose native path is on hands the runtime), or None for the Python one.
    """

    def __init__(self, heuristic, ordinary: Optional[Callable[["CandidateIndex"], Optional[Storage]]] = None,
                 checkpoints: Optional[Dict[int, int]] = None) -> None:
        self._key = heuristic.key
        self._checkpoints = {} if checkpoints is None else checkpoints  # the runtime's: sid -> rank
        self._native = ordinary
        self._staleness = bool(getattr(heuristic, "staleness", True))
        self._lowered = getattr(heuristic, "lowered", None)
        floor = getattr(heuristic, "floor", None)
        self._floor = floor if floor is not None else (lambda s: -_INF)
        self._rows: List[Optional[Storage]] = []  # slot -> storage
        self._free: List[int] = []
        self._used = 0
        # Per slot, float32: lower bound of the key (+inf: inactive), heuristic's floor of the
        # key (+inf: inactive), last access minus ``_base``, 1 / max(nbytes, 1) (for slack).
        self._bound = np.empty(0, np.float32)
        self._floors = np.empty(0, np.float32)
        self._la = np.empty(0, np.float32)
        self._inv = np.empty(0, np.float32)
        self._buf = np.empty(0, np.float32)
        self._base = 0
        self._parked: Dict[int, Storage] = {}
        self._stashed: Dict[int, Storage] = {}
        self._stash_max = 0  # no stashed storage is larger
        self._protected: Dict[int, Storage] = {}
        self._protected_from: float = _INF  # storages with a sid from this one on are protected
        # Storages made in a backward pass: the protected tier for life, never re-checked.
        self._gradients: Dict[int, Storage] = {}
        self._started = False
        # The current round: its clock, small-storage threshold, pick count, and the heap of
        # examined candidates: (score, sid, slot, pick it was scored in).
        self._now = 0
        self._small_below = 0.0
        self._picks = 0
        self._checked: list = []
        # The round's examination order (Note [Examination order]): rows taken by argmin, and
        # the sorted chunk being read (``_order[_pos:]``) and the next chunk's size.
        self._argmins = 0
        self._order = _NO_ROWS
        self._pos = 0
        self._chunk = _FIRST_CHUNK
        self._grow()

    # ------------------------------------------------------------------ rounds

    def begin(self, resident: Dict[Storage, None], now: int, small_below: float,
              protected_from: float = _INF) -> None:
        """Start an eviction round at clock ``now``: bring the rows up to date with what
        happened since the last round, and bound every score. ``resident`` is the runtime's
        insertion-ordered resident set; ``small_below`` and ``protected_from`` place storages
        in their tiers (``eviction.tier``)."""
        self._now = now
        self._small_below = small_below
        self._protected_from = protected_from
        self._checked = []
        self._picks = 0
        self._argmins, self._order, self._pos, self._chunk = 0, _NO_ROWS, 0, _FIRST_CHUNK
        if now - self._base > _REBASE:
            np.subtract(self._la, np.float32(now - self._base), out=self._la)
            self._base = now
        lowered = self._lowered() if self._lowered is not None else ([], 0.0)
        if self._started:
            if lowered is None:  # anything may have dropped: back to the floors
                np.copyto(self._bound, self._floors)
            else:
                touched, slack = lowered
                if touched:
                    self._touch(touched)
                if slack > 0.0:
                    self._apply_slack(slack)
        self._started = True
        new = []
        for s in reversed(resident):
            if s.slot is not None:
                break
            new.append(s)
        for s in reversed(new):  # oldest first: a failing key leaves a suffix unregistered
            self._add(s)
        if self._parked:
            self._unpark()
        if self._protected:
            self._unprotect()
        if self._stashed and small_below <= self._stash_max:
            self._unstash()
        if self._used > 2 * len(resident) + 1024:
            self._sweep()
        buf = self._buf
        if self._staleness:
            np.subtract(np.float32(now + 1 - self._base), self._la, out=buf)
            np.divide(self._bound, buf, out=buf)
        else:
            np.copyto(buf, self._bound)

    def pick(self) -> Optional[Storage]:
        """The round's next victim: a candidate (resident, unlocked, recomputable) with the
        lowest score (Note [Candidate index]: up to ``_TOL``) in the first tier that has one
        (Note [Eviction tiers]); None if there is no candidate. The caller evicts it before the
        next ``pick``."""
        self._picks += 1
        s = self._ordinary() if self._native is None else self._native(self)
        if s is not None:
            return s
        # A small storage stashed before it was protected stays in the stash: it counts as
        # protected here.
        flagged = [
            (slot, t)
            for slot, t in self._stashed.items()
            if tier(t, self._small_below, self._protected_from) == PROTECTED
        ]
        s = self._best_of(chain(self._protected.items(), self._gradients.items(), flagged))
        return s if s is not None else self._best_of(self._stashed.items())

    def _ordinary(self) -> Optional[Storage]:
        """The pick's candidate with the lowest score among the active rows (ORDINARY ones), or
        None when no row is active. hotpath.c's ``ordinary`` mirrors it statement for
        statement, with ``_examine``'s scoring of an ORDINARY row and h_DTR^eq's ``key``."""
        buf, checked, rows = self._buf, self._checked, self._rows
        while True:
            # The unexamined row with the lowest bound (Note [Examination order]).
            if self._pos < len(self._order):
                i = int(self._order[self._pos])
            elif self._argmins < _ARGMINS:
                i = int(buf.argmin())
            else:
                self._sort_next()
                i = int(self._order[0])
            lb = float(buf[i])
            if checked:
                score, _sid, slot, when = checked[0]
                if lb == _INF or lb >= _margin(score):
                    heappop(checked)
                    if when == self._picks:
                        return rows[slot]
                    self._examine(slot)  # scored before this round's last eviction: re-score
                    continue
            elif lb == _INF:
                return None
            buf[i] = _INF
            if self._pos < len(self._order):
                self._pos += 1
            else:
                self._argmins += 1
            self._examine(i)

    def _sort_next(self) -> None:
        """The next chunk of the round's examination order: the unexamined rows with the lowest
        bounds, by (bound, slot), every row tied with the chunk's last included; one row, of
        bound +inf, when no bound is finite (Note [Examination order])."""
        buf = self._buf
        k = self._chunk
        self._chunk = 2 * k
        below = np.flatnonzero(buf < _INF)
        if k < len(below):
            kth = np.partition(buf[below], k - 1)[k - 1]
            below = below[buf[below] <= kth]
        if len(below):
            self._order = below[np.argsort(buf[below], kind="stable")]  # stable: slot order in ties
        else:
            self._order = np.array([int(buf.argmin())], np.intp)
        self._pos = 0

    def drop(self, s: Storage) -> None:
        """``s`` (which has a row) leaves memory: free its row. O(1)."""
        self._free_row(s.slot)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ rows

    def _examine(self, slot: int) -> None:
        """Score the row at ``slot`` exactly into the round's heap, or set it aside."""
        s = self._rows[slot]
        if s is None or s.slot != slot or s.state is not RESIDENT:
            self._free_row(slot)
            return
        t = tier(s, self._small_below, self._protected_from)
        if t == BACKWARD:
            self._gradient(slot, s)
        elif t == PROTECTED:  # protected while it had a row
            self._protect(slot, s)
        elif s.locks:
            self._parked[slot] = s
            self._deactivate(slot)
        elif not self._recomputable(s):
            self._deactivate(slot)  # dead: stays registered until it leaves memory
        elif t == SMALL:
            self._stash(slot, s)
        else:
            k = self._key(s)
            la = s.last_access
            self._bound[slot] = min(k, _F32_MAX)
            self._la[slot] = la - self._base
            score = k / (self._now - la + 1) if self._staleness else k
            heappush(self._checked, (score, s.sid, slot, self._picks))

    def _add(self, s: Storage) -> None:
        """Give a storage that became resident a row (with an exact bound)."""
        if not self._free:
            self._grow()
        t = tier(s, self._small_below, self._protected_from)
        active = t == ORDINARY and self._recomputable(s)
        if active:  # before taking a slot: a key that raises leaves nothing half done
            key, floor = self._key(s), self._floor(s)
        slot = self._free.pop()
        self._rows[slot] = s
        s.slot = slot
        self._used += 1
        if t == BACKWARD:
            self._gradient(slot, s)
        elif t == PROTECTED:
            self._protect(slot, s)
        elif active:
            self._set(slot, s, key, floor)
        elif self._recomputable(s):
            self._stash(slot, s)
        # else dead from the start: inactive until it leaves memory

    def _activate(self, slot: int, s: Storage) -> None:
        """Make an inactive row of a resident storage active again, with an exact bound."""
        self._set(slot, s, self._key(s), self._floor(s))

    def _set(self, slot: int, s: Storage, key: float, floor: float) -> None:
        self._bound[slot] = min(key, _F32_MAX)
        self._floors[slot] = min(floor, _F32_MAX)
        self._la[slot] = s.last_access - self._base
        self._inv[slot] = 1.0 / (s.nbytes or 1)

    def _deactivate(self, slot: int) -> None:
        self._bound[slot] = _INF
        self._floors[slot] = _INF

    def _free_row(self, slot: int) -> None:
        s = self._rows[slot]
        self._rows[slot] = None
        self._deactivate(slot)
        self._free.append(slot)
        self._used -= 1
        self._parked.pop(slot, None)
        self._stashed.pop(slot, None)
        self._protected.pop(slot, None)
        self._gradients.pop(slot, None)
        if s is not None and s.slot == slot:
            s.slot = None

    def _grow(self) -> None:
        n = len(self._rows)
        m = max(256, 2 * n)
        self._bound = np.concatenate([self._bound, np.full(m - n, _INF, np.float32)])
        self._floors = np.concatenate([self._floors, np.full(m - n, _INF, np.float32)])
        self._la = np.concatenate([self._la, np.zeros(m - n, np.float32)])
        self._inv = np.concatenate([self._inv, np.ones(m - n, np.float32)])
        self._buf = np.empty(m, np.float32)
        self._rows.extend([None] * (m - n))
        self._free.extend(range(m - 1, n - 1, -1))  # lowest slot first

    @staticmethod
    def _recomputable(s: Storage) -> bool:
        rec = s.parent
        return rec is not None and rec.replayable

    # ------------------------------------------------------------------ catching up

    def _touch(self, storages: Iterable[Storage]) -> None:
        """The keys of ``storages`` may have dropped: fall back to their floors."""
        rows = self._rows
        n = len(rows)
        slots = [
            slot
            for s in storages
            if (slot := s.slot) is not None and slot < n and rows[slot] is s
        ]
        if slots:
            self._bound[slots] = self._floors[slots]  # inactive rows: +inf stays

    def _apply_slack(self, slack: float) -> None:
        """Every key may have dropped by ``slack / max(nbytes, 1)``."""
        drop = np.multiply(self._inv, np.float32(min(slack * _SLACK_UP, 1e30)))
        np.subtract(self._bound, drop, out=self._bound)  # inactive rows: +inf stays
        np.maximum(self._bound, self._floors, out=self._bound)

    def _unpark(self) -> None:
        for slot, s in list(self._parked.items()):
            if self._rows[slot] is not s or s.state is not RESIDENT:
                self._free_row(slot)
            elif not s.locks:
                self._activate(slot, s)
                del self._parked[slot]

    def _stash(self, slot: int, s: Storage) -> None:
        self._stashed[slot] = s
        self._deactivate(slot)
        if s.nbytes > self._stash_max:
            self._stash_max = s.nbytes

    def _unstash(self) -> None:
        """The small threshold fell below some stashed storages: activate them again."""
        top = 0
        for slot, s in list(self._stashed.items()):
            if self._rows[slot] is not s or s.state is not RESIDENT:
                self._free_row(slot)
            elif s.nbytes >= self._small_below:
                self._activate(slot, s)
                del self._stashed[slot]
            elif s.nbytes > top:
                top = s.nbytes
        self._stash_max = top

    def _protect(self, slot: int, s: Storage) -> None:
        self._protected[slot] = s
        self._deactivate(slot)

    def _gradient(self, slot: int, s: Storage) -> None:
        self._gradients[slot] = s
        self._deactivate(slot)

    def _unprotect(self) -> None:
        """Rows no longer protected (the window moved past them, ``Runtime.unprotect`` named
        them) go back to their tier. O(protected rows) per round, like parked ones."""
        for slot, s in list(self._protected.items()):
            if self._rows[slot] is not s or s.state is not RESIDENT:
                self._free_row(slot)
            else:
                t = tier(s, self._small_below, self._protected_from)
                if t != PROTECTED:
                    del self._protected[slot]
                    self._restore(slot, s, t)

    def _restore(self, slot: int, s: Storage, t: int) -> None:
        """A row that left the protected tier: to its tier ``t``."""
        if t == BACKWARD:
            self._gradient(slot, s)
        elif not self._recomputable(s):
            return  # dead: inactive until it leaves memory
        elif t == SMALL:
            self._stash(slot, s)
        else:
            self._activate(slot, s)  # locked: parked when examined

    def _best_of(self, rows: Iterable[tuple]) -> Optional[Storage]:
        """A last resort: the best candidate among ``rows`` ((slot, storage) pairs of the
        protected or the stashed tier), by a scan (rare: nothing in an earlier tier can go):
        a loop's checkpoint of the lowest rank first (Note [Loop checkpoints] in eviction.py),
        then the lowest score."""
        best = None
        now = self._now
        ranks = self._checkpoints
        for slot, s in list(rows):
            if self._rows[slot] is not s or s.state is not RESIDENT:
                self._free_row(slot)
            elif not s.locks and self._recomputable(s):
                rank = ranks.get(s.sid, _INF)
                if best is not None and rank > best[0][0]:
                    continue  # cannot win: no need to score it
                k = self._key(s)
                score = k / (now - s.last_access + 1) if self._staleness else k
                order = (rank, score, s.sid)
                if best is None or order < best[0]:
                    best = (order, s)
        return None if best is None else best[1]

    def _sweep(self) -> None:
        """Free the rows of storages that left memory without being evicted (released,
        handed out) and never came up in a round since."""
        for slot, s in enumerate(self._rows):
            if s is not None and (s.slot != slot or s.state is not RESIDENT):
                self._free_row(slot)

    # ------------------------------------------------------------------ tests

    def check(self, resident: Iterable[Storage]) -> None:
        """Assert that rows and storages agree. O(rows); for tests."""
        for s in resident:
            if s.slot is not None:
                assert self._rows[s.slot] is s, f"{s} names slot {s.slot}, which holds another"
        used = sum(1 for s in self._rows if s is not None)
        assert used == self._used, f"{used} rows in use, {self._used} counted"
        assert len(set(self._free)) == len(self._free) == len(self._rows) - used, "free list"
        for slot in self._free:
            assert self._rows[slot] is None and self._bound[slot] == _INF, f"free slot {slot}"
        for slot in list(self._parked) + list(self._stashed) + list(self._protected) + list(self._gradients):
            assert self._bound[slot] == _INF and self._floors[slot] == _INF, f"slot {slot} active"
