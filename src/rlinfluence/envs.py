"""Environment construction and the paper's per-environment presets (method-spec section 6).

``make_env(env_id)`` builds any gymnasium id, with the observation wrappers our policies need
(one-hot for ``Discrete`` observations, the image for MiniGrid's dict observations) and the
preset's constructor arguments. ``PRESETS`` holds the paper's hyperparameters; any other id
runs with ``PPOConfig``'s generic (Stable-Baselines3) defaults.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
from minigrid.wrappers import ImgObsWrapper

from rlinfluence.errors import UserError

# The paper's shared PPO settings (spec 6.1): SGD 5e-3, no gradient clipping (as the authors'
# code ran), n_steps 2048, batch 64, 10 epochs, gamma 0.99, lambda 0.95, clip 0.2, ent 0, vf 0.5.
_PAPER_PPO: dict[str, Any] = dict(
    n_envs=1, n_steps=2048, batch_size=64, n_epochs=10, optimizer="sgd", learning_rate=5e-3,
    max_grad_norm=None, gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.0, vf_coef=0.5,
)


@dataclass(frozen=True)
class EnvPreset:
    """A paper environment: how to build it and the hyperparameters the paper used."""

    env_id: str
    rounds: int
    """Rounds of the standard PPO run (one round = n_steps * n_envs environment steps)."""
    drop_pct: float
    """IIF's p: percentage of the negatively-influential records dropped each round (spec 5.4)."""
    eval_episodes: int
    make_kwargs: dict[str, Any] = field(default_factory=dict)
    ppo: dict[str, Any] = field(default_factory=dict)
    """PPOConfig overrides on top of the paper's shared settings."""

    def config_overrides(self) -> dict[str, Any]:
        rollout = _PAPER_PPO["n_steps"] * _PAPER_PPO["n_envs"]
        return {**_PAPER_PPO, "total_timesteps": self.rounds * rollout,
                "eval_episodes": self.eval_episodes, "drop_pct": self.drop_pct, **self.ppo}


HIGHWAY_CONFIG = {
    "observation": {"type": "Kinematics"},
    "action": {"type": "DiscreteMetaAction"},
    "vehicles_count": 10,
}

PRESETS: dict[str, EnvPreset] = {
    p.env_id: p
    for p in [
        EnvPreset("FrozenLake-v1", rounds=50, drop_pct=50.0, eval_episodes=1000,
                  make_kwargs={"map_name": "4x4", "is_slippery": False}),
        EnvPreset("Acrobot-v1", rounds=50, drop_pct=50.0, eval_episodes=1000),
        EnvPreset("MiniGrid-Empty-8x8-v0", rounds=40, drop_pct=12.5, eval_episodes=1000),
        EnvPreset("highway-v0", rounds=100, drop_pct=50.0, eval_episodes=100,
                  make_kwargs={"config": HIGHWAY_CONFIG}),
        EnvPreset("LunarLander-v3", rounds=150, drop_pct=12.5, eval_episodes=1000),
        EnvPreset("BipedalWalker-v3", rounds=500, drop_pct=6.25, eval_episodes=100,
                  ppo={"optimizer": "adam", "learning_rate": 3e-4}),
    ]
}

# Environment families registered by importing their package.
_PLUGINS = {"MiniGrid-": "minigrid", "BabyAI-": "minigrid", "highway": "highway_env",
            "merge": "highway_env", "roundabout": "highway_env", "parking": "highway_env",
            "intersection": "highway_env", "racetrack": "highway_env", "exit": "highway_env",
            "two-way": "highway_env", "u-turn": "highway_env", "lane-keeping": "highway_env"}


def check_env_id(env_id: str) -> None:
    """Raise ``UserError`` naming ``env_id`` if gymnasium does not know it."""
    for prefix, module in _PLUGINS.items():
        if env_id.startswith(prefix):
            importlib.import_module(module)
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        presets = ", ".join(PRESETS)
        raise UserError(f"unknown env id {env_id!r} ({exc}); presets: {presets}") from None


class OneHotObservation(gym.ObservationWrapper):
    """Discrete(n) observation -> one-hot float32 vector of length n (SB3's preprocessing)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.n = int(env.observation_space.n)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (self.n,), np.float32)

    def observation(self, observation: int) -> np.ndarray:
        out = np.zeros(self.n, dtype=np.float32)
        out[int(observation)] = 1.0
        return out


def make_env(env_id: str, **kwargs: Any) -> gym.Env:
    """Build ``env_id`` with its preset arguments (overridden by ``kwargs``) and obs wrappers."""
    check_env_id(env_id)
    preset = PRESETS.get(env_id)
    env = gym.make(env_id, **{**(preset.make_kwargs if preset else {}), **kwargs})
    space = env.observation_space
    if isinstance(space, gym.spaces.Discrete):
        env = OneHotObservation(env)
    elif isinstance(space, gym.spaces.Dict) and "image" in space.spaces:
        env = ImgObsWrapper(env)
    return env


def mc_unavailable_reason(env_id: str) -> str | None:
    """Why Monte-Carlo advantages cannot be computed for ``env_id`` (None if they can).

    They need discrete actions and a small discrete state space that the observation
    identifies: a ``Discrete`` observation (FrozenLake, one-hot encoded) or a MiniGrid image.
    """
    env = make_env(env_id)
    try:
        if not isinstance(env.action_space, gym.spaces.Discrete):
            return f"{env_id} has continuous actions ({env.action_space})"
        if isinstance(env.unwrapped.observation_space, gym.spaces.Discrete) or isinstance(env, ImgObsWrapper):
            return None
        return (f"{env_id} has continuous observations ({env.observation_space}); Monte-Carlo "
                "advantages need a small discrete state space (FrozenLake, MiniGrid)")
    finally:
        env.close()


def make_vec_env(env_id: str, n_envs: int, render_mode: str | None = None) -> gym.vector.SyncVectorEnv:
    """``n_envs`` copies in one process. SAME_STEP autoreset, as SB3: a finished episode's last
    observation comes in ``info["final_obs"]`` and the returned observation starts the next one.
    ``render_mode="rgb_array"``: ``render()`` returns every copy's frame (``--save-frames``)."""
    kwargs = {"render_mode": render_mode} if render_mode else {}
    return gym.vector.SyncVectorEnv(
        [lambda: make_env(env_id, **kwargs) for _ in range(n_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
