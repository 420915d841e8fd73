"""Runtime overhead of dtr on CPU: engine work per op, and training-step wall time vs eager.

Two sections (the runtime issue's benchmark):

1. ``small``: loops of small ops on 64x64 float32 tensors (elementwise ops, matmul + tanh, a
   matmul + tanh chain with forward and backward, in-place ops, and an op with two outputs:
   the last two take the general Python path, the others the native one), timed eagerly, under a trivial
   ``TorchDispatchMode`` that only calls ``func(*args, **kwargs)`` (PyTorch's Python-dispatch
   floor, ``passthrough_raw``: without the ``torch._disable_dynamo`` wrapper torch puts around
   every mode's ``__torch_dispatch__``, which imports ``torch._dynamo``; ``DTRMode`` takes
   its own only inside compiled code, Note [Dynamo guard], and nothing in this section loads
   dynamo, so dtr runs as in a program that does not use ``torch.compile``), and under
   ``dtr.budget(None)`` (tracking, no eviction). Engine work per op is
   ``(dtr - eager) / engine.stats().ops``; "beyond floor" is ``(dtr - passthrough_raw) / ops``,
   dtr's own bookkeeping. The timed runs start from a ``gc.collect()``, so they hold the
   young-generation collections the engine's objects cause but not the full ones, which those
   objects trigger once they outnumber a quarter of the process's long-lived objects (every
   few runs, and each pass visits every object of the process). "full gc" is that time per
   op, amortized: measured with ``gc.callbacks`` over ``--gc-runs`` back-to-back runs of each
   mode, as a training loop runs them, minus eager's. Target: <= 20 us of engine work per op,
   full collections included.
2. ``models``: one training step (forward + ``loss.backward()`` inside the block) of each model
   of ``dtr.testing.zoo`` at its "bench" preset, eagerly, under the pass-through mode (without
   torch's dynamo guard, as ``passthrough_raw`` above and ``DTRMode``), under a
   mode that only wraps (``WrapperFloor``: every result handed to the program as a wrapper
   subclass holding the plain tensor, nothing recorded; the floor of any design that, like
   dtr's, gives the program tensors of its own), under ``dtr.budget(None)``, and under ``dtr.budget(f x peak)`` for each ``--fractions`` f, where
   peak is the unlimited run's ``stats().peak_resident_bytes``. Default (measured) cost model.
   Target: <= 1.10x eager with an unlimited budget on ``mlp`` and ``transformer``. These steps
   too start from a ``gc.collect()``: full collections are not in them. The "gc ms" column is
   their time per step, amortized as "full gc" above: each process runs ``--gc-steps``
   back-to-back steps of its mode after its timed ones (the column: the median over
   processes). Each mode runs in its own Python process (``--processes`` of them
   per mode, taking turns), as a training run would: on CPU, glibc's allocator hands freed
   memory back to the OS or keeps it depending on the order of the process's earlier
   allocations, and a step pays a minor page fault per 4 KiB it gets back. With the modes
   taking turns in one process, each mode's step started from the heap the previous mode
   left: the bench MLP's dtr steps took ~4,000 faults each after the pass-through step and
   eager's none, while each mode alone gives eager 4,000-7,000 and dtr 0-1,400 (one-off
   probes, docs/runtime.md). The "faults" column shows them per step. To time dtr's own overhead
   without them, pin glibc's thresholds for the run (no mode then faults; each row records
   the ``MALLOC_*`` variables in ``malloc_env``):
   ``MALLOC_TRIM_THRESHOLD_=4000000000 MALLOC_MMAP_THRESHOLD_=4000000000 python ...``.

    python benchmarks/bench_runtime.py                         # both sections, appends JSON rows
    python benchmarks/bench_runtime.py --models mlp transformer --processes 2 --fractions 0.5 0.3
    python benchmarks/bench_runtime.py --sections small --profile   # + cProfile of the hot path

Every time is the median of the timed runs after untimed warm-up runs; the modes of one
workload take turns (run by run for small ops, process by process for models), so that load
from other processes hits them alike. Wall and
CPU (``time.process_time``) times are both kept: on a shared machine other processes stretch
wall time, not CPU time. PyTorch runs with ``--threads`` intra-op threads (1 by default: with
2 threads on a 2-core machine that other work shares, OpenMP barriers make eager timings swing
by up to 10x). A step that raises ``dtr.OutOfBudgetError`` (or any error) is recorded with that
status; one that runs past ``--time-limit`` seconds is interrupted (SIGALRM) and recorded as
``timeout``, with where it was (innermost dtr frame) and the engine's eviction and remat
counts so far (still climbing: it thrashes), and its mode is dropped for that model; rows keep
the medians of the runs that finished before.

Rows go to ``benchmarks/results/runtime.jsonl``, one JSON object per line and measurement:
commit, machine, torch version, threads, section, model, mode, budget_bytes, median_ms,
min_ms, cpu_ms, ratio (to eager, wall), cpu_ratio, us_per_op (extra wall time over eager per
intercepted op), minor_faults, processes and full_gc_ms (models), full_gc_us_per_op and
us_per_op_with_full_gc (small ops), ops, evictions, eager_evictions, remats, remat_ms,
peak_bytes, status, repeats, and the 1-minute load average.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import os
import pstats
import resource
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtr
from dtr.testing.step import run_step
from dtr.testing.zoo import MODELS, build

from progress import progress
from provenance import commit, machine

RESULTS = Path(__file__).parent / "results" / "runtime.jsonl"
TARGET_US_PER_OP = 20.0
TARGET_RATIO = 1.10
TARGET_MODELS = ("mlp", "transformer")
# Loops of tiny ops: a GRUCell with batch 32 and hidden 128 over 100 steps,
# and a batch of small trees; zoo models at the bench preset with these overrides. Target: dtr
# within 1.5x of the pass-through floor ("of floor").
TINY_LOOPS = {
    "gru_cell_small": ("gru_cell", dict(batch=32, d_emb=128, hidden=128, lengths=(100, 100), padded=100)),
    "trees_small": ("treelstm_batch", dict(trees=16, nodes=(8, 16), d_emb=32, hidden=32)),
}
TARGET_OF_FLOOR = 1.5


# ------------------------------------------------------------------------------ running


class RawPassThrough(TorchDispatchMode):
    """The Python-dispatch floor: a mode that runs every op as it is, without the
    ``torch._disable_dynamo`` wrapper torch puts around every mode's ``__torch_dispatch__``
    (private opt-out; ``DTRMode`` has none either)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Wrapped(torch.Tensor):
    """A wrapper subclass that holds a plain tensor and nothing else (``WrapperFloor``)."""

    __slots__ = ("plain",)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("_Wrapped tensors are only handled by WrapperFloor")


