"""Gradient accumulation in place, as eager autograd does it.

Note [Accumulation in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When several gradients flow into one tensor (a weight shared over time steps or tree nodes,
an embedding read once per sequence, the two branches of a residual), autograd sums them in
the receiving node's input buffer. For plain tensors it adds in place (``old.add_(new)``)
when it holds the only reference to ``old``; for a tensor subclass it never does, and
computes ``old + new`` instead (``torch/csrc/autograd/input_buffer.cpp``). Under dtr every
gradient is a wrapper, so each sum made a new storage: a step held three accumulators' worth
of memory where eager holds two (an SST-sized TreeLSTM's 6 MB embedding gradient: 18 MB at
each of its 16 sums), and every sum kept the previous one's lineage.

The driver restores eager's behaviour: an ``aten.add.Tensor(old, new)`` inside a backward pass
(a graph task running, grad mode off: the buffer's own condition for adding in place) whose
``old`` is exclusively held runs as ``old.add_(new)`` through the engine's in-place path (a
new version of ``old``'s storage, Note [Versions]) and returns a new wrapper over it. The
values are bit for bit those of ``old + new``.

A sum into a parameter's gradient, and a sum into a sum (the third gradient of a tensor used
three times, and every one after), in place or not, is then made permanent
(``Runtime.make_permanent``), as in eager, where nothing is recomputable. A sum whose ``old``
is such a permanent sum, exclusively held, is written into that very storage: no new version,
since nothing can recompute it and no replayable record reads it (the exclusivity test's
``uses`` condition), so the engine records an op that makes nothing and hands back a new
wrapper over the same cell (``Gradients._add_to_permanent``). A weight used n times keeps one
storage for its running sum, where each sum made a storage, a record and a cut of its
predecessor's lineage (``bench_runtime.py --sections models`` on the small trees and the
bench TreeLSTM, README). Its lineage is every gradient
summed so far, so its true recomputation cost is the backward pass up to here, which the
heuristics do not see: with lineage kept, simulations of the bench TreeLSTM's trace at 0.67
of its peak, and of the GRU cell loop's at 0.5, re-summed weight and embedding gradients tens
of thousands of times and did not end in a minute (with it: 1.18x and 1.31x, README). The gradients it
was summed from are released with their own lineage. Protecting running sums from eviction
while they are referenced, keeping their lineage, was not enough: the TreeLSTM's simulation
still did not end at 0.67 (a dead sum's readers, evicted, recompute through the chain). A
single sum of activation gradients (a residual branch's) keeps its lineage: made permanent,
it stays resident for as long as the ops that read it may be replayed, where an evictable one
goes as soon as the program drops it (one-off probe: with every sum permanent, the bench
transformer's unlimited peak rose from 258 to 408 MiB). A permanent sum the program dropped
gives way to its readers' outputs once those are resident and no larger
(``make_permanent(..., yielding=True)``); where they are not, it stays: the tiny ``nn.GRU``'s
state-gradient sums (three uses per step) keep 0.7 of its evictable room out of reach
(``tests/test_zoo_dynamic.py``, a strict xfail), and in one-off probes a block whose
activations are each used four times (``a.sin() + a.cos() + a * a + h``) or non-reentrant
``checkpoint`` peaked 4-8% higher than with every sum out of place and lost their lowest
budgets. The destination is read from autograd: the node whose output is being added passes
it on to its ``next_functions``, and a parameter's ``AccumulateGrad`` of the sum's shape and
dtype among them marks a parameter's gradient (a false match costs only that sum's lineage).

Only a gradient made before the running autograd node began counts (``Driver.node_from``):
a backward formula's own temporaries (``atan2``'s adds two) look exclusive by every count,
but the C++ code that made one may read it again.

Exclusive means what autograd checks: nothing but the caller holds ``old``. Its C++ use
count and its Python reference count, read from the dispatch arguments, must equal those of
an accumulation known to be exclusive, measured once per process through the same path
(``calibrate``): a real block whose backward sums two fresh gradients of one weight. Any other
holder (a second input buffer getting the same gradient, a hook, a saved tensor, a Python
variable) raises one count or the other, and the sum is made out of place as before. So are
sums whose result would differ in shape, dtype or device from ``old``, or whose ``old`` does
not cover its storage densely (a transposed whole is fine: linear layers' weight gradients
arrive so), has other views, or shares its storage with ``new``. If torch's autograd stops
summing through ``aten.add`` (the calibration sees no sum), nothing is done in place.
"""

