"""The native path (``dtr_ext._hotpath``, eager/native.py) against the Python path it mirrors:
the same records and storages, field by field, and the same decisions (evictions in the same
order, and after each op with the heuristic's hooks left as they are; the same replays, the
same gradients bit for bit) on zoo models under budgets that evict
and on random programs at random budgets; nothing changed where it hands an op back to the
Python path; and a record class changed without hotpath.c turning the native path off instead
of leaving a field unset (and, in a checkout where it is built, not off)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

import dtr
from dtr.core import State, Storage
from dtr.core.runtime import Runtime
from dtr.core.unionfind import UFNode, find
from dtr.eager import native
from dtr.eager.driver import Driver
from dtr.eager.ops import facts_for
from dtr.eager.replay import Call
from dtr.testing import zoo
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step

from test_programs import assert_same as assert_as_eager, programs, run_dtr, run_eager

needs_native = pytest.mark.skipif(not native.NATIVE, reason=f"no native path: {native.WHY_NOT}")


def test_a_built_native_path_is_on():
    """bind refuses record classes whose slots differ from hotpath.c's (the path then turns off
    quietly, saying why in ``WHY_NOT``): where the module is built, that must not happen."""
    if os.environ.get("DTR_PUREPYTHON", "") not in ("", "0"):
        pytest.skip("DTR_PUREPYTHON is set")
    try:
        import dtr_ext._hotpath  # noqa: F401
    except ImportError:
        pytest.skip("dtr_ext is not built")
    assert native.NATIVE, native.WHY_NOT


@contextlib.contextmanager
def _python_path():
    """Drivers made inside take the Python path."""
    run = native.run_simple
    native.run_simple = None
    try:
        yield
    finally:
        native.run_simple = run


def _spy(patch, names, log, by_method=False):
    """Through ``patch`` (a ``MonkeyPatch``), log the names of the ops that reach the Python
    path's ``Driver`` methods ``names``; with ``by_method``, (method, op name) pairs."""
    for name in names:
        method = getattr(Driver, name)

        def run(driver, facts, *args, _name=name, _method=method):
            log.append((_name, facts.name) if by_method else facts.name)
            return _method(driver, facts, *args)

        patch.setattr(Driver, name, run)


@contextlib.contextmanager
def _spied_block(python, engine, names, log, by_method=False):
    """A step's block (``engine``'s, or eager's where it is None) on the Python path or the
    native one, with the ops reaching ``Driver`` methods ``names`` logged (``_spy``) and every
    eviction recorded: yields the evictions and the ``MonkeyPatch``, for more patches."""
    with _python_path() if python else contextlib.nullcontext(), _evictions(True) as evicted, \
            pytest.MonkeyPatch.context() as patch:
        _spy(patch, names, log, by_method)
        with engine if engine is not None else contextlib.nullcontext():
            yield evicted, patch


def _assert_alike(native_run, python_run, eager_grads):
    """Both paths' steps, (graph, evictions after each op, stats, gradients), are equal, and
    their gradients are eager's."""
    *native_state, grads = native_run
    *python_state, py_grads = python_run
    assert native_state == python_state
    for mine, theirs, ref in zip(grads, py_grads, eager_grads):
        assert torch.equal(mine, theirs) and torch.equal(mine, ref)


@contextlib.contextmanager
def _evictions(observed: bool):
    """Every eviction of the blocks run inside (for the budget or eager), with the bytes
    charged then. ``observed=False``: each as it happens, in order, by wrapping the runtime's
    ``_on_evict`` (which makes the native path call h_DTR^eq's hook in Python too).
    ``observed=True``: what is evicted after each op (``Runtime.on_op``), leaving the hooks
    as they are, so that the native path runs h_DTR^eq's union-find merge itself."""
    evicted = []
    if not observed:
        init = Runtime.__init__

        def logged(rt, *args, **kwargs):
            init(rt, *args, **kwargs)
            on_evict = rt._on_evict

            def told(s):
                on_evict(s)
                evicted.append((s.sid, s.nbytes, s.parent and s.parent.name, rt.memory))

            rt._on_evict = told

        Runtime.__init__ = logged
        try:
            yield evicted
        finally:
            Runtime.__init__ = init
        return
    enter = dtr.Engine.__enter__

    def entered(engine):
        out = enter(engine)
        rt = engine.runtime
        watching = rt.on_op  # set by the block's start (a timeline recorder, or None)
        before = set()

        def after_op(rt):
            if watching is not None:
                watching(rt)
            now = {s.sid for s in rt.storages() if s.state is State.EVICTED}
            evicted.append((rt.clock, sorted(now - before), sorted(before - now), rt.memory))
            before.clear()
            before.update(now)

        rt.on_op = after_op
        return out

    dtr.Engine.__enter__ = entered
    try:
        yield evicted
    finally:
        dtr.Engine.__enter__ = enter