def _wrap(out):
    if type(out) is torch.Tensor:
        # As dtr.eager.tensor.make_wrapper builds its wrappers: positional arguments, and no
        # strides where they are the default.
        size = out.size()
        if out.is_contiguous() and not out.storage_offset() and 1 not in size and 0 not in size:
            w = torch.Tensor._make_wrapper_subclass(_Wrapped, size, None, None, None, out.dtype, out.layout, out.device)
        else:
            w = torch.Tensor._make_wrapper_subclass(_Wrapped, size, out.stride(), out.storage_offset(), None,
                                                    out.dtype, out.layout, out.device)
        w.plain = out
        return w
    if type(out) is list or type(out) is tuple:
        return type(out)(_wrap(o) for o in out)
    return out


def _unwrap(a):
    if type(a) is _Wrapped:
        return a.plain
    if type(a) is list or type(a) is tuple:
        return type(a)(_unwrap(x) for x in a)
    return a


class WrapperFloor(TorchDispatchMode):
    """Runs every op on the plain tensors inside its arguments and hands each result to the
    program as a new ``_Wrapped``: what a tensor subclass costs before any bookkeeping
    (``_make_wrapper_subclass``, unwrapping, autograd over subclass tensors). As in dtr, views
    of plain tensors (``weight.t()``) stay plain, and torch's dynamo guard around the mode is
    left out (``RawPassThrough``; ``DTRMode`` has none outside compiled code: Note [Dynamo guard]).
    ``op_breakdown.BareMode`` is its instrumented counterpart (kernels timed, strides always
    passed), whose figures docs/runtime.md quotes at the commit that measured them."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plain = [_unwrap(a) for a in args]
        out = func(*plain, **{k: _unwrap(v) for k, v in (kwargs or {}).items()})
        if func.is_view and all(p is a for p, a in zip(plain, args)):
            return out
        return _wrap(out)


class CountOps(TorchDispatchMode):
    """Counts the ops a mode sees (run untimed, to label the pass-through rows); without
    torch's wrapper, so that counting does not load ``torch._dynamo`` either."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class RunTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise RunTimeout(_where(frame))


