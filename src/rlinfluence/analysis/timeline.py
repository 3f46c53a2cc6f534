"""Behaviour-formation timeline (docs/method.md, section 8.2): how a fixed (s*, a*) is learned, round by round.

For every saved round k the buffer is scored with ``ActionTarget(s*, a*)`` at theta(k) and we
track pi_theta(k)(a*|s*), the top records and the **roughness** of the scores:

- nodes: the round's records with positive score, valued I_tilde_i = I_i / max_j |I_j| (max over
  all records of the round);
- embeddings e_i: the final policy's last actor hidden layer (``actor(encoder(obs))``);
- edges: each node's u nearest neighbours (scikit-learn's ``kneighbors_graph``, a sparse
  matrix), symmetrised by union (i~j if either is among the other's u nearest), weight w_ij = exp(-||e_i - e_j||^2 / sigma^2), sigma = the median
  pairwise distance between the nodes (the median of the non-zero distances if that is 0,
  e.g. many records of one discrete state);
- roughness = sum_{i<j} w_ij (I_tilde_i - I_tilde_j)^2 / sum_{i<j} w_ij (normalised Dirichlet
  energy): 0 for constant scores, high when neighbouring records disagree.

The paper describes three phases (action-advantage association, semantic clustering, influence
saturation); ``estimate_phases`` places their boundaries from the data by two stated rules and
draws none where a rule does not fire. With frames saved (``--save-frames``) the top records of
up to ``GALLERY_ROUNDS`` rounds are shown with their frames.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import sparse
from scipy.spatial.distance import pdist

from rlinfluence.analysis.report import (
    ROUND_LABEL,
    Gallery,
    Section,
    Table,
    evenly_spaced,
    figure_png,
    new_figure,
    round_axis,
    saved_rounds,
)
from rlinfluence.analysis.tables import FRAME_RECORDS, attribution_table, record_cards
from rlinfluence.errors import UserError
from rlinfluence.frames import HOW_TO_SAVE, load_frames
from rlinfluence.influence import DEFAULT_ADVANTAGE_NORM, ActionTarget, score_buffer, top_records
from rlinfluence.rundir import RunDirectory

GALLERY_ROUNDS = 6
"""rounds whose top records are shown with their frames (evenly spaced over the timeline)"""


# -- roughness -----------------------------------------------------------------------------
def knn_weights(embeddings: np.ndarray, u: int) -> tuple[sparse.csr_array, float]:
    """Sparse symmetric weights of the symmetrised u-nearest-neighbour graph
    (``sklearn.neighbors.kneighbors_graph``), and sigma.

    ``embeddings [n, d]``; a record is never its own neighbour; no weight on the diagonal.
    """
    from sklearn.neighbors import kneighbors_graph

    e = np.asarray(embeddings, dtype=np.float64).reshape(len(embeddings), -1)
    n = len(e)
    if n < 2:
        return sparse.csr_array((n, n)), math.nan
    if u < 1:
        raise ValueError(f"u must be >= 1, got {u}")
    pairs = pdist(e)
    sigma = float(np.median(pairs))
    if sigma == 0:
        positive = pairs[pairs > 0]
        sigma = float(np.median(positive)) if len(positive) else 1.0
    adjacent = kneighbors_graph(e, min(u, n - 1), mode="connectivity")
    rows, cols = sparse.triu(adjacent + adjacent.T, k=1).nonzero()  # i~j if either is the other's neighbour
    weights = np.exp(-(np.linalg.norm(e[rows] - e[cols], axis=1) / sigma) ** 2)
    upper = sparse.coo_array((weights, (rows, cols)), shape=(n, n))
    return (upper + upper.T).tocsr(), sigma


def dirichlet_roughness(values: np.ndarray, weights: np.ndarray | sparse.sparray) -> float:
    """sum_{i<j} w_ij (x_i - x_j)^2 / sum_{i<j} w_ij for a symmetric (sparse or dense) weight
    matrix (NaN if no edge)."""
    x = np.asarray(values, dtype=np.float64)
    upper = sparse.triu(sparse.coo_array(weights), k=1).tocoo()
    total = upper.data.sum()
    if total <= 0:
        return math.nan
    return float((upper.data * (x[upper.row] - x[upper.col]) ** 2).sum() / total)


def roughness(scores: np.ndarray, embeddings: np.ndarray, u: int = 50) -> float:
    """The roughness (docs/method.md, section 8.2) of one round's scores (NaN with fewer than 2 positive records)."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = scores > 0
    if positive.sum() < 2:
        return math.nan
    weights, _ = knn_weights(np.asarray(embeddings)[positive], u)
    return dirichlet_roughness(scores[positive] / np.abs(scores).max(), weights)


