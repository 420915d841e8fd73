"""How a recorded op is run again: the ``Call`` record and the helpers that replay it.

A ``Call`` is the engine's record of one aten op (an ``OpRecord``, so that the engine keeps one
object per op, not a record and its payload: every object it keeps costs time in the cyclic
collector's full passes, docs/runtime.md) plus what replaying it needs: a template of the op's
arguments with holes (``slots``) where managed tensors went. A slot names an index into the
record's ``inputs``, never a cell, so a record can be re-targeted at a new version of its
input (``translate`` in core/storage.py, ``Call.retarget``) by swapping inputs alone.

Replays restore what the op depended on besides its arguments (Invariant 4):
- the random state, for ops tagged ``nondeterministic_seeded`` (rng.py);
- the grad mode (``mkldnn_rnn_layer`` returns its workspace only with grad enabled);
- for an in-place op, the *old* contents of the storages it wrote: each is cloned from the
  previous version (Note [Versions]) and the op is applied to the clone;
- batch norm's running statistics are not touched again (ops.py, ``_HIDDEN_WRITES``).
"""

from __future__ import annotations

import contextlib
from time import perf_counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dtr.eager import rng
from dtr.eager.cost import estimate_seconds
from dtr.core import OpRecord
from dtr.errors import DTRError

__all__ = ["Call", "clone_root", "flat", "fill", "replay", "derive", "own_dispatch"]

_no_python_dispatch = torch._C._DisableTorchDispatch
_Tensor = torch.Tensor
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)
_below_autograd = torch._C._AutoDispatchBelowADInplaceOrView
# Autocast runs above Python dispatch: an op the engine saw was cast already, so its replay
# must not be cast again where the read that triggers it runs under an autocast (a read
# outside dispatch: ``dtr.materialize``, a failed block's tensors read afterwards). Excludes
# every Autocast dispatch key, whichever device.
_no_autocast = torch._C._DisableAutocast


class Call(OpRecord):
    """The record of one aten op, with what replaying it needs (see module docstring)."""

    __slots__ = (
        "func",
        "args",
        "kwargs",
        "slots",
        "rng",
        "grad",
        "versions",
        "derive",
        "fresh",
        "consts",
        "clone_args",
    )

    def __init__(
        self,
        name: str,
        inputs: list,
        cost: float,
        replayable: bool,
        func,
        args: tuple,
        kwargs: Optional[dict],
        slots: tuple,
        grad: bool,
    ) -> None:
        OpRecord.__init__(self, name, inputs, None, cost, replayable)
        self.func = func
        self.args = args  # a tuple: the collector stops tracking one that holds no tensor
        self.kwargs = kwargs
        self.slots = slots  # (arg position or kwarg name, list index or -1, input index)
        self.rng = None
        self.grad = grad
        self.versions = 0  # inputs[:versions] are the old roots of storages written in place
        self.derive: Optional[Dict[int, int]] = None  # input index -> written storage index
        self.fresh: Tuple[int, ...] = ()  # positions in flat(result) of the fresh outputs
        # storage key, tensor, version of each constant argument, flat (one object less)
        self.consts: tuple = ()
        self.clone_args: Tuple[int, ...] = ()  # constant arguments a replay must not write

    def retarget(self, inputs: list) -> "Call":
        c = Call(self.name, inputs, self.cost, self.replayable, self.func, self.args, self.kwargs,
                 self.slots, self.grad)
        c.rng, c.versions, c.derive, c.fresh = self.rng, self.versions, self.derive, self.fresh
        c.consts, c.clone_args = self.consts, self.clone_args
        return c


@contextlib.contextmanager
def _subclass_dispatch():
    """Modes set aside and Python dispatch on, also where a caller had turned it off
    (``dtr.materialize``, the block's end and ``optimizer.step()`` replay under
    ``_DisableTorchDispatch``)."""
    exclude = torch._C._dispatch_tls_local_exclude_set() - _PYTHON_KEYS
    with _disable_current_modes(), torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(), exclude
    ):
        yield


