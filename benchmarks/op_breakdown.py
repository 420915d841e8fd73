"""Where each microsecond of a dtr op goes: dtr's per-op cost beyond the pass-through floor,
split by component (issue 20, "measure first").

Workloads: the small-op loops of ``bench_runtime.py --sections small`` (1,000 forward ops on
64x64 float32: elementwise chain, matmul + tanh, matmul + tanh forward and backward) and a
``nn.GRUCell(128, 128)`` loop over 100 steps of a batch of 32 (forward, then ``h.sum()``
backward), all inside the mode or block, 1 intra-op thread.

Modes: eager; ``floor``, a mode that only calls each op (``RawPassThrough`` of
bench_runtime.py); ``bare``, a mode that also wraps every tensor output in a bare wrapper
subclass (``_make_wrapper_subclass``, the value in a slot) and unwraps inputs: what any
``__torch_dispatch__`` wrapper design pays, dtr's engine aside; ``dtr``, ``dtr.budget(None)``.

Method, in three parts:

1. Wall time. The four modes take turns run by run (``--repeats`` timed runs after
   ``--warmup``); each run starts from ``gc.collect()``, as in bench_runtime.py. Collections
   during the runs are timed with ``gc.callbacks`` (young generations apart). Full
   collections, which the engine's objects bring on every few runs, are amortized over
   ``--gc-runs`` back-to-back runs, as bench_runtime.py's "full gc" column.
2. Attribution, by timing dtr's own functions in place (monkeypatched here; the library is
   unchanged). Each instrumented run times a few groups of functions that never run inside
   one another, inclusively (``perf_counter_ns``, collections subtracted), so that one
   timer's cost never lands in another's interval: the mode's ``__torch_dispatch__`` alone;
   ``Driver.dispatch`` alone; then the groups dispatch calls (records, constants, acquire,
   complete, make_wrapper, passthrough) with the wrapper callbacks and ``drain``; then the
   groups inside those (``_new_storage``, ``_make_wrapper_subclass``, ``track``); then the
   parameter hooks and the block's enter and exit. A component is a group's inclusive time
   minus the groups measured inside it; the driver's own Python is dispatch's time minus the
   kernels (as the driver timed them, ``Driver.op_seconds``) and every group that ran inside
   it. Each timed call is corrected by the timer's own cost inside its interval, calibrated
   on an empty function (~0.1 us). Facts lookup and the driver's two ``perf_counter`` calls are
   inline statements: their cost is a ``timeit`` of the same statement ("of which" lines).
3. What no Python function of dtr holds: torch's work for a wrapper subclass outside
   Python (autograd and the dispatcher on wrapper tensors, their deallocation) is estimated
   from the bare mode: bare - floor - its Python - its ``_make_wrapper_subclass`` - its extra
   kernel time - its extra young collections (its Python and kernels timed like dtr's). The
   residual is dtr - floor minus every component: the timers' error, and whatever dtr costs
   that neither a timed function nor the bare mode's estimate holds.

    python benchmarks/op_breakdown.py                  # all workloads, ~3 min on the 2-core VM
    python benchmarks/op_breakdown.py --workloads elementwise --repeats 9

It times dtr's Python functions: run it with ``DTR_PUREPYTHON=1``. With the native path on,
what ``dtr_ext/hotpath.c`` runs (``Driver.dispatch`` and the simple ops, ``make_wrapper``, the
wrapper-death callback, ...) never calls them, and its time lands in the residual.

Prints a table of microseconds per op (medians over runs; "spread" is the interquartile
range) and writes it to ``benchmarks/results/op_breakdown.json`` with commit, machine, torch
version and load average. A diagnostic of one machine: compare runs of the same machine only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtr
import dtr.eager.driver as driver_mod
import dtr.eager.tensor as tensor_mod
from dtr.eager.constants import Constants
from dtr.eager.driver import Driver
from dtr.eager.gradients import Gradients
from dtr.eager.mode import DTRMode
from dtr.eager.ops import FACTS
from dtr.eager.replay import Call
from dtr.core import OpRecord, Runtime
from dtr.scope import Engine

from bench_runtime import RawPassThrough, count_ops, full_gc_seconds, small_workloads
from provenance import commit, machine

RESULTS = Path(__file__).parent / "results" / "op_breakdown.json"
_ns = time.perf_counter_ns

# ------------------------------------------------------------------------------ collector clock

_GC = {"ns": 0, "young": 0, "full": 0, "start": 0}
_GC_NS = [0]  # the same total as _GC["ns"], where the timers read it


def _gc_clock(phase, info):
    if phase == "start":
        _GC["start"] = _ns()
    else:
        d = _ns() - _GC["start"]
        _GC["ns"] += d
        _GC_NS[0] += d
        _GC["full" if info["generation"] == 2 else "young"] += d


# ------------------------------------------------------------------------------ inclusive timers

# Where the timed call runs: inside ``Driver.passthrough``, inside ``Driver.dispatch``, or
# outside both (a weakref callback run by the program's own code). Set by marker wrappers.
_CTX = {"dispatch": 0, "passthrough": 0, "block": 0}
_WHERE = ("dispatch", "passthrough", "block", "outside")


def _where() -> str:
    ctx = _CTX
    if ctx["passthrough"]:
        return "passthrough"
    return "dispatch" if ctx["dispatch"] else "block" if ctx["block"] else "outside"


class Group:
    """The inclusive time of a group of functions (outermost call only: a call made inside
    another of the group's calls only counts as ``nested``), collections excluded, split by
    where it ran (``_where``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ns = dict.fromkeys(_WHERE, 0)
        self.calls = dict.fromkeys(_WHERE, 0)
        self.nested = 0
        self.busy = [0]

    def wrap(self, fn: Callable, mark: str = "") -> Callable:
        busy, ns_, calls, gcs, now, where, ctx = self.busy, self.ns, self.calls, _GC_NS, _ns, _where, _CTX
        group = self

        def timed(*a, **k):
            if busy[0]:
                group.nested += 1
                return fn(*a, **k)
            busy[0] = 1
            at = where()
            if mark:
                ctx[mark] += 1
            g0 = gcs[0]
            t0 = now()
            try:
                return fn(*a, **k)
            finally:
                t = now() - t0
                if mark:
                    ctx[mark] -= 1
                busy[0] = 0
                ns_[at] += t - (gcs[0] - g0)
                calls[at] += 1

        return timed

    def total(self, where=None) -> int:
        return sum(self.ns.values()) if where is None else self.ns[where]

    def count(self) -> int:
        return sum(self.calls.values())


def marker(fn: Callable, mark: str) -> Callable:
    ctx = _CTX

    def marked(*a, **k):
        ctx[mark] += 1
        try:
            return fn(*a, **k)
        finally:
            ctx[mark] -= 1

    return marked


def calibrate(rounds: int = 21, k: int = 2000) -> Dict[str, float]:
    """ns a timer adds per call, measured on an empty function: ``self``, inside its own
    interval (subtracted from each timed call); ``nested``, the whole cost of a call that
    only passes through (subtracted from the enclosing call of the same group)."""

    def empty():
        pass

    g = Group("calibration")
    f = g.wrap(empty)
    selfs, nested = [], []
    for _ in range(rounds):
        g.ns["outside"] = g.calls["outside"] = 0
        for _ in range(k):
            f()
        selfs.append(g.ns["outside"] / g.calls["outside"])

        def plain():
            for _ in range(k):
                empty()

        h = Group("outer")
        fh = h.wrap(empty)  # inside h's own calls: only passes through

        def through():
            for _ in range(k):
                fh()

        hp, ht = h.wrap(plain), h.wrap(through)
        hp()
        a = h.ns["outside"]
        ht()
        nested.append((h.ns["outside"] - a - a) / k)
    return {"self": statistics.median(selfs), "nested": statistics.median(nested)}


# ------------------------------------------------------------------------------ modes


class TimedFloor(RawPassThrough):
    """The floor, with its kernel call timed (instrumented runs only)."""

    kernel_ns = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = _ns()
        out = func(*args, **(kwargs or {}))
        TimedFloor.kernel_ns += _ns() - t0
        return out


class Bare(torch.Tensor):
    """A wrapper subclass with nothing in it but the value."""

    __slots__ = ("v",)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # outside the mode
        return func(*_unwrap(args), **{k: _unwrap1(v) for k, v in (kwargs or {}).items()})


def _unwrap1(a):
    if type(a) is Bare:
        return a.v
    if type(a) in (list, tuple):
        return type(a)(b.v if type(b) is Bare else b for b in a)
    return a


def _unwrap(args):
    return [_unwrap1(a) for a in args]


_mws = torch.Tensor._make_wrapper_subclass
_strided = torch.strided


def bare_make(v):
    w = _mws(Bare, v.size(), v.stride(), v.storage_offset(), None, v.dtype, _strided, v.device)
    w.v = v
    return w


class BareMode(TorchDispatchMode):
    """Unwraps inputs, calls the op, wraps new tensor outputs; in-place and out= ops return
    the program's own tensors."""

    kernel_ns = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        vals = _unwrap(args)
        kw = {k: _unwrap1(v) for k, v in kwargs.items()} if kwargs else {}
        t0 = _ns()
        out = func(*vals, **kw)
        BareMode.kernel_ns += _ns() - t0
        if func._schema.is_mutable:
            return args[0] if out is vals[0] else out
        if type(out) is torch.Tensor:
            return _make(out)
        if type(out) in (tuple, list):
            return type(out)(_make(o) if type(o) is torch.Tensor else o for o in out)
        return out


_make = bare_make


# ------------------------------------------------------------------------------ instrumentation

_this = sys.modules[__name__]

# Groups of dtr's functions on the per-op path: name -> (owner, attribute) pairs.
GROUPS = {
    "entry": [(DTRMode, "__torch_dispatch__")],  # with mode._dispatch, and all below
    "dispatch": [(Driver, "dispatch")],  # with _run, _run_view, ..., the kernel
    "passthrough": [(Driver, "passthrough")],  # ops returned plain (views of constants), kernel incl.
    "records": [(OpRecord, "__init__"), (Call, "__init__")],
    "constants": [(Constants, "use")],
    "acquire": [(Runtime, "acquire")],
    "complete": [(Runtime, "complete")],  # with _wire, unlock, _new_storage
    "storage": [(Runtime, "_new_storage")],  # with Storage.__init__, the resident and _all dicts
    "wrapper": [(driver_mod, "make_wrapper")],  # with _make_wrapper_subclass and track
    "mws": [(tensor_mod, "_make_wrapper_subclass")],
    "track": [(Runtime, "track")],
    "callback": [(Runtime, "_on_wrapper_death")],
    "drain": [(Runtime, "drain")],  # wrapper deaths applied: eager eviction, release
    "hooks": [(Gradients, "_on_grad_accumulated")],  # autograd's hook keeping a parameter's .grad plain
    "block": [(Engine, "__enter__"), (Engine, "__exit__")],  # the block: driver made, runtime closed
}
# Runs per instrumented round, each timing groups that never run inside one another (so one
# timer's cost never lands in another's interval); a run marks where dispatch runs.
DTR_RUNS = [["entry"], ["dispatch"],
            ["passthrough", "records", "constants", "acquire", "complete", "wrapper", "callback", "drain"],
            ["storage", "mws", "track"], ["hooks", "block"]]
BARE_GROUPS = {"bare mode": [(BareMode, "__torch_dispatch__")], "bare mws": [(_this, "_mws")],
               "floor mode": [(TimedFloor, "__torch_dispatch__")]}


class Patched:
    """Install the timers of ``groups`` (and the dispatch marker), restore on exit."""

    def __init__(self, groups: Dict[str, Group], table: dict, mark_dispatch: bool) -> None:
        self.groups, self.table, self.mark, self.saved = groups, table, mark_dispatch, []

    def _set(self, owner, name, value) -> None:
        orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self.saved.append((owner, name, orig))
        setattr(owner, name, value)

    def __enter__(self):
        if self.mark and "dispatch" not in self.groups:
            self._set(Driver, "dispatch", marker(Driver.__dict__["dispatch"], "dispatch"))
        if self.mark and "block" not in self.groups:  # the block's enter and exit (close drains)
            for name in ("__enter__", "__exit__"):
                self._set(Engine, name, marker(Engine.__dict__[name], "block"))
        for gname, g in self.groups.items():
            mark = {"dispatch": "dispatch", "passthrough": "passthrough"}.get(gname, "")
            for owner, name in self.table[gname]:
                cur = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
                self._set(owner, name, g.wrap(cur, mark))
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)
        self.saved.clear()


# ------------------------------------------------------------------------------ workloads


def workloads(n: int) -> Dict[str, Callable[[], None]]:
    w = small_workloads(n)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(128, 128)
    xs = torch.randn(100, 32, 128, generator=g)

    def gru_cell():
        for p in cell.parameters():
            p.grad = None
        h = torch.zeros(32, 128)
        for x in xs:
            h = cell(x, h)
        h.sum().backward()

    w["gru_cell"] = gru_cell
    return w


def runner(mode: str, fn: Callable[[], None]) -> Callable[[], None]:
    if mode == "eager":
        return fn
    if mode == "dtr":
        def run():
            with dtr.budget(None):
                fn()
        return run
    cls = {"floor": RawPassThrough, "timed_floor": TimedFloor, "bare": BareMode}[mode]

    def run():
        with cls():
            fn()
    return run


_DRIVERS: List[Driver] = []  # drivers made since the last timed_run began (dtr runs)
_driver_init = Driver.__init__


def _init_recorded(self, *a, **k):
    _driver_init(self, *a, **k)
    _DRIVERS.append(self)


def timed_run(run: Callable[[], None]) -> dict:
    """One run from ``gc.collect()``: wall ns, collections' ns, and (dtr) the kernels' ns as
    the driver timed them (``Driver.op_seconds``)."""
    gc.collect()
    _DRIVERS.clear()
    y0, f0 = _GC["young"], _GC["full"]
    t0 = _ns()
    run()
    wall = _ns() - t0
    kernel = sum(d.op_seconds for d in _DRIVERS) * 1e9
    return {"wall": wall, "young": _GC["young"] - y0, "full": _GC["full"] - f0, "kernel": kernel}


def med(xs):
    return statistics.median(xs)


def iqr(xs):
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def microbench() -> Dict[str, float]:
    """ns per execution of the driver's inline statements that no function holds."""
    func = torch.ops.aten.mul.Tensor
    FACTS.get(func) or dtr.eager.ops.facts_for(func)
    n = 200_000
    facts = min(timeit.repeat("FACTS.get(func)", globals={"FACTS": FACTS, "func": func}, number=n, repeat=7)) / n
    timing = min(timeit.repeat("t0 = pc(); s = pc() - t0; d.op_seconds += s", setup="d = D()",
                               globals={"pc": time.perf_counter, "D": type("D", (), {"op_seconds": 0.0})},
                               number=n, repeat=7)) / n
    return {"facts lookup": facts * 1e9, "timing (2 perf_counter + sum)": timing * 1e9}


def measure(name: str, fn: Callable[[], None], args, cal: Dict[str, float], micro: Dict[str, float]) -> dict:
    ops = count_ops(fn)
    modes = ["eager", "floor", "bare", "dtr"]
    runs = {m: runner(m, fn) for m in modes}
    wall: Dict[str, List[dict]] = {m: [] for m in modes}
    for m in modes:
        for _ in range(args.warmup):
            runs[m]()
    for _ in range(args.repeats):
        for m in modes:
            wall[m].append(timed_run(runs[m]))
    full = {m: full_gc_seconds(runs[m], args.gc_runs) * 1e9 for m in ("eager", "dtr")}

    # -- instrumented runs, taking turns: each times a few groups (inclusive), nothing else
    plan = [("dtr", groups) for groups in DTR_RUNS] + [("floor", ["floor mode"]), ("bare", ["bare mode"]),
                                                        ("bare", ["bare mws"])]
    table = {**GROUPS, **BARE_GROUPS}
    irun = {"dtr": runner("dtr", fn), "floor": runner("timed_floor", fn), "bare": runner("bare", fn)}
    got: Dict[str, List[float]] = {}  # quantity -> ns per op, one value per round

    def put(key, v):
        got.setdefault(key, []).append(v / ops)

    for i in range(args.warmup + args.instrumented):
        for mode, names in plan:
            groups = {n: Group(n) for n in names}
            TimedFloor.kernel_ns = BareMode.kernel_ns = 0
            with Patched(groups, table, mark_dispatch=mode == "dtr"):
                r = timed_run(irun[mode])
            if i < args.warmup:
                continue
            for n, g in groups.items():
                fix = g.count() * cal["self"] + g.nested * cal["nested"]
                for where in _WHERE:
                    share = g.calls[where] / g.count() if g.count() else 0.0
                    put(f"{n}@{where}", g.total(where) - fix * share)
                put(n, g.total() - fix)
                got.setdefault(f"{n} calls", []).append(g.count() / ops)
            if "dispatch" in names:
                put("dtr kernel, timed run", r["kernel"])
            if mode == "floor":
                put("floor kernel", TimedFloor.kernel_ns)
            if "bare mode" in names:
                put("bare kernel", BareMode.kernel_ns)

    def w(m, key="wall"):
        return med([r[key] for r in wall[m]]) / ops

    timing_ns = micro["timing (2 perf_counter + sum)"]
    young = w("dtr", "young") - w("floor", "young")
    bare_minus_floor = w("bare") - w("floor") - (w("bare", "young") - w("floor", "young"))
    # Exclusive parts, from inclusive times: what each group's interval holds beyond the
    # groups inside it. Inside dispatch (or the block's exit): everything timed in the third
    # run, where it ran there.
    # Computed round by round (a round's runs are adjacent in time, so slow drifts of a shared
    # machine cancel in the differences), then the median and IQR over the rounds.
    inner = ("records", "constants", "acquire", "complete", "wrapper", "callback", "drain")

    def parts(k: int) -> List[tuple]:
        def c(key):
            return got[key][k] if key in got else 0.0

        kernel = c("dtr kernel, timed run")  # as the driver timed it, in the dispatch run
        floor_py = c("floor mode") - c("floor kernel") - timing_ns
        bare_py = c("bare mode") - c("bare kernel") - timing_ns - c("bare mws")
        return [
            ("mode entry beyond the floor's", c("entry") - c("dispatch") - floor_py),
            ("driver Python (scan, preamble, record-keeping inline)",
             c("dispatch") - kernel - c("passthrough@dispatch") - sum(c(f"{g}@dispatch") for g in inner)),
            ("  of which facts lookup", micro["facts lookup"]),
            ("  of which timing (2 perf_counter + sum)", timing_ns),
            ("record objects (OpRecord, Call)", c("records")),
            ("constants (_use_constants)", c("constants")),
            ("engine acquire", c("acquire@dispatch")),
            ("engine complete (without storage objects)", c("complete") - c("storage")),
            ("storage objects (_new_storage)", c("storage")),
            ("wrapper: dtr's Python (make_wrapper)", c("wrapper") - c("mws") - c("track")),
            ("wrapper: torch _make_wrapper_subclass", c("mws")),
            ("wrapper: track (weakref Ref)", c("track")),
            ("weakref callbacks (_on_wrapper_death)", c("callback")),
            ("wrapper deaths: drain (eager eviction, release)", c("drain")),
            ("parameter .grad hooks (_on_grad_accumulated)", c("hooks")),
            ("block enter + exit (exit releases the kept lineage)",
             c("block") - sum(c(f"{g}@block") for g in inner)),
            ("plain-result ops (passthrough, kernel incl.)",
             c("passthrough") - sum(c(f"{g}@passthrough") for g in inner)),
            ("kernel: dtr's timed - floor's timed", kernel - c("floor kernel")),
            ("young collections (gen 0-1) beyond the floor's", young),
            ("torch's wrapper-subclass work outside Python (bare mode)",
             bare_minus_floor - (bare_py - floor_py) - c("bare mws") - (c("bare kernel") - c("floor kernel"))),
            # notes, not components
            ("= bare mode Python (kernel, _make_wrapper_subclass out)", bare_py),
            ("= floor mode Python (kernel out)", floor_py),
            ("= dtr kernels, dispatch-timed runs", kernel),
        ]

    per_round = [parts(k) for k in range(args.instrumented)]
    comps = []
    for j, (label, _) in enumerate(per_round[0]):
        vals = [r[j][1] for r in per_round]
        comps.append((label, med(vals), iqr(vals) if len(set(vals)) > 1 else None))
    notes = {label[2:]: v for label, v, _ in comps if label.startswith("= ")}
    comps = [x for x in comps if not x[0].startswith("= ")]
    rows: List[tuple] = []  # (label, ns per op, spread ns, kind)
    for m in modes:
        rows.append((f"{m} wall", w(m), iqr([r["wall"] / ops for r in wall[m]]), "measured"))
    target = w("dtr") - w("floor")
    rows.append(("dtr - floor", target, None, "measured"))
    summed = sum(v for label, v, _ in comps if not label.startswith("  "))
    rows += [(label, v, sp, "component") for label, v, sp in comps]
    rows.append(("sum of components", summed, None, "sum"))
    rows.append(("residual (dtr - floor - sum)", target - summed, None, "residual"))
    fgc = (full["dtr"] - full["eager"]) / ops
    rows.append(("full collections, amortized, beyond eager's", fgc, None, "extra"))
    rows.append(("dtr - floor + full collections", target + fgc, None, "extra"))
    notes.update({
        "bare mode _make_wrapper_subclass": med(got["bare mws"]),
        "bare - floor": w("bare") - w("floor"),
        "dtr kernels, plain runs": w("dtr", "kernel"),
        "weakref callbacks inside dispatch": med(got["callback@dispatch"]),
        "drain inside the block's exit": med(got["drain@block"]),
    })
    calls = {k[:-6]: round(med(v), 3) for k, v in got.items() if k.endswith(" calls")}
    return {"workload": name, "ops": ops, "calls_per_op": calls, "rows": [
        {"label": l, "ns_per_op": round(v, 1), "spread_ns": None if sp is None else round(sp, 1), "kind": k}
        for l, v, sp, k in rows], "notes": {k: round(v, 1) for k, v in notes.items()}}


def markdown(results: List[dict]) -> str:
    """The table for docs/runtime.md: us per op, one column per workload."""
    head = "| us per op | " + " | ".join(f"{r['workload']} ({r['ops']} ops)" for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for j, row in enumerate(results[0]["rows"]):
        cells = []
        for r in results:
            x = r["rows"][j]
            sp = "" if x["spread_ns"] is None else f" ±{x['spread_ns'] / 2e3:.1f}"
            cells.append(f"{x['ns_per_op'] / 1e3:.2f}{sp}")
        label = row["label"].strip()
        label = f"**{label}**" if row["kind"] in ("sum", "residual") or label == "dtr - floor" else label
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["elementwise", "matmul", "matmul_fwd_bwd", "gru_cell"])
    ap.add_argument("--small-ops", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per mode (wall)")
    ap.add_argument("--instrumented", type=int, default=9, help="instrumented runs per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gc-runs", type=int, default=100)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    Driver.__init__ = _init_recorded
    load0 = os.getloadavg()[0]
    gc.callbacks.append(_gc_clock)
    cal = calibrate()
    micro = microbench()
    base = {"commit": commit(), "machine": machine(), "torch": torch.__version__, "threads": 1,
            "native_collector": dtr.core.collector.NATIVE, "calibration_ns": cal,
            "microbench_ns": micro, "load_start": round(load0, 2)}
    print(f"# {base['machine']}  torch {base['torch']}  commit {base['commit']}  load {load0:.2f}")
    print(f"# timer calibration: {cal['self']:.0f} ns per timed call, {cal['nested']:.0f} ns per call passing through")
    fns = workloads(args.small_ops)
    results = []
    for name in args.workloads:
        r = measure(name, fns[name], args, cal, micro)
        results.append(r)
        print(f"\n## {name}: {r['ops']} ops, us per op (median; spread = IQR of the instrumented or timed runs)")
        for row in r["rows"]:
            s = "" if row["spread_ns"] is None else f"  +-{row['spread_ns'] / 2e3:.2f}"
            print(f"  {row['label']:<52} {row['ns_per_op'] / 1e3:>7.2f}{s}")
        for k, v in r["notes"].items():
            print(f"  ({k}: {v / 1e3:.2f} us/op)")
        print(f"  (timed calls per op: {r['calls_per_op']})")
    print("\n" + markdown(results))
    base["load_end"] = round(os.getloadavg()[0], 2)
    print(f"\n# load {base['load_end']:.2f} at the end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**base, "args": {k: str(v) for k, v in vars(args).items()},
                                    "workloads": results}, indent=1) + "\n")
    print(f"# written to {args.out}")


if __name__ == "__main__":
    main()
