"""Where a model's unlimited-budget step loses time against eager: a diagnostic behind the
model rows of ``bench_runtime.py``.

For one zoo model (bench preset, 1 intra-op thread): training steps run eagerly, under a
pass-through mode (``RawPassThrough``: only calls each op, the floor of any Python dispatch
mode), and under ``dtr.budget(None)``, taking turns step by step; then, in dtr steps, the time
spent inside ``Driver.dispatch`` outside the op's own kernel call (the engine's measured op
cost), by op. A diagnostic, not a benchmark: it prints and writes nothing.

    python benchmarks/step_overhead.py --model mlp --steps 15
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

import torch

import dtr
from dtr.eager.driver import Driver
from dtr.testing import zoo
from dtr.testing.step import fresh_model

from bench_runtime import RawPassThrough


def walls(w, model, steps: int) -> dict:
    """Median wall seconds of one step per mode, the modes taking turns."""
    runs: dict = {"eager": [], "pass-through": [], "dtr": []}

    def step(mode: str) -> None:
        model.zero_grad(set_to_none=True)
        if mode == "eager":
            w.loss_fn(model, w.batch).backward()
        elif mode == "pass-through":
            with RawPassThrough():
                w.loss_fn(model, w.batch).backward()
        else:
            with dtr.budget(None):
                w.loss_fn(model, w.batch).backward()

    for mode in runs:
        step(mode)  # warm-up
    for _ in range(steps):
        for mode, times in runs.items():
            gc.collect()
            t0 = time.perf_counter()
            step(mode)
            times.append(time.perf_counter() - t0)
    return {mode: statistics.median(times) for mode, times in runs.items()}


def dispatch_overhead(w, model, steps: int) -> dict:
    """Per op name: (calls per step, seconds per step) inside ``Driver.dispatch`` minus the
    op's kernel time as the engine measured it."""
    spent: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    original = Driver.dispatch

    def timed(self, func, args, kwargs):
        k0 = self.op_seconds
        t0 = time.perf_counter()
        try:
            return original(self, func, args, kwargs)
        finally:
            name = str(func)
            spent[name] += time.perf_counter() - t0 - (self.op_seconds - k0)
            calls[name] += 1

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with dtr.budget(None):
            w.loss_fn(model, w.batch).backward()

    step()
    Driver.dispatch = timed
    try:
        for _ in range(steps):
            gc.collect()
            step()
    finally:
        Driver.dispatch = original
    return {name: (calls[name] / steps, s / steps) for name, s in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", choices=zoo.MODELS)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = zoo.build(args.model, "bench")
    model = fresh_model(w)
    m = walls(w, model, args.steps)
    print(f"{args.model}: median step, eager {m['eager'] * 1e3:.1f} ms, pass-through "
          f"{m['pass-through'] * 1e3:.1f} ms ({m['pass-through'] / m['eager']:.3f}x), dtr unlimited "
          f"{m['dtr'] * 1e3:.1f} ms ({m['dtr'] / m['eager']:.3f}x)")
    per_op = dispatch_overhead(w, model, args.steps)
    n = sum(c for c, _ in per_op.values())
    total = sum(s for _, s in per_op.values())
    print(f"dtr dispatch outside kernels: {total * 1e3:.2f} ms per step over {n:.0f} ops "
          f"({total / n * 1e6:.1f} us/op)")
    for name, (c, s) in sorted(per_op.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"    {name:<36} {c:>5.0f} x {s / c * 1e6:7.1f} us = {s * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