def _where(frame) -> str:
    """Where a run was interrupted: the innermost dtr frame and the engine's counters then
    (evictions and remats still climbing say it thrashes rather than hangs)."""
    rt, place = None, None
    while frame is not None:
        owner = frame.f_locals.get("self")
        if rt is None and owner is not None:
            rt = owner if hasattr(owner, "counters") else getattr(owner, "rt", None)
        if place is None and f"{os.sep}dtr{os.sep}" in frame.f_code.co_filename:
            path = frame.f_code.co_filename
            place = f"{path[path.rindex(os.sep + 'dtr' + os.sep) + 1:]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    parts = [f"in {place}"] if place else []
    if rt is not None and hasattr(rt, "counters"):
        c = rt.counters
        parts.append(f"{c.evictions} evictions, {c.rematerializations} remats so far")
    return "; ".join(parts)


@contextmanager
def time_limit(seconds: float):
    """Interrupt the enclosed code with ``RunTimeout`` after ``seconds`` (0: no limit)."""
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Outcome:
    """One run: wall and CPU seconds, the engine's stats (dtr modes), or why it failed."""

    def __init__(self, wall=None, cpu=None, stats=None, ops=None, status="ok", faults=None) -> None:
        self.wall, self.cpu, self.stats, self.ops, self.status = wall, cpu, stats, ops, status
        self.faults = faults  # minor page faults during the run


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn: Callable[[], Optional[dtr.Stats]], limit: float) -> Outcome:
    """Run ``fn`` once under the time limit; ``fn`` returns the engine's stats or None."""
    gc.collect()
    try:
        with time_limit(limit):
            faults = _minor_faults()
            start, start_cpu = time.perf_counter(), time.process_time()
            stats = fn()
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            faults = _minor_faults() - faults
    except RunTimeout as e:
        return Outcome(status=f"timeout after {limit:g} s ({e})" if str(e) else f"timeout after {limit:g} s")
    except dtr.OutOfBudgetError:
        return Outcome(status="OutOfBudgetError")
    except Exception as e:  # record, don't crash the benchmark
        return Outcome(status=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    return Outcome(wall, cpu, stats, stats.ops if stats is not None else None, faults=faults)


class Series:
    """The runs of one (workload, mode)."""

    def __init__(self, mode: str, fn: Callable[[], Optional[dtr.Stats]], budget=None) -> None:
        self.mode, self.fn, self.budget = mode, fn, budget
        self.runs: List[Outcome] = []
        self.status = "ok"
        self.ops: Optional[int] = None
        self.full_gc: List[float] = []  # seconds per step in full collections, one per process (models)

    def run(self, limit: float, keep: bool = True) -> bool:
        o = timed(self.fn, limit)
        if o.status != "ok":
            self.status = o.status
            return False
        if keep:
            self.runs.append(o)
        if o.ops is not None:
            self.ops = o.ops
        return True

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def median(self, attr: str) -> Optional[float]:
        vals = [getattr(r, attr) for r in self.runs]
        return statistics.median(vals) if vals else None

    def stat(self, name: str) -> Optional[int]:
        vals = [getattr(r.stats, name) for r in self.runs if r.stats is not None]
        return statistics.median_low(vals) if vals else None


def measure(series: List[Series], warmup: int, repeats: int, limit: float) -> None:
    """Warm up each series, then time them taking turns; a failing series stops running."""
    for s in series:
        for _ in range(warmup):
            if not s.run(limit, keep=False):
                break
    for _ in range(repeats):
        for s in series:
            if s.ok:
                s.run(limit)


# ------------------------------------------------------------------------------ small ops


def small_workloads(n: int, size: int = 64) -> Dict[str, Callable[[], None]]:
    """Loops of about ``n`` forward ops each on ``size`` x ``size`` float32 tensors."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=g)
    w = torch.randn(size, size, generator=g) / size**0.5
    ws = [(torch.randn(size, size, generator=g) / size**0.5).requires_grad_() for _ in range(n // 2)]

    def elementwise():  # mul, add
        y = x
        for _ in range(n // 2):
            y = y * 0.5 + x

    def matmul():  # mm, tanh
        y = x
        for _ in range(n // 2):
            y = torch.tanh(y @ w)

    def matmul_fwd_bwd():  # mm, tanh per layer; then the backward ops
        for p in ws:
            p.grad = None
        y = x
        for p in ws:
            y = torch.tanh(y @ p)
        y.sum().backward()

    def in_place():  # mul_, add_ on a tensor the loop made: every write makes a new version
        y = x * 1.0
        for _ in range(n // 2):
            y.mul_(0.5).add_(x)

    def two_outputs():  # max over a dimension: values and their indices, two new tensors
        for _ in range(n):
            torch.max(x, 1)

    return {"elementwise": elementwise, "matmul": matmul, "matmul_fwd_bwd": matmul_fwd_bwd,
            "in_place": in_place, "two_outputs": two_outputs}


def small_series(fn: Callable[[], None]) -> List[Series]:
    def eager():
        fn()

    def raw():
        with RawPassThrough():
            fn()

    def unlimited():
        with dtr.budget(None) as engine:
            fn()
        return engine.stats()

    return [Series("eager", eager), Series("passthrough_raw", raw), Series("dtr_unlimited", unlimited)]


class FullCollections:
    """Seconds the cyclic collector spends in full (oldest-generation) collections while
    active (``seconds``), timed with ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def _track(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._started = time.perf_counter()
            else:
                self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self._track)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._track)


