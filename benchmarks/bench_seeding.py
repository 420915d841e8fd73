"""Seeded runtime vs plain DTR vs the rotor optimum vs checkpoint_sequential, on chain models.

For each chain model of ``dtr.testing.zoo`` (``mlp``: its ``body`` stages; ``resnet``: its
residual blocks; ``transformer``: its decoder blocks) and each budget fraction f of the
unlimited run's peak:

* ``seeded``: ``dtr.budget(f x peak, plan=[segment])``: one profiling step, then a seeded step;
* ``plain``: ``dtr.budget(f x peak)`` (h_DTR^eq);
* ``optimum``: the rotor DP's plan for the same share, as predicted from the profile:
  the step's recorded compute + (plan makespan - store-all makespan);
* ``checkpoint_sequential``: PyTorch's schedule with sqrt(L) segments on the profiled chain
  (its compute, and its peak, which the budget does not bound: estimated as the unlimited
  peak with the segment's store-all peak replaced by the schedule's).

Compute ratios (total / the step's compute without recomputation) come from the simulator,
replaying each step's trace through the engine; the cost model is the deterministic estimate
(``cost="estimate"``), so that the plans and the replays agree. Wall ratios are the median of
``--repeats`` real steps over eager's. Target: seeded <= 1.02x the optimum.

    python benchmarks/bench_seeding.py                    # ~5 minutes on 2 cores
    python benchmarks/bench_seeding.py --models mlp --fractions 0.5 --repeats 1
    python benchmarks/bench_seeding.py --plot-only          # redraw from the JSON rows

Rows go to ``benchmarks/results/seeding.jsonl``; ``results/seeding.png`` plots them when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import warnings
from pathlib import Path

import torch

import dtr
from dtr.planner import checkpoint_sequential, evaluate, store_all
from dtr.testing import zoo
from dtr.testing.step import fresh_model, timed_step

from plotting import pyplot
from provenance import commit, machine

SEGMENTS = {"mlp": lambda m: m.body, "resnet": lambda m: m.blocks, "transformer": lambda m: m.blocks}
RESULTS = Path(__file__).parent / "results"


def steps(w, model, engine, repeats: int, path: Path):
    """``repeats`` steps in ``engine``, the last one traced into ``path``: (median wall time,
    the simulation of the traced step at the engine's budget)."""
    walls = [timed_step(w, model, engine) for _ in range(repeats - 1)]
    engine.trace = path
    walls.append(timed_step(w, model, engine))
    engine.trace = None
    return statistics.median(walls), dtr.simulate(path, engine.budget)


def measure(name: str, fractions, repeats: int, size: str, tmp: Path):
    w = zoo.build(name, size)
    model = fresh_model(w)
    timed_step(w, model)  # warm-up: first calls allocate and initialize kernels
    eager = statistics.median(timed_step(w, model) for _ in range(repeats))
    probe = dtr.budget(None, cost="estimate")
    timed_step(w, model, probe)
    peak = probe.stats().peak_resident_bytes
    for f in fractions:
        budget = int(peak * f)
        row = {"model": name, "size": size, "fraction": f, "budget_bytes": budget, "eager_ms": eager * 1e3}
        seeded = dtr.budget(budget, cost="estimate", plan=[SEGMENTS[name](model)])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                timed_step(w, model, seeded)  # profiling step
            (plans,) = seeded.plans()
            plan = next(iter(plans.values()), None)
            wall, sim = steps(w, model, seeded, repeats, tmp / "seeded.jsonl")
            row.update(seeded_ratio=sim.slowdown, seeded_wall=wall / eager,
                       seeded_feasible=sim.feasible, planned=plan is not None)
            if plan is not None:
                (chain, _, _), = seeded._seeding.segments[0].profiles.values()
                base_seg, _ = evaluate(chain, store_all(chain))
                row["optimum_ratio"] = (sim.base_cost + plan.makespan - base_seg) / sim.base_cost
                k = max(1, round(math.sqrt(chain.length)))
                ck_time, ck_peak = evaluate(chain, checkpoint_sequential(chain, k))
                row.update(checkpoint_ratio=(sim.base_cost + ck_time - base_seg) / sim.base_cost,
                           checkpoint_peak_fraction=(ck_peak + (peak - chain_peak(chain))) / peak)
        except dtr.OutOfBudgetError:
            row["seeded_status"] = "out of budget"
        plain = dtr.budget(budget, cost="estimate")
        try:
            wall, sim = steps(w, model, plain, repeats, tmp / "plain.jsonl")
            row.update(plain_ratio=sim.slowdown, plain_wall=wall / eager)
        except dtr.OutOfBudgetError:
            row["plain_status"] = "out of budget"
        yield row


def chain_peak(chain) -> float:
    """The segment's store-all peak: what the unlimited run's peak owes to the segment."""
    return evaluate(chain, store_all(chain))[1]


def plot(rows, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        rs = sorted((r for r in rows if r["model"] == name), key=lambda r: r["fraction"])
        for key, label, style in (("seeded_ratio", "seeded DTR", "o-"), ("plain_ratio", "plain DTR (h_DTR^eq)", "s-"),
                                  ("optimum_ratio", "rotor optimum", "k--")):
            pts = [(r["fraction"], r[key]) for r in rs if key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ck = [(r["checkpoint_peak_fraction"], r["checkpoint_ratio"]) for r in rs if "checkpoint_ratio" in r]
        if ck:
            ax.plot(*ck[0], "r*", markersize=12, label="checkpoint_sequential (sqrt L)")
        ax.set_title(name)
        ax.set_xlabel("budget / unlimited peak")
        ax.set_ylabel("compute / no-recompute compute (simulated)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SEGMENTS), choices=list(SEGMENTS))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    ap.add_argument("--size", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "seeding.jsonl"))
    ap.add_argument("--plot-only", action="store_true", help="plot the rows of --out's latest commit, run nothing")
    args = ap.parse_args()
    if args.plot_only:
        rows = [json.loads(line) for line in open(args.out)]
        rows = [r for r in rows if r["commit"] == rows[-1]["commit"]]
        print("plot:", RESULTS / "seeding.png" if plot(rows, RESULTS / "seeding.png") else "skipped (no matplotlib)")
        return
    torch.set_num_threads(args.threads)
    base = {"commit": commit(), "machine": machine(), "torch": torch.__version__, "threads": args.threads}
    rows = []
    print(f"{'model':<12} {'frac':>5} {'plan':>5} {'seeded':>7} {'optimum':>8} {'seeded/opt':>10} {'plain':>7} "
          f"{'plain/opt':>9} {'ckpt':>6} {'ckpt peak':>9} {'seeded wall':>11} {'plain wall':>10}")
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a") as out:
        for name in args.models:
            for row in measure(name, args.fractions, args.repeats, args.size, Path(tmp)):
                row.update(base, load=round(os.getloadavg()[0], 2))
                out.write(json.dumps(row) + "\n")
                rows.append(row)
                g = row.get
                opt = g("optimum_ratio")
                fmt = lambda v, w=7: f"{v:>{w}.3f}" if isinstance(v, float) else f"{'-':>{w}}"
                print(f"{name:<12} {row['fraction']:>5.2f} {str(g('planned', '-')):>5} {fmt(g('seeded_ratio'))} "
                      f"{fmt(opt, 8)} {fmt(g('seeded_ratio') / opt if opt and g('seeded_ratio') else None, 10)} "
                      f"{fmt(g('plain_ratio'))} {fmt(g('plain_ratio') / opt if opt and g('plain_ratio') else None, 9)} "
                      f"{fmt(g('checkpoint_ratio'), 6)} {fmt(g('checkpoint_peak_fraction'), 9)} "
                      f"{fmt(g('seeded_wall'), 11)} {fmt(g('plain_wall'), 10)}", flush=True)
    if plot(rows, RESULTS / "seeding.png"):
        print(f"plot: {RESULTS / 'seeding.png'}")
    else:
        print("plot skipped: matplotlib is not installed")
    print(f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
