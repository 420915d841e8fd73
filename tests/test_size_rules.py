"""Output sizes without the meta device (Note [Sizes without the meta device] in
dtr/eager/size_rules.py): wherever a rule answers, it gives what the meta device gives or what
the real kernel makes, and never less than the kernel makes."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from dtr.eager import output_size, size_rules
from dtr.eager.size_rules import rule_bytes
from dtr.testing import zoo
from fresh_process import run_python

aten = torch.ops.aten


class _Ops(TorchDispatchMode):
    """Keeps the first few calls of every op a step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if len(self.calls[func]) < 8:
            self.calls[func].append((args, kwargs))
        return func(*args, **kwargs)


def _made(func, args, kwargs) -> int:
    """Bytes of the new tensors a real run of the op makes (CPU, plain tensors), by their
    elements: a kernel may return a view of a larger buffer of its own (``mse_loss``'s mean is
    a view of its squared differences), which no size before the run can know and the driver
    learns from the run (``output_size.correct``)."""
    given = {t.untyped_storage().data_ptr() for t in output_size.flat_tensors([*args, *kwargs.values()])}
    out = output_size.flat_tensors(func(*args, **kwargs))
    return sum(t.numel() * t.element_size() for t in out if t.untyped_storage().data_ptr() not in given)


def _agree(func, args, kwargs) -> bool:
    """Whether a rule answered for the call; fails the test where it gives less than the real
    kernel makes, or differs from both the meta device and the real kernel (a few meta kernels
    do not promote dtypes as the CPU kernel does, on arguments no model passes)."""
    n = rule_bytes(func, args, kwargs)
    if n is None:
        return False
    meta = output_size._on_meta(func, args, kwargs)
    try:
        made = _made(func, args, kwargs)
    except RuntimeError:  # the CPU kernel refuses what its one-element stand-ins took (oneDNN's gelu_backward)
        made = meta
    assert n >= made and n in (made, meta), (func, args, kwargs, n, made, meta)
    return True


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast_bf16"])
@pytest.mark.parametrize("name", zoo.MODELS + zoo.DYNAMIC)
def test_rules_agree_with_the_meta_device_on_every_op_of_the_zoo_steps(name, autocast):
    w = zoo.build(name, "tiny")
    ops = _Ops()
    try:
        with ops, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            w.loss_fn(w.model, w.batch).backward()
    except RuntimeError as e:
        if not autocast:
            raise
        pytest.skip(f"eager's step fails under autocast (oneDNN's LSTM in bf16): {e}")
    answered = sum(_agree(f, a, k) for f, calls in ops.calls.items() for a, k in calls)
    assert answered >= 5  # the rules are in use on every model


def _pointwise_ops():
    ops = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            func = getattr(packet, overload)
            if torch.Tag.pointwise in func.tags and not func._schema.is_mutable:
                ops.append(func)
    return ops


_SHAPES = [(2, 1, 3), (4, 3), (1,)]
_STRINGS = {"rounding_mode": "trunc", "approximate": "tanh"}


def _arguments(func, first: torch.dtype):
    """Arguments for ``func`` from its schema: broadcastable tensors (the first of dtype
    ``first``), small numbers; None where the schema asks for something else."""
    args, kwargs, tensors = [], {}, 0
    for a in func._schema.arguments:
        kind = str(a.type)
        if a.has_default_value() and a.kwarg_only:
            continue
        if kind in ("Tensor", "Optional[Tensor]"):
            dtype = first if tensors == 0 else torch.float32
            v = torch.ones(_SHAPES[tensors % len(_SHAPES)], dtype=dtype)
            tensors += 1
        elif kind in ("Scalar", "number", "Optional[Scalar]", "Optional[number]", "float", "Optional[float]"):
            v = 0.5
        elif kind in ("int", "Optional[int]"):
            v = 1
        elif kind in ("bool", "Optional[bool]"):
            v = False
        elif a.name in _STRINGS:
            v = _STRINGS[a.name]
        else:
            return None
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    return args, kwargs