def full_gc_seconds(fn: Callable[[], None], runs: int) -> float:
    """Seconds spent in full (oldest-generation) collections per run of ``fn``, amortized over
    ``runs`` back-to-back runs (after one warm-up run and a ``gc.collect()``)."""
    fn()
    gc.collect()
    with FullCollections() as collections:
        for _ in range(runs):
            fn()
    return collections.seconds / runs


def count_ops(fn: Callable[[], None]) -> int:
    with CountOps() as mode:
        fn()
    return mode.ops


def run_small(args, base, out) -> None:
    print(f"\n## engine work per op: loops of small ops on 64x64 float32 (target <= {TARGET_US_PER_OP:g} us/op)")
    print("(us/op: extra wall time over eager per intercepted op; floor: a mode that only calls func, "
          "without torch's _disable_dynamo wrapper;\n beyond floor: (dtr - floor) / ops, "
          "dtr's own bookkeeping; cpu: the same from process CPU time;\n full gc: full collections per op, "
          "amortized over back-to-back runs; total: dtr us/op + full gc, the figure the target applies to)")
    print(f"{'workload':<15} {'ops':>6} {'eager ms':>9} {'floor ms':>9} {'dtr ms':>9} {'eager us/op':>11} "
          f"{'floor us/op':>11} {'dtr us/op':>10} {'beyond floor':>12} {'dtr cpu us/op':>13} "
          f"{'full gc':>8} {'total':>7}  target")
    for name, fn in small_workloads(args.small_ops).items():
        eager, raw, unlimited = series = small_series(fn)
        eager.ops = raw.ops = count_ops(fn)
        measure(series, args.warmup, args.small_repeats, args.time_limit)
        e_wall, e_cpu = eager.median("wall"), eager.median("cpu")
        full_gc = None
        if unlimited.ok:
            extra = full_gc_seconds(unlimited.fn, args.gc_runs) - full_gc_seconds(eager.fn, args.gc_runs)
            full_gc = extra / unlimited.ops
        for s in series:
            row = {**base, "load": round(os.getloadavg()[0], 2), "section": "small", "model": name, "mode": s.mode,
                   "budget_bytes": None, "size": 64, "ops": s.ops, "status": s.status, "repeats": len(s.runs),
                   "median_ms": _r(s.median("wall"), 1e3), "cpu_ms": _r(s.median("cpu"), 1e3),
                   "min_ms": _r(min(r.wall for r in s.runs), 1e3) if s.runs else None}
            if s.ok and s is not eager and s.ops:
                row["ratio"] = round(s.median("wall") / e_wall, 3)
                row["cpu_ratio"] = round(s.median("cpu") / e_cpu, 3)
                row["us_per_op"] = _r((s.median("wall") - e_wall) / s.ops, 1e6)
                row["cpu_us_per_op"] = _r((s.median("cpu") - e_cpu) / s.ops, 1e6)
            if s is unlimited and s.ok:
                row["us_per_op_beyond_floor"] = _r((s.median("wall") - raw.median("wall")) / s.ops, 1e6)
                row["full_gc_us_per_op"] = _r(full_gc, 1e6)
                row["us_per_op_with_full_gc"] = _r((s.median("wall") - e_wall) / s.ops + full_gc, 1e6)
                row.update(_stats_fields(s))
            out.write(json.dumps(row) + "\n")
        if not all(s.ok for s in series):
            print(f"{name:<15} " + "  ".join(f"{s.mode}: {s.status}" for s in series))
            continue
        ops = unlimited.ops
        dtr_us = (unlimited.median("wall") - e_wall) / ops * 1e6
        total_us = dtr_us + full_gc * 1e6
        print(f"{name:<15} {ops:>6} {e_wall * 1e3:>9.2f} {raw.median('wall') * 1e3:>9.2f} "
              f"{unlimited.median('wall') * 1e3:>9.2f} {e_wall / eager.ops * 1e6:>11.2f} "
              f"{(raw.median('wall') - e_wall) / raw.ops * 1e6:>11.2f} {dtr_us:>10.2f} "
              f"{(unlimited.median('wall') - raw.median('wall')) / ops * 1e6:>12.2f} "
              f"{(unlimited.median('cpu') - e_cpu) / ops * 1e6:>13.2f} {full_gc * 1e6:>8.2f} {total_us:>7.2f}  "
              f"{'met' if total_us <= TARGET_US_PER_OP else 'NOT met'}", flush=True)
    print(f"(torch._dynamo loaded: {'yes' if 'torch._dynamo' in sys.modules else 'no'})")


