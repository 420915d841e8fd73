"""Facts about aten ops, read once from their schemas and cached per overload.

Dispatch is the hot path, so everything the driver needs to know about an op (does it return
views? which arguments does it write? is it random?) is computed on first sight and kept in
an ``OpFacts`` keyed by the ``OpOverload`` (reading a schema costs ~0.5 µs, a tag lookup
~1 µs; a dict hit ~50 ns).

Schemas are right for almost every op. Two tables cover where they are not:

- ``_UNDECLARED_VIEWS``: ops whose output shares its input's storage although the schema
  says it does not (``_unsafe_view`` after ``matmul``, ``unsafe_split`` in ``LSTMCell``).
  Found by running the test models under a probe that compared storages of inputs and
  outputs of every op.
- ``_HIDDEN_WRITES``: batch-norm kernels update ``running_mean``/``running_var`` in training
  mode. ``native_batch_norm`` does so without a write annotation. Their outputs do not depend
  on the running statistics in training mode, so a replay passes ``None`` (or clones, where
  the schema demands tensors) and the statistics are updated exactly once.
"""

from __future__ import annotations

import enum
from typing import Dict, Optional, Tuple

import torch

from dtr.eager.scattered import SCATTERS

__all__ = ["Kind", "OpFacts", "facts_for", "FACTS", "program_returns", "written_argument"]

aten = torch.ops.aten


class Kind(enum.IntEnum):
    COMPUTE = 0
    """Outputs are new storages (or no tensors at all)."""
    VIEW = 1
    """Outputs are views of the argument ``view_of``."""
    WRITE = 2
    """Writes some arguments in place (in-place and ``out=`` ops)."""
    DETACH = 3
    """``detach``/``alias``: a new tensor object over the very same view."""
    INPLACE_VIEW = 4
    """Changes the view metadata of its first argument (``unsqueeze_``, ``transpose_``...)."""
    UNSUPPORTED = 5
    """Replaces a tensor's storage (``set_``, ``resize_``); not supported on managed tensors."""
    COLLECTIVE = 6
    """Communicates with other processes (``c10d``, functional collectives): run once, never
    replayed (Note [Collectives])."""


# Return kinds, one per schema return.
FRESH = 0
VIEW = 1
WRITTEN = 2
OTHER = 3


class OpFacts:
    """Everything dispatch needs to know about one op overload."""

    __slots__ = (
        "func",
        "kernel",
        "name",
        "kind",
        "view_of",
        "written",
        "returns",
        "random",
        "hidden_writes",
        "training_arg",
        "replay_stats",
        "functional",
        "plain_outputs",
        "placeholder",
        "simple",
        "several",
        "in_place",
        "one_view",
        "list_view",
        "sized",
        "scatters",
    )

    def __init__(self, func) -> None:
        self.func = func
        # What OpOverload.__call__ calls: calling it directly spares that Python frame (0.7 us
        # of the 3.3 us an add of two 64x64 tensors takes through the overload, on the 2-core VM).
        self.kernel = func._op
        self.name = str(func)
        self.kind = Kind.COMPUTE
        self.view_of: Optional[int] = None
        # Written arguments: (position, None) or (None, kwarg name).
        self.written: Tuple[Tuple[Optional[int], Optional[str]], ...] = ()
        # Per schema return: (kind, is_list, written-argument key or None).
        self.returns: Tuple[Tuple[int, bool, object], ...] = ()
        self.random = False
        self.hidden_writes: Tuple[int, ...] = ()
        self.training_arg: Optional[int] = None
        self.replay_stats: Optional[str] = None  # "none" or "clone" for running statistics
        self.functional = None  # out-of-place twin of an INPLACE_VIEW op
        self.plain_outputs: Tuple[int, ...] = ()  # flat output positions returned unwrapped
        self.placeholder = False  # returns uninitialized memory (see _PLACEHOLDERS)
        self.simple = False  # the common case: writes nothing, returns one new tensor
        # Writes nothing and returns this many new tensors (two or more, each maybe None or
        # empty: convolution_backward, var_mean); 0 otherwise.
        self.several = 0
        # Writes its first argument and returns it, writes nothing else and draws no random
        # numbers (``add_``, ``sigmoid_``, ``relu_``): the native path runs it (hotpath.c).
        self.in_place = False
        self.one_view = False  # a view op returning one view of its only tensor argument
        self.list_view = False  # a view op returning a list of views of its only tensor argument
        # Its output sizes may be found before it runs (output_size.py: a rule, or a run on the
        # meta device): an aten op returning a new tensor. Other namespaces' kernels may be
        # Python code with side effects (printing, profiler ranges), which a meta run would repeat.
        self.sized = False
        # Its output is zeros with a gradient written into part of them: deferred in a backward
        # pass (Note [Scattered gradients] in scattered.py), so never ``simple``, which the
        # native path would run.
        self.scatters = False

    def __repr__(self) -> str:
        return f"OpFacts({self.name}, {self.kind.name})"


