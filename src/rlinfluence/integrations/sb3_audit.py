"""Stable-Baselines3's vec envs audited and quarantined: which env (worker) is broken, and training
without it.

- ``AuditCallback(path)``: after GAE, writes each rollout's harm table (one row per record, its
  source = the vec env index; ``rlinfluence.analysis.audit``) to ``path/audit/scores/``, so that
  ``rlinfluence audit path`` tests which envs push the updates the wrong way.
- ``QuarantineCallback()``: ``--filter quarantine`` for SB3's PPO: before every ``train()``, drops
  every record of the envs the sources test flags (needs ``FilteredRolloutBuffer``).

stable-baselines3 is optional; this module needs it (``pip install "rlinfluence[sb3]"``).
"""

from __future__ import annotations

import math
import numbers
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from rlinfluence.filters import FilterContext, QuarantineFilter
from rlinfluence.influence import ZeroTargetGradient, gradient_alignment
from rlinfluence.integrations.sb3 import (
    BaseCallback,
    FilteredRolloutBuffer,
    RolloutBuffer,
    SB3PolicyAdapter,
    TimeLimitEnds,
    as_rollout_buffer,
    attribute,
    flat_field,
    global_rng_untouched,
    records_of,
)
from rlinfluence.rundir import AUDIT_SCORES, atomic_write
from rlinfluence.sources import MIN_SOURCES

__all__ = ["AUDIT_SCORERS", "AuditCallback", "QuarantineCallback"]


class QuarantineCallback(BaseCallback):
    """``--filter quarantine`` for SB3's PPO: before every ``train()``, drop every record of the vec
    envs that the sources test flags over the last ``window`` rollouts (``rlinfluence.filters.
    QuarantineFilter``: the consistency checks and the reward, value and advantage statistics,
    the audit's tests at ``alpha`` across envs x families; the last ``trusted_envs`` envs are never
    tested), on SB3's stored observations; ``guarantee`` "run": each at alpha / the rollouts ``learn()``
    will collect, so that a clean run has at most alpha chance of any false quarantine. Needs
    ``PPO(..., rollout_buffer_class=FilteredRolloutBuffer)``.
    Logs ``quarantine/quarantined`` per rollout; ``history`` keeps each rollout's quarantined envs."""

    def __init__(self, window: int = 6, alpha: float = 0.01, trusted_envs: int = 0, verbose: int = 0,
                 guarantee: str = "round"):
        super().__init__(verbose)
        if window < 1 or not 0 < alpha < 1 or trusted_envs < 0 or guarantee not in ("round", "run"):
            raise ValueError(f"window must be >= 1, alpha in (0, 1), trusted_envs >= 0, guarantee round or run; got "
                             f"{window}, {alpha}, {trusted_envs}, {guarantee!r}")
        self.filter = QuarantineFilter(window, alpha, False, trusted_envs)
        self.alpha, self.guarantee = alpha, guarantee
        self.history: list[list[int]] = []
        self._episodes: np.ndarray | None = None
        self._time_limits = TimeLimitEnds()

    def _init_callback(self) -> None:
        if not isinstance(self.model.rollout_buffer, FilteredRolloutBuffer):
            raise TypeError("QuarantineCallback needs the model built with rollout_buffer_class=FilteredRolloutBuffer "
                            f"(from rlinfluence.integrations.sb3), got {type(self.model.rollout_buffer).__name__}")
        if self.model.n_envs - self.filter.trusted_envs < MIN_SOURCES:
            raise ValueError(f"QuarantineCallback compares each env with 2 or more others: it needs at least "
                             f"{MIN_SOURCES} untrusted envs, got {self.model.n_envs} - {self.filter.trusted_envs}")
        if self.guarantee == "run":  # each rollout's test at alpha / the rollouts learn() will collect
            rollouts = math.ceil(self.model._total_timesteps / (self.model.n_steps * self.model.n_envs))
            self.filter.set_alpha(self.alpha / max(rollouts, 1))

    def _on_step(self) -> bool:
        self._time_limits.record(self.locals)
        return True

    def _on_rollout_end(self) -> None:
        model, buffer = self.model, self.model.rollout_buffer
        if self._episodes is None:
            self._episodes = np.zeros(buffer.n_envs, dtype=np.int64)
        ours = as_rollout_buffer(model, buffer, len(self.history), self._episodes,
                                 self._time_limits.take(buffer.buffer_size))
        self._episodes = ours.episode_ids[-1].numpy() + 1
        context = FilterContext(SB3PolicyAdapter(model.policy), len(self.history), model.batch_size, model.gamma)
        with global_rng_untouched(model.policy.device):
            keep = self.filter(ours, context)
        buffer.set_keep_mask(keep.numpy())
        quarantined = [int(s) for s in str(context.stats["quarantined_sources"]).split()]
        self.history.append(quarantined)
        self.logger.record("quarantine/quarantined", float(len(quarantined)))
        if self.verbose >= 1:
            print(f"quarantine: envs {quarantined or 'none'}")


# -- audits ---------------------------------------------------------------------------------------
AUDIT_SCORERS = ("influence", "dtv", "negative-advantage", "abs-advantage", "reward-extremes", "random")
"""The scorers of ``rlinfluence.analysis.audit`` an SB3 rollout can be scored with (tracin needs the
replayed optimiser steps, td-error the next values SB3 does not keep, influence-trusted trusted envs)."""
DEFAULT_AUDIT_SCORERS = ("negative-advantage", "abs-advantage", "reward-extremes", "random")
"""What ``AuditCallback`` scores unless told: the verdict (version 4 on) tests the gradient families
(influence, dtv) only where asked (``audit --gradient-families``), so they are scored only where asked."""


