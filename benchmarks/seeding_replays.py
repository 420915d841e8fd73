"""Where a seeded step recomputes more than its plan: the plan's recomputation against the ops
the seeded step actually replayed, by op.

For each chain model and budget fraction (bench presets, ``cost="estimate"``, as
``bench_seeding.py``): one profiling step under ``dtr.budget(f x peak, plan=[segment])``, then
one seeded step whose replays are logged op by op. The plan's recomputation is its makespan
minus the store-all makespan of the profiled chain. A diagnostic, not a benchmark: it prints a
table and writes nothing.

    python benchmarks/seeding_replays.py --models mlp --fractions 0.5 0.4
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch

import dtr
from dtr.eager.driver import Driver
from dtr.planner import evaluate, store_all
from dtr.testing import zoo
from dtr.testing.step import fresh_model, timed_step

from bench_seeding import SEGMENTS


def replays(model_name: str, fraction: float):
    """(plan recomputation s, {op name: [count, seconds]} replayed by the seeded step), or None
    when no plan fits."""
    w = zoo.build(model_name, "bench")
    model = fresh_model(w)
    probe = dtr.budget(None, cost="estimate")
    timed_step(w, model, probe)
    seeded = dtr.budget(int(probe.stats().peak_resident_bytes * fraction), cost="estimate",
                        plan=[SEGMENTS[model_name](model)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timed_step(w, model, seeded)  # profiling step
    (plans,) = seeded.plans()
    plan = next(iter(plans.values()), None)
    if plan is None:
        return None
    (chain, _, _), = seeded._seeding.segments[0].profiles.values()
    planned = plan.makespan - evaluate(chain, store_all(chain))[0]
    log = collections.defaultdict(lambda: [0, 0.0])
    original = Driver.replay

    def logged(self, rec):
        values, seconds = original(self, rec)
        entry = log[rec.name]
        entry[0] += 1
        entry[1] += seconds
        return values, seconds

    Driver.replay = logged
    try:
        timed_step(w, model, seeded)
    finally:
        Driver.replay = original
    return planned, dict(log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["mlp"], choices=list(SEGMENTS))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.4])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        for f in args.fractions:
            got = replays(name, f)
            if got is None:
                print(f"{name} {f:.2f}: no plan fits")
                continue
            planned, log = got
            total = sum(s for _, s in log.values())
            print(f"{name} {f:.2f}: plan recomputes {planned * 1e3:.1f} ms, "
                  f"the seeded step replayed {total * 1e3:.1f} ms")
            for op, (n, s) in sorted(log.items(), key=lambda kv: -kv[1][1]):
                print(f"    {op:<36} {n:>4} x  {s * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
