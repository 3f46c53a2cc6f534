"""Rollout records of one PPO round, GAE and Monte-Carlo returns.

Records are stored time-major, ``[n_steps, n_envs, ...]``, as they are collected. The flat
order used everywhere else (attribution, filtering, minibatching) is **env-major**, the order
of Stable-Baselines3's ``swap_and_flatten``: flat index ``i = env * n_steps + step``. Every record
has the stable id ``(round, env, step)``; ``record_ids()`` returns them in flat order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    last_values: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> np.ndarray:
    """Generalised advantage estimates, arrays shaped ``[T, E]`` (``last_values``: ``[E]``).

        delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)
        A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}

    ``done_t`` marks the end of an episode at step t (terminated or truncated); V(s_T) is
    ``last_values``. Time-limit truncation is bootstrapped by the caller, as SB3 does, by adding
    gamma * V(final observation) to ``r_t`` (see ``RolloutBuffer.gae_rewards``).
    """
    n_steps = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    last_gae = np.zeros_like(last_values)
    for t in reversed(range(n_steps)):
        next_values = last_values if t == n_steps - 1 else values[t + 1]
        non_terminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * non_terminal - values[t]
        last_gae = delta + gamma * gae_lambda * non_terminal * last_gae
        advantages[t] = last_gae
    return advantages


def discounted_returns(rewards: np.ndarray, dones: np.ndarray, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Monte-Carlo return-to-go ``G_t = sum_k gamma^k r_{t+k}`` within each episode, ``[T, E]``.

    Returns ``(G, complete)``; ``complete[t]`` is False for steps whose episode is still running
    at the end of the buffer (their G is a truncated sum, not a Monte-Carlo return).
    """
    n_steps = rewards.shape[0]
    returns = np.zeros_like(rewards, dtype=np.float64)
    complete = np.zeros(rewards.shape, dtype=bool)
    running = np.zeros(rewards.shape[1:], dtype=np.float64)
    ended = np.zeros(rewards.shape[1:], dtype=bool)
    for t in reversed(range(n_steps)):
        done = dones[t].astype(bool)
        running = np.where(done, 0.0, gamma * running) + rewards[t]
        ended = ended | done
        returns[t] = running
        complete[t] = ended
    return returns, complete


@dataclass(frozen=True)
class MinibatchStep:
    """One optimiser step of a round's update: which records formed its minibatch, at what lr."""

    epoch: int
    indices: torch.Tensor  # [b] flat (env-major) buffer indices
    lr: float