def _tensor(t):
    return ("tensor", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t


def _template(args):
    return tuple(
        [_tensor(x) for x in a] if isinstance(a, list) else _tensor(a) for a in args
    )


def _cell(c):
    if type(c) is Storage:
        return ("root", c.sid)
    return ("view", c.storage.sid, c.index, c.value is not None)


def _record(rec):
    if rec is None:
        return None
    fields = [
        type(rec).__name__, rec.name, [_cell(c) for c in rec.inputs],
        [s.sid for s in rec.use_storages],
        [o.sid if type(o) is Storage else type(o).__name__ for o in rec.outputs],  # views held weakly
        rec.cost, rec.replayable, rec.live,
        [gc.is_tracked(o) for o in (rec, rec.inputs, rec.outputs, rec.use_storages)],
    ]
    if type(rec) is Call:
        fields += [
            rec.func, _template(rec.args), rec.kwargs, rec.slots, rec.rng is None, rec.grad,
            rec.versions, rec.derive, rec.fresh, [_tensor(x) for x in rec.consts[1::3]],
            rec.consts[2::3], rec.clone_args,
            # untracked with its constants; a tuple of atomic values only the collector untracks
            gc.is_tracked(rec.args) if rec.consts else None,
        ]
    return fields


def _set_of(s: Storage):
    """The cost and size of the heuristic's union-find set that holds ``s`` (h_DTR^eq), or its
    heuristic data when it is none."""
    if type(s.hdata) is not UFNode:
        return s.hdata
    root = find(s.hdata)
    return root.cost, root.size, gc.is_tracked(root)


def _graph(rt: Runtime):
    """Every storage of the runtime with its fields and its parent record's."""
    return [
        (
            s.sid, s.nbytes, s.state, s.locks, s.refs, s.uses, s.last_access, s.cost, s.index,
            s.value is not None, len(s.views), [t.sid for t in s.dependents],
            [(_cell(v), _record(v.parent), gc.is_tracked(w)) for w in s.views for v in (w(),) if v is not None],
            s.forward and s.forward.sid, s.slot, s.protected, s.backward, gc.is_tracked(s),
            gc.is_tracked(s.dependents), _record(s.parent), _set_of(s),
        )
        for s in rt.storages()
    ] + [rt.memory, rt.peak, rt.clock, rt.work, rt.next_sid, len(rt.live_refs())]


def _step(name, fraction, python, observed):
    """One step of zoo model ``name`` at ``fraction`` of its peak (estimated costs): its result,
    the graph after the forward pass, and its evictions (``_evictions``)."""
    w = zoo.build(name, "tiny")
    graphs = []

    def loss_fn(model, batch):
        loss = w.loss_fn(model, batch)
        graphs.append(_graph(engine.runtime))
        return loss

    with _python_path() if python else contextlib.nullcontext():
        unlimited = run_step(w, fresh_model(w), None, cost="estimate")
        engine = dtr.budget(budget_at(unlimited.stats, fraction), cost="estimate")
        with _evictions(observed) as evicted:
            result = run_step(dataclasses.replace(w, loss_fn=loss_fn), fresh_model(w), engine)
    return result, graphs[0], evicted


@pytest.mark.parametrize("name,fraction", [
    ("mlp", 0.5), ("transformer", 0.4), ("lstmcell", 0.5), ("gru_cell", 0.5), ("treelstm", 0.7),
    ("resnet", 0.5),
])
@pytest.mark.parametrize("observed", [False, True])
@needs_native
def test_both_paths_record_and_evict_alike(name, fraction, observed):
    before = native.registered()
    result, graph, evicted = _step(name, fraction, python=False, observed=observed)
    handled = native.registered()
    assert handled - before > result.stats.ops / 4  # most forward ops are simple
    python, python_graph, python_evicted = _step(name, fraction, python=True, observed=observed)
    assert native.registered() == handled  # the Python run did not use the native path
    assert graph == python_graph
    assert any(e[1] for e in evicted) if observed else evicted  # the log saw evictions
    assert evicted == python_evicted
    assert result.stats.evictions > 0 and result.stats.eager_evictions > 0
    assert result.stats == python.stats
    assert_same(result, python)
    assert_same(result, run_step(zoo.build(name, "tiny"), fresh_model(zoo.build(name, "tiny")), "eager"))


def _several_step(limit=None, python=False):
    """A step of ops with several outputs (``OpFacts.several``): values and int64 indices (``sort``),
    a value and int64 indices (``max.dim``), two 0-dim ones (``aminmax``, of a detached input:
    torch 2.11 has no derivative for it), three
    (``native_layer_norm`` and its backward), a ``convolution_backward`` whose input gradient
    is None (the image needs none), and ``topk`` with k=0 (only empty outputs: the Python
    continuation). Returns the gradients, the graph after the backward, the evictions after
    each op, the stats, and the names of the ops that reached the Python path's ``_execute``
    or ``_register_several``; with ``limit=False``, eager's."""
    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    g = torch.randn(16, requires_grad=True)
    k = torch.randn(4, 3, 3, 3, requires_grad=True)
    image = torch.randn(2, 3, 8, 8)
    engine = dtr.budget(limit, cost="estimate") if limit is not False else None
    graph = None
    in_python = []
    with _spied_block(python, engine, ("_execute", "_register_several"), in_python) as (evicted, _):
        h = torch.tanh(x * 1)
        ordered, order = torch.sort(h, 1)
        top, where = torch.max(h, 1)
        low, high = torch.aminmax(h.detach())
        normed = torch.nn.functional.layer_norm(h, (16,), g)
        none, none_at = torch.topk(h, 0, dim=1)
        conv = torch.nn.functional.conv2d(image, k)
        loss = ordered[:, -1].sum() + top.sum() + (where + order[:, 0]).sum() * 0 + low * high + normed.pow(2).sum()
        loss = loss + conv.pow(2).sum() + none.sum()
        loss.backward()
        if engine is not None:  # with the largest output, which decides when ops are sized
            graph = _graph(engine.runtime), engine._driver.largest_output
    return [x.grad, g.grad, k.grad], graph, evicted, engine and engine.stats(), in_python


@pytest.mark.parametrize("fraction", [None, 0.6])
@needs_native
def test_both_paths_register_ops_with_several_outputs_alike(fraction):
    """Ops returning several new tensors run natively (``several_outputs`` in hotpath.c, where
    their inputs are resident), outputs that are None or empty handed back as they are, and
    build the graph the Python path builds: records, storages, evictions after each op and
    stats equal, gradients eager's."""
    eager, _, _, _, _ = _several_step(False)
    unlimited = _several_step(None)[3]
    limit = None if fraction is None else budget_at(unlimited, fraction)
    grads, graph, evicted, stats, in_python = _several_step(limit)
    py_grads, py_graph, py_evicted, py_stats, _ = _several_step(limit, python=True)
    several = {"aten.sort.default", "aten.max.dim", "aten.aminmax.default", "aten.native_layer_norm.default",
               "aten.native_layer_norm_backward.default", "aten.convolution_backward.default"}
    if fraction is None:  # under a budget an op with an evicted input takes the Python path
        assert not several & set(in_python), in_python
    assert "aten.topk.default" in in_python
    if fraction is not None:
        assert stats.evictions > 0
    _assert_alike((graph, evicted, stats, grads), (py_graph, py_evicted, py_stats, py_grads), eager)


def _in_place_step(limit=None, python=False):
    """A step of in-place ops (``OpFacts.in_place``, which the native path runs): ``mul_`` and
    ``add_`` on a tensor the step made, with a constant and with a tensor of the engine; ``x.add_(x)``
    (the written storage read twice); gates that are views of one storage written with
    ``sigmoid_`` and ``tanh_`` one after the other, as ``LSTMCell``'s CPU kernel writes them
    (each write carries the other, defined views to the new version); ``relu_`` on a view the
    program keeps; ``copy_`` from another tensor of the engine; ``mul_`` on a tensor whose
    lineage was cut (its new version cannot be recomputed). Returns the gradients, the
    graph after the backward, the evictions after each op, the stats, and the names of the
    ops that reached the Python path's ``_execute``; with ``limit=False``, eager's."""
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    c = torch.randn(16, 16)
    shift = torch.randn(16, 16)
    engine = dtr.budget(limit, cost="estimate") if limit is not False else None
    graph = None
    in_python = []
    with _spied_block(python, engine, ("_execute",), in_python) as (evicted, _):
        moved = c + shift
        shift.add_(1)  # a constant a record read, written: every lineage is cut (Constants)
        moved.mul_(2)  # no lineage, no reader: its new version is not recomputable
        gates = x @ w
        i, f, g, o = gates.unsafe_chunk(4, 1)
        i.sigmoid_()
        f.sigmoid_()
        g.tanh_()
        o.sigmoid_()
        h = (f * c + i * g) * o.tanh()
        h2 = h * 1
        h2.mul_(0.5).add_(c).add_(h)
        h3 = h * 2
        h3.add_(h3).mul_(h2)
        kept = h3[:, :8]
        kept.relu_()
        out = torch.empty_like(h)
        out.copy_(h3)
        loss = out.sum() + kept.sum() + h.sum() + moved.sum()
        loss.backward()
        if engine is not None:
            graph = _graph(engine.runtime)
    return [x.grad, w.grad], graph, evicted, engine and engine.stats(), in_python


@pytest.mark.parametrize("fraction", [None, 0.5])
@needs_native
def test_both_paths_register_in_place_ops_alike(fraction):
    """In-place ops run natively (``in_place_op`` in hotpath.c) where the written tensor and
    every input are resident, and build the graph the Python path builds: the written
    storage's new version, its carried views, records, evictions after each op and stats
    equal; gradients eager's."""
    eager, _, _, _, _ = _in_place_step(False)
    unlimited = _in_place_step(None)[3]
    limit = None if fraction is None else budget_at(unlimited, fraction)
    before = native.registered()
    grads, graph, evicted, stats, in_python = _in_place_step(limit)
    handled = native.registered() - before
    py_grads, py_graph, py_evicted, py_stats, py_in_python = _in_place_step(limit, python=True)
    in_place = {"aten.sigmoid_.default", "aten.tanh_.default", "aten.mul_.Tensor", "aten.add_.Tensor",
                "aten.relu_.default", "aten.copy_.default"}
    assert in_place <= set(py_in_python)
    if fraction is None:  # under a budget an op with an evicted input takes the Python path
        assert [name for name in in_python if name in in_place] == ["aten.add_.Tensor"]  # the constant's
        assert handled >= sum(py_in_python.count(name) for name in in_place) - 1
    if fraction is not None:
        assert stats.evictions > 0
    _assert_alike((graph, evicted, stats, grads), (py_graph, py_evicted, py_stats, py_grads), eager)


def _kwargs_step(limit=None, python=False):
    """A step of ops called with keyword arguments, as autocast and user code call them: a cast
    (``_to_copy(dtype=)``), ``add(alpha=)``, ``ones_like(dtype=)``, ``sum(dtype=)``, a factory
    (``scalar_tensor``, as ``torch.where`` with a number makes it), ``var_mean(correction=)`` of
    several outputs, the same of an empty tensor (only empty outputs: the Python continuation),
    and ``searchsorted(sorter=)``, whose keyword argument is a tensor (the Python path). Returns
    the gradients, the graph after the backward, the evictions after each op, the stats, the
    names of the ops that reached ``_execute`` or ``_register_several``, and the keyword
    arguments ``_make_room`` was given; with ``limit=False``, eager's."""
    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    edges = torch.arange(8.0)
    engine = dtr.budget(limit, cost="estimate") if limit is not False else None
    graph = None
    in_python = []
    room = []
    make_room = Driver._make_room

    def sized(driver, facts, func, vals, kw):
        room.append((facts.name, {k: _tensor(v) for k, v in kw.items()}))
        return make_room(driver, facts, func, vals, kw)

    with _spied_block(python, engine, ("_execute", "_register_several"), in_python) as (evicted, patch):
        patch.setattr(Driver, "_make_room", sized)
        h = torch.tanh(x @ w)
        wide = h.to(torch.float64)
        h = torch.add(h, wide.to(torch.float32), alpha=0.5)
        h = torch.where(h > 0, h, 0.25) * torch.ones_like(h, dtype=torch.float32)
        var, mean = torch.var_mean(h, 1, correction=0)
        nothing, _ = torch.var_mean(h[:0], 1, correction=0)
        bins = torch.searchsorted(edges, h.detach(), sorter=torch.arange(8))
        loss = var.sum() + mean.sum(dtype=torch.float64).float() + nothing.sum() + (bins.sum() * 0).float()
        loss.backward()
        if engine is not None:
            graph = _graph(engine.runtime)
    return [x.grad, w.grad], graph, evicted, engine and engine.stats(), in_python, room


@pytest.mark.parametrize("fraction", [None, 0.5])
@pytest.mark.filterwarnings("ignore:var_mean.*degrees of freedom")  # of the empty tensor
@needs_native
def test_both_paths_register_ops_with_keyword_arguments_alike(fraction):
    """Simple ops and ops of several outputs whose keyword arguments hold no tensors run
    natively, and build the graph the Python path builds (the records' keyword templates
    included): evictions after each op, the keyword arguments room is made with, stats equal;
    gradients eager's. A tensor among the keyword arguments takes the Python path."""
    eager = _kwargs_step(False)[0]
    unlimited = _kwargs_step(None)[3]
    limit = None if fraction is None else budget_at(unlimited, fraction)
    grads, graph, evicted, stats, in_python, room = _kwargs_step(limit)
    py_grads, py_graph, py_evicted, py_stats, py_in_python, py_room = _kwargs_step(limit, python=True)
    with_kwargs = {"aten._to_copy.default", "aten.add.Tensor", "aten.ones_like.default", "aten.sum.default",
                   "aten.scalar_tensor.default", "aten.var_mean.correction"}
    assert with_kwargs <= set(py_in_python)
    assert "aten.searchsorted.Tensor" in in_python
    assert "aten.var_mean.correction" in in_python  # the empty one, in _register_several
    if fraction is None:  # under a budget an op with an evicted input takes the Python path
        assert in_python.count("aten.var_mean.correction") == 1, in_python
        assert not (with_kwargs - {"aten.var_mean.correction"}) & set(in_python), in_python
    else:
        assert stats.evictions > 0
        assert any(kw for _, kw in room), room
    assert room == py_room
    _assert_alike((graph, evicted, stats, grads), (py_graph, py_evicted, py_stats, py_grads), eager)


def _list_views_step(limit=None, python=False):
    """A step of view ops returning lists (``OpFacts.list_view``): ``unsafe_chunk`` (as the
    ``LSTMCell`` and ``GRUCell`` kernels split their gates), ``chunk``, ``split`` by sizes of a
    base evicted first (the native path hands it to the Python path), ``unbind``, ``unbind`` of
    an empty dimension (an empty list: the general registration), and ``split`` of a constant
    (plain views). Returns the gradients, the graph after the
    backward, the evictions after each op, the stats, and the names of the ops that reached the
    Python path's ``_run_view``, ``_execute`` or ``_register``; with ``limit=False``,
    eager's."""
    torch.manual_seed(0)
    x = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(16, 48, requires_grad=True)
    c = torch.randn(12, 16)
    engine = dtr.budget(limit, cost="estimate") if limit is not False else None
    graph = None
    in_python = []
    names = ("_run_view", "_execute", "_register")
    with _spied_block(python, engine, names, in_python, by_method=True) as (evicted, _):
        gates = x @ w
        i, f, g = gates.unsafe_chunk(3, 1)
        h = torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * c
        a, b = (h * 2).chunk(2, 0)
        if engine is not None:  # an evicted base: the native path hands the op to Python's
            rt = engine.runtime
            assert rt.evict([rt.resolve(h._dtr.cell).storage])
        left, right = h.split([4, 12], 1)
        rows = (a + b).unbind(0)
        nothing = h[:, :0].unbind(1)
        plain = c.split(8, 1)
        loss = left.sum() * right.mean() + sum(r.pow(2).sum() for r in rows) + len(nothing)
        loss = loss + (h * plain[0].sum()).sum()
        loss.backward()
        if engine is not None:  # with the estimated cost of the ops run, which plans profile
            graph = _graph(engine.runtime), engine._driver.op_seconds
    return [x.grad, w.grad], graph, evicted, engine and engine.stats(), in_python


@pytest.mark.parametrize("fraction", [None, 0.5])
@needs_native
def test_both_paths_register_list_views_alike(fraction):
    """View ops returning a list of views of their only tensor argument run natively
    (``view_op`` in hotpath.c), and build the graph the Python path's one-pass
    ``Views._run_view`` builds: records, evictions after each op and stats equal, gradients
    eager's. An empty list goes to ``Driver._register`` on both paths."""
    eager = _list_views_step(False)[0]
    unlimited = _list_views_step(None)[3]
    limit = None if fraction is None else budget_at(unlimited, fraction)
    grads, graph, evicted, stats, in_python = _list_views_step(limit)
    py_grads, py_graph, py_evicted, py_stats, py_in_python = _list_views_step(limit, python=True)
    lists = {"aten.unsafe_split.Tensor", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int"}
    assert lists <= {name for path, name in py_in_python if path == "_run_view"}
    assert ("_register", "aten.unbind.int") in in_python and ("_register", "aten.unbind.int") in py_in_python
    assert ("_run_view", "aten.split_with_sizes.default") in in_python  # its base evicted
    if fraction is None:  # under a budget an op with an evicted base takes the Python path
        handed = [name for path, name in in_python if path == "_run_view" and name in lists]
        assert handed == ["aten.split_with_sizes.default"], in_python
    else:
        assert stats.evictions > 0
    _assert_alike((graph, evicted, stats, grads), (py_graph, py_evicted, py_stats, py_grads), eager)


def _sums_step(limit=None, python=False):
    """A step whose backward sums gradients every way the native path decides: a weight used
    nine times (its running sum written in place), one used through ``F.linear`` (gradients
    arriving transposed), a tensor used three ways whose gradients a hook keeps (never
    written in place), a running sum a hook keeps while a view of it is summed into again,
    and a backward formula that adds a vector to a summed gradient (an ``add`` in the
    backward that is no sum: the shapes differ). Returns the gradients, what
    the hook kept, the graph after the backward, the evictions after each op, and the stats;
    with ``limit=False``, eager's."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    v = torch.randn(16, 16, requires_grad=True)
    u = torch.randn(64, 16, requires_grad=True)
    x = torch.randn(64, 16)
    kept = []
    engine = dtr.budget(limit, cost="estimate") if limit is not False else None
    graph = None
    with _python_path() if python else contextlib.nullcontext(), _evictions(True) as evicted:
        with engine if engine is not None else contextlib.nullcontext():
            h = x * 1
            for _ in range(8):
                h = torch.tanh(h @ w)
            for _ in range(4):
                h = torch.tanh(torch.nn.functional.linear(h, v))
            h = _Shifted.apply(h, u)
            h = h * h + h  # used twice: its gradient is a sum
            a = h @ w
            branches = [torch.tanh(a), a * a, torch.sin(a)]
            for b in branches:
                b.grad_fn.register_hook(lambda grad_inputs, grad_outputs: kept.extend(grad_inputs))
            # A running sum a hook keeps, and that a transpose's backward passes on as a view
            # before it is summed into again: two wrappers over its storage.
            p = x @ u.t()
            doubled = p * 2  # made before ``q``: its backward runs after TBackward's
            q = p.t()
            r = torch.tanh(q) + torch.sin(q) + q * q
            q.grad_fn.register_hook(lambda grad_inputs, grad_outputs: kept.append(grad_outputs[0]))
            (sum(branches).sum() + r.sum() + doubled.sum()).backward()
            if engine is not None:
                graph = _graph(engine.runtime)
            kept = [dtr.materialize(g).clone() for g in kept if g is not None]
    return [w.grad, v.grad, u.grad], kept, graph, evicted, engine and engine.stats()


class _Shifted(torch.autograd.Function):
    """``x``, whose gradient comes back shifted by the first row of ``p``, a leaf of ``x``'s
    shape that gets no gradient: a broadcasting ``add`` of the incoming gradient inside a
    backward formula whose node leads to a leaf of the sum's shape (were it taken for a sum,
    it would be made permanent as a parameter's gradient)."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.save_for_backward(p)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return g + p[0].detach(), None


@pytest.mark.parametrize("fraction", [None, 0.5])
@pytest.mark.parametrize("exclusive", [True, False])
@needs_native
def test_both_paths_sum_gradients_alike(fraction, exclusive, monkeypatch):
    """Sums into a running sum made permanent run natively (hotpath.c's ``sum_op``; the Python
    ``_add_to_permanent`` is not called) and leave the graph, the evictions after each op, the
    stats, the gradients and what a hook kept exactly as the Python path does; also where the
    exclusivity test says no to every sum (then nothing is written in place)."""
    from dtr.eager import accumulation

    accumulation.calibrate()  # its own block, once per process: not one of the logged ones
    if not exclusive:
        monkeypatch.setattr(accumulation, "exclusive", lambda args: False)
    grads, kept, _, _, _ = _sums_step(False)
    limit = None
    if fraction is not None:
        limit = budget_at(_sums_step(None, python=True)[4], fraction)
    calls = []
    add = Driver._add_to_permanent
    monkeypatch.setattr(Driver, "_add_to_permanent", lambda d, args: calls.append(1) or add(d, args))
    asked = []
    test = accumulation.exclusive
    monkeypatch.setattr(accumulation, "exclusive", lambda args: asked.append(1) or test(args))
    got = _sums_step(limit)
    native_calls, native_asked = len(calls), len(asked)
    want = _sums_step(limit, python=True)
    assert native_calls == 0  # the native path wrote the running sums itself
    assert (len(calls) > 0) == exclusive  # and the Python path did, where it could
    assert native_asked == len(asked) - native_asked > 0  # the exclusivity test, as often
    assert got[2] == want[2] and got[3] == want[3] and got[4] == want[4]
    assert (got[4].evictions > 0) == (fraction is not None)
    for g, w, e in zip(got[0], want[0], grads):
        assert torch.equal(g, w) and torch.equal(g, e)
    assert len(got[1]) == len(kept) == len(want[1]) > 0
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got[1], want[1], kept))


