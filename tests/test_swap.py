"""``dtr.budget(..., swap=True)``: swapping to the host tier as an alternative to eviction.

On CPU the host tier is a separate copy of the data; everything but the overlap of copies with
compute is exercised here. A very high bandwidth makes swapping cheaper than any recomputation,
a very low one makes it dearer, so that tests can steer the choice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dtr
from dtr.eager import host_copies
from dtr.core import OpRecord, Runtime, make_heuristic
from dtr.core.host_tier import HostTier
from dtr.sim import load
from dtr.sim.simulator import _DATA, SimExecutor, _Wrapper
from dtr.sim.trace import Trace
from dtr.testing import zoo
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step

from conftest import DEVICE, workload
from test_runtime_stateful import SwappingExecutor

FAST = 1e15  # bytes/s: swapping costs next to nothing
SLOW = 1.0  # bytes/s: swapping costs more than any recomputation


def _peak(w):
    return run_step(w, fresh_model(w), None, cost="estimate").stats.peak_resident_bytes


@pytest.mark.parametrize("name", zoo.MODELS)
def test_swapping_gives_eager_gradients(name, request):
    if name == "lstm" and DEVICE.type == "cuda":  # test_zoo.py's docstring: one op needs more
        request.applymarker(pytest.mark.xfail(raises=dtr.OutOfBudgetError, strict=True))
    w = workload(name)
    eager = run_step(w, fresh_model(w), "eager")
    tracked = run_step(w, fresh_model(w), None, cost="estimate").stats
    got = run_step(w, fresh_model(w), budget_at(tracked, 0.4), cost="estimate", swap=True, bandwidth=FAST)
    assert_same(got, eager)
    s = got.stats
    assert s.swaps_out > 0 and s.swaps_in + s.prefetches > 0
    assert s.swap_bytes_out > 0 and s.host_peak_bytes > 0


def test_the_cheaper_of_swap_and_recompute_is_chosen():
    w = zoo.build("mlp", "tiny")
    budget = int(_peak(w) * 0.4)
    slow = run_step(w, fresh_model(w), budget, cost="estimate", swap=True, bandwidth=SLOW).stats
    plain = run_step(w, fresh_model(w), budget, cost="estimate").stats
    assert slow.swaps_out == 0 and slow.evictions == plain.evictions
    fast = run_step(w, fresh_model(w), budget, cost="estimate", swap=True, bandwidth=FAST).stats
    assert fast.swaps_out > 0 and fast.rematerializations < plain.rematerializations


def _held_after_a_flush(budget, **options):
    """Tensors the program holds across ``optimizer.step()`` lose their lineage (they can no
    longer be recomputed); then the step makes a tensor that does not fit beside them."""
    x = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)

    def program():
        held = [x @ w.detach() + i for i in range(8)]
        (x @ w).sum().backward()
        opt.step()  # the lineage of everything held is cut here
        torch.manual_seed(0)
        big = torch.randn(64, 3 * 64)
        return big.sum() + sum(h.sum() for h in held)

    with torch.no_grad():
        w0 = w.detach().clone()
    expected = program()
    with torch.no_grad():
        w.copy_(w0)
    w.grad = None
    with dtr.budget(budget, cost="estimate", **options) as engine:
        total = program()
    return total, expected, engine.stats()


def test_only_swapping_can_hold_tensors_that_cannot_be_recomputed():
    budget = 10 * 64 * 64 * 4  # the 8 held tensors fit, not with 3 more beside them
    with pytest.raises(dtr.OutOfBudgetError):
        _held_after_a_flush(budget)
    total, expected, stats = _held_after_a_flush(budget, swap=True, bandwidth=FAST)
    assert torch.equal(dtr.materialize(total), expected)
    assert stats.swaps_out > 0 and stats.swaps_in > 0


def test_host_limit_is_respected_then_evicting_takes_over():
    w = zoo.build("mlp", "tiny")
    eager = run_step(w, fresh_model(w), "eager")
    budget = int(_peak(w) * 0.4)
    limit = 64 * 1024
    got = run_step(w, fresh_model(w), budget, cost="estimate", swap=True, bandwidth=FAST, host_limit=limit)
    assert_same(got, eager)
    assert 0 < got.stats.host_peak_bytes <= limit
    assert got.stats.evictions > 0
    with pytest.raises(ValueError, match="host_limit"):
        dtr.budget(budget, swap=True, host_limit="lots")
    with pytest.raises(ValueError, match="swap"):
        dtr.budget(budget, host_limit=limit)  # host_limit without swap=True


def test_prefetch_reduces_synchronous_swap_ins_on_the_next_step():
    w = zoo.build("transformer", "tiny")
    eager = run_step(w, fresh_model(w), "eager")
    model = fresh_model(w)
    engine = dtr.budget(int(_peak(w) * 0.4), cost="estimate", swap=True, bandwidth=FAST)
    per_step = []
    for _ in range(4):
        before = engine.stats()
        got = run_step(w, model, engine)
        assert_same(got, eager)
        after = engine.stats()
        per_step.append((after.swaps_in - before.swaps_in, after.prefetches - before.prefetches))
    (sync1, pre1), *later = per_step
    assert pre1 == 0 and sync1 > 0
    # Every later step, not only the second: a step whose prefetches all arrived in time swaps
    # nothing in synchronously, and the one after it learns from its prefetches.
    for sync, pre in later:
        assert pre > 0 and sync < sync1, per_step


def test_a_prefetch_with_no_room_when_due_waits_for_room_and_pays_for_being_late():
    # The bench LSTM's trace, two identical steps at 0.4 of peak and 50 GB/s: when some
    # prefetches fall due the budget is full. They wait for the room later ops free, and the
    # part of a transfer that the ops left before its need no longer cover counts as a stall:
    # here most of it. Of the first step's 16 swap-ins the second step prefetches 13. The other
    # 3 (the earlier layers' final hidden states, read by the `stack` after the fourth layer)
    # it keeps: the room made before that layer falls within their prefetch lead, where they
    # are a last resort (Note [Needed soon]); picked as the stalest, they would come back
    # synchronously.
    trace = load(Path(__file__).resolve().parent.parent / "benchmarks" / "traces" / "lstm.jsonl.gz")
    one, two = Trace(trace.header, trace.blocks[:1]), Trace(trace.header, trace.blocks[:1] * 2)
    budget = int(dtr.simulate(one, None).peak_bytes * 0.4)
    first = dtr.simulate(one, budget, swap=True, bandwidth=50e9)
    both = dtr.simulate(two, budget, swap=True, bandwidth=50e9)
    assert first.swaps_in == 16 and first.prefetches == 0
    assert both.swaps_in - first.swaps_in == 0
    assert both.prefetches - first.prefetches == first.swaps_in - 3
    assert both.swaps_out - first.swaps_out == first.swaps_out - 3
    assert 0 < both.swap_stall - first.swap_stall < first.swap_stall
    assert both.peak_bytes <= budget


@pytest.mark.parametrize("bandwidth", [FAST, 1e9, 1e8])
@pytest.mark.parametrize("name", zoo.MODELS)
def test_a_prefetched_value_is_read_only_after_it_arrives(name, bandwidth, monkeypatch):
    # On a GPU a prefetch's copy lands while later ops run, and reading its buffer before the
    # engine orders the read after the copy (Note [Arrival]) reads garbage. Here the CPU
    # prefetch's buffer is poisoned until it arrives, so any read path that skips the arrival
    # shows as a wrong gradient. Slower links mix evictions (and replays that read prefetched
    # inputs) with swaps.
    real = host_copies.prefetch

    def poisoned(copy):
        value, pending = real(copy)
        value.untyped_storage().fill_(255)  # NaN as floats, -1 as integers
        return value, pending

    monkeypatch.setattr(host_copies, "prefetch", poisoned)
    w = zoo.build(name, "tiny")
    eager_model, model = fresh_model(w), fresh_model(w)
    engine = dtr.budget(int(_peak(w) * 0.4), cost="estimate", swap=True, bandwidth=bandwidth)
    for _ in range(3):  # running statistics change step by step: eager takes the same steps
        assert_same(run_step(w, model, engine), run_step(w, eager_model, "eager"))
    assert engine.stats().prefetches > 0 or engine.stats().swaps_in == 0  # nothing came back


class _Arrivals(SimExecutor):
    """The simulator's executor, counting arrivals."""

    def __init__(self) -> None:
        self.arrived = 0

    def arrive(self, pending) -> None:
        self.arrived += 1


