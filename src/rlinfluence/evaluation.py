"""Evaluation of the stochastic policy on separate environments (docs/method.md, section 7.1).

Episodes are run in a batch of environments with one policy forward per step. Episode ``e`` is
always reset with seed ``seed + e`` and runs on environment ``e % n_envs``, so every method and
every round is evaluated on the same episode seeds (common random numbers). Actions are sampled
with the caller's generator, never the training one, so evaluating does not change training.
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch

from rlinfluence.policies import ActorCritic, rollout_actor


class Evaluator:
    """Holds ``n_envs`` evaluation environments across rounds (some are slow to build)."""

    def __init__(self, make_env: Callable[[], gym.Env], n_envs: int, seed: int):
        self.envs = [make_env() for _ in range(n_envs)]
        self.seed = seed

    def evaluate(
        self, policy: ActorCritic, n_episodes: int, generator: torch.Generator
    ) -> np.ndarray:
        """Undiscounted returns of ``n_episodes`` episodes of the stochastic policy."""
        envs = self.envs[: max(1, min(len(self.envs), n_episodes))]
        low, high = _action_bounds(envs[0].action_space)
        returns = np.zeros(n_episodes)
        episode = list(range(len(envs)))  # episode index each env is running
        obs = [env.reset(seed=self.seed + e)[0] for env, e in zip(envs, episode, strict=True)]
        active = list(range(len(envs)))
        act = rollout_actor(policy)
        while active:
            batch = np.stack([obs[i] for i in active])
            actions, _, _ = act(batch, policy.noise((len(active),), generator).numpy())
            if low is not None:
                actions = np.clip(actions, low, high)
            still_active = []
            for row, i in enumerate(active):
                obs[i], reward, terminated, truncated, _ = envs[i].step(actions[row])
                returns[episode[i]] += reward
                if terminated or truncated:
                    episode[i] += len(envs)
                    if episode[i] >= n_episodes:
                        continue
                    obs[i] = envs[i].reset(seed=self.seed + episode[i])[0]
                still_active.append(i)
            active = still_active
        return returns

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _action_bounds(space: gym.Space) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Bounds to clip continuous actions to before ``env.step`` (SB3 does the same)."""
    if isinstance(space, gym.spaces.Box):
        return space.low, space.high
    return None, None
