"""Op facts (dtr/eager/ops.py) and the driver's one-pass path for views."""

import pytest
import torch

import dtr
from dtr.eager.ops import facts_for
from dtr.eager.recording import sort_outputs

aten = torch.ops.aten


@pytest.mark.parametrize(
    "op, one_view",
    [
        (aten.t.default, True),
        (aten.view.default, True),
        (aten.transpose.int, True),
        (aten.expand.default, True),
        (aten.slice.Tensor, True),
        (aten.as_strided.default, True),
        (aten._unsafe_view.default, True),
        (aten.view_as.default, False),  # a second tensor argument: the general path reads it
        (aten.split.Tensor, False),  # a list of views
        (aten.unbind.int, False),
        (aten.alias.default, False),  # handled as a detach
        (aten.tanh.default, False),
    ],
)
def test_one_view_is_a_single_view_of_the_only_tensor_argument(op, one_view):
    assert facts_for(op).one_view is one_view


@pytest.mark.parametrize(
    "op, list_view",
    [
        (aten.split.Tensor, True),
        (aten.split_with_sizes.default, True),
        (aten.unsafe_split.Tensor, True),
        (aten.unbind.int, True),
        (aten.chunk.default, True),
        (aten.t.default, False),  # one view
        (aten.tanh.default, False),
    ],
)
def test_list_view_is_a_list_of_views_of_the_only_tensor_argument(op, list_view):
    assert facts_for(op).list_view is list_view


VIEWS = {
    "t": lambda y: y.t(),
    "transpose": lambda y: y.transpose(0, 1),
    "view": lambda y: y.view(4, 12),
    "expand": lambda y: y[:1].expand(3, 6, 8),
    "select": lambda y: y.select(1, 2),
    "slice": lambda y: y[:, 2:5],
    "permute": lambda y: y.unsqueeze(0).permute(2, 0, 1),
    "diagonal": lambda y: y.diagonal(),
    "unfold": lambda y: y.unfold(1, 3, 2),
    "as_strided": lambda y: y.as_strided((3, 3), (2, 1), 4),
    "view_dtype": lambda y: y.view(torch.int32),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_a_view_is_recomputed_after_its_base_is_evicted(name):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    expected = VIEWS[name](x * 2 + 1)
    with dtr.budget(None) as engine:
        v = VIEWS[name](x * 2 + 1)
        engine.budget = 0  # evicts every storage that can be recomputed: v's base among them
        assert engine.stats().evictions > 0 and engine.stats().resident_bytes == 0
        engine.budget = None
        got = dtr.materialize(v)
    assert engine.stats().rematerializations > 0
    assert torch.equal(got, expected)
    assert got.stride() == expected.stride() and got.storage_offset() == expected.storage_offset()


def test_cudnn_dropout_state_is_returned_plain_and_never_sized():
    """ATen caches cuDNN's dropout state for the process and reuses it in and out of blocks
    (ops.py, ``_PLAIN_OUTPUTS``): never a wrapper, never charged, and not sized before it runs
    (charged, its 6 MiB failed every tiny ``nn.LSTM`` budget on a GPU)."""
    f = facts_for(torch.ops.aten._cudnn_init_dropout_state.default)
    assert f.plain_outputs == (0,) and not f.sized and not f.simple
    state = torch.empty(6 << 20, dtype=torch.uint8)  # what the CUDA kernel returns
    fresh, fresh_pos, same, plain = sort_outputs(f, state, [], {}, None)
    assert (fresh, fresh_pos, same, plain) == ([], [], {}, [])


# Kernels that hand back their constant argument where the schema promises a new tensor.
_LIB = torch.library.Library("dtr_tests", "DEF")
_LIB.define("constant_back(Tensor x, Tensor c) -> Tensor")
_LIB.define("constant_second(Tensor x, Tensor c) -> (Tensor, Tensor)")
_LIB.impl("constant_back", lambda x, c: c, "CPU")
_LIB.impl("constant_second", lambda x, c: (x * 2, c), "CPU")


@pytest.mark.parametrize("op", [torch.ops.dtr_tests.constant_back.default, torch.ops.dtr_tests.constant_second.default])
def test_an_op_that_returns_its_constant_leaves_the_inputs_unlocked(op):
    """A kernel that returns a constant argument as its new tensor is a ``DTRError`` (the
    engine would manage memory the program holds); the op's inputs are unlocked again, so
    the block goes on and evicts them for its budget. Both registrations the native path
    hands such an op to (``_register_one``, ``_register_several``) unlock, as the Python
    path does."""
    c = torch.randn(64, 64)
    with dtr.budget(3 * 64 * 64 * 4, cost="estimate") as engine:
        x = torch.randn(64, 64) * 1
        with pytest.raises(dtr.DTRError, match="returned one of its constant inputs"):
            op(x, c)
        assert [s.sid for s in engine.runtime.storages() if s.locks] == []
        ys = [torch.tanh(x)]
        for _ in range(4):
            ys.append(torch.tanh(ys[-1]))
        assert x._dtr.cell.value is None, "x was not evicted"
        want = dtr.materialize(x)
        for y in ys:
            want = torch.tanh(want)
            assert torch.equal(dtr.materialize(y), want)
