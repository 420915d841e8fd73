"""``dtr.budget(..., plan=[segment])``: static plans for sequential segments, applied by DTR.

The first step with an input shape profiles the segment; later steps follow the plan's first
sweep (tapes dropped, checkpoints pinned) and leave the backward recomputations to DTR. Every
step must still give eager's values and gradients bit for bit. Most tests zero gradients in
place (they exist before each block): the rotor DPs do not model gradients made in the block,
which the engine charges until it ends (Note [Seeding] in dtr/eager/seeding/__init__.py).
"""

from __future__ import annotations

import warnings
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings

import dtr
from dtr.eager.driver import Driver
from dtr.planner import evaluate, store_all
from dtr.planner.hints import StageHint, forward_hints
from dtr.sim import load
from dtr.testing import zoo
from dtr.testing.step import fresh_model, run_step, zero_grads

from conftest import workload


def test_hints_of_the_papers_toy_plan():
    ops = [("F_ck", 1), ("F_none", 2), ("F_ck", 3), ("F_all", 4), ("B", 4), ("F_all", 3), ("B", 3),
           ("F_all", 1), ("F_all", 2), ("B", 2), ("B", 1)]
    assert forward_hints(ops, 4) == [
        StageHint(drop_tape=True, drop_input=False, pin_output=False),  # a^1 is dropped by F_none^2
        StageHint(drop_tape=True, drop_input=True, pin_output=True),
        StageHint(drop_tape=True, drop_input=False, pin_output=True),
        StageHint(drop_tape=False, drop_input=False, pin_output=True),
    ]
    with pytest.raises(ValueError, match="runs 2 of 3 stages"):
        forward_hints([("F_all", 1), ("F_all", 2), ("B", 2)], 3)


def _mlp():
    w = workload("mlp")
    peak = run_step(w, fresh_model(w), None, cost="estimate", set_to_none=False).stats.peak_resident_bytes
    return w, peak


def _steps(w, model, engine, n, path=None):
    """``n`` training steps of ``w`` in ``engine`` (one block each); the last one traced."""
    results = []
    for i in range(n):
        if path is not None and i == n - 1:
            engine.trace = path  # record only the last block
        results.append(run_step_in(w, model, engine))
    return results


def run_step_in(w, model, engine):
    zero_grads(model.parameters(), set_to_none=False)  # the regime plans model: module docstring
    torch.manual_seed(1)
    with engine:
        loss = w.loss_fn(model, w.batch)
        loss.backward()
        loss = dtr.materialize(loss)
    return loss, [p.grad.clone() for p in model.parameters()]


def _plan_and_chain(engine):
    (plans,) = engine.plans()
    (plan,) = plans.values()
    (chain, before, _), = engine._seeding.segments[0].profiles.values()  # the profiled costs
    return plan, chain, before


@pytest.mark.parametrize("fraction", [0.6, 0.5])
def test_a_seeded_mlp_follows_its_plan_and_matches_eager(fraction, tmp_path):
    w, peak = _mlp()
    eager = run_step(w, fresh_model(w), "eager")
    model = fresh_model(w)
    budget = int(peak * fraction)
    engine = dtr.budget(budget, cost="estimate", plan=[model.body])
    path = tmp_path / "seeded.jsonl"
    for loss, grads in _steps(w, model, engine, 3, path):
        assert torch.equal(loss, eager.loss)
        assert all(torch.equal(g, e) for g, e in zip(grads, eager.grads))
    plan, chain, before = _plan_and_chain(engine)
    assert plan is not None and any(kind != "F_all" for kind, _ in plan.ops)

    # The plan was applied: checkpoints held, tapes dropped, all through the engine.
    events = load(path).blocks[0]
    assert any(e["e"] == "protect" for e in events) and any(e["e"] == "evict" for e in events)

    # Its compute is the plan's: the segment's recomputations cost what the DP predicted
    # (within 5%), measured by replaying the seeded step's trace in the simulator.
    sim = dtr.simulate(path, budget)
    assert sim.feasible
    store_all_time, _ = evaluate(chain, store_all(chain))
    predicted = sim.base_cost + plan.makespan - store_all_time
    assert sim.total_cost == pytest.approx(predicted, rel=0.05)

    # And its memory: the engine's peak stays within what was resident before the segment,
    # plus the plan's peak, plus one op's outputs (the budget is enforced after each op), plus
    # the scalars made after the segment (the loss and its gradient: a few bytes).
    largest_op = max(n for e in events if e["e"] == "op" for n, base in e["new"] if base is None)
    assert sim.peak_bytes <= before + plan.peak + largest_op + 64


