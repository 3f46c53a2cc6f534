"""Several compare folders (one per env) -> one table and rliable's plots (``rlinfluence aggregate``).

Each folder's ``scores.csv`` holds every evaluation run's normalised scores against that
folder's reference (``statistics``). Across envs they form, per method, a [runs, tasks] matrix
(the first n seeds of each env, n = the fewest any env has), from which rliable gives

    IQM and mean over all runs and envs, with stratified-bootstrap 95% intervals;
    P(method > reference), averaged over envs, with its interval: paired (seed i against seed i)
    when in every env the method's seeds are the reference's, unpaired otherwise, and said so;
    performance profiles: the fraction of runs whose score exceeds tau, for tau on a grid.

Outputs: aggregate.md, aggregate.csv, intervals.png, performance_profile.png,
probability_of_improvement.png and aggregate.html (self-contained, images embedded).
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlinfluence.errors import UserError, require_module
from rlinfluence.experiments.summary import markdown_table
from rlinfluence.progress import progress_bar
from rlinfluence.rundir import atomic_write
from rlinfluence.statistics import (
    DEFAULT_REPS,
    interval_estimates,
    probability_of_improvement,
)

KINDS = ("auc", "final")


def _load(folder: Path) -> tuple[str, str, pd.DataFrame]:
    """(env, reference, scores) of one compare folder."""
    scores_path, config_path = folder / "scores.csv", folder / "compare.json"
    if not scores_path.is_file() or not config_path.is_file():
        raise UserError(f"{str(folder)!r} is not a finished compare folder (no scores.csv / compare.json): "
                        "run or re-run `rlinfluence compare --out` on it first")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"cannot read {str(config_path)!r} ({exc}): re-run `rlinfluence compare --out {folder}`") from None
    if not isinstance(config, dict) or not isinstance(config.get("env"), str):
        raise UserError(f"{str(config_path)!r} is not a compare.json (no env): re-run `rlinfluence compare --out {folder}`")
    try:
        scores = pd.read_csv(scores_path)
    except (OSError, ValueError, pd.errors.EmptyDataError) as exc:  # binary, empty, ragged
        raise UserError(f"cannot read {str(scores_path)!r} ({str(exc).splitlines()[0] if str(exc) else 'empty'}): "
                        f"re-run `rlinfluence compare --out {folder}`") from None
    missing = sorted({"method", "seed", "reference", *KINDS} - set(scores.columns))
    if missing:
        raise UserError(f"{str(scores_path)!r} has no column {missing[0]!r}: re-run `rlinfluence compare --out {folder}`")
    for column in ("seed", *KINDS):
        values = pd.to_numeric(scores[column], errors="coerce")
        bad = scores[column][values.isna() & scores[column].notna()]
        if len(bad) or (column == "seed" and values.isna().any()):
            raise UserError(f"{str(scores_path)!r}: {column} must be numeric, got {bad.iloc[0] if len(bad) else 'an empty cell'!r}")
        scores[column] = values
    if scores.empty:
        raise UserError(f"{str(scores_path)!r} has no rows: re-run `rlinfluence compare --out {folder}`")
    reference = str(scores["reference"].iloc[0])
    if not (scores["method"] == reference).any():
        raise UserError(f"{str(scores_path)!r} has no row of its reference {reference!r}")
    return config["env"], reference, scores


def score_matrices(folders: Sequence[str | Path]
                   ) -> tuple[list[str], str, list[str], dict[str, dict[str, np.ndarray]], bool]:
    """(envs, reference, methods, {kind: {method: [runs, envs]}}, paired) of the methods every
    folder has; paired = row i of every matrix is the same seed in each env."""
    if not folders:
        raise UserError("aggregate needs at least one compare folder")
    loaded = [_load(Path(f)) for f in folders]
    envs = [env for env, _, _ in loaded]
    if len(set(envs)) < len(envs):
        raise UserError(f"two folders are for the same env ({envs}); aggregate one folder per env")
    references = {ref for _, ref, _ in loaded}
    if len(references) > 1:
        raise UserError(f"the folders use different references {sorted(references)}")
    reference = references.pop()
    methods = [m for m in dict.fromkeys(loaded[0][2]["method"])
               if all(m in set(s["method"]) for _, _, s in loaded)]
    n_runs = min(int((s["method"] == reference).sum()) for _, _, s in loaded)
    matrices: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in KINDS}
    for _, _, s in loaded:
        repeated = s[s.duplicated(["method", "seed"])]
        if len(repeated):
            raise UserError(f"scores.csv lists {repeated.iloc[0]['method']} seed {repeated.iloc[0]['seed']} twice")

    def seeds_of(s: pd.DataFrame, m: str) -> list[int]:
        return sorted(s[s["method"] == m]["seed"])[:n_runs]

    paired = all(seeds_of(s, m) == seeds_of(s, reference) for _, _, s in loaded for m in methods)
    for kind in KINDS:
        for m in methods:
            columns = [s[s["method"] == m].sort_values("seed")[kind].to_numpy()[:n_runs] for _, _, s in loaded]
            matrices[kind][m] = np.stack(columns, axis=1)
    return envs, reference, methods, matrices, paired


def aggregate(folders: Sequence[str | Path], out: str | Path, reps: int = DEFAULT_REPS, seed: int = 0,
              progress: bool = False) -> Path:
    """Write the aggregate table, plots and HTML page into ``out``; returns ``out`` (``progress``:
    a line per bootstrap step, which take a while at many replications)."""
    from rlinfluence.pages import write_html
    from rlinfluence.sections import Section, Table

    require_module("rliable.library", "aggregate")  # its plots: refuse before any work, not after the bootstrap
    envs, reference, methods, matrices, paired = score_matrices(folders)
    pairing = "paired" if paired else "unpaired"
    for kind in KINDS:
        bad = [m for m, x in matrices[kind].items() if not np.isfinite(x).all()]
        if bad:
            raise UserError(f"{kind} scores of {bad} are undefined in some env (its reference did not move)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with progress_bar(progress, f"aggregate ({reps} bootstrap draws)", len(KINDS) + len(methods)) as advance:
        estimates = {}
        for kind in KINDS:
            estimates[kind] = interval_estimates(matrices[kind], reps, seed)
            advance(f"IQM and mean intervals of {kind}")
        for m in methods:
            row: dict[str, Any] = {"method": m, "envs": len(envs), "runs_per_env": matrices["auc"][m].shape[0]}
            for kind in KINDS:
                for stat in ("iqm", "mean"):
                    row[f"{stat}_{kind}"], row[f"{stat}_{kind}_lo"], row[f"{stat}_{kind}_hi"] = estimates[kind][m][stat]
                row[f"poi_{kind}"], row[f"poi_{kind}_lo"], row[f"poi_{kind}_hi"] = probability_of_improvement(
                    matrices[kind][m], matrices[kind][reference], reps, seed, paired)
            rows.append(row)
            advance(f"P(improvement) of {m}")
    table = pd.DataFrame(rows)
    atomic_write(out / "aggregate.csv", lambda p: table.to_csv(p, index=False))

    def cell(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f} [{r[key + '_lo']:.2f}, {r[key + '_hi']:.2f}]"

    columns = ["method", "IQM auc", "mean auc", "IQM final", "mean final", f"{pairing} P(> {reference}) auc",
               f"{pairing} P(> {reference}) final"]
    body = [[r["method"], *(cell(r, k) for k in ("iqm_auc", "mean_auc", "iqm_final", "mean_final", "poi_auc",
                                                 "poi_final"))] for r in rows]
    note = (f"Envs: {', '.join(envs)}; {rows[0]['runs_per_env']} evaluation runs per env and method. Scores "
            f"normalised per env to {reference} (0 = its first-round return, 1 = its plateau); auc = mean of the "
            f"normalised curve over rounds, final = normalised plateau. 95% stratified-bootstrap intervals "
            f"({reps} replications, bootstrap seed {seed}). P(> {reference}) is {pairing}: "
            + ("a method's seed i against the reference's seed i in each env." if paired else
               "every run against every run of the reference (the folders' seeds differ between methods)."))
    lines = [f"# Aggregate over {len(envs)} envs against {reference}", "", note, ""]
    atomic_write(out / "aggregate.md", lambda p: p.write_text("\n".join(lines + markdown_table(columns, body)) + "\n"))

    title = f"{', '.join(envs)}: {rows[0]['runs_per_env']} runs per env and method"
    figures = {"intervals": _intervals_png(estimates, methods, title),
               "performance_profile": _profile_png(matrices, methods, title),
               "probability_of_improvement": _poi_png(matrices, methods, reference, reps, title, seed, paired)}
    section = Section("aggregate", f"Aggregate over {len(envs)} envs against {reference}", paragraphs=[note])
    section.tables.append(Table("Aggregate (point [95% CI])", columns, body))
    captions = {"intervals": "IQM and mean of the normalised scores with 95% stratified-bootstrap intervals "
                             f"(an interval narrower than {2 * MIN_BAR} is drawn as a mark of that width).",
                "performance_profile": "Fraction of runs (all envs) whose normalised score exceeds tau.",
                "probability_of_improvement": f"{pairing} P(method > {reference}) with 95% intervals."}
    for name, png in figures.items():
        atomic_write(out / f"{name}.png", lambda p, png=png: p.write_bytes(png))
        section.figures[name] = (png, captions[name])
    write_html(out / "aggregate.html", section.title, [section])
    return out


def _rliable_plot(draw: Any) -> bytes:
    """Run an rliable plotting call on a fresh pyplot figure and return the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = draw(plt)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")  # rliable's labels sit outside the axes
    plt.close(fig)
    return buf.getvalue()


