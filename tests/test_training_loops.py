"""A PyTorch user's training loop, written for eager and wrapped in ``with dtr.budget(...)``,
gives eager's results bit for bit: mixed precision (bf16 autocast, fp16 autocast with a
``GradScaler``), bf16 parameters, gradient accumulation within one block and across blocks, and
full loops with ``zero_grad()`` (its default, ``set_to_none=True``), gradient clipping, an
optimizer with state and a learning-rate scheduler, the optimizer and scheduler stepping after
the block or inside it.

Every test runs the same loop function three times on independent deep copies of one model,
made before any block: eagerly (``contextlib.nullcontext()`` where the engine would go), under
``dtr.budget(None)`` to measure the loop's unlimited peak, and under a fraction of that peak
with ``cost="estimate"`` (deterministic eviction decisions). It seeds the RNG before every
forward (the models have dropout) and records, in order, what the user would look at: losses,
gradients, clipped norms, parameters after each optimizer step, optimizer state, learning
rates, loss scales. The budgeted run must record exactly eager's values, as plain tensors, and
must have evicted in every block (or every step, for a loop inside one block).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Callable, List, Union

import pytest
import torch

import dtr
from dtr.testing.zoo import Workload, build, on_device

COST = "estimate"

Ctx = Union[contextlib.nullcontext, "dtr.Engine"]


# ---------------------------------------------------------------------------- helpers


class Record(dict):
    """label -> recorded value (a plain tensor, or a Python number), in the order recorded;
    ``evictions`` holds the engine's cumulative eviction count after each block (or step)."""

    def __init__(self) -> None:
        super().__init__()
        self.evictions: List[int] = []

    def value(self, label: str, t: torch.Tensor) -> None:
        """Record a result of the loop (a loss, a norm): inside a block it is a ``DTRTensor``,
        handed over as a plain tensor by ``dtr.materialize``."""
        self[label] = dtr.materialize(t.detach())

    def state(self, label: str, t: torch.Tensor) -> None:
        """Record a copy of a tensor the program keeps (a parameter, a ``.grad``, optimizer
        state): it must be a plain tensor, as in eager, wherever it is read."""
        assert t is not None, f"{label} is None"
        assert type(t) in (torch.Tensor, torch.nn.Parameter), f"{label} is a {type(t).__name__}, not a plain tensor"
        self[label] = dtr.materialize(t.detach().clone())

    def params(self, label: str, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            self.state(f"{label} param {name}", p)

    def grads(self, label: str, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            self.state(f"{label} grad {name}", p.grad)

    def optimizer(self, label: str, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            assert opt.state[p], f"{label}: no optimizer state for {name}"
            for key, v in sorted(opt.state[p].items()):
                self.state(f"{label} {key} {name}", v)

    def evicted(self, ctx: Ctx) -> None:
        if isinstance(ctx, dtr.Engine):
            self.evictions.append(ctx.stats().evictions)


def assert_bitwise(got: Record, eager: Record) -> None:
    """Every value ``got`` recorded is eager's, bit for bit, of the same dtype and device."""
    assert list(got) == list(eager), "the two runs recorded different things"
    assert len(eager) > 0
    for label, want in eager.items():
        have = got[label]
        if isinstance(want, torch.Tensor):
            assert type(have) is torch.Tensor, f"{label} is a {type(have).__name__}, not a plain tensor"
            assert (have.dtype, have.shape, have.device) == (want.dtype, want.shape, want.device), label
            assert torch.equal(have, want), (
                f"{label} differs from eager: max |diff| {(have.double() - want.double()).abs().max().item()}"
            )
        else:
            assert have == want, f"{label}: {have} vs eager's {want}"


def unlimited_peak(loop: Callable[[Ctx], Record]) -> int:
    """Peak resident bytes of ``loop`` run under an engine that tracks but never evicts."""
    engine = dtr.budget(None, cost=COST)
    loop(engine)
    stats = engine.stats()
    assert stats.evictions == 0 and stats.peak_resident_bytes > 0
    return stats.peak_resident_bytes


def run_against_eager(w: Workload, loop: Callable[[torch.nn.Module, Ctx], Record], fraction: float):
    """Run ``loop`` eagerly and under ``fraction`` of its unlimited peak, each on a fresh deep
    copy of ``w.model``; assert bitwise equality and evictions in every block. Returns the
    eager record and the engine."""
    eager = loop(copy.deepcopy(w.model), contextlib.nullcontext())
    peak = unlimited_peak(lambda engine: loop(copy.deepcopy(w.model), engine))
    engine = dtr.budget(int(peak * fraction), cost=COST)
    got = loop(copy.deepcopy(w.model), engine)
    assert_bitwise(got, eager)
    stats = engine.stats()
    assert stats.evictions > 0 and stats.rematerializations > 0, stats
    # Every block (or step) of the loop ran under memory pressure, not just the first.
    counts = [0] + got.evictions
    assert len(got.evictions) > 0 and all(b > a for a, b in zip(counts, counts[1:])), counts
    return eager, engine


def assert_params_moved(w: Workload, eager: Record, label: str) -> None:
    """The optimizer really changed the parameters (the comparison is not of untouched
    copies): at least one recorded parameter differs from the initial model's."""
    moved = [
        name
        for name, p in w.model.named_parameters()
        if not torch.equal(eager[f"{label} param {name}"], p.detach())
    ]
    assert moved, f"{label}: no parameter changed"


# The zoo's "tiny" presets with larger batches, divisible by the number of micro-batches: the
# activations, not the parameters' gradients (which the budget may charge), dominate the peak,
# so that half of it (and 30% for the MLP) leaves room to evict and recompute.
SIZES = {"mlp": dict(batch=384), "transformer": dict(batch=24)}


def workload(name: str) -> Workload:
    return build(name, **SIZES[name])


def micro_batches(w: Workload, n: int) -> list:
    """``w``'s batch split into ``n`` micro-batches along the batch dimension."""
    if w.name == "mlp":
        x, y = w.batch
        return list(zip(x.chunk(n), y.chunk(n)))
    assert w.name == "transformer"
    return list(w.batch.chunk(n))


# ---------------------------------------------------------------------------- mixed precision


def _autocast_loop(w: Workload, dtype: torch.dtype, order: str):
    def loop(model, ctx):
        rec = Record()
        torch.manual_seed(1)
        amp = torch.autocast("cpu", dtype=dtype)
        outer, inner = (ctx, amp) if order == "autocast inside the block" else (amp, ctx)
        with outer, inner:
            loss = w.loss_fn(model, w.batch)
            loss.backward()
            rec.value("loss", loss)
        rec.evicted(ctx)
        rec.grads("step 0", model)
        return rec

    return loop


@pytest.mark.parametrize(
    "name, fraction, order",
    [
        ("mlp", 0.5, "autocast inside the block"),
        ("mlp", 0.3, "autocast inside the block"),
        # autocast's cache of cast weights outlives the block: they are made resident at exit.
        pytest.param(
            "mlp", 0.5, "block inside autocast",
            marks=pytest.mark.filterwarnings("ignore:dtr. .* replayed at block exit:UserWarning"),
        ),
        # At 30% of its peak the transformer needs more than the budget for one attention op's
        # inputs and outputs (OutOfBudgetError): only half its peak is tested.
        ("transformer", 0.5, "autocast inside the block"),
    ],
)
def test_bf16_autocast(name, fraction, order):
    """Guards ``with torch.autocast("cpu", dtype=torch.bfloat16):`` around forward and
    backward, inside a budget block (or the block inside autocast): the recomputed bf16 casts
    and bf16 matmuls give eager's loss and fp32 gradients bit for bit, at half of the peak and
    (MLP) at 30%."""
    w = workload(name)
    eager, _ = run_against_eager(w, _autocast_loop(w, torch.bfloat16, order), fraction)
    # The scenario is really mixed precision: autocast changed the loss.
    torch.manual_seed(1)
    fp32_loss = w.loss_fn(copy.deepcopy(w.model), w.batch).detach()
    assert not torch.equal(eager["loss"], fp32_loss)


def _grad_scaler_loop(w: Workload, device: str):
    def loop(model, ctx):
        rec = Record()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # A small initial scale so that no step is skipped for inf/NaN gradients in fp16.
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        for step in range(3):
            torch.manual_seed(step)
            with ctx:
                with torch.autocast(device, dtype=torch.float16):
                    loss = w.loss_fn(model, w.batch)
                    scaler.scale(loss).backward()
                rec.value(f"step {step} loss", loss)
            rec.evicted(ctx)
            rec.grads(f"step {step} scaled", model)
            scaler.unscale_(opt)
            rec.value(f"step {step} norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            scaler.step(opt)
            scaler.update()
            rec[f"step {step} scale"] = scaler.get_scale()
            rec.params(f"step {step}", model)
            opt.zero_grad()
        return rec

    return loop


def _check_grad_scaler(device: str) -> None:
    w = on_device(workload("mlp"), device)
    eager, _ = run_against_eager(w, _grad_scaler_loop(w, device), 0.5)
    assert_params_moved(w, eager, "step 2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_autocast_with_grad_scaler_cuda(monkeypatch):
    """Guards the standard CUDA AMP loop: fp16 autocast, ``scaler.scale(loss).backward()``
    inside the block, then ``unscale_``, clipping, ``scaler.step`` and ``scaler.update`` after
    it, three steps: losses, scaled gradients, norms, scales and parameters are eager's."""
    # Deterministic cuBLAS, which torch.use_deterministic_algorithms(True) (conftest) demands.
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    _check_grad_scaler("cuda")


def test_fp16_autocast_with_grad_scaler_cpu():
    """Guards the same AMP loop as the CUDA test on CPU (fp16 autocast, ``GradScaler("cpu")``),
    where it runs without a GPU: the scaler's scale tensor, made lazily by the first
    ``scaler.scale`` inside a block, keeps working in ``scaler.update`` after it."""
    _check_grad_scaler("cpu")


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_bf16_parameters(name):
    """Guards a model trained in bf16 throughout (``model.to(torch.bfloat16)``; the MLP's
    inputs bf16, the transformer's are token ids): over two steps, loss and gradients are bf16
    and eager's bit for bit, and the SGD step after each block gives eager's bf16 parameters."""
    w = workload(name)
    w.model.to(torch.bfloat16)
    if name == "mlp":
        w.batch = (w.batch[0].to(torch.bfloat16), w.batch[1])

    def loop(model, ctx):
        rec = Record()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            torch.manual_seed(step)
            with ctx:
                loss = w.loss_fn(model, w.batch)
                loss.backward()
                rec.value(f"step {step} loss", loss)
            rec.evicted(ctx)
            rec.grads(f"step {step}", model)
            opt.step()
            opt.zero_grad()
            rec.params(f"step {step}", model)
        return rec

    eager, _ = run_against_eager(w, loop, 0.5)
    assert_params_moved(w, eager, "step 1")


# ---------------------------------------------------------------------------- gradient accumulation

ACCUMULATE = 3  # micro-batches per optimizer step
ACCUMULATION_STEPS = 2


def _accumulation_loop(w: Workload, per_micro_batch_block: bool):
    parts = micro_batches(w, ACCUMULATE)

    def loop(model, ctx):
        rec = Record()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(ACCUMULATION_STEPS):
            opt.zero_grad()
            if per_micro_batch_block:  # (b) each micro-batch in its own block
                for i, part in enumerate(parts):
                    torch.manual_seed(10 * step + i)
                    with ctx:
                        loss = w.loss_fn(model, part) / ACCUMULATE
                        loss.backward()
                        rec.value(f"step {step} micro-batch {i} loss", loss)
                    rec.evicted(ctx)
            else:  # (a) all micro-batches in one block
                with ctx:
                    for i, part in enumerate(parts):
                        torch.manual_seed(10 * step + i)
                        loss = w.loss_fn(model, part) / ACCUMULATE
                        loss.backward()
                        rec.value(f"step {step} micro-batch {i} loss", loss)
                rec.evicted(ctx)
            rec.grads(f"step {step} accumulated", model)
            opt.step()
            rec.params(f"step {step}", model)
        return rec

    return loop


@pytest.mark.parametrize("name", ["mlp", "transformer"])
@pytest.mark.parametrize("per_micro_batch_block", [False, True], ids=["one block", "block per micro-batch"])
def test_gradient_accumulation(name, per_micro_batch_block):
    """Guards gradient accumulation over 3 micro-batches, all in one block or each in its own
    block of the same engine, with ``optimizer.step()`` after the last: the gradients summed
    into ``.grad`` and the parameters after two such steps are eager's bit for bit."""
    w = workload(name)
    eager, _ = run_against_eager(w, _accumulation_loop(w, per_micro_batch_block), 0.5)
    assert_params_moved(w, eager, "step 1")
    # Accumulation really summed several micro-batches: the losses differ between them.
    losses = [eager[f"step 0 micro-batch {i} loss"] for i in range(ACCUMULATE)]
    assert not torch.equal(losses[0], losses[1]) and not torch.equal(losses[1], losses[2])


# ---------------------------------------------------------------------------- full loops


def _optimizer(kind: str, model: torch.nn.Module):
    if kind == "adam+StepLR":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert kind == "sgd-momentum+LambdaLR"
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))


STEPS = 3


def _full_loop(w: Workload, kind: str, step_inside: bool):
    def loop(model, ctx):
        rec = Record()
        opt, sched = _optimizer(kind, model)
        for step in range(STEPS):
            if not step_inside:
                opt.zero_grad()
            torch.manual_seed(100 + step)
            with ctx:
                if step_inside:
                    opt.zero_grad()
                loss = w.loss_fn(model, w.batch)
                loss.backward()
                if step_inside:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    rec.value(f"step {step} norm", norm)
                rec.value(f"step {step} loss", loss)
            rec.evicted(ctx)
            if not step_inside:
                rec.value(f"step {step} norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                opt.step()
                sched.step()
            rec[f"step {step} lr"] = sched.get_last_lr()[0]
            rec.grads(f"step {step} clipped", model)
            rec.params(f"step {step}", model)
        rec.optimizer("final", opt, model)
        return rec

    return loop


@pytest.mark.parametrize(
    "name, kind",
    [("mlp", "adam+StepLR"), ("mlp", "sgd-momentum+LambdaLR"), ("transformer", "adam+StepLR")],
)
@pytest.mark.parametrize("step_inside", [False, True], ids=["step after the block", "step inside the block"])
def test_full_training_loop(name, kind, step_inside):
    """Guards the textbook loop, one block per step of one engine, three steps:
    ``optimizer.zero_grad()`` (default ``set_to_none=True``), forward, backward,
    ``clip_grad_norm_(..., 1.0)``, ``optimizer.step()``, ``scheduler.step()``, with the
    optimizer and scheduler stepping after the block or inside it. Losses, norms, learning
    rates, clipped gradients, the parameters after every step and the final optimizer state
    are eager's bit for bit."""
    w = workload(name)
    eager, _ = run_against_eager(w, _full_loop(w, kind, step_inside), 0.5)
    for step in range(STEPS):
        assert_params_moved(w, eager, f"step {step}")
    # The scheduler really changed the learning rate, and the model really trained.
    assert len({eager[f"step {s} lr"] for s in range(STEPS)}) == STEPS
    assert len({eager[f"step {s} loss"].item() for s in range(STEPS)}) == STEPS


@pytest.mark.parametrize("name, kind", [("mlp", "sgd-momentum+LambdaLR"), ("transformer", "adam+StepLR")])
def test_several_steps_in_one_block(name, kind):
    """Guards a whole training loop inside one block: each step does ``optimizer.zero_grad()``
    (default ``set_to_none=True``, so the next backward makes new ``.grad`` tensors inside the
    block), forward, backward, clipping, ``optimizer.step()`` and ``scheduler.step()``; every
    step evicts, and losses, gradients, parameters and optimizer state are eager's."""
    w = workload(name)

    def loop(model, ctx):
        rec = Record()
        opt, sched = _optimizer(kind, model)
        with ctx:
            for step in range(STEPS):
                opt.zero_grad()
                assert all(p.grad is None for p in model.parameters())
                torch.manual_seed(100 + step)
                loss = w.loss_fn(model, w.batch)
                loss.backward()
                rec.value(f"step {step} loss", loss)
                rec.value(f"step {step} norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                rec.grads(f"step {step} clipped", model)
                opt.step()
                sched.step()
                rec[f"step {step} lr"] = sched.get_last_lr()[0]
                rec.params(f"step {step}", model)
                rec.evicted(ctx)
        rec.optimizer("final", opt, model)
        return rec

    eager, _ = run_against_eager(w, loop, 0.5)
    for step in range(STEPS):
        assert_params_moved(w, eager, f"step {step}")
    assert len({eager[f"step {s} loss"].item() for s in range(STEPS)}) == STEPS
