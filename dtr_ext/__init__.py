"""Optional native code, built when a C compiler is available; each module has one user and a
pure-Python fallback with the same results:

- ``dtr_ext._planner`` (``planner.c``): the planner's DP loops, used by ``dtr/planner/_native.py``;
- ``dtr_ext._collector`` (``collector.c``): keeps the engine's records out of Python's cyclic
  collector, used by ``dtr/core/collector.py``;
- ``dtr_ext._hotpath`` (``hotpath.c``): the eager driver's per-op path in one native call, used
  by ``dtr/eager/native.py``."""