def _block(previous, reads_x, end=None):
    """One block on the torch-free engine: X is made, swapped out by P and Q, then read at
    clock 9 by an op (``reads_x="op"``), by a plain read (``"read"``: ``dtr.materialize``'s
    path) or not (``None``: another op makes R instead); ``end(rt, held)`` instead of dropping
    X and closing. Returns its log and counts."""
    rt = Runtime(100, make_heuristic("dtr_eq"), _Arrivals(), host=HostTier(1e3, None, previous))
    held, cells = {}, {}

    def op(name, nbytes, inputs=(), keep=True):
        ins = [cells[i] for i in inputs]
        rt.acquire(ins)
        (cells[name],) = rt.complete(OpRecord(name, ins, None, 1.0, False), [], [(nbytes, _DATA, None)])
        if keep:
            held[name] = _Wrapper()
            rt.track(held[name], cells[name])

    op("X", 50)
    op("P", 30)
    op("Q", 30)  # over the budget: X, the stalest, is swapped out
    del held["Q"]
    rt.drain()
    for i in range(6):
        op(f"f{i}", 0, keep=False)
    if end is not None:
        end(rt, held)
        return rt
    if reads_x == "op":
        op("use", 0, ["X"], keep=False)
    elif reads_x == "read":
        rt.acquire([cells["X"]])
        rt.unlock([cells["X"]])
    else:
        op("R", 40)
    del held["X"]  # dropped before the block ends (which would bring it back)
    rt.drain()
    rt.close()
    c = rt.counters
    return rt.host.log, (c.swaps_in, c.prefetches)


