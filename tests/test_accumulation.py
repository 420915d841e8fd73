"""Gradients summed in place, as eager autograd sums them (Note [Accumulation in place] in
dtr/eager/accumulation.py): bytes against torch.profiler, values against eager, and sums that
someone else can see left out of place."""

from __future__ import annotations

import contextlib

import pytest
import torch

import dtr
from dtr.eager import accumulation, native
from dtr.sim import load
from dtr.testing.memory import profiled_peak
from fresh_process import run_python

WIDTH = 256  # a weight of 256 KiB, used USES times on a batch of 2: its gradients dominate
USES = 8


def _shared_weight_step(engine=None, batch=2, op="matmul"):
    """A loop over one shared weight (``h @ w``, or ``F.linear(h, w)``, whose weight gradients
    arrive transposed); returns its gradient."""
    torch.manual_seed(0)
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(batch, WIDTH)
    with engine if engine is not None else contextlib.nullcontext():
        h = x
        for _ in range(USES):
            h = torch.tanh(h @ w if op == "matmul" else torch.nn.functional.linear(h, w))
        h.sum().backward()
    return w.grad


@pytest.mark.parametrize(
    "make, dense",
    [
        (lambda: torch.empty(3, 4), True),
        (lambda: torch.empty(4, 3).t(), True),  # a linear layer's weight gradient
        (lambda: torch.empty(2, 3, 4).permute(2, 0, 1), True),
        (lambda: torch.empty(3, 1, 4)[:, :, ::1], True),
        (lambda: torch.empty(3, 8)[:, :4], False),  # gaps
        (lambda: torch.empty(4).expand(3, 4), False),  # overlaps
        (lambda: torch.empty([2] * 10).permute(*range(9, -1, -1)), True),  # many dimensions
        (lambda: torch.empty([2] * 9 + [4])[..., :2], False),
    ],
)
def test_dense_is_torchs_non_overlapping_and_dense(make, dense):
    import torch._prims_common as prims

    # torch 2.4 names it without the suffix.
    torchs = getattr(prims, "is_non_overlapping_and_dense_or_false", None)
    torchs = torchs or prims.is_non_overlapping_and_dense
    t = make()
    assert accumulation.dense(t) == dense == torchs(t)
    if native.NATIVE:  # hotpath.c's twin, which decides the sums the native path runs
        from dtr_ext import _hotpath

        assert _hotpath.dense(t) == dense


def test_calibration_finds_the_exclusive_counts():
    """This torch's autograd sums gradients through ``aten.add``: the calibration saw it, so
    sums are made in place (were it empty, every sum would silently be out of place)."""
    with dtr.budget(None):
        pass
    assert accumulation._exclusive, accumulation._exclusive


@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_shared_weight_gradients_are_summed_in_place(tmp_path, monkeypatch, op):
    """Summing a shared weight's gradients in place saves one gradient of true peak (the
    profiler's), gives eager's gradient bit for bit, and shows in the trace: one in-place add
    per sum that nothing else sees; the first sum into a parameter's gradient is made
    permanent, and every later one adds to that storage, with no new version."""
    expected = _shared_weight_step(op=op)
    trace = tmp_path / "t.jsonl"
    in_place = profiled_peak(lambda: _shared_weight_step(dtr.budget(None, cost="estimate", trace=trace), op=op))
    assert torch.equal(_shared_weight_step(dtr.budget(None, cost="estimate"), op=op), expected)
    events = load(trace).blocks[0]
    sums = [e for e in events if e["e"] == "op" and e["name"] == "aten.add_.Tensor"]
    # With F.linear the first sum's old is a transposed view whose base (the mm's output) the
    # running node still holds: another reference, so it is summed out of place, as autograd
    # does for a plain tensor whose storage is shared.
    in_place_sums = USES - 1 if op == "matmul" else USES - 2
    assert len(sums) == in_place_sums, [e["name"] for e in events if e["e"] == "op"]
    assert sum(e["e"] == "permanent" for e in events) == 1  # the first sum, in place or not
    # The later sums write the permanent one where it is: an op that makes nothing.
    assert [(e["mut"], e["new"], e["out"]) for e in sums[-(USES - 2):]] == [([], [], [])] * (USES - 2)

    monkeypatch.setattr(accumulation, "exclusive", lambda args: False)
    out_of_place = profiled_peak(lambda: _shared_weight_step(dtr.budget(None, cost="estimate"), op=op))
    grad_bytes = WIDTH * WIDTH * 4
    if op == "matmul":
        assert out_of_place - in_place >= 0.9 * grad_bytes, (in_place, out_of_place)
    else:  # the peak is at the first sum, out of place in both runs
        assert in_place <= out_of_place, (in_place, out_of_place)


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


def test_the_lstm_cell_loop_does_not_tip_into_thrashing(tmp_path):
    """The bench LSTMCell loop (64 steps, hidden 256) with a fixed cost table (``estimate``):
    with its weights' gradients summed out of place, simulations at 0.4 of its peak did not
    end in 20 s (each sum recomputable only through every one before it, and evicted as if
    cheap); summed in place and kept, 0.4 runs with a bounded number of replays."""
    from dtr.testing import zoo
    from dtr.testing.step import fresh_model, run_step

    w = zoo.build("lstmcell", "bench")
    trace = tmp_path / "lstmcell.jsonl.gz"
    run_step(w, fresh_model(w), None, cost="estimate", trace=trace)
    peak = dtr.simulate(trace, None).peak_bytes

    # max_recompute: a thrashing simulation stops (infeasible) instead of running for minutes.
    r = dtr.simulate(trace, int(0.4 * peak), max_recompute=10)
    assert r.feasible and r.slowdown < 2.0 and r.rematerializations < 3000, r


def test_sums_inside_a_backward_formula_stay_out_of_place(tmp_path):
    """``atan2``'s backward formula adds two temporaries of its own (C++ could read one again,
    and its reference counts look like a buffer's): no sum in place, eager's gradients."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch.atan2(x * 1.5, y).sum().backward()
    expected = (x.grad.clone(), y.grad.clone())
    x.grad = y.grad = None
    trace = tmp_path / "t.jsonl"
    with dtr.budget(None, cost="estimate", trace=trace):
        torch.atan2(x * 1.5, y).sum().backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(y.grad, expected[1])
    names = [e["name"] for e in load(trace).blocks[0] if e["e"] == "op"]
    assert "aten.add.Tensor" in names and "aten.add_.Tensor" not in names, names


def test_a_first_block_under_no_grad_calibrates(tmp_path):
    """The calibration runs its own backward whatever the caller's grad mode (a fresh process:
    it runs once per process)."""
    code = (
        "import torch, dtr\n"
        "from dtr.eager import accumulation\n"
        "with torch.no_grad():\n"
        "    with dtr.budget(None):\n"
        "        y = torch.ones(3) * 2\n"
        "print(accumulation._exclusive)\n"
    )
    out = run_python(code, timeout=120)
    assert out.strip() not in ("()", "None"), out
