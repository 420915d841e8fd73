"""Bytes against an independent measurement: torch.profiler's CPU allocation events.

The true peak of bytes allocated inside the block (allocations minus frees, in time order)
must stay within the budget plus the largest single op's working set, measured on an eager run
of the same step: the op's inputs plus the peak of what its kernel allocates while it runs
(outputs and internal temporaries). The only memory dtr itself adds is the random-number state
it keeps for each random op (5056 bytes on CPU), allowed for explicitly.
"""

import contextlib
import gc
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

import dtr
import dtr.scope
from dtr.testing.memory import memory_events, peak_bytes, profiled_peak
from dtr.testing.step import budget_at, fresh_model, run_step
from dtr.eager import output_size
from dtr.eager.ops import facts_for
from dtr.sim.trace import load
from dtr.testing.zoo import MODELS, build

RNG_STATE_BYTES = torch.get_rng_state().numel()


def _storages(x, out):
    if isinstance(x, torch.Tensor):
        out[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    elif isinstance(x, (list, tuple)):
        for y in x:
            _storages(y, out)


class _OpWindows(TorchDispatchMode):
    """Marks each op's execution in the profiler and records the bytes of its inputs that were
    allocated during the step (not parameters, gradients or the batch)."""

    def __init__(self, preexisting):
        super().__init__()
        self.preexisting = preexisting
        self.inputs = []
        self.random_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {}
        _storages(list(args) + list(kwargs.values()), seen)
        self.inputs.append(sum(v for k, v in seen.items() if k not in self.preexisting))
        self.random_ops += torch.Tag.nondeterministic_seeded in func.tags
        with record_function(f"dtr-op-{len(self.inputs) - 1}"):
            return func(*args, **kwargs)


def _largest_working_set(w, model):
    preexisting = {}
    _storages(list(model.parameters()) + list(model.buffers()) + [p.grad for p in model.parameters()], preexisting)
    _storages(list(w.batch) if isinstance(w.batch, (tuple, list)) else [w.batch], preexisting)
    windows = _OpWindows(preexisting)
    torch.manual_seed(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with windows:
            w.loss_fn(model, w.batch).backward()
    mem = memory_events(prof)
    spans = {}
    for e in prof.profiler.kineto_results.events():
        if e.name().startswith("dtr-op-"):
            spans[int(e.name()[7:])] = (e.start_ns(), e.start_ns() + e.duration_ns())  # end_ns(): torch>=2.5
    largest = 0
    for i, (start, end) in spans.items():
        level = peak = sum(n for t, n in mem if t < start)
        for t, n in mem:
            if start <= t <= end:
                level += n
                peak = max(peak, level)
        largest = max(largest, windows.inputs[i] + peak - sum(n for t, n in mem if t < start))
    model.zero_grad(set_to_none=False)
    return largest, windows.random_ops, peak_bytes(mem)


def _true_peak(w, model, budget):
    torch.manual_seed(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with dtr.budget(budget, cost="estimate") as engine:
            w.loss_fn(model, w.batch).backward()
    model.zero_grad(set_to_none=False)
    return peak_bytes(memory_events(prof)), engine.stats()


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "resnet"])
def test_true_peak_within_budget_plus_one_op(name):
    w = build(name)
    model = fresh_model(w)
    w.loss_fn(model, w.batch).backward()  # allocate .grad once, as a training loop would have
    model.zero_grad(set_to_none=False)
    largest_op, random_ops, eager_peak = _largest_working_set(w, model)
    unlimited, stats = _true_peak(w, model, None)
    engine_peak = stats.peak_resident_bytes
    # The engine's own count never exceeds what eager allocates, and misses only kernel
    # temporaries (bounded by one op's working set).
    assert engine_peak <= eager_peak <= engine_peak + largest_op
    assert unlimited <= eager_peak + random_ops * RNG_STATE_BYTES
    for fraction in (0.7, 0.5):
        budget = int(engine_peak * fraction)
        peak, stats = _true_peak(w, model, budget)
        assert stats.evictions > 0
        assert peak <= budget + largest_op + random_ops * RNG_STATE_BYTES, (
            f"{name} at {fraction:.0%}: true peak {peak} > budget {budget} + largest op {largest_op}"
        )
        assert peak < eager_peak + random_ops * RNG_STATE_BYTES


def test_engine_accounting_is_exact_without_kernel_temporaries():
    """For the MLP the kernels allocate nothing but their outputs, so the engine's peak is
    exactly eager's, and dtr's only extra memory is the random states it keeps."""
    w = build("mlp")
    model = fresh_model(w)
    w.loss_fn(model, w.batch).backward()
    model.zero_grad(set_to_none=False)
    _, random_ops, eager_peak = _largest_working_set(w, model)
    unlimited, stats = _true_peak(w, model, None)
    assert stats.peak_resident_bytes == eager_peak
    assert unlimited == eager_peak + random_ops * RNG_STATE_BYTES


def _profiled_step(w, model, engine):
    """The true peak of one step in ``engine``'s block, gradients cleared to None first (PyTorch's
    default ``zero_grad``), so that the step makes them."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with engine:
            w.loss_fn(model, w.batch).backward()
    return peak_bytes(memory_events(prof))


@pytest.mark.parametrize("name", ["mlp", "transformer", "resnet"])
def test_true_peak_with_gradients_made_in_the_block(name):
    """With ``zero_grad()``'s default (``set_to_none=True``) the step makes its ``.grad``
    tensors; they stay charged until the block ends, so the true peak stays within budget + one
    op, as for every other storage (it used to pass the budget by the gradients)."""
    w = build(name)
    model = fresh_model(w)
    largest_op, random_ops, eager_peak = _largest_working_set(w, model)
    probe = dtr.budget(None, cost="estimate")
    _profiled_step(w, model, probe)
    stats = probe.stats()
    assert stats.gradient_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    for fraction in (0.7, 0.5):
        budget = budget_at(stats, fraction)
        engine = dtr.budget(budget, cost="estimate")
        peak = _profiled_step(w, model, engine)
        assert engine.stats().evictions > 0
        assert peak <= budget + largest_op + random_ops * RNG_STATE_BYTES, (
            f"{name} at {fraction:.0%}: true peak {peak} > budget {budget} + largest op {largest_op}"
        )


@pytest.mark.parametrize("name", MODELS)
def test_room_is_made_before_an_op_runs(name, tmp_path):
    """From the second step of an engine on, each op's outputs are evicted for before it runs
    (Note [Room before an op]): the engine's own count never passes the budget. The block is
    traced and replayed by the simulator, which makes the same decisions (test_sim.py), once
    as recorded and once without the room made before ops: that one passes the budget by an
    op's outputs, on the models where the largest outputs come when the budget is full."""
    w = build(name)
    model = fresh_model(w)
    probe = dtr.budget(None, cost="estimate")
    _profiled_step(w, model, probe)
    budget = budget_at(probe.stats(), 0.5)
    engine = dtr.budget(budget, cost="estimate")
    _profiled_step(w, model, engine)
    path = tmp_path / "second.jsonl"
    engine.trace = path
    _profiled_step(w, model, engine)
    assert engine.stats().evictions > 0
    assert dtr.simulate(path, budget).peak_bytes <= budget
    trace = load(path)
    reserved = [e for b in trace.blocks for e in b if e.pop("reserve", None)]
    assert reserved, "no room was made before any op"
    after_only = dtr.simulate(trace, budget)
    if name in ("mlp", "transformer"):
        assert after_only.peak_bytes > budget


@pytest.mark.parametrize("name", MODELS)
def test_room_is_made_before_an_op_in_an_engines_first_step(name):
    """An engine that has not finished a block yet knows no largest output, so it sizes every
    op before it runs (Note [Room before an op]): its first step stays within the budget by its
    own count too, also where a step's largest output comes when the budget is full (the
    LSTM's and the TreeLSTM's, in their backward). On a GPU, that first step is the one that
    hits a cap on device memory; the true peak stays within budget + one op's working set."""
    w = build(name)
    model = fresh_model(w)
    largest_op, random_ops, _ = _largest_working_set(w, model)
    probe = dtr.budget(None, cost="estimate")
    _profiled_step(w, model, probe)
    budget = budget_at(probe.stats(), 0.5)
    engine = dtr.budget(budget, cost="estimate")
    peak = _profiled_step(w, model, engine)
    stats = engine.stats()
    assert stats.evictions > 0
    assert stats.peak_resident_bytes <= budget
    assert peak <= budget + largest_op + random_ops * RNG_STATE_BYTES


def test_an_engine_sizes_every_op_until_a_block_with_ops_has_ended():
    """A block that ran no op teaches the engine no largest output: its next step still makes
    room before every op (Note [Room before an op]). With a largest output of 0 learned, the
    LSTM's first step passed the budget by 15 kB by the engine's own count."""
    w = build("lstm")
    model = fresh_model(w)
    probe = dtr.budget(None, cost="estimate")
    _profiled_step(w, model, probe)
    budget = budget_at(probe.stats(), 0.5)
    engine = dtr.budget(budget, cost="estimate")
    with engine:
        pass
    _profiled_step(w, model, engine)
    assert engine.stats().peak_resident_bytes <= budget


def test_a_refused_step_stays_within_its_budget():
    """A step refused in its backward (the tiny TreeLSTM thrashing at 0.068 of its room,
    tests/test_thrashing.py) keeps its true peak, the block's exit included, within the budget
    plus one op: every op of this model fits in the budget (it runs at 0.085), so within twice
    the budget. Defining every live tensor at the exit (the failed autograd graph's, which the
    traceback holds) passed the unlimited run's peak (Note [A failed block's exit])."""
    w = build("treelstm")
    model = fresh_model(w)
    tracked = run_step(w, fresh_model(w), None).stats
    engine = dtr.budget(budget_at(tracked, 0.068), cost="estimate")

    def step():
        with pytest.raises(dtr.ThrashingError):
            run_step(w, model, engine)

    peak = profiled_peak(step)
    assert peak <= 2 * engine.budget, f"true peak {peak} B, budget {engine.budget} B"


def _failing_chain(engine, kept, fail=True):
    """Eight tanh layers of 64 KiB on a shared weight, every activation kept in ``kept``, then a
    view of the first (a row); raises after the forward pass when ``fail``. Returns the loss."""
    torch.manual_seed(0)
    w = torch.randn(128, 128, requires_grad=True)
    h = torch.randn(128, 128)
    with engine:
        for _ in range(8):
            h = torch.tanh(h @ w)
            kept.append(h)
        kept.append(kept[0][0])
        loss = h.sum()
        if fail:
            raise KeyError("the program's own error")
    return w, loss


def test_what_a_failed_block_leaves_is_rebuilt_when_read():
    """After a block that raised, the tensors the program kept that were evicted are rebuilt
    when read, with eager's values, and the failed step's graph still gives eager's gradient;
    until then the exit made nothing resident. A parameter changed in place since makes a read
    a clear error, not a wrong value."""
    eager: list = []
    w_eager, loss_eager = _failing_chain(contextlib.nullcontext(), eager, fail=False)
    loss_eager.backward()
    kept: list = []
    engine = dtr.budget(3 * 64 * 1024, cost="estimate")
    frames = []
    try:
        _failing_chain(engine, kept)
    except KeyError as e:
        frames.append(e.__traceback__)
    assert engine.stats().evictions > 0
    w = frames[0].tb_next.tb_frame.f_locals["w"]
    loss = frames[0].tb_next.tb_frame.f_locals["loss"]
    undefined = [t for t in kept if t._dtr.cell.value is None]
    assert undefined, "nothing was left evicted: the test does not test the exit"
    for mine, theirs in zip(kept, eager):
        assert torch.equal(dtr.materialize(mine), theirs)
    loss.backward()
    assert torch.equal(w.grad, w_eager.grad)
    kept2: list = []
    try:
        _failing_chain(dtr.budget(3 * 64 * 1024, cost="estimate"), kept2)
    except KeyError as e:
        w2 = e.__traceback__.tb_next.tb_frame.f_locals["w"]
    evicted = next(t for t in kept2 if t._dtr.cell.value is None)
    with torch.no_grad():
        w2.add_(1.0)  # an optimizer step
    with pytest.raises(dtr.DTRError, match="failed was read after one it is computed from changed in place"):
        dtr.materialize(evicted)
    kept3: list = []  # the program writes one of the failed step's tensors: its dependents cannot be rebuilt
    with pytest.raises(KeyError):
        _failing_chain(dtr.budget(3 * 64 * 1024, cost="estimate"), kept3)
    i, j = [k for k, t in enumerate(kept3[:8]) if t._dtr.cell.value is None][:2]
    first, second = kept3[i], kept3[j]
    assert j == i + 1 and torch.equal(dtr.materialize(first), eager[i])
    first.mul_(0)
    with pytest.raises(dtr.DTRError, match="written in place since"):
        dtr.materialize(second)
    kept4: list = []  # the same through a plain tensor of a view the block made (its own counter)
    with pytest.raises(KeyError):
        _failing_chain(dtr.budget(3 * 64 * 1024, cost="estimate"), kept4)
    row, second = kept4[-1], kept4[1]
    assert second._dtr.cell.value is None  # rebuilt from kept4[0], which the row views
    dtr.materialize(row).mul_(0)
    with pytest.raises(dtr.DTRError, match="written in place since"):
        dtr.materialize(second)


def test_a_tensor_kept_from_a_failed_block_keeps_nothing_else():
    """Keeping the loss of a failed step (a logged ``loss.detach()``) keeps none of the step's
    other data once the program has dropped the rest: defined live tensors lose their lineage
    at the exit, and what the exit records of the others is held weakly."""
    values = []

    def step(engine):
        torch.manual_seed(0)
        w = torch.randn(128, 128, requires_grad=True)
        with engine:
            h = torch.randn(128, 128)
            for _ in range(8):
                h = torch.tanh(h @ w)
                if h._dtr.cell.value is not None:
                    values.append(weakref.ref(h._dtr.cell.value))
            step.kept = h.sum().detach()
            raise KeyError("the program's own error")

    with pytest.raises(KeyError):
        step(dtr.budget(3 * 64 * 1024, cost="estimate"))
    gc.collect()
    assert values and step.kept.item() != 0
    assert [v() for v in values if v() is not None] == []


@pytest.mark.parametrize("traced", [False, True])
def test_a_failed_block_lets_go_with_the_last_tensor_the_program_drops(traced, tmp_path):
    """What a failed block's close kept lasts while the program holds any of its tensors (the
    last activation it left evicted is rebuilt after every other wrapper died), and
    every byte of it is freed when the program drops that last one, by reference counting
    (``rematerialize.let_go``): the profiler's memory events over the whole try sum to zero
    with the cyclic collector off. Also for an engine that writes a trace (its runtime logs
    wrapper deaths its own way)."""
    eager: list = []
    _failing_chain(contextlib.nullcontext(), eager, fail=False)
    rebuilt = []
    options = dict(trace=str(tmp_path / "failed.jsonl")) if traced else {}

    def failed_try():
        kept: list = []
        with pytest.raises(KeyError):
            _failing_chain(dtr.budget(3 * 64 * 1024, cost="estimate", **options), kept)
        i = max(k for k, t in enumerate(kept[:8]) if t._dtr.cell.value is None)
        last = kept[i]
        del kept
        rebuilt.append(torch.equal(dtr.materialize(last), eager[i]))

    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            failed_try()
    finally:
        gc.enable()
    assert rebuilt == [True]
    assert sum(nbytes for _, nbytes in memory_events(prof)) == 0


def test_a_finalizer_reads_a_failed_blocks_tensor_during_a_collection():
    """Note [Letting go after a collection]: a garbage cycle whose ``__del__`` reads the last
    tensor a failed block left, collected by a young-generation pass while the block's runtime
    sits in an older one, reads eager's value (the wrapper's weakref callback comes before the
    finalizer); what the block kept is dropped when the collection ends."""
    eager: list = []
    _failing_chain(contextlib.nullcontext(), eager, fail=False)
    read = []

    class Logger:
        def __init__(self, t, i):
            self.t, self.i, self.me = t, i, self  # a reference cycle

        def __del__(self):
            read.append(torch.equal(dtr.materialize(self.t), eager[self.i]))

    gc.collect()
    gc.disable()
    try:
        kept: list = []
        torch.manual_seed(0)
        w = torch.randn(128, 128)  # no autograd graph, whose saved tensors would outlive kept[7]
        h = torch.randn(128, 128)
        with pytest.raises(KeyError):
            with dtr.budget(3 * 64 * 1024, cost="estimate"):
                for k in range(8):
                    h = torch.tanh(h @ w)
                    kept.append(h)
                    if k == 0:
                        gc.collect()  # the runtime grows old, as a long block's passes make it
                raise KeyError("the program's own error")
        rt = kept[0]._dtr.cell.storage.runtime
        Logger(kept[7], 7)
        del kept, h
        assert rt.kept_after_close is not None
        gc.collect(0)
    finally:
        gc.enable()
    assert read == [True]
    assert rt.kept_after_close is None


def test_a_budget_below_the_gradients_says_so():
    """The bench MLP's gradients (8 x 4 MiB) take most of its peak: half the peak cannot hold
    them, and the error says that gradients are what the budget must cover, instead of the step
    passing the budget silently (true peak 35 MiB against 10 MiB, before gradients were
    charged)."""
    w = build("mlp", "bench")
    model = fresh_model(w)
    probe = dtr.budget(None, cost="estimate")
    _profiled_step(w, model, probe)
    budget = probe.stats().peak_resident_bytes // 2
    with pytest.raises(dtr.OutOfBudgetError, match="are gradients made in this block") as info:
        _profiled_step(w, model, dtr.budget(budget, cost="estimate"))
    assert info.value.budget == budget and info.value.needed_bytes > budget


@pytest.fixture(params=["no CUDA memory", "CUDA memory allocated"])
def cuda_memory(request, monkeypatch):
    """Runs a CPU test of ``total=True`` also as in a process that has CUDA memory allocated
    (a GPU machine's test run): the limit must cover what the CPU block reads, not that count
    (Driver._watch_device; with CUDA's count taken, they failed on an H200)."""
    if request.param == "CUDA memory allocated":
        monkeypatch.setattr(dtr.scope, "_cuda_allocated", lambda: 64 * 2**20)


def test_total_limit_counts_the_tensors_from_before_the_block(cuda_memory):
    """``dtr.budget(limit, total=True)``: the parameters and the batch the step reads count
    against the limit (on CPU: from a block's start, those its engine's previous block read),
    so the true peak of the step's new allocations plus those tensors stays within the limit
    plus one op's working set."""
    w = build("mlp")
    model = fresh_model(w)
    largest_op, random_ops, _ = _largest_working_set(w, model)
    before = sum(t.numel() * t.element_size() for t in [*model.parameters(), *w.batch])
    probe = dtr.budget(None, cost="estimate")
    _profiled_step(w, model, probe)
    limit = before + budget_at(probe.stats(), 0.5)
    engine = dtr.budget(limit, cost="estimate", total=True)
    _profiled_step(w, model, engine)  # learns which constants its steps read
    peak = _profiled_step(w, model, engine)
    stats = engine.stats()
    assert stats.constant_bytes == before and stats.budget == limit and stats.evictions > 0
    assert before + peak <= limit + largest_op + random_ops * RNG_STATE_BYTES
    # The same limit without total=True leaves the steps all of it: they evict less.
    plain = dtr.budget(limit, cost="estimate")
    _profiled_step(w, model, plain)
    _profiled_step(w, model, plain)
    assert plain.stats().evictions < stats.evictions


def test_total_limit_below_what_exists_already_says_so(cuda_memory):
    w = build("mlp")
    model = fresh_model(w)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(dtr.OutOfBudgetError, match="outside the engine count against the total limit"):
        _profiled_step(w, model, dtr.budget(weights // 2, total=True))
    with pytest.raises(ValueError, match="total must be True or False"):
        dtr.budget("1 GiB", total="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_total_limit_on_cuda_counts_memory_allocated():
    """On CUDA everything allocated when the block starts counts (optimizer state too):
    ``max_memory_allocated`` during the step stays within the limit plus one op's outputs."""
    w = build("mlp")
    model = fresh_model(w).cuda()
    x, y = (t.cuda() for t in w.batch)
    opt = torch.optim.Adam(model.parameters())
    F = torch.nn.functional
    F.cross_entropy(model(x), y).backward()
    opt.step()  # optimizer state exists
    # The measured step is the second: the first may make what libraries keep once made (a
    # kernel replayed on autograd's device thread allocated 1 MiB there on first use), and what
    # persists counts in the second's starting point.
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        limit = torch.cuda.memory_allocated() + 256 * 1024
        torch.cuda.reset_peak_memory_stats()
        with dtr.budget(limit, cost="estimate", total=True) as engine:
            F.cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    largest = 4 * x.numel() * x.element_size()
    assert engine.stats().evictions > 0
    assert torch.cuda.max_memory_allocated() <= limit + largest


def test_total_limit_takes_the_cuda_count_from_the_first_op_on_cuda(monkeypatch):
    """With CUDA memory allocated at entry, a block counts the constants it reads until an op
    names a CUDA device; from then on the limit covers the CUDA count instead (Driver._watch_device,
    called as the dispatch calls it: no CUDA op can run here), and an op that finds that count
    over the limit is refused, leaving the count as it was."""
    monkeypatch.setattr(dtr.scope, "_cuda_allocated", lambda: 1_000_000)
    w, x = torch.randn(64, 64), torch.randn(8, 64)
    with dtr.budget(2_000_000, total=True, cost="estimate") as engine:
        driver, rt = engine._driver, engine.runtime
        x @ w
        assert rt.outside == w.nbytes + x.nbytes and driver.count_constants is not None
        driver._watch_device("aten.mm.default", (x, w), {})  # CPU tensors: nothing changes
        assert rt.outside == w.nbytes + x.nbytes
        driver._watch_device("aten.empty.memory_format", (), {"device": torch.device("cuda")})
        assert rt.outside == 1_000_000 and rt.budget == 1_000_000 and driver.count_constants is None
        y = torch.tanh(x @ w)  # the native path (when built) runs the ops after the switch
        assert rt.outside == 1_000_000 and torch.equal(y, torch.tanh(x @ w))
    assert engine._constants_counted == 0  # what the CUDA count covers is not the next block's start
    with dtr.budget(900_000, total=True, cost="estimate") as engine:
        with pytest.raises(dtr.OutOfBudgetError, match="outside the engine"):
            engine._driver._watch_device("aten.empty.memory_format", (), {"device": torch.device("cuda")})
        assert engine.runtime.outside == 0 and engine._driver.count_constants is not None


def test_total_limit_counts_a_constant_once_whatever_alias_reads_it(cuda_memory):
    """``w.detach()`` or ``w.data`` is a new tensor object over the same memory: counted once."""
    w, x = torch.randn(512, 512), torch.randn(8, 512)
    with dtr.budget("6MB", total=True, cost="estimate") as engine:
        h = x
        for _ in range(8):
            h = torch.tanh(h @ (w.detach() if _ % 2 else w.data))
    assert engine.stats().evictions == 0  # it ran: before, the sixth read raised


def test_total_limit_refusal_leaves_nothing_counted(cuda_memory):
    """An op refused because the constant it reads first does not fit is refused again when
    retried, instead of running past the limit (the constant was left counted, the budget not
    lowered)."""
    w1, w2, x = torch.randn(512, 512), torch.randn(512, 512), torch.randn(8, 512)
    with dtr.budget("1500KB", total=True, cost="estimate"):
        x @ w1
        for _ in range(2):
            with pytest.raises(dtr.OutOfBudgetError, match="outside the engine"):
                x @ w2


def test_the_runtime_owns_the_limit_and_what_it_leaves(cuda_memory):
    """Note [The budget]: inside a block ``engine.budget`` is the runtime's limit, and the
    runtime's budget is that limit less the constants counted so far; reading a new constant
    and setting ``engine.budget`` both move it, and a refused change moves nothing."""
    w1, w2, x = torch.randn(256, 256), torch.randn(256, 256), torch.randn(8, 256)
    limit = 2_000_000
    with dtr.budget(limit, total=True, cost="estimate") as engine:
        rt = engine.runtime
        assert (engine.budget, rt.limit, rt.outside, rt.budget) == (limit, limit, 0, limit)
        x @ w1
        counted = rt.outside
        assert counted >= w1.nbytes + x.nbytes and rt.budget == limit - counted
        engine.budget = limit // 2
        assert (engine.budget, rt.limit, rt.budget) == (limit // 2, limit // 2, limit // 2 - counted)
        with pytest.raises(dtr.OutOfBudgetError, match="outside the engine"):
            engine.budget = counted - 1
        assert (engine.budget, rt.outside, rt.budget) == (limit // 2, counted, limit // 2 - counted)
        x @ w2
        assert rt.outside == counted + w2.nbytes and rt.budget == limit // 2 - rt.outside
    assert engine.runtime is None and engine.budget == limit // 2 and engine.stats().budget == limit // 2


def test_only_aten_ops_with_new_tensors_are_sized_on_meta():
    """Output sizes come from a meta run (Note [Room before an op]) of aten ops that return new
    tensors only: other namespaces' kernels may be Python with side effects (a profiler range,
    a print), which a meta run would repeat."""
    assert facts_for(torch.ops.aten.mm.default).sized
    assert facts_for(torch.ops.aten.native_dropout.default).sized
    assert not facts_for(torch.ops.aten.add_.Tensor).sized  # writes, makes nothing new
    assert not facts_for(torch.ops.aten.t.default).sized  # a view
    assert not facts_for(torch.ops.aten._print.default).sized
    assert not facts_for(torch.ops.profiler._record_function_enter_new.default).sized


def test_output_sizes_tell_scalars_of_other_types_apart():
    full = torch.ops.aten.full.default
    sizes = [output_size.output_bytes(full, ((1000,), v), {})[1] for v in (1.0, 1, True)]
    assert sizes == [4000, 8000, 1000]


def test_output_sizes_settle_after_a_real_run_and_data_dependent_ones_never_do(monkeypatch):
    """``correct`` raises an entry to what a real run made (a workspace the meta device does not
    see), settles it once a run made no more, and keeps measuring the entries of ops whose output
    size depends on the data."""
    for name in ("_SIZES", "_SETTLED", "_UNSIZED"):  # the process's own entries stay as they are
        monkeypatch.setattr(output_size, name, type(getattr(output_size, name))())
    mm = torch.ops.aten.mm.default
    args = (torch.randn(3, 5), torch.randn(5, 7))
    key, n = output_size.output_bytes(mm, args, {})
    assert key is not None and n == 3 * 7 * 4
    output_size.correct(key, torch.empty(3 * 7 + 10), args, {})  # a run that made more
    key, n = output_size.output_bytes(mm, args, {})
    assert key is not None and n == (3 * 7 + 10) * 4
    output_size.correct(key, mm(*args), args, {})
    assert output_size.output_bytes(mm, args, {}) == (None, (3 * 7 + 10) * 4)

    nonzero = torch.ops.aten.nonzero.default
    mask = (torch.arange(50) % 3 == 0,)
    key, n = output_size.output_bytes(nonzero, mask, {})
    assert n == 0
    for count, want in ((10, 10), (4, 10), (20, 20)):
        output_size.correct(key, torch.empty(count, 1, dtype=torch.long), mask, {})
        key, n = output_size.output_bytes(nonzero, mask, {})
        assert key is not None and n == want * 8
