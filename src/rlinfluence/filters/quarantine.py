"""The quarantine filter: drops every record of the sources (training envs) the audit's test flags."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.consistency import (
    CALIBRATED,
    CHECKS,
    RAW_SCALE,
    STATISTICS,
    TWO_SIDED,
    action_count,
    consistency_scores,
    statistic_scores,
)
from rlinfluence.errors import UserError
from rlinfluence.filters.base import FilterContext, guard_minibatch
from rlinfluence.influence import return_and_alignment_scores
from rlinfluence.sources import (
    EXACT_SHARE,
    MIN_EPISODES,
    calibration_p_values,
    episode_floor,
    episode_starts,
    group_means,
    normal_scores,
    verdict_p_values,
)


def _units(scores: np.ndarray, families: Sequence[str]) -> np.ndarray:
    """[N, families] each column as normal scores within the round (``rlinfluence.sources.normal_scores``;
    the ``RAW_SCALE`` checks as they are): computed once when a round is recorded, as they never change."""
    raw = np.array([family in RAW_SCALE for family in families])
    return np.where(raw, scores, normal_scores(np.zeros(len(scores)), scores))


class QuarantineFilter:
    """Drops every record of the sources (training envs) that the audit's test flags over the last
    ``window`` rounds, until they test clean again: the verdict of ``rlinfluence.sources`` each round
    on the cheap families (the consistency checks and the reward, value and advantage statistics of
    ``rlinfluence.consistency``; with ``attribution``, influence and dtv too): the exact test of
    each source's units (the mean normal score of its records whose episode started in round k;
    the ``RAW_SCALE`` checks as they are), once every source has ``MIN_EPISODES`` episodes in the
    window the outlier test of its means beside it, and the calibration test of its
    ``action-calibration``, adjusted across sources x families at ``alpha``. The last ``trusted_envs`` envs are never
    tested nor quarantined. Logs ``quarantined`` (how many sources) and ``quarantined_sources``
    (their ids, space-separated)."""

    name = "quarantine"
    PERMUTATIONS = 2000
    """maxT's shuffles each round: its p-values resolve to 1/2001, far below alpha / 0.8 at 0.01, at a
    fifth of the 10,000 an audit draws (docs/results/hidden-faults.md: the same auc, less CPU)"""
    CHEAP = (*STATISTICS, *CHECKS)
    ATTRIBUTION = ("influence", "dtv")

    def __init__(self, window: int = 6, alpha: float = 0.01, attribution: bool = False, trusted_envs: int = 0):
        self.window, self.attribution, self.trusted_envs = window, attribution, trusted_envs
        self.set_alpha(alpha)
        self.families = [*self.CHEAP, *(self.ATTRIBUTION if attribution else ())]
        # the records of the last rounds (round -> source, episode, start round, normal scores [N, families])
        # and the round each running episode started in
        self.records: dict[int, dict[str, torch.Tensor]] = {}
        self.first_seen: dict[tuple[int, int], int] = {}

    def set_alpha(self, alpha: float) -> None:
        """Test each round at ``alpha``, with enough of maxT's shuffles to resolve it (at least
        ``PERMUTATIONS``; 2 / (EXACT_SHARE alpha) for a smaller alpha, as a per-run level gives)."""
        self.alpha = alpha
        self.permutations = max(self.PERMUTATIONS, math.ceil(2 / (EXACT_SHARE * alpha)))

    def _scores(self, buffer: RolloutBuffer, context: FilterContext) -> np.ndarray:
        scores = {**statistic_scores(buffer, context.gamma),
                  **consistency_scores(context.policy, buffer, action_count(context.policy))}
        if self.attribution:  # influence (batch advantages) and dtv from one gradient pass
            obs, actions, advantages = (buffer.flat(k) for k in ("obs", "actions", "advantages"))
            gradient = return_and_alignment_scores(context.policy, obs, actions, advantages)
            for family, name in (("influence", "batch"), ("dtv", "alignment")):
                score = gradient[name]
                scores[family] = -score.double().numpy() if score is not None else np.full(len(buffer), np.nan)
        return np.column_stack([scores[f] for f in self.families])

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        n_sources = buffer.n_envs - self.trusted_envs
        ids = buffer.record_ids()
        source, episode = ids[:, 1].numpy(), buffer.flat("episode_ids").numpy()
        running = set(zip(source.tolist(), episode.tolist(), strict=True))
        self.first_seen = {key: k for key, k in self.first_seen.items() if key in running}  # ended episodes
        start = episode_starts(np.full(len(source), buffer.round), source, episode, self.first_seen)
        untrusted = source < n_sources
        self.records[buffer.round] = {"source": torch.from_numpy(source[untrusted]),
                                      "episode": torch.from_numpy(episode[untrusted]),
                                      "start": torch.from_numpy(start[untrusted]),
                                      "units": torch.from_numpy(_units(self._scores(buffer, context)[untrusted], self.families))}
        oldest = buffer.round - self.window + 1
        self.records = {k: r for k, r in self.records.items() if k >= oldest}
        kept = list(self.records.values())
        starts = torch.cat([r["start"] for r in kept]).numpy()
        sources = torch.cat([r["source"] for r in kept]).numpy()
        episodes = torch.cat([r["episode"] for r in kept]).numpy()
        z = torch.cat([r["units"] for r in kept]).numpy()  # the units of every test
        in_window = starts >= oldest
        means = dict(zip(self.families, group_means(starts[in_window], sources[in_window], z[in_window],
                                                    range(n_sources))[1], strict=True))
        outlier_means, floors = None, {}
        pairs = np.unique(sources * (episodes.max() + 1) + episodes)  # each (source, episode) once
        per_source = np.bincount(pairs // (episodes.max() + 1), minlength=n_sources)
        if (per_source[:n_sources] >= MIN_EPISODES).all():
            collected = np.concatenate([np.full(len(r["source"]), k) for k, r in enumerate(kept)])
            outlier_means = dict(zip(self.families, group_means(collected, sources, z, range(n_sources))[1], strict=True))
            floors = dict(zip(self.families, episode_floor(sources, episodes, z, range(n_sources)), strict=True))
        calibrated = {family: calibration_p_values(sources, z[:, j], range(n_sources), CALIBRATED[family])
                      for j, family in enumerate(self.families) if family in CALIBRATED}
        _, adjusted = verdict_p_values(means, TWO_SIDED, outlier_means, floors, self.permutations, calibrated)
        quarantined = np.flatnonzero((adjusted < self.alpha).any(axis=1)).tolist()  # the verdict's flags
        context.stats["quarantined"] = float(len(quarantined))
        context.stats["quarantined_sources"] = " ".join(map(str, quarantined))
        keep = ~torch.isin(ids[:, 1], torch.tensor(quarantined, dtype=torch.int64))
        return guard_minibatch(keep, keep.float(), context)

    def state_dict(self) -> dict[str, Any]:
        seen = torch.tensor([[s, e, k] for (s, e), k in self.first_seen.items()], dtype=torch.int64).reshape(-1, 3)
        return {"records": {int(k): dict(r) for k, r in self.records.items()}, "first_seen": seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = {int(k): dict(r) for k, r in state.get("records", {}).items()}
        if any("units" not in r or r["units"].shape[1] != len(self.families) for r in self.records.values()):
            raise UserError("this checkpoint's quarantine window holds the scores of another set of checks (written "
                            "by an older rlinfluence): resume it with the version that wrote it, or train again")
        seen = state.get("first_seen", torch.zeros(0, 3, dtype=torch.int64))
        self.first_seen = {(int(s), int(e)): int(k) for s, e, k in seen.tolist()}
