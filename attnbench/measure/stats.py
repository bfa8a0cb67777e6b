"""Statistics of raw timing samples: robust centre, spread, a distribution-free CI of the median, and for
samples taken in several groups (rounds, processes) a hierarchical CI and a test for two modes."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


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
    j = binom_half_ppf((1 - confidence) / 2, n) - 1
    j = min(max(j, 0), (n - 1) // 2)
    return float(x[j]), float(x[n - 1 - j])


@functools.lru_cache(maxsize=4096)
def binom_half_ppf(q: float, n: int) -> int:
    """The smallest ``k`` with ``P(X <= k) >= q`` for ``X ~ Binomial(n, 1/2)`` (``scipy.stats.binom.ppf(q, n, 0.5)``
    for ``0 < q < 1``; checked against SciPy in ``tests/test_overheads.py``). The standard library's ``lgamma`` in place
    of SciPy, whose import cost every measuring process and the driver 1.2-1.8 s."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), not {q}")
    log_norm = math.lgamma(n + 1) + n * math.log(0.5)
    cdf = 0.0
    for k in range(max(0, int(n / 2 - 10 * math.sqrt(n))), n + 1):  # the mass below is under 1e-40
        cdf += math.exp(log_norm - math.lgamma(k + 1) - math.lgamma(n - k + 1))
        if cdf >= q * (1.0 - 1e-12):  # SciPy's own check of the rank below carries the same rounding
            return k
    return n


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


# ---------------------------------------------------------------- several rounds and processes

UNSTABLE_RATIO = 1.10
"""Two modes (or two disagreeing rounds) closer than this ratio are not called unstable: ordinary drift."""
MIN_MODE_FRACTION = 0.20
"""A mode needs at least this share of the samples (and 3 of them): a cluster of outliers (preemption on a busy
machine) is a tail, not a mode."""


def _as_groups(groups: Sequence[Sequence[float]]) -> list[np.ndarray]:
    out = [np.asarray(g, dtype=float) for g in groups]
    out = [g[np.isfinite(g)] for g in out]
    return [g for g in out if len(g)]


def split_groups(samples: Sequence[float], sizes) -> list[np.ndarray]:
    """``samples`` split into consecutive groups of ``sizes`` (a row's ``samples_s`` and ``sample_groups``);
    one group when ``sizes`` is absent, has fewer than two entries, or does not add up to the samples."""
    x = np.asarray(samples, dtype=float)
    sizes = [int(n) for n in sizes] if isinstance(sizes, list | tuple | np.ndarray) else []
    if len(sizes) < 2 or sum(sizes) != len(x):
        return [x]
    return list(np.split(x, np.cumsum(sizes)[:-1]))


def group_median(groups: Sequence[Sequence[float]]) -> float:
    """The median of the samples with every group weighted equally (each sample ``1 / len(its group)``).

    The sampler keeps sampling a noisy round until its CI is tight enough or the budget runs out, so a
    round disturbed by other load has many more samples than a quiet one; pooled as they are, the disturbed
    round would decide the median (seen here: one slow round of 120 samples against two of 10). Weighted
    by group, every round and process counts once. One group: its plain median.
    """
    gs = _as_groups(groups)
    if not gs:
        return math.nan
    if len(gs) == 1:
        return float(np.median(gs[0]))
    x = np.concatenate(gs)
    w = np.concatenate([np.full(len(g), 1.0 / len(g)) for g in gs])
    order = np.argsort(x, kind="stable")
    x, cum = x[order], np.cumsum(w[order])
    half = cum[-1] / 2
    i = int(np.searchsorted(cum, half - 1e-12 * cum[-1]))
    if abs(cum[i] - half) <= 1e-12 * cum[-1] and i + 1 < len(x):  # exactly half the weight below: midpoint
        return float((x[i] + x[i + 1]) / 2)
    return float(x[i])


