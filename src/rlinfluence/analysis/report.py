"""Analysis results as sections, and one self-contained HTML report per run.

Every analysis (diagnosis, timeline, intervention) returns a ``Section``: a title, paragraphs,
key figures (``summary``), tables, PNG figures and galleries of records with their rendered
frames. ``save_section`` writes it to ``RUN_DIR/analyses/<key>.json`` plus
``<key>__<figure>.png``; ``build_report`` gathers the run's learning curve, its per-round
influence statistics and every saved section into one HTML file with the images embedded as
base64 PNG (no external file, script or style sheet). Every HTML page of the package is rendered
from its Jinja2 templates (``rlinfluence/templates/page.html.j2``) by ``render_html``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from rlinfluence.config import DEFAULT_ADVANTAGE_NORM
from rlinfluence.errors import UserError
from rlinfluence.pages import (  # noqa: F401  (the building blocks, importable from here)
    ANALYSES_DIR,
    ROUND_LABEL,
    evenly_spaced,
    figure_png,
    load_sections,
    new_figure,
    render_html,
    round_axis,
    save_section,
    write_html,
)
from rlinfluence.rundir import RunDirectory, saved_round_numbers
from rlinfluence.sections import FrameCard, Gallery, Section, Table  # noqa: F401  (importable from here)


# -- the run report ------------------------------------------------------------------------
def learning_section(run: RunDirectory, config: dict[str, Any]) -> Section:
    """Learning curve and per-round training statistics from ``metrics.csv``."""
    rows = run.rows
    section = Section("learning", "Learning curve")
    section.summary = {
        "env": config.get("env"), "method": config.get("method") or config.get("filter"),
        "seed": config.get("seed"), "rounds completed": len(rows),
        "optimizer": f"{config.get('optimizer')} lr {config.get('learning_rate')}",
        "eval episodes per round": config.get("eval_episodes"),
    }
    if not rows:
        section.paragraphs.append("metrics.csv has no completed round yet.")
        return section
    if config.get("eval_episodes") == 0:  # a run written without evaluation: its curve is the training episodes'
        section.paragraphs.append("The run was written without evaluation episodes (eval_episodes 0): the curve "
                                  "is the training episodes' returns.")
    elif not any("eval_return_mean" in r for r in rows):
        raise UserError(f"{str(run.path / 'metrics.csv')!r} has no eval_return_mean column "
                        "(not written by rlinfluence train?)")
    rounds = np.array([r["round"] for r in rows], dtype=float)

    def column(name: str) -> np.ndarray:
        return np.array([float(r.get(name, math.nan)) if r.get(name, "") != "" else math.nan for r in rows])

    mean, std = column("eval_return_mean"), column("eval_return_std")
    fig, axes = new_figure(9, 7.5, nrows=3, sharex=True)
    return_ax, update_ax, kl_ax = axes[:, 0]
    # round k's row: its update theta(k) -> theta(k+1), then the evaluation of theta(k+1)
    return_ax.plot(rounds, mean, label="evaluation of theta(k+1) (stochastic policy), +/- 1 std over episodes")
    return_ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
    train = column("train_return_mean")
    if np.isfinite(train).any():
        return_ax.plot(rounds, train, alpha=0.7, label="training episodes finished in round k")
    return_ax.set(ylabel="return")
    update_ax.plot(rounds, column("kept_fraction"), label="kept fraction")
    if np.isfinite(column("clip_fraction")).any():
        update_ax.plot(rounds, column("clip_fraction"), label="clip fraction")
    update_ax.set(ylabel="fraction")
    kl_ax.plot(rounds, column("approx_kl"), color="tab:purple", label="approx_kl of the update")
    kl_ax.set(ylabel="approx_kl")
    for ax in axes[:, 0]:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        round_axis(ax, ROUND_LABEL if ax is kl_ax else None)
    fig.suptitle(str(config.get("env")))
    section.figures["curve"] = (figure_png(fig), "Per round k: the evaluation return of theta(k+1) (+/- 1 std "
                                "over episodes), the kept and clip fractions and the approx KL of its update.")
    best = int(np.nanargmax(mean)) if np.isfinite(mean).any() else None
    figures = {
        "final eval return": float(mean[-1]),
        "best eval return": float(mean[best]) if best is not None else math.nan,
        "best after round": int(rounds[best]) if best is not None else None,
        "train seconds": float(column("train_seconds")[-1]),
    }
    # what the run did not record (a run written from another trainer has no train seconds) is left out, not "nan"
    section.summary.update({k: v for k, v in figures.items() if v is not None and not (isinstance(v, float) and math.isnan(v))})
    return section


def influence_section(run_dir: str | Path, n_rounds: int = 6, advantage_norm: str = DEFAULT_ADVANTAGE_NORM) -> Section | None:
    """Return-target snapshot scores of up to ``n_rounds`` evenly spaced saved rounds: histograms
    and a table (fraction negative, spread), plus the kept fraction the run actually used, and
    the last of these rounds' top and bottom records with their frames (if saved)."""
    from rlinfluence.analysis.tables import add_record_frames, attribution_table
    from rlinfluence.checkpoint import load_round
    from rlinfluence.frames import load_frames
    from rlinfluence.influence import ReturnTarget, score_buffer

    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    saved = saved_rounds(run)
    if not saved:
        return None
    picks = evenly_spaced(saved, n_rounds)
    section = Section("influence", "Per-round influence statistics (return target)")
    section.paragraphs.append(
        f"Snapshot influence of every record on the return target at theta(k) (advantage "
        f"normalisation: {advantage_norm}) for {len(picks)} of the {len(saved)} saved rounds. "
        "Positive = the record pushes the round's update towards a higher return.")
    rows, all_scores = [], {}
    kept = {int(r["round"]): r.get("kept_fraction") for r in run.rows}
    for k in picks:
        s = load_round(run_dir, k)
        cfg = s.trainer.config
        scores = score_buffer(s.trainer.policy, s.buffer, target=ReturnTarget(), advantage_norm=advantage_norm,
                              chunk_size=cfg.batch_size, ent_coef=cfg.ent_coef)
        last = attribution_table(s.buffer, scores)  # the last round's records are shown with their frames
        scores = scores.double().numpy()
        all_scores[k] = scores
        rows.append([k, len(scores), float((scores < 0).mean()), float(scores.mean()), float(scores.std()),
                     float(scores.min()), float(scores.max()), kept.get(k)])
    section.tables.append(Table("Return-target scores per round (kept fraction = what the run trained on)",
                                ["round", "records", "fraction negative", "mean", "std", "min", "max",
                                 "kept fraction"], rows))
    ncols = min(3, len(picks))
    nrows = math.ceil(len(picks) / ncols)
    fig, axes = new_figure(3.4 * ncols, 2.6 * nrows, ncols=ncols, nrows=nrows)
    for ax in axes.ravel()[len(picks):]:
        ax.set_visible(False)
    for ax, k in zip(axes.ravel(), picks, strict=False):
        scores = all_scores[k]
        ax.hist(scores, bins=60, color="tab:blue")
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set(title=f"round {k}: {np.mean(scores < 0):.0%} negative", xlabel="score", ylabel="records (log scale)")
    fig.suptitle(str(run.read_config().get("env")))
    section.figures["histograms"] = (figure_png(fig), "Histograms of return-target scores (log count).")
    k, order = picks[-1], last.sort_values("rank").index.to_numpy()
    add_record_frames(section, last, load_frames(run_dir, k, len(last)),
                      {f"Round {k}, top (most helpful)": order, f"Round {k}, bottom (most harmful)": order[::-1]})
    return section