# -- the policy and (s*, a*) ---------------------------------------------------------------
def load_final(run_dir: str | Path):
    """The run's trainer restored to its last checkpoint theta(T), and T."""
    from rlinfluence.checkpoint import reading_trainer
    from rlinfluence.ppo import PPOConfig

    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    config = dataclasses.replace(PPOConfig.from_dict(run.read_config()), progress=False)
    path = run.latest_checkpoint()
    trainer = reading_trainer(run, config)
    trainer.load_state_dict(run.read_checkpoint(path), source=repr(str(path)))
    return trainer, trainer.round


@torch.no_grad()
def embed(policy: torch.nn.Module, obs: torch.Tensor) -> np.ndarray:
    """Record embeddings: the output of the policy's last actor hidden layer."""
    return policy.actor(policy.encoder(obs)).double().numpy()


@torch.no_grad()
def preferred_action(policy: torch.nn.Module, obs: torch.Tensor) -> torch.Tensor:
    """The policy's mode at one observation: argmax action (discrete) or the Gaussian mean."""
    out = policy.action_head(policy.actor(policy.encoder(obs[None])))[0]
    return out if policy.continuous else out.argmax()


@torch.no_grad()
def action_probability(policy: torch.nn.Module, obs: torch.Tensor, action: torch.Tensor) -> float:
    """pi(a|s) (a density for continuous actions)."""
    return float(policy.log_prob(obs[None], action[None]).exp()[0])


def _finite(values: Sequence[float], what: str) -> list[float]:
    values = [float(v) for v in values]
    if not all(math.isfinite(v) for v in values):
        raise UserError(f"{what} must be finite numbers, got {values}")
    return values


@dataclass
class StateAction:
    obs: torch.Tensor
    action: torch.Tensor
    description: str


def select_state_action(run_dir: str | Path, *, state_round: int | None = None, state_index: int | None = None,
                        state: Sequence[float] | None = None, action: Sequence[float] | None = None
                        ) -> StateAction:
    """(s*, a*): s* = record ``state_index`` of round ``state_round``'s buffer (default: the last
    saved round) or the explicit observation ``state`` (its values, flattened); a* = ``action`` (one
    integer for a discrete action space, the action's values for a continuous one) or the
    final policy's preferred action at s*."""
    from rlinfluence.checkpoint import load_round

    final, t_final = load_final(run_dir)
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    rounds = saved_rounds(run)
    if not rounds:
        raise UserError(f"{str(run_dir)!r} has no saved rounds (train with --save-buffers)")
    if (state is None) == (state_index is None):
        raise UserError("give exactly one of --state-index (a record of a saved buffer) or --state (an observation)")
    if state_index is not None:
        k = rounds[-1] if state_round is None else state_round
        buffer = load_round(run_dir, k).buffer
        if not 0 <= state_index < len(buffer):
            raise UserError(f"--state-index {state_index} is out of range: round {k} has {len(buffer)} records "
                            f"(0..{len(buffer) - 1})")
        obs = buffer.flat("obs")[state_index]
        where = f"record {state_index} of round {k}"
    else:
        shape = final.env.single_observation_space.shape
        values = _finite(state, "--state")
        if len(values) != int(np.prod(shape)):
            raise UserError(f"--state has {len(values)} values; {final.config.env} observations have "
                            f"{int(np.prod(shape))} (shape {tuple(shape)})")
        obs = torch.from_numpy(np.array(values).reshape(shape).astype(final.env.single_observation_space.dtype))
        where = "the given observation"
    policy = final.policy
    if action is None:
        a = preferred_action(policy, obs)
        how = f"the final policy theta({t_final})'s preferred action"
    else:
        values = _finite(action, "--action")
        if policy.continuous:
            a = torch.tensor(values, dtype=torch.float32)
            if a.shape != policy.log_std.shape:
                raise UserError(f"--action needs {policy.log_std.numel()} values, got {len(values)}")
        else:
            n = policy.action_head.out_features
            if len(values) != 1 or not float(values[0]).is_integer() or not 0 <= values[0] < n:
                raise UserError(f"--action must be one integer in [0, {n}), got {' '.join(map(str, action))}")
            a = torch.tensor(int(values[0]))
        how = "given"
    a_text = ", ".join(f"{v:.3g}" for v in a.reshape(-1).tolist()) if policy.continuous else str(int(a))
    values = obs.reshape(-1).tolist()
    obs_text = ", ".join(f"{v:.3g}" for v in values[:12]) + (f", ... ({len(values)} values)" if len(values) > 12 else "")
    return StateAction(obs, a, f"s* = {where} [{obs_text}], a* = {a_text} ({how})")


