"""Environment construction and the paper's per-environment presets (docs/method.md, section 6).

``make_env(env_id)`` builds any gymnasium id, or an env of your own given by an entry point
(``package.module:make_env``), with the observation wrappers our policies need
(one-hot for ``Discrete`` observations, the image for MiniGrid's dict observations) and the
preset's constructor arguments. ``PRESETS`` (``rlinfluence.presets``) holds the paper's
hyperparameters; any other id runs with ``PPOConfig``'s generic (Stable-Baselines3) defaults.
``EnvStream`` is a vector env whose episodes continue across the trainer's rounds.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
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


def env_factory(env_id: str) -> Callable[..., gym.Env] | None:
    """The function an entry point ``package.module:function`` names (an env gymnasium cannot make by
    id: your own, built by an importable function of no required arguments, wrappers included), or
    None for a gymnasium id (gymnasium's own ``module:EnvId``, which registers the id on import,
    stays gymnasium's). ``UserError`` naming it when the module cannot be imported or has no such
    function."""
    module_name, sep, name = env_id.partition(":")
    if not sep or not module_name or not name.isidentifier() or env_id.startswith(UNREGISTERED):
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"env {env_id!r}: cannot import {module_name!r} ({exc}); an env given as an entry point "
                        "must be importable where rlinfluence runs (install its package, or add it to PYTHONPATH)"
                        ) from None
    if name in gym.registry or env_id in gym.registry:
        return None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UserError(f"env {env_id!r}: {module_name} has no function {name!r} to build the env")
    return factory


def env_package(env_id: str) -> dict[str, str] | None:
    """The installed distribution an entry point's module comes from, ``{"name", "version"}`` (what
    a run records beside its env: ``identity.written``), or None (a gymnasium id, a module on the
    path that no installed package provides)."""
    module_name, sep, _ = env_id.partition(":")
    if not sep or env_factory(env_id) is None:
        return None
    from importlib import metadata

    names = metadata.packages_distributions().get(module_name.split(".")[0], [])
    return {"name": names[0], "version": metadata.version(names[0])} if names else None


def check_env_package(recorded: dict[str, str] | None, env_id: str) -> None:
    """Warn (one line on stderr) where the env's package here is not the version the run recorded:
    what acts in the env (explain, intervene, evaluations) may act in another env."""
    if not recorded:
        return
    from importlib import metadata

    try:
        here = metadata.version(recorded["name"])
    except metadata.PackageNotFoundError:
        here = "not installed"
    if here != recorded["version"]:
        _warn_once(f"warning: the run's env {env_id!r} comes from {recorded['name']} {recorded['version']}; here it is "
                   f"{here}: what acts in the env may act in another one")


@functools.cache
def _warn_once(line: str) -> None:  # a command reads many rounds of one run
    print(line, file=sys.stderr)


UNREGISTERED = "unregistered:"
"""The env a run records (``unregistered:<its class>``) where a trainer's env had no gymnasium id and no
entry point was given: the run is read without it (``checkpoint.reading_trainer``)."""


def check_env_id(env_id: str) -> None:
    """Raise ``UserError`` naming ``env_id`` if gymnasium does not know it and it is not an entry
    point of an env (``env_factory``)."""
    if env_id.startswith(UNREGISTERED):
        raise UserError(f"this needs the run's env, which was recorded without a way to re-create it ({env_id}: it had "
                        "no gymnasium id, and no entry point package.module:function was given)")
    if env_factory(env_id) is not None:
        return
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


class FlatObservation(gym.ObservationWrapper):
    """A ``Discrete``, ``MultiDiscrete``, ``MultiBinary``, ``Dict`` or ``Tuple`` observation as a float32 vector:
    gymnasium's ``spaces.flatten`` (one-hot per discrete component, concatenated in the space's key
    order), which is SB3's preprocessing and flattening of the same spaces."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = flat_observation_space(env.observation_space)

    def observation(self, observation: Any) -> np.ndarray:
        return gym.spaces.flatten(self.env.observation_space, observation).astype(np.float32)