def saved_rounds(run: RunDirectory) -> list[int]:
    """Rounds k whose buffer and theta(k) checkpoint are both saved."""
    found = []
    for k in run.saved_buffer_rounds():
        if run.checkpoint_path(k).is_file():
            found.append(k)
    return found


def build_report(run_dir: str | Path, out: str | Path | None = None, score_rounds: int = 6) -> tuple[Path, list[Section]]:
    """Write the run's report (default ``RUN_DIR/report.html``); returns its path and sections. A
    folder that is no run of our trainer but holds saved analyses (a Stable-Baselines3 run's
    ``audit`` written by ``AuditCallback`` and ``rlinfluence audit``) gets a report of those."""
    folder = Path(run_dir)
    if not (folder / "config.json").is_file() and (folder / ANALYSES_DIR).is_dir():
        sections = load_sections(folder / ANALYSES_DIR)
        if sections:
            path = write_html(Path(out) if out else folder / "report.html", f"rlinfluence report: {folder.name}",
                              sections)
            return path, sections
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    config = run.read_config()
    completed = saved_round_numbers(run.path / "checkpoints", ".pt")
    if completed:  # the curve is the rows of every completed round, each once, none missing
        run.truncate(completed[-1])
    if not run.rows:
        raise UserError(f"{str(run.path / 'metrics.csv')!r} has no round: nothing to report yet")
    sections = [learning_section(run, config)]
    if score_rounds > 0:
        influence = influence_section(run_dir, score_rounds)
        if influence is not None:
            sections.append(influence)
    sections += load_sections(run.path / ANALYSES_DIR)
    path = write_html(Path(out) if out else run.path / "report.html",
                      f"rlinfluence report: {run.path.name}", sections)
    return path, sections
