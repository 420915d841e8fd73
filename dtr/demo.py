"""``python -m dtr.demo``: train a small GPT-style model for a few steps, eagerly and under a
budget of half its peak, and compare losses, peak memory and time.

Peak memory is measured independently of dtr's own accounting: from torch.profiler's
allocation events on CPU, or ``torch.cuda.max_memory_allocated`` on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import dtr
from dtr.testing.memory import measured_peak
from dtr.testing.zoo import build


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the peak")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    w = build("transformer", "tiny", layers=6, d=64, seq=64, batch=8)
    models = {"eager": w.model.to(args.device), "dtr": copy.deepcopy(w.model).to(args.device)}
    batch = w.batch.to(args.device)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(kind, engine=None):
        torch.manual_seed(step.count)
        m = models[kind]
        if engine is None:
            loss = w.loss_fn(m, batch)
            loss.backward()
        else:
            with engine:
                loss = w.loss_fn(m, batch)
                loss.backward()
                loss = dtr.materialize(loss)
        opts[kind].step()
        opts[kind].zero_grad()  # PyTorch's default: each step makes its gradients, charged to the budget
        return loss.item()

    # Size the budget from one tracked step of a throwaway copy.
    with dtr.budget(None) as probe:
        w.loss_fn(copy.deepcopy(w.model).to(args.device), batch).backward()
    budget = int(probe.stats().peak_resident_bytes * args.fraction)
    engine = dtr.budget(budget)

    print(f"GPT-style decoder, 6 layers, {sum(p.numel() for p in w.model.parameters()):,} parameters, "
          f"device={args.device}, torch {torch.__version__}")
    print(f"budget: {budget / 2**20:.2f} MiB ({args.fraction:.0%} of the tracked peak)\n")
    print(f"{'step':>4} {'eager loss':>12} {'dtr loss':>12} {'same':>5} {'eager ms':>9} {'dtr ms':>9}")
    for i in range(args.steps):
        step.count = i
        t0 = time.perf_counter()
        le = step("eager")
        t1 = time.perf_counter()
        ld = step("dtr", engine)
        t2 = time.perf_counter()
        print(f"{i:>4} {le:>12.6f} {ld:>12.6f} {str(le == ld):>5} {(t1 - t0) * 1e3:>9.1f} {(t2 - t1) * 1e3:>9.1f}")
    step.count = args.steps
    pe = measured_peak(lambda: step("eager"), args.device) / 2**20
    pd = measured_peak(lambda: step("dtr", engine), args.device) / 2**20
    how = "torch.cuda.max_memory_allocated" if torch.device(args.device).type == "cuda" else "torch.profiler allocation events"
    print(f"\npeak memory of one more step ({how}): eager {pe:.2f} MiB, dtr {pd:.2f} MiB")
    print(engine.stats())


if __name__ == "__main__":
    main()
