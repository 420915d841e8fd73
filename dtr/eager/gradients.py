"""Gradients in a block: each parameter's ``.grad`` kept plain and charged, gradients summed in
place as eager sums them, and the optimizer step, which changes the parameters that recorded
ops read.

- A parameter read in the block (a leaf that requires grad) gets a post-accumulate-grad hook
  (``_hook``) the first time the driver sees it: its ``.grad`` made in the block is handed to
  the program plain, since optimizers, clipping and DDP must see plain tensors, and its bytes
  stay charged until the block ends (Note [Held gradients] in runtime.py).
- ``aten.add.Tensor`` inside a backward pass may be autograd summing gradients; where nothing
  else can see the accumulator it runs in place (Note [Accumulation in place] in
  accumulation.py, which holds the tests it relies on).
- A gradient scattered into zeros (the backward of ``x[:, t]`` or an embedding lookup), or an
  outer product (a weight's gradient from one row), is recorded without being made, and summed
  into its running sum without being made (Notes [Scattered gradients] and [Outer products] in
  scattered.py).
- ``optimizer.step()`` flushes all lineage first (recorded ops that read the parameters could
  not be replayed afterwards) and its ops run untracked on the stepping thread, as do a
  library's own gradient and parameter management (``untracked``; FSDP2).

``Gradients`` is mixed into ``Driver``, whose ``rt``, ``_run``, ``_scan``, ``to_plain``,
``estimate``, ``count_constants`` and ``op_seconds`` it uses;
``Driver.dispatch`` keeps ``node`` and ``node_from`` up to date.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from time import perf_counter
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from dtr.eager import accumulation, scattered
from dtr.eager.cost import estimate_seconds
from dtr.eager.native import FIRST as _FIRST
from dtr.eager.ops import facts_for
from dtr.eager.replay import Call, fill
from dtr.eager.tensor import DTRTensor, make_wrapper, unmade_wrapper
from dtr.core import OpRecord, State, Storage
from dtr.core.collector import untrack

__all__ = ["Gradients"]

_Tensor = torch.Tensor
_EXTERNAL = State.EXTERNAL
_RESIDENT = State.RESIDENT
_no_python_dispatch = torch._C._DisableTorchDispatch
_ADD = torch.ops.aten.add.Tensor
_ADD_ = torch.ops.aten.add_.Tensor
_ADD_FACTS = facts_for(_ADD_)  # every in-place sum runs it
_CLONE = torch.ops.aten.clone.default
_CLONE_FACTS = facts_for(_CLONE)
_graph_task_id = torch._C._current_graph_task_id


class Gradients:
    """The driver's gradient handling (module docstring)."""

    def __init__(self) -> None:
        self.hooks: Dict[int, Any] = {}  # id(leaf) -> post-accumulate-grad hook handle
        self._plain_grad = self._on_grad_accumulated  # the hook, bound once (_hook)
        self.suspended_thread: Optional[int] = None  # whose ops run untracked (optimizer.step())
        # The autograd node running (backward), and the first storage id made while it runs:
        # what was made before it is no temporary of its formula (``_in_place``).
        self.node = None
        self.node_from = 0
        # Outer products recorded without being made -> their (rows, columns) (``_scattered``).
        self.products: "weakref.WeakKeyDictionary[Storage, Tuple[int, int]]" = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ parameters' .grad

    def _hook(self, leaf: torch.Tensor) -> None:
        """Keep ``leaf.grad`` a plain tensor: optimizers and checkpoints must never see
        engine-owned tensors (feasibility Q1). Views of leaves (``w.t()`` built in backward is a
        leaf view that requires grad) never accumulate gradients and get no hook."""
        # One bound method for every leaf: a closure per leaf was two more objects per
        # parameter and block for the cyclic collector (docs/runtime.md).
        self.hooks[id(leaf)] = leaf.register_post_accumulate_grad_hook(self._plain_grad)

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        g = param.grad
        rt = self.rt
        # A gradient with a graph (backward(create_graph=True)) stays the engine's: a plain copy
        # would drop the graph a gradient penalty differentiates through.
        if type(g) is DTRTensor and g._dtr.cell.storage.runtime is rt and not rt.closed and g.grad_fn is None:
            plain = param.grad = self.to_plain(g, for_grad=True)
            with rt.lock:  # Note [Held gradients] in runtime.py
                rt.hold(id(param), plain.untyped_storage().nbytes())

    def hold_gradient(self, key: torch.Tensor, grads: List[Optional[torch.Tensor]]) -> None:
        """Charge ``grads`` (plain tensors, or DTensors counted by their local shard) under
        ``key``'s identity in place of what it held (Note [Held gradients] in runtime.py): a
        library that moves a gradient elsewhere (FSDP2 reducing it to its shard) says so here."""
        nbytes = 0
        for g in grads:
            if g is not None:
                local = g.to_local() if hasattr(g, "to_local") else g
                # Its own bytes: FSDP2's sharded gradients are views into one flat buffer per
                # parameter group, which would be charged once per parameter by storage.
                nbytes += local.numel() * local.element_size()
        rt = self.rt
        if nbytes or id(key) in rt.held:
            with rt.lock:
                rt.hold(id(key), nbytes)

    # ------------------------------------------------------------------ sums

    def _summing(self, args) -> bool:
        """Whether ``aten.add.Tensor(old, new)`` is autograd summing gradients into ``old``: a
        backward pass, grad mode off, ``old`` a wrapper of this engine with ``new``'s shape,
        dtype and device (Note [Accumulation in place] in accumulation.py)."""
        old, new = args
        if (
            type(old) is not DTRTensor
            or not isinstance(new, _Tensor)
            or new is old
            or torch.is_grad_enabled()
            or _graph_task_id() == -1
        ):
            return False
        rt = self.rt
        ref = old._dtr
        c = ref.cell
        if c.storage.runtime is not rt:
            return False
        if c.storage.forward is not None:
            ref.cell = rt.resolve(c)
        return old.shape == new.shape and old.dtype == new.dtype and old.device == new.device

    def _in_place(self, args) -> bool:
        """Whether nothing but autograd's buffer can see a write to ``args[0]``.

        Reads it through ``args`` only, binding no name to it: the exclusivity test counts
        references (``accumulation.exclusive``), and the counts must be those the native path
        (hotpath.c) sees, whichever path measured them (``calibrate``)."""
        s = args[0]._dtr.cell.storage
        if self.node is None or s.sid >= self.node_from:
            # Made while this node runs: a temporary of its backward formula, which C++ may read
            # again, not a gradient autograd's buffer holds (counts cannot tell them apart).
            return False
        if s.refs != 1 or s.state is _EXTERNAL or (s.uses and not s.recomputable):
            # The last: a write would make what reads it permanent first (before_write).
            return False
        # The whole of its storage, densely (a weight's gradient often arrives transposed).
        if args[0].numel() * args[0].element_size() != s.nbytes or not accumulation.dense(args[0]):
            return False
        return accumulation.exclusive(args)

    def _sum(self, facts, args) -> Any:
        """``old + new`` for autograd: as ``old.add_(new)`` (a new wrapper over the new version
        of ``old``'s storage, or over ``old``'s cell when that storage is already a permanent
        sum) where nothing else can see the write, out of place otherwise;
        made permanent when it is a parameter's gradient or extends a chain of sums."""
        return self._sum_as(facts, args, self._in_place(args))  # before ``old`` is bound

    def _sum_as(self, facts, args, in_place: bool) -> Any:
        """``_sum`` once ``_in_place(args)`` is known (the native path tests it itself where
        ``old``'s storage is a permanent sum, and asks no second time)."""
        rt = self.rt
        s = args[0]._dtr.cell.storage
        chained = accumulation.summed(s)
        if in_place:
            if s.parent is None:  # a running sum already permanent (Note [Accumulation in place])
                return self._add_to_permanent(args)
            if not s.uses and self._scattered(args[1]) is not None:
                # Note [Scattered gradients]: the part is written into the storage itself.
                rt.make_permanent([s.root], yielding=True)
                return self._add_to_permanent(args)
            old = args[0]
            self._run(_ADD_FACTS, _ADD_, args, {})
            ref = old._dtr
            cell = ref.cell = rt.resolve(ref.cell)
            out = make_wrapper(old, rt, cell)
        else:
            old = args[0]
            new = args[1]
            # ``old`` from autograd's buffer, not a temporary of the running node's formula (as
            # in ``_in_place``): the copy is made permanent. ``new`` before its strides: it may
            # be a plain tensor of another layout, without them.
            if (
                self.node is not None
                and s.sid < self.node_from
                and self._scattered(new) is not None
                and old.stride() == new.stride()
                and accumulation.dense(old)
            ):
                return self._sum_into_copy(old, new)
            out = self._run(facts, _ADD, args, {})
            if type(out) is not DTRTensor:
                return out
            cell = out._dtr.cell
        if (chained or accumulation.into_leaf(old, self.node)) and cell.storage.state is _RESIDENT:
            rt.make_permanent([cell], yielding=True)
        return out

    def _sum_into_copy(self, old: DTRTensor, new: DTRTensor) -> DTRTensor:
        """``old + new`` out of place where ``new`` is deferred and laid out as ``old``, densely:
        a copy of ``old``, made permanent, with ``new`` added into it without being made. The
        copy keeps ``old``'s layout, which is the sum's where both operands share it. Where
        ``old`` is an outer product not yet made either (a weight's first two: Note [Outer
        products] in scattered.py), the copy is made by running its op again, into a new
        storage: the sum then holds one product's bytes where eager's holds three."""
        first = self._scattered(old)
        if first is not None and first[0].func is scattered.MM and not first[1]:
            out = self._remade(first[0], old._dtr.cell.storage.nbytes)
        else:
            out = self._run(_CLONE_FACTS, _CLONE, (old,), {})
            self.rt.make_permanent([out._dtr.cell], yielding=True)
        return self._add_to_permanent((out, new))

    def _remade(self, rec: Call, nbytes: int) -> DTRTensor:
        """A new permanent storage of ``nbytes`` holding what the deferred ``rec`` would make
        (the same op on the same inputs: the same bits), its own lineage left unmade."""
        rt = self.rt
        inputs = list(rec.inputs)
        rt.acquire(inputs)
        try:
            if rt.budget is not None:  # Note [Room before an op] in driver.py
                rt.reserve(nbytes, rec.name)
            vals, _ = fill(rec.args, None, rec.slots, lambda k: inputs[k].value)
            t0 = perf_counter()
            value = rec.func(*vals)
            seconds = perf_counter() - t0
            if self.estimate:
                seconds = estimate_seconds(rec.func, vals, {}, (value,))
        except BaseException:
            rt.unlock(inputs)
            raise
        self.op_seconds += seconds
        # Never replayed: made permanent at once, so the record keeps none of its inputs.
        made = OpRecord(rec.name, inputs, None, seconds, False)
        (cell,) = rt.complete(made, (), ((value.numel() * value.element_size(), value, None),))
        out = make_wrapper(value, rt, cell)  # first: a storage nothing refers to is released
        rt.make_permanent([cell], yielding=True)
        return out

    def _add_to_permanent(self, args) -> DTRTensor:
        """``old.add_(new)`` where ``old``'s storage is permanent and ``_in_place`` holds, so
        that nothing replayable reads it: the write needs no new version (Note [Accumulation
        in place]). The kernel writes the storage's value; the engine records an op that makes
        nothing (its clock, the inputs' last access, the cost), and the program gets a new
        wrapper over ``old``'s cell, as for an op that returns its input. A scattered ``new``
        not yet made is added without making it (``_add_scattered``)."""
        deferred = self._scattered(args[1])
        if deferred is not None:
            out = self._add_scattered(args[0], *deferred)
            if out is not None:
                return out
        rt = self.rt
        inputs: List[Any] = []
        slots: List[Any] = []
        consts: List[torch.Tensor] = []
        targs = list(args)
        vals = list(args)
        defined = self._scan(enumerate(args), targs, vals, inputs, slots, consts, None)
        rt.acquire(inputs)
        try:
            if not defined:
                vals, _ = fill(targs, None, slots, lambda k: inputs[k].value)
            if self.count_constants and consts:
                self.count_constants(consts, _ADD_FACTS.name)
            t0 = perf_counter()
            out = _ADD_FACTS.kernel(*vals)
            seconds = perf_counter() - t0
            if self.estimate:
                seconds = estimate_seconds(_ADD_, vals, {}, (out,))
        except BaseException:
            rt.unlock(inputs)
            raise
        self.op_seconds += seconds
        rt.complete(OpRecord(_ADD_FACTS.name, inputs, None, seconds), (), ())
        return make_wrapper(out, rt, inputs[0])

    # ------------------------------------------------------------------ scattered gradients

    def _defer(self, facts, func, args) -> Optional[DTRTensor]:
        """Record a scattered gradient or an outer product without making it (Notes [Scattered
        gradients] and [Outer products] in scattered.py): a wrapper over a storage born evicted,
        or None where the op must run."""
        g = args[0]
        rt = self.rt
        if type(g) is not DTRTensor or g._dtr.cell.storage.runtime is not rt or torch.is_grad_enabled():
            return None
        size = scattered.deferred_size(func, args)
        if size is None:
            return None
        inputs: List[Any] = []
        slots: List[Any] = []
        consts: List[torch.Tensor] = []
        targs = list(args)
        self._scan(enumerate(args), targs, list(args), inputs, slots, consts, None)
        if self.count_constants and consts:
            self.count_constants(consts, facts.name)
        stand_in = torch.empty(size, dtype=g.dtype, device="meta")
        # Estimated on the arguments' shapes (the wrappers), whether or not the gradient is resident.
        seconds = estimate_seconds(func, args, {}, (stand_in,), g.device.type)
        call = Call(facts.name, inputs, seconds, True, func, tuple(targs), None, tuple(slots), False)
        call.fresh = _FIRST
        s = rt.defer(call, stand_in.numel() * stand_in.element_size())
        if func is scattered.MM:
            self.products[s] = (size[0], size[1])
        if consts:
            call.consts = self._use_constants(consts)
            untrack(call.args, call.consts)  # they hold tensors: Note [Untracked records]
        return unmade_wrapper(stand_in, g.device, rt, s)

    def _scattered(self, new) -> Optional[Tuple[Call, bool]]:
        """The deferred op whose output ``new`` is, while that output has never been made (it
        reads the op's inputs, which its lineage keeps recomputable), and whether ``new`` is its
        transpose (an outer product's, read through views); else None."""
        c = new._dtr.cell if type(new) is DTRTensor else None
        s = c.storage if c is not None else None
        rt = self.rt
        if s is None or s.runtime is not rt or not rt.unmade or s not in rt.unmade or s.forward is not None:
            # Made once (then evicted, it is rebuilt: only ``deferred_size`` vouches for the op's
            # arguments), or written in place since (Note [Versions]): another value.
            return None
        rec = s.parent
        if type(rec) is not Call or rec.name not in scattered.DEFERRED:
            return None
        if c is s:
            return rec, False
        if rec.func is not scattered.MM or new.storage_offset():
            return None
        # A view laid over the product as the product itself, or as its transpose.
        m, n = self.products[s]
        if new.shape == (m, n) and new.is_contiguous():
            return rec, False
        if new.shape == (n, m) and new.t().is_contiguous():
            return rec, True
        return None

    def _add_scattered(self, old: DTRTensor, rec: Call, transposed: bool) -> Optional[DTRTensor]:
        """``old += rec``'s output (or its transpose), where ``old``'s storage is a permanent
        running sum, without making the output (``scattered.add_into``); None, changing nothing,
        where that cannot be exact."""
        rt = self.rt
        total = old._dtr.cell
        inputs = [total, *rec.inputs]
        rt.acquire(inputs)
        try:
            vals, _ = fill(rec.args, None, rec.slots, lambda k: rec.inputs[k].value)
            scratch = scattered.scratch_bytes(rec.func, vals)
            # Where its working memory does not fit, the output is made instead (and refused
            # loudly if that does not fit either): never a silent pass of the budget.
            fits = not scratch or rt.reserve_scratch(scratch, _ADD_FACTS.name)
            value = total.value
            t0 = perf_counter()
            done = fits and scattered.add_into(value, rec.func, vals, transposed)
            seconds = perf_counter() - t0
            if self.estimate:  # costed as the whole sum it stands for
                seconds = estimate_seconds(_ADD_, (value, value), {}, (value,))
        except BaseException:
            rt.unlock(inputs)
            raise
        if not done:
            rt.unlock(inputs)
            return None
        self.op_seconds += seconds
        rt.complete(OpRecord(_ADD_FACTS.name, inputs, None, seconds), (), ())
        return make_wrapper(value, rt, total)

    # ------------------------------------------------------------------ optimizer step

    def begin_optimizer_step(self) -> None:
        """Parameters are about to change: recorded ops that read them cannot be replayed.
        Make live tensors resident and drop all lineage; run the step untracked."""
        rt = self.rt
        with rt.lock, _no_python_dispatch():
            rt.drain()
            rt.flush()
        self.suspended_thread = threading.get_ident()

    def end_optimizer_step(self) -> None:
        self.suspended_thread = None

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Run the ops inside on plain values, unrecorded, on this thread: a library's own
        management of parameters and gradients (FSDP2's gathers and reductions) is not
        activations, and its buffers must stay plain tensors."""
        before = self.suspended_thread
        self.suspended_thread = threading.get_ident()
        try:
            yield
        finally:
            self.suspended_thread = before

    def _close_gradients(self) -> None:
        """The block's end: the hooks go, and nothing runs untracked any more."""
        for h in self.hooks.values():
            h.remove()
        self.hooks.clear()
        self.node = None
        self.suspended_thread = None
