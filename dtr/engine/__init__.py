"""The torch-free DTR engine: storages, op records, eviction, rematerialization.

Drivers (the eager tensor subclass, and the trace simulator) supply values and an executor
that can replay an op record; this package never imports torch (a test checks it).
"""

from dtr.engine.heuristics import (
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
from dtr.engine.executor import Executor
from dtr.engine.meter import PeakMeter
from dtr.engine.runtime import Runtime
from dtr.engine.storage import Cell, OpRecord, State, Storage
from dtr.engine.telemetry import Counters, Stats

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
