"""What torch.distributed's data-parallel wrappers need from a ``dtr.budget`` block.

- DDP: on the first forward after its buckets' order was learned (usually the second step),
  ``DistributedDataParallel`` rebuilds its gradient buckets in C++
  (``Reducer._rebuild_buckets``), which allocates them through the dispatcher and reads their
  data directly; inside a block those allocations came back as wrappers without data
  ("The tensor has a non-zero number of elements, but its data is not allocated yet"). The
  rebuild runs here first, outside the mode, so the buckets are plain tensors, constants like
  the ones DDP made at construction. DDP's own call then finds nothing left to rebuild.
- FSDP2 (``fully_shard``): Note [FSDP2].

Note [FSDP2]
~~~~~~~~~~~~
FSDP2 gathers a module's parameters before its forward and its backward, and reduces and
frees them after. That work is on parameters and gradients, not activations, and FSDP
resizes its buffers' storage, which a wrapper does not have: its parameter groups' gathers,
frees and gradient reductions run untracked (``Driver.untracked``), so the gathered
parameters are plain constants like any other parameter. What the engine must be told:

- FSDP frees a gathered parameter by resizing its storage to zero, which no dispatch mode
  sees. Before it does (``FSDPParam.free_unsharded_param``), the ops recorded on it are
  retired (``Runtime.retire``): what the program still references that they could be needed
  to recompute is made resident and permanent. A group's reshard frees all its parameters,
  so their ops are retired together, at its first free: one search of the graph per group,
  and an ``OutOfBudgetError`` there leaves every parameter gathered. With
  ``reshard_after_forward=True`` (FSDP2's default below the root) that is every output of a
  layer's parameter ops still referenced when the layer's forward ends, such as a linear
  layer's output an activation's replay needs, so they stay resident until their backward;
  with ``reshard_after_forward=False`` the parameters stay gathered until the layer's own
  backward, after which nothing needs them, and dtr evicts as freely as without FSDP.
- After its reduction, a gradient lives in the sharded parameter's ``.grad`` (or, without
  gradient sync, in FSDP's accumulation buffer): the charge of held gradients moves there
  (``Driver.hold_gradient``), by each gradient's own bytes (the sharded gradients of a
  group are views of one buffer).

Not charged: FSDP's gathered parameters and its communication buffers (constants, like the
parameters of a model without FSDP), the memory of a collective's outputs.

These are FSDP2's internals (``FSDPParamGroup``, ``FSDPParam``): tested with torch 2.13 (CPU,
gloo), present under these names since 2.4; on a torch where they are not found, FSDP2
modules in a block are refused with a ``DTRError`` rather than run with wrong memory
accounting. An ``OutOfBudgetError`` raised on one rank only leaves the others waiting in
their next collective until the process group's timeout, as any exception there does.

The hooks are installed only while a block is open in a process where ``torch.distributed``
is initialized: a global forward pre-hook takes every module off ``nn.Module``'s fast call
path.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from dtr.errors import DTRError
from dtr.log import warn

__all__ = ["register"]

# FSDPParamGroup methods that manage parameters and gradients (run untracked).
_GROUP_METHODS = ("lazy_init", "unshard", "wait_for_unshard", "reshard", "post_backward", "finalize_backward")
_fsdp2_ready: Optional[bool] = None  # whether FSDP2's internals were found and wrapped
_warned: "weakref.WeakSet" = weakref.WeakSet()  # drivers told about reshard_after_forward
_RESHARD_WARNING = (
    "dtr: FSDP2 frees a module's gathered parameters after its forward (reshard_after_forward=True, "
    "FSDP2's default below the root): what was computed from them cannot be recomputed before "
    "backward gathers them again, so dtr keeps it resident and can evict little. To let dtr "
    "evict, keep the parameters gathered until backward: fully_shard(..., reshard_after_forward=False) "
    "or module.set_reshard_after_forward(False)."
)


def register() -> Optional[Any]:
    """Install the forward pre-hook for this block (and, once per process, FSDP2's wrappers);
    its handle, or None where no process group is initialized."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    global _fsdp2_ready
    if _fsdp2_ready is None:
        _fsdp2_ready = _wrap_fsdp2()
    return torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)


