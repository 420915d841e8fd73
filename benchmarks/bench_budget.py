"""Is the budget a promise? The true peak of a training step under a budget, measured
independently (torch.profiler's allocation events on CPU, ``torch.cuda.max_memory_allocated``
on CUDA), with the gradients cleared as ``optimizer.zero_grad()`` does by default
(``set_to_none=True``), so that the step makes them.

For each model (``dtr.testing.zoo``, bench presets): one eager step (its true peak), one
``dtr.budget(None)`` step (dtr's own peak and the gradients it made), then steps under budgets
that leave a fraction of the evictable room: the step's gradients (never evicted) plus that
fraction of the rest of the unlimited peak (``dtr.testing.step.budget_at``); a fraction of the
whole peak would be below the gradients alone for weight-heavy models (the bench MLP: 32 of
its 33 MiB). A step that cannot fit raises ``OutOfBudgetError``; the row keeps what it said. Each budget runs two steps in one engine and measures the
second (an engine learns its ops' output sizes in its first: Note [Room before an op]).

    .venv/bin/python benchmarks/bench_budget.py                       # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_budget.py --models mlp --fractions 0.9 0.5

Rows go to ``benchmarks/results/budget.jsonl`` (commit, machine, torch version).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import dtr
from dtr.testing.memory import measured_peak
from dtr.testing.step import budget_at, fresh_model, training_step
from dtr.testing.zoo import build, on_device

sys.path.insert(0, str(Path(__file__).parent))
from progress import progress  # noqa: E402
from provenance import commit, machine  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "budget.jsonl"
MiB = 2**20


def true_peak(w, model, device, engine=None) -> int:
    """The true peak of one step (``training_step``), the previous step's gradients dropped
    before the measurement starts (``training_step``'s docstring)."""
    model.zero_grad()
    return measured_peak(lambda: training_step(w, model, engine), device)


def rows_for(name: str, fractions, device: str):
    w = build(name, "bench")
    if device != "cpu":
        w = on_device(w, device)
    model = fresh_model(w).to(device)
    eager = true_peak(w, model, device)
    probe = dtr.budget(None, cost="estimate")
    unlimited = true_peak(w, model, device, probe)
    stats = probe.stats()
    base = dict(model=name, preset="bench", eager_true_peak=eager, unlimited_true_peak=unlimited,
                dtr_unlimited_peak=stats.peak_resident_bytes, gradient_bytes=stats.gradient_bytes)
    for fraction in fractions:
        budget = budget_at(stats, fraction)
        engine = dtr.budget(budget, cost="estimate")
        row = dict(base, fraction=fraction, budget=budget)
        try:
            training_step(w, model, engine)
            t0 = time.perf_counter()
            row["true_peak"] = true_peak(w, model, device, engine)
            row["seconds"] = time.perf_counter() - t0
            s = engine.stats()
            row.update(engine_peak=s.peak_resident_bytes, evictions=s.evictions,
                       rematerializations=s.rematerializations)
        except dtr.OutOfBudgetError as e:
            row.update(error=str(e), needed_bytes=e.needed_bytes)
        yield row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mlp", "transformer", "resnet", "lstm"])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.7, 0.5, 0.3])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    stamp = dict(commit=commit(), machine=machine(), torch=torch.__version__, device=args.device,
                 time=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"{'model':12} {'fraction':>8} {'budget':>8} {'of peak':>7} {'true peak':>10} {'over':>7} {'eager':>8} "
          f"{'grads':>7} {'evictions':>9}   (MiB; over = true peak - budget)")
    with open(args.out, "a") as out:
        for name in progress(args.models, "models"):
            for row in rows_for(name, args.fractions, args.device):
                out.write(json.dumps(dict(row, **stamp)) + "\n")
                if "error" in row:
                    tail = f"OutOfBudgetError: needs {row['needed_bytes'] / MiB:.1f} MiB"
                    peak = over = "-"
                else:
                    tail = f"{row['evictions']:>9}"
                    peak = f"{row['true_peak'] / MiB:.1f}"
                    over = f"{(row['true_peak'] - row['budget']) / MiB:+.1f}"
                share = row["budget"] / row["dtr_unlimited_peak"]
                print(f"{name:12} {row['fraction']:>8} {row['budget'] / MiB:>8.1f} {share:>7.2f} {peak:>10} {over:>7} "
                      f"{row['eager_true_peak'] / MiB:>8.1f} {row['gradient_bytes'] / MiB:>7.1f} {tail}")


if __name__ == "__main__":
    main()