MIN_BAR = 0.005
"""Half the width of the thinnest interval bar drawn (normalised-score units)."""


def _intervals_png(estimates: dict[str, dict[str, dict[str, tuple[float, float, float]]]], methods: list[str],
                   title: str) -> bytes:
    from rliable import plot_utils

    def draw(plt: Any) -> Any:
        names = [f"{'IQM' if stat == 'iqm' else 'mean'} {kind}" for kind in KINDS for stat in ("iqm", "mean")]
        points = {m: np.array([estimates[k][m][s][0] for k in KINDS for s in ("iqm", "mean")]) for m in methods}
        cis = {m: np.array([[estimates[k][m][s][i] for k in KINDS for s in ("iqm", "mean")] for i in (1, 2)])
               for m in methods}
        # an interval of zero width (the reference's final score is 1 on every seed, normalised to
        # itself) would be drawn as nothing: widen it to a thin visible mark around its point
        for m in methods:
            cis[m] = np.stack([np.minimum(cis[m][0], points[m] - MIN_BAR), np.maximum(cis[m][1], points[m] + MIN_BAR)])
        fig, _ = plot_utils.plot_interval_estimates(points, cis, metric_names=names, algorithms=methods,
                                                    xlabel="normalised score", xlabel_y_coordinate=-0.45,
                                                    row_height=0.5)
        fig.suptitle(f"{title}; bars: 95% stratified-bootstrap intervals", y=1.35)  # above the panel titles
        return fig

    return _rliable_plot(draw)


