"""``RUN_DIR/report.html`` of an RLHF run: reward, test toxicity, KL and kept fraction per round,
and where each round's time went (one self-contained HTML file, as ``rlinfluence report``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from rlinfluence.rundir import RunDirectory

STAGES = ("generation_seconds", "forward_seconds", "reward_seconds", "influence_seconds", "optimisation_seconds")


def _column(rows: list[dict], name: str) -> np.ndarray:
    def number(value: object) -> float:
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return math.nan

    return np.array([number(r.get(name)) for r in rows])


def write_report(run: RunDirectory) -> Path:
    """Write and return ``run.path / "report.html"`` from ``metrics.csv`` and ``config.json``."""
    from rlinfluence.analysis.report import Section, Table, figure_png, new_figure, write_html

    rows, config = run.rows, run.read_config()
    section = Section("rlhf", f"RLHF: {config.get('algo')} {config.get('filter')} on {config.get('model')}")
    section.summary = {k: config.get(k) for k in ("algo", "filter", "drop_mode", "target", "seed", "prompts_per_round",
                                                  "response_length", "learning_rate")}
    if not rows:
        section.paragraphs.append("metrics.csv has no completed round yet.")
        return write_html(run.path / "report.html", f"rlinfluence report: {run.path.name}", [section])
    rounds = _column(rows, "round")
    tox = _column(rows, "test_toxicity")
    tox_rounds, tox_values = rounds + 1, tox  # row k's evaluation is of theta(k+1)
    initial = _column(rows[:1], "test_toxicity_initial")
    if np.isfinite(initial).any():
        tox_rounds, tox_values = np.concatenate([[0], rounds + 1]), np.concatenate([initial, tox])
    fig, axes = new_figure(12, 3.4, ncols=3)
    axes[0, 0].plot(rounds, _column(rows, "reward_mean"), ".-", label="training reward (mean)")
    axes[0, 0].set(xlabel="round k", title="reward of the sampled responses")
    finite = np.isfinite(tox_values)
    axes[0, 1].plot(tox_rounds[finite], tox_values[finite], "o-")
    axes[0, 1].set(xlabel="theta(k): rounds completed", title="test toxicity (mean P(offensive))")
    axes[0, 2].plot(rounds, _column(rows, "kl"), ".-", label="KL (mean summed per sequence)")
    axes[0, 2].plot(rounds, _column(rows, "kept_fraction"), ".-", label="kept fraction")
    axes[0, 2].set(xlabel="round k", title="KL and kept fraction")
    axes[0, 2].legend(fontsize=8)
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
    section.figures["curves"] = (figure_png(fig), "Training reward per round, held-out test toxicity, KL and kept fraction.")
    means = [float(np.nanmean(_column(rows, s))) for s in STAGES]
    section.tables.append(Table("Mean seconds per round (evaluation excluded)", [s.removesuffix("_seconds") for s in STAGES],
                                [[round(m, 3) for m in means]]))
    section.summary.update({
        "rounds completed": len(rows), "final training reward": float(_column(rows, "reward_mean")[-1]),
        "final test toxicity": float(tox_values[finite][-1]) if finite.any() else math.nan,
        "train seconds": float(_column(rows, "train_seconds")[-1]),
    })
    return write_html(run.path / "report.html", f"rlinfluence report: {run.path.name}", [section])
