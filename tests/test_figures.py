"""The figures people read: legends that cover no data, labelled axes, names as written.

Each test captures the matplotlib figure a function draws (its ``figure_png`` replaced by a
recorder) and checks the drawn artists, not the PNG bytes.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from tests.test_analysis import frozenlake_run  # noqa: F401  (the shared tiny run fixture)


@pytest.fixture
def drawn(monkeypatch):
    """``drawn(module)``: figures that ``module.figure_png`` would have encoded are kept in the list returned."""
    figures = []

    def capture(module):
        monkeypatch.setattr(module, "figure_png", lambda fig, dpi=100: figures.append(fig) or b"")
        return figures

    return capture


def _intervention_rows(runs: int) -> pd.DataFrame:
    rows = []
    for seed in range(runs):
        rows.append({"env": "FrozenLake-v1", "round": 3, "seed": seed, "dropped": 10, "records": 100, "R_a": 0.5,
                     **{f"delta_{arm}": 0.1 * (j + 1) + 0.01 * seed for j, arm in enumerate("bcd")},
                     "d_matched": True, "b_minus_d": -0.1, "kl_a": 0.01, "kl_b": 0.02, "kl_d": 0.02, "d_lr_scale": 1.5})
    return pd.DataFrame(rows)


def test_the_intervention_legend_is_under_the_panels_and_one_run_is_singular(drawn):
    from rlinfluence.analysis import intervention

    figures = drawn(intervention)
    intervention.bar_png(_intervention_rows(1))
    (fig,) = figures
    ax = fig.axes[0]
    assert ax.get_legend() is None  # no legend inside the panel, where it covered bar (b)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()][0].startswith("(b)")
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)  # lays the figure out as saving it does
    legend_box, axes_box = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend_box.y1 <= axes_box.y0  # below the panel
    assert ax.get_title() == "FrozenLake-v1 (1 run)" and "1 runs" not in legend.get_title().get_text()
    figures.clear()
    intervention.bar_png(_intervention_rows(3))
    assert figures[0].axes[0].get_title() == "FrozenLake-v1 (3 runs)"


def test_score_histograms_label_their_count_axis(frozenlake_run, drawn):  # noqa: F811
    from rlinfluence.analysis import report

    figures = drawn(report)
    report.influence_section(frozenlake_run, n_rounds=2)
    histograms = [ax for fig in figures for ax in fig.axes if ax.get_visible() and ax.get_yscale() == "log"]
    assert histograms and all(ax.get_ylabel() == "records (log scale)" for ax in histograms)


def test_round_axes_read_without_a_stray_parenthesis():
    from rlinfluence.analysis.report import ROUND_LABEL

    assert "))" not in ROUND_LABEL and ROUND_LABEL.count("(") == ROUND_LABEL.count(")")
    depth = 0
    for char in ROUND_LABEL:  # no parenthesis inside another: "theta(k+1))" read as a stray ")"
        depth += {"(": 1, ")": -1}.get(char, 0)
        assert 0 <= depth <= 1


def test_aggregate_intervals_name_the_mean_as_written_and_draw_a_zero_width_interval(monkeypatch):
    from rliable import plot_utils

    from rlinfluence.experiments import aggregate

    seen = {}

    def record(points, cis, metric_names, algorithms, **kwargs):
        seen.update(points=points, cis=cis, names=metric_names)
        return plot_utils.plt.figure(), None

    monkeypatch.setattr(plot_utils, "plot_interval_estimates", record)
    # the reference normalised to itself: final score 1 on every seed, an interval of width 0
    estimates = {kind: {"ppo": {"iqm": (1.0, 1.0, 1.0), "mean": (1.0, 1.0, 1.0)},
                        "iif": {"iqm": (1.2, 1.0, 1.4), "mean": (1.1, 0.9, 1.3)}} for kind in aggregate.KINDS}
    aggregate._intervals_png(estimates, ["ppo", "iif"], "test")
    assert seen["names"] == ["IQM auc", "mean auc", "IQM final", "mean final"]
    lo, hi = seen["cis"]["ppo"]
    assert np.all(hi - lo >= 2 * aggregate.MIN_BAR - 1e-12)  # a visible mark, not nothing
    np.testing.assert_allclose(seen["cis"]["iif"], [[1.0, 0.9, 1.0, 0.9], [1.4, 1.3, 1.4, 1.3]])  # real ones unchanged
