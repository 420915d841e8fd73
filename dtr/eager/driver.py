"""The torch driver of a ``Runtime``: runs aten ops on managed tensors.

One op (``Driver.dispatch``, the hot path):

1. look up the op's cached facts (ops.py);
2. scan the arguments (``Driver._scan``, the one scan of every path): wrappers of this engine
   become input cells (holes in a template), plain tensors are constants (never wrapped, never
   evicted; constants.py) and parameters among them get their ``.grad`` hook (gradients.py),
   wrappers of other engines are read as plain values;
3. before an in-place op, protect what its writes would destroy (``Driver._writes``, Note
   [Aliases] in constants.py): a written constant that a recorded op reads forces a flush; a
   written storage without lineage has its dependents made permanent (``Runtime.before_write``);
4. ``runtime.acquire`` the inputs (rematerializing as needed; a simple op whose inputs the scan
   found all defined just locks them), make room for the outputs when the budget is close (Note
   [Room before an op]), run the kernel and time it;
5. ``runtime.complete`` the record (new storages, views, new versions; recording.py builds the
   general path's), which evicts down to the budget;
6. wrap the outputs; in-place and ``out=`` ops return the program's own tensor objects
   (``ops.program_returns``).

Most ops go through ``Driver._run``; three kinds have paths of their own: a view of its only
tensor (``Views._run_view``, views.py, with ``detach`` and in-place view changes), a collective
(collectives.py, Note [Collectives] in ops.py) and autograd summing gradients
(``Gradients._sum``, gradients.py). Simple ops (one new tensor, no writes) and one-view ops
register their one output inline, and the native path registers ops of several new tensors
and in-place ops of ``facts.in_place`` itself; ``DTR_CROSSCHECK=1`` compares those records with
the general path's (crosscheck.py). The driver is the runtime's ``Executor``: ``replay`` here,
``forget`` the constant table's, the swapping half ``HostCopies`` (host_copies.py).

Ops whose outputs alias a constant (``weight.t()``) return plain tensors: a view of a constant
is a constant. A parameter's ``.grad`` made in the block is handed out plain but stays charged
(gradients.py, Note [Held gradients] in runtime.py).

Outputs with a sparse layout (COO, CSR, ...; ``nn.Embedding(sparse=True)``'s gradients), and
outputs of a tensor subclass with a ``__torch_dispatch__`` of its own, are returned plain too:
they have no storage the engine could account, evict, swap or clone without the subclass,
only parts (indices and values; the subclass's inner tensors), and those are not charged to
the budget, like constants. A part may be a managed input itself
(``torch.sparse_coo_tensor(indices, values)`` keeps ``values``); that storage is then handed
to the program as by ``dtr.materialize`` (every input, where the parts cannot be listed).
Such tensors read by recorded ops are constants; replays then run with the subclass's
dispatch on (replay.py). What a write to a constant or a handed-out storage must do first is
the constant table's (constants.py, Note [Aliases]).
"""

from __future__ import annotations

from time import perf_counter
from typing import Any, List, Optional, Tuple

import torch

from dtr.eager import native, output_size, rng
from dtr.eager.collectives import run_collective
from dtr.eager.constants import Constants
from dtr.eager.cost import estimate_seconds
from dtr.eager.gradients import Gradients
from dtr.eager.host_copies import HostCopies
from dtr.eager.ops import FACTS, WRITTEN, Kind, facts_for, program_returns, written_argument
from dtr.eager.output_size import flat_tensors
from dtr.eager.recording import record, returned_input, sort_outputs
from dtr.eager.replay import Call, fill, flat, replay
from dtr.eager.tensor import DTRTensor, make_wrapper
from dtr.eager.native import FIRST as _FIRST, NO_KWARGS as _NO_KWARGS
from dtr.eager.views import Views
from dtr.core import OpRecord, Runtime, State
from dtr.core.collector import untrack
from dtr.errors import OutOfBudgetError

__all__ = ["Driver"]