def profile_small(args) -> None:
    """cProfile of the dtr runs of the small-op loops: where the engine's time goes."""
    fns = small_workloads(args.small_ops)
    for fn in fns.values():  # warm caches
        with dtr.budget(None):
            fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.small_repeats):
        for fn in fns.values():
            with dtr.budget(None):
                fn()
    prof.disable()
    for sort, title in (("tottime", "total (own) time"), ("cumulative", "cumulative time")):
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(sort)
        print(f"\n## cProfile, dtr_unlimited on the small-op loops, all functions, top {args.profile_lines} by {title}")
        st.print_stats(args.profile_lines)
        print(_trim_pstats(buf.getvalue()))
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).sort_stats(sort)
        print(f"## ... only the driver's modules and dtr/core/runtime.py, top {args.profile_lines} by {title}")
        st.print_stats(r"dtr/(eager/(driver|constants|recording|gradients|views)|core/runtime)\.py", args.profile_lines)
        print(_trim_pstats(buf.getvalue(), strip=str(Path(dtr.__file__).parent.parent) + os.sep))


def _trim_pstats(text: str, strip: str = "") -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), 0)
    return "\n".join(line.replace(strip, "") for line in lines[max(0, start - 2):] if line.strip())


# ------------------------------------------------------------------------------ models


def model_steps(name: str) -> Dict[str, Callable]:
    """The step of each mode for one model: ``eager``, ``passthrough``, ``wrapper``, ``dtr_unlimited``
    (each returns the engine's stats or None) and ``under(budget)`` (a step under that
    budget)."""
    zoo_name, overrides = TINY_LOOPS.get(name, (name, {}))
    w = build(zoo_name, "bench", **overrides)
    model = w.model

    def in_mode(mode):
        def step():
            for p in model.parameters():
                p.grad = None
            torch.manual_seed(1)
            with mode():
                loss = w.loss_fn(model, w.batch)
                loss.backward()

        return step

    def under(budget):
        return lambda: run_step(w, model, budget).stats

    return {"eager": lambda: run_step(w, model, "eager").stats, "passthrough": in_mode(RawPassThrough),
            "wrapper": in_mode(WrapperFloor), "dtr_unlimited": under(None), "under": under}


def run_worker(spec: dict, args) -> None:
    """One process's share of a model's measurement (``--worker``): untimed warm-up steps,
    then ``--repeats`` timed steps of one mode; prints one JSON line for ``run_models``."""
    steps = model_steps(spec["model"])
    mode, budget = spec["mode"], spec.get("budget")
    fn = steps["under"](budget) if budget is not None else steps[mode]
    ops = None
    if mode in ("passthrough", "wrapper"):
        with CountOps() as counter:
            steps["passthrough"]()
        ops = counter.ops
    s = Series(mode, fn, budget)
    for _ in range(args.warmup):
        if not s.run(args.time_limit, keep=False):
            break
    for _ in range(args.repeats):
        if not s.run(args.time_limit):
            break
    full_gc = None
    if s.ok and args.gc_steps:
        try:
            with time_limit(args.time_limit * (args.gc_steps + 1)):
                full_gc = full_gc_seconds(fn, args.gc_steps)
        except RunTimeout:
            pass
    runs = [{"wall": r.wall, "cpu": r.cpu, "faults": r.faults,
             "stats": None if r.stats is None else dataclasses.asdict(r.stats)} for r in s.runs]
    print(json.dumps({"status": s.status, "ops": s.ops or ops, "runs": runs, "full_gc": full_gc}))