def _before_forward(module: torch.nn.Module, args) -> None:
    reducer = getattr(module, "reducer", None)
    if reducer is not None and isinstance(module, torch.nn.parallel.DistributedDataParallel):
        if torch.is_grad_enabled():  # DDP rebuilds only then, too
            with _disable_current_modes():
                if reducer._rebuild_buckets():
                    module._has_rebuilt_buckets = True
    elif not _fsdp2_ready and any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
        raise DTRError(
            f"dtr: FSDP2 (fully_shard) is not supported inside dtr.budget with torch {torch.__version__}: "
            "its internals (FSDPParamGroup, FSDPParam) are not the ones dtr was written against (torch 2.13). "
            "Use DistributedDataParallel, or FSDP2 without dtr."
        )


def _active_driver():
    """The driver of the dtr block whose mode is on this thread's stack, or None."""
    from dtr.eager.mode import DTRMode

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if type(mode) is DTRMode:
            return mode.driver
    return None


def _wrap_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        try:  # torch 2.4, 2.5
            from torch.distributed._composable.fsdp._fsdp_param import FSDPParam
            from torch.distributed._composable.fsdp._fsdp_param_group import FSDPParamGroup
        except ImportError:
            return False
    if not (all(hasattr(FSDPParamGroup, m) for m in _GROUP_METHODS) and hasattr(FSDPParam, "free_unsharded_param")):
        return False
    for name in _GROUP_METHODS:
        setattr(FSDPParamGroup, name, _untracked(getattr(FSDPParamGroup, name)))
    FSDPParamGroup.post_backward = _moving_gradients(FSDPParamGroup.post_backward)
    FSDPParamGroup.reshard = _resharding(FSDPParamGroup.reshard)
    FSDPParam.free_unsharded_param = _retiring(FSDPParam.free_unsharded_param)
    return True


# driver -> [the parameters of the group it is resharding, whether their ops are retired]
_resharded: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _resharding(reshard):
    @functools.wraps(reshard)
    def run(group, *args, **kwargs):
        driver = _active_driver()
        if driver is None:
            return reshard(group, *args, **kwargs)
        _resharded[driver] = [group.fsdp_params, False]
        try:
            return reshard(group, *args, **kwargs)
        finally:
            del _resharded[driver]

    return run


def _gathered(param) -> list:
    return [
        t
        for t in (
            *getattr(param, "all_gather_outputs", ()),
            *getattr(param, "_unsharded_inner_tensors", ()),
            getattr(param, "_unsharded_param", None),
        )
        if t is not None
    ]


def _untracked(method):
    @functools.wraps(method)
    def run(*args, **kwargs):
        driver = _active_driver()
        if driver is None:
            return method(*args, **kwargs)
        with driver.untracked():
            return method(*args, **kwargs)

    return run


def _retiring(free):
    @functools.wraps(free)
    def run(param, *args, **kwargs):
        driver = _active_driver()
        if driver is not None:
            if torch._C._current_graph_task_id() == -1 and driver not in _warned:  # not in backward
                _warned.add(driver)
                warn(_RESHARD_WARNING, stacklevel=2)
            # A group's reshard frees all its parameters: one search of the graph for them all,
            # at the first free (each search visits every storage).
            group = _resharded.get(driver)
            if group is None or not any(p is param for p in group[0]):
                driver.constants.before_freed(_gathered(param))
            elif not group[1]:
                driver.constants.before_freed([t for p in group[0] for t in _gathered(p)])
                group[1] = True
        return free(param, *args, **kwargs)

    return run


def _moving_gradients(post_backward):
    @functools.wraps(post_backward)
    def run(group, *args, **kwargs):
        driver = _active_driver()
        if driver is None:
            return post_backward(group, *args, **kwargs)
        # A sharded gradient that existed before (zero_grad(set_to_none=False), an earlier
        # step's) is accumulated into in place: no new memory to charge.
        before = [p.sharded_param.grad for p in group.fsdp_params]
        out = post_backward(group, *args, **kwargs)
        with driver.untracked():
            for p, old in zip(group.fsdp_params, before):
                gathered = getattr(p, "_unsharded_param", None)
                if gathered is not None:
                    accumulated = getattr(p, "unsharded_accumulated_grad", None)
                    driver.hold_gradient(gathered, [gathered.grad, accumulated])
                grad = p.sharded_param.grad
                if grad is not old:
                    driver.hold_gradient(p.sharded_param, [grad])
        return out

    return run
