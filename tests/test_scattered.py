"""Scattered gradients and outer products (Notes [Scattered gradients] and [Outer products] in
dtr/eager/scattered.py): the backward of ``x[:, t]``, ``x[a:b]`` and an embedding lookup, and a
weight's gradient from one row (``mm`` of a column by a row, and views of it), are deferred in a
backward pass and summed into their running sums without being made, bit for bit as eager sums
them, and made by a replay where anything else reads them."""

import contextlib
import gzip
import json
from unittest import mock

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import dtr
from dtr.eager import scattered
from dtr.testing.memory import measured_peak
from dtr.testing.step import assert_same, budget_at, fresh_model, run_step
from dtr.testing import zoo

aten = torch.ops.aten
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Values as integers, so that -0.0 and 0.0 differ; NaNs as one value (their payload
    depends on the kernel's loop that writes them: Note [Scattered gradients])."""
    t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t).contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def awkward(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values with about a quarter of them 0.0 or -0.0 (where eager's sum of zeros
    differs from a sum that skips them) and a few infinities and NaNs."""
    t = torch.randn(shape, generator=gen)
    pick = torch.rand(shape, generator=gen)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    t = torch.where(pick < 0.25, 0.0 * sign, t)
    t = torch.where(pick > 0.98, float("inf") * sign, t)
    t = torch.where((pick > 0.97) & (pick <= 0.98), float("nan"), t)
    return t.to(dtype)


def check_add_into(func, args, total):
    expected = total.clone().add_(func(*args))
    got = total.clone()
    assert scattered.add_into(got, func, args)
    assert torch.equal(bits(got), bits(expected))


def maybe_transposed(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``t``'s values, laid out transposed when asked (a non-contiguous running sum)."""
    if not transpose or t.dim() < 2:
        return t
    return t.transpose(0, -1).contiguous().transpose(0, -1)


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    wide=st.sampled_from([1, 67]),  # the last dimension past the kernels' vector width
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_select_and_slice_sums_are_eagers_bit_for_bit(shape, wide, data, dtype, transpose, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = shape[:-1] + [shape[-1] * wide]
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    n = shape[dim]
    total = maybe_transposed(awkward(shape, dtype, gen), transpose)
    index = data.draw(st.integers(-n, n - 1))
    part_shape = list(shape)
    del part_shape[dim]
    grad = maybe_transposed(awkward(part_shape, dtype, gen), not transpose)
    check_add_into(aten.select_backward.default, [grad, list(shape), dim, index], total)
    # Slices as Python writes them: negative and out-of-range bounds, empty slices.
    start = data.draw(st.integers(-n - 2, n + 2))
    stop = data.draw(st.integers(-n - 2, n + 2))
    span = range(n)[start:stop]
    part_shape = list(shape)
    part_shape[dim] = len(span)
    grad = awkward(part_shape, dtype, gen)
    check_add_into(aten.slice_backward.default, [grad, list(shape), dim, start, stop, 1], total)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 1200),  # past the kernel's 1,000-row grain of parallel work
    width=st.sampled_from([1, 3, 67]),
    lookups=st.lists(st.integers(0, 6), min_size=0, max_size=2),
    padding=st.sampled_from(["none", "present", "absent", "negative"]),
    index_dtype=st.sampled_from([torch.int64, torch.int32]),
    dtype=st.sampled_from(DTYPES),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_embedding_sums_are_eagers_bit_for_bit(rows, width, lookups, padding, index_dtype, dtype, transpose, seed):
    gen = torch.Generator().manual_seed(seed)
    # Few distinct rows, so that most are read several times (their sums' order matters).
    indices = torch.randint(0, min(rows, 4), lookups, generator=gen).to(index_dtype)
    first = int(indices.reshape(-1)[0]) if indices.numel() else 0
    pad = {"none": -1, "present": first, "absent": rows - 1 if rows > 4 else -1, "negative": -2}[padding]
    grad = awkward([*lookups, width], dtype, gen)
    total = maybe_transposed(awkward([rows, width], dtype, gen), transpose)
    check_add_into(aten.embedding_dense_backward.default, [grad, indices, rows, pad, False], total)


def test_what_is_not_deferred():
    g = torch.randn(3, 4)
    assert scattered.deferred_size(aten.select_backward.default, [g, [5, 3, 4], 0, 1]) == [5, 3, 4]
    assert scattered.deferred_size(aten.slice_backward.default, [g, [6, 4], 0, 0, 6, 2]) is None  # step 2
    assert scattered.deferred_size(aten.select_backward.default, [g.to(torch.int64), [5, 3, 4], 0, 1]) is None
    idx = torch.tensor([1, 2, 2])
    assert scattered.deferred_size(aten.embedding_dense_backward.default, [g, idx, 10, -1, False]) == [10, 4]
    assert scattered.deferred_size(aten.embedding_dense_backward.default, [g, idx, 10, -1, True]) is None


@settings(max_examples=120, deadline=None)
@given(
    m=st.integers(1, 700),
    n=st.sampled_from([1, 3, 67, 600]),  # 600: several blocks of rows for 4- and 8-byte dtypes
    dtype=st.sampled_from(DTYPES),
    transposed=st.booleans(),  # the running sum of the product's transpose (a linear layer's)
    layout=st.booleans(),  # the running sum laid out transposed
    odd_factors=st.booleans(),
    odd_total=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_outer_product_sums_are_eagers_bit_for_bit(m, n, dtype, transposed, layout, odd_factors, odd_total, seed):
    """Eager's ``total + mm(a, b)`` (or ``+ mm(a, b).t()``) on this machine's kernel, against
    ``add_into``: the same bits, or a refusal that leaves ``total`` as it was, which happens only
    where a zero's sign could tell the kernel's product from a plain multiplication."""
    gen = torch.Generator().manual_seed(seed)

    def values(shape, odd):
        return awkward(shape, dtype, gen) if odd else torch.randn(shape, generator=gen).to(dtype)

    a, b = values((m, 1), odd_factors), values((1, n), odd_factors)
    if odd_factors and m > 2:
        a[1, 0] = 1e-30  # times a small b_j, an underflow to a signed zero
    product = torch.mm(a, b)
    addend = product.t() if transposed else product
    total = maybe_transposed(values(tuple(addend.shape), odd_total), layout)
    expected = total.clone().add_(addend)
    got = total.clone()
    if scattered.add_into(got, aten.mm.default, [a, b], transposed):
        assert torch.equal(bits(got), bits(expected))
    else:
        assert torch.equal(bits(got), bits(total))
        assert odd_total and bool((total == 0).logical_and(total.signbit()).any())


def test_which_products_are_deferred():
    col, row = torch.randn(5, 1), torch.randn(1, 4)
    mm = aten.mm.default
    assert scattered.deferred_size(mm, [col, row]) == [5, 4]
    assert scattered.deferred_size(mm, [torch.randn(5, 2), torch.randn(2, 4)]) is None  # two columns
    assert scattered.deferred_size(mm, [col.to(torch.float64), row]) is None  # mixed dtypes
    assert scattered.deferred_size(mm, [col.to(torch.int64), row.to(torch.int64)]) is None
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # bf16 inputs on oneDNN: not the exact products
    try:
        assert scattered.deferred_size(mm, [col, row]) is None
        assert scattered.deferred_size(mm, [col.double(), row.double()]) == [5, 4]
    finally:
        torch.set_float32_matmul_precision(precision)


class RowLoop(nn.Module):
    """Reads two weights one row at a time (a batch of one, as a TreeLSTM's node reads its
    cell): every step's weight gradients are outer products of the weights' size."""

    def __init__(self, d=256, steps=12):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.rec = nn.Linear(d, d, bias=False)
        self.steps = steps

    def forward(self, x):
        h = torch.zeros(1, self.lin.in_features)
        for t in range(self.steps):
            h = torch.tanh(self.lin(x[t : t + 1]) + self.rec(h))
        return h.square().sum()


def row_workload():
    torch.manual_seed(0)
    return RowLoop(), torch.randn(12, 256)


def _row_peak(model, x, engine=None) -> int:
    """The true peak of a forward and backward pass, the gradients dropped before it."""
    for p in model.parameters():
        p.grad = None

    def run():
        with engine if engine is not None else contextlib.nullcontext():
            model(x).backward()

    return measured_peak(run)


def test_a_row_loop_makes_no_outer_product_and_matches_eager():
    model, x = row_workload()
    eager = _step(model, x)
    engine = dtr.budget(None)
    with mock.patch.object(scattered, "add_into", wraps=scattered.add_into) as added:
        got = _step(model, x, engine)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, eager))
    # Each weight's 11 sums add a product without making it; the first adds it into the
    # first product, made as a new storage (so no product is ever made).
    assert added.call_count == 2 * 11
    assert all(c.args[1] is aten.mm.default for c in added.call_args_list)
    assert engine.stats().rematerializations == 0
    # Eager's first sums hold two products and their sum beside the other weight's; here one
    # product, a block of rows, and the other weight's sum.
    weight = 256 * 256 * 4
    eager_peak, dtr_peak = _row_peak(model, x), _row_peak(model, x, dtr.budget(None))
    assert dtr_peak <= eager_peak - 1.5 * weight, (dtr_peak, eager_peak)


