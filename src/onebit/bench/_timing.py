"""Median wall time of repeated calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """Median over ``repeat`` timed calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
