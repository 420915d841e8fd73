"""Where a step's time goes under a budget: the engine's budget machinery, split by phase,
against the replayed kernels it exists to run (issue 18: the recurrent loops' wall time at
0.5 and 0.3 of their peak).

Workloads: the recurrent loops of ``bench_runtime.py`` (``gru_cell_small``: a ``GRUCell`` with
batch 32 and hidden 128 over 100 steps; ``lstmcell``: the zoo's ``LSTMCell`` bench preset), and
the bench presets of issue 18's sweep (``gru_cell``, ``lstm_cell_masked``, ``treelstm_batch``,
``treelstm_nary``),
forward and backward, 1 intra-op thread. Per model and fraction: one engine at the fraction
of the unlimited step's peak resident bytes, ``--warmup`` untimed steps, then ``--repeats``
steps timed as they are, then ``--repeats`` steps with the phases timed in place
(monkeypatched here; the library is unchanged), each inclusively and at its outermost call:

- ``python path``: ``Driver._execute``, the ops the native path hands to Python (an evicted
  input, an ``.item()``), with the rematerializations they wait for;
- ``materialize``: every rematerialization (``rematerialize.materialize``), with the replays
  and the eviction rounds it runs for room;
- ``replay``: ``Driver.replay``, one op run again (guards, argument templates, the kernel);
  ``kernels`` is the kernels' own time within it, as the driver timed them, and ``copies`` the
  copies an in-place op's replay starts from (``clone_root``) and the views it takes of them
  (``derive``), timed around those calls;
- ``eviction rounds``: ``Runtime._evict_to``, the candidate search and the evictions;
- ``room before ops``: ``Driver._make_room``, sizing an op's outputs and evicting for them.
  Replacing it sends the native path's sizing (hotpath.c's ``make_room``) to it too, so this
  phase times the Python sizing; the uninstrumented step times the native one.

Phases nest (a materialization replays and evicts; the Python path materializes), so the
rows do not add up; ``machinery`` is the budgeted step less the unlimited one less the
replayed kernels and copies. Replays are counted apart from rematerializations: re-deriving a view of a
resident storage replays its view op and brings back no bytes.

    .venv/bin/python benchmarks/budget_breakdown.py                       # the two loops, 0.5
    .venv/bin/python benchmarks/budget_breakdown.py --models gru_cell_small --fractions 0.5 0.3

Rows (JSON lines, with commit and machine) are appended to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import dtr
from dtr.core import runtime as runtime_module
from dtr.eager import driver as driver_module
from dtr.eager import replay as replay_module
from dtr.testing import zoo
from dtr.testing.step import fresh_model, run_step

from provenance import commit, machine

RESULTS = Path(__file__).parent / "results" / "budget_breakdown.jsonl"
MODELS = {
    "gru_cell_small": ("gru_cell", dict(batch=32, d_emb=128, hidden=128, lengths=(100, 100), padded=100)),
    "lstmcell": ("lstmcell", {}),
    "gru_cell": ("gru_cell", {}),
    "lstm_cell_masked": ("lstm_cell_masked", {}),
    "treelstm_batch": ("treelstm_batch", {}),
    "treelstm_nary": ("treelstm_nary", {}),
}
# (label, owner, attribute): each timed at its outermost call.
PHASES = (
    ("python path", driver_module.Driver, "_execute"),
    ("materialize", runtime_module, "materialize"),
    ("replay", driver_module.Driver, "replay"),
    ("eviction rounds", runtime_module.Runtime, "_evict_to"),
    ("room before ops", driver_module.Driver, "_make_room"),
)


class Phases:
    """Inclusive time and calls of each phase at its outermost call, while installed."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.kernels = 0.0
        self.copies = 0.0
        self._depth: collections.Counter = collections.Counter()
        self._saved: list = []

    def _timed(self, label, fn):
        depth, seconds, calls, clock = self._depth, self.seconds, self.calls, time.perf_counter

        def timed(*args, **kwargs):
            if depth[label]:
                return fn(*args, **kwargs)
            depth[label] += 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += clock() - t0
                calls[label] += 1
                depth[label] -= 1

        return timed

    def __enter__(self) -> "Phases":
        for label, owner, name in PHASES:
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn))
            if label == "replay":
                fn = self._counting_kernels(fn)
            setattr(owner, name, self._timed(label, fn))
        for name in ("clone_root", "derive"):  # module globals that replay() calls
            fn = getattr(replay_module, name)
            self._saved.append((replay_module, name, fn))
            setattr(replay_module, name, self._copying(fn))
        return self

    def _copying(self, fn):
        clock = time.perf_counter

        def timed(*args):
            t0 = clock()
            try:
                return fn(*args)
            finally:
                self.copies += clock() - t0

        return timed

    def _counting_kernels(self, replay):
        def replay_counted(driver, rec):
            values, seconds = replay(driver, rec)
            self.kernels += seconds
            return values, seconds

        return replay_counted

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()