@pytest.mark.parametrize("first", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_every_pointwise_op_is_sized_as_the_meta_device_sizes_it(first):
    """Every pointwise aten op this torch has, on broadcast shapes, with promotion from a
    first argument of each kind of dtype: where the meta device sizes it, the rule gives the
    same bytes or leaves it to the meta device."""
    answered = 0
    for func in _pointwise_ops():
        made = _arguments(func, first)
        if made is None:
            continue
        args, kwargs = made
        try:
            func(*output_size._to_meta(args), **kwargs)
        except Exception:  # no meta kernel, or no such dtype or shape for this op
            continue
        answered += _agree(func, args, kwargs)
    assert answered >= 120


_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool])


@st.composite
def _broadcastable(draw):
    """Shapes that broadcast: dimensions of the output, each argument's a suffix with some ones."""
    out = draw(st.lists(st.integers(0, 4), max_size=4))
    shapes = []
    for _ in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(0, len(out)))
        tail = out[len(out) - rank:]
        shapes.append(tuple(n if draw(st.booleans()) else 1 for n in tail))
    return shapes


@settings(max_examples=60, deadline=None)
@given(shapes=_broadcastable(), dtypes=st.lists(_DTYPES, min_size=3, max_size=3),
       op=st.sampled_from(["add", "mul", "div", "where", "gt", "sigmoid", "maximum", "tanh_backward"]))