FACTS: Dict[object, OpFacts] = {}

_UNDECLARED_VIEWS = {
    "aten::_unsafe_view",
    "aten::unsafe_split",
    "aten::unsafe_split_with_sizes",
    "aten::unsafe_chunk",
}

# op name -> (index of the `training` argument or None if always training, indices of the
# running statistics, how a replay passes them).
_HIDDEN_WRITES = {
    "aten::native_batch_norm": (5, (3, 4), "none"),
    "aten::cudnn_batch_norm": (5, (3, 4), "none"),
    "aten::miopen_batch_norm": (5, (3, 4), "none"),
    "aten::_native_batch_norm_legit": (5, (3, 4), "clone"),
    "aten::_batch_norm_with_update": (None, (3, 4), "clone"),
}

_UNSUPPORTED = {"aten::set_", "aten::resize_", "aten::resize_as_", "aten::_resize_output_"}

# Note [Collectives]
# ~~~~~~~~~~~~~~~~~~
# Ops of these namespaces talk to other ranks. Replaying one would send or wait for data that
# no other rank sends again (a hang, or another rank's next message read as this one), so they
# run once and nothing they write or make is recomputable. ``c10d::`` schemas declare no
# writes, although every op of the namespace but those in ``_C10D_READ_ONLY`` writes its first
# argument (``allreduce_`` its tensors, ``_allgather_base_`` its output, ``recv_`` its
# buffers) and returns it; the functional collectives' schemas are right.
_COLLECTIVE_NAMESPACES = ("c10d::", "_c10d_functional::", "c10d_functional::", "_dtensor::")
_C10D_READ_ONLY = {"c10d::send", "c10d::check_for_nan"}

# Outputs that C++ code reads directly, outside dispatch, or keeps beyond the block (so they
# cannot be wrappers), by position in the flattened results; like constants, they are not
# charged. ``batch_sizes`` is a small index tensor computed from constants. cuDNN's dropout
# state (several MiB, made by the first ``nn.LSTM``/``nn.GRU`` with dropout on a device) is
# cached by ATen for the process and reused by every later RNN call, in blocks and out of them.
_PLAIN_OUTPUTS = {
    "aten::_pack_padded_sequence": (1,),  # batch_sizes, read by the RNN kernels' C++ code
    "aten::_cudnn_init_dropout_state": (0,),
}

# Ops whose output is uninitialized memory. When it has at most one element it is a
# placeholder that code swaps a storage into (copy.deepcopy: new_empty([]) then set_), and it
# must keep the type of a plain tensor; larger ones (dropout masks) are managed as usual.
_PLACEHOLDERS = {"aten::empty", "aten::new_empty", "aten::empty_strided", "aten::new_empty_strided", "aten::empty_like"}


def written_argument(key: Tuple[Optional[int], Optional[str]], args, kwargs):
    """The program's own tensor for the written argument ``key`` (``(position, None)`` or
    ``(None, keyword)``, as in ``OpFacts.written`` and ``OpFacts.returns``)."""
    pos, name = key
    return args[pos] if pos is not None else kwargs[name]


def program_returns(facts: OpFacts, out, args, kwargs):
    """``out`` as the program sees it: the returns of in-place and ``out=`` ops are the tensor
    objects the program passed (``x.add_(y) is x``), never the kernel's."""
    returns = facts.returns
    if not any(rk == WRITTEN for rk, _, _ in returns):
        return out
    if len(returns) == 1:
        return written_argument(returns[0][2], args, kwargs)
    return tuple(written_argument(key, args, kwargs) if rk == WRITTEN else o for (rk, _, key), o in zip(returns, out))

