"""engine.explain(): what holds the budget (by group and op), the evictions and replays by the
op that made each tensor, and why the last OutOfBudgetError happened; checked against what the
programs below allocate."""

from __future__ import annotations

import pytest
import torch

import dtr
from dtr.core import OpRecord, Runtime, make_heuristic
from dtr.core.events import holdings
from dtr.sim.simulator import SimExecutor

N = 128  # 128 x 128 float32: 64 KiB per tensor
TENSOR = N * N * 4


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    y = x
    for _ in range(n):
        y = torch.tanh(y)
    return y


def test_before_any_block_the_report_is_empty_and_says_so():
    report = dtr.budget("1 MiB").explain()
    assert report.holdings == [] and report.failure is None
    assert "no block has run yet" in str(report)


def test_under_a_tight_budget_the_largest_holder_is_the_op_that_made_the_largest_tensor():
    x = torch.randn(N, N)
    with dtr.budget(12 * TENSOR, cost="estimate") as engine:
        ys = [chain(x, 1) for _ in range(8)]  # 8 tanh outputs, 8 tensors' bytes
        wide = torch.cat([ys[0]] * 10)  # one cat output, 10 tensors' bytes: tanh outputs go
        report = engine.explain()
        stats = engine.stats()
        del ys, wide
    assert report.moment.startswith("now")
    assert stats.evictions >= 6
    top = report.holdings[0]
    assert (top.group, top.op, top.count, top.nbytes) == ("activations", "aten.cat.default", 1, 10 * TENSOR)
    tanh = [h for h in report.holdings if h.op == "aten.tanh.default"]
    assert sum(h.nbytes for h in tanh) == 8 * TENSOR - stats.evictions * TENSOR
    # The report is a view of the engine's own accounting: it adds up to the resident bytes.
    assert sum(h.nbytes for h in report.holdings) == stats.resident_bytes
    assert "aten.cat.default" in str(report)


def test_evictions_and_replays_are_attributed_to_the_ops_that_made_the_tensors():
    x = torch.randn(N, N, requires_grad=True)
    with dtr.budget(6 * TENSOR, cost="estimate") as engine:
        chain(x * 1, 20).sum().backward()
    report, stats = engine.explain(), engine.stats()
    assert stats.evictions > 0 and stats.rematerializations > 0
    assert sum(t.count for t in report.evictions) == stats.evictions
    assert sum(t.count for t in report.replays) == stats.rematerializations
    assert sum(t.seconds for t in report.replays) == pytest.approx(stats.remat_seconds)
    assert {t.op for t in report.replays} <= {"aten.tanh.default", "aten.mul.Tensor"}
    assert all(t.nbytes == t.count * TENSOR for t in report.evictions + report.replays)
    # After a normal end: what the block kept then; its gradient is among it.
    assert report.moment.startswith("at the end of the last block")
    grads = [h for h in report.holdings if h.group == "gradients"]
    assert [h.nbytes for h in grads] == [stats.gradient_bytes] == [TENSOR]


def test_why_names_the_op_bytes_and_budget_of_the_out_of_budget_error():
    x = torch.randn(N, N)
    engine = dtr.budget(6 * TENSOR, cost="estimate")
    with pytest.raises(dtr.OutOfBudgetError) as info:
        with engine:
            y = chain(x, 3)
            torch.cat([y] * 8)  # 8 tensors' bytes in one output: cannot fit
    err = info.value
    report = engine.explain()
    f = report.failure
    assert (f.kind, f.op, f.needed_bytes, f.budget) == ("OutOfBudgetError", "aten.cat.default", err.needed_bytes, err.budget)
    assert report.moment == "when the last block's OutOfBudgetError was raised (aten.cat.default)"
    # What was held when the engine gave up: the cat's output and its input, locked.
    locked = {h.op: h.nbytes for h in f.holdings if h.group == "locked"}
    assert locked == {"aten.cat.default": 8 * TENSOR, "aten.tanh.default": TENSOR}
    assert sum(locked.values()) == err.needed_bytes
    text = str(report)
    assert "Why the last OutOfBudgetError: aten.cat.default" in text and str(err) in text


def test_a_failed_budget_change_is_explained_and_the_block_goes_on():
    x = torch.randn(N, N)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    opt = torch.optim.SGD([p], lr=0.1)
    with dtr.budget(None) as engine:
        y = chain(x, 4)
        opt.step()  # lineage dropped: y can no longer be recomputed
        with pytest.raises(dtr.OutOfBudgetError):
            engine.budget = TENSOR // 2
        report = engine.explain()
        z = y + 1
    f = report.failure
    assert (f.op, f.budget, f.needed_bytes) == ("set budget", TENSOR // 2, TENSOR)
    assert [(h.group, h.nbytes) for h in f.holdings] == [("not recomputable", TENSOR)]
    assert z.shape == (N, N)


def test_thrashing_is_explained_with_its_replays_and_ratio(monkeypatch):
    monkeypatch.setattr("dtr.core.rematerialize._THRASH_REPLAYS", 5)
    x = torch.randn(N, N, requires_grad=True)
    engine = dtr.budget(4 * TENSOR, cost="estimate", max_recompute=0.01)
    with pytest.raises(dtr.ThrashingError) as info:
        with engine:
            chain(x * 1, 30).sum().backward()
    f = engine.explain().failure
    assert (f.kind, f.replays, f.ratio) == ("ThrashingError", info.value.replays, info.value.ratio)
    assert "replays cost" in str(engine.explain())


def test_holdings_groups_on_the_engine():
    """Every group of ``holdings`` on a bare runtime: locked, protected, a loop's checkpoint,
    made in a backward pass, not recomputable, activations, gradients."""
    rt = Runtime(None, make_heuristic("dtr_eq"), SimExecutor())

    def op(name, nbytes, *inputs):
        rt.acquire(list(inputs))  # complete() unlocks an op's inputs
        (out,) = rt.complete(OpRecord(name, list(inputs), None, 1.0), (), ((nbytes, True, None),))
        return out

    a = op("make_a", 100)
    b = op("make_b", 200, a)
    c = op("make_c", 400)
    op("make_d", 800, c)
    f = op("make_f", 3200)
    rt.checkpoint([f.storage], 0)
    rt.set_backward(True)
    op("make_e", 1600, a)
    rt.set_backward(False)
    rt.acquire([a])  # locked
    rt.protect([b.storage])
    rt.make_permanent([c])  # cut from its op: not recomputable
    rt.hold("w", 50)
    got = {(h.group, h.op): h.nbytes for h in holdings(rt)}
    assert got == {
        ("locked", "make_a"): 100,
        ("protected by a plan", "make_b"): 200,
        ("loop checkpoints", "make_f"): 3200,
        ("not recomputable", "(lineage dropped)"): 400,
        ("activations", "make_d"): 800,
        ("made in backward", "make_e"): 1600,
        ("gradients", ".grad"): 50,
    }
    assert sum(got.values()) == rt.memory
