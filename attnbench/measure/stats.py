"""Statistics of raw timing samples: robust centre, spread and a distribution-free CI of the median."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


def median_ci(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median from order statistics.

    The number of samples below the true median is Binomial(n, 1/2), so the sorted samples at ranks
    ``j`` and ``n - 1 - j`` bracket it with probability ``>= confidence``. No normality assumption:
    timing distributions are skewed and heavy-tailed. With fewer than 6 samples the interval is the range.
    """
    x = np.sort(np.asarray(samples, dtype=float))
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    if n < 6:
        return float(x[0]), float(x[-1])
    j = int(stats.binom.ppf((1 - confidence) / 2, n, 0.5)) - 1
    j = min(max(j, 0), (n - 1) // 2)
    return float(x[j]), float(x[n - 1 - j])


def summarize(samples: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """``median_s, iqr_s, mean_s, std_s, min_s, max_s, n, ci_low_s, ci_high_s, ci_rel`` of the samples."""
    x = np.asarray(samples, dtype=float)
    if len(x) == 0:
        nan = math.nan
        return dict(median_s=nan, iqr_s=nan, mean_s=nan, std_s=nan, min_s=nan, max_s=nan, n=0,
                    ci_low_s=nan, ci_high_s=nan, ci_rel=nan)
    med = float(np.median(x))
    q1, q3 = np.percentile(x, [25, 75])
    lo, hi = median_ci(x, confidence)
    return dict(median_s=med, iqr_s=float(q3 - q1), mean_s=float(x.mean()), std_s=float(x.std(ddof=1)) if len(x) > 1 else 0.0,
                min_s=float(x.min()), max_s=float(x.max()), n=int(len(x)), ci_low_s=lo, ci_high_s=hi,
                ci_rel=float((hi - lo) / 2 / med) if med > 0 else math.nan)
