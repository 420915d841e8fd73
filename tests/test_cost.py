"""The roofline cost estimate (``cost="estimate"``, and the default on accelerators): matmuls
by their FLOPs, elementwise ops by their memory traffic, and ops that only make a new view of
their input by the fixed per-op overhead alone."""

from __future__ import annotations

import pytest
import torch

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
