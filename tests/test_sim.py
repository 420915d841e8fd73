"""Traces and the simulator: a simulated trace repeats the real run's decisions exactly.

The real run uses the deterministic cost model (``cost="estimate"``), so that its recorded
costs, and hence its scores, are the ones a replay of the trace sees. Evictions are compared
as sequences of storage ids, which both runs allocate in the same order.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from test_programs import execute, make_inputs, programs, run_eager

import dtr
from dtr.core import DTREq
from dtr.sim import Trace, load
from dtr.testing import zoo
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step


class Logged(DTREq):
    """h_DTR^eq that logs the storage ids it sees evicted (budget and eager evictions alike)."""

    name = "logged"

    def __init__(self) -> None:
        self.log = []

    def on_evict(self, s) -> None:
        self.log.append(s.sid)
        super().on_evict(s)


def record_and_simulate(run, limit, path):
    """``run(limit, heuristic, trace)`` for real, then the simulation of its trace: both logs."""
    real = Logged()
    try:
        run(limit, real, path)
        feasible = True
    except dtr.OutOfBudgetError:
        feasible = False
    sim = Logged()
    result = dtr.simulate(path, limit, heuristic=sim)
    return feasible, real.log, result, sim.log


@pytest.mark.parametrize("name", zoo.MODELS)
def test_simulation_repeats_the_evictions_of_the_real_run(name, tmp_path):
    w = zoo.build(name, "tiny")
    eager = run_step(w, fresh_model(w), "eager")
    tracked = run_step(w, fresh_model(w), None, cost="estimate").stats
    stats = {}

    def run(limit, heuristic, trace):
        # A fresh model each run: batch norm's running statistics change with every step.
        r = run_step(w, fresh_model(w), limit, cost="estimate", heuristic=heuristic, trace=trace)
        assert_same(r, eager)  # recording changes nothing
        stats["real"] = r.stats

    limit = budget_at(tracked, 0.5)
    feasible, real, sim, simulated = record_and_simulate(run, limit, tmp_path / "t.jsonl")
    assert feasible and sim.feasible
    assert stats["real"].evictions > 0
    assert simulated == real
    s = stats["real"]
    assert (sim.evictions, sim.eager_evictions, sim.rematerializations, sim.peak_bytes) == (
        s.evictions, s.eager_evictions, s.rematerializations, s.peak_resident_bytes
    )
    # A replay estimates its cost again, from the same shapes (in-place ones add a clone).
    assert sim.remat_cost == pytest.approx(s.remat_seconds, rel=1e-3)
    # Deferred ops (Note [Scattered gradients]) count once a replay has made them.
    trace = load(tmp_path / "t.jsonl")
    deferred = sum(e["cost"] for b in trace.blocks for e in b if e.get("deferred"))
    slack = 1e-9 * trace.compute_cost
    assert trace.compute_cost - slack <= sim.base_cost <= trace.compute_cost + deferred + slack
    assert sim.total_cost == pytest.approx(sim.base_cost + sim.remat_cost)


@pytest.mark.parametrize("fraction", [0.5, 0.8])
@pytest.mark.parametrize("name", ["mlp", "transformer", "treelstm", "gru_cell"])
def test_an_unlimited_trace_simulates_a_run_under_a_budget(name, fraction, tmp_path):
    """A trace recorded with no budget has no room made before its ops; simulated under a
    budget it makes room where the driver would (``RoomBeforeOps``): in the first block for
    every op, later where the headroom is less than the largest output made. Two steps of one
    engine, simulated at the budget, make the real engine's evictions in order and its peak
    (without it, the simulated peak passed the budget by an op and the evictions differed)."""
    w = zoo.build(name, "tiny")
    unlimited = dtr.budget(None, cost="estimate", trace=tmp_path / "t.jsonl")
    model = fresh_model(w)
    for _ in range(2):
        run_step(w, model, unlimited)
    tracked = run_step(w, fresh_model(w), None, cost="estimate").stats
    limit = budget_at(tracked, fraction)
    real_log = Logged()
    engine = dtr.budget(limit, cost="estimate", heuristic=real_log)
    model = fresh_model(w)
    for _ in range(2):
        run_step(w, model, engine)
    real = engine.stats()
    sim_log = Logged()
    sim = dtr.simulate(tmp_path / "t.jsonl", limit, heuristic=sim_log)
    assert sim.feasible and real.evictions > 0
    assert sim_log.log == real_log.log
    assert (sim.evictions, sim.rematerializations, sim.peak_bytes) == (
        real.evictions, real.rematerializations, real.peak_resident_bytes
    )
    assert sim.peak_bytes <= limit


def test_a_later_block_does_not_anticipate_a_larger_output(tmp_path):
    """After its first block an engine makes room before an op only where the headroom is
    less than the largest output it has made, so an output larger than any before (the
    second block's ``repeat``) passes the budget by itself; simulated from the unlimited
    trace, the same happens, with the same evictions."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)

    def steps(engine):
        for big in (False, True):
            w.grad = None
            with engine:
                h = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
                for _ in range(6):
                    h = torch.tanh(h @ w)
                if big:
                    h = h.repeat(16, 1)
                h.sum().backward()
                del h

    steps(dtr.budget(None, cost="estimate", trace=tmp_path / "t.jsonl"))
    limit = 78_000
    real_log = Logged()
    engine = dtr.budget(limit, cost="estimate", heuristic=real_log)
    steps(engine)
    real = engine.stats()
    sim_log = Logged()
    sim = dtr.simulate(tmp_path / "t.jsonl", limit, heuristic=sim_log)
    assert sim_log.log == real_log.log and real.evictions > 0
    assert sim.peak_bytes == real.peak_resident_bytes > limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(program=programs, seed=st.integers(0, 2**16), fraction=st.floats(0.05, 1.0))
def test_simulation_agrees_on_random_programs(program, seed, fraction, tmp_path):
    """Views, in-place writes, cat/split, dropout, frees: the same decisions, and the same
    verdict on feasibility."""
    assume(run_eager(program, seed) is not None)
    path = tmp_path / f"p{seed}.jsonl"

    def run(limit, heuristic, trace):
        inputs = make_inputs(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ops were replayed at block exit"
            with dtr.budget(limit, cost="estimate", heuristic=heuristic, trace=trace):
                execute(program, seed, *inputs)

    with dtr.budget(None, cost="estimate") as engine:
        execute(program, seed, *make_inputs(seed))
    limit = int(engine.stats().peak_resident_bytes * fraction)
    feasible, real, sim, simulated = record_and_simulate(run, limit, path)
    assert sim.feasible == feasible
    if feasible:
        assert simulated == real
    else:
        # Both fail at the same op, after the same evictions; the real run then exits its
        # block (which may evict more), the simulation stops.
        assert real[: len(simulated)] == simulated


def test_trace_round_trip_and_gzip(tmp_path):
    w = zoo.build("transformer", "tiny")
    model = fresh_model(w)
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    run_step(w, model, None, cost="estimate", trace=plain)
    run_step(w, model, None, cost="estimate", trace=packed)
    with gzip.open(packed, "rt") as f:
        assert f.read() == plain.read_text()
    trace = load(plain)
    assert trace.header["format"] == "dtr-trace" and trace.header["version"] == 5
    assert trace.header["cost"] == "estimate" and trace.header["heuristic"] == "dtr_eq"
    assert len(trace.blocks) == 1 and trace.blocks[0][0]["e"] == "begin" and trace.blocks[0][-1]["e"] == "end"
    kinds = {e["e"] for e in trace.blocks[0]}
    assert {"op", "ref", "free", "extract", "hold"} <= kinds
    # Every op names its inputs and outputs by cell ids made before; sizes are positive.
    seen = set()
    for e in trace.blocks[0]:
        if e["e"] == "op":
            assert set(e["in"]) <= seen, e
            assert all(n > 0 for n, base in e["new"] if base is None), e
            seen.update(e["out"])
        elif e["e"] == "resolve":
            seen.add(e["to"])
    assert trace.ops > 50
    assert dtr.simulate(trace, "10 MB") == dtr.simulate(plain, "10 MB") == dtr.simulate(packed, "10 MB")
    peak = dtr.simulate(trace, None).peak_bytes
    grads = sum(e["bytes"] for e in trace.blocks[0] if e["e"] == "hold")  # never evicted
    half = grads + (peak - grads) // 2
    low = dtr.simulate(trace, half)
    assert low.feasible and low.evictions > 0 and low.peak_bytes <= half + 2 * max(
        n for b in trace.blocks for e in b if e["e"] == "op" for n, _ in e["new"]
    )
    assert low.slowdown > 1.0 == dtr.simulate(trace, None).slowdown


def test_infeasible_budget_is_reported_not_raised(tmp_path):
    w = zoo.build("mlp", "tiny")
    run_step(w, fresh_model(w), None, cost="estimate", trace=tmp_path / "t.jsonl")
    r = dtr.simulate(tmp_path / "t.jsonl", 1000)
    assert not r.feasible and "budget" in r.error
    assert isinstance(r, dtr.SimResult)


def test_each_block_of_an_engine_is_appended(tmp_path):
    w = zoo.build("mlp", "tiny")
    model = fresh_model(w)
    engine = dtr.budget(None, cost="estimate", trace=tmp_path / "t.jsonl")
    for _ in range(2):
        model.zero_grad(set_to_none=True)  # the same ops twice: no accumulation into .grad
        with engine:
            w.loss_fn(model, w.batch).backward()
    trace = load(tmp_path / "t.jsonl")
    assert len(trace.blocks) == 2
    one = dtr.simulate(Trace(trace.header, trace.blocks[:1]), None)
    two = dtr.simulate(trace, None)
    assert two.base_cost == pytest.approx(2 * one.base_cost)
    assert two.peak_bytes == one.peak_bytes


def test_bad_input_is_named(tmp_path):
    w = zoo.build("mlp", "tiny")
    path = tmp_path / "t.jsonl"
    run_step(w, fresh_model(w), None, trace=path)
    with pytest.raises(ValueError, match="budget"):
        dtr.simulate(path, "lots")
    with pytest.raises(ValueError, match="heuristic"):
        dtr.simulate(path, None, heuristic="nope")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"hello": 1}) + "\n")
    with pytest.raises(ValueError, match="not a dtr trace"):
        dtr.simulate(other, None)
    newer = tmp_path / "newer.jsonl"
    newer.write_text(json.dumps({"format": "dtr-trace", "version": 99}) + "\n")
    with pytest.raises(ValueError, match="version 99"):
        load(newer)
    with pytest.raises(ValueError, match="trace must be a file path"):
        dtr.budget(None, trace=3)


