"""Matplotlib for the benchmarks' plots when it is installed (it is not a dependency of dtr)."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
