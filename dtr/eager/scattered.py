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
memory (at most about the table's size, the output eager's op makes, where a batch reads every
row; a hundredth of it for a tree of the bench TreeLSTM). The driver makes room for the rows'
sums first (``scratch_bytes``: as many rows as indices, at most the table's;
``Runtime.reserve_scratch``, which traces record with or without a budget) and charges
nothing once the sum is done.

Deferred ops are costed by the roofline estimate (cost.py) under either cost mode: they do not
run, so there is no time to measure; a replay measures its own.

Note [Outer products]
~~~~~~~~~~~~~~~~~~~~~
A weight that a loop reads one row at a time (a tree's node, a batch of one) gets, per read,
a weight gradient that is an outer product: ``mm(g.t(), x)``, ``g`` 1 x m and ``x`` 1 x n, a
full weight's size, which autograd sums into the weight's running sum (through ``t`` views, as
a linear layer's backward lays it out). The bench TreeLSTMs make one of 3 to 6 MB per node
beside running sums of 12.7 and 18.4 MB: at their lowest budgets it is what does not fit.

Such an ``mm`` (one column by one row, in a backward pass) is deferred as the scatters are, and
so are the views taken of it before it is made (``Views._defer_view``: a view cell without a
value, over the unmade storage). A sum into a running sum that nothing else can see, whose
addend is the product or its transpose, adds it a block of rows at a time (``add_into``):
``total[r] += a[r] * b``. With one column each element of the product is one multiplication,
``round(a_i * b_j)``, whatever kernel computes it, so every block's bits are the product's.
The zero's sign is the exception: a kernel that starts from +0.0 and fuses the multiply with
the add gives +0.0 where the product is -0.0, which changes a sum only where the running sum
holds -0.0; ``add_into`` declines where it does (the output is then rebuilt), so the answer is
eager's bits in every case. A float32 product is deferred only at the ``highest`` matmul
precision, where the kernel multiplies the inputs unrounded (not as TF32 or bf16). A block (a
quarter of the product, 64 KiB to 1 MiB) is the sum's working memory: the driver makes room
for it before the sum (``scratch_bytes``, ``Runtime.reserve_scratch``) so that the true peak
stays within the budget, and charges nothing once the sum is done; where it cannot, the
product is made instead.
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["SCATTERS", "DEFERRED", "MM", "add_into", "deferred_size", "scratch_bytes"]

aten = torch.ops.aten
_SELECT_BACKWARD = aten.select_backward.default
_SLICE_BACKWARD = aten.slice_backward.default
_EMBEDDING_BACKWARD = aten.embedding_dense_backward.default
MM = aten.mm.default

# Names of the scatter ops (ops.py marks their facts ``scatters``, which keeps them off the
# native path); ``mm`` stays ``simple``, and the native path hands it back in a backward pass.
SCATTERS = frozenset(str(op) for op in (_SELECT_BACKWARD, _SLICE_BACKWARD, _EMBEDDING_BACKWARD))
# Names of every op ``Gradients._defer`` may record without running.
DEFERRED = SCATTERS | {str(MM)}

# Bytes of one block of an outer product's rows (Note [Outer products]): a quarter of the
# product, within these bounds (each block costs a few Python calls).
_BLOCK = 1 << 20
_SMALLEST_BLOCK = 1 << 16
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def deferred_size(func, args) -> Optional[List[int]]:
    """The size of ``func(*args)``'s output where ``Runtime.defer`` may stand for it (Note
    [Scattered gradients]), else None. ``args[0]`` is the gradient (a wrapper)."""
    grad = args[0]
    if not grad.is_floating_point() or grad.layout is not torch.strided:
        return None
    if func is MM:
        a, b = args
        if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != 1 or b.shape[0] != 1 or a.dtype not in _FLOATS
                or b.dtype != a.dtype or b.layout is not torch.strided or b.device != a.device):
            return None
        if not a.numel() or not b.numel() or (a.dtype is torch.float32 and not _full_float32()):
            return None  # an empty product costs nothing to make
        return [a.shape[0], b.shape[1]]
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


def _full_float32() -> bool:
    """Whether a float32 ``mm`` multiplies its inputs as they are: no TF32 or bf16 rounding
    of them (``torch.set_float32_matmul_precision``), which would give other bits than the
    exact products ``add_into`` sums."""
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # set per backend (torch.backends.*.fp32_precision): not known here
        return False


def add_into(total: torch.Tensor, func, args, transposed: bool = False) -> bool:
    """``total += func(*args)`` in place (``total += func(*args).t()`` where ``transposed``: an
    outer product's), bit for bit, without making ``func(*args)`` (Notes [Scattered gradients],
    [Outer products]); False, with ``total`` unchanged, where it cannot be exact."""
    if func is MM:
        return _add_outer(total.t() if transposed else total, *args)
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
    if _holds_negative_zero(part):
        return False
    total.add_(0.0)
    total.index_add_(0, rows, part)
    return True


def scratch_bytes(func, args) -> int:
    """Bytes of working memory ``add_into(total, func, args)`` allocates at most besides
    ``total``; the driver makes room for them first. An outer product: a block of rows (the
    zero test's masks before it are smaller), and the factors' magnitudes. An embedding
    gradient: its rows (as many as indices, at most the table's) with the zero test's two
    byte masks, and the distinct indices and index maps."""
    if func is MM:
        a, b = args
        block = min(_block_rows(a, b), a.shape[0]) * b.numel() * b.element_size()
        return block + (a.numel() + b.numel()) * a.element_size()
    if func is _EMBEDDING_BACKWARD:
        grad, indices, num_weights = args[:3]
        rows = min(indices.numel(), num_weights) * grad.shape[-1]
        return rows * (grad.element_size() + 2) + 3 * indices.numel() * 8
    return 0


def _block_rows(a, b) -> int:
    row = max(1, b.numel() * b.element_size())
    return max(1, min(_BLOCK, max(_SMALLEST_BLOCK, a.shape[0] * row // 4)) // row)


def _add_outer(total, a, b) -> bool:
    m = a.shape[0]
    rows = _block_rows(a, b)
    if _may_hold_zero(a, b):  # a zero product's sign is the kernel's: see the running sum's zeros
        for r in range(0, m, rows):
            if _holds_negative_zero(total[r : r + rows]):
                return False
    block = torch.empty((min(rows, m), b.shape[1]), dtype=b.dtype, device=b.device)
    for r in range(0, m, rows):
        k = min(rows, m - r)
        p = block[:k]
        torch.mul(a[r : r + k], b, out=p)
        total[r : r + k].add_(p)
    return True


def _holds_negative_zero(t) -> bool:
    return bool((t == 0).logical_and_(t.signbit()).any())


def _may_hold_zero(a, b) -> bool:
    """Whether some ``a_i * b_j`` may round to zero (or is NaN): a zero factor, or factors small
    enough to underflow, judged against the dtype's smallest normal (a flushed subnormal is a
    zero too)."""
    low = float(a.abs().amin()) * float(b.abs().amin())  # in double: no underflow here
    return not low >= torch.finfo(a.dtype).smallest_normal