class AuditCallback(BaseCallback):
    """Writes the harm table ``rlinfluence audit`` reads, once per rollout (after GAE, before
    ``train()``, the policy still the one that collected it): one row per record in SB3's flat
    order with ``round`` (the rollout), ``source`` (the vec env index), ``episode`` (counted per
    env from SB3's ``episode_starts``), ``step``, ``trusted`` (False), ``corrupted`` (only with
    ``corrupted_envs``: the envs a benchmark knows are broken) and one harm column per scorer
    (higher = more harmful, as in ``rlinfluence.analysis.audit``): influence = minus
    ``attribute(model, buffer, advantage_norm="batch")``; dtv = minus the gradient alignment
    g_i . mean_j g_j; negative-advantage, abs-advantage and reward-extremes from the buffer;
    random seeded by the rollout. The files go to ``path/audit/scores/round_K.parquet``.
    NumPy's and torch's global random states are left untouched, so training is unchanged.
    """

    def __init__(self, path: str | Path, scorers: Sequence[str] = DEFAULT_AUDIT_SCORERS, corrupted_envs: Sequence[int] = (),
                 verbose: int = 0):
        super().__init__(verbose)
        unknown = [s for s in scorers if s not in AUDIT_SCORERS]
        if unknown or not scorers:
            raise ValueError(f"unknown scorer {unknown[0] if unknown else None!r} for SB3 rollouts "
                             f"(choose from {', '.join(AUDIT_SCORERS)})")
        if not isinstance(path, str | os.PathLike):
            raise ValueError(f"path must be the run folder (a str or Path), got {path!r}")
        self.folder = Path(path) / AUDIT_SCORES
        not_index = [e for e in corrupted_envs if isinstance(e, bool) or not isinstance(e, numbers.Integral)]
        if not_index:
            raise ValueError(f"corrupted_envs holds {not_index[0]!r}: vec env indices are integers")
        self.scorers, self.corrupted_envs = tuple(scorers), tuple(int(e) for e in corrupted_envs)
        self.rounds = 0
        self._episodes: np.ndarray | None = None  # per env: episodes started so far
        self._time_limits = TimeLimitEnds()

    def _init_callback(self) -> None:
        n_envs = self.model.n_envs
        bad = [e for e in self.corrupted_envs if not 0 <= e < n_envs]
        if bad:
            raise ValueError(f"corrupted_envs holds {bad[0]}, not a vec env index of this model (0..{n_envs - 1})")
        for folder in (self.folder.parent, self.folder):  # audit/ and audit/scores/
            if folder.is_symlink():
                raise ValueError(f"{str(folder)!r} is a link (-> {os.readlink(folder)!r}): the score tables go into "
                                 "real folders only")
        # rounds this callback did not write (another training into the same folder) would be audited with its own
        others = sorted(f.name for f in self.folder.glob("round_*.parquet")
                        if not f.stem.removeprefix("round_").isdigit() or int(f.stem.removeprefix("round_")) >= self.rounds)
        if others:
            raise ValueError(f"{str(self.folder)!r} already holds {others[0]} from another training: an audit would mix "
                             "the two; give this training its own path")
        self.folder.mkdir(parents=True, exist_ok=True)

    def _on_step(self) -> bool:
        self._time_limits.record(self.locals)
        return True

    def _harm(self, name: str, buffer: RolloutBuffer, adapter: SB3PolicyAdapter, obs: torch.Tensor,
              actions: torch.Tensor, advantages: torch.Tensor, env_rewards: np.ndarray) -> np.ndarray:
        try:
            if name == "influence":
                return -attribute(self.model, buffer, advantage_norm="batch").double().numpy()
            if name == "dtv":
                return -gradient_alignment(adapter, obs, actions, advantages).detach().cpu().double().numpy()
        except ZeroTargetGradient:
            return np.zeros(len(advantages))
        a = advantages.cpu().double().numpy()
        if name == "negative-advantage":
            return -a
        if name == "abs-advantage":
            return np.abs(a)
        if name == "reward-extremes":  # the env's rewards, without SB3's time-limit bootstrap
            return np.abs(env_rewards - env_rewards.mean())
        checksum = zlib.crc32(flat_field(buffer, "actions").tobytes())
        return np.random.default_rng([self.rounds, checksum]).random(len(a))

    def _on_rollout_end(self) -> None:
        import pandas as pd

        buffer = self.model.rollout_buffer
        adapter = SB3PolicyAdapter(self.model.policy)
        n_steps, n_envs = buffer.buffer_size, buffer.n_envs
        starts = np.asarray(buffer.episode_starts, dtype=np.int64)  # [n_steps, n_envs]
        if self._episodes is None:
            self._episodes = np.zeros(n_envs, dtype=np.int64)
            starts[0] = 0  # the first step of training starts episode 0 of every env
        episode = self._episodes[None] + np.cumsum(starts, axis=0)  # [n_steps, n_envs]
        self._episodes = episode[-1]
        table = pd.DataFrame({"round": self.rounds, "source": np.repeat(np.arange(n_envs), n_steps),
                              "episode": episode.T.reshape(-1), "step": np.tile(np.arange(n_steps), n_envs),
                              "trusted": False})
        if self.corrupted_envs:
            table["corrupted"] = table["source"].isin(self.corrupted_envs)
        obs, actions, advantages = records_of(buffer, adapter)
        env_rewards = self._time_limits.take(n_steps)[0].T.reshape(-1)  # flat env-major, as the table
        with global_rng_untouched(adapter.policy.device):
            for name in self.scorers:
                table[name] = self._harm(name, buffer, adapter, obs, actions, advantages, env_rewards)
        atomic_write(self.folder / f"round_{self.rounds:06d}.parquet", lambda p: table.to_parquet(p, index=False))
        self.rounds += 1
