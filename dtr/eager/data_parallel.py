"""What torch.distributed's data-parallel wrappers need from a ``dtr.budget`` block.

- DDP: on the first forward after its buckets' order was learned (usually the second step),
  ``DistributedDataParallel`` rebuilds its gradient buckets in C++
  (``Reducer._rebuild_buckets``), which allocates them through the dispatcher and reads their
  data directly; inside a block those allocations came back as wrappers without data
  ("The tensor has a non-zero number of elements, but its data is not allocated yet"). The
  rebuild runs here first, outside the mode, so the buckets are plain tensors, constants like
  the ones DDP made at construction. DDP's own call then finds nothing left to rebuild.
- FSDP2 (``fully_shard``) is refused with a ``DTRError``. After each forward it frees the
  unsharded parameters by resizing their storage to zero, which no dispatch mode sees, so the
  recorded ops that read them could no longer be replayed; and its all-gather buffers, made
  inside the block, would be wrappers whose storage cannot be resized.

The hook is registered only while a block is open in a process where ``torch.distributed`` is
initialized: a global forward pre-hook takes every module off ``nn.Module``'s fast call path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dtr.errors import DTRError

__all__ = ["register"]


def register() -> Optional[Any]:
    """Install the forward pre-hook for this block; its handle, or None where no process group
    is initialized."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)


def _before_forward(module: torch.nn.Module, args) -> None:
    reducer = getattr(module, "reducer", None)
    if reducer is not None and isinstance(module, torch.nn.parallel.DistributedDataParallel):
        if torch.is_grad_enabled():  # DDP rebuilds only then, too
            with _disable_current_modes():
                if reducer._rebuild_buckets():
                    module._has_rebuilt_buckets = True
    elif any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
        raise DTRError(
            "dtr: FSDP2 (fully_shard) is not supported inside dtr.budget: it frees the unsharded "
            "parameters after each forward by resizing their storage, so the ops dtr recorded "
            "could not be recomputed. Use DistributedDataParallel, or FSDP2 without dtr."
        )
