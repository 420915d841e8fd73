"""The chain model and the exact simulator: validation, op semantics, transfer timing, import hygiene."""

import doctest
import math

import pytest

import dtr.planner
from dtr.planner import Chain, evaluate
from fresh_process import run_python
from planner_support import TOY

# The paper's optimal toy sequence at 90 MB (planner notes §1.8, errata 3), loss ops implicit.
TOY_90MB = [("F_ck", 1), ("F_none", 2), ("F_none", 3), ("F_all", 4), ("F_all", 5), ("F_all", 6),
            ("B", 6), ("B", 5), ("B", 4), ("F_ck", 1), ("F_none", 2), ("F_all", 3), ("B", 3),
            ("F_all", 1), ("F_all", 2), ("B", 2), ("B", 1)]


def tiny(L=2, **overrides):
    costs = dict(forward_time=[1] * L, backward_time=[1] * L, output_bytes=[2] * L, saved_bytes=[3] * L,
                 forward_overhead=[0] * L, backward_overhead=[0] * L, input_bytes=2)
    costs.update(overrides)
    return Chain(**costs)


@pytest.mark.parametrize("overrides, message", [
    (dict(forward_time=[1, 2, 3]), "one entry per stage"),
    (dict(output_bytes=[2, -1]), "output_bytes[1] = -1"),
    (dict(backward_time=[1, math.nan]), "backward_time[1]"),
    (dict(saved_bytes=[1, True]), "is not a number"),
    (dict(forward_overhead="ab"), "must be a sequence"),
    (dict(input_bytes=math.inf), "input_bytes"),
])
def test_chain_rejects_bad_costs(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tiny(**overrides)


def test_chain_clamps_tape_below_output():
    chain = tiny(saved_bytes=[1, 5])
    assert chain.saved_bytes == (2, 5)
    assert TOY.saved_bytes[3] == 1068  # the paper's 10.66 < 10.68 MB


def test_toy_sequence_matches_paper():
    # 47.42 ms as in the paper; 86.77 MB rather than 86.75 because ā^4 is clamped up by 0.02 MB.
    makespan, peak = evaluate(TOY, TOY_90MB)
    assert makespan == pytest.approx(47.42)
    assert peak == 8677


def test_explicit_loss_stage_is_the_implicit_loss_step():
    # The toy with its loss as a 7th zero-cost stage: same schedule plus F_all^7 B^7.
    explicit = Chain([*TOY.forward_time, 0], [*TOY.backward_time, 0], [*TOY.output_bytes, 0],
                     [*TOY.saved_bytes, 0], [0] * 7, [*TOY.backward_overhead, 0], TOY.input_bytes)
    ops = TOY_90MB[:6] + [("F_all", 7), ("B", 7)] + TOY_90MB[6:]
    assert evaluate(explicit, ops) == evaluate(TOY, TOY_90MB)


def test_printed_paper_sequence_exceeds_budget():
    # Erratum 3 of the planner notes: the paper prints F_all^3 in the first sweep. Keeping ā^3 from
    # there (no second F^1..F^3) peaks at 97.45 MB (+0.02 for the clamped ā^4), over the 90 MB budget.
    printed = TOY_90MB[:2] + [("F_all", 3)] + TOY_90MB[3:9] + [("B", 3)] + TOY_90MB[13:]
    assert evaluate(TOY, printed)[1] == 9747


def test_peak_counts_input_and_gradients():
    chain = tiny(L=1, output_bytes=[5], saved_bytes=[7], backward_overhead=[11], input_bytes=3)
    # B^1 holds a^0 (3) + ā^1 (7) + δ^1 (5) + δ^0 (3) + overhead 11.
    assert evaluate(chain, [("F_all", 1), ("B", 1)]) == (2.0, 29.0)


@pytest.mark.parametrize("ops, message", [
    ([("F_all", 2)], r"ops\[0\] = \('F_all', 2\) needs a\^1"),
    ([("F_none", 1)], "would drop the chain input a\\^0"),
    ([("F_ck", 1), ("F_ck", 1)], r"ops\[1\].*a\^1 is already stored"),
    ([("F_all", 1), ("F_none", 2)], "would drop ā\\^1"),
    ([("F_all", 1), ("B", 1)], "comes before the loss"),
    ([("F_all", 1), ("F_all", 2), ("B", 1)], "needs δ\\^1, but the gradient held is δ\\^2"),
    ([("F_all", 1), ("F_ck", 2), ("B", 2)], "a\\^2 is not stored"),
    ([("F_all", 1), ("F_all", 2), ("B", 2), ("B", 1), ("B", 1)], "comes after B\\^1"),
    ([("F_all", 1), ("F_all", 2), ("B", 2)], "end holding δ\\^1, before B\\^1"),
    ([], "end before the loss"),
    ([("F_al", 1)], "unknown kind 'F_al'"),
    ([("F_all", 0)], "stage must be an int in 1..2"),
    ([("F_all",)], "is not a \\(kind, stage\\) pair"),
    ([("F_all", 1), ("F_all", 2), ("B", 2), ("B", 2)], "needs δ\\^2, but the gradient held is δ\\^1"),
    ([("F_ck", 1), ("F_none", 2), ("offload", 2)], "input of stage 2 \\(a\\^1\\) is not stored"),
    ([("offload", 1), ("F_ck", 1)], "a\\^0 \\(the input of stage 1\\), which is on the host"),
    ([("F_ck", 1), ("offload", 1), ("offload", 1)], "a\\^0 was offloaded already"),
    ([("F_ck", 1), ("prefetch", 1)], "prefetches must come after the loss"),
    ([("F_ck", 1), ("F_all", 2), ("offload", 1), ("prefetch", 2)], "offloads must come before the loss"),
    ([("F_ck", 1), ("F_all", 2), ("prefetch", 1)], "a\\^0 is not on the host"),
])
def test_evaluate_rejects_invalid_sequences(ops, message):
    with pytest.raises(ValueError, match=message):
        evaluate(tiny(), ops, offload_bandwidth=1.0)


def test_evaluate_wants_a_bandwidth_for_transfers():
    ops = [("F_ck", 1), ("offload", 1), ("F_all", 2), ("B", 2), ("prefetch", 1), ("F_all", 1), ("B", 1)]
    with pytest.raises(ValueError, match="pass offload_bandwidth"):
        evaluate(tiny(), ops)


# Note [Offload and prefetch], by hand. a^0 = 3 goes out after F_ck^1 (t = 1) at 1 byte per unit.
# Budget 8. Forward: F_all^2 holds a^1 1 + ā^2 1 + overhead 4 = 6 plus 3 in flight: it waits until
# t = 2, ends at 3 with 1 byte still to go. Backward, timed in reverse from B^1: B^1 (8), F_all^1 (5),
# then a^0 comes back (3) while B^2 (6: a^1, ā^2, δ^2, δ^1, overhead 2) waits in reverse until only
# 2 bytes are in, runs, and 1 byte is left for the junction. Makespan 3 + (1 + 1) + 4 = 9.
OFFLOAD_CHAIN = Chain([1, 1], [1, 1], [1, 1], [1, 1], [0, 4], [0, 2], 3)
OFFLOAD_OPS = [("F_ck", 1), ("offload", 1), ("F_all", 2), ("B", 2), ("prefetch", 1), ("F_all", 1), ("B", 1)]


def test_transfers_wait_for_memory_under_a_budget():
    assert evaluate(OFFLOAD_CHAIN, OFFLOAD_OPS, budget=8, offload_bandwidth=1.0) == (9.0, 8.0)


def test_transfers_without_budget_never_wait():
    # F_all^2 starts at t = 1 with 3 bytes in flight (9); the makespan is the same 2 + (2 + 2) + 3.
    assert evaluate(OFFLOAD_CHAIN, OFFLOAD_OPS, offload_bandwidth=1.0) == (9.0, 9.0)


def test_fast_transfers_cost_nothing():
    makespan, peak = evaluate(OFFLOAD_CHAIN, OFFLOAD_OPS, budget=8, offload_bandwidth=1e9)
    assert makespan == pytest.approx(5.0) and peak <= 8


def test_budget_too_small_for_an_op_even_without_transfers():
    with pytest.raises(ValueError, match=r"ops\[6\] = \('B', 1\) holds 8.0 even with no transfer"):
        evaluate(OFFLOAD_CHAIN, OFFLOAD_OPS, budget=7, offload_bandwidth=1.0)


def test_import_does_not_load_torch():
    code = "import sys, dtr.planner; assert 'torch' not in sys.modules, 'dtr.planner imported torch'"
    run_python(code)


def test_package_tour_runs():
    assert doctest.testmod(dtr.planner).failed == 0


def test_simulate_is_a_deprecated_name_of_evaluate():
    """``dtr.planner.simulate`` still evaluates a schedule, and says that its name is now
    ``evaluate`` (``dtr.simulate`` replays traces)."""
    with pytest.warns(DeprecationWarning, match="dtr.planner.evaluate"):
        old = dtr.planner.simulate
    assert old(TOY, TOY_90MB) == evaluate(TOY, TOY_90MB)
    with pytest.raises(AttributeError, match="no_such_name"):
        dtr.planner.no_such_name
