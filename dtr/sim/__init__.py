"""Traces and the simulator: replay what the engine saw through the same engine.

``dtr.budget(limit, trace="run.jsonl")`` records a trace (``trace.py`` documents the format);
``dtr.simulate(trace, budget, heuristic)`` replays it under another budget or heuristic in
seconds, with no tensors (``simulator.py``). Torch-free, like ``dtr.core``.
"""

from dtr.sim.simulator import SimResult, simulate
from dtr.sim.trace import FORMAT, VERSION, Trace, TraceWriter, load

__all__ = ["FORMAT", "VERSION", "SimResult", "Trace", "TraceWriter", "load", "simulate"]
