"""Ops on wrappers whose block has exited: they hold their data for good, so ops run eagerly
on it and return plain tensors (in-place and ``out=`` ops return the program's own objects)."""

from __future__ import annotations

import torch

from dtr.eager.ops import WRITTEN, facts_for

__all__ = ["run_escaped"]


def _plain(a, wrapper: type):
    if type(a) is wrapper:
        return a._plain()
    if type(a) in (list, tuple):
        return type(a)(_plain(b, wrapper) for b in a)
    return a


def run_escaped(wrapper: type, func, args, kwargs):
    """Run ``func`` eagerly on the plain values of the ``wrapper`` tensors (``DTRTensor``,
    passed in by its ``__torch_dispatch__``) among ``args`` and ``kwargs``."""
    out = func(*[_plain(a, wrapper) for a in args], **{k: _plain(v, wrapper) for k, v in kwargs.items()})
    returns = facts_for(func).returns
    if not any(rk == WRITTEN for rk, _, _ in returns):
        return out

    def original(key):
        pos, name = key
        return args[pos] if pos is not None else kwargs[name]

    if len(returns) == 1:
        return original(returns[0][2])
    return tuple(original(key) if rk == WRITTEN else o for (rk, _, key), o in zip(returns, out))
