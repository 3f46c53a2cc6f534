"""Statistics that hold at 5-10 seeds (Agarwal et al., NeurIPS 2021), reproducible and paired.

Scores are normalised per env against the reference method r:

    norm(R) = (R - R_r,0) / (P_r - R_r,0)

with R_r,0 the reference's first-round return and P_r its plateau (mean of its last 5 rounds),
each averaged over the reference's seeds: 0 = where the reference starts, 1 = where it ends.
A run's scores are ``auc`` (the mean of its normalised curve over rounds: how fast it learns)
and ``final`` (its normalised plateau). Over runs (x tasks):

    IQM          = mean of the middle 50% of the scores (scipy.stats.trim_mean(x, 0.25))
    P(X > Y)     unpaired: mean over tasks of 1/(n m) sum_i sum_j [x_i > y_j] + 1/2 [x_i = y_j]
                 paired (run i of X and of Y share seed i): mean over tasks of
                 1/n sum_i [x_i > y_i] + 1/2 [x_i = y_i]

Intervals that cover at the few seeds used: a t interval for every mean over seeds and every
paired difference (``ci95``); Fieller's interval for a ratio of paired means (``ratio_ci95``); the exact Clopper-Pearson interval for a paired P(X > Y) on one
task (a fraction of seeds); and, for IQM and statistics over several tasks, 95% percentile
intervals of a stratified bootstrap written here rather than rliable's (whose generator ignores
the seed passed in): runs are resampled within each task, with one set of indices for both
sides of a paired statistic and separate sets for an unpaired one, from
``numpy.random.default_rng(seed)``, so the same seed gives the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

DEFAULT_REPS = 2000
"""Bootstrap replications of every interval (this module's)."""
MAX_REPS = 1_000_000
"""More replications than this take minutes per interval and change nothing a table shows."""

Interval = tuple[float, float, float]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (0 for a single value)."""
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def ci95(values: Sequence[float], bounds: tuple[float, float] = (-math.inf, math.inf)) -> Interval:
    """(mean, low, high) of a 95% t-interval: mean +/- t_{0.975, n-1} s.e. (2.776 for 5 seeds),
    clipped to the quantity's ``bounds`` (an AUROC or a fraction: (0, 1); clipping where the truth
    cannot be loses no coverage); a single value has no interval (NaN bounds). The interval of
    every per-seed mean and paired difference: it covers at 3-10 seeds (0.95 on normal data, 0.93
    at skewness 1; a percentile bootstrap covers 0.74 at 3 seeds), tested in
    tests/test_statistics_coverage.py."""
    mean, se = mean_se(values)
    from scipy import stats  # scipy on first use: the command line's parsers import this module

    t = stats.t.ppf(0.975, len(values) - 1) if len(values) > 1 else math.nan
    return mean, float(np.clip(mean - t * se, *bounds)), float(np.clip(mean + t * se, *bounds))



def ratio_ci95(numerators: Sequence[float], denominators: Sequence[float]) -> Interval:
    """(ratio, low, high): mean(a) / mean(b) of paired samples (a_i, b_i share seed i; e.g. a filter's
    gain over PPO and the oracle's, so the ratio is the share of the oracle's gain it recovers) with
    Fieller's 95% interval, exact for normal pairs: the theta with

        (a_bar - theta b_bar)^2 <= t^2 (v_aa - 2 theta v_ab + theta^2 v_bb),   v = sample (co)variance / n,

    t = t_{0.975, n-1}. Where b_bar is not clearly apart from 0 (b_bar^2 <= t^2 v_bb) that set is
    unbounded and the interval is (-inf, inf): a ratio over a denominator that may be 0 says nothing,
    which a bare ratio or a percentile bootstrap hides."""
    a, b = np.asarray(numerators, float), np.asarray(denominators, float)
    n = len(a)
    if n != len(b) or n < 2:
        raise ValueError(f"ratio_ci95 needs paired samples of 2 or more, got {n} and {len(b)}")
    from scipy import stats

    t2 = stats.t.ppf(0.975, n - 1) ** 2
    (v_aa, v_ab), (_, v_bb) = np.cov(a, b, ddof=1) / n
    a_bar, b_bar = a.mean(), b.mean()
    ratio = float(a_bar / b_bar) if b_bar else math.nan
    quadratic = b_bar**2 - t2 * v_bb
    if quadratic <= 0:
        return ratio, -math.inf, math.inf
    linear = a_bar * b_bar - t2 * v_ab
    root = math.sqrt(max(linear**2 - quadratic * (a_bar**2 - t2 * v_aa), 0.0))
    return ratio, (linear - root) / quadratic, (linear + root) / quadratic


def holm(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error rate across the tests), any shape:
    sorted p_(1) <= ... <= p_(m), adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))."""
    p = np.asarray(p_values, float)
    flat = p.ravel()
    order = np.argsort(flat, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((len(flat) - np.arange(len(flat))) * flat[order]))
    out = np.empty_like(flat)
    out[order] = adjusted
    return out.reshape(p.shape)


