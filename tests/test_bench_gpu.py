"""``benchmarks/bench_gpu.py`` on CPU at its tiny sizes: what every section that runs without a
GPU yields (the GPU machine's time is too short to find a broken script there), its rank
correlation with ties, and the plot of the shipped rows."""

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # benchmark scripts import their siblings by name

import bench_gpu  # noqa: E402

CPU = torch.device("cpu")
ARGS = Namespace(repeats=1, rounds=2, fractions=[0.9, 0.5, 0.01])


@pytest.mark.parametrize("name", sorted(bench_gpu.BUILDERS))
def test_sections_on_cpu(name):
    if name == "gpt2":
        pytest.importorskip("transformers")
    case = bench_gpu.BUILDERS[name]("tiny", CPU)
    (overhead,) = bench_gpu.section_overhead(case, CPU, ARGS)
    assert overhead["ops"] > 0 and overhead["ratio"] > 0 and overhead["eager_true_peak"] is None
    budgets = list(bench_gpu.section_budgets(case, CPU, ARGS))
    statuses = [r["status"] for r in budgets]
    assert statuses[0] == "ok" and statuses[-1] != "ok"  # down to the first fraction that cannot run
    assert all(s == "ok" for s in statuses[:-1]) and "OutOfBudgetError" in statuses[-1]
    assert all(r["evictions"] >= 0 and r["replays"] >= 0 for r in budgets if r["status"] == "ok")
    turns = list(bench_gpu.section_turns(case, CPU, ARGS))  # settings taking turns; 0.01 refused
    assert [r["setting"] for r in turns] == ["0.01", "eager", "unlimited", "0.9", "0.5"]
    assert "OutOfBudgetError" in turns[0]["status"] and all(r["status"] == "ok" for r in turns[1:])
    assert all(len(r["host_s"]) == 2 and len(r["step_s"]) == 2 for r in turns[1:])
    assert turns[2]["evictions"] == 0 and turns[4]["evictions"] > 0
    for row in list(budgets) + turns + [overhead]:
        assert bench_gpu.describe(dict(row, model=name))
    checkpoint = list(bench_gpu.section_checkpoint(case, CPU, ARGS))
    assert len(checkpoint) == (case.checkpointed is not None)


def test_rank_correlation_averages_ties():
    assert bench_gpu._spearman([1, 2, 2, 3], [10, 20, 20, 30]) == pytest.approx(1.0)
    assert bench_gpu._spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert bench_gpu._spearman([1, 1, 2, 2], [5, 6, 7, 8]) == pytest.approx(0.894, abs=1e-3)


def test_the_plotted_curve_is_one_process_with_the_most_points():
    def row(time, run, fraction, status="ok", model="resnet50"):
        return dict(section="budgets", model=model, time=time, run=run, commit="c", fraction=fraction, status=status)

    rows = [row("01:00", "run 1", f) for f in (0.9, 0.67, 0.45)]
    rows += [row("02:00", "run 2", f) for f in (0.9, 0.67)] + [row("02:00", "run 2", 0.45, "OutOfBudgetError")]
    rows += [row("00:30", "run 0", f) for f in (0.9, 0.67, 0.45)] + [row("03:00", "run 3", 0.9, model="gpt2")]
    points, run = bench_gpu.curve(rows, "resnet50")
    assert run == "run 1" and [r["fraction"] for r in points] == [0.9, 0.67, 0.45]
    assert bench_gpu.curve(rows, "gpt2")[1] == "run 3"
    assert bench_gpu.curve(rows, "treelstm") == ([], None)


def test_plot_of_the_shipped_rows(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [json.loads(line) for line in open(BENCHMARKS / "results" / "gpu.jsonl")]
    assert bench_gpu.plot(rows, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0