def test_a_prefetch_the_program_stopped_needing_is_not_repeated():
    # Block A reads the swapped X; blocks B (an evaluation, say) never do. The first B
    # prefetches X, as A's log says; the next ones must not (a prefetch used to log itself as
    # a need, so a useless one repeated in every later block).
    log, (sync, pre) = _block(None, reads_x="op")
    assert (sync, pre) == (1, 0)
    counts = []
    for _ in range(3):
        log, got = _block(log, reads_x=None)
        counts.append(got)
    assert counts[0][1] == 1 and counts[1:] == [(0, 0), (0, 0)], counts


@pytest.mark.parametrize("read", ["op", "read"])
def test_a_prefetch_the_block_reads_is_repeated_in_every_later_block(read):
    # Read by an op or by a plain read (dtr.materialize, .item(), printing): both count, or
    # the steps alternate between synchronous swap-ins and prefetches.
    log, _ = _block(None, reads_x=read)
    counts = []
    for _ in range(3):
        log, got = _block(log, reads_x=read)
        counts.append(got)
    assert counts == [(0, 1)] * 3


def test_a_block_that_fails_to_close_leaves_no_prefetch_unlanded(monkeypatch):
    # X is prefetched (as the first block's log says) but not read yet when the block ends, and
    # bringing the live tensors back fails (say, a replay raises): X outlives the block, so its
    # copy must still land.
    log, _ = _block(None, reads_x="op")

    def end(rt, held):
        assert rt.arriving  # X, prefetched, not read

        def failing(self, cells):
            raise RuntimeError("a replay failed")

        monkeypatch.setattr(Runtime, "acquire", failing)
        with pytest.raises(RuntimeError, match="replay failed"):
            rt.close()

    rt = _block(log, reads_x=None, end=end)
    assert not rt.arriving and rt.executor.arrived == 1


def test_the_swap_log_times_every_op_also_one_that_failed():
    # The prefetch schedule reads op costs by clock: an op that raised OutOfBudgetError still
    # moved the clock, and its cost must be logged, or every later prefetch is timed one op off.
    host = HostTier(1e3, 0)  # no host room: b cannot push a out
    rt = Runtime(100, make_heuristic("dtr_eq"), SimExecutor(), host=host)
    keep, failed = [], []
    for name, nbytes in (("a", 60), ("b", 60), ("c", 30)):
        try:
            (c,) = rt.complete(OpRecord(name, [], None, 1.0, False), [], [(nbytes, _DATA, None)])
        except dtr.OutOfBudgetError:
            failed.append(name)
            continue
        keep.append(_Wrapper())
        rt.track(keep[-1], c)
    assert failed == ["b"]
    assert rt.clock == 3 and len(rt.host.log.costs) == 3


