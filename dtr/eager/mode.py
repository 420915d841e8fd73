"""``DTRMode``: the dispatch mode active inside a ``dtr.budget`` block.

A mode sees every op on the thread that entered the block, including ops on plain tensors
(factory functions, ``weight.t()``) and, when ``backward()`` runs inside the block, the
backward ops; autograd propagates it to its worker threads. Wrappers that outlive the block,
or reach a thread without the mode, dispatch through ``DTRTensor`` instead.

Note [Dynamo guard]
~~~~~~~~~~~~~~~~~~~
torch wraps every mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``, so that code
compiled with ``torch.compile`` never traces into a mode. That wrapper imports
``torch._dynamo`` on the first op: the first block of a process took ~1 s longer (2-core VM),
for ~120,000 more objects in the process. Dynamo can only be tracing if it has been imported,
so ``DTRMode`` opts out of torch's wrapper (a private flag; if torch drops it, its wrapper simply
comes back) and applies the same ``torch._dynamo.disable(recursive=True)`` itself, from the
first op after ``torch._dynamo`` appears in ``sys.modules`` on which this thread has a
frame-evaluation callback set: dynamo sets one while it compiles and while compiled code runs,
and only then can it trace into the mode; elsewhere the guard would only cost its two
``set_eval_frame`` calls (0.3-0.8 µs an op on the 2-core VM). A block under a budget sizes ops
(Note [Room before an op] in driver.py), and torch's meta kernels for most pointwise ops and
many others carry the same guard: the ops a training step runs most are sized by rules instead
(Note [Sizes without the meta device] in size_rules.py), and the first op sized on the meta
device that has such a kernel imports dynamo.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtr.errors import OutOfBudgetError

__all__ = ["DTRMode"]

_ident = threading.get_ident
_modules = sys.modules


def _always() -> bool:
    return True


# This thread's frame-evaluation callback: None unless dynamo is compiling or running compiled
# code on this thread; dynamo reads ``_compiling()`` as True where it traces (Note [Dynamo guard]).
_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
_compiling = getattr(torch.compiler, "is_compiling", None)
if _frame_callback is None or _compiling is None:  # no way to ask on this torch: always guarded
    _compiling = _always


class DTRMode(TorchDispatchMode):
    """Sends every op to the driver, except during ``optimizer.step()`` on the stepping
    thread, whose ops run untracked (optimizer state stays plain; see ``Driver``)."""

    _guarded = None  # __torch_dispatch__ under torch._dynamo.disable, made when dynamo loads

    def __init__(self, driver) -> None:
        super().__init__()
        self.driver = driver

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # guarded here instead (Note [Dynamo guard])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "torch._dynamo" in _modules and (_compiling() or _frame_callback() is not None):
            guarded = DTRMode._guarded
            if guarded is None:
                import torch._dynamo

                guarded = DTRMode._guarded = torch._dynamo.disable(_dispatch, recursive=True)
            return guarded(self, func, args, kwargs)
        return _dispatch(self, func, args, kwargs)


def _dispatch(mode: DTRMode, func, args, kwargs):
    d = mode.driver
    if d.suspended_thread is not None and d.suspended_thread == _ident():
        return d.passthrough(func, args, kwargs or {})
    try:  # free when nothing is raised (Python 3.11+), a few ns before
        return d.dispatch(func, args, kwargs or {})
    except OutOfBudgetError as e:  # it reaches the program here: engine.explain() tells why
        events = d.rt.events
        if events is not None:
            with d.rt.lock:
                events.raised(e, d.rt)
        raise
