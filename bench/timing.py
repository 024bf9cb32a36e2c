"""Timing shared by the benchmarks: medians of functions timed in turn, under the same load."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each function, timed in turn so that all see the same machine load."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            started = time.perf_counter()
            fn()
            out.append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]
