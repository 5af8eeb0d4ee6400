"""Small statistics helpers: means over runs, win rates and bootstrap confidence intervals."""

from __future__ import annotations

import math
import random
from typing import Iterable, Sequence


def mean(values: Iterable[float | None]) -> float | None:
    """Mean of the non-None values (None when there are none)."""
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def std(values: Iterable[float | None]) -> float | None:
    """Sample standard deviation (n-1) of the non-None values (None for fewer than two values)."""
    vals = [float(v) for v in values if v is not None]
    if len(vals) < 2:
        return None
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is zero."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def win_rate(wins: int, losses: int, ties: int) -> float | None:
    """(W + T/2) / n, or None when n == 0."""
    n = wins + losses + ties
    return (wins + 0.5 * ties) / n if n else None


def bootstrap_ci(scores: Sequence[float], resamples: int = 1000, seed: int = 0,
                 level: float = 0.95) -> list[float] | None:
    """Percentile bootstrap confidence interval of the mean of ``scores``.

    Args:
        scores: Per-item scores (pairwise: 1 win, 0.5 tie, 0 loss).
        resamples: Number of bootstrap resamples.
        seed: Seed of the resampling generator (results are reproducible).
        level: Confidence level.

    Returns:
        [low, high], or None for no scores.
    """
    n = len(scores)
    if n == 0:
        return None
    rng = random.Random(seed)
    means = sorted(sum(scores[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    alpha = (1.0 - level) / 2.0
    return [_quantile(means, alpha), _quantile(means, 1.0 - alpha)]


def _quantile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values (numpy's default method)."""
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)
