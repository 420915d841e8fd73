"""``DTR_CROSSCHECK=1``: every op a one-pass path registers is compared with the general path's
record (eager/crosscheck.py), on zoo models under budgets that evict, on a program of views,
in-place ops, keyword arguments and lists, and against fast paths made to drift."""

from __future__ import annotations

import pytest
import torch

import dtr
from dtr.eager import driver as driver_module
from dtr.eager import native
from dtr.eager import views as views_module
from dtr.eager.crosscheck import CrosscheckedDriver
from dtr.eager.driver import Driver
from dtr.eager.replay import Call
from dtr.testing import zoo
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step


@pytest.fixture
def comparisons(monkeypatch):
    """Turn the crosscheck on; the list receives each block's comparisons, by path."""
    monkeypatch.setenv("DTR_CROSSCHECK", "1")
    seen = []
    close = CrosscheckedDriver.close

    def counted(self, failed=False):
        seen.append(dict(self.crosschecked))
        return close(self, failed)

    monkeypatch.setattr(CrosscheckedDriver, "close", counted)
    return seen


# The MLP, a transformer block, an LSTMCell loop, a ResNet (batch norm, in-place ReLU, views)
# and a TreeLSTM (sums of many gradients in place).
@pytest.mark.parametrize("name", ["mlp", "transformer", "lstmcell", "resnet", "treelstm"])
def test_one_pass_paths_record_what_the_general_path_would(name, comparisons):
    w = zoo.build(name, "tiny")
    unlimited = run_step(w, fresh_model(w), None, cost="estimate")
    got = run_step(w, fresh_model(w), budget_at(unlimited.stats, 0.5), cost="estimate")
    assert_same(got, run_step(w, fresh_model(w), "eager"))
    assert got.stats.evictions > 0
    counts = comparisons[-1]
    assert counts["simple op"] > 0 and counts["one-view op"] > 0, counts
    if name in ("transformer", "lstmcell", "treelstm"):  # weights shared across uses
        assert counts["sum in place"] > 0, counts
    if name in ("lstmcell", "treelstm"):  # weights used three times and more
        assert counts["sum into a permanent sum"] > 0, counts
    if name in ("transformer", "resnet"):  # layer norm; convolution and batch-norm backward
        assert counts["several outputs"] > 0, counts
    if name in ("lstmcell", "resnet"):  # the cell's gates written in place; ReLU and the residual add_
        assert counts["in place"] > 0, counts


def _program(x, w):
    """Views (one, and a list), in-place ops, keyword arguments, lists, a random op and a factory."""
    h = torch.add(x @ w, x.t().sum(0, keepdim=True).t(), alpha=0.5)
    h = torch.dropout(h, 0.25, True).relu_()
    h = torch.cat([h, h * 2], dim=1).view(h.shape[0], 2, -1).transpose(0, 1)
    h = h + torch.ones(h.shape, dtype=h.dtype) * torch.rand_like(h)
    h.mul_(0.5).add_(x)  # the second with a constant
    return (h.unbind(0)[0] * h[1]).sum()


def test_views_in_place_ops_and_keyword_arguments(comparisons):
    torch.manual_seed(0)
    x = torch.randn(16, 16)
    w = torch.randn(16, 16, requires_grad=True)
    torch.manual_seed(1)
    _program(x, w).backward()
    expected, w.grad = w.grad, None
    with dtr.budget(None, cost="estimate"):
        torch.manual_seed(1)
        _program(x, w).backward()
    assert torch.equal(w.grad, expected)
    counts = comparisons[-1]
    assert counts["simple op"] > 0 and counts["one-view op"] > 0 and counts["in place"] > 0, counts
    assert counts["list-view op"] > 0, counts  # unbind


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("DTR_CROSSCHECK", raising=False)
    with dtr.budget(None) as engine:
        assert type(engine._driver) is Driver


class _GradFlipped(Call):
    """A record that says the op ran under the other grad mode."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.grad = not self.grad


# (x * 2).t(): the simple op mul, then the one-view op t, each made to drift in turn.
@pytest.mark.parametrize("module, op", [(driver_module, "aten.mul.Tensor"), (views_module, "aten.t.default")],
                         ids=["simple op", "one-view op"])
@pytest.mark.parametrize("name, value, field", [("_FIRST", (1,), "fresh"), ("Call", _GradFlipped, "grad")],
                         ids=["fresh positions", "grad mode"])
def test_a_fast_path_that_drifts_is_caught(module, op, name, value, field, monkeypatch, comparisons):
    monkeypatch.setattr(native, "run_simple", None)  # the Python path drifts (native: test_native.py)
    monkeypatch.setattr(module, name, value)
    x = torch.randn(8, 8)
    with pytest.raises(AssertionError, match=rf"DTR_CROSSCHECK: {op} \(.+\): {field} differs"):
        with dtr.budget(None, cost="estimate"):
            (x * 2).t()