# -- the timeline --------------------------------------------------------------------------
@dataclass
class Timeline:
    env: str
    target: StateAction
    rounds: pd.DataFrame
    """per round k: pi (at theta(k)), scale (max |I|), n_positive, roughness, top_same_action,
    top_distance_ratio"""
    top: pd.DataFrame
    """the top records of every round (attribution_table rows + ``top_rank``)"""
    final_round: int
    final_pi: float
    neighbours: int
    phases: dict[str, int | None] = field(default_factory=dict)
    galleries: list[Gallery] = field(default_factory=list)
    """the top records of up to GALLERY_ROUNDS rounds with their frames (empty without --save-frames)"""


def estimate_phases(rounds: np.ndarray, scale: np.ndarray, rough: np.ndarray,
                    saturation: float = 0.1, drop: float = 0.5) -> dict[str, int | None]:
    """Phase boundaries from the data (None where a rule does not fire):

    - ``saturation``: the first round from which max |I| stays at or below ``saturation`` times
      its peak over all rounds (scores near zero);
    - ``clustering``: before saturation, the first round after the peak of the roughness
      (smoothed by a centred running median of 3 rounds, so one noisy round neither makes nor
      ends a phase) at which the smoothed roughness is at or below ``drop`` times that peak.
    """
    rounds, scale, rough = (np.asarray(a, dtype=np.float64) for a in (rounds, scale, rough))
    out: dict[str, int | None] = {"clustering": None, "saturation": None}
    if len(rounds) == 0 or not np.isfinite(scale).any():
        return out
    low = np.nan_to_num(scale, nan=0.0) <= saturation * np.nanmax(scale)
    stays_low = np.flip(np.logical_and.accumulate(np.flip(low)))
    end = len(rounds)
    if stays_low.any() and stays_low.argmax() > 0:
        end = int(stays_low.argmax())
        out["saturation"] = int(rounds[end])
    pre = running_median(rough)[:end]
    if np.isfinite(pre).any():
        peak = int(np.nanargmax(pre))
        after = np.flatnonzero(np.nan_to_num(pre[peak + 1:], nan=np.inf) <= drop * pre[peak])
        if len(after):
            out["clustering"] = int(rounds[peak + 1 + after[0]])
    return out


def running_median(x: np.ndarray, width: int = 3) -> np.ndarray:
    """Centred running median ignoring NaN (windows are cut at the ends): pandas ``rolling``."""
    return pd.Series(x, dtype=np.float64).rolling(width, center=True, min_periods=1).median().to_numpy()


def timeline(run_dir: str | Path, target: StateAction, rounds: list[int] | None = None, neighbours: int = 50,
             top: int = 10, advantage_norm: str = DEFAULT_ADVANTAGE_NORM) -> Timeline:
    """Score every saved round (or ``rounds``) with ``ActionTarget(s*, a*)``."""
    from rlinfluence.checkpoint import load_round

    if neighbours < 1:
        raise UserError(f"--neighbours must be >= 1, got {neighbours}")
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    available = saved_rounds(run)
    if rounds is None:
        rounds = available
    missing = sorted(set(rounds) - set(available))
    if missing:
        raise UserError(f"rounds {missing} are not saved in {str(run_dir)!r} (saved: "
                        f"{_ranges(available) or 'none; train with --save-buffers'})")
    final, t_final = load_final(run_dir)
    s_embed = embed(final.policy, target.obs[None])[0]
    per_round, tops, galleries = [], [], []
    gallery_rounds = evenly_spaced(rounds, GALLERY_ROUNDS)
    for k in rounds:
        saved = load_round(run_dir, k)
        cfg, buffer, policy = saved.trainer.config, saved.buffer, saved.trainer.policy
        scores = score_buffer(policy, buffer, target=ActionTarget(target.obs, target.action),
                              advantage_norm=advantage_norm, chunk_size=cfg.batch_size, ent_coef=cfg.ent_coef)
        values = scores.double().numpy()
        emb = embed(final.policy, buffer.flat("obs"))
        best = top_records(scores, top).proponents.numpy()
        records = attribution_table(buffer, scores)
        table = records.iloc[best].copy()
        table.insert(0, "top_rank", np.arange(1, len(best) + 1))
        tops.append(table)
        frames = load_frames(run_dir, k, len(buffer)) if k in gallery_rounds else None
        if frames is not None:
            shown = best[:FRAME_RECORDS]
            galleries.append(Gallery(f"Round {k}: the top {len(shown)} records for a*",
                                     record_cards(records, shown, frames)))
        actions = buffer.flat("actions")
        distance = np.linalg.norm(emb - s_embed, axis=1)
        per_round.append({
            "round": k,
            "pi": action_probability(policy, target.obs, target.action),
            "scale": float(np.abs(values).max()),
            "n_positive": int((values > 0).sum()),
            "roughness": roughness(values, emb, neighbours),
            "top_same_action": (float((actions[best] == target.action).float().mean())
                                if not policy.continuous else math.nan),
            "top_distance_ratio": float(distance[best].mean() / max(np.median(distance), 1e-12)),
        })
    frame = pd.DataFrame(per_round)
    phases = estimate_phases(frame["round"].to_numpy(), frame["scale"].to_numpy(), frame["roughness"].to_numpy())
    return Timeline(final.config.env, target, frame, pd.concat(tops, ignore_index=True), t_final,
                    action_probability(final.policy, target.obs, target.action), neighbours, phases,
                    galleries)