def own_dispatch(t: torch.Tensor) -> bool:
    """Whether ``t`` is of a tensor subclass with a ``__torch_dispatch__`` of its own."""
    return type(t) is not _Tensor and type(t).__torch_dispatch__ is not _PLAIN_DISPATCH


def flat(out: Any) -> List[Any]:
    """The op's results as one list (tuples and lists of tensors flattened one level)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        items: List[Any] = []
        for o in out:
            if isinstance(o, (tuple, list)):
                items.extend(o)
            else:
                items.append(o)
        return items
    return [out]


def fill(template: Sequence[Any], kwargs: Optional[dict], slots, value_of) -> Tuple[list, dict]:
    """Copies of the templates with every slot set to ``value_of(input index)``."""
    args = list(template)
    kw = dict(kwargs) if kwargs else {}
    copied = set()
    for i, j, k in slots:
        v = value_of(k)
        box = kw if type(i) is str else args
        if j < 0:
            box[i] = v
        else:
            if (i, "list") not in copied:
                box[i] = list(box[i])
                copied.add((i, "list"))
            box[i][j] = v
    return args, kw


def clone_root(value: torch.Tensor) -> torch.Tensor:
    """A copy of ``value``'s whole storage, viewed exactly like ``value``."""
    storage = value.untyped_storage().clone()
    return value.new_empty((0,)).set_(storage, value.storage_offset(), value.size(), value.stride())


def derive(cell, root_value: torch.Tensor) -> torch.Tensor:
    """``cell``'s view, taken from ``root_value`` instead of its storage's root."""
    chain = []
    c = cell
    root = c.storage.root
    while c is not root:
        chain.append(c)
        c = c.parent.inputs[0]
    v = root_value
    for c in reversed(chain):
        p = c.parent
        args, kw = fill(p.args, p.kwargs, p.slots, lambda k, v=v: v)
        v = flat(p.func(*args, **kw))[c.index]
    return v


def replay(rec, estimate: bool) -> Tuple[Sequence[Any], float]:
    """Run ``rec`` again (see module docstring). Returns output values and cost in seconds.

    A replay runs where the original kernel ran: below autograd and autocast (a replay can be
    triggered from outside dispatch: a hook, ``dtr.materialize``, autograd unpacking a saved
    tensor) and under the recorded grad mode, for every kernel it calls, view derivations
    included.
    """
    inputs = rec.inputs
    consts = rec.consts
    # Python dispatch is off, so that the replay does not enter dtr's mode again; unless a
    # constant is a subclass that needs its own __torch_dispatch__ (without it the kernel
    # reads a wrapper with no data: a crash), and then only the modes are set aside.
    guard = _no_python_dispatch
    for j in range(1, len(consts), 3):
        if own_dispatch(consts[j]):
            guard = _subclass_dispatch
            break
    with guard(), _below_autograd(), _no_autocast(), torch.set_grad_enabled(rec.grad):
        clones = [clone_root(inputs[m].value) for m in range(rec.versions)]
        if rec.derive:
            deriv = rec.derive

            def value_of(k):
                m = deriv.get(k)
                return inputs[k].value if m is None else derive(inputs[k], clones[m])

        else:

            def value_of(k):
                return inputs[k].value

        args, kw = fill(rec.args, rec.kwargs, rec.slots, value_of)
        for i in rec.clone_args:
            args[i] = args[i].clone()
        for j in range(1, len(consts), 3):
            if consts[j]._version != consts[j + 1]:
                raise DTRError(
                    f"dtr: cannot recompute {rec.name}: one of its inputs, a tensor created "
                    "outside the dtr.budget block, was modified in place without dtr seeing it "
                    "(e.g. from another thread). Modify such tensors only between blocks, or "
                    "through ordinary in-place ops."
                )
        with rng.restored(rec.rng) if rec.rng is not None else contextlib.nullcontext():
            t0 = perf_counter()
            out = rec.func(*args, **kw)
            seconds = perf_counter() - t0
        results = flat(out)
        if estimate:
            seconds = estimate_seconds(rec.func, args, kw, results)
    return clones + [results[i] for i in rec.fresh], seconds
