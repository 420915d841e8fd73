"""Random-number state: captured before a random op runs, restored when it is replayed.

A replayed dropout must draw the same mask (Invariant 4), and replays must not disturb the
program's own random stream. Captured: the generator the op uses (its ``generator=``
argument, or the default generator of its device). Restored inside a fork, so the stream the
program sees afterwards is exactly what it would have been without the replay.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Tuple

import torch

__all__ = ["capture", "restore", "restored"]


def _device_of(args, kwargs) -> torch.device:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b.device
    return torch.device("cpu")


def capture(args, kwargs) -> Tuple[Any, Any, Optional[int]]:
    """State to restore before replaying a random op called with these (unwrapped) args."""
    gen = kwargs.get("generator")
    if gen is not None:
        return ("generator", gen, gen.get_state())
    dev = _device_of(args, kwargs)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return ("cuda", idx, torch.cuda.get_rng_state(idx))
    return ("cpu", None, torch.get_rng_state())


def restore(state) -> None:
    """Set the random state ``capture`` returned (the stream the program sees goes back to it:
    an op that failed for lack of memory must not have advanced it)."""
    kind, where, saved = state
    if kind == "generator":
        where.set_state(saved)
    elif kind == "cuda":
        torch.cuda.set_rng_state(saved, where)
    else:
        torch.set_rng_state(saved)


@contextlib.contextmanager
def restored(state):
    """Run the body with the captured random state; the program's state is untouched after."""
    kind, where, _ = state
    if kind == "generator":
        current = (kind, where, where.get_state())
        restore(state)
        try:
            yield
        finally:
            restore(current)
    else:
        with torch.random.fork_rng(devices=[where] if kind == "cuda" else []):
            restore(state)
            yield
