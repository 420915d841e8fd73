"""Ops on wrappers whose block has exited: they hold their data for good, so ops run eagerly
on it and return plain tensors (in-place and ``out=`` ops return the program's own objects)."""

from __future__ import annotations

from dtr.eager.ops import facts_for, program_returns

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
    return program_returns(facts_for(func), out, args, kwargs)