def _constant_uses(table, model, batch):
    """A constant table's uses (``Constants.uses``), keyed by what each constant is."""
    names = {id(p): n for n, p in model.named_parameters()}
    names.update((id(t), f"batch {i}") for i, t in enumerate(batch if isinstance(batch, (list, tuple)) else [batch]))
    return sorted((names.get(k, "other"), n) for k, n in table.uses.items()), len(table.memory), len(table.addresses)


def _release_step(name, fraction, python):
    """A step of zoo model ``name`` at ``fraction`` of its peak (None: no budget), with the graph
    and the constant table after its backward pass, the constant table after the block's exit,
    and the gradients."""
    w = zoo.build(name, "tiny")
    model = fresh_model(w)
    with _python_path() if python else contextlib.nullcontext():
        limit = None
        if fraction is not None:
            limit = budget_at(run_step(w, fresh_model(w), None, cost="estimate").stats, fraction)
        torch.manual_seed(0)
        with dtr.budget(limit, cost="estimate") as engine:
            table = engine._driver.constants
            w.loss_fn(model, w.batch).backward()
            h = engine.runtime.heuristic
            log = None if h._log is None else [s.sid for s in h._log]  # h_DTR^eq's lowered keys
            before = _graph(engine.runtime), _constant_uses(table, model, w.batch), log, h._slack
        after = _constant_uses(table, model, w.batch), engine.stats()
    return before, after, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["lstmcell", "treelstm", "transformer"])
