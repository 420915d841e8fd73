"""dtr's cost per op in instructions executed, counted by valgrind's callgrind: a figure that
does not move with the machine's speed or load (issue 20, beside the wall times of
``bench_runtime.py --sections small``).

Workloads: the small-op loops of ``bench_runtime.py`` (``--ops`` forward ops on 64x64
float32), in three modes: eager; ``floor``, a mode that only calls each op
(``RawPassThrough``); ``dtr``, ``dtr.budget(None)``. Each mode runs twice untimed, then
``--runs`` times inside one call of ``functools.reduce``: callgrind counts only inside that C
function (``--toggle-collect``) and writes one count per call (``--dump-after``), so the
interpreter's start, imports and warm-up are left out; the counted process has a fixed hash
seed. Per op is the count over the ops the ``CountOps`` mode sees (as bench_runtime.py
divides); "beyond floor" is (dtr - floor) per op.
Instructions are not time (a cache miss costs more than an add), but a change that removes
work removes instructions, on any machine.

    .venv/bin/python benchmarks/op_instructions.py                 # ~7 min on the 2-core VM
    .venv/bin/python benchmarks/op_instructions.py --workloads elementwise --runs 3
    .venv/bin/python benchmarks/op_instructions.py --models gru_cell_small lstmcell treelstm trees_small  # ~40 min, 2-core VM

``--models`` counts one training step of ``bench_runtime.py``'s models instead (its
``model_steps``: eager, the pass-through floor, the wrapper-only mode, ``dtr.budget(None)``;
two untimed steps first) and prints instructions per step with dtr's ratio to each: issue 20's
model targets are wall-time ratios to eager, and this is the count behind them that the VM's
speed does not move (a Python-heavy mode runs fewer instructions per second than eager's
kernels, so the ratios are not the wall-time ones).

Needs ``valgrind`` on the PATH and a Python whose ``libpython`` keeps its symbols
(``functools_reduce``); says so otherwise. Prints a table and appends it, with commit,
machine and torch version, to ``benchmarks/results/op_instructions.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench_runtime import MODELS as STEP_MODELS, TINY_LOOPS, count_ops, model_steps, small_series, small_workloads
from provenance import commit, machine

MODES = ("eager", "floor", "dtr")
WORKLOADS = ("elementwise", "matmul", "matmul_fwd_bwd", "in_place", "two_outputs")
STEP_MODES = ("eager", "passthrough", "wrapper", "dtr_unlimited")


def child(workloads, ops: int, runs: int, models) -> None:
    """Runs under callgrind: one counted ``functools.reduce`` per workload (or model) and mode."""
    torch.set_num_threads(1)
    for name in models:
        steps = model_steps(name)
        for mode in STEP_MODES:
            _counted(steps[mode], runs)
    for name in workloads:
        fn = small_workloads(ops)[name]
        for series in small_series(fn):  # eager, the floor, dtr: in MODES' order
            _counted(series.fn, runs)


def _counted(run, runs: int) -> None:
    """Two untimed calls of ``run``, then ``runs`` inside the one ``functools.reduce`` that
    callgrind counts."""
    run()
    run()
    gc.collect()
    functools.reduce(lambda _, f: f(), [run] * runs, None)


def _count(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"{dump}: no instruction total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--ops", type=int, default=200, help="forward ops per loop")
    parser.add_argument("--runs", type=int, default=None,
                        help="counted runs per mode (default: 5 runs of each small-op loop, 1 step of each model)")
    parser.add_argument("--models", nargs="+", choices=STEP_MODELS + tuple(TINY_LOOPS), default=[],
                        help="count training steps of these models instead of the small-op loops "
                             "(--workloads and --ops are then unused)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "op_instructions.jsonl"))
    args = parser.parse_args()
    if args.runs is None:
        args.runs = 1 if args.models else 5
    workloads = [] if args.models else args.workloads
    if args.child:
        child(workloads, args.ops, args.runs, args.models)
        return
    if shutil.which("valgrind") is None:
        sys.exit("op_instructions.py: valgrind is not on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
               "--dump-after=functools_reduce", f"--callgrind-out-file={out}", sys.executable, __file__, "--child",
               "--ops", str(args.ops), "--runs", str(args.runs)]
        cmd += ["--models", *args.models] if args.models else ["--workloads", *args.workloads]
        # A fixed hash seed: set and dict layouts the same run to run (addresses still move
        # the counts by about 1%).
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        # One dump per counted call, numbered from 1 in order; a count of zero or a dump more
        # means the toggle did not bracket exactly the counted calls.
        dumps = sorted(Path(tmp).glob("cg.out.*"), key=lambda p: int(p.suffix[1:]))
        counts = [_count(d) for d in dumps]
    calls = len(args.models) * len(STEP_MODES) + len(workloads) * len(MODES)
    if len(counts) != calls or not all(counts):
        sys.exit(f"op_instructions.py: {len(counts)} counts for {calls} calls "
                 f"(zero: {counts.count(0)}); is libpython stripped of functools_reduce, or does the "
                 f"measured code call functools.reduce?")
    stamp = {"commit": commit(), "machine": machine(), "torch": torch.__version__, "ops": args.ops,
             "runs": args.runs, "hash_seed": "0"}
    if args.models:
        report_steps(args, stamp, counts)
        return
    print(f"# {stamp['machine']}  commit {stamp['commit']}  torch {stamp['torch']}; instructions per op "
          f"(callgrind), {args.runs} runs of {args.ops}-op loops")
    print(f"{'workload':<15} {'ops':>5} {'eager':>8} {'floor':>8} {'dtr':>8} {'beyond floor':>12}")
    rows = []
    with open(args.out, "a") as f:
        for i, name in enumerate(args.workloads):
            n = count_ops(small_workloads(args.ops)[name]) * args.runs
            eager, floor, mine = (c / n for c in counts[3 * i:3 * i + 3])
            row = dict(stamp, workload=name, ops_per_run=n // args.runs, eager=round(eager), floor=round(floor),
                       dtr=round(mine), beyond_floor=round(mine - floor))
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            print(f"{name:<15} {row['ops_per_run']:>5} {row['eager']:>8} {row['floor']:>8} {row['dtr']:>8} "
                  f"{row['beyond_floor']:>12}")


def report_steps(args, stamp: dict, counts) -> None:
    """Prints and appends the ``--models`` rows: instructions per step of each mode."""
    base = {k: v for k, v in stamp.items() if k != "ops"}
    print(f"# {base['machine']}  commit {base['commit']}  torch {base['torch']}; millions of instructions "
          f"per training step (callgrind), {args.runs} counted step(s) per mode")
    print(f"{'model':<15} {'eager':>8} {'floor':>8} {'wrapper':>8} {'dtr':>8} {'dtr/eager':>9} {'dtr/floor':>9} "
          f"{'dtr/wrapper':>11}")
    with open(args.out, "a") as f:
        for i, name in enumerate(args.models):
            n = len(STEP_MODES)
            eager, floor, wrapper, mine = (c / args.runs for c in counts[n * i:n * (i + 1)])
            row = dict(base, section="models", model=name, eager=round(eager), floor=round(floor),
                       wrapper=round(wrapper), dtr=round(mine))
            f.write(json.dumps(row) + "\n")
            print(f"{name:<15} {eager / 1e6:>8.1f} {floor / 1e6:>8.1f} {wrapper / 1e6:>8.1f} {mine / 1e6:>8.1f} "
                  f"{mine / eager:>9.2f} {mine / floor:>9.2f} {mine / wrapper:>11.2f}")


if __name__ == "__main__":
    main()
