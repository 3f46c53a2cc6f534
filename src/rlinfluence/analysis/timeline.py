"""Behaviour-formation timeline (method-spec 8.2): how a fixed (s*, a*) is learned, round by round.

For every saved round k the buffer is scored with ``ActionTarget(s*, a*)`` at theta(k) and we
track pi_theta(k)(a*|s*), the top records and the **roughness** of the scores:

- nodes: the round's records with positive score, valued I_tilde_i = I_i / max_j |I_j| (max over
  all records of the round);
- embeddings e_i: the final policy's last actor hidden layer (``actor(encoder(obs))``);
- edges: each node's u nearest neighbours, symmetrised by union (i~j if either is among the
  other's u nearest), weight w_ij = exp(-||e_i - e_j||^2 / sigma^2), sigma = the median
  pairwise distance between the nodes (the median of the non-zero distances if that is 0,
  e.g. many records of one discrete state);
- roughness = sum_{i<j} w_ij (I_tilde_i - I_tilde_j)^2 / sum_{i<j} w_ij (normalised Dirichlet
  energy): 0 for constant scores, high when neighbouring records disagree.

The paper describes three phases (action-advantage association, semantic clustering, influence
saturation); ``estimate_phases`` places their boundaries from the data by two stated rules and
draws none where a rule does not fire.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rlinfluence.analysis.report import Section, Table, figure_png, new_figure, saved_rounds
from rlinfluence.analysis.tables import attribution_table
from rlinfluence.errors import UserError
from rlinfluence.influence import ActionTarget, score_buffer, top_records
from rlinfluence.rundir import RunDirectory, load_checkpoint


# -- roughness -----------------------------------------------------------------------------
def knn_weights(embeddings: np.ndarray, u: int) -> tuple[np.ndarray, float]:
    """Dense symmetric weights of the symmetrised u-nearest-neighbour graph, and sigma.

    ``embeddings [n, d]``; ties in distance are broken by index. The diagonal is zero.
    """
    e = np.asarray(embeddings, dtype=np.float64).reshape(len(embeddings), -1)
    n = len(e)
    if n < 2:
        return np.zeros((n, n)), math.nan
    if u < 1:
        raise ValueError(f"u must be >= 1, got {u}")
    sq = (e * e).sum(1)
    dist = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * e @ e.T, 0.0))
    np.fill_diagonal(dist, 0.0)
    pairs = dist[np.triu_indices(n, 1)]
    sigma = float(np.median(pairs))
    if sigma == 0:
        positive = pairs[pairs > 0]
        sigma = float(np.median(positive)) if len(positive) else 1.0
    k = min(u, n - 1)
    masked = dist + np.diag(np.full(n, np.inf))  # never one's own neighbour
    neighbours = np.argsort(masked, axis=1, kind="stable")[:, :k]
    adjacent = np.zeros((n, n), dtype=bool)
    adjacent[np.repeat(np.arange(n), k), neighbours.ravel()] = True
    adjacent |= adjacent.T
    return np.where(adjacent, np.exp(-(dist / sigma) ** 2), 0.0), sigma


def dirichlet_roughness(values: np.ndarray, weights: np.ndarray) -> float:
    """sum_{i<j} w_ij (x_i - x_j)^2 / sum_{i<j} w_ij for a symmetric weight matrix (NaN if no edge)."""
    x = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    iu = np.triu_indices(len(x), 1)
    total = w[iu].sum()
    if total <= 0:
        return math.nan
    return float((w[iu] * (x[iu[0]] - x[iu[1]]) ** 2).sum() / total)


def roughness(scores: np.ndarray, embeddings: np.ndarray, u: int = 50) -> float:
    """Spec 8.2's roughness of one round's scores (NaN with fewer than 2 positive records)."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = scores > 0
    if positive.sum() < 2:
        return math.nan
    weights, _ = knn_weights(np.asarray(embeddings)[positive], u)
    return dirichlet_roughness(scores[positive] / np.abs(scores).max(), weights)


# -- the policy and (s*, a*) ---------------------------------------------------------------
def load_final(run_dir: str | Path):
    """The run's trainer restored to its last checkpoint theta(T), and T."""
    from rlinfluence.ppo import PPO, PPOConfig

    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    config = dataclasses.replace(PPOConfig.from_dict(run.read_config()), progress=False)
    path = run.latest_checkpoint()
    trainer = PPO(config, run_dir=False)
    trainer.load_state_dict(load_checkpoint(path), source=repr(str(path)))
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


def _parse_floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise UserError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise UserError(f"{what} must be finite numbers, got {text!r}")
    return values


@dataclass
class StateAction:
    obs: torch.Tensor
    action: torch.Tensor
    description: str