@pytest.mark.parametrize("fraction", [None, 0.5])
@needs_native
def test_both_paths_release_alike(name, fraction):
    """What a release changes (the runtime's books, h_DTR^eq's sets of evicted storages, the
    constants' uses) is the same on both paths, where it runs from C: in the backward pass, as
    wrapper deaths and gradient sums release, and at the block's exit, where the lineage the
    program kept goes. With no budget, the sets are the eager evictions' and the candidate index
    is not listening; under one it is, and h_DTR^eq logs the keys a release lowers."""
    got = _release_step(name, fraction, python=False)
    want = _release_step(name, fraction, python=True)
    assert got[0] == want[0]
    assert any(type(row[-1]) is tuple for row in got[0][0][:-6])  # union-find sets were kept
    assert got[0][1][0]  # records that read constants were alive
    assert (got[0][2] is not None and got[0][3] > 0) == (fraction is not None)  # the index listened
    assert got[1] == want[1]
    assert got[1][0] == ([], 0, 0)  # every use was forgotten at the exit
    for g, w in zip(got[2], want[2]):
        assert torch.equal(g, w)


@needs_native
def test_both_paths_count_a_constant_that_one_op_reads_twice():
    """A record reading one constant twice holds two of its uses and gives both back when it is
    forgotten: in C while the constant keeps a use after that, in Python when it loses its last
    (the table then forgets the constant)."""
    x = torch.randn(4, 4)

    def run(python):
        with _python_path() if python else contextlib.nullcontext():
            with dtr.budget(None) as engine:
                uses = engine._driver.constants.uses
                w = x + 1
                y = x * x
                z = y * 2
                seen = [list(uses.values())]
                del w  # w's record is forgotten: x keeps y's two uses
                torch.zeros(1)  # an op: the wrappers' deaths are applied at the next one
                seen.append(list(uses.values()))
                del y, z  # and y's, x's last two
                torch.zeros(1)
                seen.append(list(uses.values()))
        return seen

    assert run(python=False) == run(python=True) == [[3], [2], []]


