"""The torch-free DTR engine: storages, op records, eviction, rematerialization.

Drivers (the eager tensor subclass, and the trace simulator) supply values and an executor
that can replay an op record; this package never imports torch (a test checks it).
"""

from dtr.core.heuristics import (
    DTR,
    LRU,
    MSPS,
    DTREq,
    DTRLocal,
    Heuristic,
    Random,
    Size,
    heuristic_names,
    make_heuristic,
    register_heuristic,
)
from dtr.core.executor import Executor
from dtr.core.meter import PeakMeter
from dtr.core.runtime import Runtime
from dtr.core.storage import Cell, OpRecord, State, Storage
from dtr.core.telemetry import Counters, Stats

__all__ = [
    "Cell",
    "Counters",
    "DTR",
    "DTREq",
    "DTRLocal",
    "Executor",
    "Heuristic",
    "LRU",
    "MSPS",
    "OpRecord",
    "PeakMeter",
    "Random",
    "Runtime",
    "Size",
    "State",
    "Stats",
    "Storage",
    "heuristic_names",
    "make_heuristic",
    "register_heuristic",
]
