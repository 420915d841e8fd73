"""dtr on a GPU: overhead, slowdown against budget, true memory, checkpointing, largest batch.

Models (``--size gpu``, the default): GPT-2 small (124M, Hugging Face's default ``GPT2Config``,
sequence 1024, batch 8), ResNet-50 (torchvision's, 224x224 images, batch 64; the zoo's residual
net scaled up where torchvision is missing) and the batched child-sum TreeLSTM
(``zoo.build("treelstm_batch", "bench")``: 16 trees of 50-150 nodes, hidden 512). ``--size tiny``
runs the same code on toy shapes (``--device cpu`` checks the script without a GPU).

Sections (``--sections``):
- ``overhead``: one engine with ``dtr.budget(None)`` against eager, steps timed with a
  synchronization at the end of each: wall ratio, and the CPU time per op the engine adds
  (time until ``backward()`` returns, before the synchronization, minus eager's, per op).
- ``budgets``: ``dtr.budget(budget_at(stats, f))`` (the step's gradients plus ``f`` of the rest
  of the unlimited peak) for each fraction, down to the first that cannot run; per point the
  median step and its host time (as in ``overhead``), evictions, replays, and the true peak (``torch.cuda.max_memory_allocated`` of
  the step, less what was allocated before it) next to the budget, with the caching
  allocator's ``memory_reserved`` peak beside it.
- ``turns``: eager, ``dtr.budget(None)`` and each of ``--fractions`` taking turns in one
  process, ``--rounds`` rounds of ``--repeats`` steps each, one engine per setting: the host
  time of a step under a budget against no budget, free of the drift between processes and
  over time that separate sections see (one row per setting, a median per round).
- ``checkpoint``: Hugging Face's ``gradient_checkpointing_enable()`` (GPT-2) and
  ``checkpoint_sequential`` (ResNet-50, sqrt(n) segments), their time and true peak; then dtr
  with its budget at that measured peak.
- ``batch``: the largest batch whose step fits a memory cap
  (``torch.cuda.set_per_process_memory_fraction``) for eager, checkpointing and dtr (whose
  budget is the cap less ``--dtr-margin``, ``total=True``), and samples/s at each. Run it with
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, one model per process: with the default
  segments, fragmentation under the cap refuses dtr's evicting steps long before its budget
  does (rows record ``alloc_conf``).
- ``cost``: the CUDA cost mode. Synchronizations a step makes, counted with
  ``torch.cuda.set_sync_debug_mode("warn")``, eager against dtr (unlimited and evicting); and
  the roofline estimate of each op against its CUDA-event time in an eager step.

    DTR_COMMIT=<hash> python3 benchmarks/bench_gpu.py --out $OUT/gpu.jsonl   # on the GPU machine
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --size tiny --out /tmp/gpu.jsonl
    .venv/bin/python benchmarks/bench_gpu.py --plot-only --out benchmarks/results/gpu.jsonl

Rows (JSON lines, with commit, device name and torch version) go to ``--out`` (``DTR_COMMIT``
names the commit where the machine's copy of the tree kept another HEAD); ``--plot``
draws slowdown against budget with the DTR paper's curves (Titan V) on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dtr
from dtr.eager.cost import estimate_seconds
from dtr.testing import zoo
from dtr.testing.memory import measured_peak
from dtr.testing.step import budget_at, training_step

sys.path.insert(0, str(Path(__file__).parent))
from plotting import pyplot  # noqa: E402
from provenance import commit  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MiB = 2**20
# The DTR paper's Figure 2 (Titan V): budget / eager's peak -> slowdown.
PAPER = {
    "resnet50": [(0.9, 1.28), (0.67, 1.35), (0.45, 1.42)],
    "gpt2": [(0.81, 1.12), (0.61, 1.15), (0.41, 1.19)],
    "treelstm": [(0.9, 1.65), (0.67, 1.85), (0.45, 2.09)],
}


class Case:
    """A model, its batch and its loss; ``checkpointed()`` is the same step with the usual
    static checkpointing switched on (None where the model has no sequential structure)."""

    def __init__(self, name, model, batch, loss_fn, checkpointed=None, arch=""):
        self.name, self.model, self.batch, self.loss_fn = name, model, batch, loss_fn
        self.checkpointed, self.arch = checkpointed, arch

    def step(self, engine=None, checkpoint=False):
        fn = self.checkpointed if checkpoint else self.loss_fn
        training_step(zoo.Workload(self.name, self.model, self.batch, fn), self.model, engine)


def gpt2(size, device, batch=None):
    import transformers

    if size == "tiny":
        config, seq, b = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=500), 64, 2
    else:
        config, seq, b = transformers.GPT2Config(), 1024, 8  # GPT-2 small: 124M parameters
    b = batch or b
    torch.manual_seed(0)
    with torch.device(device):  # initialized in place: the batch search builds many
        model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (b, seq), device=device)

    def loss(m, x):
        return m(input_ids=x, labels=x).loss

    def checkpointed(m, x):
        # Renamed activation_checkpointing_* in later transformers releases (the old names warn).
        if hasattr(m, "activation_checkpointing_enable"):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(use_reentrant=False))
            disable = m.activation_checkpointing_disable
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
            disable = m.gradient_checkpointing_disable
        try:
            return loss(m, x)
        finally:
            disable()

    return Case("gpt2", model, ids, loss, checkpointed, f"GPT-2 {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, seq {seq}, batch {b}")


def resnet50(size, device, batch=None):
    try:
        import torchvision

        with torch.device(device):
            body = torchvision.models.resnet50(num_classes=1000) if size != "tiny" else torchvision.models.resnet18(num_classes=10)
        layers = [body.conv1, body.bn1, body.relu, body.maxpool, *body.layer1, *body.layer2, *body.layer3,
                  *body.layer4, body.avgpool, nn.Flatten(1), body.fc]
        arch = "torchvision " + ("resnet50" if size != "tiny" else "resnet18")
    except ImportError:  # the zoo's residual net, scaled up, where torchvision is missing
        w = zoo.build("resnet", "bench" if size != "tiny" else "tiny")
        layers = [*w.model.stem, *w.model.blocks, _SpatialMean(), w.model.head]
        arch = "zoo ResNet"
    model = nn.Sequential(*layers).to(device).train()
    b, image, classes = (batch or 64, 224, 1000) if size != "tiny" else (batch or 4, 32, 10)
    torch.manual_seed(0)
    x = torch.randn(b, 3, image, image, device=device)
    y = torch.randint(0, classes if "torchvision" in arch else 10, (b,), device=device)
    segments = max(1, round(math.sqrt(len(layers))))

    def loss(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1])

    def checkpointed(m, batch):
        out = torch.utils.checkpoint.checkpoint_sequential(m, segments, batch[0], use_reentrant=False)
        return F.cross_entropy(out, batch[1])

    return Case("resnet50", model, (x, y), loss, checkpointed, f"{arch}, {image}x{image}, batch {b}")


class _SpatialMean(nn.Module):
    def forward(self, x):
        return x.mean((2, 3))


def treelstm(size, device, batch=None):
    w = zoo.build("treelstm_batch", "bench" if size != "tiny" else "tiny", **({"trees": batch} if batch else {}))
    w = zoo.on_device(w, device)
    return Case("treelstm", w.model, w.batch, w.loss_fn, None, f"child-sum TreeLSTM, {len(w.batch[0])} trees")


BUILDERS = {"gpt2": gpt2, "resnet50": resnet50, "treelstm": treelstm}


# ------------------------------------------------------------------------------ measuring


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(case, device, engine=None, checkpoint=False):
    """(wall seconds with a synchronization at the end, host seconds until backward returned:
    the time the host spent issuing the step, which a step waiting on a full launch queue
    lengthens for eager and dtr alike)."""
    sync(device)
    t0 = time.perf_counter()
    case.step(engine, checkpoint)
    cpu = time.perf_counter() - t0
    sync(device)
    return time.perf_counter() - t0, cpu


def peak_of(case, device, engine=None, checkpoint=False):
    """(true peak, reserved peak) of a step: the most bytes allocated above what was allocated
    before it, the previous step's gradients already dropped (the step makes its own), and the
    caching allocator's highest reservation during it (absolute: blocks cached by earlier steps
    count). Off CUDA the step runs (callers count it) and both are None."""
    if device.type != "cuda":
        case.step(engine, checkpoint)
        return None, None
    case.model.zero_grad()
    peak = measured_peak(lambda: case.step(engine, checkpoint), device)
    return peak, torch.cuda.max_memory_reserved(device)


def repeat(case, device, n, engine=None, checkpoint=False):
    times = [timed(case, device, engine, checkpoint) for _ in range(n)]
    return statistics.median(t for t, _ in times), statistics.median(c for _, c in times)


def section_overhead(case, device, args):
    repeat(case, device, 2)  # warm-up: cuDNN/cuBLAS choices, allocator
    eager, eager_cpu = repeat(case, device, args.repeats)
    engine = dtr.budget(None)
    repeat(case, device, 1, engine)
    t, cpu = repeat(case, device, args.repeats, engine)
    ops = engine.stats().ops // (1 + args.repeats)  # the engine sums its blocks
    eager_peak, eager_reserved = peak_of(case, device)
    yield dict(section="overhead", eager_s=eager, eager_host_s=eager_cpu, dtr_s=t, dtr_host_s=cpu, ratio=t / eager,
               ops=ops, host_us_per_op=(cpu - eager_cpu) / ops * 1e6, eager_true_peak=eager_peak,
               eager_reserved_peak=eager_reserved)


def unlimited_stats(case):
    probe = dtr.budget(None)
    case.step(probe)
    return probe.stats()


def section_budgets(case, device, args):
    stats = unlimited_stats(case)
    repeat(case, device, 1)
    eager, eager_host = repeat(case, device, args.repeats)
    eager_peak, _ = peak_of(case, device)
    for fraction in args.fractions:
        budget = budget_at(stats, fraction)
        row = dict(section="budgets", fraction=fraction, budget=budget, unlimited_peak=stats.peak_resident_bytes,
                   gradient_bytes=stats.gradient_bytes, eager_s=eager, eager_host_s=eager_host, eager_true_peak=eager_peak,
                   of_eager_peak=budget / eager_peak if eager_peak else None)
        engine = dtr.budget(budget)
        try:
            case.step(engine)  # the engine learns its ops' output sizes (Note [Room before an op])
            before = engine.stats()
            row["true_peak"], row["reserved_peak"] = peak_of(case, device, engine)
            t, host = repeat(case, device, args.repeats, engine)
            after = engine.stats()
            steps = args.repeats + 1  # the measured step and the timed ones
            row.update(status="ok", dtr_s=t, dtr_host_s=host, ratio=t / eager, engine_peak=after.peak_resident_bytes,
                       evictions=(after.evictions - before.evictions) / steps,
                       replays=(after.rematerializations - before.rematerializations) / steps)
        except dtr.OutOfBudgetError as e:
            row.update(status=type(e).__name__, error=str(e)[:300])
        yield row
        if row["status"] != "ok":
            break


def section_turns(case, device, args):
    stats = unlimited_stats(case)
    settings = {"eager": None, "unlimited": dtr.budget(None)}
    settings.update((f"{f:g}", dtr.budget(budget_at(stats, f))) for f in args.fractions)
    for name, engine in list(settings.items()):
        try:
            repeat(case, device, 2, engine)  # warm-up; each engine learns its ops' sizes
        except dtr.OutOfBudgetError as e:
            del settings[name]
            yield dict(section="turns", setting=name, budget=engine.budget, status=type(e).__name__, error=str(e)[:300])
    rounds = {name: [] for name in settings}
    counts = {}
    for _ in range(args.rounds):
        for name, engine in settings.items():
            before = engine.stats() if engine is not None else None
            rounds[name].append(repeat(case, device, args.repeats, engine))
            if engine is not None:
                after = engine.stats()
                counts[name] = ((after.evictions - before.evictions) / args.repeats,
                                (after.rematerializations - before.rematerializations) / args.repeats)
    for name, times in rounds.items():
        evictions, replays = counts.get(name, (0, 0))
        yield dict(section="turns", setting=name, status="ok",
                   budget=None if settings[name] is None else settings[name].budget, step_s=[t for t, _ in times], host_s=[h for _, h in times], evictions=evictions, replays=replays,
                   repeats=args.repeats)


def section_checkpoint(case, device, args):
    if case.checkpointed is None:
        return
    repeat(case, device, 1)
    eager, _ = repeat(case, device, args.repeats)
    repeat(case, device, 1, checkpoint=True)
    ckpt, _ = repeat(case, device, args.repeats, checkpoint=True)
    ckpt_peak, ckpt_reserved = peak_of(case, device, checkpoint=True)
    eager_peak, _ = peak_of(case, device)
    row = dict(section="checkpoint", eager_s=eager, checkpoint_s=ckpt, checkpoint_ratio=ckpt / eager,
               checkpoint_true_peak=ckpt_peak, checkpoint_reserved_peak=ckpt_reserved, eager_true_peak=eager_peak)
    if ckpt_peak:
        engine = dtr.budget(ckpt_peak)
        try:
            case.step(engine)
            row["dtr_true_peak"], _ = peak_of(case, device, engine)
            t, _ = repeat(case, device, args.repeats, engine)
            row.update(status="ok", dtr_s=t, dtr_ratio=t / eager)
        except dtr.OutOfBudgetError as e:
            row.update(status=type(e).__name__, error=str(e)[:300])
    yield row


def _fits(build, device, method, cap, margin):
    """(seconds per step, or None when a step of ``build()`` does not fit under ``cap`` bytes of
    device memory; what refused it: the allocator's cap or dtr's budget, with their words)."""
    case = None
    try:
        case = build()
        engine = dtr.budget(int(cap * (1 - margin)), total=True) if method == "dtr" else None
        for _ in range(2):  # the second step is the steady state (gradients exist, sizes learned)
            t, _ = timed(case, device, engine, checkpoint=method == "checkpoint")
        return t, None
    except (torch.cuda.OutOfMemoryError, dtr.OutOfBudgetError) as e:
        # dtr within its budget refused by the allocator's cap points at fragmentation or
        # memory dtr does not count; its own refusal names the op.
        return None, f"{type(e).__name__}: {str(e)[:240]}"
    finally:
        # A refused dtr try on CUDA left its tensors in reference cycles that only a full
        # collection frees (GPT-2 at batch 16: 4.9 GiB), which the next try would find
        # allocated (README, limitations).
        del case
        gc.collect()
        torch.cuda.empty_cache()


def section_batch(name, device, args):
    if device.type != "cuda":
        return
    cap = int(args.cap_gib * 2**30)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        for method in ("eager", "checkpoint", "dtr"):
            if method == "checkpoint" and name == "treelstm":  # no sequential structure to checkpoint
                continue
            deadline = time.perf_counter() + args.batch_seconds
            best, best_t, lo, hi, b, refused = 0, None, 0, None, args.batch_start[name], None
            while time.perf_counter() < deadline:
                t, why = _fits(lambda: BUILDERS[name](args.size, device, b), device, method, cap, args.dtr_margin)
                if t is not None:
                    best, best_t, lo = b, t, b
                else:
                    hi, refused = b, why
                if hi is None:
                    b *= 2
                elif hi - lo <= max(1, lo // 16):
                    break
                else:
                    b = (lo + hi) // 2
            converged = hi is not None and hi - lo <= max(1, lo // 16)
            yield dict(section="batch", method=method, cap=cap, largest_batch=best, searched_up_to=hi,
                       converged=converged, samples_per_s=best / best_t if best_t else None,
                       dtr_margin=args.dtr_margin, refused_by=refused)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


class _OpTimer(TorchDispatchMode):
    """Eager ops with a CUDA event pair around each and the roofline estimate beside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = func(*args, **kwargs)
        end.record()
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
        self.ops.append((str(func.overloadpacket.__name__), start, end, estimate_seconds(func, args, kwargs, outs)))
        return out