def _run(program, seed, limit, python, observed):
    """``run_dtr`` on one path: its outcome (None if out of budget), evictions and error."""
    with _python_path() if python else contextlib.nullcontext(), _evictions(observed) as evicted:
        try:
            return run_dtr(program, seed, limit), evicted, None
        except dtr.OutOfBudgetError as e:
            return None, evicted, str(e)


@needs_native
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs, seed=st.integers(0, 2**16), fraction=st.floats(0.05, 1.0))
def test_random_programs_take_the_same_decisions_on_both_paths(program, seed, fraction):
    eager = run_eager(program, seed)
    assume(eager is not None)
    with _python_path():
        limit = budget_at(run_dtr(program, seed, None).stats, fraction)
    for observed in (False, True):
        got, evicted, error = _run(program, seed, limit, python=False, observed=observed)
        want, want_evicted, want_error = _run(program, seed, limit, python=True, observed=observed)
        assert evicted == want_evicted
        assert error == want_error
        if got is not None:
            assert got.stats == want.stats
            assert_as_eager(got, eager)
            assert_as_eager(want, eager)


@needs_native
def test_an_op_the_native_path_hands_back_changes_nothing():
    mul = torch.ops.aten.mul.Tensor
    x = torch.randn(8, 8)
    with dtr.budget(None, cost="estimate") as engine:
        y = x * 2
        z = y + 1  # keeps y's lineage: y can be evicted
        rt = engine.runtime
        s = y._dtr.cell.storage
        assert rt.evict([s]) == s.nbytes
        before = (rt.memory, rt.clock, rt.next_sid, s.locks, s.refs, s.uses, len(rt.live_refs()))
        assert native.run_simple(rt.executor, facts_for(mul), mul, (y, y)) is native.FALLBACK
        assert (rt.memory, rt.clock, rt.next_sid, s.locks, s.refs, s.uses, len(rt.live_refs())) == before
        assert torch.equal(dtr.materialize(y * y), (x * 2) * (x * 2))  # the Python path runs it
        del z


