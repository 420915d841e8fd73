"""Gradients summed in place, as eager autograd sums them (Note [Accumulation in place] in
dtr/eager/accumulation.py): bytes against torch.profiler, values against eager, and sums that
someone else can see left out of place."""

from __future__ import annotations

import contextlib

import pytest
import torch

import dtr
from dtr.eager import accumulation
from dtr.sim import load
from dtr.testing.memory import profiled_peak

WIDTH = 256  # a weight of 256 KiB, used USES times on a batch of 2: its gradients dominate
USES = 8


def _shared_weight_step(engine=None, batch=2):
    """A loop over one shared weight; returns its gradient."""
    torch.manual_seed(0)
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(batch, WIDTH)
    with engine if engine is not None else contextlib.nullcontext():
        h = x
        for _ in range(USES):
            h = torch.tanh(h @ w)
        h.sum().backward()
    return w.grad


def test_calibration_finds_the_exclusive_counts():
    """This torch's autograd sums gradients through ``aten.add``: the calibration saw it, so
    sums are made in place (were it empty, every sum would silently be out of place)."""
    with dtr.budget(None):
        pass
    assert accumulation._exclusive, accumulation._exclusive


def test_shared_weight_gradients_are_summed_in_place(tmp_path, monkeypatch):
    """Summing a shared weight's gradients in place saves one gradient of true peak (the
    profiler's), gives eager's gradient bit for bit, and shows in the trace: one in-place add
    per sum, each sum into a parameter's gradient made permanent."""
    expected = _shared_weight_step()
    trace = tmp_path / "t.jsonl"
    in_place = profiled_peak(lambda: _shared_weight_step(dtr.budget(None, cost="estimate", trace=trace)))
    assert torch.equal(_shared_weight_step(dtr.budget(None, cost="estimate")), expected)
    events = load(trace).blocks[0]
    sums = [e for e in events if e["e"] == "op" and e["name"] == "aten.add_.Tensor"]
    assert len(sums) == USES - 1, [e["name"] for e in events if e["e"] == "op"]
    assert sum(e["e"] == "permanent" for e in events) == USES - 1

    monkeypatch.setattr(accumulation, "exclusive", lambda args: False)
    out_of_place = profiled_peak(lambda: _shared_weight_step(dtr.budget(None, cost="estimate")))
    grad_bytes = WIDTH * WIDTH * 4
    assert out_of_place - in_place >= 0.9 * grad_bytes, (in_place, out_of_place)


@pytest.mark.parametrize("fraction", [0.6, 0.4])
def test_sums_in_place_under_a_budget(fraction):
    """Under a budget that evicts (activations of a batch of 256 dominate), the sums stay
    eager's."""
    expected = _shared_weight_step(batch=256)
    probe = dtr.budget(None, cost="estimate")
    _shared_weight_step(probe, batch=256)
    engine = dtr.budget(int(fraction * probe.stats().peak_resident_bytes), cost="estimate")
    assert torch.equal(_shared_weight_step(engine, batch=256), expected)
    assert engine.stats().evictions > 0


def _kept_contributions_step(engine=None):
    """A tensor used four ways (twice by one op), with every gradient contribution flowing
    into it kept by a hook: a sum in place would change what was kept."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(64, 16)
    kept = []
    with engine if engine is not None else contextlib.nullcontext():
        a = x @ w
        branches = [torch.tanh(a), a * a, torch.sin(a)]  # a residual-like sum of branches
        for b in branches:  # whichever gradient arrives first is the one summed into
            b.grad_fn.register_hook(lambda grad_inputs, grad_outputs: kept.extend(grad_inputs))
        sum(branches).sum().backward()
        kept = [dtr.materialize(g).clone() if g is not None else None for g in kept]
    return w.grad, kept


@pytest.mark.parametrize("fraction", [None, 0.75])
def test_sums_others_can_see_stay_out_of_place(fraction):
    """Gradients kept by a hook, and one gradient passed to two inputs, are never written in
    place: what the hook kept and the weight's gradient equal eager's."""
    grad, kept = _kept_contributions_step()
    budget = None
    if fraction is not None:
        probe = dtr.budget(None, cost="estimate")
        _kept_contributions_step(probe)
        budget = int(fraction * probe.stats().peak_resident_bytes)
    got, got_kept = _kept_contributions_step(dtr.budget(budget, cost="estimate"))
    assert torch.equal(got, grad)
    assert len(got_kept) == len(kept) and all(torch.equal(a, b) for a, b in zip(got_kept, kept))