def test_pointwise_sizes_over_random_shapes_and_dtypes(shapes, dtypes, op):
    tensors = [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
    func = {"add": aten.add.Tensor, "mul": aten.mul.Tensor, "div": aten.div.Tensor, "where": aten.where.self,
            "gt": aten.gt.Tensor, "sigmoid": aten.sigmoid.default, "maximum": aten.maximum.default,
            "tanh_backward": aten.tanh_backward.default}[op]
    arity = len(func._schema.arguments)
    args = (tensors * arity)[:arity]
    if op == "where":
        args = [args[0].bool(), *args[1:]]
    try:
        func(*output_size._to_meta(args))
    except Exception:  # shapes or dtypes the op refuses
        return
    if not _agree(func, args, {}):  # the rule defers only what the CPU kernel cannot run
        with pytest.raises(Exception):
            func(*args)


x = torch.randn(3, 4)
_CASES = [
    (aten.arange.default, (10.0,), {}),
    (aten.arange.start_step, (0, 1, 0.3), {}),
    (aten.arange.start_step, (5, 0, -2), {}),
    (aten.arange.start, (0, 7), {"dtype": torch.float16}),
    (aten.arange.start_step, (0.5, 3, 0.7), {"dtype": torch.float64}),
    (aten.zeros.default, ((3, 4),), {"dtype": torch.float16}),
    (aten.empty.memory_format, ((2, 5),), {}),
    (aten.ones.default, ((0, 5),), {}),
    (aten.empty_like.default, (x,), {"dtype": torch.int8}),
    (aten.zeros_like.default, (x,), {}),
    (aten.ones_like.default, (x.half(),), {}),
    (aten.new_zeros.default, (x, (2, 3)), {}),
    (aten.new_empty.default, (x, (7,)), {"dtype": torch.float64}),
    (aten.new_ones.default, (x, (0, 2)), {}),
    (aten.sum.dim_IntList, (x, [1], True), {}),
    (aten.sum.dim_IntList, (x, [-1]), {"dtype": torch.float64}),
    (aten.sum.dim_IntList, (x, None), {}),
    (aten.mean.dim, (x, [0, 1]), {}),
    (aten.mean.dim, (x.half(), [1]), {"dtype": torch.float32}),
    (aten.cat.default, ([x, torch.randn(2, 4), torch.empty(0, dtype=torch.float64)],), {}),
    (aten.cat.default, ([x, torch.randn(3, 2, dtype=torch.float64)], 1), {}),
    (aten.stack.default, ([x, x], 2), {}),
    (aten._softmax.default, (x.half(), 1, True), {}),
    (aten._log_softmax.default, (x, 0, False), {}),
    (aten._softmax_backward_data.default, (x, x, 1, torch.float32), {}),
    (aten._log_softmax_backward_data.default, (x.double(), x.double(), 0, torch.float64), {}),
    (aten._safe_softmax.default, (x, -1, torch.float64), {}),
    (aten.nll_loss_forward.default, (x, torch.tensor([0, 1, 2]), None, 2, -100), {}),
    (aten.nll_loss_backward.default, (torch.tensor(1.0), x, torch.tensor([0, 1, 2]), None, 1, -100, torch.tensor(3.0)), {}),
    (aten.mse_loss.default, (x, x, 0), {}),
    (aten.mse_loss.default, (x, x), {}),
    (aten.mse_loss_backward.default, (torch.tensor(1.0), x, x, 1), {}),
    (aten.mm.default, (x, torch.randn(4, 6)), {}),
    (aten.bmm.default, (torch.randn(2, 3, 4), torch.randn(2, 4, 5)), {}),
    (aten.addmm.default, (torch.randn(6), x, torch.randn(4, 6)), {}),
    (aten.embedding.default, (x, torch.tensor([[0, 2], [1, 1]])), {}),
    (aten.embedding_dense_backward.default, (torch.randn(2, 2, 4), torch.tensor([[0, 2], [1, 1]]), 3, -1, False), {}),
    (aten.select_backward.default, (torch.randn(4), [3, 4], 0, 1), {}),
    (aten.slice_backward.default, (torch.randn(1, 4), [3, 4], 0, 0, 1, 1), {}),
    (aten.native_layer_norm.default, (torch.randn(2, 3, 4), [3, 4], None, None, 1e-5), {}),
    (aten.native_layer_norm_backward.default, (torch.randn(2, 3, 4), torch.randn(2, 3, 4), [4], torch.randn(2, 3, 1),
                                               torch.randn(2, 3, 1), torch.randn(4), None, [True, True, False]), {}),
    (aten.native_batch_norm.default, (torch.randn(2, 3, 4), None, None, None, None, True, 0.1, 1e-5), {}),
    (aten.native_batch_norm.default, (torch.randn(2, 3, 4, dtype=torch.bfloat16), *[torch.ones(3, dtype=torch.bfloat16)] * 4,
                                      True, 0.1, 1e-5), {}),  # CPU keeps bf16 statistics: the rule's is an upper bound
    (aten.native_layer_norm.default, (torch.randn(2, 3, 4, dtype=torch.float16), [4], None, None, 1e-5), {}),
    (aten.native_batch_norm_backward.default, (torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(3), None, None,
                                               torch.randn(3), torch.rand(3), True, 1e-5, [True, False, True]), {}),
    (aten.sort.default, (x, 1), {}),
    (aten.convolution.default, (torch.randn(2, 3, 9, 8), torch.randn(4, 3, 3, 2), None, [2, 1], [1, 0], [1, 2],
                                False, [0, 0], 1), {}),
    (aten.convolution.default, (torch.randn(2, 4, 10), torch.randn(6, 2, 3), torch.randn(6), [3], [2], [1], False,
                                [0], 2), {}),
    (aten.convolution.default, (torch.randn(1, 4, 5, 5), torch.randn(4, 3, 3, 3), None, [2, 2], [1, 1], [1, 1],
                                True, [1, 0], 2), {}),
    (aten.convolution.default, (torch.randn(2, 4, 5, 6), torch.randn(4, 2, 3, 2), None, [2, 1], [1, 0], [2, 1],
                                True, [1, 0], 1), {}),
    (aten.convolution.default, (torch.randn(1, 2, 5, 6, 7), torch.randn(3, 2, 2, 3, 3), None, [1, 2, 1], [0, 1, 1],
                                [2, 1, 1], False, [0, 0, 0], 1), {}),
    (aten.convolution_backward.default, (torch.randn(1, 6, 11, 11), torch.randn(1, 4, 5, 5), torch.randn(4, 3, 3, 3),
                                         [6], [2, 2], [1, 1], [1, 1], True, [1, 1], 2, [True, True, True]), {}),
    (aten.convolution_backward.default, (torch.randn(2, 4, 3, 4), torch.randn(2, 3, 5, 6), torch.randn(4, 3, 3, 3),
                                         [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True]), {}),
    (aten.convolution_backward.default, (torch.randn(2, 4, 3, 4), torch.randn(2, 3, 5, 6), torch.randn(4, 3, 3, 3),
                                         None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False]), {}),
    (aten.max_pool2d_with_indices.default, (torch.randn(2, 3, 9, 7), [3, 2]), {}),
    (aten.max_pool2d_with_indices.default, (torch.randn(3, 9, 7), [3, 3], [2, 2], [1, 1], [1, 1], True), {}),
    (aten.max_pool2d_with_indices.default, (torch.randn(1, 1, 6, 6), [2], [2], [1], [2], True), {}),
    (aten.max_pool2d_with_indices.default, (torch.randn(1, 1, 5, 5), [2, 2], [2, 2], [1, 1], [1, 1], True), {}),
    (aten.max_pool2d_with_indices.default, (torch.randn(1, 2, 7, 7), [3, 2], [], [1, 0], [1, 1], True), {}),
    (aten.index_add.default, (x, 0, torch.tensor([0, 2]), torch.randn(2, 4)), {}),
    (aten.max_pool2d_with_indices_backward.default, (torch.randn(1, 2, 2, 2), torch.randn(1, 2, 4, 4), [2, 2], [2, 2],
                                                     [0, 0], [1, 1], False, torch.zeros(1, 2, 2, 2, dtype=torch.long)), {}),
    (aten.tril.default, (x,), {}),
    (aten.triu.default, (x, 1), {}),
    (aten.any.default, (x,), {}),
    (aten.all.default, (torch.ones(3, 2, dtype=torch.uint8),), {}),
    (aten.gather.default, (x, 1, torch.tensor([[0, 1, 1], [2, 0, 3], [1, 1, 1]])), {}),
]