def test_recording_a_failed_step_keeps_the_engine_usable(tmp_path):
    """An op that runs out of budget is logged as failed; raising the budget, the step goes
    on, and the simulation at the raised budget runs the whole trace."""
    w = zoo.build("mlp", "tiny")
    model = fresh_model(w)
    eager = run_step(w, model, "eager")
    path = tmp_path / "t.jsonl"
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    with dtr.budget(1000, cost="estimate", trace=path) as engine:
        with pytest.raises(dtr.OutOfBudgetError):
            w.loss_fn(model, w.batch)
        engine.budget = None
        torch.manual_seed(1)
        loss = w.loss_fn(model, w.batch)
        loss.backward()
        assert torch.equal(dtr.materialize(loss), eager.loss)
    events = load(path).blocks[0]
    assert any(e.get("error") == "out of budget" for e in events)
    assert any(e["e"] == "budget" for e in events)
    assert dtr.simulate(path, None).feasible


def test_a_failed_block_ends_in_its_trace_as_it_ended(tmp_path):
    """A block an exception left ends with ``"failed": true``, and its simulation, like the
    run, makes nothing resident at the end (Note [A failed block's exit]): the simulated peak
    stays within the budget, where defining the eight kept activations would pass it."""
    path = tmp_path / "t.jsonl"
    budget = 3 * 64 * 1024
    torch.manual_seed(0)
    w = torch.randn(128, 128, requires_grad=True)
    kept = []
    with pytest.raises(KeyError):
        with dtr.budget(budget, cost="estimate", trace=path):
            h = torch.randn(128, 128)
            for _ in range(8):
                h = torch.tanh(h @ w)
                kept.append(h)
            raise KeyError("the program's own error")
    events = load(path).blocks[0]
    assert events[-1] == {"e": "end", "failed": True}
    r = dtr.simulate(path, budget)
    assert r.feasible and r.evictions > 0 and r.peak_bytes <= budget