def _syncs(fn):
    """Synchronizations ``fn()`` makes, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def section_cost(case, device, args):
    if device.type != "cuda":
        return
    case.step()
    stats = unlimited_stats(case)
    evicting = dtr.budget(budget_at(stats, 0.5))
    case.step(evicting)
    unlimited = dtr.budget(None)
    case.step(unlimited)  # both engines counted in their second block, as a loop runs them
    counts = dict(eager=_syncs(lambda: case.step()), dtr_unlimited=_syncs(lambda: case.step(unlimited)),
                  dtr_half=_syncs(lambda: case.step(evicting)))
    timer = _OpTimer()
    torch.manual_seed(1)
    case.model.zero_grad()
    with timer:
        case.loss_fn(case.model, case.batch).backward()
    torch.cuda.synchronize(device)
    measured = [(name, s.elapsed_time(e) / 1e3, est) for name, s, e, est in timer.ops]
    ratios = sorted(est / m for _, m, est in measured if m > 0)
    by_op = {}
    for name, m, est in measured:
        total = by_op.setdefault(name, [0, 0.0, 0.0])
        total[0] += 1
        total[1] += m
        total[2] += est
    heavy = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:8]
    yield dict(section="cost", syncs=counts, ops=len(measured), measured_s=sum(m for _, m, _ in measured),
               estimated_s=sum(est for _, _, est in measured), median_ratio=ratios[len(ratios) // 2],
               p10_ratio=ratios[len(ratios) // 10], p90_ratio=ratios[9 * len(ratios) // 10],
               spearman=_spearman([m for _, m, _ in measured], [est for _, _, est in measured]),
               heaviest={k: dict(n=v[0], measured_ms=v[1] * 1e3, estimated_ms=v[2] * 1e3) for k, v in heavy})


def _spearman(a, b):
    def ranks(x):  # ties share their average rank
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


SECTIONS = {"overhead": section_overhead, "budgets": section_budgets, "turns": section_turns,
            "checkpoint": section_checkpoint, "cost": section_cost}


# ------------------------------------------------------------------------------ report


def describe(row):
    s = row["section"]
    if s == "overhead":
        return (f"eager {row['eager_s'] * 1e3:8.1f} ms  dtr {row['dtr_s'] * 1e3:8.1f} ms  {row['ratio']:.3f}x  "
                f"{row['ops']} ops, +{row['host_us_per_op']:.1f} us host time/op")
    if s == "budgets":
        if row["status"] != "ok":
            return f"fraction {row['fraction']:.2f}: {row['status']}: {row['error'][:120]}"
        mem = ""
        if row.get("true_peak") is not None:
            mem = (f"true peak {row['true_peak'] / MiB:8.1f} MiB (budget {row['budget'] / MiB:8.1f}, "
                   f"over {(row['true_peak'] - row['budget']) / MiB:+6.1f}), reserved {row['reserved_peak'] / MiB:8.1f}")
        return (f"fraction {row['fraction']:.2f}: {row['ratio']:.3f}x (host {row['dtr_host_s'] * 1e3:.1f} ms, "
                f"eager's {row['eager_host_s'] * 1e3:.1f})  evictions {row['evictions']}/step, "
                f"replays {row['replays']}/step  {mem}")
    if s == "turns":
        if row["status"] != "ok":
            return f"{row['setting']:9} {row['status']}: {row['error'][:120]}"
        host = " ".join(f"{h * 1e3:6.1f}" for h in row["host_s"])
        step = " ".join(f"{t * 1e3:6.1f}" for t in row["step_s"])
        return (f"{row['setting']:9} host ms {host}  step ms {step}  "
                f"evictions {row['evictions']:.1f}/step, replays {row['replays']:.1f}/step")
    if s == "checkpoint":
        out = f"checkpointing {row['checkpoint_ratio']:.3f}x at {(row['checkpoint_true_peak'] or 0) / MiB:.1f} MiB"
        if row.get("status") == "ok":
            out += f"; dtr at that budget {row['dtr_ratio']:.3f}x (true peak {row['dtr_true_peak'] / MiB:.1f} MiB)"
        elif "status" in row:
            out += f"; dtr at that budget: {row['status']}"
        return out
    if s == "batch":
        sps = f"{row['samples_per_s']:.1f} samples/s" if row["samples_per_s"] else "-"
        cut = "" if row.get("converged", True) else " (at least: the search hit --batch-seconds)"
        why = f"; {row['searched_up_to']} refused by {row['refused_by'][:100]}" if row.get("refused_by") else ""
        return f"{row['method']:10} largest batch {row['largest_batch']}{cut} under {row['cap'] / 2**30:.1f} GiB, {sps}{why}"
    if s == "cost":
        return (f"syncs {row['syncs']}; estimate/measured median {row['median_ratio']:.2f} "
                f"(p10 {row['p10_ratio']:.2f}, p90 {row['p90_ratio']:.2f}), rank correlation {row['spearman']:.2f}, "
                f"step {row['measured_s'] * 1e3:.1f} ms measured vs {row['estimated_s'] * 1e3:.1f} estimated")
    return str(row)


def curve(rows, name):
    """The ``budgets`` rows of ``name`` that ran, from one process (runs differ by the host's
    speed): the one with the most such points, the newest of those; and its ``run`` label."""
    runs = {}
    for r in rows:
        if r["section"] == "budgets" and r["model"] == name and r.get("status") == "ok":
            runs.setdefault((r["time"], r.get("run"), r["commit"]), []).append(r)
    if not runs:
        return [], None
    key = max(runs, key=lambda k: (len(runs[k]), k[0]))
    return runs[key], key[1]


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows if r["section"] == "budgets"))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(4.4 * max(1, len(models)), 3.6), squeeze=False)
    for ax, name in zip(axes.flat, models):
        ok, run = curve(rows, name)
        # Budgets as a share of eager's true peak where it was measured (CUDA), else of dtr's
        # evictable room (``budget_at``'s fraction).
        measured = any(r.get("of_eager_peak") for r in ok)
        pts = sorted((r["of_eager_peak"], r["ratio"]) if measured else (r["fraction"], r["ratio"])
                     for r in ok if r.get("of_eager_peak") or not measured)
        if pts:
            ax.plot(*zip(*pts), "o-", label="dtr_eq (wall, this GPU)")
        if name in PAPER:
            ax.plot(*zip(*PAPER[name]), "ks", fillstyle="none", label="DTR paper (Titan V)")
        for r in rows:
            if (r["section"] == "checkpoint" and r["model"] == name and r.get("eager_true_peak")
                    and r.get("run") == run):
                ax.plot(r["checkpoint_true_peak"] / r["eager_true_peak"], r["checkpoint_ratio"], "r*", markersize=12,
                        label="static checkpointing")
                if r.get("dtr_true_peak"):
                    ax.plot(r["dtr_true_peak"] / r["eager_true_peak"], r["dtr_ratio"], "bX", markersize=9,
                            label="dtr_eq, budget at checkpointing's peak")
        ax.set_title(name)
        ax.set_xlabel("budget / eager's true peak" if measured else "fraction of the evictable room")
        ax.set_ylabel("slowdown vs eager")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(BUILDERS), default=list(BUILDERS))
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS) + ["batch"],
                    default=["overhead", "budgets", "turns", "checkpoint", "cost", "batch"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=["gpu", "tiny"], default="gpu")
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.67, 0.45, 0.3, 0.2, 0.1])
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per point (median)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the turns section")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="memory cap of the batch section")
    ap.add_argument("--dtr-margin", type=float, default=0.15, help="share of the cap dtr's budget leaves to kernels' scratch")
    ap.add_argument("--batch-seconds", type=float, default=25.0, help="search time per model and method")
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu.jsonl")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of slowdown against budget (default: next to --out)")
    ap.add_argument("--plot-only", action="store_true", help="draw --out's rows, run nothing")
    args = ap.parse_args()
    args.batch_start = dict(gpt2=4, resnet50=32, treelstm=16) if args.size != "tiny" else dict(gpt2=1, resnet50=2, treelstm=2)
    plot_path = args.plot or args.out.with_suffix(".png")
    if args.plot_only:
        rows = [json.loads(line) for line in open(args.out)]
        print("wrote", plot_path) if plot(rows, plot_path) else print("no matplotlib")
        return
    device = torch.device(args.device)
    # The caching allocator's settings decide how much of a memory cap fragmentation takes
    # (``expandable_segments:True`` maps memory in one growing segment).
    stamp = dict(commit=commit(), torch=torch.__version__, size=args.size, device=args.device,
                 alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                 device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 time=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"# {stamp['device_name']}, torch {stamp['torch']}, commit {stamp['commit']}", flush=True)
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out:

        def report(name, section, arch, produced):
            t0 = time.perf_counter()
            for row in produced:
                row = dict(row, model=name, arch=arch, **stamp)
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"{name:9} {section:10} {describe(row)}", flush=True)
            print(f"{name:9} {section:10} ({time.perf_counter() - t0:.0f} s)", flush=True)

        for name in args.models:
            case = BUILDERS[name](args.size, device)
            arch = case.arch
            print(f"## {name}: {arch}", flush=True)
            for section in args.sections:
                if section != "batch":
                    report(name, section, arch, SECTIONS[section](case, device, args))
            del case  # the batch search builds its own models, under the cap
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if "batch" in args.sections:
                report(name, "batch", arch, section_batch(name, device, args))
    if plot(rows, plot_path):
        print("wrote", plot_path)


if __name__ == "__main__":
    main()
