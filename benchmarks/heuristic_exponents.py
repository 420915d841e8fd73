"""h_DTR^eq with other exponents on size and staleness, simulated on the shipped traces: the
probe that docs/heuristics.md ("Exponents on size and staleness") reports, not adopted.

A variant scores a storage by h_DTR^eq's key x bytes / (bytes^b x staleness^a): a = b = 1 is
h_DTR^eq itself. Variants define ``score``, so they are searched by rescoring, not through the
candidate index. Each point is ``dtr.simulate`` of the trace at that fraction of its unlimited
peak with ``max_recompute=30``; slowdowns are the same on any machine. A diagnostic, not a
benchmark: it prints a table and writes nothing (about 10 minutes on a 2-core VM, the exact e*
most of it).

    python benchmarks/heuristic_exponents.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dtr.core.heuristics import DTREq, make_heuristic
from dtr.sim import load, simulate

TRACES = Path(__file__).parent / "traces"
POINTS = [
    ("gru_cell", 0.3), ("lstm_cell_masked", 0.3), ("gru_cell", 0.5), ("lstm_cell_masked", 0.5),
    ("lstmcell", 0.5), ("treelstm_batch", 0.5), ("treelstm_batch", 0.67), ("treelstm_nary", 0.67),
    ("gru", 0.67), ("lstm_packed", 0.67), ("resnet", 0.3), ("transformer", 0.3), ("cnn", 0.4),
    ("mlp", 0.3), ("lstm", 0.3),
]
# (a, b): staleness^a and bytes^b; the docs' columns after h_DTR^eq and the exact e*.
EXPONENTS = [(0.75, 1.0), (0.5, 1.0), (1.5, 1.0), (1.0, 1.25), (1.0, 1.5), (0.75, 1.25)]


class Exponents(DTREq):
    """h_DTR^eq's key (cost of the storage and its evicted neighbourhood, per byte) scored as
    key x bytes / (bytes^b x staleness^a)."""

    name = "dtr_eq_exponents"

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b

    def score(self, s, now: int) -> float:
        n = s.nbytes or 1
        return self.key(s) * n / n**self.b / (now - s.last_access + 1) ** self.a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args()
    variants = [("h_DTR^eq", lambda: make_heuristic("dtr_eq")),
                ("h_DTR (exact e*)", lambda: make_heuristic("dtr"))]
    variants += [(f"a={a}, b={b}", lambda a=a, b=b: Exponents(a, b)) for a, b in EXPONENTS]
    print("| trace @ fraction | " + " | ".join(label for label, _ in variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for name, fraction in POINTS:
        trace = load(TRACES / f"{name}.jsonl.gz")
        limit = int(simulate(trace, None).peak_bytes * fraction)
        cells = []
        for _, make in variants:
            r = simulate(trace, limit, make(), max_recompute=30)
            cells.append(f"{r.slowdown:.2f}" if r.feasible else "infeasible")
        print(f"| {name} @ {fraction} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
