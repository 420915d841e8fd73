"""``dtr.budget(...)`` and the ``Engine`` it returns: the user's handle on one DTR budget.

Note [Block lifecycle]
~~~~~~~~~~~~~~~~~~~~~~
- Entering a block pushes a ``DTRMode`` on the current thread and starts a fresh runtime.
  Tensors that exist already (parameters, buffers, inputs, optimizer state) are constants.
- ``optimizer.step()`` inside the block: just before it, every tensor the program still holds
  is made resident and its lineage dropped (the parameters are about to change, so recorded
  ops that read them could no longer be replayed faithfully); the step itself runs untracked,
  so optimizer state stays plain.
- Leaving the block does the same for every tensor still alive, so tensors that escape stay
  correct; from then on they hold their data and ops on them run eagerly. If some of them had
  been evicted (typically: activations saved for a ``backward()`` that runs after the block),
  they are recomputed at exit, and a warning says so.
- Blocks do not nest (a clear error); one engine may be entered again, its statistics add up.

Note [A failed backward's pending nodes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When an op of a backward pass raises (a refusal of the budget, most often), PyTorch keeps the
failed pass's pending autograd nodes, and the tensors they saved, until the next backward on
the same thread: a bare ``TorchDispatchMode`` raising at one op of an ``nn.LSTMCell`` loop's
backward leaves a third of the step's tensors alive until then (torch 2.13, CPU). The program's
next try would run its forward with them still allocated, and on a device near capacity fail
for memory the budget never saw. So a block that an exception leaves, outside any backward
pass, ends with a backward of its own over one scalar, which lets them go
(``tests/test_leaks.py``). A CUDA backward runs on autograd's device thread: a bare mode
raising halfway through one left none of the step's memory allocated (a probe on an H100, torch
2.11), so there the scalar backward finds nothing to let go.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from dtr.config import parse_bytes
from dtr.eager import accumulation, crosscheck, data_parallel
from dtr.eager.cost import COST_MODES
from dtr.eager.driver import Driver
from dtr.eager.mode import DTRMode
from dtr.eager.loops import Loops, loop_modules
from dtr.eager.seeding import Seeding, segments_of
from dtr.eager.host_copies import measure_bandwidth
from dtr.core import Counters, Heuristic, Runtime, Stats, make_heuristic
from dtr.core.events import Events, holdings
from dtr.core.host_tier import HostTier
from dtr.errors import DTRError, OutOfBudgetError
from dtr.explain import Report, report
from dtr.log import apply_env, warn
from dtr.sim.record import RecordingRuntime
from dtr.sim.trace import TraceWriter
from dtr.timeline import Recorder, Timeline

__all__ = ["Engine", "budget"]

_local = threading.local()
_OPTIONS = ("cost", "trace", "plan", "loops", "swap", "host_limit", "bandwidth", "total", "max_recompute", "timeline")


class Engine:
    """A DTR memory budget; use it as a context manager (see ``dtr.budget``).

    Attributes:
        budget: bytes (int) or None. Settable at any time, also in the middle of a forward or
            backward pass, with the same forms ``dtr.budget`` accepts; lowering it evicts at
            once, or raises ``OutOfBudgetError`` and keeps the old budget if it cannot.
    """

    def __init__(
        self,
        limit: Union[int, str, None],
        *,
        heuristic: Union[str, Heuristic] = "dtr_eq",
        cost: str = "auto",
        trace: Union[str, "os.PathLike[str]", None] = None,
        plan: Optional[Sequence[Any]] = None,
        loops: Optional[Sequence[Any]] = None,
        swap: bool = False,
        host_limit: Union[int, str, None] = None,
        bandwidth: Optional[float] = None,
        total: bool = False,
        max_recompute: Optional[float] = 10.0,
        timeline: bool = False,
    ) -> None:
        self._budget = parse_bytes(limit)
        if max_recompute is not None and not (
            isinstance(max_recompute, (int, float)) and not isinstance(max_recompute, bool) and max_recompute > 0
        ):
            raise ValueError(f"dtr.budget: max_recompute must be a positive number or None, got {max_recompute!r}")
        self._max_recompute = max_recompute
        if not isinstance(total, bool):
            raise ValueError(f"dtr.budget: total must be True or False, got {total!r}")
        self._total = total
        if not isinstance(timeline, bool):
            raise ValueError(f"dtr.budget: timeline must be True or False, got {timeline!r}")
        self._record_timeline = timeline
        # The last (or current) block, for explain() and timeline(): plain data only.
        self._events: Optional[Events] = None
        self._holdings: list = []  # at the last block's end (Report.moment)
        self._sampler: Optional[Recorder] = None
        make_heuristic(heuristic)  # fail now, not at __enter__, on an unknown name
        self._heuristic = heuristic
        if cost not in COST_MODES:
            raise ValueError(f"dtr.budget: cost must be one of {COST_MODES}, got {cost!r}")
        self._cost = cost
        self.trace = trace
        self._seeding = Seeding(segments_of(plan)) if plan is not None else None
        self._loops = Loops(loop_modules(loops)) if loops is not None else None
        if not isinstance(swap, bool):
            raise ValueError(f"dtr.budget: swap must be True or False, got {swap!r}")
        if not swap and (host_limit is not None or bandwidth is not None):
            raise ValueError("dtr.budget: host_limit and bandwidth apply to swapping; pass swap=True")
        try:
            self._host_limit = parse_bytes(host_limit)
        except ValueError as e:
            raise ValueError(f"dtr.budget: host_limit: {e}") from None
        if bandwidth is not None and not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
            raise ValueError(f"dtr.budget: bandwidth must be a positive number of bytes per second, got {bandwidth!r}")
        self._swap = swap
        self._bandwidth = bandwidth
        self._swap_log = None  # the previous block's swap-ins, for prefetching
        self._host_peak = 0
        self._driver: Optional[Driver] = None
        self._mode: Optional[DTRMode] = None
        self._hooks: list = []
        self._done = Counters()  # of the blocks that ended
        self._ops = 0
        self._peak = 0
        self._constant_bytes = 0
        # Carried from block to block, and learned once a block has ended (Note [Room before an op]).
        self._largest_output = 0
        self._sizes_learned = False
        self._gradient_bytes = 0  # of the last block (Stats.gradient_bytes)
        self._constants_counted = 0  # total=True on CPU: what the last block counted
        self._plans_budget: Optional[int] = None  # see _absorb

    # ---------------------------------------------------------------- budget

    @property
    def budget(self) -> Optional[int]:
        d = self._driver
        return self._budget if d is None else d.rt.limit

    @budget.setter
    def budget(self, value: Union[int, str, None]) -> None:
        b = parse_bytes(value)
        d = self._driver
        if d is not None:  # the block's runtime owns the budget (Note [The budget])
            with d.rt.lock:
                d.rt.drain()
                try:
                    d.rt.set_budget(b)
                except OutOfBudgetError as e:
                    d.rt.events.raised(e, d.rt)
                    raise
        self._budget = b  # for the blocks to come

    @property
    def runtime(self) -> Optional[Runtime]:
        """The open block's ``dtr.core.Runtime`` (None outside a block), for tests and
        debugging: its storages, ``check_invariants``. Its API is internal; take its ``lock``
        before reading it while another thread may train."""
        d = self._driver
        return None if d is None else d.rt

    @property
    def trace(self) -> Union[str, "os.PathLike[str]", None]:
        """The trace file the engine's blocks are recorded into, or None. Setting it (also to
        None) takes effect at the next block; a new path starts a new file."""
        return self._trace

    @trace.setter
    def trace(self, path: Union[str, "os.PathLike[str]", None]) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"dtr.budget: trace must be a file path, got {path!r}")
        self._trace = path
        self._traced_blocks = 0

    # ---------------------------------------------------------------- block

    def __enter__(self) -> "Engine":
        if getattr(_local, "engine", None) is not None:
            raise DTRError(
                "dtr.budget blocks cannot be nested; to change the limit inside a block, "
                "set engine.budget instead"
            )
        if self._driver is not None:
            raise DTRError("this engine's block is already active (on another thread)")
        if torch.compiler.is_compiling():
            raise DTRError("dtr.budget cannot be entered inside torch.compile'd code")
        apply_env()
        accumulation.calibrate()
        heuristic = make_heuristic(self._heuristic)
        runtime = Runtime
        if self._trace is not None:
            runtime = self._recorder(heuristic)
        outside = None
        if self._total and self._budget is not None:
            # With CUDA memory allocated, that count is what exists before the block from its
            # first op that names a CUDA device (Driver._watch_device).
            outside = _cuda_allocated()
            before = self._constants_counted
            if before > self._budget:
                raise OutOfBudgetError(
                    before, self._budget, "dtr.budget(total=True) on entry",
                    f"{before} bytes exist before the block (the tensors the engine's last "
                    "block read), more than the total limit.",
                )
        if self._swap:
            host = HostTier(self._bandwidth or measure_bandwidth(), self._host_limit, self._swap_log)
            runtime = functools.partial(runtime, host=host)
        kind = crosscheck.CrosscheckedDriver if crosscheck.enabled() else Driver  # DTR_CROSSCHECK
        driver = kind(
            self._budget, heuristic, estimate=self._cost == "estimate", runtime=runtime,
            largest_output=self._largest_output,
            size_every_op=not self._sizes_learned and self._seeding is None,
            total=self._total, outside=outside,
            constants_before=self._constants_counted, max_recompute=self._max_recompute,
        )
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._hooks = [
            register_optimizer_step_pre_hook(lambda opt, a, k: driver.begin_optimizer_step()),
            register_optimizer_step_post_hook(lambda opt, a, k: driver.end_optimizer_step()),
        ]
        parallel = data_parallel.register()
        if parallel is not None:
            self._hooks.append(parallel)
        self._events = driver.rt.events = Events()
        self._sampler = driver.rt.on_op = Recorder() if self._record_timeline else None
        self._driver = driver
        if self._seeding is not None:
            self._seeding.attach(driver)
        if self._loops is not None:
            self._loops.attach(driver)
        self._mode = DTRMode(driver)
        self._mode.__enter__()
        _local.engine = self
        return self

    def _recorder(self, heuristic: Heuristic):
        """A runtime factory that records the block into the trace file: the first block
        writes the header, later ones append."""
        header = None
        if not self._traced_blocks:
            header = {
                "heuristic": getattr(heuristic, "name", type(heuristic).__name__),
                "cost": self._cost,
                "budget": self._budget,
                "meta": {"torch": torch.__version__, "device": "cpu"},
            }
        writer = TraceWriter(self._trace, header)
        self._traced_blocks += 1
        return lambda budget, h, executor, **options: RecordingRuntime(budget, h, executor, writer, **options)

    def __exit__(self, exc_type, exc, tb) -> None:
        driver, mode = self._driver, self._mode
        rt = driver.rt
        try:
            mode.__exit__(exc_type, exc, tb)
            if self._seeding is not None:
                self._seeding.detach()
            self._gradient_bytes = rt.held_bytes  # the block's end stops charging them
            with rt.lock:
                if isinstance(exc, OutOfBudgetError):  # one the mode did not see (a gradient hook's)
                    rt.events.raised(exc, rt)
                self._holdings = holdings(rt)
            recomputed = driver.close(failed=exc_type is not None)
            self._sizes_learned = self._sizes_learned or (exc_type is None and driver.ops > 0)
            if self._sampler is not None:
                self._sampler.end(rt)
        finally:
            if self._loops is not None:
                self._loops.detach()
            if isinstance(driver.rt, RecordingRuntime):
                driver.rt.writer.close()
            for h in self._hooks:
                h.remove()
            self._hooks = []
            _local.engine = None
            self._absorb(driver)
            self._driver = self._mode = None
            if exc_type is not None:
                _release_failed_backward()
        if recomputed and exc_type is None:
            warn(
                f"dtr: {recomputed} ops were replayed at block exit to recompute tensors that "
                "were still referenced but had been evicted (often: activations saved for a "
                "backward() that runs after the block). Run backward() inside the block to "
                "keep them under the budget.",
                stacklevel=2,
            )

    def _absorb(self, driver: Driver) -> None:
        self._done.add(driver.rt.counters)
        self._ops += driver.ops
        host = driver.rt.host
        if host is not None:
            self._swap_log = host.log
            self._host_peak = max(self._host_peak, host.peak)
        self._peak = max(self._peak, driver.rt.peak)
        self._largest_output = driver.largest_output
        self._constants_counted = max(self._constants_counted, driver.constants.counted_bytes)
        self._constant_bytes = driver.constants.read_bytes
        self._plans_budget = driver.rt.budget  # the budget the last block's plans were for

    # ---------------------------------------------------------------- stats

    def stats(self) -> Stats:
        """What this engine has done so far, summed over its blocks (see ``dtr.Stats``)."""
        counts = Counters().add(self._done)
        ops = self._ops
        peak, resident, constant = self._peak, 0, self._constant_bytes
        host_peak = self._host_peak
        gradients = self._gradient_bytes
        driver = self._driver
        if driver is not None:
            rt = driver.rt
            with rt.lock:
                rt.drain()  # count tensors the program has dropped as gone
                counts.add(rt.counters)
                ops += driver.ops
                peak = max(peak, rt.peak)
                resident = rt.memory
                if rt.host is not None:
                    host_peak = max(host_peak, rt.host.peak)
                constant = driver.constants.read_bytes
                gradients = rt.held_bytes
        return Stats(
            resident_bytes=resident,
            peak_resident_bytes=peak,
            constant_bytes=constant,
            budget=self.budget,
            host_peak_bytes=host_peak,
            gradient_bytes=gradients,
            ops=ops,
            **counts.fields(),
        )

    def explain(self) -> Report:
        """What holds the budget, the most expensive evictions and replays, and why the last
        ``OutOfBudgetError`` happened: a ``dtr.explain.Report`` (data; ``print`` it to read it).

        Inside a block it describes the block so far; after one, the last block (what was held
        when it failed, or else just before its end). Before any block the report is empty and
        says so. See dtr/explain.py.
        """
        stats = self.stats()
        driver = self._driver
        if driver is not None:
            rt = driver.rt
            with rt.lock:  # the runtime's tallies change under it (another thread may train)
                rt.drain()
                return report("now, inside the block", holdings(rt), rt.events, stats)
        events = self._events
        if events is None:
            return report("no block has run yet: nothing to explain", [], None, stats)
        failure = events.failure
        if failure is not None:
            return report(f"when the last block's {failure.kind} was raised ({failure.op})", failure.holdings,
                          events, stats)
        return report("at the end of the last block, before it handed live tensors back", self._holdings,
                      events, stats)

    def timeline(self) -> Timeline:
        """The memory timeline of the current block so far, or of the last one (see
        dtr/timeline.py). Needs ``dtr.budget(..., timeline=True)``.

        Raises:
            DTRError: the engine does not record a timeline, or no block has run yet.
        """
        if not self._record_timeline:
            raise DTRError("engine.timeline(): this engine records no timeline; create it with "
                           "dtr.budget(..., timeline=True), or record a trace (trace=path) and use dtr.plot(path)")
        if self._sampler is None:
            raise DTRError("engine.timeline(): no block has run yet")
        driver = self._driver
        if driver is None:
            return self._sampler.timeline()
        with driver.rt.lock:
            return self._sampler.timeline()

    def plot_timeline(self, path: Union[str, "os.PathLike[str]", None] = None, *, ax: Any = None) -> Any:
        """Draw ``timeline()`` (``dtr.plot``): resident bytes and budget against the op clock,
        evictions and replays per op. Returns the matplotlib figure; saves it to ``path`` if
        given. Needs matplotlib (``pip install 'dtr[plot]'``) and ``timeline=True``."""
        return self.timeline().plot(path, ax=ax)

    def plans(self) -> List[Dict[tuple, Any]]:
        """The plans of ``dtr.budget(..., plan=segments)``, one dict per segment: input
        signature (shape, dtype, device type of each tensor argument of its first stage) ->
        the ``dtr.planner.Plan`` applied at the current budget, or None where the segment runs
        under plain DTR (no plan fits its share of the budget). A signature appears once its
        profiling step (the first with it) has run forward and backward. Empty without
        ``plan=``."""
        if self._seeding is None:
            return []
        d = self._driver
        return self._seeding.plans(self._plans_budget if d is None else d.rt.budget)

    def check_invariants(self) -> None:
        """Assert the runtime's invariants (for tests; O(number of tensors))."""
        if self._driver is not None:
            with self._driver.rt.lock:
                self._driver.rt.drain()
                self._driver.rt.check_invariants()

    def __repr__(self) -> str:
        state = "active" if self._driver is not None else "inactive"
        return f"<dtr.Engine budget={self.budget} heuristic={self._heuristic!r} {state}>"