def test_a_planned_backward_stage_keeps_the_gradient_it_makes(tmp_path):
    """The gradient a stage's backward makes for its input is what the plan's next backward
    step reads: the seeded step protects it (``Runtime.protect_new``) instead of letting DTR
    evict it between the op that made it and its reader, then recompute it. Without that, the
    bench MLP at 0.35 of its peak replays six backward ``mm`` ops (99 ms, against 60 ms with
    it; at 0.4 it was six before finished stages were evicted, docs/planner.md)."""
    w = zoo.build("mlp", "bench")
    eager = run_step(w, fresh_model(w), "eager")
    peak = run_step(w, fresh_model(w), None, cost="estimate", set_to_none=False).stats.peak_resident_bytes
    model = fresh_model(w)
    engine = dtr.budget(int(peak * 0.35), cost="estimate", plan=[model.body])
    path = tmp_path / "seeded.jsonl"
    replayed = []
    original = Driver.replay

    def logged(self, rec):
        replayed.append(rec.name)
        return original(self, rec)

    run_step_in(w, model, engine)  # profiles the segment
    engine.trace = path
    with mock.patch.object(Driver, "replay", logged):
        loss, grads = run_step_in(w, model, engine)
    assert torch.equal(loss, eager.loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, eager.grads))
    assert "aten.addmm.default" in replayed  # the plan recomputes forward stages
    assert "aten.mm.default" not in replayed  # and no gradient
    events = [e for e in load(path).blocks[0] if e["e"] == "protect_new"]
    _, chain, _ = _plan_and_chain(engine)
    assert [e["on"] for e in events] == [True] * len(chain.forward_time) + [False]


@pytest.mark.parametrize("name, segment, fraction, bound", [
    ("transformer", lambda m: m.blocks, 0.5, 1.02),
    # 148 ms against 118 when the tape the plan keeps (F_all) was not protected and DTR evicted
    # part of it during the next block's backward; 123 ms with it, when the tape a stage's
    # backward reads was not protected during that backward (211 against 176 at 0.3).
    ("transformer", lambda m: m.blocks, 0.6, 1.02),
    ("transformer", lambda m: m.blocks, 0.3, 1.02),
    # 43 ms against 36.5 with the gradients zeroed in place (the regime these tests run in, as
    # plans do not model gradients made in the block); within 2% when they were made in the
    # block and left the accounting. The same 1.18x with the engine of 3cde937.
    ("mlp", lambda m: m.body, 0.4, 1.2),
    # 28.9 ms against 25.3 (docs/planner.md, what is left); 81 ms when the held loss, a small
    # storage, was evicted before the protected ones and recomputed with the whole forward.
    ("mlp", lambda m: m.body, 0.5, 1.2),
])
def test_a_seeded_step_recomputes_what_its_plan_does(name, segment, fraction, bound):
    """The seeded step's replays cost what the plan's recomputation does (2%, or the bound
    given), on the bench models. Without evicting a finished backward stage's leftovers (what
    its forward made or recomputed that the program no longer holds), they stayed resident as
    lineage of the gradients downstream, crowded the next stage's fresh tape out, and the
    transformer replayed 212 ms against the plan's 176 ms; without it, the MLP at 0.4 replayed
    58 ms against 55 (docs/planner.md)."""
    w = zoo.build(name, "bench")
    peak = run_step(w, fresh_model(w), None, cost="estimate", set_to_none=False).stats.peak_resident_bytes
    model = fresh_model(w)
    engine = dtr.budget(int(peak * fraction), cost="estimate", plan=[segment(model)])
    run_step_in(w, model, engine)  # profiles the segment
    plan, chain, _ = _plan_and_chain(engine)
    planned = plan.makespan - evaluate(chain, store_all(chain))[0]
    replayed = []
    original = Driver.replay

    def logged(self, rec):
        values, seconds = original(self, rec)
        replayed.append(seconds)
        return values, seconds

    with mock.patch.object(Driver, "replay", logged):
        run_step_in(w, model, engine)
    assert planned > 0 and sum(replayed) <= bound * planned


def test_two_chained_segments_end_their_backward_cleanly():
    """Two segments, the second reading the first's output, several steps in one block: the
    first segment's last stage and the second's input share a gradient, whose hooks fire in
    the first segment's favour. After every backward pass, protection is off and no pass is
    left open (found by review: protection stayed on, and every later storage was a last
    resort). Gradients stay eager's."""
    torch.manual_seed(0)

    def segment():
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                     for _ in range(6)])

    s1, s2 = segment(), segment()
    x = torch.randn(64, 256)
    params = list(s1.parameters()) + list(s2.parameters())
    s2(s1(x)).pow(2).mean().backward()
    eager = [q.grad.clone() for q in params]
    probe = dtr.budget(None, cost="estimate")
    with probe:
        s2(s1(x)).pow(2).mean().backward()
    engine = dtr.budget(int(probe.stats().peak_resident_bytes * 0.9), cost="estimate", plan=[s1, s2])
    with engine:
        rt = engine.runtime
        for step in range(3):
            zero_grads(params, set_to_none=False)
            s2(s1(x)).pow(2).mean().backward()
            assert rt._protected_from == float("inf"), f"step {step}: protection left on"
            assert not engine._seeding._open, f"step {step}: a pass left open"
            assert all(torch.equal(q.grad, e) for q, e in zip(params, eager))
    assert all(p is not None for plans in engine.plans() for p in plans.values()), "both planned"