from __future__ import annotations

import sys
import threading
from typing import Optional, Tuple

import torch

__all__ = ["calibrate", "dense", "exclusive", "into_leaf", "summed"]

# (use count, reference count) of an exclusively held ``old``; None before ``calibrate``,
# () where the calibration saw no sum (never in place).
_exclusive: Optional[Tuple[int, ...]] = None
_calibrating: Optional[list] = None  # the counts seen, while ``calibrate`` runs
_lock = threading.Lock()  # one calibration at a time
_calibrator: Optional[int] = None  # the thread calibrating: other threads' sums are not its measurements
_SUMS = ("aten.add.Tensor", "aten.add_.Tensor")  # the ops' names in records


def calibrate() -> None:
    """Measure, once per process, the reference counts of an exclusively held accumulator
    (Note [Accumulation in place]). Runs a tiny block of its own; call outside any block.
    Whatever the caller's grad mode, and on any thread; if it fails, sums stay out of place."""
    global _exclusive, _calibrating, _calibrator
    if _exclusive is not None or _calibrator == threading.get_ident():  # done, or its own block
        return
    with _lock:
        if _exclusive is not None:
            return
        from dtr.scope import Engine

        seen = _calibrating = []
        _calibrator = threading.get_ident()
        try:
            if not hasattr(torch.Tensor, "_use_count"):  # no way to tell: never in place
                raise AttributeError("Tensor._use_count")
            with torch.inference_mode(False), torch.enable_grad():
                w = torch.ones(4, dtype=torch.float32, device="cpu", requires_grad=True)
                with Engine(None, cost="estimate"):
                    y = torch.ones(4, dtype=torch.float32, device="cpu") * 2  # managed: wrapped gradients
                    ((y * w).sum() + (y * w).sum()).backward()
        except Exception:
            seen = []
        finally:
            _calibrating = _calibrator = None
        _exclusive = seen[0] if len(set(seen)) == 1 else ()


def exclusive(args) -> bool:
    """Whether ``args[0]`` of an ``aten.add.Tensor`` call inside a backward pass is held by
    the caller alone (only the counts: the driver checks the rest)."""
    counts = (args[0]._use_count(), sys.getrefcount(args[0]))
    if _exclusive is None:  # calibrating: only its own block's sums are measurements
        if _calibrator == threading.get_ident():
            _calibrating.append(counts)
        return False
    return counts == _exclusive


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory without gaps or overlaps, in some order
    of its dimensions (contiguous, or transposed as a linear layer's weight gradient arrives):
    autograd's condition for summing into it in place. From its metadata alone."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def summed(s) -> bool:
    """Whether storage ``s`` is itself a sum (made by an ``add``, in place or not), so that
    adding to it extends a chain of sums."""
    rec = s.parent
    return rec is not None and rec.name in _SUMS


def into_leaf(old: torch.Tensor, node) -> bool:
    """Whether autograd is summing into the gradient of a leaf (a parameter): ``node``, the
    autograd node running, which made the gradient being added, passes one of its outputs to
    a leaf of ``old``'s shape and dtype (Note [Accumulation in place])."""
    if node is None:
        return False
    for fn, _ in node.next_functions:
        if fn is not None and type(fn).__name__ == "AccumulateGrad":
            v = fn.variable
            if v.shape == old.shape and v.dtype == old.dtype:
                return True
    return False
