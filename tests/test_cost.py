"""The roofline cost estimate (``cost="estimate"``, and the default on accelerators): matmuls
by their FLOPs, elementwise ops by their memory traffic, and ops that only make a new view of
their input by the fixed per-op overhead alone."""

from __future__ import annotations

import pytest
import torch

from dtr.eager import cost
from dtr.eager.cost import _ROOFLINE, estimate_seconds

aten = torch.ops.aten
FLOPS, BANDWIDTH, OVERHEAD = _ROOFLINE["cpu"]


def test_elementwise_ops_cost_their_memory_traffic():
    x = torch.randn(512, 512)
    moved = 3 * x.numel() * 4  # two inputs read, one output written
    assert estimate_seconds(aten.add.Tensor, (x, x), {}, (x + x,)) == pytest.approx(moved / BANDWIDTH + OVERHEAD)


def test_matmuls_cost_their_flops():
    a, b = torch.randn(256, 512), torch.randn(512, 1024)
    flops = 2 * 256 * 512 * 1024
    assert estimate_seconds(aten.mm.default, (a, b), {}, (a @ b,)) == pytest.approx(flops / FLOPS + OVERHEAD)


@pytest.mark.parametrize("op, args", [
    (aten.view.default, lambda x: (x, [-1])),
    (aten.t.default, lambda x: (x,)),
    (aten.transpose.int, lambda x: (x, 0, 1)),
    (aten.expand.default, lambda x: (x[:1], [1024, 1024])),
    (aten.detach.default, lambda x: (x,)),
    (aten._unsafe_view.default, lambda x: (x, [-1])),  # a view its schema does not declare
    (aten.transpose_.default, lambda x: (x.clone(), 0, 1)),  # changes view metadata in place
])
def test_views_move_no_data(op, args):
    x = torch.randn(1024, 1024)
    a = args(x)
    assert estimate_seconds(op, a, {}, (op(*a),)) == OVERHEAD


def _uncached(func, args, outs):
    cost._ESTIMATES.clear()
    return estimate_seconds(func, args, {}, outs)


def test_cached_estimates_tell_shapes_and_arguments_apart():
    """Note [Cached estimates]: each call gets what an empty cache would give it."""
    x = torch.randn(2, 8, 16, 16)
    w = torch.randn(8, 8, 3, 3)
    calls = []
    for stride, padding in ((1, 1), (2, 1), (1, 0)):
        conv_args = (x, w, None, [stride, stride], [padding, padding], [1, 1], False, [0, 0], 1)
        calls.append((aten.convolution.default, conv_args, (aten.convolution.default(*conv_args),)))
    for n in (16, 32):
        a = torch.randn(n, n)
        calls.append((aten.mm.default, (a, a), (a @ a,)))
        calls.append((aten.mm.default, (a.double(), a.double()), (a.double() @ a.double(),)))
    alone = [_uncached(f, a, o) for f, a, o in calls]
    assert len(set(alone)) == len(alone)  # every call here costs something different
    cost._ESTIMATES.clear()
    for _ in range(2):  # the second round reads the cache
        assert [estimate_seconds(f, a, {}, o) for f, a, o in calls] == alone
    assert len(cost._ESTIMATES) == len(calls)


def test_raw_formulas_are_not_cached(monkeypatch):
    """A formula registered raw reads values (sequence offsets): two calls with the same shapes
    and different values must not share an estimate."""
    def raw(a, b, *, out_val):  # no __wrapped__: registered raw
        return int(a.sum()) * 10**9

    monkeypatch.setitem(cost._FLOPS, aten.mm.default.overloadpacket, raw)
    cost._ESTIMATES.clear()
    ones, twos = torch.ones(4, 4), torch.full((4, 4), 2.0)
    first = estimate_seconds(aten.mm.default, (ones, ones), {}, (ones @ ones,))
    assert estimate_seconds(aten.mm.default, (twos, twos), {}, (twos @ twos,)) > first
    assert not cost._ESTIMATES


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(cost, "_MAX_ESTIMATES", 8)
    cost._ESTIMATES.clear()
    for n in range(1, 30):
        a = torch.randn(n, 3)
        estimate_seconds(aten.mm.default, (a, a.t()), {}, (a @ a.t(),))
        assert len(cost._ESTIMATES) <= 8
