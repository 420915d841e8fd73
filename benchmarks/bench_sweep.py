"""The budget sweep (the DTR paper's Figure 2): slowdown against memory budget, per model and heuristic.

Sections:

1. ``--record``: one training step (forward + backward inside the block, unlimited budget,
   measured cost model) of each ``dtr.testing.zoo`` model at its "bench" preset is recorded to
   ``benchmarks/traces/<model>.jsonl.gz`` (small committed files; ``bench_swap.py`` replays
   them too), after an eager warm-up step so that first-call kernel set-up is not recorded as
   cost. The sweep then runs on the new traces.
2. Simulated (always): each trace is replayed by ``dtr.simulate`` for every heuristic
   (``--heuristics``; default: all of ``dtr.heuristic_names()``) at budget fractions of the
   trace's unlimited simulated peak (dtr's own: below eager's where gradients are scattered,
   Note [Scattered gradients], so that a fraction of it is a smaller budget than the same
   fraction of eager's peak): 1.0, 0.9, ... 0.1 with 0.67 and 0.45 (targets' budgets), going
   lower until a budget is infeasible or times out. Slowdown = simulated compute (recorded
   op costs plus the recomputations') / the recorded compute. A thrashing heuristic can
   take minutes near its lowest budget, so each simulation gets ``--sim-time-limit`` seconds
   and is recorded as "timeout" past that. ``--of-eager``: the fractions are of eager's true
   peak instead (one eager step per model, by torch.profiler, gradients made by the step as
   in the traces), the reference of issue 18's targets and of the DTR paper's curves; those
   rows are section "sim_eager", and the plot draws such a model on that axis.
3. ``--real``: real CPU steps of each model (``--real-heuristics``, default dtr_eq) at
   ``--real-fractions`` of the unlimited run's ``peak_resident_bytes`` (the same reference as
   the trace's simulated peak): wall time / eager's (medians of ``--repeats``; eager and dtr
   steps take turns, so that load from other processes hits both alike; ``max_over_median``,
   the slowest run over the median, shows a run that tipped into thrashing, and
   ``max_over_median_less_gc`` the same with each run's full collections taken out, which
   tells a run that thrashed from one that a full collection of the process's heap landed
   in) and the true peak,
   measured independently by torch.profiler's allocation events (``dtr.testing.memory``),
   over eager's. A run past ``--time-limit`` seconds is interrupted (SIGALRM); after a timeout
   or an infeasible budget the model goes no lower. Baseline: PyTorch's
   ``checkpoint_sequential`` with round(sqrt(n)) segments (use_reentrant=False) over the n
   stages of the chain-shaped models (mlp and cnn: their ``body`` split into layers, one per
   Linear/Conv2d; resnet: its residual blocks; transformer: its decoder blocks, with the
   embeddings and head run around them as ``GPT.forward`` does), eagerly: measured peak and
   wall ratio, plotted at x = its true peak / eager's true peak.

``--loops``: the cell loops (``LOOP_MODELS``) with ``dtr.budget(loops=[model.cell])`` (their
states kept as ranked checkpoints, Note [Loop checkpoints] in dtr/core/eviction.py), in every
section: traces ``<model>_loops.jsonl.gz``, rows of model ``<model>_loops``. ``--set KEY=VALUE``
overrides the bench preset (``--set trees=32``: a batch of 32 trees), traces and rows named
``<model>-trees32``: where a step's fixed part (its weights' gradient sums) is a smaller share
of its peak, lower fractions of it leave room for activations.

"Lowest fraction before 2x": going down from 1.0, the last fraction before the first one that
is infeasible, times out or is >= 2x slower. Targets (with dtr_eq, ``TARGETS``):
resnet <= 1.25x at 0.67 of the peak, transformer <= 1.10x at 0.6, treelstm <= 1.5x at 0.67; the
dynamic models (``zoo.DYNAMIC``, issue 18): the TreeLSTMs <= 1.6x at 0.9, 1.8x at 0.67, 2.0x at
0.45 (the DTR paper's TreeLSTM, drawn on their plots with its LSTM), the GRU and LSTM cell
loops <= 1.5x at 0.5 and 2.0x at 0.3, of eager's peak (``--of-eager``).

    python benchmarks/bench_sweep.py                           # simulated, about a minute
    python benchmarks/bench_sweep.py --real                    # + real CPU steps, ~15 minutes on 2 cores
    python benchmarks/bench_sweep.py --real --no-sim           # only the real steps
    python benchmarks/bench_sweep.py --record                  # re-record the traces first
    python benchmarks/bench_sweep.py --models resnet --heuristics dtr_eq lru --real --repeats 1
    python benchmarks/bench_sweep.py --plot-only               # redraw from the JSON rows

Rows go to ``benchmarks/results/sweep.jsonl`` (commit, machine, torch, threads, load, the run's
start time and the heuristics that existed then on each), or to ``--out``; ``results/sweep.png``
(``--out``'s name ending in ``.png``, or ``--plot``) plots each model's latest run of each section when
matplotlib is installed. PyTorch runs with ``--threads`` intra-op
threads (1 by default: on a shared 2-core machine two threads make timings swing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

import dtr
from dtr.sim import load
from dtr.testing import zoo
from dtr.testing.memory import profiled_peak
from dtr.testing.step import fresh_model, timed_step

from bench_runtime import FullCollections, RunTimeout, time_limit
from plotting import pyplot
from progress import progress
from provenance import commit, machine

HERE = Path(__file__).parent
TRACES = HERE / "traces"
RESULTS = HERE / "results"
PRESET = "bench"
LOOP_MODELS = ("gru_cell", "lstm_cell_masked")  # the zoo models whose loop calls ``model.cell`` (--loops)
FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.67, 0.6, 0.5, 0.45, 0.4, 0.3, 0.2, 0.1)
REAL_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.67, 0.6, 0.5, 0.4, 0.3)
SLOW = 2.0
TARGET_HEURISTIC = "dtr_eq"
TARGETS = (
    ("resnet", 0.67, 1.25), ("transformer", 0.6, 1.10), ("treelstm", 0.67, 1.5),
    # The dynamic models' (issue 18): the DTR paper's TreeLSTM curve, and recurrent loops.
    ("treelstm_batch", 0.9, 1.6), ("treelstm_batch", 0.67, 1.8), ("treelstm_batch", 0.45, 2.0),
    ("treelstm_nary", 0.9, 1.6), ("treelstm_nary", 0.67, 1.8), ("treelstm_nary", 0.45, 2.0),
    ("gru_cell", 0.5, 1.5), ("gru_cell", 0.3, 2.0), ("lstm_cell_masked", 0.5, 1.5), ("lstm_cell_masked", 0.3, 2.0),
    # The same loops with their states as checkpoints (--loops).
    ("gru_cell_loops", 0.5, 1.5), ("gru_cell_loops", 0.3, 2.0),
    ("lstm_cell_masked_loops", 0.5, 1.5), ("lstm_cell_masked_loops", 0.3, 2.0),
)
CHAIN_MODELS = ("mlp", "cnn", "resnet", "transformer")
# Row sections that the summary reads, and what their fractions are of.
SECTIONS = {"sim": "simulated, fractions of dtr's unlimited peak",
            "sim_eager": "simulated, fractions of eager's true peak",
            "real": "real, fractions of dtr's unlimited peak"}
# The DTR paper's measured slowdowns on a Titan V (its prototype's data files, via
# shared/design/prior-art.md): budget / the baseline's peak -> slowdown. TreeLSTM (batch 9,
# 8.9 GB): 8, 6, 4, 2 GB; LSTM (batch 256, 11.1 GB): 10 and 4 GB. Drawn on the tree and
# recurrent models' plots for comparison (the paper's fractions are of eager's peak, as ours are
# with --of-eager; without it ours are of dtr's unlimited one).
PAPER = {
    "TreeLSTM": [(8 / 8.9, 1.65), (6 / 8.9, 1.85), (4 / 8.9, 2.09), (2 / 8.9, 3.01)],
    "LSTM": [(10 / 11.1, 1.23), (4 / 11.1, 1.41)],
}
PAPER_MODELS = {
    "treelstm": "TreeLSTM", "treelstm_batch": "TreeLSTM", "treelstm_nary": "TreeLSTM",
    "lstm": "LSTM", "lstmcell": "LSTM", "gru_cell": "LSTM", "lstm_cell_masked": "LSTM", "gru": "LSTM",
    "lstm_packed": "LSTM",
}


# ------------------------------------------------------------------------------ recording


@dataclasses.dataclass(frozen=True)
class Variant:
    """How the models run: with ``dtr.budget(loops=[model.cell])`` (``--loops``), and with
    overrides of the bench preset (``--set``). Names its traces and rows."""

    loops: bool = False
    overrides: Tuple[Tuple[str, Any], ...] = ()

    def name(self, model: str) -> str:
        """``model``'s trace and row name: ``gru_cell_loops``, ``treelstm_batch-trees32``."""
        sets = "".join(f"-{k}{'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in self.overrides)
        return f"{model}{'_loops' if self.loops else ''}{sets}"

    @staticmethod
    def model_of(name: str) -> str:
        """The zoo model a trace or row ``name`` (``name``'s result) is of."""
        return name.split("-")[0].removesuffix("_loops")

    def build(self, model: str) -> zoo.Workload:
        return zoo.build(model, PRESET, **dict(self.overrides))

    def engine(self, limit: Optional[int], model: nn.Module, **options) -> dtr.Engine:
        return dtr.budget(limit, loops=[model.cell] if self.loops else None, **options)


def record(models: List[str], traces: Path, variant: Variant = Variant()) -> None:
    """Record one training step of each model into ``traces/<name>.jsonl.gz``, ``name`` being
    ``variant``'s for the model."""
    traces.mkdir(parents=True, exist_ok=True)
    print(f"## recording one '{PRESET}' training step per model into {traces}")
    for name in models:
        w = variant.build(name)
        model = fresh_model(w)
        timed_step(w, model)  # warm-up: first calls initialize kernels, which is not their cost
        path = traces / f"{variant.name(name)}.jsonl.gz"
        engine = variant.engine(None, model, trace=path)
        timed_step(w, model, engine)
        print(f"{variant.name(name):<16} {engine.stats().ops:>6} ops  {path.stat().st_size / 1024:>7.1f} KiB", flush=True)


# ------------------------------------------------------------------------------ simulated


def sweep_trace(path: Path, heuristics: List[str], fractions=FRACTIONS, limit: float = 30.0,
                eager_peak: Optional[int] = None) -> Iterator[dict]:
    """Rows of the simulated sweep of one trace: per heuristic, ``fractions`` (in order) of the
    trace's unlimited peak until one is infeasible or runs past ``limit`` seconds. With
    ``eager_peak`` (bytes), the fractions are of it instead: section "sim_eager"."""
    trace = load(path)
    peak = dtr.simulate(trace, None).peak_bytes
    reference = peak if eager_peak is None else eager_peak
    extra = {} if eager_peak is None else {"eager_true_peak_fresh_grads_bytes": eager_peak}
    for heuristic in heuristics:
        for f in fractions:
            row = {"section": "sim" if eager_peak is None else "sim_eager", "model": path.name.split(".")[0],
                   "heuristic": heuristic, "fraction": f, "budget_bytes": int(reference * f),
                   "unlimited_peak_bytes": peak, **extra, "trace": path.name}
            row.update(_simulate(trace, row["budget_bytes"], heuristic, limit))
            yield row
            if row["status"] != "ok":
                break


def _simulate(trace, budget: int, heuristic: str, limit: float) -> dict:
    start = time.perf_counter()
    try:
        with time_limit(limit):
            r = dtr.simulate(trace, budget, heuristic=heuristic)
    except RunTimeout as e:
        return {"status": f"timeout after {limit:g} s ({e})", "feasible": None, "sim_s": round(limit, 1)}
    row = {"status": "ok" if r.feasible else "infeasible", "feasible": r.feasible,
           "sim_s": round(time.perf_counter() - start, 3), "evictions": r.evictions,
           "remats": r.rematerializations, "peak_bytes": r.peak_bytes}
    if r.feasible:  # an infeasible run's costs cover only part of the trace: no slowdown
        row.update(slowdown=round(r.slowdown, 4), total_cost=r.total_cost, base_cost=r.base_cost,
                   remat_cost=r.remat_cost)
    return row


def eager_run(name: str, variant: Variant = Variant()):
    """Model ``name`` at the bench preset (with ``variant``'s overrides), a fresh copy of its
    model after an eager warm-up step (which also allocates the gradients ``true_peaks``
    zeroes), and eager's ``true_peaks``."""
    w = variant.build(name)
    model = fresh_model(w)
    timed_step(w, model)
    return w, model, true_peaks(w, model, lambda: None, 0)


def eager_peak(name: str, variant: Variant = Variant()) -> int:
    """The true peak of one eager step of model ``name`` with the gradients created by the step
    (as the traces record it): the reference of the issues' budget fractions."""
    return eager_run(name, variant)[2]["true_peak_fresh_grads_bytes"]


def run_sim(args, base: dict, out) -> List[dict]:
    of = "eager's true peak (torch.profiler)" if args.of_eager else "the unlimited peak"
    print(f"\n## simulated: slowdown (compute / recorded compute) at budget fractions of {of}; "
          f"X infeasible, T timeout (> {args.sim_time_limit:g} s)")
    print(f"{'model':<16} {'heuristic':<10} " + " ".join(f"{f:>5.2f}" for f in FRACTIONS) + f"  {'sim s':>6}")
    rows = []
    for name in progress(args.models, "simulated"):
        path = args.traces / f"{args.variant.name(name)}.jsonl.gz"
        if not path.exists():
            print(f"{name}: no trace at {path}; record it with --record")
            continue
        by_heuristic: Dict[str, List[dict]] = {}
        reference = eager_peak(name, args.variant) if args.of_eager else None
        for row in sweep_trace(path, args.heuristics, FRACTIONS, args.sim_time_limit, reference):
            _emit(row, base, out)
            rows.append(row)
            by_heuristic.setdefault(row["heuristic"], []).append(row)
        for heuristic, rs in by_heuristic.items():
            cells = {r["fraction"]: _cell(r) for r in rs}
            print(f"{name:<16} {heuristic:<10} " + " ".join(f"{cells.get(f, ''):>5}" for f in FRACTIONS)
                  + f"  {sum(r['sim_s'] for r in rs):>6.1f}", flush=True)
    return rows


def _cell(row: dict) -> str:
    if row["status"] == "ok":
        return f"{row['slowdown']:.2f}"
    return "X" if row["status"] == "infeasible" else "T"


# ------------------------------------------------------------------------------ real


class Failed(Exception):
    """A real run that did not finish: its status ("infeasible", "timeout ...", an error), and
    for "infeasible" the refusal's first line (``error``: which error, at which op)."""

    def __init__(self, status: str, error: Optional[str] = None) -> None:
        super().__init__(status)
        self.error = error

    def fields(self) -> dict:
        """The row's ``status`` and, when known, ``error``."""
        return {"status": str(self)} if self.error is None else {"status": str(self), "error": self.error}


def _limited(limit: float, fn: Callable[[], object]):
    """``fn()`` within ``limit`` seconds; raises ``Failed`` with the reason it did not finish."""
    try:
        with time_limit(limit):
            return fn()
    except RunTimeout as e:
        raise Failed(f"timeout after {limit:g} s ({e})" if str(e) else f"timeout after {limit:g} s") from None
    except dtr.OutOfBudgetError as e:
        raise Failed("infeasible", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    except Exception as e:  # record it, don't lose the rest of the sweep
        raise Failed(f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}") from None


def _ratios(w, model, run: Callable[[], float], repeats: int, limit: float) -> dict:
    """Wall times of ``run`` (one ``timed_step``) and of eager steps, taking turns; ``run`` is
    warmed up first. The eager steps run under no limit: they are the baseline. Each run's
    wall time and the full collections inside it are kept (``walls_ms``, ``full_gc_ms``), so
    that a slow run can be told from a thrashing one."""
    _limited(limit, run)
    walls, eager, full_gc = [], [], []
    for _ in range(repeats):
        eager.append(timed_step(w, model))
        with FullCollections() as collections:
            walls.append(_limited(limit, run))
        full_gc.append(round(collections.seconds * 1e3, 1))
    less_gc = [t - g / 1e3 for t, g in zip(walls, full_gc)]
    return {"eager_ms": round(statistics.median(eager) * 1e3, 3), "median_ms": round(statistics.median(walls) * 1e3, 3),
            "ratio": round(statistics.median(walls) / statistics.median(eager), 4), "repeats": repeats,
            # The slowest run over the median: a run that tipped into thrashing shows here.
            "max_over_median": round(max(walls) / statistics.median(walls), 3),
            "max_over_median_less_gc": round(max(less_gc) / statistics.median(less_gc), 3),
            "walls_ms": [round(t * 1e3, 1) for t in walls], "full_gc_ms": full_gc}


def true_peaks(w, model, make_engine: Callable[[], Optional[dtr.Engine]], limit: float) -> dict:
    """The step's true peak (bytes allocated at once, torch.profiler) two ways: with the
    gradients already allocated and zeroed (``zero_grad(set_to_none=False)``, as
    tests/test_memory.py measures: what the step allocates is then activations and kernel
    temporaries, what a budget bounds), and with them created by the step (``set_to_none=True``,
    PyTorch's default, the steps the wall times are of)."""
    out = {}
    for key, fresh in (("true_peak_bytes", False), ("true_peak_fresh_grads_bytes", True)):
        model.zero_grad(set_to_none=fresh)  # before profiling: it does not see frees of older blocks
        torch.manual_seed(1)
        engine = make_engine()

        def step():
            if engine is None:
                w.loss_fn(model, w.batch).backward()
            else:
                with engine:
                    w.loss_fn(model, w.batch).backward()

        out[key] = _limited(limit, lambda: profiled_peak(step))
    return out


def _peak_fractions(row: dict, eager: dict) -> None:
    for key in ("true_peak_bytes", "true_peak_fresh_grads_bytes"):
        row[key.replace("_bytes", "_fraction")] = round(row[key] / eager[key], 4)


def real_point(w, model, heuristic: str, budget: int, repeats: int, limit: float, eager: dict,
               variant: Variant = Variant()) -> dict:
    """One model, heuristic and budget for real: wall ratio, engine counts, true peaks over
    eager's (``eager``: ``true_peaks`` of the eager step); engines as ``variant`` makes them."""
    engines = []

    def make():
        engines.append(variant.engine(budget, model, heuristic=heuristic))
        return engines[-1]

    try:
        row = _ratios(w, model, lambda: timed_step(w, model, make()), repeats, limit)
        st = engines[-1].stats()
        row.update(true_peaks(w, model, make, limit))
    except Failed as e:
        return e.fields()
    row.update(status="ok", evictions=st.evictions, remats=st.rematerializations, engine_peak_bytes=st.peak_resident_bytes)
    _peak_fractions(row, eager)
    return row


def _layers(seq: nn.Sequential) -> nn.Sequential:
    """``seq``'s modules grouped into layers, one from each Linear or Conv2d to the next, so
    that an in-place activation shares a checkpoint segment with the op whose output it
    overwrites (first in a segment, it would overwrite that segment's saved input)."""
    groups: List[List[nn.Module]] = []
    for m in seq:
        if not groups or isinstance(m, (nn.Linear, nn.Conv2d)):
            groups.append([])
        groups[-1].append(m)
    return nn.Sequential(*(nn.Sequential(*g) for g in groups))


def checkpointed(name: str, model: nn.Module):
    """(n stages, segments, loss_fn): ``name``'s training loss with its chain of stages run by
    ``checkpoint_sequential`` in round(sqrt(n)) segments."""
    stages = {"mlp": lambda: _layers(model.body), "cnn": lambda: _layers(model.body),
              "resnet": lambda: model.blocks, "transformer": lambda: nn.Sequential(*model.blocks)}[name]()
    n = len(stages)
    k = max(1, round(math.sqrt(n)))

    def chain(x):
        return checkpoint_sequential(stages, k, x, use_reentrant=False)

    if name == "transformer":

        def lm_loss(m, b):  # GPT.forward with the blocks checkpointed, then zoo's LM loss
            idx = b[:, :-1]
            x = m.drop(m.tok(idx) + m.pos(torch.arange(idx.shape[1], device=idx.device)))
            logits = m.head(m.ln(chain(x)))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

        return n, k, lm_loss
    forward = {"mlp": lambda m, x: m.head(chain(x)),
               "cnn": lambda m, x: m.head(torch.flatten(chain(x), 1)),
               "resnet": lambda m, x: m.head(chain(m.stem(x)).mean((2, 3)))}[name]
    return n, k, lambda m, b: F.cross_entropy(forward(m, b[0]), b[1])


def checkpoint_point(w, model, repeats: int, limit: float, eager: dict) -> dict:
    """The checkpoint_sequential baseline for real: wall ratio and true peaks over eager's."""
    n, k, loss_fn = checkpointed(w.name, model)
    ck = dataclasses.replace(w, loss_fn=loss_fn)
    with torch.no_grad():  # the replicated forward must be the model's own (same RNG draws)
        torch.manual_seed(1)
        want = w.loss_fn(model, w.batch)
        torch.manual_seed(1)
        if not torch.equal(want, ck.loss_fn(model, w.batch)):
            raise AssertionError(f"{w.name}: the checkpointed loss differs from the model's")
    row = {"section": "checkpoint", "model": w.name, "heuristic": "checkpoint_sequential", "stages": n, "segments": k}
    try:
        row.update(_ratios(w, model, lambda: timed_step(ck, model), repeats, limit))
        row.update(true_peaks(ck, model, lambda: None, limit))
    except Failed as e:
        row.update(e.fields())
        return row
    row["status"] = "ok"
    _peak_fractions(row, eager)
    return row


def run_real(args, base: dict, out) -> List[dict]:
    print(f"\n## real CPU steps: wall time / eager's (median of {args.repeats}); true peak (torch.profiler) over "
          f"eager's, with the gradients allocated before the step, and created by it (fresh)")
    print(f"{'model':<16} {'heuristic':<22} {'frac':>5} {'budget MiB':>10} {'eager ms':>9} {'ms':>9} {'ratio':>6} "
          f"{'max/med':>7} {'less gc':>7} {'evict':>6} {'remat':>6} {'true MiB':>9} {'/eager':>6} {'fresh MiB':>9} {'/eager':>6}  status")
    rows = []
    for name in progress(args.models, "real steps"):
        w, model, eager = eager_run(name, args.variant)
        probe = dtr.budget(None)
        timed_step(w, model, probe)
        peak = probe.stats().peak_resident_bytes
        common = {"model": args.variant.name(name), "unlimited_peak_bytes": peak, "eager_true_peak_bytes": eager["true_peak_bytes"],
                  "eager_true_peak_fresh_grads_bytes": eager["true_peak_fresh_grads_bytes"]}
        for heuristic in args.real_heuristics:
            for f in args.real_fractions:
                row = {"section": "real", "heuristic": heuristic, "fraction": f, "budget_bytes": int(peak * f), **common}
                row.update(real_point(w, model, heuristic, row["budget_bytes"], args.repeats, args.time_limit, eager,
                                      args.variant))
                _emit(row, base, out)
                rows.append(row)
                print(_real_line(row), flush=True)
                if row["status"] != "ok":
                    break
        if name in CHAIN_MODELS:
            row = {**checkpoint_point(w, model, args.repeats, args.time_limit, eager), **common}
            _emit(row, base, out)
            rows.append(row)
            print(_real_line(row), flush=True)
    return rows


def _real_line(row: dict) -> str:
    def f(key, fmt, scale=1):
        v = row.get(key)
        return format(v * scale, fmt) if v is not None else "-"

    label = row["heuristic"] + (f" ({row['segments']} of {row['stages']})" if "segments" in row else "")
    return (f"{row['model']:<16} {label:<22} {f('fraction', '.2f'):>5} {f('budget_bytes', '.1f', 2**-20):>10} "
            f"{f('eager_ms', '.1f'):>9} {f('median_ms', '.1f'):>9} {f('ratio', '.2f'):>6} {f('max_over_median', '.2f'):>7} {f('max_over_median_less_gc', '.2f'):>7} "
            f"{f('evictions', 'd'):>6} "
            f"{f('remats', 'd'):>6} {f('true_peak_bytes', '.1f', 2**-20):>9} {f('true_peak_fraction', '.2f'):>6} "
            f"{f('true_peak_fresh_grads_bytes', '.1f', 2**-20):>9} {f('true_peak_fresh_grads_fraction', '.2f'):>6}  "
            f"{row['status']}")


# ------------------------------------------------------------------------------ summary


def _emit(row: dict, base: dict, out) -> None:
    row.update(base, load=round(os.getloadavg()[0], 2))
    out.write(json.dumps(row) + "\n")
    out.flush()


def _slowdown(row: dict) -> Optional[float]:
    """The row's slowdown: simulated compute ratio or real wall ratio; None if it did not run."""
    if row["status"] != "ok":
        return None
    return row["slowdown"] if row["section"].startswith("sim") else row["ratio"]


def lowest_before(rows: List[dict], limit: float = SLOW) -> Optional[float]:
    """Going down the fractions of one sweep, the last one before the first that failed or was
    ``limit`` times slower (None: not even the first)."""
    lowest = None
    for row in sorted(rows, key=lambda r: -r["fraction"]):
        s = _slowdown(row)
        if s is None or s >= limit:
            break
        lowest = row["fraction"]
    return lowest


def summarize(rows: List[dict]) -> None:
    for section in SECTIONS:
        sweeps: Dict[tuple, List[dict]] = {}
        for r in rows:
            if r["section"] == section:
                sweeps.setdefault((r["model"], r["heuristic"]), []).append(r)
        if not sweeps:
            continue
        print(f"\n## lowest budget fraction before {SLOW:g}x slowdown ({SECTIONS[section]})")
        heuristics = list(dict.fromkeys(h for _, h in sweeps))
        print(f"{'model':<16} " + " ".join(f"{h:>10}" for h in heuristics))
        for model in dict.fromkeys(m for m, _ in sweeps):
            cells = [lowest_before(sweeps[model, h]) if (model, h) in sweeps else "" for h in heuristics]
            print(f"{model:<16} " + " ".join(f"{'none' if c is None else c:>10}" for c in cells))
    print(f"\n## targets ({TARGET_HEURISTIC}; sections as above)")
    for model, fraction, target in TARGETS:
        for section in SECTIONS:
            match = [r for r in rows if r["section"] == section and r["model"] == model
                     and r["heuristic"] == TARGET_HEURISTIC and r["fraction"] == fraction]
            swept = [r for r in rows if r["section"] == section and r["model"] == model
                     and r["heuristic"] == TARGET_HEURISTIC]
            if match:
                verdict = _verdict(match[-1], target)
            else:
                last = min(swept, key=lambda r: r["fraction"], default=None)
                if last is None or last["status"] == "ok" or last["fraction"] < fraction:
                    continue  # not swept at the target's fraction
                verdict = f"NOT met (not reached: {last['status']} at {last['fraction']:.2f})"
            print(f"{model:<16} {section:<9} <= {target:.2f}x at {fraction:.2f}: {verdict}")


def _verdict(row: dict, target: float) -> str:
    s = _slowdown(row)
    if s is None:
        return f"NOT met ({row['status']})"
    extra = ""
    if row.get("true_peak_fraction"):
        extra = (f", true peak {row['true_peak_fraction']:.2f} of eager's "
                 f"({row['true_peak_fresh_grads_fraction']:.2f} with fresh gradients)")
    return f"{s:.3f}x{extra}  {'met' if s <= target else 'NOT met'}"


# ------------------------------------------------------------------------------ plot


def plot(rows: List[dict], path: Path) -> bool:
    """One subplot per model: simulated slowdown per heuristic (solid), real wall ratios
    (dashed), checkpoint_sequential (star at its measured peak fraction). False: no matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = min(4, len(models))
    nrows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    colors: Dict[str, str] = {}
    for ax, name in zip(axes.flat, models):
        # A model swept at fractions of eager's peak is drawn on that axis, the paper's: its real
        # points at their budgets over eager's peak.
        eager = next((r["eager_true_peak_fresh_grads_bytes"] for r in rows
                      if r["section"] == "sim_eager" and r["model"] == name), None)
        sim = "sim" if eager is None else "sim_eager"

        def x(r):
            return r["fraction"] if eager is None or r["section"] == sim else r["budget_bytes"] / eager

        for section, style in ((sim, "o-"), ("real", "x--")):
            for heuristic in dict.fromkeys(r["heuristic"] for r in rows if r["section"] == section):
                pts = sorted((x(r), _slowdown(r)) for r in rows if r["section"] == section
                             and r["model"] == name and r["heuristic"] == heuristic and _slowdown(r) is not None)
                if pts:
                    color = colors.setdefault(heuristic, f"C{len(colors)}")
                    label = heuristic + (" (real wall)" if section == "real" else "")
                    ax.plot(*zip(*pts), style, color=color, label=label, markersize=4,
                            linewidth=2 if section == "real" else 1.2)
        paper = PAPER_MODELS.get(Variant.model_of(name))
        if paper is not None:
            ax.plot(*zip(*PAPER[paper]), "ks", markersize=5, fillstyle="none",
                    label=f"DTR paper's {paper} (GPU, wall)")
        for r in rows:
            if r["section"] == "checkpoint" and r["model"] == name and r["status"] == "ok":
                ax.plot(r["true_peak_fraction"], r["ratio"], "r*", markersize=13,
                        label=f"checkpoint_sequential ({r['segments']} seg., real)")
        ax.axhline(SLOW, color="grey", linestyle=":", linewidth=1)
        # As in the paper's figure, up to 3x (past 2x a budget is hardly worth it), but high
        # enough for the real runs, whose wall ratios include the engine's per-op overhead.
        real = [_slowdown(r) for r in rows if r["model"] == name and not r["section"].startswith("sim") and _slowdown(r)]
        ax.set_ylim(0.9, min(12.0, max([3.0] + [1.05 * s for s in real])))
        ax.set_xlim(0.05, 1.05)
        ax.set_title(name)
        ax.set_xlabel("budget / unlimited peak" if eager is None else "budget / eager's peak")
        ax.set_ylabel("slowdown")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    fig.suptitle("slowdown vs budget: simulated compute ratio per heuristic (solid), real CPU wall ratio (dashed)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def latest_rows(path: Path) -> List[dict]:
    """The rows of each model's latest run of each section in ``path`` (sections, and models,
    may be run separately)."""
    rows = [json.loads(line) for line in path.open()]
    last = {(r["section"], r["model"]): r["run"] for r in rows}
    return [r for r in rows if r["run"] == last[r["section"], r["model"]]]


# ------------------------------------------------------------------------------ main


def _overrides(ap, pairs: List[str], models: List[str]) -> Dict[str, Any]:
    """``--set``'s KEY=VALUE pairs, each a key of every model's bench preset."""
    out: Dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = tuple(int(v) for v in value.split(",")) if "," in value else int(value)
        except ValueError:
            ap.error(f"--set {pair}: expected KEY=INT or KEY=INT,INT")
        for m in models:
            if key not in zoo.PRESETS[m][PRESET]:
                ap.error(f"--set {pair}: {m}'s preset has no {key!r} (it has {', '.join(zoo.PRESETS[m][PRESET])})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=zoo.MODELS + zoo.DYNAMIC, default=list(zoo.MODELS),
                    help="default: zoo.MODELS; the dynamic models (zoo.DYNAMIC) by name")
    ap.add_argument("--heuristics", nargs="+", default=None, help="simulated; default: all of dtr.heuristic_names()")
    ap.add_argument("--record", action="store_true", help="record the traces first")
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--sim-time-limit", type=float, default=30.0, help="seconds per simulation")
    ap.add_argument("--of-eager", action="store_true",
                    help="simulated budgets are fractions of eager's true peak, as issue 18's targets are "
                         "(measured by torch.profiler on one eager step per model; section sim_eager)")
    ap.add_argument("--loops", action="store_true",
                    help="the cell loops (gru_cell, lstm_cell_masked) run with dtr.budget(loops=[model.cell]), "
                         "recorded, simulated and run for real: traces and rows named <model>_loops")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="override the bench preset of every model given (an int, or ints joined by commas for "
                         "a range: trees=32, lengths=20,80): traces and rows named <model>-<key><value>")
    ap.add_argument("--real", action="store_true", help="also run real CPU steps and the checkpoint_sequential baseline")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulated section (the plot keeps its latest run)")
    ap.add_argument("--real-heuristics", nargs="+", default=[TARGET_HEURISTIC])
    ap.add_argument("--real-fractions", nargs="+", type=float, default=list(REAL_FRACTIONS))
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per real point (median)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per real step")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=RESULTS / "sweep.jsonl")
    ap.add_argument("--plot", type=Path, help="the figure's file (default: --out's, ending in .png)")
    ap.add_argument("--plot-only", action="store_true", help="redraw from --out's rows, run nothing")
    args = ap.parse_args()
    args.plot = args.plot or args.out.with_suffix(".png")  # a run into another file leaves the shipped figure be
    if args.plot_only:
        rows = latest_rows(args.out)
        summarize(rows)
        print("plot:", args.plot if plot(rows, args.plot) else "skipped (matplotlib is not installed)")
        return
    available = dtr.heuristic_names()
    args.heuristics = args.heuristics or available
    torch.set_num_threads(args.threads)
    base = {"commit": commit(), "machine": machine(), "torch": torch.__version__, "threads": args.threads,
            "preset": PRESET, "heuristics_available": available, "run": time.strftime("%Y-%m-%dT%H:%M:%S")}
    start = time.perf_counter()
    print(f"# {base['machine']}  torch {base['torch']}  threads {args.threads}  commit {base['commit']}  "
          f"heuristics {', '.join(available)}  load {os.getloadavg()[0]:.2f}")
    if args.loops and set(args.models) - set(LOOP_MODELS):
        ap.error(f"--loops: only for {', '.join(LOOP_MODELS)}")
    args.variant = Variant(args.loops, tuple(sorted(_overrides(ap, args.set, args.models).items())))
    if args.record:
        record(args.models, args.traces, args.variant)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        rows = [] if args.no_sim else run_sim(args, base, out)
        if args.real:
            rows += run_real(args, base, out)
    rows = latest_rows(args.out)  # with the other sections' and models' latest runs, for the summary and plot
    summarize(rows)
    print("\nplot:", args.plot if plot(rows, args.plot) else "skipped (matplotlib is not installed)")
    print(f"# done in {time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.2f}; rows appended to {args.out}")


if __name__ == "__main__":
    main()
