"""The true peak of some code, measured independently of dtr: torch.profiler's CPU allocation
events, or the CUDA caching allocator's counters.

dtr's own byte count (``Engine.stats().peak_resident_bytes``) cannot check itself, and misses
what kernels allocate internally. The profiler sees every allocation and free of the
allocator, so the running sum of its ``[memory]`` events, in time order, is the true number of
bytes allocated since profiling started (for tests, and for the benchmarks' measured peaks).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Tuple, Union

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["memory_events", "peak_bytes", "profiled_peak", "measured_peak", "left_allocated"]


def memory_events(prof) -> List[Tuple[int, int]]:
    """``(time in ns, bytes)`` of each allocation (positive) and free (negative) a finished
    ``torch.profiler.profile(profile_memory=True)`` saw, in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sorted((e.start_ns(), e.nbytes()) for e in events)


def peak_bytes(events: Iterable[Tuple[int, int]]) -> int:
    """The highest running sum of ``events``' bytes: the most bytes allocated at once since
    profiling started (memory allocated before and freed during can make the sum negative)."""
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return peak


def profiled_peak(fn: Callable[[], object]) -> int:
    """Run ``fn()`` under the profiler; the most bytes it had allocated at once."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return peak_bytes(memory_events(prof))


def measured_peak(fn: Callable[[], object], device: Union[str, torch.device] = "cpu") -> int:
    """Run ``fn()``; the most bytes it had allocated at once on ``device``, above what was
    allocated before: ``torch.cuda.max_memory_allocated`` on CUDA, ``profiled_peak`` elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return profiled_peak(fn)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def left_allocated(fn: Callable[[], object], device: Union[str, torch.device] = "cpu") -> int:
    """Run ``fn()``; the bytes it left allocated on ``device`` (allocated and not freed): the
    sum of the profiler's memory events on CPU, the change in ``torch.cuda.memory_allocated``
    on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return sum(nbytes for _, nbytes in memory_events(prof))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - base