@needs_native
def test_an_in_place_op_the_native_path_hands_back_changes_nothing():
    """An in-place op goes to the Python path, with nothing changed, where that path has more
    to do than register a new version: the written tensor evicted (to rematerialize), handed
    to the program (``dtr.materialize``), a constant, or without lineage while a record reads
    it (``lineage.before_write`` makes the readers permanent first)."""
    add_ = torch.ops.aten.add_.Tensor
    facts = facts_for(add_)
    assert facts.in_place
    x = torch.randn(8, 8)
    constant = torch.randn(8, 8)
    with dtr.budget(None, cost="estimate") as engine:
        rt = engine.runtime
        y = x * 2
        z = y + 1  # reads y: y can be evicted, and its writes must keep z's lineage
        evicted = y._dtr.cell.storage
        assert rt.evict([evicted]) == evicted.nbytes
        handed = x * 3
        dtr.materialize(handed)
        cut = x * 4
        reader = cut + 1
        rt.make_permanent([cut._dtr.cell.storage])  # lineage cut, read by ``reader``'s record
        assert cut._dtr.cell.storage.uses and not cut._dtr.cell.storage.recomputable
        for written, other in ((y, z), (handed, z), (constant, z), (cut, z)):
            storages = list(rt.storages())
            before = (rt.memory, rt.clock, rt.next_sid, len(rt.live_refs()),
                      [(s.locks, s.refs, s.uses, s.state, s.forward) for s in storages])
            assert native.run_simple(rt.executor, facts, add_, (written, other)) is native.FALLBACK
            assert (rt.memory, rt.clock, rt.next_sid, len(rt.live_refs()),
                    [(s.locks, s.refs, s.uses, s.state, s.forward) for s in storages]) == before
        y.add_(z)  # the Python path runs them
        cut.add_(z)
        assert torch.equal(dtr.materialize(y), x * 2 + (x * 2 + 1))
        assert torch.equal(dtr.materialize(reader), x * 4 + 1)


class _Refused:
    """Refuses to be added to or tested for truth, as an allocation that fails would."""

    def __add__(self, other):
        raise MemoryError("refused")

    __radd__ = __iadd__ = __add__

    def __bool__(self):
        raise MemoryError("refused")


@pytest.mark.parametrize("python", [False, True])
def test_a_view_op_that_fails_before_its_registration_unlocks_its_base(python):
    """A view op (one view, a list of views) that fails after its kernel and before
    ``complete`` takes over the lock leaves its base unlocked, so that it stays evictable; here
    the count of the op's seconds fails, as an allocation there would."""
    x = torch.randn(4, 8)
    with _python_path() if python else contextlib.nullcontext(), dtr.budget(None, cost="estimate") as engine:
        y = x * 2
        driver = engine.runtime.executor
        s = y._dtr.cell.storage
        for view in (lambda t: t.view(-1), lambda t: t.split(2)):
            driver.op_seconds, total = _Refused(), driver.op_seconds
            try:
                with pytest.raises(MemoryError, match="refused"):
                    view(y)
            finally:
                driver.op_seconds = total
            assert s.locks == 0
        assert torch.equal(dtr.materialize(y.view(-1)), (x * 2).view(-1))


