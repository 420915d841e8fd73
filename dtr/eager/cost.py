"""Compute cost of an op, in seconds: measured on CPU, estimated on accelerators.

Note [Cost without synchronization]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On CPU a kernel runs synchronously, so a ``perf_counter`` pair around it is its cost (~0.1 µs
of overhead). On CUDA a launch returns before the kernel runs; timing it would measure launch
latency, and synchronizing per op (what the DTR prototype did, with CUDA_LAUNCH_BLOCKING)
serializes the device. So on accelerators, and whenever ``cost="estimate"`` is asked for, the
cost is a roofline estimate, ``max(flops / peak_flops, bytes_moved / bandwidth)`` plus a fixed
launch overhead: deterministic (handy in tests), free of synchronization, and right about
what matters to the heuristic (matmuls and convolutions are expensive, elementwise ops cost
their memory traffic). FLOPs come from ``torch.utils.flop_counter``'s formulas. Ops that only
make a new view of their input (views, ``detach``, in-place view changes) move no data and run
no kernel: they cost the fixed overhead alone. (Charged for the bytes of their input and output,
as they once were, the 66 view replays of the bench transformer's seeded step at 0.3 of peak
"cost" 51 ms, a seventh of its recomputation.)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dtr.eager.ops import Kind, facts_for

__all__ = ["estimate_seconds", "COST_MODES"]

COST_MODES = ("auto", "estimate")

_METADATA_ONLY = (Kind.VIEW, Kind.DETACH, Kind.INPLACE_VIEW)

# (peak FLOP/s, bytes/s, launch overhead s): rough figures; only ratios matter to eviction.
_ROOFLINE = {
    "cpu": (1e11, 1e10, 2e-6),
    "cuda": (1e14, 2e12, 5e-6),
}

try:  # the formulas moved around between torch releases; without them we count bytes only
    from torch.utils.flop_counter import flop_registry as _FLOPS
except ImportError:  # pragma: no cover
    _FLOPS = {}


def _nbytes(values: Sequence) -> int:
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (list, tuple)):
            total += _nbytes(v)
    return total


def estimate_seconds(func, args, kwargs, outs: Sequence, device: Optional[str] = None) -> float:
    """Roofline estimate of ``func(*args, **kwargs)`` that produced ``outs`` (unwrapped), on
    the device of the first output, or on ``device`` (outputs on the meta device stand for an
    op that has not run)."""
    if device is None:
        device = "cpu"
        for v in outs:
            if isinstance(v, torch.Tensor):
                device = v.device.type
                break
    flops_per_s, bytes_per_s, launch = _ROOFLINE.get(device, _ROOFLINE["cuda"])
    if facts_for(func).kind in _METADATA_ONLY:
        return launch
    formula = _FLOPS.get(func.overloadpacket)
    if formula is None:
        return _moved(args, kwargs, outs) / bytes_per_s + launch
    if not hasattr(formula, "__wrapped__"):  # a raw formula: it may read values (Note [Cached estimates])
        return _with_flops(formula, args, kwargs, outs, flops_per_s, bytes_per_s) + launch
    key = (func, device, _signature(args), _signature(kwargs.values()), tuple(kwargs), _signature(outs))
    seconds = _ESTIMATES.get(key)
    if seconds is None:
        seconds = _ESTIMATES[key] = _with_flops(formula, args, kwargs, outs, flops_per_s, bytes_per_s) + launch
        if len(_ESTIMATES) > _MAX_ESTIMATES:  # dynamic shapes (trees, variable lengths) keep coming
            _ESTIMATES.clear()
    return seconds


# Note [Cached estimates]
# ~~~~~~~~~~~~~~~~~~~~~~~
# torch's FLOP formulas are Python over the arguments' shapes and cost more than the rest of
# the engine's work on a matmul or a convolution (docs/runtime.md); on CUDA every op
# is estimated, so they are cached by what they read: the op, and each argument's shape and
# dtype (tensors) or value (anything else). That holds for the formulas torch registers on
# shapes (wrapped, so with ``__wrapped__``); the few it registers raw (variable-length flash and
# memory-efficient attention, flex attention) read tensors' values, such as sequence offsets,
# and are not cached. Ops without a formula cost their bytes, which is cheaper to compute than
# a key.
_ESTIMATES: dict = {}
_MAX_ESTIMATES = 1 << 16


def _signature(values) -> tuple:
    """A hashable key of ``values`` for the estimate: tensors by shape and dtype."""
    key = []
    for v in values:
        t = type(v)
        if t in _HASHABLE:
            key.append(v)
        elif isinstance(v, torch.Tensor):
            key.append((v.shape, v.dtype))
        elif t is list or t is tuple:
            key.append(_signature(v))
        else:
            key.append(repr(v))
    return tuple(key)


_HASHABLE = {type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format}


def _moved(args, kwargs, outs) -> int:
    """Bytes the op reads and writes."""
    return _nbytes(args) + _nbytes(kwargs.values()) + _nbytes(outs)


def _with_flops(formula, args, kwargs, outs, flops_per_s: float, bytes_per_s: float) -> float:
    seconds = _moved(args, kwargs, outs) / bytes_per_s
    out = outs[0] if len(outs) == 1 else tuple(outs)
    try:
        return max(seconds, formula(*args, **kwargs, out_val=out) / flops_per_s)
    except Exception:  # a formula that does not accept this overload's arguments
        return seconds
