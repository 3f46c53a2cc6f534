"""Diagnosis of learning (docs/method.md, section 8.1): which records of a round hurt the return, and why.

The round's buffer is scored with the ``return`` target at theta(k). For small discrete state
spaces the estimated advantages A_hat (GAE) are compared with a Monte-Carlo advantage
A_bar(s, a) = Q_bar(s, a) - V_bar(s) from the buffer's own complete episodes
(``RolloutBuffer.monte_carlo_advantages``; no extra environment sampling):

- sign mismatch: A_bar * A_hat < 0 (strictly opposite signs; a record whose state saw only one
  action has A_bar = 0 and is not counted as a mismatch), as a fraction of the records that have
  an A_bar, among the bottom records and among all records;
- Spearman rank correlation between the score and A_bar * A_hat (the paper: about -0.67 on
  FrozenLake, round 5).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats

from rlinfluence.analysis.report import Section, Table, figure_png, new_figure
from rlinfluence.analysis.tables import add_record_frames, attribution_table
from rlinfluence.buffer import RolloutBuffer
from rlinfluence.envs import make_env, mc_unavailable_reason
from rlinfluence.errors import UserError
from rlinfluence.frames import load_frames
from rlinfluence.influence import DEFAULT_ADVANTAGE_NORM, ReturnTarget, score_buffer, top_records


def monte_carlo_advantages(buffer: RolloutBuffer, env_id: str, gamma: float) -> torch.Tensor:
    """A_bar per record (flat order, NaN where (s, a) is not in a complete episode);
    ``UserError`` for envs where it is not meaningful."""
    reason = mc_unavailable_reason(env_id)
    if reason is not None:
        raise UserError(f"Monte-Carlo advantage not available: {reason}")
    return buffer.monte_carlo_advantages(gamma)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """``scipy.stats.spearmanr`` (average ranks for ties); NaN, without scipy's warning, with
    fewer than 2 values or if either side is constant."""
    if len(x) < 2:
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        return float(stats.spearmanr(x, y).statistic)


@dataclass
class Diagnosis:
    env: str
    round: int
    table: pd.DataFrame
    """attribution_table + ``mc_advantage`` (A_bar, NaN where unavailable) and ``mismatch``."""
    bottom: np.ndarray
    """flat indices of the bottom records, lowest score first"""
    top: np.ndarray
    """flat indices of the top records, highest score first"""
    mc_reason: str | None
    """why A_bar is not available (None if it is)"""
    stats: dict[str, float]
    obs: np.ndarray
    """the buffer's observations, flat order"""
    frames: np.ndarray | None = None
    """the records' rendered frames, flat order (None if the run saved none)"""


def diagnose_round(saved, bottom: int = 100, advantage_norm: str = DEFAULT_ADVANTAGE_NORM,
                   frames: np.ndarray | None = None) -> Diagnosis:
    """Diagnose a ``SavedRound`` (``rlinfluence.ppo.load_round``); ``frames``: its records'
    frames (``rlinfluence.frames.load_frames``), shown with the top and bottom records."""
    trainer, buffer = saved.trainer, saved.buffer
    cfg = trainer.config
    scores = score_buffer(trainer.policy, buffer, target=ReturnTarget(), advantage_norm=advantage_norm,
                          chunk_size=cfg.batch_size, ent_coef=cfg.ent_coef)
    table = attribution_table(buffer, scores)
    flat_obs = buffer.flat("obs").reshape(len(buffer), -1)
    if ((flat_obs == 0) | (flat_obs == 1)).all() and (flat_obs.sum(1) == 1).all():  # one-hot: name the state
        table.insert(table.columns.get_loc("obs_summary"), "state", flat_obs.argmax(1).numpy())
    picks = top_records(scores, bottom)
    low, high = picks.opponents.numpy(), picks.proponents.numpy()
    reason = mc_unavailable_reason(cfg.env)
    stats: dict[str, float] = {"records": float(len(buffer)), "bottom": float(len(low)),
                               "fraction negative": float((scores < 0).double().mean())}
    if reason is None:
        a_bar = buffer.monte_carlo_advantages(cfg.gamma).numpy()
        a_hat = table["advantage"].to_numpy(np.float64)
        valid = np.isfinite(a_bar)
        mismatch = valid & (a_bar * a_hat < 0)
        table["mc_advantage"] = a_bar
        table["mismatch"] = mismatch
        score = table["score"].to_numpy()

        def frac(idx: np.ndarray) -> float:
            n = valid[idx].sum()
            return float(mismatch[idx].sum() / n) if n else math.nan

        def mean_gap(idx: np.ndarray) -> float:
            idx = idx[valid[idx]]
            return float(np.abs(a_bar[idx] - a_hat[idx]).mean()) if len(idx) else math.nan

        everything = np.arange(len(buffer))
        stats.update({
            "A_bar coverage": float(valid.mean()),
            "mismatch fraction, bottom": frac(low),
            "mismatch fraction, all": frac(everything),
            "mismatch fraction, top": frac(high),
            "mean |A_bar - A_hat|, bottom": mean_gap(low),
            "mean |A_bar - A_hat|, all": mean_gap(everything),
            "spearman(score, A_bar*A_hat)": spearman(score[valid], (a_bar * a_hat)[valid]),
            "spearman(score, A_bar*A_hat), bottom": spearman(score[low][valid[low]], (a_bar * a_hat)[low][valid[low]]),
        })
    return Diagnosis(cfg.env, buffer.round, table, low, high, reason, stats, buffer.flat("obs").numpy(), frames)