def test_a_row_loop_runs_where_made_products_do_not_fit():
    """The lowest budget moves: the two running sums, a block and the activations fit; with
    the products made (two and a sum at the first sums) they do not."""
    model, x = row_workload()
    eager = _step(model, x)
    weight = 256 * 256 * 4
    budget = 2 * weight + weight // 2
    engine = dtr.budget(budget, cost="estimate")
    got = _step(model, x, engine)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, eager))
    assert _row_peak(model, x, dtr.budget(budget, cost="estimate")) <= budget
    with mock.patch.object(scattered, "deferred_size", return_value=None):
        with pytest.raises(dtr.OutOfBudgetError):
            _step(model, x, dtr.budget(budget, cost="estimate"))


@pytest.mark.parametrize("name", ["treelstm_batch", "treelstm_nary"])
def test_summing_products_keeps_a_tree_within_its_budget(name):
    """A product's block of rows is working memory the engine makes room for: the true peak
    stays within the budget (without the room it passed it by about one product)."""
    w = zoo.build(name)
    model = fresh_model(w)
    w.loss_fn(model, w.batch).backward()  # .grad allocated once, as in a training loop
    model.zero_grad(set_to_none=False)
    with dtr.budget(None, cost="estimate") as engine:
        w.loss_fn(model, w.batch).backward()
    budget = int(engine.stats().peak_resident_bytes * 0.7)
    model.zero_grad(set_to_none=False)

    def run():
        torch.manual_seed(1)
        with dtr.budget(budget, cost="estimate"):
            w.loss_fn(model, w.batch).backward()

    assert measured_peak(run) <= budget