def test_simulation_repeats_retired_ops(tmp_path):
    """Ops that read memory about to be freed (FSDP2 resharding a layer's parameters after its
    forward: ``Driver.before_constants_freed``) are retired in the real run and in its trace's
    simulation alike; gradients stay eager's."""
    from dtr.testing.distributed import tanh_mlp

    torch.manual_seed(0)
    model = tanh_mlp(width=64, depth=6)
    x, target = torch.randn(128, 64), torch.randint(0, 10, (128,))

    def step(engine=None):
        m = copy.deepcopy(model)

        def resharded(layer, args, out):
            if engine is not None:
                engine._driver.constants.before_freed([layer.weight, layer.bias])

        handle = m[0].register_forward_hook(resharded)
        with engine if engine is not None else contextlib.nullcontext():
            torch.nn.functional.cross_entropy(m(x), target).backward()
        handle.remove()
        return [p.grad for p in m.parameters()]

    eager = step()
    probe = dtr.budget(None, cost="estimate")
    step(probe)
    limit = int(0.8 * probe.stats().peak_resident_bytes)

    def run(limit, heuristic, trace):
        grads = step(dtr.budget(limit, cost="estimate", heuristic=heuristic, trace=trace))
        assert all(torch.equal(a, b) for a, b in zip(eager, grads))

    feasible, real, sim, simulated = record_and_simulate(run, limit, tmp_path / "t.jsonl")
    assert feasible and sim.feasible and real
    assert simulated == real
    assert any(e["e"] == "retire" for e in load(tmp_path / "t.jsonl").blocks[0])


