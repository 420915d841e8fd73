"""Copies between a storage and the host tier, for the runtime's swapping (core/host_tier.py).

On CUDA a swap-out copies the whole storage into a new pinned host buffer on a side stream,
after the work that produced it (the side stream waits for the current one); the device tensor
is held by the handle until the copy's event has completed, so its memory is never reused while
the copy reads it. A swap-in copies back on the side stream into a new device buffer and makes
the current stream wait for that copy's event: compute never reads a buffer before its copy has
finished, without the host waiting. Each swap uses its own host buffer, so no buffer is reused
before its copy has left.

A prefetch (a swap-in ahead of need) copies back on the side stream into a buffer from the side
stream's own pool, without waiting for the current stream, so the copy runs beside the compute
already queued; the current stream waits for its event only when the engine first reads the
value (``arrive``, Note [Arrival] in core/host_tier.py).

On CPU (no accelerator: the tests' machines) the host tier is a separate copy of the data, made
synchronously; the same logic runs, without the overlap (a prefetch's copy is made on arrival).

``HostCopies`` is how the runtime reaches these functions: the swapping half of its
``Executor`` (core/runtime.py), which the driver inherits.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import torch

from dtr.eager.replay import clone_root

__all__ = ["HostCopies", "HostCopy", "swap_out", "swap_in", "prefetch", "arrive", "measure_bandwidth"]

_no_python_dispatch = torch._C._DisableTorchDispatch
_streams: Dict[torch.device, Any] = {}
_bandwidth: Dict[str, float] = {}


class HostCopy:
    """A storage's data on the host, and how to view it again."""

    __slots__ = ("host", "size", "stride", "offset", "dtype", "device", "event", "pending")

    def __init__(self, host: torch.Tensor, like: torch.Tensor, event=None, pending=None) -> None:
        self.host = host
        self.size, self.stride, self.offset = like.size(), like.stride(), like.storage_offset()
        self.dtype, self.device = like.dtype, like.device
        self.event = event  # CUDA: the copy's completion
        self.pending = pending  # CUDA: the device tensor, held until the copy has read it

    def done(self) -> bool:
        """Whether the copy out has finished (the device memory can be reused)."""
        if self.pending is not None and self.event.query():
            self.pending = None
        return self.pending is None

    def wait(self) -> None:
        """Block until the copy out has finished."""
        self.event.synchronize()
        self.done()


class HostCopies:
    """The swapping half of the runtime's ``Executor`` (core/runtime.py): handles are
    ``HostCopy`` objects. The runtime swaps from inside an op's dispatch and from outside it
    (a budget lowered between ops), so each copy runs with Python dispatch off: the copies'
    own ops are no program's. Each method calls the module function of its name, looked up
    when called (tests replace them)."""

    swap_done = staticmethod(HostCopy.done)
    swap_wait = staticmethod(HostCopy.wait)

    @staticmethod
    def swap_out(value: torch.Tensor) -> HostCopy:
        with _no_python_dispatch():
            return swap_out(value)

    @staticmethod
    def swap_in(handle: HostCopy) -> Tuple[torch.Tensor, float]:
        with _no_python_dispatch():
            return swap_in(handle)

    @staticmethod
    def prefetch(handle: HostCopy) -> Tuple[torch.Tensor, Any]:
        with _no_python_dispatch():
            return prefetch(handle)

    @staticmethod
    def arrive(pending: Any) -> None:
        with _no_python_dispatch():
            arrive(pending)


def _side_stream(device: torch.device):
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device=device)
    return s


def swap_out(value: torch.Tensor) -> HostCopy:
    """Start copying ``value``'s storage to the host."""
    if value.device.type != "cuda":
        return HostCopy(clone_root(value), value)
    storage = value.untyped_storage()
    src = torch.empty(0, dtype=torch.uint8, device=value.device).set_(storage)
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
    stream = _side_stream(value.device)
    stream.wait_stream(torch.cuda.current_stream(value.device))
    with torch.cuda.stream(stream):
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return HostCopy(host, value, event, pending=src)


def swap_in(copy: HostCopy) -> Tuple[torch.Tensor, float]:
    """The data back as a tensor viewed like the original; and the seconds the host waited."""
    t0 = time.perf_counter()
    if copy.device.type != "cuda":
        return copy.host, time.perf_counter() - t0
    stream = _side_stream(copy.device)
    buf = torch.empty(copy.host.numel(), dtype=torch.uint8, device=copy.device)
    stream.wait_stream(torch.cuda.current_stream(copy.device))
    with torch.cuda.stream(stream):
        buf.copy_(copy.host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    torch.cuda.current_stream(copy.device).wait_event(event)
    buf.record_stream(torch.cuda.current_stream(copy.device))
    value = torch.empty(0, dtype=copy.dtype, device=copy.device).set_(
        buf.untyped_storage(), copy.offset, copy.size, copy.stride
    )
    return value, time.perf_counter() - t0


def prefetch(copy: HostCopy) -> Tuple[torch.Tensor, Any]:
    """Start copying the data back without waiting for it: a tensor viewed like the original,
    not to be read before ``arrive(pending)``, and ``pending`` (engine: Note [Arrival])."""
    if copy.device.type != "cuda":
        # The copy is made on arrival: on CPU there is nothing to overlap, and a read that
        # skipped ``arrive`` would see no data (the tests poison the buffer to catch one).
        storage = torch.UntypedStorage(copy.host.untyped_storage().nbytes())
        value = copy.host.new_empty((0,)).set_(storage, copy.offset, copy.size, copy.stride)
        return value, (value, copy.host)
    stream = _side_stream(copy.device)
    if copy.pending is not None:
        # Its copy out may not have run yet, and the handle (the only reference to the device
        # tensor it reads) is about to go: keep that memory from the compute stream until then.
        copy.pending.record_stream(stream)
    with torch.cuda.stream(stream):
        # From the side stream's pool, so that no wait on the compute stream is needed: the
        # host buffer was filled earlier on this same stream. The copy starts at once, beside
        # the compute already queued.
        buf = torch.empty(copy.host.numel(), dtype=torch.uint8, device=copy.device)
        buf.copy_(copy.host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    value = torch.empty(0, dtype=copy.dtype, device=copy.device).set_(
        buf.untyped_storage(), copy.offset, copy.size, copy.stride
    )
    return value, (buf, event)


def arrive(pending: Any) -> None:
    """Order every later read of a prefetched value after its copy (the host does not wait)."""
    buf, how = pending
    if isinstance(how, torch.Tensor):  # CPU: the copy itself, of the whole storage
        buf.untyped_storage().copy_(how.untyped_storage())
        return
    current = torch.cuda.current_stream(buf.device)
    current.wait_event(how)
    buf.record_stream(current)  # its memory goes back to the side stream: not before these reads


def measure_bandwidth(device: Optional[torch.device] = None, nbytes: int = 64 * 2**20) -> float:
    """Bytes per second of one copy direction to the host tier, measured once per device
    type: a pinned device-to-host copy on CUDA, a memory copy on CPU."""
    kind = device.type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind in _bandwidth:
        return _bandwidth[kind]
    with _no_python_dispatch():
        if kind == "cuda":
            src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dst.copy_(src)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        else:
            src = torch.empty(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            dst.copy_(src)
            t0 = time.perf_counter()
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    _bandwidth[kind] = nbytes / max(seconds, 1e-9)
    return _bandwidth[kind]
