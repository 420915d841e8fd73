"""Data-parallel training under dtr: DDP steps eagerly and under a budget, on every rank.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--budget-fraction 0.5] [--steps N] \
        [--model mlp|transformer]
    python benchmarks/bench_distributed.py                      # one process (world size 1)
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cuda   # nccl, a GPU per rank

Each rank builds the same ``dtr.testing.zoo`` model (``--size``, bench preset by default) and
its own batch, and wraps two copies of the model in DDP (gloo on CPU, nccl on CUDA): one
trained eagerly, one under dtr. Every step (forward, backward, ``optimizer.step()``; SGD with
momentum, ``zero_grad(set_to_none=False)``) runs on the eager copy, then on the dtr copy, and
their gradients and parameters are compared. First a warm-up step without dtr (it allocates
the gradients and momentum buffers, constants to the dtr steps, as in a training loop's later
steps), then one under ``dtr.budget(None)`` for the unlimited peak, then ``--steps`` timed
steps under ``dtr.budget(fraction x peak)`` (taking turns with eager steps, so that load from
other processes hits both alike), and one more of each, not compared, measured for its true peak:
torch.profiler's allocation events on CPU (``dtr.testing.memory``),
``torch.cuda.max_memory_allocated`` on CUDA.

Rank 0 prints, per rank and mode: median step time, dtr's ``peak_resident_bytes``, the true
peak, evictions and rematerializations over the timed steps, and whether the gradients after
backward and the parameters after ``optimizer.step()`` equal eager's bit for bit in every
step but the measured one. It appends one JSON row per rank to
``benchmarks/results/distributed.jsonl`` (commit, machine, torch, threads, load and the run's
settings on each).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dtr
from dtr.testing import zoo
from dtr.testing.distributed import differences, train_step
from dtr.testing.memory import measured_peak

from provenance import commit, machine

RESULTS = Path(__file__).parent / "results" / "distributed.jsonl"
MiB = 2**20


def init(device_kind: str) -> torch.device:
    """Join the process group: torchrun's (``env://``), or a world of one through a file in a
    temporary directory when started by plain ``python``. The rank's device."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, init_method="env://")
    else:
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)  # nccl and gather_object use the current device
        return device
    return torch.device("cpu")


def run(args, device: torch.device) -> dict:
    """This rank's measurements (see the module docstring)."""
    rank = dist.get_rank()
    w = zoo.on_device(zoo.build(args.model, args.size, seed=0), device)
    # Each rank its own data; DDP keeps the model in sync (its construction broadcasts rank 0's).
    batch = zoo.on_device(zoo.build(args.model, args.size, seed=1 + rank), device).batch
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ddp_args = {"device_ids": [device.index]} if device.type == "cuda" else {}
    # Copies of the model made before DDP wraps them; one optimizer each.
    eager, managed = (DDP(copy.deepcopy(w.model), **ddp_args) for _ in range(2))
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (eager, managed)}
    diffs = {"grads": [], "params": []}

    def step(model, seed, engine=None, snapshot=True):
        return train_step(model, opts[model], [batch], w.loss_fn, engine, seed=seed, sync=sync, snapshot=snapshot)

    def both(seed, engine):
        """A step of the eager copy, then one of the dtr copy in ``engine``'s block, compared
        bit for bit; their wall seconds."""
        a, b = step(eager, seed), step(managed, seed, engine)
        for kind in diffs:
            diffs[kind] += differences(getattr(a, kind), getattr(b, kind), f"step {seed} {kind}")
        return a.seconds, b.seconds

    # Warm-up without dtr: allocates the gradients and the momentum buffers, which the dtr
    # steps then find as constants (zero_grad(set_to_none=False)), as a training loop would.
    both(0, None)
    probe = dtr.budget(None)
    both(1, probe)
    peak = probe.stats().peak_resident_bytes
    budget = int(args.budget_fraction * peak)
    engine = dtr.budget(budget)
    times = {"eager": [], "dtr": []}
    for i in range(args.steps):
        a, b = both(2 + i, engine)
        times["eager"].append(a)
        times["dtr"].append(b)
    stats = engine.stats()
    # Not compared: the copies of the gradients would dominate the peak.
    true_peak = [measured_peak(lambda: step(m, 2 + args.steps, e, snapshot=False), device)
                 for m, e in ((eager, None), (managed, engine))]
    return {
        "rank": rank,
        "unlimited_peak_bytes": peak,
        "budget_bytes": budget,
        "eager_ms": statistics.median(times["eager"]) * 1e3,
        "dtr_ms": statistics.median(times["dtr"]) * 1e3,
        "dtr_peak_bytes": stats.peak_resident_bytes,
        "eager_true_peak_bytes": true_peak[0],
        "dtr_true_peak_bytes": true_peak[1],
        "evictions": stats.evictions,
        "rematerializations": stats.rematerializations,
        "grads_equal": not diffs["grads"],
        "params_equal": not diffs["params"],
        "differences": (diffs["grads"] + diffs["params"])[:5],
    }


def report(rows, base) -> None:
    """Print the run's settings, then a line per rank and mode."""
    print(f"# {base['machine']} | torch {base['torch']} | commit {base['commit']} | {base['world_size']} x "
          f"{base['backend']} on {base['device']} | threads {base['threads']} | load {base['load']}")
    print(f"# {base['model']} ({base['size']} preset), {base['steps']} steps, budget {base['fraction']} x the "
          f"unlimited peak ({rows[0]['unlimited_peak_bytes'] / MiB:.1f} MiB on rank 0)")
    print(f"{'rank':>4} {'mode':<5} {'step ms':>8} {'dtr peak MiB':>12} {'true peak MiB':>13} {'evictions':>9} "
          f"{'remats':>6} {'grads':>6} {'params':>6}")
    for r in rows:
        same = {k: "equal" if r[f"{k}_equal"] else "DIFFER" for k in ("grads", "params")}
        print(f"{r['rank']:>4} {'eager':<5} {r['eager_ms']:>8.1f} {'':>12} {r['eager_true_peak_bytes'] / MiB:>13.1f}")
        print(f"{r['rank']:>4} {'dtr':<5} {r['dtr_ms']:>8.1f} {r['dtr_peak_bytes'] / MiB:>12.1f} "
              f"{r['dtr_true_peak_bytes'] / MiB:>13.1f} {r['evictions']:>9} {r['rematerializations']:>6} "
              f"{same['grads']:>6} {same['params']:>6}")
        for line in r["differences"]:
            print(f"     rank {r['rank']}: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument("--size", choices=["tiny", "bench"], default="bench", help="zoo preset")
    ap.add_argument("--budget-fraction", type=float, default=0.5, help="of the unlimited step's dtr peak")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (after warm-up and probe)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    # Ranks share the machine's cores; one thread each keeps them from fighting over them.
    torch.set_num_threads(args.threads)
    # Bitwise comparisons need deterministic kernels (cuBLAS only with this workspace setting,
    # read when it starts).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    device = init(args.device)
    row = run(args, device)
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    if dist.get_rank() == 0:
        base = {"commit": commit(), "machine": machine(), "torch": torch.__version__, "threads": args.threads,
                "load": round(os.getloadavg()[0], 2), "world_size": dist.get_world_size(),
                "backend": dist.get_backend(), "device": args.device, "model": args.model, "size": args.size,
                "fraction": args.budget_fraction, "steps": args.steps}
        report(rows, base)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as out:
            for r in rows:
                out.write(json.dumps({**base, **r}) + "\n")
        print(f"rows appended to {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
