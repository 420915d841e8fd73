"""Bytes of an op's new outputs from its arguments' shapes and dtypes, for the ops a training
step runs most, without the meta device.

Note [Sizes without the meta device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's meta kernels for most pointwise ops, and for softmax, norms, losses, reductions, ``cat``
and ``addmm``, are Python references wrapped in ``torch._disable_dynamo``, whose first call
imports ``torch._dynamo`` and sympy (most other Python meta kernels, ``mm``'s and convolution's
among them, import sympy): about 1.5 s on the 2-core VM, and about 117,000 objects that
every later full collection of the cyclic collector goes over (a pass there: 73 ms with torch
and dtr loaded, 136 ms with dynamo and sympy too). An engine sizes every op of its first block
(Note [Room before an op] in driver.py), so without these rules every process that trains
under a budget paid both. Each rule gives what the meta device gives, or where a meta kernel promotes dtypes
otherwise than the CPU kernel does, what the kernel makes (tests/test_size_rules.py checks
both on the zoo's steps, on every pointwise op and on cases of every rule); a rule returns None
for what it does not know (an unexpected dtype or argument), and the op is sized on the meta
device.

A pointwise op's outputs have its tensor arguments' broadcast shape and the dtype its kernel
promotes them to: the rule runs the op itself on one-element CPU stand-ins of the same dtypes
and dimensions (a 0-dim tensor promotes differently from a dimensioned one), which draws no
random numbers (seeded ops are left out) and touches no argument. Autocast has already cast the
arguments the driver sees, and its policies cast nothing twice.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

__all__ = ["rule_bytes"]

_Tensor = torch.Tensor
_aten = torch.ops.aten
_no_python_dispatch = torch._C._DisableTorchDispatch
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)
_LOW = (torch.float16, torch.bfloat16)


def _statistic_size(x: _Tensor) -> Optional[int]:
    """Bytes of a norm's saved mean or inverse deviation per element: float32 for half inputs,
    as CUDA and the meta device keep them (CPU kernels keep the input's half dtype unless the
    weights are float32: an upper bound there), the input's own dtype for float32 and float64;
    None for others."""
    if x.dtype in _LOW:
        return 4
    return x.element_size() if x.dtype in (torch.float32, torch.float64) else None


def rule_bytes(func, args, kwargs) -> Optional[int]:
    """Bytes of the tensors ``func(*args, **kwargs)`` would make, or None where no rule knows."""
    rule = _RULES.get(func)
    if rule is None:
        if not _POINTWISE[func]:
            return None
        rule = _pointwise
    try:
        return rule(func, args, kwargs)
    except Exception:  # an argument the rule did not expect: the meta device decides
        return None


def _is_pointwise(func) -> bool:
    schema = func._schema
    return (
        torch.Tag.pointwise in func.tags
        and _SEEDED not in func.tags
        and not schema.is_mutable
        and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
    )


class _Pointwise(dict):
    """Whether an op is a pointwise op that makes new tensors, decided once per op."""

    def __missing__(self, func) -> bool:
        ok = self[func] = isinstance(func, torch._ops.OpOverload) and _is_pointwise(func)
        return ok


_POINTWISE = _Pointwise()


def _broadcast(shapes) -> list:
    # torch.broadcast_shapes would do, but it imports sympy
    out: list = []
    for shape in shapes:
        shape = list(shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for i, n in enumerate(shape, len(out) - len(shape)):
            if n != out[i]:
                if out[i] == 1:
                    out[i] = n
                elif n != 1:
                    raise ValueError("shapes do not broadcast")
    return out


def _stand_in(a):
    if isinstance(a, _Tensor):
        return torch.ones((1,) * a.dim(), dtype=a.dtype, device="cpu")  # whatever the default device
    if isinstance(a, (list, tuple, torch.device)):
        raise TypeError("not a pointwise argument")
    return a


def _pointwise(func, args, kwargs) -> int:
    shapes = [a.shape for a in (*args, *kwargs.values()) if isinstance(a, _Tensor)]
    numel = math.prod(_broadcast(shapes))
    with _no_python_dispatch():  # unseen by the block's modes
        stand_ins = [_stand_in(a) for a in args]
        kw = {k: _stand_in(v) for k, v in kwargs.items()}
        out = func(*stand_ins, **kw)
    given = {t.data_ptr() for t in (*stand_ins, *kw.values()) if isinstance(t, _Tensor)}
    outs = out if isinstance(out, tuple) else (out,)
    # an op may hand back its argument (``conj_physical`` of a real tensor): nothing new
    return sum(numel * o.element_size() for o in outs if o.data_ptr() not in given)


def _like(t: _Tensor, dtype=None) -> int:
    return t.numel() * (dtype.itemsize if dtype is not None else t.element_size())


def _dtype_of(tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _addmm(func, args, kwargs):
    bias, m1, m2 = args[:3]
    if not (bias.dtype == m1.dtype == m2.dtype) or m1.dim() != 2 or m2.dim() != 2:
        return None
    return m1.shape[0] * m2.shape[1] * m1.element_size()


def _cat(func, args, kwargs):
    tensors = args[0]
    # cat skips 1-D empty tensors whatever the other shapes; stack sums equal shapes
    numel = sum(t.numel() for t in tensors)
    return numel * _dtype_of(list(tensors)).itemsize


def _softmax(func, args, kwargs):
    x, half_to_float = args[0], args[2]
    return _like(x, torch.float32 if half_to_float else None)


def _safe_softmax(func, args, kwargs):
    return _like(args[0], args[2] if len(args) > 2 else None)


def _softmax_backward(func, args, kwargs):
    grad, dtype = args[0], args[3]
    # CPU kernels give the gradient's dtype, CUDA's half-to-float path the input's: both agree
    # where the two are the same, as autograd passes them
    return _like(grad) if grad.dtype == dtype else None


def _layer_norm(func, args, kwargs):
    x, normalized = args[0], args[1]
    stat = _statistic_size(x)
    if stat is None:
        return None
    rows = math.prod(x.shape[: x.dim() - len(normalized)])
    return _like(x) + 2 * rows * stat


def _layer_norm_backward(func, args, kwargs):
    x, weight, bias, mask = args[1], args[5], args[6], args[7]
    parts = [(x, mask[0]), (weight, mask[1]), (bias, mask[2])]
    if any(want and t is None for t, want in parts):
        return None
    return sum(_like(t) for t, want in parts if want)


def _batch_norm(func, args, kwargs):
    x, training = args[0], args[5]
    stat = _statistic_size(x)
    if stat is None or not training or x.dim() < 2:
        return None
    return _like(x) + 2 * x.shape[1] * stat


def _batch_norm_backward(func, args, kwargs):
    x, weight, mask = args[1], args[2], args[9]
    if weight is None or not x.dtype.is_floating_point:
        return None
    return (_like(x) if mask[0] else 0) + (mask[1] + mask[2]) * _like(weight)


def _nll_loss(func, args, kwargs):
    x, reduction = args[0], args[3]
    if reduction == 0:
        return None
    return 2 * x.element_size()  # the loss and the total weight, 0-dim


def _like_second(func, args, kwargs):
    return _like(args[1])


def _mse_loss(func, args, kwargs):
    x, target = args[0], args[1]
    reduction = args[2] if len(args) > 2 else 1
    if x.shape != target.shape or x.dtype != target.dtype:
        return None
    return x.element_size() if reduction else _like(x)


def _mse_loss_backward(func, args, kwargs):
    grad, x, target = args[:3]
    if x.shape != target.shape or not (grad.dtype == x.dtype == target.dtype):
        return None
    return _like(x)


def _mm(func, args, kwargs):
    a, b = args[:2]
    if a.dtype != b.dtype or a.dim() != b.dim() or a.dim() not in (2, 3):
        return None
    return math.prod(a.shape[:-1]) * b.shape[-1] * a.element_size()


def _embedding(func, args, kwargs):
    weight, indices = args[:2]
    return indices.numel() * weight.shape[1] * weight.element_size() if weight.dim() == 2 else None


def _embedding_backward(func, args, kwargs):
    grad, rows = args[0], args[2]
    return rows * grad.shape[-1] * grad.element_size()


def _grad_of_part(func, args, kwargs):
    """``select_backward``, ``slice_backward``: the input's sizes, the gradient's dtype."""
    return math.prod(args[1]) * args[0].element_size()


def _factory_dtype(kwargs, default: torch.dtype) -> Optional[torch.dtype]:
    if kwargs.get("layout") not in (None, torch.strided):
        return None  # a sparse layout: the meta device says
    dtype = kwargs.get("dtype")
    return default if dtype is None else dtype


def _factory(func, args, kwargs):
    """``empty``, ``zeros``, ``ones``: the given sizes, in the given dtype or the default one."""
    dtype = _factory_dtype(kwargs, torch.get_default_dtype())
    return None if dtype is None else math.prod(args[0]) * dtype.itemsize


def _arange(func, args, kwargs):
    bounds = list(args) if func is not _aten.arange.default else [0, args[0]]
    start, end, step = (bounds + [1])[:3]
    if not all(type(v) in (int, float) for v in (start, end, step)):
        return None
    ints = all(type(v) is int for v in (start, end, step))
    dtype = _factory_dtype(kwargs, torch.int64 if ints else torch.get_default_dtype())
    if dtype is None or not (ints or dtype.is_floating_point):
        return None  # float bounds into integers: the kernel rounds them first
    return max(0, math.ceil((end - start) / step)) * dtype.itemsize


def _like_factory(func, args, kwargs):
    """``empty_like``, ``zeros_like``, ``ones_like``: the argument's numel, its dtype or the given one."""
    dtype = _factory_dtype(kwargs, args[0].dtype)
    return None if dtype is None else args[0].numel() * dtype.itemsize