def _cuda_allocated() -> Optional[int]:
    """Bytes allocated on the current CUDA device, or None where the process has none there
    (``dtr.budget(total=True)`` then counts the constants the block reads instead)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    allocated = torch.cuda.memory_allocated()
    return allocated or None


def budget(
    limit: Union[int, str, None], *, heuristic: Union[str, Heuristic] = "dtr_eq", **options
) -> Engine:
    """Run the enclosed code with at most ``limit`` bytes of managed tensors in memory.

    ``with dtr.budget("6 GiB") as engine: loss = model(x); loss.backward()`` trains as eager
    PyTorch would (same values, same gradients, plain ``.grad`` tensors), evicting tensors
    produced inside the block when their bytes would exceed the budget and recomputing them by
    replaying the ops that made them when they are needed again.

    Args:
        limit: bytes (int), a string with SI or IEC units ("800MB", "1.5 GiB"), or None to
            track without evicting.
        heuristic: which storage to evict first: a name from
            ``dtr.heuristic_names()`` (default "dtr_eq", the DTR paper's h_DTR^eq) or a
            heuristic object (see ``dtr.Heuristic``).
        cost: "auto" (default: measured kernel time on CPU, a roofline estimate on
            accelerators, where timing would need synchronization) or "estimate" (always the
            deterministic estimate).
        trace: a file path: record what the engine sees (ops with their inputs, outputs,
            sizes and costs, views, in-place writes, frees) as a trace that
            ``dtr.simulate(path, budget, heuristic)`` replays in seconds, without tensors.
            JSON lines, gzip-compressed if the name ends in ".gz"; format in ``dtr.sim.trace``.
            Each block of the engine is appended to the file (the first one starts it anew).
        plan: sequential segments to plan statically, each an ``nn.Sequential`` or a list of
            modules called in order (a stack of transformer blocks, ResNet stages). The first
            step with a given input shape profiles each stage; from the next one on, the
            rotor-optimal schedule for the segment's share of the budget is followed there
            (checkpoints pinned until their backward, the other activations dropped as the
            plan says); DTR handles everything else. ``engine.plans()`` shows the plans.
        loops: modules called once per step of a loop over time (``[model.cell]`` for an
            ``nn.LSTMCell`` or ``nn.GRUCell`` unrolled in Python, or a cell of one's own). The
            tensors each call reads that were made in the block (the carried state) are kept as
            checkpoints: evicted only when nothing else can go, and then so that those left
            stay evenly spread over the steps (every other one first, then every fourth, ...),
            so that the backward pass rebuilds a state from a few steps back rather than from
            the start of the loop.
        swap: when True, a tensor can also be copied to host memory instead of evicted,
            whichever is cheaper (transfer time vs recomputation), and is copied back when
            needed, or ahead of need in the order the previous block needed it. Tensors the
            engine cannot recompute can still be swapped.
        host_limit: host bytes the swapped tensors may take (None: no limit); beyond it the
            engine evicts instead. Needs ``swap=True``.
        bandwidth: bytes per second of a host copy, for the swap-or-evict choice; None (the
            default) measures it once per process on the device in use.
        total: when True, ``limit`` is the memory the whole step may use on the device, not
            only the tensors made in the block: everything already allocated counts against it
            (parameters, gradients, optimizer state, inputs), so "fit in 22 GiB" is one
            argument. For a block on CUDA that is ``torch.cuda.memory_allocated()`` as the
            block starts, from its first op that names a CUDA device (which raises
            ``OutOfBudgetError`` if that count is over the limit already); elsewhere (CPU,
            which keeps no such count) the bytes of the tensors from before the block that its
            ops read: from the start of a block, as many as the engine's previous block read,
            and more as new ones are first read (in an engine's first block, only as each is
            first read).
        max_recompute: stop a block whose recomputation has cost more than this many times
            its own operations (after 1,000 replays) with ``dtr.ThrashingError``, an
            ``OutOfBudgetError``: below its lowest workable budget a model thrashes for minutes
            or hours instead of failing. None: never stop.
        timeline: when True, sample the engine's memory after every op, for
            ``engine.timeline()`` and ``engine.plot_timeline()`` (a few bytes and well under a
            microsecond per op; off by default, so that nothing is paid per op unasked).

    Returns:
        An ``Engine``: a context manager with a settable ``budget``, ``stats()``,
        ``explain()`` and, with ``timeline=True``, ``timeline()`` and ``plot_timeline()``.

    Raises:
        ValueError: on a malformed limit, an unknown heuristic or a bad option value.
        TypeError: on an unknown option.
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"dtr.budget() got unknown option(s) {unknown}; known options: {list(_OPTIONS)}")
    return Engine(limit, heuristic=heuristic, **options)


def _release_failed_backward() -> None:
    """Note [A failed backward's pending nodes]: run a backward over one scalar, unless a
    backward pass is running (the block ended inside one) or autograd is off. Best effort:
    where it cannot run (inside a ``torch.func`` transform, under a mode that refuses its
    ops) the program's own error must still be the one that reaches it."""
    if torch._C._current_graph_task_id() != -1 or torch.is_inference_mode_enabled():
        return
    try:
        with torch.enable_grad():
            torch.ones((), requires_grad=True).mul(2).backward()
    except Exception:
        pass