def test_a_sum_whose_working_memory_does_not_fit_makes_the_product_and_says_so():
    """Between what the running sums need and what a block needs on top, the budget is
    refused (as with the products made), not passed silently; just above, the step runs within
    it (2.05-2.2 weights' bytes are refused, 2.3 runs)."""
    model, x = row_workload()
    weight = 256 * 256 * 4
    for budget in (int(2.05 * weight), int(2.1 * weight), int(2.2 * weight), int(2.3 * weight)):
        engine = dtr.budget(budget, cost="estimate")
        try:
            peak = _row_peak(model, x, engine)
        except dtr.OutOfBudgetError:
            continue
        assert peak <= budget and engine.stats().peak_resident_bytes <= budget


def test_an_embeddings_sum_stays_within_an_unlimited_runs_peak():
    """The working memory of an embedding gradient's sum (its rows, the zero test's masks and
    the index maps) is made room for: at a budget of the unlimited run's peak the true peak
    stays within it (counting the rows alone, it passed it by half the table)."""
    torch.manual_seed(0)
    emb = nn.Embedding(4000, 128)
    tokens = [torch.randperm(4000).view(1, 4000) for _ in range(4)]
    w = torch.randn(128) * 0.1

    def step(engine=None):
        with engine if engine is not None else contextlib.nullcontext():
            sum((emb(t) * w).tanh().sum() for t in tokens).backward()
        emb.zero_grad(set_to_none=False)

    step()  # .grad allocated once, as in a training loop
    unlimited = dtr.budget(None, cost="estimate")
    step(unlimited)
    budget = unlimited.stats().peak_resident_bytes
    assert measured_peak(lambda: step(dtr.budget(budget, cost="estimate"))) <= budget


