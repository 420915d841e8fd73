"""Swapping to the host vs rematerializing vs both: slowdown against budget.

1. Simulated (default): each recorded zoo trace (``benchmarks/traces/<model>.jsonl.gz``, made
   by ``bench_sweep.py --record``) replayed by ``dtr.simulate`` at budget fractions of its
   unlimited peak, for three policies:

   * ``remat``: plain DTR (h_DTR^eq), no host tier;
   * ``swap``: swapping only (a heuristic that never evicts; dead tensors are still freed);
   * ``combined``: ``swap=True``: per candidate, the cheaper of the two;

   at host bandwidths of 12, 25 and 50 GB/s. Slowdown is the simulated compute plus the stall
   of synchronous swap-ins (transfer time; swap-outs and prefetches are assumed to overlap
   compute), over the recorded compute. Target: combined <= min(remat, swap) at every budget.
2. ``--real``: real CPU steps of a few zoo models at their bench presets, remat vs combined at
   the measured host-copy bandwidth: wall time over eager (median of ``--repeats``).

    python benchmarks/bench_swap.py                   # simulated, ~1 minute
    python benchmarks/bench_swap.py --real            # adds real CPU steps, a few minutes

Rows go to ``benchmarks/results/swap.jsonl``; ``results/swap.png`` plots the simulated ones
when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import dtr
from dtr.engine import Heuristic
from dtr.sim import load

from bench_runtime import RunTimeout, time_limit
from plotting import pyplot
from provenance import commit, machine

HERE = Path(__file__).parent
TRACES = HERE / "traces"
RESULTS = HERE / "results"
BANDWIDTHS = (12e9, 25e9, 50e9)
FRACTIONS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


class NeverEvict(Heuristic):
    """Swap-only: no storage is ever worth evicting, so every budget eviction is a swap."""

    name = "never_evict"

    def score(self, storage, now: int) -> float:
        return float("inf")


def _simulate(limit: float, *args, **kwargs):
    """``dtr.simulate`` within ``limit`` seconds (a thrashing policy can take minutes), or None."""
    try:
        with time_limit(limit):
            return dtr.simulate(*args, **kwargs)
    except RunTimeout:
        return None


def simulated(traces: Path, models, out, base, limit: float):
    rows = []
    print(f"{'model':<12} {'GB/s':>5} {'frac':>5} {'remat':>8} {'swap':>8} {'combined':>8} {'swaps':>6} {'evict':>6}  target")
    for name in models:
        path = traces / f"{name}.jsonl.gz"
        if not path.exists():
            print(f"{name}: no trace at {path}; record it with: python benchmarks/bench_sweep.py --record")
            continue
        trace = load(path)
        peak = dtr.simulate(trace, None).peak_bytes
        remat = {}  # fraction -> the remat-only result (it does not depend on the bandwidth)
        for bw in BANDWIDTHS:
            for f in FRACTIONS:
                budget = int(peak * f)
                if f not in remat:
                    # Below a fraction where remat-only timed out it only thrashes harder: skip.
                    gave_up = any(g > f and remat[g] is None for g in remat)
                    remat[f] = None if gave_up else _simulate(limit, trace, budget)
                r = remat[f]
                s = _simulate(limit, trace, budget, heuristic=NeverEvict(), swap=True, bandwidth=bw)
                c = _simulate(limit, trace, budget, swap=True, bandwidth=bw)
                ok = lambda x: x is not None and x.feasible
                alone = [x.slowdown for x in (r, s) if ok(x)]
                # Met: combined runs wherever either alone does, and is no slower than the best.
                met = (ok(c) and c.slowdown <= min(alone) * (1 + 1e-9)) if alone else None
                row = {**base, "section": "sim", "model": name, "bandwidth": bw, "fraction": f, "budget_bytes": budget,
                       "remat": _slowdown(r), "swap": _slowdown(s), "combined": _slowdown(c), "target_met": met}
                if c is not None:
                    row.update(combined_swaps_out=c.swaps_out, combined_evictions=c.evictions,
                               combined_prefetches=c.prefetches, combined_stall=c.swap_stall)
                out.write(json.dumps(row) + "\n")
                rows.append(row)
                fmt = lambda v: f"{v:>8.3f}" if isinstance(v, float) else f"{v:>8}"
                print(f"{name:<12} {bw / 1e9:>5.0f} {f:>5.2f} {fmt(row['remat'])} {fmt(row['swap'])} "
                      f"{fmt(row['combined'])} {row.get('combined_swaps_out', '-'):>6} "
                      f"{row.get('combined_evictions', '-'):>6}  {_verdict(met)}", flush=True)
    return rows


def _slowdown(r):
    if r is None:
        return "timeout"
    return r.slowdown if r.feasible else "infeas."


def _verdict(met) -> str:
    return "-" if met is None else ("met" if met else "NOT met")


def real(models, fractions, repeats, out, base):
    from dtr.eager.swap import measure_bandwidth
    from dtr.testing import zoo
    from dtr.testing.step import fresh_model, timed_step

    bw = measure_bandwidth()
    print(f"\n## real CPU steps, host-copy bandwidth measured: {bw / 1e9:.1f} GB/s")
    print(f"{'model':<12} {'frac':>5} {'remat':>7} {'combined':>8} {'swaps':>6} {'prefetch':>8} {'stall ms':>8}")
    for name in models:
        w = zoo.build(name, "bench")
        model = fresh_model(w)
        timed_step(w, model)  # warm-up
        eager = statistics.median(timed_step(w, model) for _ in range(repeats))
        probe = dtr.budget(None)
        timed_step(w, model, probe)
        peak = probe.stats().peak_resident_bytes
        for f in fractions:
            row = {**base, "section": "real", "model": name, "fraction": f, "bandwidth": bw, "eager_ms": eager * 1e3}
            for mode, opts in (("remat", {}), ("combined", {"swap": True})):
                engine = dtr.budget(int(peak * f), **opts)
                try:
                    row[mode] = statistics.median(timed_step(w, model, engine) for _ in range(repeats)) / eager
                except dtr.OutOfBudgetError:
                    row[mode] = None
                st = engine.stats()
                if mode == "combined":
                    row.update(swaps_out=st.swaps_out, prefetches=st.prefetches, swaps_in=st.swaps_in,
                               stall_ms=st.swap_stall_seconds * 1e3)
            out.write(json.dumps(row) + "\n")
            fmt = lambda v: f"{v:>7.3f}" if v is not None else f"{'OOB':>7}"
            print(f"{name:<12} {f:>5.2f} {fmt(row['remat'])} {fmt(row['combined'])} {row['swaps_out']:>6} "
                  f"{row['prefetches']:>8} {row['stall_ms']:>8.1f}", flush=True)


def plot(rows, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(BANDWIDTHS), len(models), figsize=(3.2 * len(models), 2.8 * len(BANDWIDTHS)),
                             squeeze=False)
    for i, bw in enumerate(BANDWIDTHS):
        for j, name in enumerate(models):
            ax = axes[i][j]
            rs = sorted((r for r in rows if r["model"] == name and r["bandwidth"] == bw), key=lambda r: r["fraction"])
            for key, style in (("remat", "s-"), ("swap", "^-"), ("combined", "o-")):
                pts = [(r["fraction"], r[key]) for r in rs if isinstance(r[key], float)]
                if pts:
                    ax.plot(*zip(*pts), style, label=key, markersize=4)
            ax.set_title(f"{name}, {bw / 1e9:.0f} GB/s", fontsize=9)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if i == len(BANDWIDTHS) - 1:
                ax.set_xlabel("budget / peak")
            if j == 0:
                ax.set_ylabel("slowdown (simulated)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None, help="default: every trace in --traces")
    ap.add_argument("--traces", default=str(TRACES), help="folder of <model>.jsonl.gz traces")
    ap.add_argument("--real", action="store_true", help="also time real CPU steps")
    ap.add_argument("--real-models", nargs="+", default=["mlp", "transformer"])
    ap.add_argument("--real-fractions", nargs="+", type=float, default=[0.5, 0.3])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=60, help="seconds per simulation")
    ap.add_argument("--out", default=str(RESULTS / "swap.jsonl"))
    args = ap.parse_args()
    traces = Path(args.traces)
    models = args.models or sorted(p.name.split(".")[0] for p in traces.glob("*.jsonl.gz"))
    base = {"commit": commit(), "machine": machine()}
    with open(args.out, "a") as out:
        rows = simulated(traces, models, out, base, args.time_limit)
        if args.real:
            base["load"] = round(os.getloadavg()[0], 2)
            real(args.real_models, args.real_fractions, args.repeats, out, base)
    if rows:
        met = [r for r in rows if r["target_met"] is not None]
        print(f"\ncombined <= min(remat, swap): {sum(r['target_met'] for r in met)} of {len(met)} (model, bandwidth, "
              f"budget) points")
        print("plot:", RESULTS / "swap.png" if plot(rows, RESULTS / "swap.png") else "skipped (no matplotlib)")
    print(f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
