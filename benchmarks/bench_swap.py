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
   "next": the combined policy's slowdown in one more run of the same step (a training
   loop's later steps), which prefetches what the first run swapped in synchronously, with
   that run's synchronous swap-ins and prefetches.
2. ``--real``: real steps of a few zoo models at their bench presets on ``--device`` (CUDA when
   available), remat-only vs combined at fractions of the unlimited step's peak and the
   measured host-copy bandwidth: wall time over eager (``--repeats`` steps after a warm-up
   step, taking turns with eager steps), the peak measured without dtr (``torch.cuda.max_memory_allocated``, or torch.profiler
   on CPU) and one step's swap / remat mix. On CPU the host tier is a second copy in RAM,
   which the measured peak includes.

    python benchmarks/bench_swap.py                   # simulated, every shipped trace: ~35 minutes
    python benchmarks/bench_swap.py --real            # adds real steps, a few minutes
    python benchmarks/bench_swap.py --real-only --device cuda   # the GPU rows only

Rows go to ``benchmarks/results/swap.jsonl``; ``results/swap.png`` plots the simulated ones
when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import dtr
from dtr.eager.host_copies import measure_bandwidth
from dtr.core import Heuristic
from dtr.sim import load
from dtr.sim.trace import Trace
from dtr.testing import zoo
from dtr.testing.memory import measured_peak

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
    print(f"{'model':<12} {'GB/s':>5} {'frac':>5} {'remat':>8} {'swap':>8} {'combined':>8} {'swaps':>6} {'evict':>6}  "
          f"target  {'next':>6} {'sync':>5} {'pref':>5}")
    for name in models:
        path = traces / f"{name}.jsonl.gz"
        if not path.exists():
            print(f"{name}: no trace at {path}; record it with: python benchmarks/bench_sweep.py --record")
            continue
        trace = load(path)
        again = Trace(trace.header, trace.blocks + trace.blocks[-1:])
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
                # The same program once more: what a training loop's later steps cost, with the
                # prefetches the previous step's log schedules.
                c2 = _simulate(limit, again, budget, swap=True, bandwidth=bw) if c is not None and c.feasible else None
                ok = lambda x: x is not None and x.feasible
                alone = [x.slowdown for x in (r, s) if ok(x)]
                # Met: combined runs wherever either alone does, and is no slower than the best.
                met = (ok(c) and c.slowdown <= min(alone) * (1 + 1e-9)) if alone else None
                row = {**base, "section": "sim", "model": name, "bandwidth": bw, "fraction": f, "budget_bytes": budget,
                       "remat": _slowdown(r), "swap": _slowdown(s), "combined": _slowdown(c), "target_met": met}
                if c is not None:
                    row.update(combined_swaps_out=c.swaps_out, combined_evictions=c.evictions,
                               combined_prefetches=c.prefetches, combined_stall=c.swap_stall)
                if c2 is not None and c2.feasible:
                    row.update(combined_next=(c2.total_cost - c.total_cost) / (c2.base_cost - c.base_cost),
                               combined_next_swaps_in=c2.swaps_in - c.swaps_in,
                               combined_next_prefetches=c2.prefetches - c.prefetches)
                out.write(json.dumps(row) + "\n")
                rows.append(row)
                fmt = lambda v: f"{v:>8.3f}" if isinstance(v, float) else f"{v:>8}"
                fmt6 = lambda v: f"{v:>6.3f}" if isinstance(v, float) else f"{'-':>6}"
                print(f"{name:<12} {bw / 1e9:>5.0f} {f:>5.2f} {fmt(row['remat'])} {fmt(row['swap'])} "
                      f"{fmt(row['combined'])} {row.get('combined_swaps_out', '-'):>6} "
                      f"{row.get('combined_evictions', '-'):>6}  {_verdict(met):<7} {fmt6(row.get('combined_next'))} "
                      f"{row.get('combined_next_swaps_in', '-'):>5} {row.get('combined_next_prefetches', '-'):>5}", flush=True)
    return rows


def _slowdown(r):
    if r is None:
        return "timeout"
    return r.slowdown if r.feasible else "infeas."


def _verdict(met) -> str:
    return "-" if met is None else ("met" if met else "NOT met")


MIX = ("evictions", "rematerializations", "swaps_out", "swap_bytes_out", "swaps_in", "prefetches",
       "swap_stall_seconds")