def test_a_new_input_shape_is_profiled_not_given_another_plan():
    w, peak = _mlp()
    model = fresh_model(w)
    engine = dtr.budget(int(peak * 0.5), cost="estimate", plan=[model.body])
    _steps(w, model, engine, 2)
    small = zoo.Workload(w.name, w.model, (w.batch[0][:64], w.batch[1][:64]), w.loss_fn)
    eager_small = run_step(small, fresh_model(small), "eager")
    for _ in range(2):  # profiled, then planned: both exact
        loss, grads = run_step_in(small, model, engine)
        assert torch.equal(loss, eager_small.loss)
        assert all(torch.equal(g, e) for g, e in zip(grads, eager_small.grads))
    (plans,) = engine.plans()
    assert sorted(sig[0][0] for sig in plans) == [(64, 64), (128, 64)]


def test_no_plan_fits_the_share_then_plain_dtr_runs_it():
    w = workload("resnet")
    eager = run_step(w, fresh_model(w), "eager")
    peak = run_step(w, fresh_model(w), None, cost="estimate", set_to_none=False).stats.peak_resident_bytes
    model = fresh_model(w)
    engine = dtr.budget(int(peak * 0.4), cost="estimate", plan=[model.blocks])
    with pytest.warns(UserWarning, match="no plan fits"):
        results = _steps(w, model, engine, 2)
    for loss, grads in results:
        assert torch.equal(loss, eager.loss)
    (plans,) = engine.plans()
    assert list(plans.values()) == [None]


def test_transformer_blocks_as_a_segment_match_eager():
    w = workload("transformer")
    eager = run_step(w, fresh_model(w), "eager")
    peak = run_step(w, fresh_model(w), None, cost="estimate", set_to_none=False).stats.peak_resident_bytes
    model = fresh_model(w)
    engine = dtr.budget(int(peak * 0.7), cost="estimate", plan=[model.blocks])
    for loss, grads in _steps(w, model, engine, 3):
        assert torch.equal(loss, eager.loss)
        assert all(torch.equal(g, e) for g, e in zip(grads, eager.grads))
    engine.check_invariants()


def test_unlimited_budget_needs_no_plan_and_inference_is_untouched():
    w, _ = _mlp()
    model = fresh_model(w)
    engine = dtr.budget(None, plan=[model.body])
    _steps(w, model, engine, 2)
    assert engine.plans() == [{}]
    with torch.no_grad(), engine:
        model(w.batch[0])


def test_bad_plan_arguments_are_named():
    w, _ = _mlp()
    with pytest.raises(ValueError, match="non-empty list of segments"):
        dtr.budget("1 GB", plan=w.model.body)
    with pytest.raises(ValueError, match=r"plan\[0\] must be an nn.Sequential"):
        dtr.budget("1 GB", plan=[3])
    with pytest.raises(ValueError, match="repeats a module"):
        dtr.budget("1 GB", plan=[w.model.body, [w.model.body[0]]])


class _Residual(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU())

    def forward(self, x):
        return x + self.f(x)


_STAGES = {
    "linear_relu_": lambda w: torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(inplace=True)),
    "linear_tanh_dropout": lambda w: torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Tanh(),
                                                         torch.nn.Dropout(0.2)),
    "residual": _Residual,
    "relu_": lambda w: torch.nn.ReLU(inplace=True),  # fuses with the previous stage
}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(sorted(_STAGES)), min_size=2, max_size=6),
       width=st.sampled_from([16, 32, 48]), batch=st.sampled_from([8, 32]),
       fraction=st.floats(0.3, 1.0), seed=st.integers(0, 2**16), one_block=st.booleans())
# The first module writes the segment's input (a constant) in place: its stage's output needs
# no gradient, so that stage's backward never begins, and what it held stayed in the plan's
# state after every backward (found by this test).
@example(kinds=["relu_", "residual", "linear_tanh_dropout", "residual", "linear_relu_"], width=32, batch=32,
         fraction=0.74, seed=6880, one_block=True)
