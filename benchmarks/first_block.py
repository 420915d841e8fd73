"""A process's first budgeted steps: what sizing their ops costs, and what it imports.

An engine sizes every op of its first block (Note [Room before an op] in driver.py), by a rule
(Note [Sizes without the meta device] in size_rules.py) or on the meta device, and caches the
size per op and shapes for the process. For each model (zoo, bench preset, 1 intra-op thread),
each run in a fresh process: an eager step, then the first budgeted step (a fresh engine, every
size looked up anew), then a second budgeted step with another fresh engine (sizes cached);
then which of ``torch._dynamo`` and sympy the process has imported, its objects tracked by the
cyclic collector, and one full collection's time. The "meta" runs switch the rules off
(every op sized on the meta device, as before them); the two take turns, ``--runs`` each. The
budget is far above the step's peak: what is timed is sizing, not eviction. Rows go to
``results/first_block.jsonl``.

    .venv/bin/python benchmarks/first_block.py --models transformer gru_cell lstm_cell_masked
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from provenance import commit, machine

RESULTS = Path(__file__).parent / "results" / "first_block.jsonl"


def child(name: str, sizing: str) -> dict:
    """One run, in this process: the figures ``main`` prints."""
    import gc

    import dtr
    from dtr.eager import output_size
    from dtr.testing import zoo
    from dtr.testing.step import timed_step

    if sizing == "meta":  # output_size looks the name up at each size it finds
        output_size.rule_bytes = lambda func, args, kwargs: None
    torch.set_num_threads(1)
    w = zoo.build(name, "bench")
    eager = timed_step(w, w.model)
    first = timed_step(w, w.model, dtr.budget("64 GiB"))
    second = timed_step(w, w.model, dtr.budget("64 GiB"))
    t0 = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - t0
    return {"model": name, "sizing": sizing, "eager_s": eager, "first_s": first, "second_s": second,
            "sizes": len(output_size._SIZES), "dynamo": "torch._dynamo" in sys.modules,
            "sympy": "sympy" in sys.modules, "objects": len(gc.get_objects()), "full_gc_ms": full * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["transformer", "gru_cell", "lstm_cell_masked"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "SIZING"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    stamp = {"commit": commit(), "machine": machine(), "torch": torch.__version__,
             "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"# {stamp['machine']}, torch {stamp['torch']}, commit {stamp['commit']}")
    print("| model | sizing | eager step (s) | first budgeted step (s) | second (s) | sizes | imports "
          "| objects | full collection (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with args.out.open("a") as out:
        for name in args.models:
            runs: dict = {"rules": [], "meta": []}
            for i in range(args.runs):
                for sizing in sorted(runs, reverse=i % 2 == 1):  # which goes first alternates
                    got = subprocess.run([sys.executable, __file__, "--child", name, sizing],
                                         capture_output=True, text=True)
                    if got.returncode:
                        sys.exit(f"{name}, sizing by {sizing}: the run failed\n{got.stderr}")
                    runs[sizing].append(json.loads(got.stdout.splitlines()[-1]))
            for sizing, rows in runs.items():
                med = {k: statistics.median(r[k] for r in rows)
                       for k in ("eager_s", "first_s", "second_s", "objects", "full_gc_ms")}
                imports = ", ".join(m for m in ("dynamo", "sympy") if rows[0][m]) or "none"
                print(f"| {name} | {sizing} | {med['eager_s']:.3f} | {med['first_s']:.3f} | "
                      f"{med['second_s']:.3f} | {rows[0]['sizes']} | {imports} | {med['objects']:,.0f} "
                      f"| {med['full_gc_ms']:.0f} |")
                out.write(json.dumps({"model": name, "sizing": sizing, "runs": rows, "median": med, **stamp}) + "\n")
    print(f"\nrows appended to {args.out} (medians of {args.runs} runs)", file=sys.stderr)


if __name__ == "__main__":
    main()