@pytest.mark.parametrize("python", [False, True])
def test_an_in_place_op_whose_lineage_test_fails_raises_before_writing(python):
    """An in-place op on a tensor that records read asks whether a replay can rebuild it (if
    not, its readers become permanent first); an error there reaches the program before the
    kernel runs: the tensor keeps its data, and the op's inputs are unlocked."""
    x = torch.randn(4, 8)
    with _python_path() if python else contextlib.nullcontext(), dtr.budget(None, cost="estimate"):
        y = x * 2
        z = x + 1
        w = y + 1  # a record reads y
        rec = y._dtr.cell.storage.parent
        rec.replayable, replayable = _Refused(), rec.replayable
        try:
            with pytest.raises(MemoryError, match="refused"):
                y.add_(z)
        finally:
            rec.replayable = replayable
        assert y._dtr.cell.storage.locks == 0 and z._dtr.cell.storage.locks == 0
        assert torch.equal(dtr.materialize(y), x * 2) and torch.equal(dtr.materialize(w), x * 2 + 1)


def _clears_errors_when_freed():
    """An object whose deallocation clears the pending error (a capsule whose destructor is
    ``PyErr_Clear``), as freeing a CUDA tensor did while torch recorded memory history with
    Python stacks (Note [Letting go with an error pending] in hotpath.c)."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new(1, None, ctypes.cast(ctypes.pythonapi.PyErr_Clear, ctypes.c_void_p))


@pytest.mark.parametrize("python", [False, True])
def test_a_refusal_survives_an_output_whose_deallocation_clears_errors(python, monkeypatch):
    """A refused op's output is freed on the way out with the ``OutOfBudgetError`` set; a
    deallocation that clears pending errors must not turn the refusal into ``SystemError:
    error return without exception set``."""
    facts = facts_for(torch.ops.aten.mul.Tensor)
    kernel = facts.kernel

    def marked(*args, **kwargs):
        out = kernel(*args, **kwargs)
        out.dtr_test_finalizer = _clears_errors_when_freed()
        return out

    monkeypatch.setattr(facts, "kernel", marked)
    x = torch.randn(1024)
    with _python_path() if python else contextlib.nullcontext(), pytest.raises(dtr.OutOfBudgetError):
        with dtr.budget(6 * 1024):
            a = x + 1  # 4 KiB, the only storage the block holds
            a * 2  # 4 KiB more with ``a`` locked: refused once it has run (outputs.fit)


@needs_native
def test_a_record_class_changed_without_hotpath_c_turns_the_native_path_off():
    from dtr_ext import _hotpath

    class Wider(Storage):
        __slots__ = ("extra",)

    config = native._config()
    config["Storage"] = Wider
    try:
        with pytest.raises(TypeError, match="slots, the native path fills"):
            _hotpath.bind(config)
        with pytest.raises(RuntimeError, match="bind"):
            native.run_simple(None, None, None, ())
    finally:
        _hotpath.bind(native._config())


# The engine's property tests: the stateful machine, random programs against eager, the
# simulator against real runs, and the heuristics.
_PROPERTY_TESTS = ("test_runtime_stateful.py", "test_programs.py", "test_sim.py", "test_heuristics.py")


@needs_native
def test_the_engine_property_tests_pass_without_the_native_path():
    """The suite runs with the native path; the Python path it mirrors must stand on its own
    too (issue 20): the engine's property tests, in a child process with ``DTR_PUREPYTHON=1``
    (which turns off the native collector too, where ``_python_path`` only drops the per-op
    path)."""
    here = Path(__file__).parent
    # The parent run's selection and plugins are not the child's: it runs every test there.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["DTR_PUREPYTHON"] = "1"

    def child(*options):
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options,
             *(str(here / f) for f in _PROPERTY_TESTS)],
            env=env, cwd=here.parent, capture_output=True, text=True, timeout=900,
        )

    collected = re.search(r"(\d+) tests? collected", child("--collect-only").stdout)
    run = child()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert collected and re.match(rf"{collected.group(1)} passed in ", summary), summary


TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"


def _simulated_evictions(path, fraction, heuristic, ordinary):
    """The storages ``dtr.simulate`` evicts on the trace at ``path`` at ``fraction`` of its
    peak, in order, and its result, with ``ordinary`` as the candidate index's search (None:
    the Python one)."""
    evicted = []
    init, evict = Runtime.__init__, Runtime._evict

    def made(rt, *args, **kwargs):
        init(rt, *args, **kwargs)
        rt.native_ordinary = ordinary

    def logged(rt, s):
        evicted.append(s.sid)
        evict(rt, s)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Runtime, "__init__", made)
        patch.setattr(Runtime, "_evict", logged)
        peak = dtr.simulate(path, None).peak_bytes
        result = dtr.simulate(path, int(peak * fraction), heuristic=heuristic, max_recompute=10.0)
    return evicted, result


@needs_native
@pytest.mark.parametrize("trace,fraction", [
    ("mlp", 0.3), ("transformer", 0.3), ("lstmcell", 0.5), ("treelstm", 0.5), ("gru_cell", 0.3),
    ("lstm_cell_masked", 0.5), ("treelstm_batch", 0.5), ("gru", 0.3),
])
@pytest.mark.parametrize("heuristic", ["dtr_eq", "dtr"])
def test_both_searches_evict_alike_on_the_zoo_traces(trace, fraction, heuristic):
    """The candidate index's native search (hotpath.c's ``ordinary``, with h_DTR^eq's key native
    and any other heuristic's key called in Python) evicts the same storages in the same order
    as ``CandidateIndex._ordinary`` on the shipped traces, through the simulator, which drives
    the same runtime as ``dtr.budget``."""
    path = TRACES / f"{trace}.jsonl.gz"
    got, got_result = _simulated_evictions(path, fraction, heuristic, native.ordinary)
    want, want_result = _simulated_evictions(path, fraction, heuristic, None)
    assert len(want) > 20
    assert got == want
    assert got_result == want_result


@pytest.mark.parametrize("trace,fraction,heuristic", [
    ("treelstm_batch", 0.5, "dtr_eq"), ("treelstm_batch", 0.5, "size"), ("gru_cell", 0.3, "lru"),
    ("transformer", 0.3, "size"),
])
def test_sorted_chunks_examine_rows_in_argmin_order(trace, fraction, heuristic, monkeypatch):
    """Note [Examination order]: a round that reads its rows from sorted chunks (here from the
    first row on, one row in the first chunk, so that chunks end inside runs of equal bounds)
    evicts what one that finds every row by argmin evicts, in the same order; "size" and
    LRU tie on many bounds."""
    from dtr.core import candidates

    path = TRACES / f"{trace}.jsonl.gz"
    monkeypatch.setattr(candidates, "_ARGMINS", 10**9)
    want, want_result = _simulated_evictions(path, fraction, heuristic, None)
    monkeypatch.setattr(candidates, "_ARGMINS", 0)
    monkeypatch.setattr(candidates, "_FIRST_CHUNK", 1)
    sorted_chunks = []
    sort_next = candidates.CandidateIndex._sort_next
    monkeypatch.setattr(candidates.CandidateIndex, "_sort_next", lambda index: sorted_chunks.append(1) or sort_next(index))
    got, got_result = _simulated_evictions(path, fraction, heuristic, None)
    assert len(want) > 20 and len(sorted_chunks) > 20
    assert got == want
    assert got_result == want_result


@needs_native
def test_the_native_key_is_h_dtr_eq_s_next_to_many_evicted_sets():
    """h_DTR^eq's key in C is the Python one's float, also for a storage next to more evicted
    union-find sets than the C keeps on its stack (16): 40 products of one tensor, evicted."""
    from dtr_ext import _hotpath

    w = torch.randn(64, 64, requires_grad=True)
    with dtr.budget(12 * 64 * 64 * 4, cost="estimate") as engine:
        x = torch.randn(64, 64) @ w
        products = [x * float(k) for k in range(40)]
        rt = engine.runtime
        storages = list(rt.storages())
        sets = {
            s.sid: len({find(n.hdata) for n in s.dependents if n.state is State.EVICTED})
            for s in storages
        }
        assert max(sets.values()) > 16
        for s in storages:
            assert _hotpath.dtreq_key(s) == rt.heuristic.key(s), s
    del products


@needs_native
def test_the_native_size_lookup_builds_python_s_keys(monkeypatch):
    """Near the budget the native path looks an op's output size up itself (``make_room`` in
    hotpath.c): under the key ``output_size.output_bytes`` builds, for tensors, lists of them,
    numbers of each type (NaN too), other constants and keyword arguments; a miss (None) is left
    to Python, and a settled entry gives no key."""
    from dtr_ext import _hotpath
    from dtr.eager import output_size

    for name in ("_SIZES", "_SETTLED", "_UNSIZED"):  # the process's own entries stay as they are
        monkeypatch.setattr(output_size, name, type(getattr(output_size, name))())
    aten = torch.ops.aten
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    cases = [
        (aten.mm.default, [x, y], {}),
        (aten.cat.default, [[x, x, x], 0], {}),
        (aten.full.default, [(1000,), 1.0], {}),
        (aten.full.default, [(1000,), 1], {}),
        (aten.full.default, [(1000,), True], {}),
        (aten.full.default, [(10,), float("nan")], {}),
        (aten.sum.dim_IntList, [x, [1]], {"dtype": torch.float64}),
        (aten.add.Tensor, (x, x), {"alpha": 2}),
        (aten.new_empty.default, [x, [7]], {"dtype": None}),
    ]
    for func, args, kwargs in cases:
        assert _hotpath.cached_size(func, args, kwargs) is None  # a miss: Python sizes it on meta
        want = output_size.output_bytes(func, args, kwargs)
        assert want[0] is not None and want[1] > 0
        assert _hotpath.cached_size(func, args, kwargs) == want
    func, args, kwargs = cases[0]
    key, _ = output_size.output_bytes(func, args, kwargs)
    output_size.correct(key, func(*args), args, kwargs)
    assert _hotpath.cached_size(func, args, kwargs) == (None, 3 * 5 * 4)


def test_both_paths_queue_wrapper_deaths_alike():
    """The native callback of wrapper deaths (``native.wrapper_death``) queues the cells and
    drops the Refs that ``Runtime._on_wrapper_death`` does while the block is open, and runs that
    method once the block has closed."""
    if not native.NATIVE:
        pytest.skip(native.WHY_NOT)

    def deaths(python):
        x = torch.randn(8, 8)
        with _python_path() if python else contextlib.nullcontext():
            with dtr.budget(None) as engine:
                rt = engine.runtime
                ys = [x * (i + 1) for i in range(6)]
                callback = rt._wrapper_died
                refs = len(rt._refs)
                sids = [y._dtr.cell.storage.sid for y in ys]
                del ys[4], ys[1]  # queued, not applied: no op runs after them
                queued = [c.storage.sid for c in rt._dead]
                assert queued == [sids[4], sids[1]]
                open_state = (refs - len(rt._refs), queued)
                z = ys[0] + 1  # the next op applies them: both storages are released
                applied = len(rt._dead), {sids[4], sids[1]} & {s.sid for s in rt.storages()}
        del ys, z  # after the block
        return callback, open_state, applied, len(rt._refs)

    native_run, python_run = deaths(False), deaths(True)
    assert not hasattr(native_run[0], "__func__") and python_run[0].__func__ is Runtime._on_wrapper_death
    assert native_run[1:] == python_run[1:]
    assert native_run[1][0] == 2 and native_run[2] == (0, set()) and native_run[3] == 0
