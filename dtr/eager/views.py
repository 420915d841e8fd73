"""View ops on tensors the engine manages: a view of its only tensor, or a list of them, in
one pass, ``detach`` and ``alias``, and in-place changes of a tensor's view (``unsqueeze_``,
``transpose_``, ...).

A view is a cell of its base's storage (Note [Three levels] in core/storage.py): it adds no
bytes, its record keeps no dependency edges (it lives and dies with its base's storage), and
it is recomputed by replaying its op on the base. Views of constants are constants, returned
plain (``Driver.passthrough``).

``Views`` is mixed into ``Driver``, whose ``rt``, ``_run``, ``_register``, ``estimate`` and
``op_seconds`` it uses; ``Driver.dispatch`` sends it the view ops of this engine's tensors.
"""

from __future__ import annotations

from time import perf_counter

import torch

from dtr.eager import scattered
from dtr.eager.cost import estimate_seconds
from dtr.eager.native import FIRST as _FIRST, NO_KWARGS as _NO_KWARGS
from dtr.eager.ops import facts_for
from dtr.eager.replay import Call
from dtr.eager.tensor import DTRTensor, make_wrapper, unmade_wrapper
from dtr.errors import DTRError

__all__ = ["Views"]

_no_python_dispatch = torch._C._DisableTorchDispatch
_MM_NAME = str(scattered.MM)  # views of an outer product not yet made are deferred too


class Views:
    """The driver's view ops (module docstring)."""

    def _defer_view(self, facts, func, base: DTRTensor, args) -> DTRTensor:
        """A view of an outer product not yet made (``Runtime.defer``), left unmade too: a view
        cell without a value, laid out as the op lays out a meta stand-in of ``base`` (Note
        [Outer products] in scattered.py). Reading it makes the product and the view, as a
        replay."""
        rt = self.rt
        c = base._dtr.cell
        i = facts.view_of
        whole = torch.empty(c.storage.nbytes // base.element_size(), dtype=base.dtype, device="meta")
        vals = list(args)
        vals[i] = whole.as_strided(base.size(), base.stride(), base.storage_offset())
        stand_in = facts.kernel(*vals)
        targs = list(args)
        targs[i] = None
        seconds = estimate_seconds(func, vals, {}, (stand_in,), base.device.type)
        call = Call(facts.name, [c], seconds, True, func, tuple(targs), None, ((i, -1, 0),), torch.is_grad_enabled())
        call.fresh = _FIRST
        return unmade_wrapper(stand_in, base.device, rt, rt.defer_view(call, c))

    def _run_view(self, facts, func, base: DTRTensor, args):
        """A view op of ``facts.one_view``, or of ``facts.list_view`` (``split``, ``chunk``,
        ``unbind``, the ``unsafe_split`` of every ``LSTMCell`` and ``GRUCell`` step), called
        without keyword arguments, in one pass: its base is its only tensor, so it needs no
        scan, and its outputs no sort (``Driver._run`` takes it where the base is evicted). One
        ``Call`` whose outputs are views of the base's cell, and a wrapper, or a list of them;
        an empty list (``unbind`` of an empty dimension) gets the general registration
        (``Driver._register``). Views are a quarter of a model's ops (``t`` and ``view`` in
        every linear layer's backward), and the general path made them dearer than compute
        ops (measured: ``y.t()`` cost 22 us more than eager, ``tanh`` 13.5)."""
        rt = self.rt
        ref = base._dtr
        c = ref.cell
        if c.storage.forward is not None:
            c = ref.cell = rt.resolve(c)
        if c.value is None:
            if facts.one_view and rt.unmade and c.storage in rt.unmade and c.storage.parent.name == _MM_NAME:
                return self._defer_view(facts, func, base, args)
            return self._run(facts, func, args, {})
        i = facts.view_of
        many = facts.list_view
        targs = list(args)
        targs[i] = None
        vals = list(args)
        vals[i] = c.value
        inputs = [c]
        rt.acquire(inputs)  # defined: it only locks, and waits for a prefetch
        try:  # until complete or _register, which unlock whatever happens
            grad = torch.is_grad_enabled()
            t0 = perf_counter()
            out = facts.kernel(*vals)
            seconds = perf_counter() - t0
            empty = many and not out
            if not empty:
                if self.estimate:
                    seconds = estimate_seconds(func, vals, {}, out if many else (out,))
                self.op_seconds += seconds
                call = Call(facts.name, inputs, seconds, True, func, tuple(targs), None, ((i, -1, 0),), grad)
                call.fresh = tuple(range(len(out))) if many else _FIRST
                fresh = [(0, v, c) for v in out] if many else ((0, out, c),)
        except BaseException:
            rt.unlock(inputs)
            raise
        if empty:
            return self._register(facts, func, out, seconds, inputs, targs, None, [(i, -1, 0)], [], grad, None,
                                  vals, _NO_KWARGS, args, _NO_KWARGS, [], True)
        cells = rt.complete(call, (), fresh)
        if not many:
            return make_wrapper(out, rt, cells[0])
        return [make_wrapper(v, rt, cell) for v, cell in zip(out, cells)]

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