@pytest.mark.parametrize("func,args,kwargs", _CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(_CASES)])
def test_each_rule_agrees_with_the_meta_device_beyond_the_zoo(func, args, kwargs):
    """Arguments the zoo's steps do not pass: other dtypes, negative dims, float ranges,
    reductions over everything, empty tensors, promotion in ``cat``."""
    assert _agree(func, args, kwargs)


def test_a_convolution_s_bias_gradient_alone_counts_the_weight_s_too():
    """A frozen weight with a trained bias: oneDNN's CPU path makes the weight's gradient too,
    which the meta device does not count; the rule does, above the kernel or equal to it."""
    args = (torch.randn(4, 8, 6, 6), torch.randn(4, 3, 8, 8), torch.randn(8, 3, 3, 3), [8], [1, 1], [0, 0], [1, 1],
            False, [0, 0], 1, [True, False, True])
    func = aten.convolution_backward.default
    n = rule_bytes(func, args, {})
    assert n == output_size._on_meta(func, args, {}) + 8 * 3 * 3 * 3 * 4
    assert n >= _made(func, args, {})


def test_every_rule_has_a_case():
    """A rule that stopped answering (a changed schema, a wrong index) would only send its op
    back to the meta device: each one answers a case above."""
    assert set(size_rules._RULES) <= {func for func, _, _ in _CASES}


@pytest.mark.parametrize("func,args,kwargs", [
    (aten.arange.start_step, (0, 5.9, 1.9), {"dtype": torch.int64}),  # the kernel rounds the bounds first
    (aten.arange.start, (0, 5.5), {"dtype": torch.int32}),
    (aten._softmax_backward_data.default, (x, x, 1, torch.bfloat16), {}),  # the CPU kernel keeps the gradient's
    (aten.sum.dim_IntList, (torch.ones(3, dtype=torch.int32), [0]), {}),  # integers sum to int64
])
def test_rules_defer_what_they_would_get_wrong(func, args, kwargs):
    """Arguments whose output dtype or length a shape rule would get wrong (the real kernel's
    differs from what the arguments' dtypes and bounds say) go to the meta device."""
    assert rule_bytes(func, args, kwargs) is None


def test_a_budgeted_step_imports_neither_dynamo_nor_sympy():
    """The models that sized every op on the meta device imported ``torch._dynamo`` and sympy
    in their first budgeted block (about 1.5 s and 117,000 objects on the 2-core VM); with the
    rules nothing of theirs runs on it."""
    script = (
        "import sys, torch, dtr\n"
        "from dtr.testing import zoo\n"
        "for name in ('mlp', 'resnet', 'transformer', 'lstm', 'gru_cell', 'treelstm_batch', 'lstm_packed'):\n"
        "    w = zoo.build(name, 'tiny')\n"
        "    with dtr.budget('1 GiB'):\n"
        "        w.loss_fn(w.model, w.batch).backward()\n"
        "    if name != 'lstm':  # oneDNN has no bf16 LSTM on this CPU\n"
        "        with dtr.budget('1 GiB'), torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "            w.loss_fn(w.model, w.batch).backward()\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    assert run_python(script).strip() == "[]"