def test_an_empty_outer_product_runs_as_eagers():
    lin = nn.Linear(4, 0, bias=False)
    x = torch.randn(3, 4)

    def grad(engine=None):
        lin.weight.grad = None
        with engine if engine is not None else contextlib.nullcontext():
            sum(lin(x[t : t + 1]).sum() for t in range(3)).backward()
        return lin.weight.grad

    assert torch.equal(grad(dtr.budget(None)), grad())
    assert scattered.deferred_size(aten.mm.default, [torch.randn(0, 1), torch.randn(1, 4)]) is None


def test_an_outer_product_read_otherwise_is_made():
    """A weight read once by one row: its only gradient is the deferred product, through the
    linear layer's ``t`` views, which ``.grad`` and a hook read: replays make it, with eager's
    values, as the op's own work."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 4)
    x = torch.randn(1, 5)

    def run(engine=None):
        lin.zero_grad()
        seen = []
        with engine if engine is not None else contextlib.nullcontext():
            hook = lin.weight.register_hook(lambda g: seen.append((g * 1).tolist()))
            lin(x).exp().sum().backward()
        hook.remove()
        return lin.weight.grad.clone(), seen

    engine = dtr.budget(None)
    with mock.patch.object(dtr.core.Runtime, "defer_view", autospec=True,
                           side_effect=dtr.core.Runtime.defer_view) as views:
        g1, s1 = run(engine)
    g0, s0 = run()
    assert views.call_count == 2  # the layer's two ``t``
    assert torch.equal(bits(g0), bits(g1)) and s0 == s1 and len(s0) == 1
    assert engine.stats().rematerializations == 0


class OuterTwice(torch.autograd.Function):
    """``x @ w`` for one row ``x``, whose backward doubles the weight's outer product in place:
    a deferred product written before autograd sums it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = torch.mm(x.t(), g)
        gw.mul_(2)
        return g @ w.t(), gw


def test_an_outer_product_written_in_place_is_summed_as_written():
    def run(engine=None):
        torch.manual_seed(0)
        w = torch.randn(5, 3, requires_grad=True)
        rows = torch.randn(4, 5)
        with engine if engine is not None else contextlib.nullcontext():
            sum(OuterTwice.apply(rows[i : i + 1], w).sum() * (i + 1) for i in range(4)).backward()
        return w.grad.clone()

    assert torch.equal(bits(run(dtr.budget(None))), bits(run()))


class SequenceLoop(nn.Module):
    """Reads a long embedded sequence one step at a time (``x[:, t]``), as the cell loops do,
    and each sentence of the batch's embedding apart (``emb(tokens[i])``), as the TreeLSTMs
    do; the per-step work is small, so that the full-size gradients of the sequence and of the
    embedding table are what a step's peak is made of."""

    def __init__(self, vocab=512, d=256, steps=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.w = nn.Parameter(torch.randn(d) * 0.1)
        self.steps = steps

    def forward(self, tokens):
        h = torch.zeros(tokens.shape[0], self.emb.embedding_dim)
        x = self.emb(tokens)
        for t in range(self.steps):
            h = torch.tanh(x[:, t] * self.w + h)
        for i in range(tokens.shape[0]):
            h = h + self.emb(tokens[i : i + 1, :2]).sum(1)
        return h.square().sum()


def sequence_workload():
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (4, 24))
    return SequenceLoop(), tokens


def _step(model, tokens, engine=None):
    for p in model.parameters():
        p.grad = None
    if engine is None:
        model(tokens).backward()
    else:
        with engine:
            model(tokens).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_step_makes_no_scattered_gradient_and_matches_eager():
    model, tokens = sequence_workload()
    eager = _step(model, tokens)
    eager_peak = measured_peak(lambda: _step(model, tokens))
    engine = dtr.budget(None)
    with mock.patch.object(scattered, "add_into", wraps=scattered.add_into) as added:
        got = _step(model, tokens, engine)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, eager))
    # The first gradient of each running sum is made (it becomes the sum), none after it: 23
    # of the sequence's 24 steps, 4 of the table's 5 lookups (the sequence's and 4 sentences').
    assert added.call_count == 23 + 4
    assert engine.stats().rematerializations == 0
    dtr_peak = measured_peak(lambda: _step(model, tokens, dtr.budget(None)))
    full = 4 * 24 * 256 * 4  # one gradient of the embedded sequence, or of the table: 96 KiB / 512 KiB
    table = 512 * 256 * 4
    assert dtr_peak <= eager_peak - min(full, table) * 0.9, (dtr_peak, eager_peak)