def _in_process(spec: dict, args, s: Series) -> None:
    """Run ``run_worker`` for ``spec`` in a fresh Python process; add its runs to ``s``."""
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--warmup", str(args.warmup),
           "--repeats", str(args.repeats), "--time-limit", str(args.time_limit), "--threads", str(args.threads),
           "--gc-steps", str(args.gc_steps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        err = done.stderr.strip().splitlines()
        s.status = f"worker failed: {err[-1][:120] if err else done.returncode}"
        return
    got = json.loads(lines[-1])
    for r in got["runs"]:
        stats = SimpleNamespace(**r["stats"]) if r["stats"] is not None else None
        s.runs.append(Outcome(r["wall"], r["cpu"], stats, got["ops"], faults=r["faults"]))
    s.ops = got["ops"] or s.ops
    if got["full_gc"] is not None:
        s.full_gc.append(got["full_gc"])
    if got["status"] != "ok":
        s.status = got["status"]


def run_models(args, base, out) -> None:
    print(f"\n## one training step (forward + backward), zoo 'bench' presets; "
          f"target <= {TARGET_RATIO:.2f}x eager unlimited on {' and '.join(TARGET_MODELS)}")
    print(f"(each mode in its own process, {args.processes} processes per mode taking turns, {args.warmup} "
          f"untimed + {args.repeats} timed steps each; ratio: median wall time / eager's; of floor: / the pass-through mode's; of wrapper: / the wrapper-only mode's; cpu ratio: the same "
          "from process CPU time;\n us/op: extra wall time over eager per intercepted op; faults: minor page "
          "faults per step, median;\n gc ms: full collections per step, amortized over back-to-back steps)")
    print(f"{'model':<12} {'mode':<16} {'budget MiB':>10} {'median ms':>10} {'cpu ms':>9} {'ratio':>6} {'of floor':>8} {'of wrapper':>10} "
          f"{'cpu ratio':>9} {'us/op':>7} {'ops':>6} {'evict':>6} {'remat':>6} {'peak MiB':>9} {'faults':>7} {'gc ms':>6}  status")
    for name in progress(args.models, "models"):
        eager, passthrough, wrapper, unlimited = every = [
            Series(m, None) for m in ("eager", "passthrough", "wrapper", "dtr_unlimited")]
        fixed = [Series(f"dtr_{f:g}x_peak", None) for f in args.fractions]
        f_of = dict(zip(fixed, args.fractions))
        for _ in range(args.processes):
            for s in every + fixed:
                if s in fixed and s.budget is None and s.ok:
                    # A fraction of the unlimited run's peak, known once its first process ran.
                    if unlimited.ok and unlimited.runs:
                        s.budget = int(f_of[s] * statistics.median_low(r.stats.peak_resident_bytes
                                                                       for r in unlimited.runs))
                    else:
                        s.status = f"skipped (dtr_unlimited: {unlimited.status})"
                if s.ok:
                    _in_process({"model": name, "mode": s.mode, "budget": s.budget}, args, s)
        every = every + fixed
        e_wall = eager.median("wall")
        floor, wrapped = passthrough.median("wall"), wrapper.median("wall")
        for s in every:
            wall = s.median("wall")
            status = s.status if s.ok or not s.runs else f"{s.status} (after {len(s.runs)} runs)"
            row = {**base, "load": round(os.getloadavg()[0], 2), "section": "models", "model": name, "mode": s.mode,
                   "budget_bytes": s.budget, "status": status, "repeats": len(s.runs), "processes": args.processes,
                   "median_ms": _r(wall, 1e3), "cpu_ms": _r(s.median("cpu"), 1e3), "ops": s.ops,
                   "minor_faults": s.median("faults"),
                   "full_gc_ms": _r(statistics.median(s.full_gc), 1e3) if s.full_gc else None}
            if s.runs:
                row["min_ms"] = _r(min(r.wall for r in s.runs), 1e3)
            if wall is not None and e_wall:
                row["ratio"] = round(wall / e_wall, 3)
                row["cpu_ratio"] = round(s.median("cpu") / eager.median("cpu"), 3)
                if s.ops:
                    row["us_per_op"] = _r((wall - e_wall) / s.ops, 1e6)
            if wall is not None and floor:
                row["of_floor"] = round(wall / floor, 3)
            if wall is not None and wrapped:
                row["of_wrapper"] = round(wall / wrapped, 3)
            row.update(_stats_fields(s))
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(_model_line(row), flush=True)


def _stats_fields(s: Series) -> dict:
    if not any(r.stats is not None for r in s.runs):
        return {}
    return {"evictions": s.stat("evictions"), "eager_evictions": s.stat("eager_evictions"),
            "remats": s.stat("rematerializations"), "peak_bytes": s.stat("peak_resident_bytes"),
            "remat_ms": _r(statistics.median(r.stats.remat_seconds for r in s.runs), 1e3)}


def _model_line(row: dict) -> str:
    def f(key, fmt, scale=1):
        v = row.get(key)
        return format(v * scale, fmt) if v is not None else "-"

    target = ""
    if row["model"] in TARGET_MODELS and row["mode"] == "dtr_unlimited" and row.get("ratio") is not None:
        target = "  target " + ("met" if row["ratio"] <= TARGET_RATIO else "NOT met")
    if row["model"] in TINY_LOOPS and row["mode"] == "dtr_unlimited" and row.get("of_floor") is not None:
        target = "  target " + ("met" if row["of_floor"] <= TARGET_OF_FLOOR else "NOT met")
    return (f"{row['model']:<12} {row['mode']:<16} {f('budget_bytes', '.1f', 2**-20):>10} "
            f"{f('median_ms', '.1f'):>10} {f('cpu_ms', '.1f'):>9} {f('ratio', '.2f'):>6} {f('of_floor', '.2f'):>8} {f('of_wrapper', '.2f'):>10} {f('cpu_ratio', '.2f'):>9} "
            f"{f('us_per_op', '.1f'):>7} {f('ops', 'd'):>6} {f('evictions', 'd'):>6} {f('remats', 'd'):>6} "
            f"{f('peak_bytes', '.1f', 2**-20):>9} {f('minor_faults', '.0f'):>7} {f('full_gc_ms', '.1f'):>6}  {row['status']}{target}")


def _r(v: Optional[float], scale: float) -> Optional[float]:
    return None if v is None else round(v * scale, 3)


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=["small", "models"], default=["small", "models"])
    parser.add_argument("--models", nargs="+", choices=MODELS + tuple(TINY_LOOPS), default=list(MODELS))
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.5],
                        help="budgets as fractions of the unlimited run's peak resident bytes")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per model, mode and process")
    parser.add_argument("--processes", type=int, default=3,
                        help="processes per model and mode (models section), taking turns")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed runs per workload and mode first (per process in the models section)")
    parser.add_argument("--small-ops", type=int, default=1000, help="forward ops per small-op loop")
    parser.add_argument("--small-repeats", type=int, default=15)
    parser.add_argument("--gc-runs", type=int, default=150,
                        help="back-to-back runs per small-op workload over which full collections are amortized")
    parser.add_argument("--gc-steps", type=int, default=20,
                        help="back-to-back steps per model, mode and process over which full collections are "
                             "amortized (models section; 0: not measured)")
    parser.add_argument("--time-limit", type=float, default=30.0,
                        help="seconds one run may take before it is interrupted and recorded as a timeout (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", action="store_true", help="also print cProfile tables of the small-op loops")
    parser.add_argument("--profile-lines", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run_models' child processes: JSON spec
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.worker:
        run_worker(json.loads(args.worker), args)
        return
    base = {"commit": commit(), "machine": machine(), "torch": torch.__version__, "threads": args.threads,
            # glibc's allocator settings, when pinned: they decide the model rows' page faults
            "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")} or None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"# {base['machine']}  torch {base['torch']}  threads {args.threads}  commit {base['commit']}  "
          f"load {os.getloadavg()[0]:.2f}")
    with args.out.open("a") as out:
        if "small" in args.sections:
            run_small(args, base, out)
        if "models" in args.sections:
            run_models(args, base, out)
    if args.profile:
        profile_small(args)
    print(f"\n# done in {time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.2f}; "
          f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