def _new_factory(func, args, kwargs):
    """``new_zeros``, ``new_empty``, ``new_ones``: the given sizes, the tensor's dtype or the given one."""
    dtype = _factory_dtype(kwargs, args[0].dtype)
    return None if dtype is None else math.prod(args[1]) * dtype.itemsize


def _reduction(func, args, kwargs):
    """``sum.dim_IntList``, ``mean.dim``: what the named dims leave, in the given dtype or the input's."""
    x, dims, dtype = args[0], args[1], kwargs.get("dtype")
    if dtype is None and not x.dtype.is_floating_point:
        return None  # integers sum to int64, and mean refuses them
    if not dims:
        dims = range(x.dim())
    gone = {d % max(x.dim(), 1) for d in dims}
    kept = [n for i, n in enumerate(x.shape) if i not in gone]  # keepdim's ones change nothing
    return math.prod(kept) * (dtype.itemsize if dtype is not None else x.element_size())


def _per_dim(values, dims: int) -> list:
    values = list(values)
    if len(values) == 1:
        values *= dims
    if len(values) != dims:
        raise ValueError("one value per spatial dimension")
    return values


def _convolution(func, args, kwargs):
    x, weight, _, stride, padding, dilation, transposed, output_padding, groups = args
    if x.dim() != weight.dim() or x.dtype != weight.dtype:
        return None  # an input without a batch dimension (the kernel refuses it), or mixed dtypes
    dims = x.dim() - 2
    stride, padding, dilation = (_per_dim(v, dims) for v in (stride, padding, dilation))
    kernel = weight.shape[2:]
    if transposed:
        extra = _per_dim(output_padding, dims)
        sizes = [max(0, (n - 1) * s - 2 * p + d * (k - 1) + e + 1)
                 for n, s, p, d, k, e in zip(x.shape[2:], stride, padding, dilation, kernel, extra)]
        channels = weight.shape[1] * groups
    else:
        sizes = [max(0, (n + 2 * p - d * (k - 1) - 1) // s + 1)
                 for n, s, p, d, k in zip(x.shape[2:], stride, padding, dilation, kernel)]
        channels = weight.shape[0]
    return x.shape[0] * channels * math.prod(sizes) * x.element_size()


def _convolution_backward(func, args, kwargs):
    grad, x, weight, bias_sizes, mask = args[0], args[1], args[2], args[3], args[10]
    if not (grad.dtype == x.dtype == weight.dtype) or (mask[2] and bias_sizes is None):
        return None
    bias = math.prod(bias_sizes) * x.element_size() if mask[2] else 0
    # oneDNN's CPU path makes the weight's gradient with the bias's even where it is not asked
    # for (a frozen weight, a trained bias): counted there, an upper bound where it does not
    weight_too = mask[1] or (mask[2] and weight.device.type == "cpu")
    return mask[0] * _like(x) + weight_too * _like(weight) + bias


def _max_pool2d(func, args, kwargs):
    x, kernel = args[0], _per_dim(args[1], 2)
    stride = _per_dim(args[2], 2) if len(args) > 2 and args[2] else kernel
    padding = _per_dim(args[3], 2) if len(args) > 3 else [0, 0]
    dilation = _per_dim(args[4], 2) if len(args) > 4 else [1, 1]
    ceil_mode = args[5] if len(args) > 5 else False
    sizes = []
    for n, k, s, p, d in zip(x.shape[-2:], kernel, stride, padding, dilation):
        out = (n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
        if ceil_mode and (out - 1) * s >= n + p:  # the last window would start in the padding
            out -= 1
        sizes.append(max(0, out))
    numel = math.prod(x.shape[:-2]) * math.prod(sizes)
    return numel * (x.element_size() + 8)  # the values, and int64 indices


def _sort(func, args, kwargs):
    return args[0].numel() * (args[0].element_size() + 8)  # the values, and int64 indices


def _one_byte(func, args, kwargs):
    return 1  # one bool (uint8 for uint8 input: the same byte)


def _gather(func, args, kwargs):
    return args[2].numel() * args[0].element_size()  # the index's shape, the input's dtype


def _like_first(func, args, kwargs):
    return _like(args[0])


def _table() -> Dict[object, Callable]:
    by_name = {
        "addmm.default": _addmm,
        "cat.default": _cat,
        "stack.default": _cat,
        "_softmax.default": _softmax,
        "_log_softmax.default": _softmax,
        "_safe_softmax.default": _safe_softmax,
        "_softmax_backward_data.default": _softmax_backward,
        "_log_softmax_backward_data.default": _softmax_backward,
        "native_layer_norm.default": _layer_norm,
        "native_layer_norm_backward.default": _layer_norm_backward,
        "native_batch_norm.default": _batch_norm,
        "native_batch_norm_backward.default": _batch_norm_backward,
        "nll_loss_forward.default": _nll_loss,
        "nll_loss_backward.default": _like_second,
        "mse_loss.default": _mse_loss,
        "mse_loss_backward.default": _mse_loss_backward,
        "mean.dim": _reduction,
        "sum.dim_IntList": _reduction,
        "mm.default": _mm,
        "bmm.default": _mm,
        "embedding.default": _embedding,
        "embedding_dense_backward.default": _embedding_backward,
        "select_backward.default": _grad_of_part,
        "slice_backward.default": _grad_of_part,
        "empty_like.default": _like_factory,
        "zeros_like.default": _like_factory,
        "ones_like.default": _like_factory,
        "empty.memory_format": _factory,
        "zeros.default": _factory,
        "ones.default": _factory,
        "arange.default": _arange,
        "arange.start": _arange,
        "arange.start_step": _arange,
        "convolution.default": _convolution,
        "convolution_backward.default": _convolution_backward,
        "max_pool2d_with_indices.default": _max_pool2d,
        "index_add.default": _like_first,
        "max_pool2d_with_indices_backward.default": _like_second,
        "sort.default": _sort,
        "new_zeros.default": _new_factory,
        "new_empty.default": _new_factory,
        "new_ones.default": _new_factory,
        "any.default": _one_byte,
        "all.default": _one_byte,
        "gather.default": _gather,
        "tril.default": _like_first,
        "triu.default": _like_first,
    }
    table = {}
    for name, rule in by_name.items():
        packet, overload = name.split(".")
        func = getattr(getattr(_aten, packet, None), overload, None)
        if func is not None:  # an op this torch does not have (``_safe_softmax`` before 2.5)
            table[func] = rule
    return table


_RULES = _table()
