"""``DTRMode``: the dispatch mode active inside a ``dtr.budget`` block.

A mode sees every op on the thread that entered the block, including ops on plain tensors
(factory functions, ``weight.t()``) and, when ``backward()`` runs inside the block, the
backward ops; autograd propagates it to its worker threads. Wrappers that outlive the block,
or reach a thread without the mode, dispatch through ``DTRTensor`` instead.
"""

from __future__ import annotations

import threading

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DTRMode"]

_ident = threading.get_ident


class DTRMode(TorchDispatchMode):
    """Sends every op to the driver, except during ``optimizer.step()`` on the stepping
    thread, whose ops run untracked (optimizer state stays plain; see ``Driver``)."""

    def __init__(self, driver) -> None:
        super().__init__()
        self.driver = driver

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        d = self.driver
        if d.suspended_thread is not None and d.suspended_thread == _ident():
            return d.passthrough(func, args, kwargs or {})
        return d.dispatch(func, args, kwargs or {})
