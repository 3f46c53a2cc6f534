"""Environment construction and the paper's per-environment presets (docs/method.md, section 6).

``make_env(env_id)`` builds any gymnasium id, with the observation wrappers our policies need
(one-hot for ``Discrete`` observations, the image for MiniGrid's dict observations) and the
preset's constructor arguments. ``PRESETS`` (``rlinfluence.presets``) holds the paper's
hyperparameters; any other id runs with ``PPOConfig``'s generic (Stable-Baselines3) defaults.
``EnvStream`` is a vector env whose episodes continue across the trainer's rounds.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np

from rlinfluence.errors import UserError, require_module
from rlinfluence.presets import PRESETS, EnvPreset  # noqa: F401  (importable from here)

if TYPE_CHECKING:
    import torch

# Environment families registered by importing their package.
_PLUGINS = {"MiniGrid-": "minigrid", "BabyAI-": "minigrid", "highway": "highway_env",
            "merge": "highway_env", "roundabout": "highway_env", "parking": "highway_env",
            "intersection": "highway_env", "racetrack": "highway_env", "exit": "highway_env",
            "two-way": "highway_env", "u-turn": "highway_env", "lane-keeping": "highway_env"}


def check_env_id(env_id: str) -> None:
    """Raise ``UserError`` naming ``env_id`` if gymnasium does not know it."""
    for prefix, module in _PLUGINS.items():
        if env_id.startswith(prefix):
            require_module(module, "envs")
            importlib.import_module(module)
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as exc:
        presets = ", ".join(PRESETS)
        raise UserError(f"unknown env id {env_id!r} ({exc}); presets: {presets}") from None
    if isinstance(spec.entry_point, str):  # a registered env whose package is missing: say which
        try:
            gym.envs.registration.load_env_creator(spec.entry_point)
        except gym.error.DependencyNotInstalled as exc:
            raise UserError(f"{env_id} needs a package that is not installed: {exc}") from None
        except ImportError as exc:
            raise UserError(f"{env_id} needs the package {exc.name!r}, which is not installed "
                            f"(pip install {exc.name})") from None


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
    elif _is_image_dict(space):
        from minigrid.wrappers import ImgObsWrapper  # only MiniGrid's envs have such spaces

        env = ImgObsWrapper(env)
    return env


def _is_image_dict(space: gym.Space) -> bool:
    """A dict observation with an ``image`` entry (MiniGrid's), which ``make_env`` reduces to the image."""
    return isinstance(space, gym.spaces.Dict) and "image" in space.spaces


def mc_unavailable_reason(env_id: str) -> str | None:
    """Why Monte-Carlo advantages cannot be computed for ``env_id`` (None if they can).

    They need discrete actions and a small discrete state space that the observation
    identifies: a ``Discrete`` observation (FrozenLake, one-hot encoded) or a MiniGrid image.
    """
    env = make_env(env_id)
    try:
        if not isinstance(env.action_space, gym.spaces.Discrete):
            return f"{env_id} has continuous actions ({env.action_space})"
        unwrapped = env.unwrapped.observation_space
        if isinstance(unwrapped, gym.spaces.Discrete) or _is_image_dict(unwrapped):
            return None
        return (f"{env_id} has continuous observations ({env.observation_space}); Monte-Carlo "
                "advantages need a small discrete state space (FrozenLake, MiniGrid)")
    finally:
        env.close()


def make_vec_env(env_id: str, n_envs: int, render_mode: str | None = None, asynchronous: bool = False
                 ) -> gym.vector.VectorEnv:
    """``n_envs`` copies, stepped in this process (SyncVectorEnv) or, ``asynchronous``, each in its
    own process (AsyncVectorEnv: for envs whose step is slow; the same transitions). SAME_STEP
    autoreset, as SB3: a finished episode's last observation comes in ``info["final_obs"]`` and the
    returned observation starts the next one. ``render_mode="rgb_array"``: ``render()`` returns
    every copy's frame (``--save-frames``)."""
    kwargs = {"render_mode": render_mode} if render_mode else {}
    factories = [functools.partial(make_env, env_id, **kwargs) for _ in range(n_envs)]
    if asynchronous:
        return gym.vector.AsyncVectorEnv(factories, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    return gym.vector.SyncVectorEnv(factories, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def base_observation_space(env_id: str) -> gym.Space:
    """The observation space ``env_id`` has before ``make_env``'s wrappers (a one-hot Box is a
    Discrete space underneath)."""
    env = make_env(env_id)
    try:
        return env.unwrapped.observation_space
    finally:
        env.close()


class EnvStream:
    """A vector env whose episodes continue across rounds, with the generator of its action noise."""

    def __init__(self, env: gym.vector.VectorEnv, generator: torch.Generator):
        self.env, self.generator = env, generator
        self.finished_returns: list[float] = []  # returns of the episodes that ended this round

    def reset(self, seed: int) -> None:
        self.obs, _ = self.env.reset(seed=seed)
        n_envs = self.env.num_envs
        self.episode_ids = np.arange(n_envs, dtype=np.int64)
        self.next_episode_id = n_envs
        self.episode_returns = np.zeros(n_envs)

    def track(self, rewards: np.ndarray, dones: np.ndarray) -> None:
        self.episode_returns += rewards
        for i in np.flatnonzero(dones):
            self.finished_returns.append(float(self.episode_returns[i]))
            self.episode_returns[i] = 0.0
            self.episode_ids[i] = self.next_episode_id
            self.next_episode_id += 1