def test_traces_mark_the_backward_pass(tmp_path):
    """The driver says when autograd starts running the program's ops (Note [Gradients are a
    last resort]): one step's trace turns the backward pass on once, after the last forward
    op and before the first backward formula, and the storages made in it are the ones the
    runtime marks."""
    w = zoo.build("mlp")
    path = tmp_path / "mlp.jsonl.gz"
    made = []
    with dtr.budget(None, cost="estimate", trace=path) as engine:
        rt = engine.runtime
        x, y = w.batch
        logits = w.model(x)
        # Halfway through the backward pass: what the runtime holds then, and its marks.
        logits.register_hook(lambda g: made.extend((s.parent.name, s.backward) for s in rt.storages() if s.parent))
        torch.nn.functional.cross_entropy(logits, y).backward()
    names = []
    with gzip.open(path, "rt") as f:
        for line in f:
            e = json.loads(line)
            if e.get("e") == "backward":
                names.append(("backward", e["on"]))
            elif e.get("e") == "op":
                names.append(e["name"])
    switches = [i for i, n in enumerate(names) if isinstance(n, tuple)]
    assert [names[i] for i in switches] == [("backward", True)]
    before, after = names[: switches[0]], names[switches[0] + 1 :]
    assert not any("backward" in n for n in before) and "aten.nll_loss_forward.default" in before
    assert "backward" in after[0]
    # Marked: what backward formulas made; not: the forward's loss.
    assert any(name.endswith("_backward.default") for name, _ in made)
    assert all(marked for name, marked in made if name.endswith("_backward.default"))
    assert not any(marked for name, marked in made if name == "aten.nll_loss_forward.default")


def test_version_1_traces_load_in_version_3_words(tmp_path):
    """A version 1 trace's pins (a plan's checkpoints locked between ops, as seeded runs once
    did) replay as protections, and its ``protect`` window event as ``protect_new`` (Note
    [Trace format, version 5]): the pinned storage is now the last to go, not never."""
    op = lambda n, out, ins=(): {"e": "op", "name": n, "cost": 1.0, "replayable": True,  # noqa: E731
                                 "in": list(ins), "mut": [], "new": [[100, None]], "out": [out]}
    events = [{"e": "begin", "budget": None}]
    for k in range(3):
        events += [op(f"op{k}", k, [k - 1] if k else []), {"e": "ref", "ref": k, "cell": k}]
    events += [{"e": "pin", "cells": [0]}, {"e": "protect", "on": True}, op("op3", 3, [2]),
               {"e": "ref", "ref": 3, "cell": 3}, {"e": "protect", "on": False},
               {"e": "unpin", "cells": [0]}, {"e": "end"}]
    path = tmp_path / "v1.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in [{"format": "dtr-trace", "version": 1}] + events) + "\n")
    trace = load(path)
    kinds = [e["e"] for e in trace.blocks[0]]
    assert "pin" not in kinds and "unpin" not in kinds
    assert kinds.count("protect") == 1 and kinds.count("unprotect") == 1 and kinds.count("protect_new") == 2
    assert dtr.simulate(trace, None).feasible
    squeezed = dtr.simulate(trace, 200)  # a pin would make 200 bytes infeasible at op3
    assert squeezed.feasible and squeezed.evictions >= 2