def test_simulated_swapping_repeats_the_real_run(tmp_path):
    w = zoo.build("resnet", "tiny")
    budget = int(_peak(w) * 0.4)
    path = tmp_path / "t.jsonl"
    real = run_step(w, fresh_model(w), budget, cost="estimate", swap=True, bandwidth=FAST, trace=path).stats
    sim = dtr.simulate(path, budget, swap=True, bandwidth=FAST)
    assert sim.feasible
    assert (sim.swaps_out, sim.swaps_in, sim.evictions, sim.rematerializations, sim.peak_bytes) == (
        real.swaps_out, real.swaps_in, real.evictions, real.rematerializations, real.peak_resident_bytes)
    no_swap = dtr.simulate(path, budget)
    assert no_swap.swaps_out == 0


def _chain(layers: int, size: int, device: str):
    """A chain of tanh(y @ w), and a step that returns its weights' gradients. The gradients
    exist before the block and are zeroed in place (``zero_grad(set_to_none=False)``): the
    budgets below hold activations only."""
    x = torch.randn(size, size, device=device)
    ws = [torch.randn(size, size, device=device, requires_grad=True) for _ in range(layers)]
    for w in ws:
        w.grad = torch.zeros_like(w)

    def step():
        for w in ws:
            w.grad.zero_()
        y = x
        for w in ws:
            y = torch.tanh(y @ w)
        y.sum().backward()
        return [w.grad.clone() for w in ws]

    return step


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_swaps_are_ordered_by_events(device):
    """On CUDA copies run on a side stream; compute after a swap-in must see the copied data."""
    step = _chain(6, 256, device)
    eager = step()
    with dtr.budget(3 * 256 * 256 * 4, swap=True, bandwidth=FAST) as engine:
        got = step()
    assert engine.stats().swaps_out > 0
    for g, e in zip(got, eager):
        assert torch.equal(g, e)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetches_land_before_their_reads(device):
    """Steps after the first prefetch (on CUDA on the side stream); compute waits for each copy
    at the tensor's first read (Note [Arrival]): gradients stay eager's in every step."""
    step = _chain(8, 512, device)
    eager = step()
    engine = dtr.budget(6 * 512 * 512 * 4, swap=True, bandwidth=FAST)
    for _ in range(3):
        with engine:
            got = step()
        for g, e in zip(got, eager):
            assert torch.equal(g, e)
    assert engine.stats().prefetches > 0


def test_copies_in_flight_that_cover_the_room_are_waited_for_not_added_to():
    # Swapped-out bytes stay charged until their copy is done. A round that has started copies
    # enough to make the room waits for them; without the wait it would swap out every
    # candidate (what the program reads next, too), since memory does not fall while copies run.
    rt = Runtime(100, make_heuristic("dtr_eq"), SwappingExecutor(), host=HostTier(FAST, None))
    held = []
    for name, nbytes in (("a", 30), ("b", 30), ("c", 30), ("d", 40)):
        (c,) = rt.complete(OpRecord(name, [], None, 1.0, False), [], [(nbytes, _DATA, None)])
        held.append(_Wrapper())
        rt.track(held[-1], c)
    assert rt.counters.swaps_out == 1 and rt.executor.waited == 1
    assert rt.memory == 100 and not rt.host.outgoing


def test_a_replay_leaves_a_swapped_sibling_on_the_host():
    # y and z are the two outputs of one op; a refused op made room by evicting y and swapping
    # z out. Rebuilding y replays the op, which computes z too: z stays on the host, since the
    # replay made room for y alone (taking the value would leave z SWAPPED with a value, its
    # bytes uncharged).
    rt = Runtime(20, make_heuristic("dtr_eq"), SimExecutor(), host=HostTier(4.0, None))
    held = []

    def op(name, inputs, sizes, replayable=True):
        rt.acquire(inputs)
        cells = rt.complete(OpRecord(name, inputs, None, 2.0, replayable), [], [(n, _DATA, None) for n in sizes])
        for c in cells:
            held.append(_Wrapper())
            rt.track(held[-1], c)
        return cells

    (x,) = op("x", [], [1], replayable=False)
    y, z = op("yz", [x], [12, 7])
    with pytest.raises(dtr.OutOfBudgetError):
        op("big", [], [6400])
    assert (y.state.name, z.state.name) == ("EVICTED", "SWAPPED")
    rt.acquire([y])
    rt.unlock([y])
    assert y.state.name == "RESIDENT" and z.state.name == "SWAPPED" and z.value is None
    rt.check_invariants()
    rt.acquire([z])  # back from the host
    rt.unlock([z])
    assert z.value is not None
    rt.check_invariants()
