"""Progress bars for the long benchmark runs, with tqdm when it is installed (``pip install
'dtr[bench]'``); without it the loops run as they are. Bars go to stderr, the tables to stdout."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str) -> Iterable[T]:
    """``items``, wrapped in a tqdm bar labelled ``desc`` if tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