def _profile_png(matrices: dict[str, dict[str, np.ndarray]], methods: list[str], title: str) -> bytes:
    from matplotlib.lines import Line2D
    from rliable import library, plot_utils

    colors = {m: f"C{i}" for i, m in enumerate(methods)}

    def draw(plt: Any) -> Any:
        fig, axes = plt.subplots(1, len(KINDS), figsize=(6 * len(KINDS), 4))
        for ax, kind in zip(axes, KINDS, strict=True):
            values = np.concatenate([x.ravel() for x in matrices[kind].values()])
            taus = np.linspace(min(0.0, values.min()), max(1.2, values.max()), 81)
            profiles, cis = library.create_performance_profile(matrices[kind], taus, reps=500)
            plot_utils.plot_performance_profiles(profiles, taus, performance_profile_cis=cis, colors=colors, ax=ax,
                                                 xlabel=rf"normalised {kind} score $\tau$", labelsize="medium")
            ax.set_title(kind)
            ax.legend([Line2D([], [], color=colors[m]) for m in methods], methods, fontsize=8,
                      title="band: 95% stratified-bootstrap interval", title_fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        return fig

    return _rliable_plot(draw)


def _poi_png(matrices: dict[str, dict[str, np.ndarray]], methods: list[str], reference: str, reps: int,
             title: str, seed: int, paired: bool) -> bytes:
    others = [m for m in methods if m != reference]

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(6, 0.6 + 0.5 * len(others) * len(KINDS)))
        labels, points, lows, highs = [], [], [], []
        for kind in KINDS:
            for m in others:
                p, lo, hi = probability_of_improvement(matrices[kind][m], matrices[kind][reference], reps, seed, paired)
                labels.append(f"{m} ({kind})")
                points.append(p)
                lows.append(p - lo)
                highs.append(hi - p)
        y = np.arange(len(labels))
        ax.errorbar(points, y, xerr=[lows, highs], fmt="o", capsize=4)
        ax.axvline(0.5, color="k", lw=0.8, ls="--")
        ax.set_yticks(y, labels)
        ax.set(xlim=(0, 1), xlabel=f"{'paired' if paired else 'unpaired'} P(method > {reference}), 95% bootstrap intervals", title=title)
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        return fig

    return _rliable_plot(draw)