def interval_p_value(mean: float, low: float, high: float, n: int, interval: str = "t") -> float:
    """Two-sided p of "the mean is 0" recovered from a 95% interval of a mean over n values:
    ``interval="t"`` for ``ci95``'s unclipped t interval, s.e. = (high - low) / (2 t_{0.975, n-1});
    ``"percentile"`` for a percentile bootstrap of the mean, whose spread is about z_{0.975} times
    s sqrt((n-1)/n) / sqrt(n), so s.e. = (high - low) / (2 z_{0.975}) sqrt(n / (n-1)). Then
    p = 2 T_{n-1}(-|mean| / s.e.) (NaN below 2 values; 0 or 1 for an interval of width 0 off or at 0)."""
    if n < 2 or not all(map(math.isfinite, (mean, low, high))):
        return math.nan
    from scipy import stats

    if interval == "t":
        se = (high - low) / (2 * stats.t.ppf(0.975, n - 1))
    elif interval == "percentile":
        se = (high - low) / (2 * stats.norm.ppf(0.975)) * math.sqrt(n / (n - 1))
    else:
        raise ValueError(f"unknown interval {interval!r} (expected 't' or 'percentile')")
    if se <= 0:
        return 1.0 if mean == 0 else 0.0
    return float(2 * stats.t.sf(abs(mean) / se, n - 1))



def normalise(returns: np.ndarray, start: float, plateau: float) -> np.ndarray:
    """(R - start) / (plateau - start); a reference that did not improve (plateau <= start) makes
    the scale undefined, and the scores NaN: dividing by a negative span would reverse every
    comparison made on the normalised scores."""
    span = plateau - start
    return (np.asarray(returns, float) - start) / span if span > 0 else np.full(np.shape(returns), np.nan)


def iqm(scores: np.ndarray) -> float:
    """Interquartile mean of all n entries: the mean of the sorted entries [floor(n/4), n - floor(n/4)),
    NaN when any entry is NaN or there are none. The same partition and mean as
    ``scipy.stats.trim_mean(scores, 0.25, axis=None)``, without its per-call dispatch, which cost
    more than the arithmetic when a bootstrap calls it 10,000 times an interval."""
    flat = np.asarray(scores, float).ravel()
    if flat.size == 0 or np.isnan(flat).any():
        return math.nan
    cut = flat.size // 4
    return float(np.partition(flat, (cut, flat.size - cut - 1))[cut:flat.size - cut].mean())


def stratified_bootstrap(
    matrices: Sequence[np.ndarray], statistic: Callable[..., float], reps: int = DEFAULT_REPS, seed: int = 0,
    paired: bool = False,
) -> Interval:
    """(statistic(*matrices), 2.5th, 97.5th percentile over ``reps`` resamples) of [runs, tasks]
    matrices: each task's runs resampled with replacement, with the same row indices in every
    matrix when ``paired`` (they must then have the same number of runs), independently otherwise."""
    xs = [np.asarray(m, float) for m in matrices]
    if paired and len({x.shape for x in xs}) > 1:
        raise ValueError(f"paired matrices need the same shape, got {[x.shape for x in xs]}")
    point = float(statistic(*xs))
    rng = np.random.default_rng(seed)
    draws = np.empty(reps)
    for r in range(reps):
        if paired:
            idx = rng.integers(0, xs[0].shape[0], size=xs[0].shape)
            resampled = [np.take_along_axis(x, idx, axis=0) for x in xs]
        else:
            resampled = [np.take_along_axis(x, rng.integers(0, x.shape[0], size=x.shape), axis=0) for x in xs]
        draws[r] = statistic(*resampled)
    low, high = np.nanpercentile(draws, [2.5, 97.5]) if np.isfinite(draws).any() else (math.nan, math.nan)
    return point, float(low), float(high)


def interval_estimates(
    scores: Mapping[str, np.ndarray], reps: int = DEFAULT_REPS, seed: int = 0
) -> dict[str, dict[str, Interval]]:
    """Per method: IQM and mean of its [runs, tasks] scores, each as (point, low, high)."""
    return {k: {"iqm": stratified_bootstrap([v], iqm, reps, seed),
                "mean": stratified_bootstrap([v], lambda x: float(np.mean(x)), reps, seed)}
            for k, v in scores.items()}


def _poi(x: np.ndarray, y: np.ndarray, paired: bool) -> float:
    if paired:
        per_task = ((x > y) + 0.5 * (x == y)).mean(axis=0)
    else:
        wins = (x[:, None, :] > y[None, :, :]) + 0.5 * (x[:, None, :] == y[None, :, :])
        per_task = wins.mean(axis=(0, 1))
    return float(per_task.mean())


def clopper_pearson(wins: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval of a proportion from ``wins`` of ``n`` (a tie counted as half a win:
    the lower bound from the wins rounded down, the upper from them rounded up): 5 of 5 gives
    [0.48, 1.00], never [1, 1]."""
    from scipy import stats

    tail = (1 - level) / 2
    low_k, high_k = math.floor(wins), math.ceil(wins)
    low = float(stats.beta.ppf(tail, low_k, n - low_k + 1)) if low_k > 0 else 0.0
    high = float(stats.beta.ppf(1 - tail, high_k + 1, n - high_k)) if high_k < n else 1.0
    return low, high


def probability_of_improvement(
    x: np.ndarray, y: np.ndarray, reps: int = DEFAULT_REPS, seed: int = 0, paired: bool = False
) -> Interval:
    """P(X > Y) of two [runs, tasks] score matrices as (point, low, high): ``paired`` when run i of
    x and of y share a seed (the chance that on a seed X beats Y), unpaired otherwise (the chance
    that a run of X beats a run of Y). Paired on one task, the point is a fraction of seeds and its
    interval the exact ``clopper_pearson`` one; otherwise the stratified bootstrap's."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if paired and x.ndim == 2 and x.shape[1] == 1 and x.shape == y.shape:
        point = _poi(x, y, paired=True)
        return (point, *clopper_pearson(point * len(x), len(x)))
    return stratified_bootstrap([x, y], lambda a, b: _poi(a, b, paired), reps, seed, paired)