def bootstrap_medians(groups: Sequence[Sequence[float]], resamples: int = 2000,
                      rng: np.random.Generator | int | None = 0) -> np.ndarray:
    """:func:`group_median` of ``resamples`` hierarchical bootstrap resamples: groups drawn with replacement,
    then, within each drawn group, as many samples as the largest group has, drawn with replacement (so
    every drawn group weighs the same, as in :func:`group_median`), pooled.

    A group is what was measured together (one round in one process). Resampling the groups first
    carries the variance *between* rounds and processes into the interval; resampling only pooled
    samples would treat thousands of samples from one environment as independent evidence.
    (``scipy.stats.bootstrap`` resamples one level only, hence this.)
    """
    rng = np.random.default_rng(rng)
    gs = _as_groups(groups)
    if not gs:
        return np.full(resamples, np.nan)
    sizes = np.array([len(g) for g in gs])
    width = int(sizes.max())
    padded = np.full((len(gs), width), np.nan)
    for i, g in enumerate(gs):
        padded[i, :len(g)] = g
    out = np.empty(resamples)
    chunk = max(1, 4_000_000 // (len(gs) * width))
    for start in range(0, resamples, chunk):
        k = min(chunk, resamples - start)
        picked = rng.integers(0, len(gs), size=(k, len(gs)))  # (k, G): which groups each resample draws
        n = sizes[picked][..., None]  # (k, G, 1)
        idx = (rng.random((k, len(gs), width)) * n).astype(np.int64)  # (k, G, width), < each group's size
        values = padded[picked[..., None], idx]  # every drawn group contributes `width` draws: equal weight
        out[start:start + k] = np.median(values.reshape(k, -1), axis=1)
    return out


def hierarchical_median_ci(groups: Sequence[Sequence[float]], confidence: float = 0.95, resamples: int = 2000,
                           seed: int = 0) -> tuple[float, float]:
    """CI of the :func:`group_median` that includes the variance between groups (rounds, processes).

    One group: the distribution-free interval of :func:`median_ci`. Several: the percentile interval of
    :func:`bootstrap_medians`, widened to contain the pooled samples' own :func:`median_ci` (never
    narrower than what the samples alone say).
    """
    gs = _as_groups(groups)
    pooled = np.concatenate(gs) if gs else np.array([])
    lo, hi = median_ci(pooled, confidence)
    if len(gs) < 2:
        return lo, hi
    boot = bootstrap_medians(gs, resamples, seed)
    blo, bhi = np.quantile(boot, [(1 - confidence) / 2, 1 - (1 - confidence) / 2])
    return float(min(lo, blo)), float(max(hi, bhi))


@dataclass(frozen=True)
class Modes:
    """Two modes of a cell's timings: their medians, the share of samples in the faster one, and why."""

    low_s: float
    high_s: float
    frac_low: float
    reason: str

    def text(self) -> str:
        """``unstable: <reason>: modes 2.43 ms (55%) and 4.22 ms (45%)``."""
        return (f"unstable: {self.reason}: modes {1e3 * self.low_s:.4g} ms ({100 * self.frac_low:.0f}%) and "
                f"{1e3 * self.high_s:.4g} ms ({100 * (1 - self.frac_low):.0f}%)")


def _two_means(x: np.ndarray) -> int:
    """The size of the lower cluster of the best split of sorted ``x`` into two (least squares)."""
    n = len(x)
    c, c2 = np.cumsum(x), np.cumsum(x * x)
    k = np.arange(1, n)
    sse = (c2[k - 1] - c[k - 1] ** 2 / k) + ((c2[-1] - c2[k - 1]) - (c[-1] - c[k - 1]) ** 2 / (n - k))
    return int(np.argmin(sse)) + 1


def _bimodal(samples: np.ndarray) -> Modes | None:
    """Two clear modes in one set of samples, or None.

    On log-times, the best two-cluster split must leave at least :data:`MIN_MODE_FRACTION` of the samples
    (and 3) on each side, its two medians must differ by more than :data:`UNSTABLE_RATIO`, and the middle
    third between them must be a dip: under half as many samples as an equally wide band around the
    thinner mode. A single bell (split anywhere, its middle is densest) or a skewed tail fails the last test.
    """
    x = np.sort(np.log(samples[samples > 0]))
    n = len(x)
    least = max(3, int(np.ceil(MIN_MODE_FRACTION * n)))
    if n < 2 * least:
        return None
    k = _two_means(x)
    if k < least or n - k < least:
        return None
    lo, hi = float(np.median(x[:k])), float(np.median(x[k:]))
    if hi - lo <= np.log(UNSTABLE_RATIO):
        return None
    w = (hi - lo) / 3

    def count(a: float, b: float) -> int:
        return int(np.searchsorted(x, b, "right") - np.searchsorted(x, a, "left"))

    middle = count(lo + w, hi - w)
    if middle >= 0.5 * min(count(lo - w / 2, lo + w / 2), count(hi - w / 2, hi + w / 2)):
        return None
    return Modes(float(np.exp(lo)), float(np.exp(hi)), k / n, "bimodal samples")


def find_modes(groups: Sequence[Sequence[float]], confidence: float = 0.95) -> Modes | None:
    """Two modes in a cell's timings, or None when it is stable.

    Unstable means: group medians (rounds, processes) that disagree by more than :data:`UNSTABLE_RATIO`
    with non-overlapping confidence intervals, or a clearly bimodal distribution of the pooled samples.
    """
    gs = _as_groups(groups)
    if not gs:
        return None
    pooled = np.concatenate(gs)
    if len(gs) >= 2:
        meds = np.array([np.median(g) for g in gs])
        cis = [median_ci(g, confidence) for g in gs]
        i, j = int(np.argmin(meds)), int(np.argmax(meds))
        if meds[j] > UNSTABLE_RATIO * meds[i] and cis[j][0] > cis[i][1]:
            order = np.argsort(meds)
            k = _two_means(np.log(meds[order]))  # the faster groups, as a cluster
            low = np.concatenate([gs[g] for g in order[:k]])
            high = np.concatenate([gs[g] for g in order[k:]])
            listed = ", ".join(f"{1e3 * m:.4g}" for m in meds)
            return Modes(float(np.median(low)), float(np.median(high)), len(low) / len(pooled),
                         f"round medians disagree ({listed} ms)")
    return _bimodal(pooled)


def summarize_groups(groups: Sequence[Sequence[float]], confidence: float = 0.95,
                     seed: int = 0, drift: float = 0.0) -> tuple[dict[str, float], Modes | None]:
    """:func:`summarize` of the pooled samples with, for several groups, the :func:`group_median` as
    ``median_s`` and the hierarchical CI; and the modes if unstable.

    ``drift`` is the between-run term (:mod:`attnbench.measure.drift`): the CI is widened by it, and the
    result also carries ``ci_within_rel`` (the CI this run alone supports) and ``drift_rel``.
    """
    gs = _as_groups(groups)
    pooled = np.concatenate(gs) if gs else np.array([])
    out = summarize(pooled, confidence)
    if len(gs) >= 2:
        # 2000 resamples, fewer for tens of thousands of samples (tiny cells): the driver's time, not the CI's
        resamples = int(min(2000, max(500, 2e7 // max(len(gs) * max(len(g) for g in gs), 1))))
        lo, hi = hierarchical_median_ci(gs, confidence, resamples=resamples, seed=seed)
        out["median_s"] = group_median(gs)
        out.update(ci_low_s=min(lo, out["median_s"]), ci_high_s=max(hi, out["median_s"]))
        out["ci_rel"] = _rel(out["ci_low_s"], out["ci_high_s"], out["median_s"])
    out["ci_within_rel"] = out["ci_rel"]
    out["drift_rel"] = float(drift)
    if drift:
        lo, hi = widen(out["median_s"], out["ci_low_s"], out["ci_high_s"], drift, confidence)
        out.update(ci_low_s=lo, ci_high_s=hi, ci_rel=_rel(lo, hi, out["median_s"]))
    return out, find_modes(gs, confidence)


def _rel(lo: float, hi: float, median: float) -> float:
    return float((hi - lo) / 2 / median) if median > 0 else math.nan


# ---------------------------------------------------------------- the between-run term (attnbench.measure.drift)


def z_value(confidence: float = 0.95) -> float:
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def widen(median: float, lo: float, hi: float, rel: float, confidence: float = 0.95) -> tuple[float, float]:
    """``(lo, hi)`` around ``median`` widened by the between-run term: each side's log half-width ``h``
    becomes ``sqrt(h^2 + (z * rel)^2)``. Unchanged when ``rel`` is 0 or the inputs are not positive."""
    return rewiden(median, lo, hi, 0.0, rel, confidence) if rel else (lo, hi)


def rewiden(median: float, lo: float, hi: float, old: float, new: float,
            confidence: float = 0.95) -> tuple[float, float]:
    """``(lo, hi)`` that :func:`widen` made with the term ``old``, remade with ``new`` instead."""
    if not (median > 0 and lo > 0 and hi > 0):
        return lo, hi
    z = z_value(confidence)
    down = math.sqrt(max(0.0, math.log(median / lo) ** 2 - (z * old) ** 2) + (z * new) ** 2)
    up = math.sqrt(max(0.0, math.log(hi / median) ** 2 - (z * old) ** 2) + (z * new) ** 2)
    return median * math.exp(-min(down, LOG_SPAN)), median * math.exp(min(up, LOG_SPAN))


LOG_SPAN = 700.0
"""The widest log half-width an interval is given: a between-run term so large (a machine hundreds of times noisier than
its calibration) that ``exp`` would overflow makes an interval from about 0 to about 1e304 times the median, which
says "nothing known" without an OverflowError ending the run."""


# ---------------------------------------------------------------- paired speed-ups (interleaved members)

def paired_speedup(base_groups: Sequence[Sequence[float]], member_groups: Sequence[Sequence[float]],
                   confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``(speedup, ci_low, ci_high)`` of a member against the baseline: baseline time / member time, from
    per-cycle ratios.

    ``base_groups[g][i]`` and ``member_groups[g][i]`` are the two per-call times of cycle ``i`` of group ``g``
    (one round in one process) of an interleaved measurement (:func:`attnbench.measure.interleave.time_interleaved`):
    measured moments apart, so a drift of the machine hits both and cancels in their ratio. Cycles where
    either is NaN (did not run) are dropped pairwise. The estimate is the :func:`group_median` of the log
    ratios (every group weighs the same) and the CI is :func:`hierarchical_median_ci` of them (groups drawn
    first, then cycles; one group: the distribution-free interval), both mapped back from the log scale.
    All NaN when no cycle has both times.
    """
    if len(base_groups) != len(member_groups):
        raise ValueError(f"{len(base_groups)} baseline groups against {len(member_groups)} member groups: not aligned")
    log_ratios = []
    for base, member in zip(base_groups, member_groups, strict=True):
        b, m = np.asarray(base, dtype=float), np.asarray(member, dtype=float)
        if b.shape != m.shape:
            raise ValueError(f"a group of {len(b)} baseline cycles against {len(m)} member cycles: not aligned")
        both = np.isfinite(b) & np.isfinite(m) & (b > 0) & (m > 0)
        log_ratios.append(np.log(b[both] / m[both]))
    gs = _as_groups(log_ratios)
    if not gs:
        return math.nan, math.nan, math.nan
    centre = group_median(gs)
    lo, hi = hierarchical_median_ci(gs, confidence, resamples=resamples, seed=seed)
    return math.exp(centre), math.exp(min(lo, centre)), math.exp(max(hi, centre))
