"""The only module that knows about ``dtr_ext._hotpath``: the eager driver's per-op path in one
native call (hotpath.c's header lists what it runs and what it leaves to Python).

``run_simple(driver, facts, func, args, kwargs={})`` runs an op of ``facts.simple``,
``facts.several`` or ``facts.in_place`` as ``Driver._run`` does, or returns ``FALLBACK`` having
changed nothing (but wrappers resolved to their storage's newest version, which the Python
path does first too), for the Python path to run it (hotpath.c says when).
``dispatcher(driver)`` is ``driver.dispatch`` with its preamble native too (the lock, queued
wrapper deaths, the autograd node); it runs those ops with ``run_simple``'s code, view ops
returning one view or a list of them, ``detach`` and views of constants itself, and hands the
others to ``Driver._route``: a ``Driver`` installs it as its ``dispatch``. The Python code stays the definition of what an op does; the native path mirrors
it, and tests/test_native.py checks that both build the same records and make the same
decisions. Without the native module (no C compiler at install, or ``DTR_PUREPYTHON=1`` at
import) ``run_simple`` is None and every op takes the Python path; ``NATIVE`` tells which is in
use, and ``WHY_NOT`` why not.
"""

from __future__ import annotations

import heapq
import os
from time import perf_counter
from types import MappingProxyType
from typing import Any, Callable, Optional

import torch

from dtr.core import candidates, collector, heuristics
from dtr.core.candidates import CandidateIndex
from dtr.core.heuristics import DTREq
from dtr.core.outputs import fit
from dtr.core.unionfind import UFNode
from dtr.core.runtime import Ref, Runtime
from dtr.core.storage import EVICTED, EXTERNAL, RELEASED, RESIDENT, SWAPPED, Cell, OpRecord, Storage
from dtr.eager import accumulation, output_size
from dtr.eager.constants import Constants
from dtr.eager.cost import estimate_seconds
from dtr.eager.ops import FACTS, Kind, OpFacts, facts_for
from dtr.eager.replay import Call
from dtr.eager.tensor import DTRTensor

__all__ = ["FALLBACK", "NATIVE", "WHY_NOT", "bind_driver", "dispatcher", "ordinary", "registered", "release",
           "run_simple", "wrapper_death"]

FALLBACK = object()
"""What ``run_simple`` returns when the Python path must run the op."""

# Constants of both paths: keyword arguments of an op called without any (read only: no dict
# made per op), and ``Call.fresh`` of a simple op (its one output is fresh).
NO_KWARGS = MappingProxyType({})
FIRST = (0,)


def _config() -> dict:
    """What ``_hotpath.bind`` needs: the classes, functions and constants the native path uses."""
    return {
        "Runtime": Runtime, "Tensor": torch.Tensor, "DTRTensor": DTRTensor, "Storage": Storage, "Cell": Cell,
        "OpRecord": OpRecord, "Call": Call, "Ref": Ref, "Facts": OpFacts, "strided": torch.strided,
        "UFNode": UFNode, "DTREq": DTREq, "dtreq_on_evict": DTREq.on_evict, "dtreq_key": DTREq.key,
        "dtreq_on_release": DTREq.on_release, "constants_forget": Constants.forget,
        "constants_use": Constants.use,
        "heappush": heapq.heappush, "heappop": heapq.heappop, "TOL": candidates._TOL,
        "F32_MAX": candidates._F32_MAX, "ARGMINS": candidates._ARGMINS,
        "LOG_LIMIT": heuristics._LOG_LIMIT,
        "RESIDENT": RESIDENT, "RELEASED": RELEASED, "EVICTED": EVICTED, "SWAPPED": SWAPPED,
        "VIEW": Kind.VIEW, "DETACH": Kind.DETACH, "fit": fit,
        "mws": torch.Tensor._make_wrapper_subclass, "is_grad_enabled": torch.is_grad_enabled,
        "perf_counter": perf_counter, "estimate_seconds": estimate_seconds,
        "correct_size": output_size.correct, "output_bytes": output_size.output_bytes,
        "output_size": output_size,
        "no_kwargs": NO_KWARGS, "first": FIRST, "FALLBACK": FALLBACK,
        "untrack_gc": collector.NATIVE, "FACTS": FACTS, "facts_for": facts_for,
        "current_node": getattr(torch._C, "_current_autograd_node", lambda: None),
        "ADD": torch.ops.aten.add.Tensor, "ADD_": torch.ops.aten.add_.Tensor, "MM": torch.ops.aten.mm.default,
        "ADD_FACTS": facts_for(torch.ops.aten.add_.Tensor), "EXTERNAL": EXTERNAL,
        "graph_task_id": torch._C._current_graph_task_id, "accumulation": accumulation,
    }


def _load():
    if os.environ.get("DTR_PUREPYTHON", "") not in ("", "0"):
        return None, "DTR_PUREPYTHON is set"
    try:
        from dtr_ext import _hotpath
    except ImportError as e:
        return None, f"dtr_ext._hotpath is not built ({e})"
    if getattr(_hotpath, "ABI_VERSION", None) != 5:
        return None, "dtr_ext._hotpath is from another version of dtr: reinstall dtr"
    try:
        _hotpath.bind(_config())
    except (TypeError, KeyError, AttributeError) as e:  # a class's fields changed without hotpath.c
        return None, str(e)
    return _hotpath, ""


_EXT, WHY_NOT = _load()
NATIVE: bool = _EXT is not None
run_simple: Optional[Callable[..., Any]] = _EXT.run_simple if _EXT is not None else None
registered: Callable[[], int] = _EXT.registered if _EXT is not None else (lambda: 0)
"""How many ops the native path has registered itself (not handed back) in this process."""
dispatcher: Optional[Callable[[Any], Callable[..., Any]]] = _EXT.dispatcher if _EXT is not None else None


def bind_driver(driver_class: type) -> None:
    """Tell the native path ``driver_class._make_room``, which it runs natively for as long as
    a driver's ``_make_room`` is that function (driver.py calls it once ``Driver`` exists)."""
    if _EXT is not None:
        _EXT.bind_make_room(driver_class._make_room)


wrapper_death: Optional[Callable[[Runtime], Callable[[Ref], None]]] = (
    _EXT.wrapper_death if _EXT is not None else None)
"""``Runtime._on_wrapper_death`` bound to one runtime, native while its block is open: the
callback of its wrappers' Refs (``Runtime._wrapper_died``)."""
ordinary: Optional[Callable[[CandidateIndex], Any]] = _EXT.ordinary if _EXT is not None else None
"""``CandidateIndex._ordinary`` natively, for a runtime the native path drives."""
release: Optional[Callable[[Any, Storage], None]] = _EXT.release if _EXT is not None else None
"""``lineage.release`` natively, for a runtime the native path drives."""