class NormalizedObservation(gym.ObservationWrapper):
    """Observations normalised by the run's saved running statistics, frozen (SB3's ``VecNormalize``
    with ``training=False``): clip((obs - mean) / sqrt(var + epsilon), -clip, clip). ``statistics`` is
    the trainer's dict (``clip``, ``mean``, ``var``, ``epsilon``; the identity until a round's are
    loaded), shared, so every env sees the round the trainer holds."""

    def __init__(self, env: gym.Env, statistics: dict[str, Any]):
        super().__init__(env)
        self.statistics = statistics
        clip = float(statistics["clip"])
        self.observation_space = gym.spaces.Box(-clip, clip, env.observation_space.shape, np.float32)

    def observation(self, observation: Any) -> np.ndarray:
        s = self.statistics
        return np.clip((observation - s["mean"]) / np.sqrt(s["var"] + s["epsilon"]), -s["clip"], s["clip"]
                       ).astype(np.float32)


def flat_observation_space(space: gym.Space) -> gym.spaces.Box:
    """The float32 ``Box`` that ``FlatObservation`` makes of ``space``; ``UserError`` for a space with
    no such vector (Text, Sequence, Graph, ...)."""

    def flattenable(part: gym.Space) -> bool:
        if isinstance(part, gym.spaces.Dict | gym.spaces.Tuple):
            return all(flattenable(p) for p in part.spaces.values()) if isinstance(part, gym.spaces.Dict) \
                else all(flattenable(p) for p in part.spaces)
        return isinstance(part, gym.spaces.Box | gym.spaces.Discrete | gym.spaces.MultiDiscrete | gym.spaces.MultiBinary)

    if not flattenable(space):
        raise UserError(f"observation space {space} is not supported; supported: Box, Discrete, MultiDiscrete, "
                        "MultiBinary (one-hot / as floats), and Dict or Tuple of those (flattened), MiniGrid's image dict")
    flat = gym.spaces.flatten_space(space)
    return gym.spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32), dtype=np.float32)


def make_env(env_id: str, *, obs_statistics: dict[str, Any] | None = None, **kwargs: Any) -> gym.Env:
    """Build ``env_id`` (a gymnasium id, or an entry point ``package.module:function``:
    ``env_factory``) with its preset arguments (overridden by ``kwargs``) and obs wrappers
    (``obs_statistics``: the trainer's, for a run with ``obs_norm_clip``: ``NormalizedObservation``)."""
    factory = env_factory(env_id)
    if factory is not None:
        try:
            env = factory(**kwargs)
        except TypeError as exc:
            if not kwargs:
                raise
            raise UserError(f"env {env_id!r} does not take {', '.join(kwargs)} ({exc})") from None
        if not isinstance(env, gym.Env):
            raise UserError(f"env {env_id!r} built a {type(env).__name__}, not a gymnasium.Env")
    else:
        check_env_id(env_id)
        preset = PRESETS.get(env_id)
        env = gym.make(env_id, **{**(preset.make_kwargs if preset else {}), **kwargs})
    space = env.observation_space
    if _is_image_dict(space):
        from minigrid.wrappers import ImgObsWrapper  # only MiniGrid's envs have such spaces

        env = ImgObsWrapper(env)
    elif not isinstance(space, gym.spaces.Box):
        env = FlatObservation(env)
    return env if obs_statistics is None else NormalizedObservation(env, obs_statistics)


def _is_image_dict(space: gym.Space) -> bool:
    """MiniGrid's dict observation (``image`` and ``mission`` entries), which ``make_env`` reduces to the
    image; another Dict is flattened whole (``FlatObservation``)."""
    return isinstance(space, gym.spaces.Dict) and {"image", "mission"} <= set(space.spaces)


