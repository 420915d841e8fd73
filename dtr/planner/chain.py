"""The chain model shared by the planners, the simulator and the baselines.

A chain has stages ``1..L``; stage ``k`` maps the activation ``a^(k-1)`` to ``a^k`` (``a^0`` is the
chain's input). Backward ``B^k`` maps the gradient ``δ^k`` to ``δ^(k-1)``. Gradients have the size of
the activation they belong to (``|δ^k| = |a^k|``, ``|δ^0| = |a^0|``).

Note [Sizes of a stage]
~~~~~~~~~~~~~~~~~~~~~~~
``output_bytes[k-1]`` is ``|a^k|``, the tensor the next stage reads. ``saved_bytes[k-1]`` is
``|ā^k|``: everything autograd keeps to run ``B^k``, *including* ``a^k`` but not ``a^(k-1)``. A
measured ``ā`` smaller than ``a`` is noise (the rotor paper's table has one), so it is clamped up to
``|a^k|``. Overheads are transient bytes an operation needs on top of its inputs and outputs.

Note [The loss]
~~~~~~~~~~~~~~~
The chain ends where the caller's loss takes over: right after the first forward of stage ``L``,
the loss turns ``a^L`` into the seed gradient ``δ^L`` (``output_bytes[-1]`` bytes). A plain ``a^L``
is consumed by it; an ``ā^L`` (from ``F_all``) stays for ``B^L``. If the chain's last stage *is*
the loss, its output is a scalar and this step costs nothing. The step takes no time and appears in
no op list; its memory (everything stored plus ``δ^L``) counts towards the peak.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

__all__ = ["Chain", "Plan", "Op", "OP_KINDS", "REMAT_KINDS", "TRANSFER_KINDS"]

Number = Union[int, float]

#: One operation of a plan: ``(kind, stage)``, stage 1-based.
Op = Tuple[str, int]

#: Forward kinds: keep the input and the tape (``F_all``), keep the input and the output only
#: (``F_ck``), keep the output only (``F_none``). ``B`` is a stage's backward.
REMAT_KINDS = ("F_all", "F_ck", "F_none", "B")
#: Transfers of the stored input of a stage (``a^(k-1)`` or ``ā^(k-1)``) to the host and back.
TRANSFER_KINDS = ("offload", "prefetch")
OP_KINDS = REMAT_KINDS + TRANSFER_KINDS


def _number(name: str, value: object) -> Number:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Chain: {name} = {value!r} is not a number; give sizes and times as int or float")
    value = int(value) if isinstance(value, numbers.Integral) else float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Chain: {name} = {value!r}; times and sizes must be finite and >= 0")
    return value


@dataclass(frozen=True)
class Chain:
    """Costs of a chain of ``L`` stages, one list entry per stage ``1..L``.

    Args:
        forward_time: duration of ``F^k`` (any time unit, used consistently).
        backward_time: duration of ``B^k``.
        output_bytes: ``|a^k|``, the output activation of stage ``k`` (also ``|δ^k|``).
        saved_bytes: ``|ā^k|``, what ``F_all^k`` keeps for ``B^k`` including ``a^k``; values
            below ``output_bytes`` are raised to it (see Note [Sizes of a stage]).
        forward_overhead: transient bytes of ``F^k`` beyond its input and output.
        backward_overhead: transient bytes of ``B^k`` beyond ``δ^k``, ``ā^k``, ``a^(k-1)``, ``δ^(k-1)``.
        input_bytes: ``|a^0|``, the chain's input.

    Any consistent units work (bytes and seconds, MB and ms). Integer sizes keep every memory
    computation exact. Raises ValueError naming the first bad entry.
    """

    forward_time: Sequence[Number]
    backward_time: Sequence[Number]
    output_bytes: Sequence[Number]
    saved_bytes: Sequence[Number]
    forward_overhead: Sequence[Number]
    backward_overhead: Sequence[Number]
    input_bytes: Number

    def __post_init__(self) -> None:
        names = ("forward_time", "backward_time", "output_bytes", "saved_bytes",
                 "forward_overhead", "backward_overhead")
        columns = {}
        for name in names:
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise ValueError(f"Chain: {name} must be a sequence with one entry per stage, got {values!r}")
            columns[name] = tuple(_number(f"{name}[{i}]", v) for i, v in enumerate(values))
        lengths = {name: len(col) for name, col in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"Chain: every list needs one entry per stage; got lengths {lengths}")
        if lengths["forward_time"] == 0:
            raise ValueError("Chain: a chain needs at least one stage")
        columns["saved_bytes"] = tuple(
            max(saved, out) for saved, out in zip(columns["saved_bytes"], columns["output_bytes"]))
        for name, col in columns.items():
            object.__setattr__(self, name, col)
        object.__setattr__(self, "input_bytes", _number("input_bytes", self.input_bytes))

    @property
    def length(self) -> int:
        """``L``, the number of stages."""
        return len(self.forward_time)

    def activation_sizes(self) -> Tuple[List[Number], List[Number]]:
        """``(x, xb)`` indexed ``0..L``: ``x[k] = |a^k|``, ``xb[k] = |ā^k|`` (``xb[0] = x[0]``)."""
        x = [self.input_bytes, *self.output_bytes]
        xb = [self.input_bytes, *self.saved_bytes]
        return x, xb


@dataclass(frozen=True)
class Plan:
    """A schedule for one training step of a chain and what it costs.

    ``makespan`` and ``peak`` are what :func:`dtr.planner.evaluate` returns for ``ops`` with exact
    sizes (``peak`` includes the input ``a^0``). ``budget`` is the budget it was solved for and
    ``offload_bandwidth`` the bandwidth its transfers were timed with (None if it has none); pass
    both to ``evaluate`` to replay a plan with transfers.
    """

    ops: List[Op]
    makespan: float
    peak: Number
    budget: Number
    offload_bandwidth: Optional[float] = field(default=None)

    def __repr__(self) -> str:
        transfers = sum(kind in TRANSFER_KINDS for kind, _ in self.ops)
        return (f"Plan({len(self.ops)} ops, {transfers} transfers, makespan={self.makespan:.6g}, "
                f"peak={self.peak:.6g}, budget={self.budget:.6g})")