@dataclass
class RolloutBuffer:
    """The records of round ``round``: ``n_steps`` steps of ``n_envs`` environments.

    ``rewards`` are the rewards the learner saw (the environment's, unless a corruption changed
    them: ``corrupted``); ``final_values`` holds V(final observation)
    for steps that ended by time-limit truncation (0 elsewhere). ``advantages`` / ``returns``
    (= advantages + values) are filled by ``compute_advantages``.
    """

    round: int
    obs: torch.Tensor  # [T, E, *obs_shape]
    actions: torch.Tensor  # [T, E] (discrete) or [T, E, act_dim]
    rewards: torch.Tensor  # [T, E]
    terminated: torch.Tensor  # [T, E] bool
    truncated: torch.Tensor  # [T, E] bool
    logp: torch.Tensor  # [T, E] log pi_old(a|s)
    values: torch.Tensor  # [T, E] V_old(s)
    final_values: torch.Tensor  # [T, E]
    episode_ids: torch.Tensor  # [T, E] int64
    corrupted: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    """[T, E] bool: the record was changed by a corruption (``rlinfluence.corruptions``); the
    ground truth of detection. Empty in rounds saved before it existed (read: nothing corrupted)."""
    last_values: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [E] V(s_T)
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [T, E]
    returns: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [T, E]

    @classmethod
    def empty(
        cls,
        round: int,
        n_steps: int,
        n_envs: int,
        obs_shape: tuple[int, ...],
        obs_dtype: torch.dtype,
        action_shape: tuple[int, ...],
        action_dtype: torch.dtype,
    ) -> RolloutBuffer:
        """Pre-allocated storage for one round."""
        te = (n_steps, n_envs)
        return cls(
            round=round,
            obs=torch.zeros(te + tuple(obs_shape), dtype=obs_dtype),
            actions=torch.zeros(te + action_shape, dtype=action_dtype),
            rewards=torch.zeros(te),
            terminated=torch.zeros(te, dtype=torch.bool),
            truncated=torch.zeros(te, dtype=torch.bool),
            logp=torch.zeros(te),
            values=torch.zeros(te),
            final_values=torch.zeros(te),
            episode_ids=torch.zeros(te, dtype=torch.int64),
            corrupted=torch.zeros(te, dtype=torch.bool),
        )

    @property
    def n_steps(self) -> int:
        return self.rewards.shape[0]

    @property
    def n_envs(self) -> int:
        return self.rewards.shape[1]

    def __len__(self) -> int:
        return self.n_steps * self.n_envs

    @property
    def dones(self) -> torch.Tensor:
        """Episode ended at this step (terminated or truncated)."""
        return self.terminated | self.truncated

    def gae_rewards(self, gamma: float) -> torch.Tensor:
        """r_t + gamma * V(final obs) on truncated steps: SB3's time-limit bootstrap."""
        return self.rewards + gamma * self.final_values * self.truncated

    def td_errors(self, gamma: float) -> torch.Tensor:
        """delta_t = r_t + gamma V(s_t+1) (1 - done_t) - V(s_t), ``[T, E]`` (r_t with the time-limit
        bootstrap of ``gae_rewards``; V(s_T) = ``last_values``)."""
        next_values = torch.cat([self.values[1:], self.last_values[None]], dim=0)
        return self.gae_rewards(gamma) + gamma * next_values * (~self.dones) - self.values

    def compute_advantages(self, gamma: float, gae_lambda: float) -> None:
        """Fill ``advantages`` (GAE) and ``returns`` = advantages + values."""
        adv = compute_gae(
            self.gae_rewards(gamma).numpy(),
            self.values.numpy(),
            self.dones.numpy().astype(np.float32),
            self.last_values.numpy(),
            gamma,
            gae_lambda,
        )
        self.advantages = torch.from_numpy(adv)
        self.returns = self.advantages + self.values

    def monte_carlo_returns(self, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(G_t, complete) in ``[T, E]``; see ``discounted_returns``."""
        g, complete = discounted_returns(self.rewards.numpy(), self.dones.numpy(), gamma)
        return torch.from_numpy(g), torch.from_numpy(complete)

    def flat(self, name: str) -> torch.Tensor:
        """Field ``name`` flattened to ``[N, ...]`` in env-major order (i = env * T + step)."""
        return self.flatten(getattr(self, name))

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """A ``[T, E, ...]`` tensor flattened to ``[N, ...]`` in env-major order."""
        return x.transpose(0, 1).reshape(len(self), *x.shape[2:])

    def monte_carlo_advantages(self, gamma: float) -> torch.Tensor:
        """A_bar(s, a) = Q_bar(s, a) - V_bar(s) per record, flat order (docs/method.md, section 8.1).

        Q_bar(s, a) is the mean discounted return-to-go over the occurrences of (s, a) in the
        buffer's *complete* episodes, V_bar(s) the mean over all visits of s in them; no extra
        environment sampling. States are identified by their exact observation, so this is
        meaningful for small discrete state spaces (FrozenLake, MiniGrid). NaN where (s, a) never
        occurs in a complete episode.
        """
        if self.actions.is_floating_point():
            raise ValueError("Monte-Carlo advantages need discrete actions")
        g, complete = self.monte_carlo_returns(gamma)
        g, weight = self.flatten(g).numpy(), self.flatten(complete).numpy().astype(np.float64)
        _, state = np.unique(self.flat("obs").reshape(len(self), -1).numpy(), axis=0, return_inverse=True)
        state = state.reshape(-1)
        action = self.flat("actions").numpy().astype(np.int64)
        pair = state * (int(action.max()) + 1) + action

        def mean_by(key: np.ndarray) -> np.ndarray:
            total = np.bincount(key, weights=g * weight)
            count = np.bincount(key, weights=weight)
            with np.errstate(invalid="ignore", divide="ignore"):
                return np.where(count > 0, total / np.maximum(count, 1e-300), np.nan)[key]

        return torch.from_numpy(mean_by(pair) - mean_by(state))

    def record_ids(self) -> torch.Tensor:
        """``[N, 3]`` int64 ids ``(round, env, step)`` in flat order."""
        env = torch.arange(self.n_envs).repeat_interleave(self.n_steps)
        step = torch.arange(self.n_steps).repeat(self.n_envs)
        return torch.stack([torch.full_like(env, self.round), env, step], dim=1)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> RolloutBuffer:
        """Rebuild a buffer from ``tensors()`` output (e.g. a saved round's safetensors file)."""
        ids = tensors["record_ids"]
        n_envs, n_steps = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1

        def unflatten(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(n_envs, n_steps, *x.shape[1:]).transpose(0, 1).contiguous()

        names = [f.name for f in fields(cls) if f.name not in ("round", "last_values")]
        return cls(round=int(ids[0, 0]), last_values=tensors["last_values"],
                   **{name: unflatten(tensors[name]) for name in names if name in tensors})

    def tensors(self) -> dict[str, torch.Tensor]:
        """All per-record fields, flat (for saving with safetensors or building tables)."""
        names = [f.name for f in fields(self) if f.name not in ("round", "last_values")]
        out = {name: self.flat(name).contiguous() for name in names if getattr(self, name).numel()}
        out["record_ids"] = self.record_ids()
        out["last_values"] = self.last_values.contiguous()
        return out