def mc_unavailable_reason(env_id: str) -> str | None:
    """Why Monte-Carlo advantages cannot be computed for ``env_id`` (None if they can).

    They need discrete actions and a small discrete state space that the observation
    identifies: a ``Discrete`` observation (FrozenLake, one-hot encoded) or a MiniGrid image.
    """
    try:
        env = make_env(env_id)
    except UserError as exc:  # a read run whose env cannot be re-created here: no state space to tell
        return f"the env cannot be re-created here ({exc})"
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


def make_vec_env(env_id: str, n_envs: int, render_mode: str | None = None, asynchronous: bool = False,
                 obs_statistics: dict[str, Any] | None = None) -> gym.vector.VectorEnv:
    """``n_envs`` copies, stepped in this process (SyncVectorEnv) or, ``asynchronous``, each in its
    own process (AsyncVectorEnv: for envs whose step is slow; the same transitions). SAME_STEP
    autoreset, as SB3: a finished episode's last observation comes in ``info["final_obs"]`` and the
    returned observation starts the next one. ``render_mode="rgb_array"``: ``render()`` returns
    every copy's frame (``--save-frames``)."""
    kwargs = {"render_mode": render_mode} if render_mode else {}
    factories = [functools.partial(make_env, env_id, obs_statistics=obs_statistics, **kwargs) for _ in range(n_envs)]
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


def space_to_json(space: gym.Space) -> dict[str, Any] | None:
    """A ``Box`` or ``Discrete`` space as JSON (None for another kind): what a run records of the
    spaces its policy was built for (``spaces.json``), so that the analyses that need no env can
    build the policy where the env cannot be re-created."""
    if isinstance(space, gym.spaces.Box):
        return {"type": "Box", "low": space.low.tolist(), "high": space.high.tolist(), "dtype": str(space.dtype)}
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    return None


def space_from_json(data: dict[str, Any]) -> gym.Space:
    """The space ``space_to_json`` wrote."""
    if data["type"] == "Box":
        dtype = np.dtype(data["dtype"])
        return gym.spaces.Box(np.asarray(data["low"], dtype=dtype), np.asarray(data["high"], dtype=dtype), dtype=dtype)
    return gym.spaces.Discrete(int(data["n"]), start=int(data["start"]))


class UnavailableEnv(gym.vector.VectorEnv):
    """Stands in for a run's envs where they cannot be re-created (``reason``): it has the spaces the
    policy was built for, resets to zeros, and refuses to step with one ``UserError`` naming why, so
    the analyses that read saved rounds only (attribute, diagnose, timeline, audit) run and the ones
    that act in the env say what they need."""

    def __init__(self, n_envs: int, observation_space: gym.Space, action_space: gym.Space, reason: str):
        self.num_envs, self.reason = n_envs, reason
        self.single_observation_space, self.single_action_space = observation_space, action_space
        self.observation_space = gym.vector.utils.batch_space(observation_space, n_envs)
        self.action_space = gym.vector.utils.batch_space(action_space, n_envs)

    def reset(self, *, seed: Any = None, options: Any = None) -> tuple[np.ndarray, dict]:
        return np.zeros(self.observation_space.shape, dtype=self.observation_space.dtype), {}

    def step(self, actions: Any) -> Any:
        raise UserError(f"this needs the run's env, which cannot be re-created here: {self.reason}")

    def close(self, **kwargs: Any) -> None:
        pass


def check_finite(values: np.ndarray, what: str, round_index: int) -> None:
    """``UserError`` naming the first non-finite entry of a collected ``[n_steps, n_envs, ...]`` array."""
    if values.dtype.kind != "f":
        return
    bad = ~np.isfinite(values)
    if bad.any():
        where = tuple(np.argwhere(bad)[0])
        raise UserError(f"round {round_index}: the env returned a non-finite {what} ({values[where]}) "
                        f"at step {where[0]} of env {where[1]}")
