"""How many bytes an op's new outputs will take, before it runs.

The driver makes room for an op's outputs before the kernel runs when the budget is close
(``Runtime.reserve``), so that the op does not pass the budget by its outputs; an LM head's
logits are the op that makes a GPU step fail near the limit. Sizes come from a rule for the
ops a training step runs most (size_rules.py), else from running the op on the meta device
(shapes and dtypes only, no data, no random numbers drawn), cached by the op and its
arguments' shapes and dtypes: a training loop runs the same ops on the same shapes
every step, so after the first step a lookup is the whole cost. Where an op's real outputs
turn out larger than sized (``mkldnn_rnn_layer``'s workspace), the driver corrects the entry
(``correct``), so that the next step makes enough room. Once a real run made no more than a
sized entry, the entry is settled: the same shapes and dtypes make the same sizes, so its later
runs are not measured again (``correct`` costs about as much as the lookup). Entries that could
not be sized (data-dependent shapes) never settle.

What this cannot see: memory a kernel allocates for itself and frees before it returns
(convolution and matmul workspaces, cuBLAS/cuDNN scratch). No dispatch mode sees it, so it is
never charged; the true peak can pass the budget by that much.
"""

from __future__ import annotations

from typing import Any, Dict, Set, Tuple

import torch

from dtr.eager.size_rules import rule_bytes

__all__ = ["correct", "flat_tensors", "output_bytes"]

_Tensor = torch.Tensor
_no_python_dispatch = torch._C._DisableTorchDispatch
_SIZES: Dict[Tuple[Any, ...], int] = {}
_SETTLED: Set[Tuple[Any, ...]] = set()  # a real run made no more than the size found
_UNSIZED: Set[Tuple[Any, ...]] = set()  # no size could be found for them
_META = torch.device("meta")
_MAX_ENTRIES = 100_000  # a model with ever-new shapes must not grow the cache without end


def output_bytes(func, args, kwargs) -> Tuple[Any, int]:
    """Bytes of the tensors ``func(*args, **kwargs)`` would return that are not its arguments
    (0 where the meta device cannot tell: data-dependent shapes, ops without a meta kernel),
    and the key to ``correct`` them by (None where the arguments cannot be hashed, or the
    entry is settled)."""
    try:
        key = (func, _signature(args), _signature(tuple(kwargs.items())) if kwargs else None)
        n = _SIZES.get(key)
    except TypeError:  # an argument that cannot be hashed: estimate without caching
        return None, _sized(func, args, kwargs)
    if n is None:
        if len(_SIZES) >= _MAX_ENTRIES:
            _SIZES.clear()
            _SETTLED.clear()
            _UNSIZED.clear()
        n = _SIZES[key] = _sized(func, args, kwargs)
        if not n:
            _UNSIZED.add(key)
    elif key in _SETTLED:
        return None, n
    return key, n


def correct(key, out, args, kwargs) -> None:
    """The op ``output_bytes`` gave ``key`` for returned ``out`` from ``args`` and ``kwargs``:
    remember the bytes of its new storages if they are more than estimated."""
    if key is None:
        return
    given = {id(t) for t in flat_tensors(list(args)) + flat_tensors(list(kwargs.values()))}
    made = sum(
        t.untyped_storage().nbytes()
        for t in flat_tensors(out)
        if id(t) not in given and type(t) is _Tensor and t.layout is torch.strided
    )
    known = _SIZES.get(key)
    if known is None:  # the cache was cleared since the lookup
        return
    if made > known:
        _SIZES[key] = made
    elif key not in _UNSIZED:
        _SETTLED.add(key)


def _signature(a):
    if isinstance(a, _Tensor):
        return (a.shape, a.dtype, a.layout)
    t = type(a)
    if t in (list, tuple):
        return tuple(_signature(b) for b in a)
    if t is float or t is int or t is bool:
        # 1, 1.0 and True are equal keys, but give outputs of other dtypes; NaN equals nothing.
        return (t, a) if a == a else (t, "nan")
    return a


def _to_meta(a):
    if isinstance(a, _Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=_META)
    if type(a) in (list, tuple):
        return type(a)(_to_meta(b) for b in a)
    return a


def _sized(func, args, kwargs) -> int:
    n = rule_bytes(func, args, kwargs)  # Note [Sizes without the meta device]
    return _on_meta(func, args, kwargs) if n is None else n


def _on_meta(func, args, kwargs) -> int:
    try:
        with _no_python_dispatch():
            margs = _to_meta(list(args))
            mkw = {k: _to_meta(v) for k, v in kwargs.items()}
            if "device" in mkw:  # a factory: allocating on its real device is what is avoided
                mkw["device"] = _META
            out = func(*margs, **mkw)
    except Exception:  # no meta kernel, a data-dependent shape, a non-strided argument
        return 0
    seen = {id(t) for t in flat_tensors(margs) + flat_tensors(list(mkw.values()))}
    return sum(t.numel() * t.element_size() for t in flat_tensors(out) if id(t) not in seen)


def flat_tensors(a) -> list:
    """The tensors in ``a``: a tensor, or lists and tuples of them at any depth."""
    if isinstance(a, _Tensor):
        return [a]
    if type(a) in (list, tuple):
        return [t for b in a for t in flat_tensors(b)]
    return []
