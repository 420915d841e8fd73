"""Planner solve time, native (dtr_ext) vs pure Python, by chain length.

Times ``dtr.planner.solve`` end to end (discretization, DP, reconstruction, the exact simulation of
the plan) on a seeded synthetic heterogeneous chain, at a budget where the DP must work (40% of the
store-all peak). Rows: the rotor DP at 500 slots; the combined remat + offload DP at 50 levels.
Issue 4's targets for the rotor DP: native <= 0.3 s at L=100 and <= 1.5 s at L=200, Python <= 2 s
and <= 10 s.

    python benchmarks/bench_planner.py                     # full table, appends JSON rows
    python benchmarks/bench_planner.py --lengths 25 50 --combined-lengths 10 --repeats 1

Each row is the median of ``--repeats`` (5) timed solves after one untimed warm-up at the smallest
length. Rows go to ``benchmarks/results/planner.jsonl`` (one JSON object per line: commit, machine,
backend, dp, L, slots, seconds, cpu_seconds, makespan, and the 1-minute load average, since other
processes on a small machine stretch wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from dtr.planner import HAS_NATIVE, Chain, evaluate, solve, store_all

from provenance import commit, machine

RESULTS = Path(__file__).parent / "results" / "planner.jsonl"


def synthetic_chain(L: int, seed: int = 0) -> Chain:
    """Heterogeneous stages: output 10-100 units, tape up to 2x more, small overheads."""
    rng = random.Random(seed)
    out = [rng.randint(10, 100) for _ in range(L)]
    return Chain([rng.uniform(1, 5) for _ in range(L)], [rng.uniform(2, 10) for _ in range(L)], out,
                 [v + rng.randint(0, 100) for v in out], [rng.randint(0, 20) for _ in range(L)],
                 [rng.randint(0, 50) for _ in range(L)], 50)


def time_solve(chain: Chain, backend: str, repeats: int, **kwargs) -> tuple:
    """Median wall and CPU seconds of ``repeats`` solves, and the plan's makespan.

    CPU time is reported too because on a shared machine other processes stretch wall time.
    """
    budget = 0.4 * evaluate(chain, store_all(chain))[1]
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = solve(chain, budget, backend=backend, **kwargs)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), plan.makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--combined-lengths", type=int, nargs="+", default=[10, 25, 50, 100])
    parser.add_argument("--python-combined-max", type=int, default=25,
                        help="longest chain for the pure-Python combined DP (it is O(L^2 N^3) in Python)")
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--levels", type=int, default=50)
    parser.add_argument("--bandwidth", type=float, default=20.0, help="units of size per unit of time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    backends = ["native", "python"] if HAS_NATIVE else ["python"]
    base = {"commit": commit(), "machine": machine()}
    cases = [("rotor", L, backend, {"slots": args.slots}) for L in args.lengths for backend in backends]
    cases += [("combined", L, backend, {"levels": args.levels, "offload_bandwidth": args.bandwidth})
              for L in args.combined_lengths for backend in backends
              if backend == "native" or L <= args.python_combined_max]
    time_solve(synthetic_chain(min(args.lengths)), backends[0], 1, slots=args.slots)  # warm-up
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"# {base['machine']}  commit {base['commit']}")
    print(f"{'dp':<9} {'backend':<7} {'L':>4} {'units':>6} {'seconds':>9} {'cpu s':>9} {'makespan':>11}")
    with args.out.open("a") as out:
        for dp, L, backend, kwargs in cases:
            seconds, cpu, makespan = time_solve(synthetic_chain(L), backend, args.repeats, **kwargs)
            units = kwargs.get("slots", kwargs.get("levels"))
            row = {**base, "backend": backend, "dp": dp, "L": L, "slots": units, "seconds": round(seconds, 4),
                   "cpu_seconds": round(cpu, 4), "makespan": makespan, "load": round(os.getloadavg()[0], 2)}
            out.write(json.dumps(row) + "\n")
            print(f"{dp:<9} {backend:<7} {L:>4} {units:>6} {seconds:>9.3f} {cpu:>9.3f} {makespan:>11.3f}", flush=True)


if __name__ == "__main__":
    main()