def test_every_call_event_replays_the_call_that_was_recorded(tmp_path):
    """The trace's call events (``trace.CALLS``) are written by the recorder and replayed by the
    simulator from one table: each call made on a recording runtime comes back from its trace
    as the same method with the same arguments (cells and storages named by the output they
    are)."""
    import inspect

    from dtr.core import OpRecord, Runtime
    from dtr.sim.record import RecordingRuntime
    from dtr.sim.simulator import SimExecutor, run_block
    from dtr.sim.trace import CALLS, TraceWriter

    class Held:
        """A tensor object the program holds (the runtime keeps a weak reference)."""

    held = []

    def program(rt):
        """One op of three outputs, then every call event, by position and by keyword."""
        a, b, c = rt.complete(OpRecord("make", [], None, 1.0, True), (), [(8, True, None)] * 3)
        for cell in (a, b, c):
            held.append(Held())
            rt.track(held[-1], cell)
        rt.make_permanent([a], yielding=True)
        rt.make_permanent([b])
        rt.set_backward(True)
        rt.hold("w", 16)
        rt.reserve_scratch(32, "a sum")
        rt.protect_new(True)
        rt.protect([c.storage])
        rt.unprotect(iter([c.storage]))  # any iterable, as the runtime takes
        rt.checkpoint([c.storage], 3)
        rt.protect_new(False)
        rt.set_backward(False)
        rt.evict([c.storage])
        rt.before_write([b.storage])
        rt.extract(b)
        rt.retire([a.storage])
        rt.set_budget(64, "a change")
        rt.flush()

    def spying(cls):
        """A subclass of ``cls`` that logs the program's calls of the table's methods as
        ``(method, {parameter: argument})``, not the calls the runtime makes on itself."""
        calls = []
        depth = [0]

        class Spy(cls):
            def complete(self, rec, mutated, fresh):
                out = super().complete(rec, mutated, fresh)
                made.extend(out)
                return out

        made = []
        for event in CALLS.values():
            run = getattr(cls, event.method)

            signature = inspect.signature(getattr(Runtime, event.method))

            def spy(self, *args, __run=run, __name=event.method, __sig=signature, **kwargs):
                if not depth[0]:
                    bound = __sig.bind(self, *args, **kwargs)
                    bound.apply_defaults()
                    named = {p: list(v) if p in ("storages", "roots") else v for p, v in bound.arguments.items()}
                    del named["self"]
                    if "storages" in bound.arguments:  # an iterable, read here and by the call
                        args, kwargs = (), dict(named)
                    calls.append((__name, named))
                depth[0] += 1
                try:
                    return __run(self, *args, **kwargs)
                finally:
                    depth[0] -= 1

            setattr(Spy, event.method, spy)
        return Spy, calls, made

    def by_output(calls, made):
        """Each call with its cells and storages replaced by the index of their output."""
        index = {id(c): i for i, c in enumerate(made)} | {id(c.storage): i for i, c in enumerate(made)}

        def name(v):
            return [name(x) for x in v] if isinstance(v, list) else index.get(id(v), v)

        return [(method, {p: name(v) for p, v in args.items()}) for method, args in calls]

    writer = TraceWriter(tmp_path / "calls.jsonl", {"heuristic": "dtr_eq", "cost": "estimate", "budget": None})
    Recorder, recorded, recorded_made = spying(RecordingRuntime)
    rt = Recorder(None, DTREq(), SimExecutor(), writer)
    program(rt)
    rt.close()
    writer.close()
    Replayer, replayed, replayed_made = spying(Runtime)
    (block,) = load(tmp_path / "calls.jsonl").blocks
    run_block(Replayer(None, DTREq(), SimExecutor()), block)

    want = [(m, a) for m, a in by_output(recorded, recorded_made) if m != "set_budget"]  # simulations keep their budget
    assert {m for m, _ in want} == {e.method for e in CALLS.values() if e.replayed}
    assert by_output(replayed, replayed_made) == want