def workload(name: str) -> zoo.Workload:
    base, overrides = MODELS[name]
    return zoo.build(base, "bench", **overrides)


def steps(w, model, engine, n: int) -> list:
    times = []
    for _ in range(n):
        gc.collect()
        t0 = time.perf_counter()
        run_step(w, model, engine)
        times.append(time.perf_counter() - t0)
    return times


def measure(name: str, fraction: float, args) -> dict:
    w = workload(name)
    model = fresh_model(w)
    unlimited = dtr.budget(None)
    steps(w, model, unlimited, args.warmup)
    unlimited_s = statistics.median(steps(w, model, unlimited, args.repeats))
    peak = unlimited.stats().peak_resident_bytes
    engine = dtr.budget(int(peak * fraction))
    steps(w, model, engine, args.warmup)
    before = engine.stats()
    budget_s = statistics.median(steps(w, model, engine, args.repeats))
    after = engine.stats()
    with Phases() as phases:
        instrumented_s = statistics.median(steps(w, model, engine, args.repeats))
    n = args.repeats
    row = {
        "model": name, "fraction": fraction, "budget_bytes": int(peak * fraction),
        "unlimited_ms": unlimited_s * 1e3, "budget_ms": budget_s * 1e3, "instrumented_ms": instrumented_s * 1e3,
        "evictions": (after.evictions - before.evictions) / n,
        "rematerializations": (after.rematerializations - before.rematerializations) / n,
        "replays": phases.calls["replay"] / n,
        "kernels_ms": phases.kernels / n * 1e3,
        "copies_ms": phases.copies / n * 1e3,
        "phases_ms": {label: phases.seconds[label] / n * 1e3 for label, *_ in PHASES},
        "phase_calls": {label: phases.calls[label] / n for label, *_ in PHASES},
    }
    row["machinery_ms"] = row["budget_ms"] - row["unlimited_ms"] - row["kernels_ms"] - row["copies_ms"]
    return row


def show(row: dict) -> None:
    print(f"\n{row['model']} at {row['fraction']:g} of its peak ({row['budget_bytes'] / 2**20:.1f} MiB): "
          f"step {row['budget_ms']:.1f} ms (instrumented {row['instrumented_ms']:.1f}), unlimited "
          f"{row['unlimited_ms']:.1f} ms; per step {row['evictions']:.0f} evictions, "
          f"{row['rematerializations']:.0f} rematerializations, {row['replays']:.0f} replays")
    print(f"  {'phase (inclusive, outermost calls)':42} {'ms/step':>8} {'calls/step':>11}")
    for label, *_ in PHASES:
        print(f"  {label:42} {row['phases_ms'][label]:8.1f} {row['phase_calls'][label]:11.0f}")
    print(f"  {'of which replayed kernels':42} {row['kernels_ms']:8.1f}")
    print(f"  {'of which copies for in-place replays':42} {row['copies_ms']:8.1f}")
    print(f"  {'machinery (budget - unlimited - both)':42} {row['machinery_ms']:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["gru_cell_small", "lstmcell"])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    stamp = {"commit": commit(), "machine": machine(), "torch": torch.__version__,
             "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"# {stamp['machine']}, torch {stamp['torch']}, commit {stamp['commit']}")
    with args.out.open("a") as out:
        for name in args.models:
            for fraction in args.fractions:
                try:
                    row = {**measure(name, fraction, args), **stamp}
                except dtr.OutOfBudgetError as e:  # below what the loop can run at
                    print(f"\n{name} at {fraction:g} of its peak: {type(e).__name__}: {str(e)[:160]}")
                    row = {"model": name, "fraction": fraction, "refused": str(e), **stamp}
                else:
                    show(row)
                out.write(json.dumps(row) + "\n")
    print(f"\nrows appended to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