_Tensor = torch.Tensor
_EXTERNAL = State.EXTERNAL
_VIEW = Kind.VIEW
_WRITE = Kind.WRITE
_DETACH = Kind.DETACH
_COLLECTIVE = Kind.COLLECTIVE
_no_python_dispatch = torch._C._DisableTorchDispatch
_NO_INPUTS = -1  # ``_scan``'s ``only``: no argument is an input
_strided = torch.strided
_ADD = torch.ops.aten.add.Tensor
_MM = torch.ops.aten.mm.default  # an outer product in a backward pass may be deferred (scattered.py)
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class Driver(Views, Gradients, HostCopies):
    """Executes aten ops for one runtime and replays its records (it is the runtime's
    ``Executor``: module docstring)."""

    views_alias_data = True  # torch views share their storage's memory

    def __init__(
        self,
        budget: Optional[int],
        heuristic,
        estimate: bool,
        runtime=Runtime,
        largest_output: int = 0,
        size_every_op: bool = False,
        total: bool = False,
        outside: Optional[int] = None,
        constants_before: int = 0,
        max_recompute: Optional[float] = None,
    ) -> None:
        # With ``dtr.budget(total=True)``, ``budget`` also covers memory the engine does not
        # manage (Note [The budget] in runtime.py): ``outside`` bytes allocated on the device
        # before the block (CUDA), or, where no allocator counts them, the constants the block
        # reads (``count_constants``): as many as the engine's previous block read
        # (``constants_before``), more as new ones are first read. The CUDA count is for a
        # block that computes on CUDA: until an op names a CUDA device (``_watch_device``) the
        # block counts the constants it reads (a CPU block in a process that also uses a GPU).
        Gradients.__init__(self)
        self.constants_before = constants_before if total else 0
        self._cuda_outside = outside if total else None
        # ``runtime``: the Runtime class, or a factory with its signature (the trace recorder).
        # Untracked records: the block always closes the runtime (Note [Untracked records]).
        self.rt = runtime(
            budget, heuristic, self, untracked=True, max_recompute=max_recompute,
            outside=self.constants_before,
        )
        self.estimate = estimate
        # The largest new storage an op of this engine made, and whether its ops are sized
        # whatever the headroom: until a block has taught it that largest (Note [Room before an op]).
        self.largest_output = largest_output
        self.size_every_op = size_every_op
        self.constants = Constants(self.rt, self._charge_constants)
        # Bound once, as the hot path calls them (one lookup per op); ``forget`` is the
        # runtime's ``Executor.forget``.
        self._use_constants = self.constants.use
        self.forget = self.constants.forget
        # ``Constants.count`` where constants read count against the limit, else None.
        self.count_constants = self.constants.count if total else None
        self.ops = 0  # ops intercepted
        self.native = None
        self._bind_native()
        self.op_seconds = 0.0  # cost of the ops run for the program (not replays); plans profile it

    def _bind_native(self) -> None:
        """The native simple op (native.py), for the runtime it mirrors: not a trace recorder's
        (a subclass), not with a host tier or constants counted; and with it the native search
        of the runtime's candidate index, its native ``lineage.release`` and the native
        callback of its wrappers' deaths."""
        if type(self.rt) is Runtime and self.rt.host is None and self.count_constants is None:
            self.native = native.run_simple
            if self.native is not None:
                self.rt.native_ordinary = native.ordinary
                self.rt.native_release = native.release
                self.rt._wrapper_died = native.wrapper_death(self.rt)
            if self.native is not None and type(self) is Driver:  # subclasses keep their overrides
                self.dispatch = native.dispatcher(self)

    def _watch_device(self, opname: str, args, kwargs) -> None:
        """With ``total=True`` and CUDA memory allocated at the block's entry: at the first op
        that names a CUDA device, the limit covers that count instead of the constants read so
        far. Raises ``OutOfBudgetError`` (the op does not run; the next one tries again) if that
        leaves the engine less than it holds."""
        device = kwargs.get("device")
        named = isinstance(device, torch.device) and device.type == "cuda"
        if not named and not any(t.device.type == "cuda"
                                 for t in output_size.flat_tensors([*args, *kwargs.values()])):
            return
        self.rt.set_outside(self._cuda_outside, opname)
        self._cuda_outside = None
        self.constants_before = 0
        self.count_constants = None
        self.constants.counted.clear()  # counted in the CUDA count: not the next block's start
        self._bind_native()

    def _charge_constants(self, nbytes: int, opname: str) -> None:
        """With ``count_constants``: ``nbytes`` of constants have been read (``Constants.count``);
        raises ``OutOfBudgetError`` (the op does not run) if the engine cannot evict down to what
        they leave of the limit (``__init__``)."""
        rt = self.rt
        outside = max(self.constants_before, nbytes)
        if outside > rt.outside and rt.limit is not None:
            rt.set_outside(outside, opname)

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, func, args, kwargs):
        """Run one op (module docstring). With the native path, the driver's ``dispatch`` is
        native.py's, which does the same natively up to ``_route``, and runs itself simple ops,
        ops of several new tensors, in-place ops that write their first argument, view ops
        returning one view or a list of views, ``detach`` and gradient sums into a permanent
        running sum (docs/runtime.md)."""
        facts = FACTS.get(func)
        if facts is None:
            facts = facts_for(func)
        rt = self.rt
        with rt.lock:
            self.ops += 1
            if rt._dead:
                rt.drain()
            if self._cuda_outside is not None:
                self._watch_device(facts.name, args, kwargs)
            node = _current_node()
            if node is not self.node:
                if (node is None) is not (self.node is None):
                    rt.set_backward(node is not None)
                self.node = node
                self.node_from = rt.next_sid
            return self._route(facts, func, args, kwargs)

    def _route(self, facts, func, args, kwargs):
        """The path that runs an op of ``facts`` (module docstring), under the runtime's lock."""
        kind = facts.kind
        if kind is _VIEW or kind is _DETACH or kind is Kind.INPLACE_VIEW:
            base = args[facts.view_of]
            if type(base) is not DTRTensor or base._dtr.cell.storage.runtime is not self.rt:
                if kind is Kind.INPLACE_VIEW and type(base) is not DTRTensor:
                    # Recorded ops hold this very tensor object, whose shape is about to
                    # change: as for a write, they must not be replayed after it.
                    self.constants.before_constants_written([base])
                return self.passthrough(func, args, kwargs)
            if kind is _DETACH:
                return self._alias(base)
            if kind is Kind.INPLACE_VIEW:
                return self._inplace_view(facts, func, base, args, kwargs)
            if (facts.one_view or facts.list_view) and not kwargs:
                return self._run_view(facts, func, base, args)
        elif kind is Kind.UNSUPPORTED:
            self._unsupported(facts, args, kwargs)
            return self.passthrough(func, args, kwargs)
        elif kind is _COLLECTIVE:
            return run_collective(self, facts, args, kwargs)
        elif func is _ADD and not kwargs and len(args) == 2 and self._summing(args):
            return self._sum(facts, args)
        elif (facts.scatters or func is _MM) and self.node is not None and not kwargs:
            out = self._defer(facts, func, args)
            if out is not None:
                return out
        return self._run(facts, func, args, kwargs)

    def passthrough(self, func, args, kwargs):
        """Run ``func`` on plain values, returning plain results (nothing is recorded)."""
        vals = list(args)
        consts: List[torch.Tensor] = []
        self._scan(enumerate(args), vals, vals, None, None, consts, _NO_INPUTS)
        if kwargs:
            kw = dict(kwargs)
            self._scan(kwargs.items(), kw, kw, None, None, consts, _NO_INPUTS)
            out = func(*vals, **kw)
        else:
            out = func(*vals)
        facts = FACTS.get(func) or facts_for(func)
        if facts.kind is _WRITE or facts.kind is Kind.INPLACE_VIEW:
            return program_returns(facts, out, args, kwargs)
        return out

    def _plain(self, a):
        """``a`` (an argument: a tensor, a list of them, anything else) as plain values, for a
        use the engine does not record (``_scan`` with no inputs)."""
        box = [a]
        self._scan(((0, a),), box, box, None, None, [], _NO_INPUTS)
        return box[0]

    def _value_of(self, w: DTRTensor) -> torch.Tensor:
        """The current data of a wrapper, as a plain tensor the caller will only read."""
        ref = w._dtr
        rt = ref.cell.storage.runtime
        if rt is self.rt:
            cell = ref.cell = rt.resolve(ref.cell)
            rt.acquire([cell])
            rt.unlock([cell])
            return cell.value
        return w._plain()

    def _unsupported(self, facts, args, kwargs) -> None:
        for a in list(args) + list(kwargs.values()):
            if type(a) is DTRTensor and a._dtr.cell.storage.runtime is self.rt:
                raise NotImplementedError(
                    f"dtr: {facts.name} replaces the storage of a tensor the engine manages, "
                    "which dtr does not support; use out-of-place ops (or dtr.materialize(t) to "
                    "get a plain tensor) inside the dtr.budget block"
                )

    def _writes(self, facts, args, kwargs) -> Tuple[list, list, list]:
        """What an op is about to write, sorted (``_sort_written``; batch norm's running
        statistics, ops.py ``_HIDDEN_WRITES``, count as constants written), once what the
        writes would destroy is protected (Note [Aliases]): ``(mutated, external_written,
        const_written)``."""
        mutated: List[Any] = []
        external_written: List[Any] = []
        const_written: List[torch.Tensor] = []
        if facts.written:
            for pos, name in facts.written:
                w = args[pos] if pos is not None else kwargs.get(name)
                self._sort_written(flat_tensors(w), mutated, external_written, const_written)
        elif facts.hidden_writes and (facts.training_arg is None or args[facts.training_arg]):
            for i in facts.hidden_writes:
                t = args[i]
                if type(t) is DTRTensor:
                    raise NotImplementedError(
                        f"dtr: {facts.name} updates running statistics that were created inside "
                        "the dtr.budget block; create batch-norm buffers before entering it"
                    )
                if t is not None:
                    const_written.append(t)
        self.constants.before_writes(mutated, external_written, const_written)
        return mutated, external_written, const_written

    def _sort_written(self, tensors, mutated: list, external_written: list, const_written: list) -> None:
        """Sort the tensors an op is about to write: storages of this engine (``mutated``, or
        ``external_written`` if handed out) and constants (``const_written``)."""
        rt = self.rt
        for t in tensors:
            if type(t) is DTRTensor and t._dtr.cell.storage.runtime is rt:
                ref = t._dtr
                s = (ref.cell if ref.cell.storage.forward is None else rt.resolve(ref.cell)).storage
                if s.state is _EXTERNAL:
                    external_written.append(s)
                elif s not in mutated:
                    mutated.append(s)
            else:
                const_written.append(self._plain(t))

    def _scan(self, items, template, values, inputs, slots, consts, only, where=None) -> bool:
        """Sort an op's arguments, ``(position or keyword, value)`` pairs (the elements of the
        list argument ``where``, when it recurses): every run path's one scan.

        A wrapper of this engine becomes an input: appended to ``inputs``, a hole in
        ``template`` named by a slot (``Call.slots``), its cell's value in ``values``. Any
        other tensor is a constant: plain (another engine's wrapper is read), in ``template``,
        ``values`` and ``consts``; a leaf that requires grad (a parameter) gets its ``.grad``
        hook the first time (gradients.py). ``only``: every wrapper of this engine is an input
        (None), only those at one position (a view op's base: its record keeps no dependency
        edges, so other tensors go by value), or none (``_NO_INPUTS``: plain values for an op
        that is not recorded). Returns whether every input's value is defined; if not,
        ``values`` is incomplete, and the caller acquires the inputs and fills ``template``.
        """
        rt = self.rt
        defined = True
        for i, a in items:
            if isinstance(a, _Tensor):
                if type(a) is DTRTensor:
                    ref = a._dtr
                    c = ref.cell
                    if c.storage.runtime is rt and (only is None or i == only):
                        if c.storage.forward is not None:
                            c = ref.cell = rt.resolve(c)
                        slots.append((i, -1, len(inputs)) if where is None else (where, i, len(inputs)))
                        inputs.append(c)
                        template[i] = None
                        v = values[i] = c.value
                        if v is None:
                            defined = False
                        continue
                    a = template[i] = values[i] = self._value_of(a)
                elif a.requires_grad and a.is_leaf and id(a) not in self.hooks and a._base is None:
                    self._hook(a)
                consts.append(a)
            elif type(a) in (list, tuple) and a:
                t = list(a)
                v = list(a)
                within = None if only is None or i == only else _NO_INPUTS
                if not self._scan(enumerate(a), t, v, inputs, slots, consts, within, i):
                    defined = False
                template[i] = t
                values[i] = v
        return defined

    def _run(self, facts, func, args, kwargs):
        """Run an op on tensors of this engine and register its results: natively for an op
        of ``facts.simple`` or ``facts.several``, or of ``facts.in_place`` without keyword
        arguments, where the native path takes it (native.py), else ``_execute``."""
        if (facts.simple or facts.several or (facts.in_place and not kwargs)) and self.native is not None:
            out = self.native(self, facts, func, args, kwargs)
            if out is not native.FALLBACK:
                return out
        return self._execute(facts, func, args, kwargs)

    def _execute(self, facts, func, args, kwargs):
        """Run an op on tensors of this engine and register its results (module docstring,
        steps 2 to 6). An op of ``facts.simple`` (the common case: it writes nothing and returns
        one new tensor) skips the general bookkeeping at both ends: its inputs are locked as
        the scan found them when they are all defined, and its one output is registered
        without sorting the schema's returns (measured: about a third of the per-op cost on
        small ops). ``DTR_CROSSCHECK=1`` compares that registration with the general one
        (crosscheck.py)."""
        rt = self.rt
        simple = facts.simple
        if simple:
            inputs: List[Any] = []
            only = None
        else:
            # Writes are sorted before the scan, so that input indices account for the old
            # roots of the written storages, first in ``inputs`` (Note [Versions]).
            mutated, external_written, const_written = self._writes(facts, args, kwargs)
            inputs = [s.root for s in mutated]
            only = facts.view_of if facts.kind is _VIEW else None
        slots: List[Any] = []
        consts: List[torch.Tensor] = []
        targs = list(args)
        vals = list(args)
        defined = self._scan(enumerate(args), targs, vals, inputs, slots, consts, only)
        tkw = None
        kw = _NO_KWARGS
        if kwargs:
            tkw = dict(kwargs)
            kw = dict(kwargs)
            defined = self._scan(kwargs.items(), tkw, kw, inputs, slots, consts, only) and defined
        rt.acquire(inputs)
        if not simple:
            defined = False
        try:
            if not defined:
                vals, kw = fill(targs, tkw, slots, lambda k: inputs[k].value)
            if self.count_constants and consts:
                self.count_constants(consts, facts.name)
            budget = rt.budget
            sized = None
            if budget is not None and facts.sized and (
                    self.size_every_op or rt.memory + self.largest_output > budget):
                sized = self._make_room(facts, func, vals, kw)
            state = rng.capture(vals, kw) if facts.random else None
            grad = torch.is_grad_enabled()
            t0 = perf_counter()
            out = facts.kernel(*vals, **kw) if kwargs else facts.kernel(*vals)
            seconds = perf_counter() - t0
            if sized is not None:
                output_size.correct(sized, out, vals, kw)
        except BaseException:
            rt.unlock(inputs)
            raise
        if simple:
            return self._register_one(facts, func, out, seconds, inputs, targs, tkw, slots, consts, grad, state, vals, kw)
        return self._register(facts, func, out, seconds, inputs, targs, tkw, slots, consts, grad, state, vals, kw,
                              args, kwargs, mutated, not ((const_written and not facts.hidden_writes) or external_written))

    def _register_several(self, facts, func, out, seconds, inputs, targs, tkw, slots, consts, grad, vals, kw,
                          args, kwargs):
        """Register the outputs of an op of ``facts.several`` that the native path ran on
        acquired ``inputs`` (no RNG or writes) and does not register itself: one that returned
        an input, or an output returned plain."""
        return self._register(facts, func, out, seconds, inputs, targs, tkw, slots, consts, grad, None, vals,
                              kw, args, kwargs, [], True)

    def _register(self, facts, func, out, seconds, inputs, targs, tkw, slots, consts, grad, state, vals, kw,
                  args, kwargs, mutated, replayable):
        """The general path's registration of the results ``out`` of an op that ran on
        acquired ``inputs`` (the old roots of the ``mutated`` storages first)."""
        rt = self.rt
        nv = len(mutated)
        try:  # until ``complete``, which unlocks them, also when it fails
            fresh, fresh_pos, same_at, plain = sort_outputs(
                facts, out, inputs, consts, inputs[nv] if facts.kind is _VIEW else None
            )
            for v in plain:  # returned plain (module docstring); inputs still locked, so resident
                self.constants.hand_out_parts(v, inputs)
            if self.estimate:
                seconds = estimate_seconds(func, vals, kw, flat(out))
        except BaseException:
            rt.unlock(inputs)
            raise
        for nbytes, _, _ in fresh:
            if nbytes > self.largest_output:
                self.largest_output = nbytes
        self.op_seconds += seconds
        rec = record(facts, func, inputs, seconds, args=targs, kwargs=tkw, slots=slots, grad=grad,
                     rng_state=state, fresh=fresh_pos, mutated=mutated, replayable=replayable)
        try:
            cells = rt.complete(rec, [(s, s.value) for s in mutated], fresh)
        except BaseException:
            if state is not None:
                rng.restore(state)
            raise
        if type(rec) is Call and replayable and consts:
            rec.consts = self._use_constants(consts)
            untrack(rec.args, rec.consts)  # they hold tensors: Note [Untracked records]
        by_pos = dict(zip(fresh_pos, cells[nv:]))
        by_pos.update(same_at)
        return self._returns(facts, out, by_pos, args, kwargs)

    def _register_one(self, facts, func, out, seconds, inputs, targs, tkw, slots, consts, grad, state, vals, kw):
        """Register the one output of a simple op that ran on acquired ``inputs`` (``_run``);
        the native path (native.py) calls it for every outcome it does not register itself."""
        rt = self.rt
        try:
            if type(out) is _Tensor and out.layout is _strided:
                same = returned_input(out, inputs, consts)
                nbytes = out.untyped_storage().nbytes()
            else:  # returned plain (module docstring); inputs still locked, so resident
                if isinstance(out, _Tensor):
                    self.constants.hand_out_parts(out, inputs)
                nbytes, same = 0, None
            if self.estimate:
                seconds = estimate_seconds(func, vals, kw, (out,))
        except BaseException:
            rt.unlock(inputs)
            raise
        self.op_seconds += seconds
        if same is not None:
            rt.complete(OpRecord(facts.name, inputs, None, seconds), (), ())
            return make_wrapper(out, rt, same)
        if not nbytes:
            rt.complete(OpRecord(facts.name, inputs, None, seconds), (), ())
            return out
        if nbytes > self.largest_output:
            self.largest_output = nbytes
        call = Call(facts.name, inputs, seconds, True, func, tuple(targs), tkw, tuple(slots), grad)
        call.rng = state
        call.fresh = _FIRST
        try:
            (cell,) = rt.complete(call, (), ((nbytes, out, None),))
        except BaseException:
            if state is not None:
                rng.restore(state)
            raise
        if consts:
            call.consts = self._use_constants(consts)
            untrack(call.args, call.consts)  # they hold tensors: Note [Untracked records]
        return make_wrapper(out, rt, cell)

    def _returns(self, facts, out, by_pos, args, kwargs):
        """What the program gets back from an op: a wrapper for each output with a cell in
        ``by_pos`` (flat position -> cell), its own tensor for a written argument (in-place and
        ``out=`` ops), anything else as the kernel returned it."""
        returns = facts.returns
        if not returns:
            return out
        rt = self.rt
        res = []
        pos = 0
        for (rk, is_list, key), o in zip(returns, (out,) if len(returns) == 1 else out):
            if rk == WRITTEN:
                res.append(written_argument(key, args, kwargs))
            elif is_list:
                res.append([_wrapped(v, rt, by_pos.get(pos + j)) for j, v in enumerate(o)])
            else:
                res.append(_wrapped(o, rt, by_pos.get(pos)))
            pos += len(o) if is_list else 1
        return res[0] if len(returns) == 1 else tuple(res)

    def _make_room(self, facts, func, args, kwargs) -> Any:
        """Evict for the op's outputs before it runs (inputs locked), when they may not fit.

        Note [Room before an op]
        ~~~~~~~~~~~~~~~~~~~~~~~~
        An op's outputs exist before the engine can evict for them, so enforcing the budget
        after each op lets the peak pass it by the op's outputs; near the limit, one large
        output (an LM head's logits) is what makes a GPU step fail. Where the headroom is at
        least the largest output this engine has made, no op is expected to pass the budget and
        nothing is done (the hot path's cost when the budget is far away: one comparison).
        Otherwise the outputs' size is found first (output_size.py: a shape rule or the meta
        device, cached per op and shapes) and the runtime evicts for it (``Runtime.reserve``).
        Until one of its blocks has ended, an engine has no largest output to compare with, so
        it sizes every op (``size_every_op``), at the price of a size lookup per op in that
        block: a first step is where a cap on device memory is hit (an LM head's logits, larger
        than any output before them, passed a GPU's cap). An engine with a plan does not
        (``plan=``): its first block profiles the segment's stages by the peaks of the engine's
        count, and room made before every op hides a stage's growth from them (evicting older
        storages first), so the seeded step replays more than its plan (tests/test_seeding.py's
        bounds). Later an
        output larger than any the engine has made (a longer sequence) is not anticipated: the
        peak can pass the budget by it once. The simulator repeats this rule for traces recorded
        without a budget (``dtr.sim.simulator.RoomBeforeOps``; tests/test_sim.py checks that
        the two agree), so a change here is a change there.
        Returns the size's key, for the caller to correct it by what the op made.
        """
        key, nbytes = output_size.output_bytes(func, args, kwargs)
        if nbytes:
            self.rt.reserve(nbytes, facts.name)
        return key

    # ------------------------------------------------------------------ executor

    def replay(self, rec):
        return replay(rec, self.estimate)

    # ------------------------------------------------------------------ handing data out

    def to_plain(self, w: DTRTensor, *, for_grad: bool = False) -> torch.Tensor:
        """``w``'s data as a plain tensor the program owns from now on.

        The storage stops being charged and evicted (state EXTERNAL). For a gradient that
        recorded ops still read, a copy is handed out instead, so that accumulating into
        ``.grad`` later cannot change what those ops replay.
        """
        rt = self.rt
        with rt.lock, _no_python_dispatch():
            rt.drain()
            ref = w._dtr
            cell = ref.cell = rt.resolve(ref.cell)
            s = cell.storage
            if for_grad and s.uses:
                rt.acquire([cell])
                try:
                    return cell.value.clone()
                finally:
                    rt.unlock([cell])
            return self.constants.hand_out(cell)

    # ------------------------------------------------------------------ lifecycle

    def close(self, failed: bool = False) -> int:
        """End of block (``failed``: an exception left it, ``Runtime.close``). Returns how many
        ops had to be replayed to define live tensors."""
        rt = self.rt
        with rt.lock, _no_python_dispatch():
            before = rt.counters.rematerializations
            try:
                rt.close(failed)
            finally:
                self._close_gradients()
                self.constants.clear()
            return rt.counters.rematerializations - before


def _wrapped(v, rt, cell):
    """A wrapper for an output with a cell; anything else (plain outputs, None) as it is."""
    return v if cell is None else make_wrapper(v, rt, cell)


native.bind_driver(Driver)  # native.py binds before this module defines Driver
