"""Summary statistics of a run (percentiles, latency summaries, safe ratios), for the simulator and the benchmarks.

Plain Python on purpose: the model-free simulator reports with them and must stay light.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method), p in [0, 100]; nan for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(values: Sequence[float]) -> dict:
    """The usual latency summary: what a reader wants to compare two runs by."""
    values = list(values)
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else math.nan,
        "median": median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values, default=math.nan),
        "max": max(values, default=math.nan),
    }


def ratio(a: float, b: float) -> float:
    """a / b, nan instead of an exception when b is zero (a broken run should still print its table)."""
    return a / b if b else math.nan