def test_random_chains_seeded_match_eager(kinds, width, batch, fraction, seed, one_block):
    """Random chains (in-place activations that fuse stages, dropout, residual blocks), random
    budgets: every step of a seeded engine (the profiling step, then steps that apply the plan:
    pins, drops, protections, finished stages evicted) gives eager's loss and gradients bit for
    bit, or raises OutOfBudgetError; with the steps in one block, no pin, protection or open
    pass is left after each backward."""
    torch.manual_seed(seed)
    body = torch.nn.Sequential(*[_STAGES[k](width) for k in kinds])
    head = torch.nn.Linear(width, 4)
    params = list(body.parameters()) + list(head.parameters())
    x, y = torch.randn(batch, width), torch.randint(0, 4, (batch,))

    def step():
        for q in params:
            q.grad = None
        torch.manual_seed(seed + 1)  # dropout masks
        loss = torch.nn.functional.cross_entropy(head(body(x)), y)
        loss.backward()
        return dtr.materialize(loss), [q.grad for q in params]

    try:
        want_loss, want_grads = step()
    except RuntimeError:  # two in-place ReLUs in a row: eager rejects it too
        assume(False)
    with dtr.budget(None, cost="estimate") as probe:
        step()
    engine = dtr.budget(int(probe.stats().peak_resident_bytes * fraction), cost="estimate", plan=[body])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no plan fits the share; ops replayed at block exit
        try:
            if one_block:
                with engine:
                    for _ in range(3):
                        loss, grads = step()
                        assert torch.equal(loss, want_loss)
                        assert all(torch.equal(g, e) for g, e in zip(grads, want_grads))
                        held = engine._seeding
                        assert not (held._held or held._open)
                        assert not any(s.protected for s in engine.runtime.storages())
            else:
                for _ in range(3):
                    with engine:
                        loss, grads = step()
                    assert torch.equal(loss, want_loss)
                    assert all(torch.equal(g, e) for g, e in zip(grads, want_grads))
        except dtr.OutOfBudgetError:
            return


def test_passes_without_backward_release_their_plan_state():
    """A forward without backward (evaluation with grad on) and a pass that stops part-way
    hold pins and protected tapes for a backward that never comes: the next forward releases
    them (found by review: they piled up over the steps of one block). The full step after
    them still gives eager's gradients."""
    w, peak = _mlp()
    eager = run_step(w, fresh_model(w), "eager")
    model = fresh_model(w)
    engine = dtr.budget(int(peak * 0.6), cost="estimate", plan=[model.body])
    x, _ = w.batch
    with warnings.catch_warnings(), engine:
        warnings.simplefilter("ignore")  # the held loss's graph is replayed at block exit
        seeding, rt = engine._seeding, engine.runtime
        for step in range(6):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            if step in (2, 4):
                w.loss_fn(model, w.batch)  # no backward
            elif step == 3:
                h = x
                for m in list(model.body)[:4]:  # part of the segment only
                    h = m(h)
                h.square().mean().backward()
            else:
                loss = w.loss_fn(model, w.batch)
                loss.backward()
            assert len(seeding._held) <= 16, f"step {step}: piling up"
        assert not seeding._held
        assert not any(s.protected for s in rt.storages())
        assert torch.equal(dtr.materialize(loss), eager.loss)
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), eager.grads))
    assert any(p is not None for plans in engine.plans() for p in plans.values())


class _FailsForward(torch.nn.Module):
    def forward(self, x):
        x.tanh()
        raise RuntimeError("the stage failed")


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the stage's backward failed")


class _FailsBackwardModule(torch.nn.Module):
    def forward(self, x):
        return _FailsBackward.apply(x)


@pytest.mark.parametrize("failing", [_FailsForward, _FailsBackwardModule])
def test_a_profiled_stage_that_raises_leaves_the_peak_right(failing):
    """A stage that raises while it is profiled (in its forward or its backward) leaves
    ``peak_resident_bytes`` what the same program reports without a plan: the stage's
    measurement never lowers the engine's own peak, here set by a large tensor freed
    before the segment runs."""
    torch.manual_seed(0)
    segment = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), failing())
    x = torch.randn(32, 64)

    def program():
        spike = x.repeat(64, 16)  # 8 MiB, freed at once
        del spike
        with pytest.raises(RuntimeError, match="failed"):
            segment(x).sum().backward()

    peaks = []
    for plan in (None, [segment]):
        engine = dtr.budget("1 GB", cost="estimate", plan=plan)
        with engine:
            program()
        peaks.append(engine.stats().peak_resident_bytes)
    assert peaks[0] >= 32 * 64 * 64 * 16 * 4 and peaks[1] == peaks[0]