def _step(w, engine, device) -> float:
    """Wall seconds of one training step of ``w`` (under ``engine`` when given), kernels
    included: on CUDA the step is bracketed by synchronizations. Gradients are zeroed in place
    (``set_to_none=False``, as the README advises): new ``.grad`` tensors made in a block are
    not charged, and the measured peak would count them on top of the budget."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    w.model.zero_grad(set_to_none=False)
    torch.manual_seed(1)
    sync()
    t0 = time.perf_counter()
    if engine is None:
        w.loss_fn(w.model, w.batch).backward()
    else:
        with engine:
            w.loss_fn(w.model, w.batch).backward()
    sync()
    return time.perf_counter() - t0


def real(models, fractions, repeats, device, out, base):
    """Real steps on ``device`` at fractions of the unlimited step's tracked peak, remat-only
    and combined: wall time over eager (after a warm-up step, which also records the access
    order prefetching follows, ``repeats`` steps taking turns with eager ones: median over
    median, so that a burst of load on a shared machine hits both), the measured peak of one
    more step, and that step's swap / remat mix."""
    bw = measure_bandwidth(device)
    print(f"\n## real steps on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), "
          f"host-copy bandwidth measured: {bw / 1e9:.1f} GB/s")
    print(f"{'model':<12} {'frac':>5} {'mode':<9} {'time':>6} {'peak MiB':>9} {'evict':>6} {'remat':>6} "
          f"{'swaps':>6} {'swap MiB':>8} {'sync in':>7} {'prefetch':>8} {'stall ms':>8}")
    for name in models:
        w = zoo.on_device(zoo.build(name, "bench"), device)
        _step(w, None, device)  # warm-up; allocates the gradients
        eager = statistics.median(_step(w, None, device) for _ in range(repeats))
        eager_peak = measured_peak(lambda: _step(w, None, device), device)
        probe = dtr.budget(None)
        _step(w, probe, device)
        peak = probe.stats().peak_resident_bytes
        print(f"{name:<12} {'eager':>5} {'':<9} {eager * 1e3:>5.0f}ms {eager_peak / 2**20:>9.1f}")
        for f in fractions:
            for mode, opts in (("remat", {}), ("combined", {"swap": True, "bandwidth": bw})):
                row = {**base, "section": "real", "device": str(device), "model": name, "fraction": f, "mode": mode,
                       "bandwidth": bw, "eager_ms": eager * 1e3, "eager_peak_bytes": eager_peak,
                       "budget_bytes": int(peak * f)}
                engine = dtr.budget(int(peak * f), **opts)
                try:
                    _step(w, engine, device)
                    runs, eagers = [], []
                    for _ in range(repeats):
                        eagers.append(_step(w, None, device))
                        runs.append(_step(w, engine, device))
                    row["slowdown"] = statistics.median(runs) / statistics.median(eagers)
                    before = engine.stats()
                    row["peak_bytes"] = measured_peak(lambda: _step(w, engine, device), device)
                    after = engine.stats()
                    row.update({k: getattr(after, k) - getattr(before, k) for k in MIX})
                except dtr.OutOfBudgetError:
                    row["slowdown"] = None
                out.write(json.dumps(row) + "\n")
                if row["slowdown"] is None:
                    print(f"{name:<12} {f:>5.2f} {mode:<9} {'OOB':>6}")
                    continue
                print(f"{name:<12} {f:>5.2f} {mode:<9} {row['slowdown']:>5.2f}x {row['peak_bytes'] / 2**20:>9.1f} "
                      f"{row['evictions']:>6} {row['rematerializations']:>6} {row['swaps_out']:>6} "
                      f"{row['swap_bytes_out'] / 2**20:>8.1f} {row['swaps_in']:>7} {row['prefetches']:>8} "
                      f"{row['swap_stall_seconds'] * 1e3:>8.1f}", flush=True)


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
    ap.add_argument("--real", action="store_true", help="also time real steps on --device")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="for --real; default: cuda when available")
    ap.add_argument("--real-only", action="store_true", help="skip the simulation (implies --real)")
    ap.add_argument("--real-models", nargs="+", default=["mlp", "transformer"])
    ap.add_argument("--real-fractions", nargs="+", type=float, default=[0.8, 0.6, 0.5, 0.4, 0.3])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=60, help="seconds per simulation")
    ap.add_argument("--out", default=str(RESULTS / "swap.jsonl"))
    args = ap.parse_args()
    traces = Path(args.traces)
    models = args.models or sorted(p.name.split(".")[0] for p in traces.glob("*.jsonl.gz"))
    base = {"commit": commit(), "machine": machine()}
    with open(args.out, "a") as out:
        rows = [] if args.real_only else simulated(traces, models, out, base, args.time_limit)
        if args.real or args.real_only:
            base["load"] = round(os.getloadavg()[0], 2)
            real(args.real_models, args.real_fractions, args.repeats, torch.device(args.device), out, base)
    if rows:
        met = [r for r in rows if r["target_met"] is not None]
        print(f"\ncombined <= min(remat, swap): {sum(r['target_met'] for r in met)} of {len(met)} (model, bandwidth, "
              f"budget) points")
        print("plot:", RESULTS / "swap.png" if plot(rows, RESULTS / "swap.png") else "skipped (no matplotlib)")
    print(f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