def _functional_twin(func, base: str):
    """The out-of-place overload of in-place view op ``func`` (``transpose_.default`` ->
    ``transpose.int``): the overload of ``base`` with the same arguments. Overload names do
    not always match."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = getattr(aten, base)
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if [(a.name, str(a.type)) for a in op._schema.arguments] == want:
            return op
    raise NotImplementedError(f"dtr: no out-of-place form of {func} found among aten.{base}'s overloads")


def facts_for(func) -> OpFacts:
    """The (cached) facts of ``func``."""
    f = FACTS.get(func)
    if f is None:
        f = FACTS[func] = _compute(func)
    return f


def _compute(func) -> OpFacts:
    f = OpFacts(func)
    schema = func._schema
    name = schema.name
    tags = func.tags
    f.random = torch.Tag.nondeterministic_seeded in tags
    f.plain_outputs = _PLAIN_OUTPUTS.get(name, ())
    f.placeholder = name in _PLACEHOLDERS

    arg_sets = {}
    written = []
    wildcard = None  # the argument written as `Tensor(a -> *)`: list-returning views alias it
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None:
            continue
        key = (None, a.name) if a.kwarg_only else (i, None)
        for s in info.before_set:
            arg_sets[s] = (key, info.is_write)
        if "*" in info.after_set and wildcard is None:
            wildcard = (key, info.is_write)
        if info.is_write:
            written.append(key)

    returns = []
    for r in schema.returns:
        is_list = isinstance(r.type, torch.ListType)
        info = r.alias_info
        tensorish = is_list or isinstance(r.type, torch.TensorType) or (
            isinstance(r.type, torch.OptionalType) and isinstance(r.type.getElementType(), torch.TensorType)
        )
        if not tensorish:
            returns.append((OTHER, False, None))
        elif info is None:
            returns.append((FRESH, is_list, None))
        else:
            # `Tensor(a)[]` carries its alias set on the element type, not on the return.
            key, is_write = next(
                (arg_sets[s] for s in info.before_set if s in arg_sets), wildcard or (None, False)
            )
            if key is None:
                raise NotImplementedError(f"dtr: cannot tell which argument {func} aliases")
            if is_write:
                returns.append((WRITTEN, is_list, key))
            else:
                returns.append((VIEW, is_list, key))
    f.returns = tuple(returns)
    f.written = tuple(written)

    if name.startswith(_COLLECTIVE_NAMESPACES):
        f.kind = Kind.COLLECTIVE
        if name.startswith("c10d::") and name not in _C10D_READ_ONLY:
            first = schema.arguments[0]
            f.written = ((None, first.name) if first.kwarg_only else (0, None),)
    elif name in _UNSUPPORTED:
        f.kind = Kind.UNSUPPORTED
    elif name in ("aten::detach", "aten::alias"):
        f.kind = Kind.DETACH
        f.view_of = 0
    elif torch.Tag.inplace_view in tags:
        f.kind = Kind.INPLACE_VIEW
        f.view_of = 0
        f.functional = _functional_twin(func, name.split("::")[1].rstrip("_"))
    elif name in _HIDDEN_WRITES:
        f.training_arg, f.hidden_writes, f.replay_stats = _HIDDEN_WRITES[name]
        f.written = ()  # handled through hidden_writes, whatever the schema says
        f.returns = tuple((FRESH, False, None) for _ in schema.returns)
    elif written:
        f.kind = Kind.WRITE
        f.in_place = (f.written == ((0, None),) and f.returns == ((WRITTEN, False, (0, None)),)
                      and not f.random)
    elif name in _UNDECLARED_VIEWS:
        f.kind = Kind.VIEW
        f.view_of = 0
        f.returns = tuple((VIEW, is_list, (0, None)) for _, is_list, _ in returns)
    elif f.returns == ((FRESH, False, None),) and not f.plain_outputs and not f.placeholder:
        f.scatters = f.name in SCATTERS
        f.simple = not f.scatters
    elif (len(f.returns) > 1 and set(f.returns) == {(FRESH, False, None)}
          and not f.plain_outputs and not f.placeholder):
        f.several = len(f.returns)
    elif any(k == VIEW for k, _, _ in returns):
        views = {key for k, _, key in returns if k == VIEW}
        if all(k == VIEW for k, _, _ in returns) and len(views) == 1:
            (key,) = views
            if key[0] is not None:
                f.kind = Kind.VIEW
                f.view_of = key[0]
        if f.kind is not Kind.VIEW:
            raise NotImplementedError(
                f"dtr: {f.name} returns views of several arguments or mixes views with new "
                "tensors; please report this op"
            )
    if f.plain_outputs and any(is_list for _, is_list, _ in f.returns):
        # Plain positions count flattened outputs; ``sized`` below counts schema returns.
        raise NotImplementedError(f"dtr: plain outputs of {f.name}, which returns a list, are not supported")
    f.sized = f.kind is Kind.COMPUTE and name.startswith("aten::") and any(
        k == FRESH for i, (k, _, _) in enumerate(f.returns) if i not in f.plain_outputs)
    if f.kind is Kind.VIEW and not any(
            _holds_tensors(a.type) for i, a in enumerate(schema.arguments) if i != f.view_of):
        f.one_view = f.returns == ((VIEW, False, (f.view_of, None)),)
        f.list_view = f.returns == ((VIEW, True, (f.view_of, None)),)
    return f


def _holds_tensors(t) -> bool:
    """Whether an argument of schema type ``t`` can be or contain a tensor."""
    if isinstance(t, (torch.OptionalType, torch.ListType)):
        t = t.getElementType()
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
    return isinstance(t, torch.TensorType)