def diagnose(run_dir: str | Path, round_index: int, bottom: int = 100, advantage_norm: str = DEFAULT_ADVANTAGE_NORM) -> Diagnosis:
    """Load round ``round_index`` of a run saved with ``--save-buffers`` and diagnose it."""
    from rlinfluence.checkpoint import load_round

    if bottom < 1:
        raise UserError(f"--bottom must be >= 1, got {bottom}")
    saved = load_round(run_dir, round_index)
    return diagnose_round(saved, bottom, advantage_norm, load_frames(run_dir, round_index, len(saved.buffer)))


# -- figures -------------------------------------------------------------------------------
def scatter_png(d: Diagnosis) -> bytes:
    t = d.table
    product = (t["mc_advantage"] * t["advantage"]).to_numpy()
    score = t["score"].to_numpy()
    valid = np.isfinite(product)
    fig, axes = new_figure(6, 4.2)
    ax = axes[0, 0]
    ax.scatter(product[valid], score[valid], s=6, alpha=0.35, color="tab:gray", label="all records")
    for idx, colour, label in ((d.bottom, "tab:red", "bottom"), (d.top, "tab:green", "top")):
        idx = idx[valid[idx]]
        ax.scatter(product[idx], score[idx], s=12, color=colour, label=f"{label} {len(idx)}")
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(0, color="k", lw=0.6)
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set(xlabel="A_bar * A_hat (symlog)", ylabel="return-target score",
           title=f"{d.env}, round {d.round}: Spearman {d.stats['spearman(score, A_bar*A_hat)']:.3f}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return figure_png(fig)


_FROZENLAKE_TILES = {"S": "#cfe8ff", "F": "#f4f8fb", "H": "#2b3a4a", "G": "#ffd54f"}
_FROZENLAKE_MOVES = {0: (-1, 0), 1: (0, 1), 2: (1, 0), 3: (0, -1)}  # LEFT DOWN RIGHT UP as (dx, dy)


def frozenlake_png(d: Diagnosis, desc: np.ndarray) -> bytes:
    """Bottom and top records on the map: one arrow per (state, action), width ~ count, colour =
    mean score (shared diverging scale, red = harmful)."""
    from matplotlib.colors import TwoSlopeNorm

    nrow, ncol = desc.shape
    t = d.table
    states = d.obs.reshape(len(d.obs), -1).argmax(1)
    actions = t["action"].to_numpy().astype(int)
    score = t["score"].to_numpy()
    limit = max(float(np.abs(score[d.bottom]).max()), float(np.abs(score[d.top]).max()), 1e-12)
    norm = TwoSlopeNorm(0.0, -limit, limit)
    fig, axes = new_figure(9, 4.6, ncols=2)
    import matplotlib

    cmap = matplotlib.colormaps["RdYlGn"]
    for ax, idx, name in ((axes[0, 0], d.bottom, "bottom"), (axes[0, 1], d.top, "top")):
        for r in range(nrow):
            for c in range(ncol):
                ch = desc[r, c].decode() if isinstance(desc[r, c], bytes) else str(desc[r, c])
                ax.add_patch(matplotlib.patches.Rectangle((c, r), 1, 1, color=_FROZENLAKE_TILES.get(ch, "w"), ec="#999"))
                ax.text(c + 0.08, r + 0.2, ch, fontsize=8, color="#777")
        groups = pd.DataFrame({"s": states[idx], "a": actions[idx], "score": score[idx]}).groupby(["s", "a"])["score"]
        for (s, a), group in groups:
            r, c = divmod(int(s), ncol)
            dx, dy = _FROZENLAKE_MOVES[int(a)]
            ax.arrow(c + 0.5, r + 0.5, 0.32 * dx, 0.32 * dy, width=0.02 + 0.025 * math.log1p(len(group)),
                     head_width=0.12 + 0.03 * math.log1p(len(group)), length_includes_head=True,
                     color=cmap(norm(group.mean())), ec="k", lw=0.4)
            ax.text(c + 0.5 + 0.38 * dx, r + 0.5 + 0.38 * dy, str(len(group)), fontsize=6, ha="center", va="center")
        ax.set(xlim=(0, ncol), ylim=(nrow, 0), aspect="equal", xticks=[], yticks=[],
               title=f"{name} {len(idx)} records, round {d.round}")
    fig.colorbar(matplotlib.cm.ScalarMappable(norm, cmap), ax=axes[0, 1], label="mean score")
    fig.suptitle(d.env)
    return figure_png(fig)


_MINIGRID_ACTIONS = ["left", "right", "forward", "pickup", "drop", "toggle", "done"]
_MINIGRID_COLOURS = {0: "#111111", 1: "#ffffff", 2: "#888888", 8: "#3cb44b", 4: "#a0522d", 5: "#e6c619", 6: "#4363d8", 7: "#f58231", 9: "#e6194b"}


def minigrid_png(d: Diagnosis, n: int = 8) -> bytes:
    """The agent's 7x7 egocentric views of the n lowest and n highest records (the observation
    does not hold the absolute position): agent at the bottom centre facing up."""
    from matplotlib.colors import to_rgb

    t = d.table
    views = d.obs
    rows = [("bottom", d.bottom[:n]), ("top", d.top[:n])]
    fig, axes = new_figure(1.6 * n, 4.2, ncols=n, nrows=2)
    for r, (name, idx) in enumerate(rows):
        for c in range(n):
            ax = axes[r, c]
            ax.set(xticks=[], yticks=[])
            if c >= len(idx):
                ax.set_visible(False)
                continue
            i = int(idx[c])
            objects = views[i][:, :, 0].T  # encode() is indexed [x, y]
            image = np.array([[to_rgb(_MINIGRID_COLOURS.get(int(o), "#cccccc")) for o in row] for row in objects])
            ax.imshow(image)
            ax.plot(objects.shape[1] // 2, objects.shape[0] - 1, marker="^", color="tab:red", ms=8)
            a = int(t["action"].iloc[i])
            ax.set_title(f"{name}: {_MINIGRID_ACTIONS[a] if a < 7 else a}\n{t['score'].iloc[i]:.3g}", fontsize=7)
    fig.suptitle(f"{d.env}, round {d.round}")
    return figure_png(fig)


def diagnosis_section(d: Diagnosis, rows: int = 20) -> Section:
    section = Section(f"diagnosis_round_{d.round}", f"Diagnosis of round {d.round} ({d.env})")
    section.paragraphs.append(
        "Records of the round's buffer scored by their snapshot influence on the return target at "
        "theta(k); the bottom records are the most harmful. A_hat is the GAE advantage the update used.")
    columns = ["rank", "step", "episode", "state" if "state" in d.table else "obs_summary", "action",
               "advantage", "score"]
    if d.mc_reason is None:
        section.paragraphs.append(
            "A_bar = Q_bar(s,a) - V_bar(s) from the buffer's complete episodes (docs/method.md, section 8.1). "
            "Mismatch = A_bar * A_hat < 0; fractions are over records that have an A_bar. The paper "
            "reports a Spearman correlation of about -0.67 between score and A_bar * A_hat on FrozenLake.")
        columns += ["mc_advantage", "mismatch"]
    else:
        section.paragraphs.append(f"Monte-Carlo advantage: not available ({d.mc_reason}).")
    section.summary = dict(d.stats)
    add_record_frames(section, d.table, d.frames, {"Bottom (most harmful)": d.bottom, "Top (most helpful)": d.top})
    for name, idx in (("bottom", d.bottom[:rows]), ("top", d.top[:rows])):
        sub = d.table.iloc[idx]
        section.tables.append(Table(f"{name} {len(idx)} records", columns,
                                    [[_cell(v) for v in row] for row in sub[columns].itertuples(index=False)]))
    if d.mc_reason is None:
        section.figures["scatter"] = (scatter_png(d), "Score vs A_bar * A_hat (symlog x); bottom records red, top green.")
        if d.env.startswith("FrozenLake"):
            env = make_env(d.env)
            section.figures["grid"] = (frozenlake_png(d, env.unwrapped.desc),
                                       "Bottom (left) and top (right) records on the map: arrow = action, "
                                       "number = records, colour = mean score.")
            env.close()
        elif d.obs.ndim == 4 and d.obs.shape[-1] == 3:  # MiniGrid image observations
            section.figures["views"] = (minigrid_png(d), "Egocentric views of the lowest and highest records.")
    return section


def _cell(value: object) -> object:
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, np.generic):
        return value.item()
    return value