def test_a_scattered_gradient_read_otherwise_is_made():
    """A hook on the only gradient of a tensor read once (``y[1]``), and the backward of a
    tensor read once (``z[2:4]``), read deferred outputs: replays make them, with eager's
    values, counted as the ops' own work, not as rematerializations."""
    torch.manual_seed(0)
    x = torch.randn(5, 7, requires_grad=True)

    def run(engine=None):
        x.grad = None
        seen = []
        with engine if engine is not None else contextlib.nullcontext():
            y = x * 2
            z = x.exp()
            y.register_hook(lambda g: seen.append((g * 1).tolist()))
            (y[1] * z[2:4]).sum().backward()
        return x.grad.clone(), seen

    engine = dtr.budget(None)
    with mock.patch.object(dtr.core.Runtime, "defer", autospec=True, side_effect=dtr.core.Runtime.defer) as deferred:
        (g1, s1) = run(engine)
    (g0, s0) = run()
    assert deferred.call_count == 2
    assert torch.equal(bits(g0), bits(g1)) and s0 == s1 and len(s0) == 1
    assert engine.stats().rematerializations == 0


class HalveRows(torch.autograd.Function):
    """``x[a:b]`` whose backward scales aten's ``slice_backward`` in place: a deferred output
    written before autograd sums it."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.shape, ctx.a, ctx.b = list(x.shape), a, b
        return x[a:b].clone()

    @staticmethod
    def backward(ctx, g):
        gi = aten.slice_backward(g, ctx.shape, 0, ctx.a, ctx.b, 1)
        gi.mul_(0.5)
        return gi, None, None


def test_a_scattered_gradient_written_in_place_is_summed_as_written():
    def run(engine=None):
        torch.manual_seed(0)
        x = torch.randn(6, 3, requires_grad=True)
        with engine if engine is not None else contextlib.nullcontext():
            h = x * 2
            (HalveRows.apply(h, 0, 2).sum() + HalveRows.apply(h, 1, 4).sum() * 3).backward()
        return x.grad.clone()

    assert torch.equal(bits(run(dtr.budget(None))), bits(run()))


@pytest.mark.parametrize("name", ["gru_cell", "treelstm_batch", "treelstm_nary"])
def test_under_budgets_the_gradients_stay_eagers(name):
    w = zoo.build(name, "tiny")
    eager = run_step(w, fresh_model(w))
    tracked = run_step(w, fresh_model(w), None).stats
    for fraction in (0.6, 0.45):
        with mock.patch.object(scattered, "add_into", wraps=scattered.add_into) as added:
            r = run_step(w, fresh_model(w), budget_at(tracked, fraction), cost="estimate")
        assert_same(r, eager)
        assert r.stats.evictions > 0 and added.call_count > 0


@pytest.mark.parametrize("name", ["gru_cell", "treelstm_batch"])
def test_the_trace_says_what_was_deferred_and_the_simulation_repeats_the_run(tmp_path, name):
    w = zoo.build(name, "tiny")
    tracked = run_step(w, fresh_model(w), None).stats
    budget = budget_at(tracked, 0.5)
    trace = tmp_path / "t.jsonl.gz"
    real = run_step(w, fresh_model(w), budget, cost="estimate", trace=trace).stats
    with gzip.open(trace, "rt") as f:
        events = [json.loads(line) for line in f]
    deferred = [e for e in events if e.get("deferred")]
    assert deferred and {e["name"] for e in deferred if e["new"][0][1] is None} <= scattered.DEFERRED
    views = {e["name"] for e in deferred if e["new"][0][1] is not None}
    # The TreeLSTM's nodes read their weights one row at a time; the GRU loop's steps a batch.
    assert (views == {"aten.t.default"}) if name == "treelstm_batch" else not views
    sim = dtr.simulate(trace, budget)
    assert sim.feasible
    assert (sim.evictions, sim.rematerializations, sim.peak_bytes) == (
        real.evictions, real.rematerializations, real.peak_resident_bytes)