def _ranges(values: list[int]) -> str:
    return f"{values[0]}..{values[-1]}" if values else ""


# -- figure and section --------------------------------------------------------------------
def timeline_png(t: Timeline) -> bytes:
    """Three stacked panels over rounds: pi(a*|s*), roughness (both with the estimated phases)
    and what the top records are."""
    f = t.rounds
    k = f["round"].to_numpy()
    fig, axes = new_figure(10, 7.5, nrows=3, sharex=True)
    pi_ax, rough_ax, top_ax = axes[:, 0]
    pi_ax.plot(np.append(k, t.final_round), np.append(f["pi"].to_numpy(), t.final_pi), "o-", ms=3,
               color="tab:blue", label="pi(a*|s*) at theta(k), the start of round k (last: the final policy)")
    pi_ax.set(ylabel="pi(a*|s*)")
    rough_ax.plot(k, f["roughness"], "s-", ms=3, color="tab:red", label="roughness of the positive scores")
    rough_ax.set(ylabel="roughness")
    if np.isfinite(f["top_same_action"]).any():
        top_ax.plot(k, f["top_same_action"], "o-", ms=3, label="top records with a = a* (fraction)")
    top_ax.plot(k, f["top_distance_ratio"], "s-", ms=3, label="top records' distance to s* / median distance")
    top_ax.plot(k, f["scale"] / f["scale"].max(), "^-", ms=3, label="max |I| / its peak")
    top_ax.set(ylim=(0, None))
    edges = [k[0], t.phases.get("clustering"), t.phases.get("saturation"), k[-1] + 1]
    names = ["1: association", "2: clustering", "3: saturation"]
    colours = ["#fde0dd", "#e0ecf4", "#e5f5e0"]
    # a phase is drawn only when at least one of its boundaries was found in the data
    found = [i for i in range(3) if i == 0 or edges[i] is not None]
    bounds = [e for e in edges if e is not None]
    for ax in (pi_ax, rough_ax):
        if len(found) > 1:
            for lo, hi, i in zip(bounds[:-1], bounds[1:], found, strict=True):
                ax.axvspan(lo - 0.5, hi - 0.5, color=colours[i], alpha=0.6, zorder=0)
                ax.text((lo + hi - 1) / 2, 0.03, names[i], transform=ax.get_xaxis_transform(), ha="center",
                        fontsize=8)
    for ax in axes[:, 0]:
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
        round_axis(ax, ROUND_LABEL if ax is top_ax else None)
    fig.suptitle(f"{t.env}: formation of a*")
    return figure_png(fig)


def timeline_section(t: Timeline, top_rows: int = 5) -> Section:
    section = Section("timeline", f"Behaviour formation timeline ({t.env})")
    section.paragraphs += [
        t.target.description,
        f"Every saved round's buffer scored with the action target log pi(a*|s*) at theta(k). Roughness: "
        f"normalised Dirichlet energy of the positive scores on the symmetrised {t.neighbours}-nearest-neighbour "
        "graph of the final policy's last actor hidden layer (sigma = median pairwise distance).",
        "Phase boundaries are estimated from the data: saturation = first round from which max |I| stays "
        "<= 10% of its peak; clustering = first round after the peak of the roughness (running median of 3 "
        "rounds, before saturation) at which it is <= 50% of that peak. A boundary the data does not show "
        "is not drawn.",
    ]
    section.summary = {"final round T": t.final_round, "pi(a*|s*) at theta(T)": t.final_pi,
                       "clustering starts (estimated)": t.phases.get("clustering"),
                       "saturation starts (estimated)": t.phases.get("saturation")}
    f = t.rounds
    section.tables.append(Table("Per round", list(f.columns), [list(r) for r in f.itertuples(index=False)]))
    top = t.top[t.top["top_rank"] <= top_rows]
    columns = ["round", "top_rank", "step", "obs_summary", "action", "advantage", "score"]
    section.tables.append(Table(f"Top {top_rows} records per round", columns,
                                [[v.item() if isinstance(v, np.generic) else v for v in row]
                                 for row in top[columns].itertuples(index=False)]))
    section.figures["timeline"] = (timeline_png(t), "pi(a*|s*) at theta(k) (last point: the final policy), "
                                   "roughness, both with the estimated phases, and what the top records are.")
    section.galleries = list(t.galleries)
    if not t.galleries:
        section.paragraphs.append(f"No frames of the records: {HOW_TO_SAVE}.")
    return section
