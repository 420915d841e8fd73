"""Stateful property test of the torch-free runtime, driven directly with a fake executor.

Values are nested tuples that name how they were computed, so a rematerialized value can be
compared with the one the program saw first: a wrong replay, a lost mutation or a stale view
shows up as a different tuple. ``check_invariants()`` runs after every step.
"""

import gc

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from dtr.core import OpRecord, Runtime, make_heuristic
from dtr.core.events import holdings
from dtr.core.host_tier import HostTier
from dtr.errors import OutOfBudgetError


class FakeExecutor:
    """Replays records whose payload is a function of the input values."""

    def __init__(self):
        self.replays = 0
        self.forgotten = 0
        # Records whose constants are gone (Runtime.retire), by id; held so no id is reused.
        self.retired = {}

    def replay(self, rec):
        assert id(rec) not in self.retired, f"{rec.name} was retired and replayed"
        self.replays += 1
        return rec.payload([c.value for c in rec.inputs]), rec.cost

    def forget(self, rec):
        self.forgotten += 1


class Handle:
    """Stands for a tensor the program holds (a wrapper)."""

    def __init__(self, expected, path=()):
        self.expected = expected
        self.path = path  # view ops from the storage's root to this tensor
        self.ref = None


class RuntimeMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.ex = FakeExecutor()
        self.rt = Runtime(None, make_heuristic("dtr_eq"), self.ex)
        self.n = 0
        self.live = []  # handles the program holds
        self.metered = None  # the runtime the meters below are of
        self._watch_peaks()

    # -- helpers ---------------------------------------------------------------------------

    def cell(self, h):
        h.ref.cell = self.rt.resolve(h.ref.cell)
        return h.ref.cell

    def make(self, cell, expected, path=()):
        h = Handle(expected, path)
        h.ref = self.rt.track(h, cell)
        self.live.append(h)
        return h

    def run(self, inputs, payload, nbytes_list, name):
        """Acquire, 'run', complete: returns new handles, or None on OutOfBudgetError."""
        rt = self.rt
        cells = [self.cell(h) for h in inputs]
        try:
            rt.acquire(cells)
        except OutOfBudgetError:
            return None
        values = [c.value for c in cells]
        assert values == [h.expected for h in inputs], "acquire returned a wrong value"
        outs = payload(values)
        rec = OpRecord(name, cells, payload, cost=1.0 + len(nbytes_list))
        try:
            out_cells = rt.complete(rec, [], [(nb, v, None) for nb, v in zip(nbytes_list, outs)])
        except OutOfBudgetError:
            return None
        return [self.make(c, v) for c, v in zip(out_cells, outs)]

    # -- rules -----------------------------------------------------------------------------

    # Now and then a storage a hundred times larger, so that the others fall under the small
    # threshold (1% of the mean resident size) and the small tier is exercised too.
    @rule(target=handles, nbytes=st.one_of(st.integers(1, 64), st.integers(1, 64), st.just(6400)))
    def constant_op(self, nbytes):
        """An op with no managed inputs (a factory op, or an op on parameters)."""
        self.n += 1
        k = self.n
        out = self.run([], lambda vals, k=k: [("const", k)], [nbytes], f"const{k}")
        return out[0] if out else None

    @rule(target=handles, a=handles, b=handles, nbytes=st.integers(1, 64), two=st.booleans())
    def compute(self, a, b, nbytes, two):
        if a is None or b is None:
            return None
        self.n += 1
        k = self.n
        sizes = [nbytes, nbytes // 2 + 1] if two else [nbytes]

        def payload(vals, k=k, m=len(sizes)):
            return [("op", k, i, tuple(vals)) for i in range(m)]

        out = self.run([a, b], payload, sizes, f"op{k}")
        return out[0] if out else None

    @rule(target=handles, a=handles)
    def view(self, a):
        if a is None:
            return None
        rt = self.rt
        base = self.cell(a)
        try:
            rt.acquire([base])
        except OutOfBudgetError:
            return None
        self.n += 1
        k = self.n

        def payload(vals, k=k):
            return [("view", k, vals[0])]

        value = payload([base.value])[0]
        rec = OpRecord(f"view{k}", [base], payload, cost=0.1)
        (c,) = rt.complete(rec, [], [(0, value, base)])
        return self.make(c, value, a.path + (k,))

    @rule(a=handles, b=handles)
    def mutate(self, a, b):
        """a += b in place (a may be a view: the whole storage gets a new version)."""
        if a is None or b is None:
            return
        rt = self.rt
        ca, cb = self.cell(a), self.cell(b)
        if ca.storage is cb.storage:
            return
        root = ca.storage.root
        if ca is not root:
            return  # the fake executor only mutates roots; views of roots are covered by view()
        try:
            rt.before_write([root.storage])
            rt.acquire([root, cb])
        except OutOfBudgetError:
            return
        self.n += 1
        k = self.n

        def payload(vals, k=k):
            return [("mut", k, vals[0], vals[1])]

        new_value = payload([root.value, cb.value])[0]
        rec = OpRecord(f"mut{k}", [root, cb], payload, cost=1.0)
        rt.complete(rec, [(root.storage, new_value)], [])
        # Every handle over this storage sees the new version; a view's value follows its root.
        for h in self.live:
            if self.cell(h).storage is rt.resolve(root).storage:
                value = new_value
                for v in h.path:
                    value = ("view", v, value)
                h.expected = value

    @rule(a=handles)
    def access(self, a):
        if a is None:
            return
        c = self.cell(a)
        try:
            self.rt.acquire([c])
        except OutOfBudgetError:
            return
        assert c.value == a.expected, f"rematerialized {c.value!r}, expected {a.expected!r}"
        self.rt.unlock([c])

    @rule(a=consumes(handles))
    def release(self, a):
        if a is None or a not in self.live:
            return
        self.live.remove(a)
        del a
        gc.collect()
        self.rt.drain()

    @rule(on=st.booleans())
    def backward(self, on):
        """The program enters or leaves a backward pass: what it makes while in one is a last
        resort of eviction for good (Note [Gradients are a last resort])."""
        self.rt.set_backward(on)

    @rule(budget=st.one_of(st.none(), st.integers(0, 400), st.integers(6400, 7000)))
    def set_budget(self, budget):
        try:
            self.rt.set_budget(budget)
        except OutOfBudgetError:
            pass

    @rule(on=st.booleans())
    def protect(self, on):
        self.rt.protect_new(on)

    @rule(a=handles, on=st.booleans())
    def protect_storage(self, a, on):
        if a is None:
            return
        s = self.cell(a).storage
        self.rt.protect([s]) if on else self.rt.unprotect([s])

    @rule(a=handles, rank=st.sampled_from([0, 1, 2, 64]))
    def checkpoint(self, a, rank):
        """A loop's checkpoint (Note [Loop checkpoints]): protected, and among the last
        resorts evicted by rank."""
        if a is None:
            return
        self.rt.checkpoint([self.cell(a).storage], rank)

    @precondition(lambda self: self.live)
    @rule()
    def flush(self):
        try:
            self.rt.flush()
        except OutOfBudgetError:
            pass

    @rule(a=handles)
    def retire(self, a):
        """What a storage was computed from is freed (FSDP2 resharding): its parent op never
        runs again, and every handle must still read its value (checked at teardown)."""
        if a is None:
            return
        s = self.cell(a).storage
        rec = s.parent
        try:
            self.rt.retire([s])
        except OutOfBudgetError:
            return
        if rec is not None:
            self.ex.retired[id(rec)] = rec

    def _watch_peaks(self):
        """Meters of ``self.rt`` from its start (a subclass may replace it before any op:
        test_heuristics.py)."""
        if self.metered is not self.rt:
            self.metered = self.rt
            self.whole = self.rt.meter()  # open from the start: must read the runtime's peak
            self.meters = {}  # open PeakMeter -> the peak it read last
            self.stopped = {}  # stopped PeakMeter -> the peak it froze at

    @rule()
    def start_meter(self):
        self._watch_peaks()
        m = self.rt.meter()
        self.meters[m] = m.peak

    @precondition(lambda self: self.meters)
    @rule(data=st.data())
    def stop_meter(self, data):
        m = data.draw(st.sampled_from(sorted(self.meters, key=id)))
        del self.meters[m]
        self.stopped[m] = m.stop()

    @invariant()
    def invariants(self):
        self.rt.drain()
        self.rt.check_invariants()

    @invariant()
    def meters_read_their_peaks(self):
        """Other meters starting and stopping never change what one reads: the meter open since
        the start reads the runtime's peak, the others a rising value between the bytes
        charged now and that peak, and a stopped one what it read when it stopped."""
        self._watch_peaks()
        rt = self.rt
        assert self.whole.peak == rt.peak
        for m, last in self.meters.items():
            assert last <= m.peak and rt.memory <= m.peak <= rt.peak
            self.meters[m] = m.peak
        assert all(m.peak == frozen for m, frozen in self.stopped.items())

    def teardown(self):
        # At the end every handle the program holds must still read its expected value.
        rt = self.rt
        rt.set_budget(None)
        for h in self.live:
            c = self.cell(h)
            rt.acquire([c])
            assert c.value == h.expected
            rt.unlock([c])
        rt.close()


RuntimeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRuntime = RuntimeMachine.TestCase


class SwappingExecutor(FakeExecutor):
    """``FakeExecutor`` with a host tier whose copies out finish only when the runtime waits
    for them or the program lets time pass (``SwappingMachine.copies_finish``), as on a GPU's
    side stream. A handle is ``[value, done]``; ``waited`` counts the runtime's waits."""

    def __init__(self):
        super().__init__()
        self.in_flight = []
        self.waited = 0

    def swap_out(self, value):
        handle = [value, False]
        self.in_flight.append(handle)
        return handle

    @staticmethod
    def swap_done(handle):
        return handle[1]

    def swap_wait(self, handle):
        self.waited += 1
        handle[1] = True

    @staticmethod
    def swap_in(handle):
        return handle[0], 0.0

    @staticmethod
    def prefetch(handle):
        return handle[0], object()

    @staticmethod
    def arrive(pending):
        pass


class SwappingMachine(RuntimeMachine):
    """The runtime's stateful test with a host tier (``swap=True``): every candidate can be
    swapped out instead of evicted, at a bandwidth that makes swapping cheaper or dearer than
    recomputing, copies out finish late (Note [Copies in flight]), and a host limit now and
    then sends the rest to eviction. Swapped values come back as the program saw them
    (``access``, teardown), and the runtime's invariants count the copies in flight."""

    @initialize(bandwidth=st.sampled_from([4.0, 64.0, 1e6]), limit=st.sampled_from([None, 200]))
    def choose(self, bandwidth, limit):
        self.ex = SwappingExecutor()
        self.rt = Runtime(None, make_heuristic("dtr_eq"), self.ex, host=HostTier(bandwidth, limit))

    @rule()
    def copies_finish(self):
        for handle in self.ex.in_flight:
            handle[1] = True
        self.ex.in_flight.clear()


SwappingMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSwappingRuntime = SwappingMachine.TestCase


def _op(rt, inputs, nbytes, name, keep):
    """Run one op of ``nbytes`` on ``inputs``; its cell, held by a handle kept in ``keep``."""
    rec = OpRecord(name, inputs, lambda vals: [(name, tuple(vals))], cost=1.0)
    rt.acquire(inputs)
    (c,) = rt.complete(rec, [], [(nbytes, (name, tuple(i.value for i in inputs)), None)])
    h = Handle(c.value)
    h.ref = rt.track(h, c)
    keep[name] = h
    return c


def test_a_dead_storage_without_lineage_keeps_its_dependents_evictable():
    """``x`` lost its lineage (a flush) and dies while ``t = f(x)`` may need it: ``t`` stays
    recomputable, so writing ``t`` in place later costs nothing, and an 8-byte op fits in a
    16-byte budget by evicting. Cutting ``t`` instead (as after FSDP2 frees parameters,
    ``Runtime.retire``) would make ``u = g(t)`` permanent at the write: out of budget."""
    rt = Runtime(None, make_heuristic("dtr_eq"), FakeExecutor())
    keep = {}
    x = _op(rt, [], 8, "x", keep)
    rt.flush()
    t = _op(rt, [x], 8, "t", keep)
    u = _op(rt, [t], 8, "u", keep)
    rt.evict([u])
    del keep["x"]
    gc.collect()
    rt.drain()
    assert t.storage.recomputable
    rt.set_budget(16)
    rt.before_write([t.storage])
    rt.acquire([t])
    rt.complete(OpRecord("t+=1", [t], lambda v: [("inc", v[0])], cost=1.0), [(t.storage, ("inc", t.value))], [])
    _op(rt, [], 8, "w", keep)
    rt.check_invariants()
    rt.close()


def _write(rt, cell, name):
    """``cell += 1`` in place: a new version of its storage (Note [Versions])."""
    rt.before_write([cell.storage])
    rt.acquire([cell])
    rec = OpRecord(name, [cell], lambda vals: [(name, vals[0])], cost=1.0)
    rt.complete(rec, [(cell.storage, (name, cell.value))], [])
    return rt.resolve(cell)


def _versions(rt, keep):
    """``x`` written in place three times (four versions), the newest evicted and accessed
    again; ``keep`` holds the program's handles. Returns the versions, oldest first."""
    x = _op(rt, [], 8, "x", keep)
    versions = [x]
    for k in range(3):
        versions.append(_write(rt, versions[-1], f"w{k}"))
    return versions


def test_old_versions_are_evicted_once_their_successor_is_rebuilt():
    """Rebuilding the newest of four versions replays all four ops; the old versions go as
    each successor is back, as when the program wrote them in place: one storage's bytes are
    resident after the access, not four (Note [Old versions after a replay])."""
    ex = FakeExecutor()
    rt = Runtime(None, make_heuristic("dtr_eq"), ex)
    keep = {}
    versions = _versions(rt, keep)
    newest = versions[-1]
    rt.evict([newest.storage])
    rt.acquire([newest])
    assert newest.value == ("w2", ("w1", ("w0", ("x", ()))))
    rt.unlock([newest])
    assert ex.replays == 4
    assert [v.storage.state.name for v in versions] == ["EVICTED"] * 3 + ["RESIDENT"]
    assert rt.memory == 8
    rt.check_invariants()
    rt.close()


def test_an_old_version_stays_for_an_evicted_reader_the_program_holds():
    """``y = f(x)`` read the oldest version and is held, evicted: the oldest version, rebuilt
    on the way to the newest, stays resident, since ``y`` would need it again (the eager
    eviction rule); the middle ones go."""
    ex = FakeExecutor()
    rt = Runtime(None, make_heuristic("dtr_eq"), ex)
    keep = {}
    x = _op(rt, [], 8, "x", keep)
    y = _op(rt, [x], 8, "y", keep)
    versions = [x]
    for k in range(3):
        versions.append(_write(rt, versions[-1], f"w{k}"))
    rt.evict([y.storage, versions[-1].storage])
    rt.acquire([versions[-1]])
    rt.unlock([versions[-1]])
    assert [v.storage.state.name for v in versions] == ["RESIDENT", "EVICTED", "EVICTED", "RESIDENT"]
    rt.acquire([y])
    assert y.value == ("y", (("x", ()),))
    rt.unlock([y])
    rt.check_invariants()
    rt.close()


def test_an_old_version_made_permanent_stays():
    """An old version made permanent (its lineage cut) after its successor was written cannot
    be evicted when the successor is rebuilt: nothing could recompute it (Invariant 3)."""
    rt = Runtime(None, make_heuristic("dtr_eq"), FakeExecutor())
    keep = {}
    versions = _versions(rt, keep)
    rt.make_permanent([versions[1]])
    rt.evict([versions[-1].storage, versions[2].storage])
    rt.acquire([versions[-1]])
    rt.unlock([versions[-1]])
    assert [v.storage.state.name for v in versions] == ["RELEASED", "RESIDENT", "EVICTED", "RESIDENT"]
    rt.check_invariants()
    rt.close()


def test_a_peak_meter_reads_the_most_bytes_since_it_started():
    """A meter reads the most bytes charged since it started, however the runtime's own peak
    compares, and stops there; meters started later or stopped earlier change nothing."""
    rt = Runtime(None, make_heuristic("dtr_eq"), FakeExecutor())
    keep = {}
    big = _op(rt, [], 1000, "big", keep)
    del keep["big"], big
    gc.collect()
    rt.drain()
    assert (rt.memory, rt.peak) == (0, 1000)
    outer = rt.meter()
    _op(rt, [], 100, "a", keep)
    inner = rt.meter()
    assert (outer.peak, inner.peak) == (100, 100)
    _op(rt, [], 50, "b", keep)
    assert inner.stop() == 150
    _op(rt, [], 30, "c", keep)
    assert (outer.peak, inner.peak, rt.peak) == (180, 150, 1000)
    late = rt.meter()
    _op(rt, [], 900, "d", keep)
    assert (outer.stop(), late.stop(), rt.peak) == (1080, 1080, 1080)
    assert outer.stop() == 1080  # stopping twice changes nothing
    rt.close()


def test_an_old_version_stays_for_a_reader_a_replay_in_flight_needs():
    """``x = f(h)`` read the old version and the program dropped it; ``y = g(h', x)`` reads
    the new version and ``x``. Rebuilding ``y`` rebuilds ``h'`` first (an input order the
    program chose): the old version must stay for ``x``, which ``y``'s replay reads next, or
    it is replayed twice (found by review)."""
    for order in ("new first", "x first"):
        ex = FakeExecutor()
        rt = Runtime(None, make_heuristic("dtr_eq"), ex)
        keep = {}
        a = _op(rt, [], 8, "a", keep)
        h = _op(rt, [a], 8, "h", keep)
        x = _op(rt, [h], 8, "x", keep)
        new = _write(rt, h, "w")
        y = _op(rt, [new, x] if order == "new first" else [x, new], 8, "y", keep)
        del keep["x"]
        gc.collect()
        rt.drain()
        rt.evict([y.storage, x.storage, new.storage, h.storage])
        ex.replays = 0
        rt.acquire([y])
        rt.unlock([y])
        assert ex.replays == 4, (order, ex.replays)  # h, h', x, y: each once
        rt.check_invariants()
        rt.close()


def test_an_input_every_level_of_a_replay_chain_reads_is_rebuilt_at_most_twice():
    """``a_i = f(h_{i-1}, e)``, ``h_i = g(a_i)``, with a large, cheap ``e`` read at every level
    (an RNN's embedded sequence, read by each step's input projection): rebuilding ``h_12``
    from nothing replays the chain, and the budget leaves room for ``e`` and three states.
    h_DTR^eq's set of the dead states makes every state dearer per byte than ``e``, so without
    Note [Rebuilt twice in one access] each ``g`` evicted ``e`` (unlocked once ``f`` is done)
    and the next ``f`` rebuilt it; protected after its second rebuild, it stays. A replay
    that fails halfway through the chain ends the protection too."""
    for fail in (None, "a6"):
        _chain_reading_one_input(fail)


def _chain_reading_one_input(fail):
    ex = FakeExecutor()
    rt = Runtime(None, make_heuristic("dtr_eq"), ex)
    keep = {}
    e = _op(rt, [], 1000, "e", keep)
    h = _op(rt, [], 100, "h0", keep)
    for i in range(1, 13):
        a = _op(rt, [h, e], 100, f"a{i}", keep)
        h = _op(rt, [a], 100, f"h{i}", keep)
    for name in list(keep):
        if name != "h12":
            del keep[name]
    gc.collect()
    rt.drain()
    rt.evict(list(rt.resident))
    rt.set_budget(1300)
    rebuilt = []
    replay = ex.replay

    groups = {}

    def spy(rec):
        if rec.name == fail:
            raise RuntimeError("a kernel failed")
        if rec.name == "h5":  # e is kept (and unlocked): what explain() would show if the budget failed now
            groups.update((h.op, h.group) for h in holdings(rt))
            rt.protect([e.storage])  # a plan's protection too: that one shows
            groups["e with a plan"] = {h.op: h.group for h in holdings(rt)}["e"]
            rt.unprotect([e.storage])
        rebuilt.append(rec.name)
        return replay(rec)

    ex.replay = spy
    if fail:
        with pytest.raises(RuntimeError):
            rt.acquire([h])
        assert rebuilt.count("e") == 2, rebuilt
        ex.replay = replay  # the kernel works again: the block's end may rebuild h_12
    else:
        rt.acquire([h])
        assert h.value[0] == "h12"
        rt.unlock([h])
        assert rebuilt.count("e") == 2, rebuilt
        assert len(rebuilt) == 2 + 2 * 12 + 1  # e twice, each level once, h0
    assert e.storage.protected == 0 and not rt.kept_by_access  # the protection ends with the access
    assert e.storage.state.name == "RESIDENT" and groups["e"] == "activations"  # not "protected by a plan"
    assert groups["e with a plan"] == "protected by a plan"
    rt.check_invariants()
    rt.close()
