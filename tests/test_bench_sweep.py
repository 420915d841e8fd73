"""The budget sweep's simulated section on a shipped trace: the rows it writes, in a second or two."""

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # benchmark scripts import their siblings by name

import bench_sweep  # noqa: E402


def test_simulated_sweep_rows():
    rows = list(bench_sweep.sweep_trace(bench_sweep.TRACES / "cnn.jsonl.gz", ["dtr_eq"], [1.0, 0.5], limit=30))
    assert [r["fraction"] for r in rows] == [1.0, 0.5]
    for r in rows:
        assert r["section"] == "sim" and r["model"] == "cnn" and r["heuristic"] == "dtr_eq"
        assert r["status"] == "ok" and r["feasible"]
        assert r["budget_bytes"] == int(r["unlimited_peak_bytes"] * r["fraction"])
        assert r["peak_bytes"] <= r["unlimited_peak_bytes"]
        for key in ("slowdown", "evictions", "remats", "total_cost", "base_cost", "sim_s"):
            assert key in r
    full, half = rows
    assert full["slowdown"] == 1.0 and full["remats"] == 0
    assert half["slowdown"] > 1.0 and half["evictions"] > 0
    assert bench_sweep.lowest_before(rows) == 0.5


def test_fractions_of_eagers_peak():
    """``--of-eager``: the same trace at fractions of a given eager peak, in their own section."""
    eager = 40 * 2**20  # below the trace's unlimited peak (50 MiB): the budget binds
    rows = list(bench_sweep.sweep_trace(bench_sweep.TRACES / "cnn.jsonl.gz", ["dtr_eq"], [0.9], 30, eager))
    (row,) = rows
    assert row["section"] == "sim_eager" and row["budget_bytes"] == int(eager * 0.9)
    assert row["eager_true_peak_fresh_grads_bytes"] == eager and row["unlimited_peak_bytes"] != eager
    assert row["status"] == "ok" and row["evictions"] > 0 and row["peak_bytes"] <= row["budget_bytes"]


def test_a_refused_real_point_keeps_its_error():
    """A real point refused by the budget is "infeasible", and its row says which error, at which
    op (OutOfBudgetError or ThrashingError: the remedies differ)."""
    import dtr

    def refuse():
        raise dtr.ThrashingError(1 << 20, "aten.mm.default", 1234, 12.5)

    try:
        bench_sweep._limited(30, refuse)
    except bench_sweep.Failed as e:
        row = e.fields()
    assert row["status"] == "infeasible"
    assert row["error"].startswith("ThrashingError: dtr: aten.mm.default") and "\n" not in row["error"]
    assert bench_sweep.Failed("timeout after 1 s").fields() == {"status": "timeout after 1 s"}


def test_the_summary_keeps_each_models_latest_run(tmp_path):
    """A run of one model leaves the other models' latest rows of that section in the summary
    and the plot, and replaces its own older ones."""
    rows = [{"section": "real", "model": "a", "run": "1", "fraction": 1.0},
            {"section": "real", "model": "b", "run": "1", "fraction": 1.0},
            {"section": "real", "model": "a", "run": "2", "fraction": 0.5},
            {"section": "sim", "model": "a", "run": "0", "fraction": 0.9}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench_sweep.latest_rows(path) == rows[1:]
