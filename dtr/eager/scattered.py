"""Gradients scattered into zeros: made only if something other than a sum reads them.

Note [Scattered gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The backward of reading part of a tensor makes a gradient of the whole tensor's size: zeros
with the part's gradient written in (``select_backward`` for ``x[:, t]``, ``slice_backward``
for ``x[j:j+1]``, ``embedding_dense_backward`` for an embedding lookup, whose rows are the few
tokens a batch read). Autograd then sums it into the running sum of that tensor's gradient
(Note [Accumulation in place] in accumulation.py). A loop over a sequence's steps, or a tree's
nodes, makes one per step: a full-size allocation each time (6.25 MiB per step for the bench
cell loops' embedded sequence, 6 MB per tree for the bench TreeLSTM's embedding), beside the
running sum, which under a budget evicts that much activation memory at every step.

In a backward pass with grad mode off, the driver therefore does not run these ops: it records
them (``Runtime.defer``), and their output is born evicted, with the op as its lineage. A sum
into a running sum that nothing else can see (``Gradients._in_place``) whose addend is such an
output adds the part alone into the running sum (``add_into``), reading the op's arguments;
anything else that reads the output (the only gradient of a tensor read once, a hook, a
``.grad``) rebuilds it by replaying the op, as for any evicted tensor; so does a sum of one
written in place since (its storage has a newer version). A running sum not yet permanent is
made so first (lineage.make_permanent): the write it takes has no version.

``add_into`` is bit for bit the sum eager makes, ``total + zeros-with-the-part`` (NaN payloads
aside: which payload a bfloat16 NaN gets depends on the kernel's loop that writes it):
- Outside the part, eager adds 0.0, which turns a -0.0 into 0.0 and changes nothing else: the
  complement gets ``add_(0.0)``. Inside it, eager adds the part's values: so does ``add_into``.
- For ``select_backward`` and ``slice_backward`` (step 1) the part is the gradient itself, and
  the complement is the two blocks on either side of it along the dimension.
- For ``embedding_dense_backward`` the part is one row per distinct index, each the sum of that
  index's gradient rows. The same kernel computes them over the distinct indices alone
  (``torch.unique``, sorted, maps each index to its row; the padding index to its row, or to
  none): on the CPU it adds each row's contributions in the order of the indices from a zero
  row, as over the whole table, so every row's bits are the same; a row summed from a zero
  start is never -0.0, which lets ``add_(0.0)`` run over the whole table first. Rows are then
  added with ``index_add_`` over distinct indices, one addition per element. A part holding a
  -0.0 (another device's kernel, which may sum a row without a zero start) is not added this
  way: ``add_into`` declines and the output is rebuilt. ``scale_grad_by_freq`` is not deferred
  (its scaling is per row of the whole table), nor are CUDA embedding gradients (the device's
  kernel sums in an order not checked to match on distinct indices).

An embedding's sum allocates the distinct rows' sums and index maps while it runs: its working
memory, as a kernel's scratch is, not charged (at most about the table's size, the output
eager's op makes, where a batch reads every row; a hundredth of it for a tree of the bench
TreeLSTM). A block recorded without a budget makes no room before ops (``RoomBeforeOps`` in
sim/simulator.py emulates the driver's), so making room for it would need a trace event of
its own.

Deferred ops are costed by the roofline estimate (cost.py) under either cost mode: they do not
run, so there is no time to measure; a replay measures its own.
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["SCATTERS", "add_into", "deferred_size"]

aten = torch.ops.aten
_SELECT_BACKWARD = aten.select_backward.default
_SLICE_BACKWARD = aten.slice_backward.default
_EMBEDDING_BACKWARD = aten.embedding_dense_backward.default

# Names of the ops deferred (ops.py marks their facts ``scatters``).
SCATTERS = frozenset(str(op) for op in (_SELECT_BACKWARD, _SLICE_BACKWARD, _EMBEDDING_BACKWARD))


def deferred_size(func, args) -> Optional[List[int]]:
    """The size of ``func(*args)``'s output where ``Runtime.defer`` may stand for it (Note
    [Scattered gradients]), else None. ``args[0]`` is the gradient (a wrapper)."""
    grad = args[0]
    if not grad.is_floating_point() or grad.layout is not torch.strided:
        return None
    if func is _EMBEDDING_BACKWARD:
        _, indices, num_weights, _, scale = args
        if scale or grad.device.type != "cpu" or not isinstance(num_weights, int):
            return None
        return [num_weights, grad.shape[-1]]
    if func is _SLICE_BACKWARD and args[5] != 1:
        return None
    sizes = args[1]
    if not all(isinstance(n, int) for n in sizes):
        return None
    return list(sizes)


def add_into(total: torch.Tensor, func, args) -> bool:
    """``total += func(*args)`` in place, bit for bit, without making ``func(*args)`` (Note
    [Scattered gradients]); False, with ``total`` unchanged, where it cannot be exact."""
    if func is _EMBEDDING_BACKWARD:
        return _add_rows(total, *args)
    if func is _SELECT_BACKWARD:
        grad, sizes, dim, index = args
        dim %= len(sizes)
        start = index % sizes[dim]
        stop = start + 1
        part = total.select(dim, start)
    else:
        grad, sizes, dim, start, stop, _ = args
        dim %= len(sizes)
        span = range(sizes[dim])[start:stop]  # the clamping of aten's slice, for step 1
        start, stop = span.start, max(span.stop, span.start)
        part = total.narrow(dim, start, stop - start)
    n = sizes[dim]
    if start:
        total.narrow(dim, 0, start).add_(0.0)
    if stop < n:
        total.narrow(dim, stop, n - stop).add_(0.0)
    part.add_(grad)
    return True


def _add_rows(total, grad, indices, num_weights, padding_idx, scale) -> bool:
    rows, position = torch.unique(indices.reshape(-1), sorted=True, return_inverse=True)
    pad = -1
    if padding_idx >= 0:
        hit = (rows == padding_idx).nonzero()
        if hit.numel():
            pad = int(hit[0, 0])
    part = _EMBEDDING_BACKWARD(grad, position.reshape(indices.shape), rows.numel(), pad, False)
    if bool((part == 0).logical_and_(part.signbit()).any()):
        return False
    total.add_(0.0)
    total.index_add_(0, rows, part)
    return True
