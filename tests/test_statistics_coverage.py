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
