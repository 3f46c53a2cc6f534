"""The quarantine filter: drops every record of the sources (training envs) the audit's test flags."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
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
    calibration_test,
    cell_means,
    episode_starts,
    normal_scores,
    pair_floors,
    verdict_p_values,
)


def _units(scores: np.ndarray, families: Sequence[str]) -> np.ndarray:
    """[N, families] each column as normal scores within the round (``rlinfluence.sources.normal_scores``;
    the ``RAW_SCALE`` checks as they are): computed once when a round is recorded, as they never change."""
    raw = np.array([family in RAW_SCALE for family in families])
    return np.where(raw, scores, normal_scores(np.zeros(len(scores)), scores))


@dataclass
class _RoundSums:
    """One recorded round's units, summed once: the tests see a round's records only through these
    sums and counts ([..., families], NaN units left out), so a round costs its own records once
    and the window only the adding up. ``by_start``: per start round k, [sources, families] over
    the records whose episode started in k; ``collected``: the same over the round; per (source,
    episode) pair of the round, ``pair_sums``/``pair_counts`` [pairs, families]."""

    by_start: dict[int, tuple[np.ndarray, np.ndarray]]
    collected: tuple[np.ndarray, np.ndarray]
    pair_source: np.ndarray
    pair_episode: np.ndarray
    pair_sums: np.ndarray
    pair_counts: np.ndarray


def _round_sums(record: dict[str, torch.Tensor], n_sources: int) -> _RoundSums:
    source, episode, start, units = (record[k].numpy() for k in ("source", "episode", "start", "units"))
    n_families = units.shape[1]
    scored = ~np.isnan(units)
    values, weights = np.where(scored, units, 0.0).ravel(), scored.ravel().astype(float)

    def summed(code: np.ndarray, n_codes: int) -> tuple[np.ndarray, np.ndarray]:  # per code: [n_codes, families]
        cell = (code[:, None] * n_families + np.arange(n_families)).ravel()
        return (np.bincount(cell, values, minlength=n_codes * n_families).reshape(n_codes, n_families),
                np.bincount(cell, weights, minlength=n_codes * n_families).reshape(n_codes, n_families))

    starts, start_code = np.unique(start, return_inverse=True)
    sums, counts = summed(start_code.ravel() * n_sources + source, len(starts) * n_sources)
    by_start = {int(k): (sums[i * n_sources:(i + 1) * n_sources], counts[i * n_sources:(i + 1) * n_sources])
                for i, k in enumerate(starts)}
    key = source * (int(episode.max()) + 1) + episode
    pairs, first, pair_code = np.unique(key, return_index=True, return_inverse=True)
    pair_sums, pair_counts = summed(pair_code.ravel(), len(pairs))
    return _RoundSums(by_start, summed(source, n_sources), source[first], episode[first], pair_sums, pair_counts)


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
        self.sums: dict[int, _RoundSums] = {}  # each recorded round's, derived from ``records`` when first needed

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
        self.sums = {k: self.sums.get(k) or _round_sums(r, n_sources) for k, r in self.records.items()}
        tests = self._window_tests(oldest, n_sources)
        _, adjusted = verdict_p_values(two_sided=TWO_SIDED, permutations=self.permutations, flags_at=self.alpha, **tests)
        quarantined = np.flatnonzero((adjusted < self.alpha).any(axis=1)).tolist()  # the verdict's flags
        context.stats["quarantined"] = float(len(quarantined))
        context.stats["quarantined_sources"] = " ".join(map(str, quarantined))
        keep = ~torch.isin(ids[:, 1], torch.tensor(quarantined, dtype=torch.int64))
        return guard_minibatch(keep, keep.float(), context)

    def _window_tests(self, oldest: int, n_sources: int) -> dict[str, Any]:
        """The inputs of ``verdict_p_values`` over the window, from its rounds' sums: the exact test's
        means per episode start round, and once every source has ``MIN_EPISODES`` episodes the
        outlier test's means per collected round and episode floors; the calibration test's p-values."""
        kept = [self.sums[k] for k in sorted(self.sums)]
        # the exact test's units: the means per episode start round in the window, per source
        start_rounds = sorted({k for r in kept for k in r.by_start if k >= oldest})
        window = [[r.by_start[k] for r in kept if k in r.by_start] for k in start_rounds]
        means = self._family_means([sum(s for s, _ in parts) for parts in window],
                                   [sum(c for _, c in parts) for parts in window])
        # each (source, episode) pair of the window, its parts in several rounds added up
        pair_source = np.concatenate([r.pair_source for r in kept])
        pair_episode = np.concatenate([r.pair_episode for r in kept])
        pairs, first, pair_code = np.unique(pair_source * (int(pair_episode.max()) + 1) + pair_episode,
                                            return_index=True, return_inverse=True)
        pair_sums, pair_counts = np.zeros((len(pairs), len(self.families))), np.zeros((len(pairs), len(self.families)))
        np.add.at(pair_sums, pair_code.ravel(), np.concatenate([r.pair_sums for r in kept]))
        np.add.at(pair_counts, pair_code.ravel(), np.concatenate([r.pair_counts for r in kept]))
        pair_source = pair_source[first]
        outlier_means, floors = None, {}
        if (np.bincount(pair_source, minlength=n_sources)[:n_sources] >= MIN_EPISODES).all():
            outlier_means = self._family_means([r.collected[0] for r in kept], [r.collected[1] for r in kept])
            scored_pairs: dict[bytes, list[int]] = {}  # families scored on the same pairs (most on all) go together
            for j in range(len(self.families)):
                scored_pairs.setdefault((pair_counts[:, j] > 0).tobytes(), []).append(j)
            for columns in scored_pairs.values():
                present = pair_counts[:, columns[0]] > 0
                pair_means = pair_sums[present][:, columns] / pair_counts[present][:, columns]
                floors |= dict(zip([self.families[j] for j in columns],
                                   pair_floors(pair_means, pair_source[present], range(n_sources)).T, strict=True))
        calibrated = {family: calibration_test(sum(r.collected[0][:, j] for r in kept), sum(r.collected[1][:, j] for r in kept),
                                               CALIBRATED[family])
                      for j, family in enumerate(self.families) if family in CALIBRATED}
        return {"means": means, "outlier_means": outlier_means, "floors": floors, "calibrated": calibrated}

    def _family_means(self, sums: list[np.ndarray], counts: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Per family, h [groups, sources] (``rlinfluence.sources.cell_means``) of each group's
        [sources, families] sums and counts."""
        h = cell_means(np.stack(sums).transpose(2, 0, 1), np.stack(counts).transpose(2, 0, 1))
        return dict(zip(self.families, h, strict=True))

    def state_dict(self) -> dict[str, Any]:
        seen = torch.tensor([[s, e, k] for (s, e), k in self.first_seen.items()], dtype=torch.int64).reshape(-1, 3)
        return {"records": {int(k): dict(r) for k, r in self.records.items()}, "first_seen": seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = {int(k): dict(r) for k, r in state.get("records", {}).items()}
        self.sums = {}
        if any("units" not in r or r["units"].shape[1] != len(self.families) for r in self.records.values()):
            raise UserError("this checkpoint's quarantine window holds the scores of another set of checks (written "
                            "by an older rlinfluence): resume it with the version that wrote it, or train again")
        seen = state.get("first_seen", torch.zeros(0, 3, dtype=torch.int64))
        self.first_seen = {(int(s), int(e)): int(k) for s, e, k in seen.tolist()}
