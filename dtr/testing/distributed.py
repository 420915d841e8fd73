"""Multi-process training under ``dtr.budget``, compared with the same training without dtr,
for ``tests/test_distributed.py`` and ``benchmarks/bench_distributed.py``.

- ``launch`` starts worker processes and waits for them with a deadline: a hung collective
  fails with a clear error instead of hanging CI.
- ``init_gloo`` joins a process group through a file, so that no TCP port is chosen and
  concurrent runs cannot collide.
- ``train_step`` runs one optimizer step (gradient accumulation over micro-batches, all but
  the last without gradient sync), inside an engine's block or not, and returns the
  gradients and the parameters it produced and its time; ``differences`` and ``mismatches``
  compare two such steps or runs bit for bit.
- ``worker`` is the tests': per ``Case`` (DDP or FSDP2, and their options) it trains a model
  eagerly and under dtr in the same process, on the same per-rank data, and saves both runs'
  snapshots to files for the parent to compare. They live here rather than in the test module so that the
  spawned processes can import them whatever pytest's import mode.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import dtr

__all__ = [
    "launch",
    "init_gloo",
    "Step",
    "train_step",
    "differences",
    "mismatches",
    "tanh_mlp",
    "Case",
    "worker",
    "fully_shard_api",
]

Snapshot = Dict[str, List[torch.Tensor]]  # {"grads": [...], "params": [...]}, one entry per step


def launch(fn: Callable, args: tuple, nprocs: int, timeout: float) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes and wait at most ``timeout``
    seconds for all of them.

    A failing process stops the others and re-raises its traceback
    (``torch.multiprocessing.ProcessRaisedException``). Past the deadline every process still
    running is killed and ``TimeoutError`` says which ranks had not finished (typically one
    waiting in a collective for a rank that will never join it).
    """
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    # join() returns as soon as any one process ends; loop until all have, or time is up.
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            running = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            raise TimeoutError(f"ranks {running} of {nprocs} still running after {timeout:.0f} s; killed")


def init_gloo(rank: int, world_size: int, store: Path, timeout: float = 60) -> None:
    """Join the gloo process group rendezvousing through the file ``store`` (no TCP port).
    ``timeout`` bounds every collective, so that a rank left alone errors out."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )


def _local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A plain copy of ``t``: FSDP2's parameters and gradients are DTensors, which are
    compared by their local shard (``to_local``)."""
    if t is None:
        return None
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().clone()


@dataclass
class Step:
    """What ``train_step`` returns: copies of the gradients after backward and of the
    parameters after ``optimizer.step()`` (None without ``snapshot``), and the step's wall
    seconds (copies excluded)."""

    grads: Optional[List[Optional[torch.Tensor]]]
    params: Optional[List[torch.Tensor]]
    seconds: float


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    engine: Optional["dtr.Engine"] = None,
    *,
    set_to_none: bool = False,
    seed: int = 1,
    sync: Callable[[], None] = lambda: None,
    snapshot: bool = True,
) -> Step:
    """One optimizer step of ``model``.

    Gradients are zeroed first (``set_to_none``), then accumulated over ``micro_batches``
    inside ``engine``'s block when one is given; every micro-batch but the last runs without
    gradient sync (``_no_sync``). The RNG is seeded so that an eager
    step and a dtr step draw the same dropout masks. ``sync`` waits for the device (CUDA)
    before each clock reading. ``snapshot=False`` copies nothing, for steps whose memory is
    measured (a copy of the gradients would be most of their peak).
    """
    sync()
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=set_to_none)
    torch.manual_seed(seed)
    with engine if engine is not None else nullcontext():
        for i, mb in enumerate(micro_batches):
            with _no_sync(model) if i < len(micro_batches) - 1 else nullcontext():
                loss_fn(model, mb).backward()
    sync()
    seconds = time.perf_counter() - t0
    grads = [_local(p.grad) for p in model.parameters()] if snapshot else None
    sync()
    t0 = time.perf_counter()
    optimizer.step()
    sync()
    seconds += time.perf_counter() - t0
    return Step(grads, [_local(p) for p in model.parameters()] if snapshot else None, seconds)


@contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation without communication: DDP's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync(False)``."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def differences(
    expected: Sequence[Optional[torch.Tensor]], got: Sequence[Optional[torch.Tensor]], what: str
) -> List[str]:
    """One line per tensor of ``got`` that differs from ``expected``'s bit for bit."""
    if len(expected) != len(got):
        return [f"{what}: {len(expected)} tensors vs {len(got)}"]
    out = []
    for i, (x, y) in enumerate(zip(expected, got)):
        if (x is None) != (y is None):
            out.append(f"{what}[{i}]: one is None")
        elif x is not None and not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else "shapes differ"
            out.append(f"{what}[{i}] differs (max |diff| {diff})")
    return out


def mismatches(eager: Snapshot, other: Snapshot) -> List[str]:
    """Where two runs' snapshots differ bit for bit, step by step."""
    out = []
    for kind in ("grads", "params"):
        if len(eager[kind]) != len(other[kind]):
            out.append(f"{kind}: {len(eager[kind])} steps vs {len(other[kind])}")
            continue
        for step, (xs, ys) in enumerate(zip(eager[kind], other[kind])):
            out += differences(xs, ys, f"step {step} {kind}")
    return out


