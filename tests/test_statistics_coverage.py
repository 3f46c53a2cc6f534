"""Intervals that cover at the seed counts used: the t interval of a mean (and of a paired
difference) covers within 0.03 of 95% at n = 3, 5, 10 on normal and on skewed (gamma, skewness 1)
data; the exact interval of k wins in n."""

import numpy as np
import pytest
from scipy import stats

from rlinfluence.statistics import ci95, clopper_pearson, probability_of_improvement, ratio_ci95


@pytest.mark.parametrize("n", [3, 5, 10])
@pytest.mark.parametrize(("draw", "truth"), [
    (lambda rng, n: rng.normal(2.0, 1.5, size=n), 2.0),
    (lambda rng, n: rng.gamma(4.0, size=n), 4.0),  # skewness 1
    (lambda rng, n: rng.gamma(4.0, size=n) - rng.normal(3.0, 1.0, size=n), 1.0),  # a paired difference
], ids=["normal", "gamma", "difference"])
def test_the_t_interval_covers_at_small_n(n, draw, truth):
    rng = np.random.default_rng(n)
    covered = [lo <= truth <= hi for _, lo, hi in (ci95(draw(rng, n)) for _ in range(4000))]
    assert abs(np.mean(covered) - 0.95) <= 0.03


def test_a_single_value_has_no_interval():
    mean, lo, hi = ci95([3.0])
    assert mean == 3.0 and np.isnan(lo) and np.isnan(hi)


@pytest.mark.parametrize(("wins", "n"), [(5, 5), (0, 5), (3, 10), (7, 10)])
def test_clopper_pearson_is_the_exact_binomial_interval(wins, n):
    low, high = clopper_pearson(wins, n)
    # the exact interval: the p at which P(X >= k) and P(X <= k) are 2.5%
    if wins:
        assert stats.binom.sf(wins - 1, n, low) == pytest.approx(0.025)
    if wins < n:
        assert stats.binom.cdf(wins, n, high) == pytest.approx(0.025)
    assert clopper_pearson(5, 5) == pytest.approx((0.478, 1.0), abs=1e-3)


def test_clopper_pearson_covers_at_least_its_level():
    rng = np.random.default_rng(0)
    for p in (0.3, 0.7, 0.9):
        covered = [lo <= p <= hi for lo, hi in (clopper_pearson(rng.binomial(5, p), 5) for _ in range(3000))]
        assert np.mean(covered) >= 0.95 - 0.01


def test_a_paired_probability_of_improvement_on_one_task_is_a_fraction_of_seeds_with_an_exact_interval():
    x = np.array([[1.0], [2.0], [3.0], [4.0], [5.0]])
    y = np.array([[0.0], [1.0], [3.0], [5.0], [0.0]])  # 3 wins, 1 tie, 1 loss
    point, low, high = probability_of_improvement(x, y, paired=True)
    assert point == pytest.approx(3.5 / 5)
    assert low == pytest.approx(clopper_pearson(3, 5)[0]) and high == pytest.approx(clopper_pearson(4, 5)[1])


@pytest.mark.parametrize("n", [3, 5, 10])
def test_the_ratio_interval_covers_at_small_n(n):
    """Paired normal gains, the numerator correlated with the denominator (a filter's gain and the
    oracle's share the PPO run they are measured from): Fieller's interval covers mean(a)/mean(b)."""
    rng = np.random.default_rng(n)
    covered = []
    for _ in range(4000):
        shared = rng.normal(0.0, 1.0, size=n)
        b = 3.0 + shared + rng.normal(0.0, 0.5, size=n)
        a = 2.4 + shared + rng.normal(0.0, 1.0, size=n)
        _, lo, hi = ratio_ci95(a, b)
        covered.append(lo <= 0.8 <= hi)
    assert abs(np.mean(covered) - 0.95) <= 0.03


def test_a_ratio_over_a_denominator_that_may_be_zero_is_unbounded():
    ratio, lo, hi = ratio_ci95([1.0, 2.0, 0.5, 1.5], [0.5, -0.4, 0.3, -0.2])
    assert ratio == pytest.approx(5.0 / 0.2) and lo == -np.inf and hi == np.inf
    ratio, lo, hi = ratio_ci95([8.0, 9.0, 7.5, 8.5], [10.0, 10.5, 9.5, 10.2])
    assert lo < ratio < hi and np.isfinite(lo) and np.isfinite(hi)
    with pytest.raises(ValueError, match="paired samples"):
        ratio_ci95([1.0, 2.0], [1.0])


@pytest.mark.parametrize("n", [3, 5, 10])
def test_the_p_value_read_from_an_interval_is_the_t_tests(n):
    from rlinfluence.statistics import interval_p_value

    values = np.random.default_rng(n).normal(0.4, 1.0, size=n)
    expected = stats.ttest_1samp(values, 0.0).pvalue
    mean, low, high = ci95(values)
    assert interval_p_value(mean, low, high, n) == pytest.approx(expected, rel=1e-9)
    spread = stats.norm.ppf(0.975) * values.std(ddof=0) / np.sqrt(n)  # a percentile bootstrap's, for a mean
    assert interval_p_value(mean, mean - spread, mean + spread, n, "percentile") == pytest.approx(expected, rel=1e-9)
    assert np.isnan(interval_p_value(1.0, np.nan, np.nan, n)) and np.isnan(interval_p_value(1.0, 0.5, 1.5, 1))
    with pytest.raises(ValueError, match="unknown interval"):
        interval_p_value(mean, low, high, n, "bca")


def test_holm_over_a_tables_speed_readings_can_take_a_faster_back():
    import pandas as pd

    from rlinfluence.experiments.published import speed_p_values

    rows = pd.DataFrame({"method": ["ppo", "a", "b", "c"], "seeds": 10, "interval": "t",
                         "log_ratio80": [0.0, 0.3, 0.17, 0.05], "log_ratio80_lo": [0.0, 0.15, 0.01, -0.1],
                         "log_ratio80_hi": [0.0, 0.45, 0.33, 0.2]})
    adjusted = speed_p_values(rows)
    raw = [interval_p_value_of(r) for r in rows.to_dict("records")[1:]]
    assert np.isnan(adjusted[0]) and raw[1] < 0.05 <= adjusted[2]  # b alone is "faster"; among three it is not
    assert adjusted[1:].tolist() == pytest.approx(sorted_holm(raw))


def interval_p_value_of(row):
    from rlinfluence.statistics import interval_p_value

    return interval_p_value(row["log_ratio80"], row["log_ratio80_lo"], row["log_ratio80_hi"], 10)


def sorted_holm(p):
    order = np.argsort(p)
    adjusted = np.empty(len(p))
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()
