"""The torch driver of a ``Runtime``: runs aten ops on managed tensors.

One op (``Driver.dispatch``, the hot path):

1. look up the op's cached facts (ops.py);
2. scan the arguments: wrappers of this engine become input cells (holes in a template),
   plain tensors are constants (never wrapped, never evicted), wrappers of other engines are
   read as plain values;
3. before an in-place op, protect what its writes would destroy: a written constant that a
   recorded op reads forces a flush; a written storage without lineage has its dependents
   made permanent (``Runtime.before_write``);
4. ``runtime.acquire`` the inputs (rematerializing as needed), make room for the outputs when
   the budget is close (Note [Room before an op]), run the kernel and time it;
5. ``runtime.complete`` the record (new storages, views, new versions), which evicts down to
   the budget;
6. wrap the outputs; in-place and ``out=`` ops return the program's own tensor objects.

Ops whose outputs alias a constant (``weight.t()``) return plain tensors: a view of a constant
is a constant. Collectives take a path of their own (collectives.py, Note [Collectives] in
ops.py), and a parameter's ``.grad`` made in the block is handed out plain but stays charged
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
from typing import Any, Dict, List, Optional

import torch

from dtr.eager import output_size, rng
from dtr.eager.constants import Constants
from dtr.eager.collectives import run_collective
from dtr.eager.cost import estimate_seconds
from dtr.eager.gradients import Gradients
from dtr.eager.host_copies import HostCopies
from dtr.eager.ops import FACTS, VIEW, WRITTEN, Kind, facts_for, program_returns, written_argument
from dtr.eager.replay import Call, fill, flat, replay
from dtr.eager.tensor import DTRTensor, make_wrapper
from dtr.engine import OpRecord, Runtime, State
from dtr.engine.collector import untrack
from dtr.errors import DTRError, OutOfBudgetError

__all__ = ["Driver"]

_Tensor = torch.Tensor
_EXTERNAL = State.EXTERNAL
_VIEW = Kind.VIEW
_WRITE = Kind.WRITE
_DETACH = Kind.DETACH
_COLLECTIVE = Kind.COLLECTIVE
_no_python_dispatch = torch._C._DisableTorchDispatch
_FIRST = (0,)
_strided = torch.strided
_ADD = torch.ops.aten.add.Tensor
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class Driver(Gradients, HostCopies):
    """Executes aten ops for one runtime and replays its records (it is the runtime's
    ``Executor``: ``replay`` here, ``forget`` the constant table's, swapping ``HostCopies``')."""

    views_alias_data = True  # torch views share their storage's memory

    def __init__(
        self,
        budget: Optional[int],
        heuristic,
        estimate: bool,
        runtime=Runtime,
        largest_output: int = 0,
        total: bool = False,
        outside: Optional[int] = None,
        constants_before: int = 0,
        max_recompute: Optional[float] = None,
    ) -> None:
        # ``budget`` is the user's limit. With ``dtr.budget(total=True)`` it also covers memory
        # the engine does not manage: ``outside`` bytes allocated on the device before the
        # block (CUDA), or, where no allocator counts them, the constants the block reads
        # (``count_constants``): as many as the engine's previous block read
        # (``constants_before``), more as new ones are first read. The runtime's budget is what
        # is left of the limit.
        Gradients.__init__(self)
        self.limit = budget
        counting = total and outside is None
        self.constants_before = constants_before if counting else 0
        self.outside = self.constants_before if counting else (outside or 0)
        managed = None if budget is None else budget - self.outside
        # ``runtime``: the Runtime class, or a factory with its signature (the trace recorder).
        # Untracked records: the block always closes the runtime (Note [Untracked records]).
        self.rt = runtime(managed, heuristic, self, untracked=True, max_recompute=max_recompute)
        self.rt.outside = self.outside
        self.estimate = estimate
        # The largest new storage an op of this engine made (Note [Room before an op]).
        self.largest_output = largest_output
        self.constants = Constants(self.rt, self._charge_constants)
        # Bound once, as the hot path calls them (one lookup per op); ``forget`` is the
        # runtime's ``Executor.forget``.
        self._use_constants = self.constants.use
        self.forget = self.constants.forget
        # ``Constants.count`` where constants read count against the limit, else None.
        self.count_constants = self.constants.count if counting else None
        self.ops = 0  # ops intercepted
        self.op_seconds = 0.0  # cost of the ops run for the program (not replays); plans profile it

    def set_limit(self, limit: Optional[int], opname: str = "set budget") -> None:
        """Change the user's limit: the runtime's budget becomes what is left of it beside the
        memory outside the engine (``__init__``). Raises ``OutOfBudgetError`` and keeps the old
        limit if the engine cannot evict down to it."""
        outside = self.rt.outside = self.outside
        if limit is not None and limit < outside:
            raise OutOfBudgetError(
                outside, limit, opname,
                f"{outside} bytes outside the engine count against the total limit "
                "(dtr.budget(total=True)): tensors from before the block.",
            )
        self.rt.set_budget(None if limit is None else limit - outside, opname)
        self.limit = limit

    def _charge_constants(self, nbytes: int, opname: str) -> None:
        """With ``count_constants``: ``nbytes`` of constants have been read (``Constants.count``);
        raises ``OutOfBudgetError`` (the op does not run) if the engine cannot evict down to what
        they leave of the limit (``__init__``)."""
        before = self.outside
        outside = max(self.constants_before, nbytes)
        if outside > before and self.limit is not None:
            self.outside = outside
            try:
                self.set_limit(self.limit, opname)
            except BaseException:  # the op does not run: as if they had not been read
                self.outside = self.rt.outside = before
                raise

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, func, args, kwargs):
        facts = FACTS.get(func)
        if facts is None:
            facts = facts_for(func)
        rt = self.rt
        with rt.lock:
            self.ops += 1
            if rt._dead:
                rt.drain()
            node = _current_node()
            if node is not self.node:
                if (node is None) is not (self.node is None):
                    rt.set_backward(node is not None)
                self.node = node
                self.node_from = rt.next_sid
            kind = facts.kind
            if kind is _VIEW or kind is _DETACH or kind is Kind.INPLACE_VIEW:
                base = args[facts.view_of]
                if type(base) is not DTRTensor or base._dtr.cell.storage.runtime is not rt:
                    if kind is Kind.INPLACE_VIEW and type(base) is not DTRTensor:
                        # Recorded ops hold this very tensor object, whose shape is about to
                        # change: as for a write, they must not be replayed after it.
                        self.constants.before_constants_written([base])
                    return self.passthrough(func, args, kwargs)
                if kind is _DETACH:
                    return self._alias(base)
                if kind is Kind.INPLACE_VIEW:
                    return self._inplace_view(facts, func, base, args, kwargs)
                if facts.one_view and not kwargs:
                    return self._run_view(facts, func, base, args)
            elif kind is Kind.UNSUPPORTED:
                self._unsupported(facts, args, kwargs)
                return self.passthrough(func, args, kwargs)
            elif kind is _COLLECTIVE:
                return run_collective(self, facts, args, kwargs)
            if facts.simple and not kwargs:
                if func is _ADD and len(args) == 2 and self._summing(args):
                    return self._sum(facts, args)
                return self._run_simple(facts, func, args)
            return self._run(facts, func, args, kwargs)

    def passthrough(self, func, args, kwargs):
        """Run ``func`` on plain values, returning plain results (nothing is recorded)."""
        vals = [self._plain(a) for a in args]
        kw = {k: self._plain(v) for k, v in kwargs.items()} if kwargs else {}
        out = func(*vals, **kw)
        facts = FACTS.get(func) or facts_for(func)
        if facts.kind is _WRITE or facts.kind is Kind.INPLACE_VIEW:
            return program_returns(facts, out, args, kwargs)
        return out

    def _plain(self, a):
        if isinstance(a, _Tensor):
            if type(a) is DTRTensor:
                return self._value_of(a)
            if a.requires_grad and a.is_leaf and id(a) not in self.hooks and a._base is None:
                self._hook(a)
            return a
        if type(a) in (list, tuple):
            return type(a)(self._plain(b) for b in a)
        return a

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

    def _alias(self, base: DTRTensor) -> DTRTensor:
        ref = base._dtr
        rt = self.rt
        cell = ref.cell = rt.resolve(ref.cell)
        if cell.value is None:
            rt.acquire([cell])
            rt.unlock([cell])
        return make_wrapper(cell.value, rt, cell)

    def _inplace_view(self, facts, func, base: DTRTensor, args, kwargs):
        """``x.unsqueeze_(0)`` and friends: ``x`` becomes a new view of the same storage."""
        if base.requires_grad:
            self._refuse_inplace_view_with_views(facts, base)
        twin = self._run(facts_for(facts.functional), facts.functional, args, kwargs)
        with _no_python_dispatch():
            func(base, *args[1:], **kwargs)  # updates the wrapper's own sizes and strides
        base._dtr.cell = twin._dtr.cell
        return base

    def _refuse_inplace_view_with_views(self, facts, base: DTRTensor) -> None:
        """Raise if ``base`` (which requires grad) is a view, or has a live view that requires
        grad. Changing its shape in place bumps the version its views share, and autograd then
        rebuilds their backward by replaying their view ops on the base as it is *now* for a
        tensor subclass (eager uses ``as_strided`` with each view's own strides): gradients
        come out wrong (``t()`` then ``transpose_``) or autograd raises. Scans the live
        wrappers, only when another one shares the storage (``matmul`` calls ``squeeze_`` on
        fresh results)."""
        views = base._base is not None
        if not views and self.rt.resolve(base._dtr.cell).storage.refs > 1:  # another wrapper
            for ref in list(self.rt._refs.values()):
                v = ref()
                if v is not None and v is not base and v._base is base and v.requires_grad:
                    views = True
                    break
        if views:
            raise DTRError(
                f"dtr: {facts.name} changes the shape of a tensor that requires grad and is a view "
                "or has one; autograd would rebuild those views' gradients wrongly for a tensor "
                "subclass. Use the out-of-place op (x = x.transpose(0, 1), x = x.unsqueeze(0), ...)"
            )

    def _unsupported(self, facts, args, kwargs) -> None:
        for a in list(args) + list(kwargs.values()):
            if type(a) is DTRTensor and a._dtr.cell.storage.runtime is self.rt:
                raise NotImplementedError(
                    f"dtr: {facts.name} replaces the storage of a tensor the engine manages, "
                    "which dtr does not support; use out-of-place ops (or dtr.materialize(t) to "
                    "get a plain tensor) inside the dtr.budget block"
                )

    def _sort_written(self, tensors, mutated: list, external_written: list, const_written: list) -> None:
        """Sort the tensors an op is about to write: storages of this engine (``mutated``, or
        ``external_written`` if handed out) and constants (``const_written``)."""
        rt = self.rt
        for t in tensors:
            if t is None:
                continue
            if type(t) is DTRTensor and t._dtr.cell.storage.runtime is rt:
                ref = t._dtr
                s = (ref.cell if ref.cell.storage.forward is None else rt.resolve(ref.cell)).storage
                if s.state is _EXTERNAL:
                    external_written.append(s)
                elif s not in mutated:
                    mutated.append(s)
            else:
                const_written.append(self._plain(t))

    def _run(self, facts, func, args, kwargs):
        rt = self.rt
        # -- writes (before scanning, so that input indices account for the old roots) ------
        mutated: List[Any] = []
        const_written: List[torch.Tensor] = []
        external_written: List[Any] = []
        if facts.written:
            for pos, name in facts.written:
                w = args[pos] if pos is not None else kwargs.get(name)
                self._sort_written(w if type(w) in (list, tuple) else (w,), mutated, external_written, const_written)
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

        # -- scan arguments ------------------------------------------------------------------
        # A view op's record keeps no dependency edges (its outputs live and die with its
        # base's storage), so only the base is a managed input; other tensors go by value.
        kind = facts.kind
        view_of = facts.view_of if kind is _VIEW else -1
        nv = len(mutated)
        inputs = [s.root for s in mutated]
        slots = []
        consts: List[torch.Tensor] = []
        targs = list(args)
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                if type(a) is DTRTensor:
                    ref = a._dtr
                    c = ref.cell
                    if c.storage.runtime is rt and (view_of < 0 or i == view_of):
                        if c.storage.forward is not None:
                            c = ref.cell = rt.resolve(c)
                        slots.append((i, -1, len(inputs)))
                        inputs.append(c)
                        targs[i] = None
                        continue
                    a = targs[i] = self._value_of(a)
                elif a.requires_grad and a.is_leaf and id(a) not in self.hooks and a._base is None:
                    self._hook(a)
                consts.append(a)
            elif type(a) in (list, tuple) and a:
                targs[i] = self._scan_list(a, i, inputs, slots, consts)
        if view_of >= 0:
            kwargs = {k: self._plain(v) for k, v in kwargs.items()} if kwargs else kwargs
        tkw = None
        if kwargs:
            tkw = dict(kwargs)
            for name, a in kwargs.items():
                if isinstance(a, _Tensor):
                    if type(a) is DTRTensor and a._dtr.cell.storage.runtime is rt:
                        ref = a._dtr
                        c = ref.cell = rt.resolve(ref.cell)
                        slots.append((name, -1, len(inputs)))
                        inputs.append(c)
                        tkw[name] = None
                        continue
                    a = tkw[name] = self._plain(a)
                    consts.append(a)
                elif type(a) in (list, tuple) and a:
                    tkw[name] = self._scan_list(a, name, inputs, slots, consts)

        # -- run --------------------------------------------------------------------------------
        state = None
        rt.acquire(inputs)
        try:
            if slots:
                args_v, kw_v = fill(targs, tkw, slots, lambda k: inputs[k].value)
            else:
                args_v, kw_v = targs, (tkw or {})
            if self.count_constants and consts:
                self.count_constants(consts, facts.name)
            sized = None
            if facts.sized and rt.budget is not None and rt.memory + self.largest_output > rt.budget:
                sized = self._make_room(facts, func, args_v, kw_v)
            state = rng.capture(args_v, kw_v) if facts.random else None
            grad = torch.is_grad_enabled()
            t0 = perf_counter()
            out = facts.kernel(*args_v, **kw_v)
            seconds = perf_counter() - t0
            if sized is not None:
                output_size.correct(sized, out, args_v, kw_v)
        except BaseException:
            rt.unlock(inputs)
            raise

        if facts.simple and isinstance(out, _Tensor):
            return self._one_output(facts, func, out, inputs, consts, targs, tkw, slots, state, grad, seconds, args_v, kw_v)

        # -- register outputs ---------------------------------------------------------------
        fresh = []
        fresh_pos = []
        same: Dict[int, Any] = {}  # output position -> input cell returned as it is
        returns = facts.returns
        if len(returns) == 1:
            pairs = ((returns[0], out),)
        else:  # several returns, or none (out is None: e.g. the profiler's record_function)
            pairs = zip(returns, out) if returns else ()
        pos = 0
        base_cell = inputs[nv] if kind is _VIEW else None
        plain = facts.plain_outputs
        for (rk, is_list, _), o in pairs:
            for v in (o if is_list else (o,)):
                if isinstance(v, _Tensor) and rk != WRITTEN and pos not in plain:
                    if type(v) is not _Tensor or v.layout is not _strided:
                        self.constants.hand_out_parts(v, inputs)  # returned plain (module docstring)
                    elif rk == VIEW:
                        fresh.append((0, v, base_cell))
                        fresh_pos.append(pos)
                    else:
                        c = _returned_input(v, inputs, consts)
                        if c is not None:
                            same[pos] = c
                        else:
                            nbytes = v.untyped_storage().nbytes()
                            # An empty output holds nothing to manage, and a one-element
                            # uninitialized one is a placeholder (ops.py, _PLACEHOLDERS): plain,
                            # they stay usable by code that swaps storages in (deepcopy,
                            # torch.load).
                            if nbytes and not (facts.placeholder and v.numel() <= 1):
                                fresh.append((nbytes, v, None))
                                fresh_pos.append(pos)
                                if nbytes > self.largest_output:
                                    self.largest_output = nbytes
                pos += 1
        if self.estimate:
            seconds = estimate_seconds(func, args_v, kw_v, flat(out))
        self.op_seconds += seconds
        replayable = not ((const_written and not facts.hidden_writes) or external_written)
        call = None
        if fresh or mutated:
            rec = call = Call(
                facts.name, inputs, seconds, replayable, func, tuple(targs), tkw, tuple(slots), grad
            )
            call.rng = state
            call.fresh = tuple(fresh_pos)
            if nv:
                call.versions = nv
                call.derive = {
                    k: mutated.index(inputs[k].storage)
                    for k in range(nv, len(inputs))
                    if inputs[k].storage in mutated
                } or None
            if facts.hidden_writes:
                self._strip_running_stats(facts, call)
        else:  # nothing to replay: only the dependency edges and the clock are recorded
            rec = OpRecord(facts.name, inputs, None, seconds, replayable)
        try:
            cells = rt.complete(rec, [(s, s.value) for s in mutated], fresh)
        except BaseException:
            if state is not None:
                rng.restore(state)
            raise
        if call is not None and replayable and consts:
            call.consts = self._use_constants(consts)
            untrack(call.args, call.consts)  # they hold tensors: Note [Untracked records]

        # -- wrap -----------------------------------------------------------------------------
        by_pos = dict(zip(fresh_pos, cells[nv:]))
        if same:
            by_pos.update(same)
        if len(returns) == 1:
            return self._wrap_return(returns[0], out, by_pos, 0, args, kwargs)[0]
        if not returns:
            return out
        res = []
        pos = 0
        for r, o in zip(returns, out):
            w, pos = self._wrap_return(r, o, by_pos, pos, args, kwargs)
            res.append(w)
        return tuple(res)

    def _run_simple(self, facts, func, args):
        """``_run`` for the common case: an op of ``facts.simple`` called without keyword
        arguments on tensors that are all defined, none in a list. It scans and unwraps the
        arguments in one pass; anything else goes to ``_run``, which handles every case."""
        rt = self.rt
        inputs: List[Any] = []
        slots = []
        consts: List[torch.Tensor] = []
        targs = list(args)
        vals = list(args)
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                if type(a) is DTRTensor:
                    ref = a._dtr
                    c = ref.cell
                    if c.storage.runtime is not rt:  # a wrapper from another block
                        return self._run(facts, func, args, {})
                    if c.storage.forward is not None:
                        c = ref.cell = rt.resolve(c)
                    if c.value is None:
                        return self._run(facts, func, args, {})
                    slots.append((i, -1, len(inputs)))
                    inputs.append(c)
                    targs[i] = None
                    vals[i] = c.value
                    continue
                if a.requires_grad and a.is_leaf and id(a) not in self.hooks and a._base is None:
                    self._hook(a)
                consts.append(a)
            elif type(a) in (list, tuple) and a:
                return self._run(facts, func, args, {})
        for c in inputs:
            c.storage.locks += 1
        if rt.arriving:
            rt.arrive(inputs)
        try:
            if self.count_constants and consts:
                self.count_constants(consts, facts.name)
            budget = rt.budget
            sized = None
            if budget is not None and rt.memory + self.largest_output > budget and facts.sized:
                sized = self._make_room(facts, func, vals, {})
            state = rng.capture(vals, {}) if facts.random else None
            grad = torch.is_grad_enabled()
            t0 = perf_counter()
            out = facts.kernel(*vals)
            seconds = perf_counter() - t0
            if sized is not None:
                output_size.correct(sized, out, vals, {})
        except BaseException:
            rt.unlock(inputs)
            raise
        return self._one_output(facts, func, out, inputs, consts, targs, None, slots, state, grad, seconds, vals, {})

    def _make_room(self, facts, func, args, kwargs) -> Any:
        """Evict for the op's outputs before it runs (inputs locked), when they may not fit.

        Note [Room before an op]
        ~~~~~~~~~~~~~~~~~~~~~~~~
        An op's outputs exist before the engine can evict for them, so enforcing the budget
        after each op lets the peak pass it by the op's outputs; near the limit, one large
        output (an LM head's logits) is what makes a GPU step fail. Where the headroom is at
        least the largest output this engine has made, no op is expected to pass the budget and
        nothing is done (the hot path's cost when the budget is far away: one comparison).
        Otherwise the outputs' size is found first (output_size.py: the meta device, cached per
        op and shapes) and the runtime evicts for it (``Runtime.reserve``). A first output larger
        than any before it is not anticipated: the peak can still pass the budget by it once.
        Returns the size's key, for the caller to correct it by what the op made.
        """
        key, nbytes = output_size.output_bytes(func, args, kwargs)
        if nbytes:
            self.rt.reserve(nbytes, facts.name)
        return key

    def _run_view(self, facts, func, base: DTRTensor, args):
        """``_run`` for a view op of ``facts.one_view`` called without keyword arguments: one
        pass, as ``_run_simple``. Views are a quarter of a model's ops (``t`` and ``view`` in
        every linear layer's backward), and ``_run`` made them dearer than compute ops
        (measured: ``y.t()`` cost 22 us more than eager, ``tanh`` 13.5)."""
        rt = self.rt
        ref = base._dtr
        c = ref.cell
        if c.storage.forward is not None:
            c = ref.cell = rt.resolve(c)
        if c.value is None:
            return self._run(facts, func, args, {})
        i = facts.view_of
        targs = list(args)
        targs[i] = None
        vals = list(args)
        vals[i] = c.value
        inputs = [c]
        c.storage.locks += 1
        if rt.arriving:
            rt.arrive(inputs)
        try:
            grad = torch.is_grad_enabled()
            t0 = perf_counter()
            out = facts.kernel(*vals)
            seconds = perf_counter() - t0
            if self.estimate:
                seconds = estimate_seconds(func, vals, {}, (out,))
        except BaseException:
            rt.unlock(inputs)
            raise
        self.op_seconds += seconds
        call = Call(facts.name, inputs, seconds, True, func, tuple(targs), None, ((i, -1, 0),), grad)
        call.fresh = _FIRST
        (cell,) = rt.complete(call, (), ((0, out, c),))
        return make_wrapper(out, rt, cell)

    def _one_output(self, facts, func, out, inputs, consts, targs, tkw, slots, state, grad, seconds, args_v, kw_v):
        """Registration for the common case (``facts.simple``): one new tensor, no writes.
        The general path below handles it too; this one skips its bookkeeping (measured:
        about a third of the per-op cost on small ops)."""
        rt = self.rt
        try:
            if type(out) is _Tensor and out.layout is _strided:
                c = _returned_input(out, inputs, consts)
                nbytes = out.untyped_storage().nbytes()
            else:  # returned plain (module docstring); inputs still locked, so resident
                self.constants.hand_out_parts(out, inputs)
                nbytes, c = 0, None
            if self.estimate:
                seconds = estimate_seconds(func, args_v, kw_v, (out,))
        except BaseException:
            rt.unlock(inputs)
            raise
        self.op_seconds += seconds
        if c is not None:
            rt.complete(OpRecord(facts.name, inputs, None, seconds), (), ())
            return make_wrapper(out, rt, c)
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

    def _scan_list(self, seq, where, inputs, slots, consts):
        rt = self.rt
        out = list(seq)
        for j, a in enumerate(seq):
            if isinstance(a, _Tensor):
                if type(a) is DTRTensor and a._dtr.cell.storage.runtime is rt:
                    ref = a._dtr
                    c = ref.cell = rt.resolve(ref.cell)
                    slots.append((where, j, len(inputs)))
                    inputs.append(c)
                    out[j] = None
                    continue
                a = out[j] = self._plain(a)
                consts.append(a)
        return out

    def _wrap_return(self, ret, o, by_pos, pos, args, kwargs):
        """The program's view of one schema return starting at flat position ``pos``."""
        rk, is_list, key = ret
        n = len(o) if is_list else 1
        if rk == WRITTEN:
            return written_argument(key, args, kwargs), pos + n
        rt = self.rt
        if is_list:
            return [_wrapped(v, rt, by_pos.get(pos + j)) for j, v in enumerate(o)], pos + n
        return _wrapped(o, rt, by_pos.get(pos)), pos + 1

    @staticmethod
    def _strip_running_stats(facts, call: Call) -> None:
        # In training mode batch norm's outputs do not depend on the running statistics, and
        # a replay must not update them a second time (ops.py, _HIDDEN_WRITES).
        if facts.replay_stats == "none":
            args = list(call.args)
            for i in facts.hidden_writes:
                args[i] = None
            call.args = tuple(args)
        else:
            call.clone_args = facts.hidden_writes

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

    def close(self) -> int:
        """End of block. Returns how many ops had to be replayed to define live tensors."""
        rt = self.rt
        with rt.lock, _no_python_dispatch():
            before = rt.counters.rematerializations
            try:
                rt.close()
            finally:
                self._close_gradients()
                self.constants.clear()
            return rt.counters.rematerializations - before


def _returned_input(v: torch.Tensor, inputs, consts) -> Any:
    """The input cell an op returned as it is although its schema promised a new tensor."""
    for c in inputs:
        if c.value is v:
            return c
    for t in consts:
        if t is v:
            raise DTRError(
                "dtr internal error: an op returned one of its constant inputs as a new tensor; "
                "please report the op"
            )
    return None


def _wrapped(v, rt, cell):
    """A wrapper for an output with a cell; anything else (plain outputs, None) as it is."""
    return v if cell is None else make_wrapper(v, rt, cell)

