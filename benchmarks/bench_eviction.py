"""Cost of one eviction decision against the size of the candidate pool (the heuristics issue's
target: <= 20 us per eviction with 10,000 evictable storages).

The torch-free runtime is driven directly, with a fake executor (no tensors): a random DAG of
``--storages`` resident outputs (each op reads one or two of the last 64 outputs that are
resident, sizes 1-16 KiB, costs random), all held by the program so none leaves memory on its
own. Then the budget is set to what is resident, and each of ``--ops`` further ops allocates a
16 KiB output (the largest size), which forces at least one eviction (the evicted
neighbourhoods grow as in a real run, and with them the work of "dtr", "dtr_eq" and "msps"). Per eviction: time spent in the
runtime's eviction loop (choosing, evicting, the heuristic's hooks) / evictions, median of
``--repeats`` runs, for every registered heuristic, searched the way the runtime searches it
(the candidate index, core/candidates.py) and, with ``--rescoring``, by rescoring every
candidate each round (what a heuristic that defines only ``score`` gets), to show why the index
exists.

    python benchmarks/bench_eviction.py                          # about a minute
    python benchmarks/bench_eviction.py --storages 1000 10000 100000 --rescoring

Rows go to ``benchmarks/results/eviction.jsonl``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import List

import dtr
from dtr.core import Heuristic, OpRecord, Runtime, State, make_heuristic

from provenance import commit, machine

RESULTS = Path(__file__).parent / "results"
TARGET_US = 20.0
RESIDENT = State.RESIDENT


class Executor:
    """Never replays: the benchmark's ops read resident storages only."""

    def replay(self, rec):  # pragma: no cover - a replay would mean the benchmark is wrong
        raise AssertionError(f"{rec.name} replayed")

    def forget(self, rec):
        pass


class Handle:
    """Stands for a tensor the program holds."""


class Rescored(Heuristic):
    """A heuristic's scores through ``score`` only: the runtime then rescores every candidate
    each round instead of using the candidate index."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name + " (rescoring)"
        for hook in ("on_evict", "on_materialize", "on_release"):
            setattr(self, hook, getattr(inner, hook))

    def score(self, s, now):
        return self.inner.score(s, now)


class TimedRuntime(Runtime):
    """A ``Runtime`` whose eviction loop (``_evict_to``) adds its wall time to ``spent`` once
    ``timing`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timing = False
        self.spent = 0.0

    def _evict_to(self, target: int, opname: str, best_effort: bool = False) -> None:
        if not self.timing:
            return super()._evict_to(target, opname, best_effort)
        start = time.perf_counter()
        try:
            return super()._evict_to(target, opname, best_effort)
        finally:
            self.spent += time.perf_counter() - start


def run(heuristic, storages: int, ops: int, seed: int, warmup: int = 10) -> dict:
    """One run: build the pool, force ``warmup`` evictions, then time ``ops`` more."""
    rng = random.Random(seed)
    rt = TimedRuntime(None, heuristic, Executor())
    held: List[Handle] = []
    cells = []

    def op(i: int, nbytes: int):
        # Resident inputs only: reading evicted ones would time rematerialization too, and a
        # heuristic that evicts what the next op reads ("size") would thrash.
        recent = [c for c in cells[-64:] if c.storage.state is RESIDENT]
        inputs = rng.sample(recent, min(len(recent), rng.choice((1, 2))))
        rt.acquire(inputs)
        rec = OpRecord(f"op{i}", inputs, None, cost=rng.uniform(1e-6, 1e-3))
        (c,) = rt.complete(rec, [], [(nbytes, i, None)])  # any value but None (None: not resident)
        h = Handle()
        rt.track(h, c)
        held.append(h)
        cells.append(c)

    for i in range(storages):
        op(i, rng.randint(1, 16) * 1024)
    rt.set_budget(rt.memory)
    # The first round registers the whole pool with the candidate index (a one-off of the
    # first eviction in a run; later rounds register the few storages made since): untimed.
    for i in range(warmup):
        op(storages + i, 16 * 1024)
    rt.timing = True
    before = rt.counters.evictions
    gc.disable()
    try:
        for i in range(warmup, warmup + ops):
            op(storages + i, 16 * 1024)
    finally:
        gc.enable()
    evictions = rt.counters.evictions - before
    rt.check_invariants()
    return {"us_per_eviction": rt.spent / evictions * 1e6, "evictions": evictions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storages", nargs="+", type=int, default=[1000, 10000])
    ap.add_argument("--ops", type=int, default=2000, help="forced evictions per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heuristics", nargs="+", default=None, help="default: all of dtr.heuristic_names()")
    ap.add_argument("--rescoring", action="store_true", help="also time the rescoring search")
    ap.add_argument("--out", type=Path, default=RESULTS / "eviction.jsonl")
    args = ap.parse_args()
    names = args.heuristics or dtr.heuristic_names()
    base = {"commit": commit(), "machine": machine(), "run": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"# {base['machine']}  commit {base['commit']}; us per eviction, median of {args.repeats} runs "
          f"of {args.ops} forced evictions; target <= {TARGET_US:g} us at 10,000 storages")
    searches = ["index", "rescoring"] if args.rescoring else ["index"]
    print(f"{'heuristic':<12} {'search':<10} " + " ".join(f"{n:>10}" for n in args.storages))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for name in names:
            for search in searches:
                cells = []
                for n in args.storages:
                    times = []
                    for r in range(args.repeats):
                        h = make_heuristic(name)
                        res = run(h if search == "index" else Rescored(h), n, args.ops, seed=r)
                        times.append(res["us_per_eviction"])
                    us = statistics.median(times)
                    cells.append(f"{us:>10.1f}")
                    row = {**base, "heuristic": name, "search": search, "storages": n, "ops": args.ops,
                           "us_per_eviction": round(us, 2), "runs_us": [round(t, 2) for t in times]}
                    out.write(json.dumps(row) + "\n")
                print(f"{name:<12} {search:<10} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