# ---------------------------------------------------------------------------- workers


WIDTH, DEPTH, BATCH = 128, 8, 512


def tanh_mlp(width: int = WIDTH, depth: int = DEPTH, classes: int = 10) -> nn.Module:
    """``depth`` Linear(width, width) + Tanh layers and a linear head: a few distributed
    steps take well under a second on a CPU.

    Activations outweigh parameters at these sizes, as half the unlimited peak needs: the
    gradients a block makes stay charged until it ends, and a tanh backward holds three
    activations at once, so a 4-layer, 256-wide MLP (batch 32, or even 1024) raises
    ``OutOfBudgetError`` there, while this one evicts."""
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def _cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _batches(rank: int, steps: int, micro: int, batch: int = BATCH, width: int = WIDTH) -> List[list]:
    """Per step, ``micro`` micro-batches of rank ``rank``'s data (each rank its own)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        [(torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(micro)]
        for _ in range(steps)
    ]


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _train(model, optimizer, batches, engine=None, set_to_none=False) -> Snapshot:
    snap: Snapshot = {"grads": [], "params": []}
    for step, micro in enumerate(batches):
        result = train_step(model, optimizer, micro, _cross_entropy, engine, set_to_none=set_to_none, seed=step)
        snap["grads"].append(result.grads)
        snap["params"].append(result.params)
    return snap


def _worker_setup(rank: int, world_size: int, store: Path) -> None:
    # Two ranks share the machine's cores; bitwise comparisons need deterministic kernels.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    init_gloo(rank, world_size, store)


@dataclass
class Case:
    """One data-parallel configuration trained eagerly and under dtr (see ``worker``)."""

    name: str
    parallel: str = "ddp"  # "ddp": DistributedDataParallel; "fsdp2": fully_shard per layer and root
    options: Dict[str, Any] = field(default_factory=dict)  # DDP's or fully_shard's keyword arguments
    fraction: Optional[float] = 0.5  # budget as a fraction of the unlimited step's peak; None: unlimited
    micro_batches: int = 1  # > 1: gradient accumulation, all but the last without gradient sync
    set_to_none: bool = False  # optimizer.zero_grad(set_to_none=...) between steps
    optimizer: str = "sgd"  # "sgd" (with momentum) or "adam"
    steps: int = 3


def fully_shard_api():
    """``(fully_shard, init_device_mesh)``: FSDP2's public API, or on older torch (2.4, 2.5)
    its ``torch.distributed._composable.fsdp`` location. Raises ``ImportError`` without it."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    return fully_shard, init_device_mesh


def _parallel(model: nn.Module, case: Case) -> nn.Module:
    """A copy of ``model`` wrapped as ``case`` says (FSDP2: each Linear, then the root)."""
    model = copy.deepcopy(model)
    if case.parallel == "ddp":
        return DDP(model, **case.options)
    fully_shard, init_device_mesh = fully_shard_api()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **case.options)
    return fully_shard(model, mesh=mesh, **case.options)


def worker(rank: int, world_size: int, store: Path, out: Path, cases: Sequence[Case]) -> None:
    """Per case: train a copy of one model eagerly, then another copy under dtr
    (``cost="estimate"``, deterministic), same seeds and per-rank data, both wrapped as the
    case says; saves ``{"eager", "dtr", "stats", "budget", "peak", "warnings", "grad_bytes"}`` (``"error"``
    instead of ``"dtr"`` and ``"stats"`` if the dtr run raised a ``DTRError``) to
    ``out/<case>.rank<rank>.pt``.

    The budget's peak comes from one probe step of a third copy under ``dtr.budget(None)``,
    the same first step the dtr run then takes. Copies are made before wrapping.
    """
    _worker_setup(rank, world_size, store)
    for case in cases:
        torch.manual_seed(0)
        model = tanh_mlp()
        batches = _batches(rank, case.steps, case.micro_batches)
        eager, managed = (_parallel(model, case) for _ in range(2))
        result: Dict[str, Any] = {"eager": _train(eager, _optimizer(case.optimizer, eager), batches, set_to_none=case.set_to_none)}
        try:
            budget = peak = None
            if case.fraction is not None:
                probe = _parallel(model, case)
                engine = dtr.budget(None, cost="estimate")
                train_step(probe, _optimizer(case.optimizer, probe), batches[0], _cross_entropy, engine, seed=0)
                peak = engine.stats().peak_resident_bytes
                budget = int(case.fraction * peak)
            engine = dtr.budget(budget, cost="estimate")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    result["dtr"] = _train(managed, _optimizer(case.optimizer, managed), batches, engine, case.set_to_none)
                finally:
                    result["warnings"] = [str(w.message) for w in caught]
            result.update(stats=dataclasses.asdict(engine.stats()), budget=budget, peak=peak)
            # What the last step's gradients take on this rank (a DTensor's by its local shard).
            result["grad_bytes"] = sum(g.numel() * g.element_size() for g in (_local(p.grad) for p in managed.parameters()) if g is not None)
        except dtr.DTRError as e:
            result["error"] = f"{type(e).__name__}: {e}"
        torch.save(result, out / f"{case.name}.rank{rank}.pt")
    dist.destroy_process_group()