def select_state_action(run_dir: str | Path, *, state_round: int | None = None, state_index: int | None = None,
                        state: str | None = None, action: str | None = None) -> StateAction:
    """(s*, a*): s* = record ``state_index`` of round ``state_round``'s buffer (default: the last
    saved round) or the explicit observation ``state`` ("v1,v2,..."); a* = ``action`` or the
    final policy's preferred action at s*."""
    from rlinfluence.ppo import load_round

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
        values = _parse_floats(state, "--state")
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
        values = _parse_floats(action, "--action")
        if policy.continuous:
            a = torch.tensor(values, dtype=torch.float32)
            if a.shape != policy.log_std.shape:
                raise UserError(f"--action needs {policy.log_std.numel()} values, got {len(values)}")
        else:
            n = policy.action_head.out_features
            if len(values) != 1 or not float(values[0]).is_integer() or not 0 <= values[0] < n:
                raise UserError(f"--action must be one integer in [0, {n}), got {action!r}")
            a = torch.tensor(int(values[0]))
        how = "given"
    a_text = ", ".join(f"{v:.3g}" for v in a.reshape(-1).tolist()) if policy.continuous else str(int(a))
    obs_text = ", ".join(f"{v:.3g}" for v in obs.reshape(-1).tolist()[:12])
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
    """Centred running median ignoring NaN (windows are cut at the ends)."""
    x = np.asarray(x, dtype=np.float64)
    half = width // 2
    out = np.full(len(x), np.nan)
    for i in range(len(x)):
        window = x[max(0, i - half): i + half + 1]
        if np.isfinite(window).any():
            out[i] = np.nanmedian(window)
    return out


def timeline(run_dir: str | Path, target: StateAction, rounds: list[int] | None = None, neighbours: int = 50,
             top: int = 10, advantage_norm: str = "batch") -> Timeline:
    """Score every saved round (or ``rounds``) with ``ActionTarget(s*, a*)``."""
    from rlinfluence.ppo import load_round

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
    per_round, tops = [], []
    for k in rounds:
        saved = load_round(run_dir, k)
        cfg, buffer, policy = saved.trainer.config, saved.buffer, saved.trainer.policy
        scores = score_buffer(policy, buffer, target=ActionTarget(target.obs, target.action),
                              advantage_norm=advantage_norm, chunk_size=cfg.batch_size, ent_coef=cfg.ent_coef)
        values = scores.double().numpy()
        emb = embed(final.policy, buffer.flat("obs"))
        best = top_records(scores, top).proponents.numpy()
        table = attribution_table(buffer, scores).iloc[best].copy()
        table.insert(0, "top_rank", np.arange(1, len(best) + 1))
        tops.append(table)
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
                    action_probability(final.policy, target.obs, target.action), neighbours, phases)


def _ranges(values: list[int]) -> str:
    return f"{values[0]}..{values[-1]}" if values else ""


# -- figure and section --------------------------------------------------------------------
def timeline_png(t: Timeline) -> bytes:
    f = t.rounds
    k = f["round"].to_numpy()
    fig, axes = new_figure(10, 6.4, nrows=2)
    ax = axes[0, 0]
    ax.plot(np.append(k, t.final_round), np.append(f["pi"].to_numpy(), t.final_pi), "o-", ms=3,
            color="tab:blue", label="pi(a*|s*) at theta(k)")
    ax.set(ylabel="pi(a*|s*)", title=f"{t.env}: formation of a*")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(k, f["roughness"], "s-", ms=3, color="tab:red", label="roughness")
    right.set_ylabel("roughness", color="tab:red")
    edges = [k[0], t.phases.get("clustering"), t.phases.get("saturation"), k[-1] + 1]
    names = ["1: association", "2: clustering", "3: saturation"]
    colours = ["#fde0dd", "#e0ecf4", "#e5f5e0"]
    # a phase is drawn only when at least one of its boundaries was found in the data
    if any(e is not None for e in edges[1:3]):
        bounds = [e for e in edges if e is not None]
        labels = [names[i] for i in range(3) if (i == 0 or edges[i] is not None)]
        fills = [colours[i] for i in range(3) if (i == 0 or edges[i] is not None)]
        for lo, hi, name, colour in zip(bounds[:-1], bounds[1:], labels, fills, strict=False):
            ax.axvspan(lo - 0.5, hi - 0.5, color=colour, alpha=0.6, zorder=0)
            ax.text((lo + hi - 1) / 2, 0.03, name, transform=ax.get_xaxis_transform(), ha="center", fontsize=8)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="center right")
    ax = axes[1, 0]
    if np.isfinite(f["top_same_action"]).any():
        ax.plot(k, f["top_same_action"], "o-", ms=3, label="top records with a = a* (fraction)")
    ax.plot(k, f["top_distance_ratio"], "s-", ms=3, label="top records' distance to s* / median distance")
    ax.plot(k, f["scale"] / f["scale"].max(), "^-", ms=3, label="max |I| / its peak")
    ax.set(xlabel="round k", ylim=(0, None))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
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
    section.figures["timeline"] = (timeline_png(t), "Top: pi(a*|s*) at theta(k) (last point: final policy) and "
                                   "roughness, with estimated phases. Bottom: what the top records are.")
    return section
