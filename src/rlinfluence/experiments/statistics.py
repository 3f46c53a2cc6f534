"""Statistics that hold at 3-5 seeds (Agarwal et al., NeurIPS 2021; the ``rliable`` library).

Scores are normalised per env against the reference method r:

    norm(R) = (R - R_r,0) / (P_r - R_r,0)

with R_r,0 the reference's first-round return and P_r its plateau (mean of its last 5 rounds),
each averaged over the reference's seeds: 0 = where the reference starts, 1 = where it ends.
A run's scores are ``auc`` (the mean of its normalised curve over rounds: how fast it learns)
and ``final`` (its normalised plateau). Over runs (x tasks):

    IQM          = mean of the middle 50% of the scores (scipy.stats.trim_mean(x, 0.25))
    P(X > Y)     = mean over tasks of  1/(n m) sum_i sum_j [x_i > y_j] + 1/2 [x_i = y_j]

with 95% intervals from rliable's stratified bootstrap (runs resampled within each task).
Per-seed-pair reductions (rounds to 80%, ...) get a bootstrap interval of their mean.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from scipy import stats

DEFAULT_REPS = 2000


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (0 for a single value)."""
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def ci95(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of a 95% t-interval: mean +/- t_{0.975, n-1} s.e. (2.776 for 5 seeds)."""
    mean, se = mean_se(values)
    t = stats.t.ppf(0.975, len(values) - 1) if len(values) > 1 else math.nan
    return mean, mean - t * se, mean + t * se


def normalise(returns: np.ndarray, start: float, plateau: float) -> np.ndarray:
    """(R - start) / (plateau - start); a reference that did not move (plateau == start) makes
    the scale undefined, and the scores NaN."""
    span = plateau - start
    return (np.asarray(returns, float) - start) / span if span != 0 else np.full(np.shape(returns), np.nan)


def _rng(seed: int) -> np.random.RandomState:
    return np.random.RandomState(seed)


def _bootstrap(scores: Mapping[str, object], func: Callable[..., np.ndarray], reps: int, seed: int) -> tuple[dict, dict]:
    """rliable's ``get_interval_estimates`` (its arch backend warns about ``random_state``)."""
    from rliable import library

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return library.get_interval_estimates(scores, func, reps=reps, random_state=_rng(seed))


def iqm(scores: np.ndarray) -> float:
    """Interquartile mean of all entries (rliable's ``aggregate_iqm``)."""
    from rliable import metrics

    return float(metrics.aggregate_iqm(np.asarray(scores, float)))


def interval_estimates(
    scores: Mapping[str, np.ndarray], reps: int = DEFAULT_REPS, seed: int = 0
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per method: IQM and mean of its [runs, tasks] scores, each as (point, low, high), from
    rliable's stratified bootstrap (percentile intervals, 95%)."""
    from rliable import metrics

    def aggregates(x: np.ndarray) -> np.ndarray:
        return np.array([metrics.aggregate_iqm(x), metrics.aggregate_mean(x)])

    points, intervals = _bootstrap({k: np.asarray(v, float) for k, v in scores.items()}, aggregates, reps, seed)
    return {k: {name: (float(points[k][i]), float(intervals[k][0, i]), float(intervals[k][1, i]))
                for i, name in enumerate(("iqm", "mean"))} for k in scores}


def probability_of_improvement(
    x: np.ndarray, y: np.ndarray, reps: int = DEFAULT_REPS, seed: int = 0
) -> tuple[float, float, float]:
    """P(X > Y) of two [runs, tasks] score matrices as (point, low, high), with rliable's
    stratified independent bootstrap (the runs of x and of y resampled separately)."""
    from rliable import metrics

    x, y = np.asarray(x, float), np.asarray(y, float)
    points, intervals = _bootstrap(
        {"p": (x, y)}, lambda a, b: np.array([metrics.probability_of_improvement(a, b)]), reps, seed)
    return float(points["p"][0]), float(intervals["p"][0, 0]), float(intervals["p"][1, 0])


def bootstrap_mean(values: Sequence[float], reps: int = DEFAULT_REPS, seed: int = 0) -> tuple[float, float, float]:
    """Mean of per-seed values with a 95% percentile bootstrap interval (``scipy.stats.bootstrap``);
    a single value has no interval (NaN bounds)."""
    x = np.asarray(values, float)
    if len(x) < 2 or np.all(x == x[0]):
        low = high = float(x[0]) if len(x) > 1 else math.nan
        return float(x.mean()), low, high
    result = stats.bootstrap((x,), np.mean, n_resamples=reps, confidence_level=0.95, method="percentile",
                             random_state=np.random.default_rng(seed))
    return float(x.mean()), float(result.confidence_interval.low), float(result.confidence_interval.high)
