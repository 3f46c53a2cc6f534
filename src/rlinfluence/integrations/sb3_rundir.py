"""A Stable-Baselines3 PPO run as an rlinfluence run directory, so that every analysis command
(``attribute``, ``diagnose``, ``timeline``, ``validate``, ``intervene``, ``explain``, ``audit``,
``report``) works on it:

    from stable_baselines3 import PPO
    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback

    model = PPO("MlpPolicy", "CartPole-v1", n_steps=256, seed=1)
    model.learn(20_000, callback=RunDirectoryCallback("runs/sb3_cartpole"))
    # rlinfluence attribute runs/sb3_cartpole --round 3 ...

The callback writes what ``rlinfluence.ppo.PPO`` writes with ``save_buffers``: ``config.json`` (a
``PPOConfig`` with the model's env and hyperparameters), ``metrics.csv`` (one row per round),
``checkpoints/round_K.pt`` (theta(k) with the optimiser's state, before round k's ``train()``;
and the final theta) and ``buffers/round_K.safetensors`` (round k's records after SB3's GAE).

The policy is written as rlinfluence's ``ActorCritic``, the same network with the same weights
(``MlpPolicy``'s MLPs, ``net_arch`` pi and vf, tanh or ReLU; ``MultiInputPolicy`` on Dict
observations without images and Discrete / MultiDiscrete / MultiBinary observations, recorded as
the flat vectors SB3's extractor gives the policy; ``CnnPolicy``'s shared ``NatureCNN`` as the
``nature`` encoder; the names map ``mlp_extractor.policy_net`` -> ``actor``,
``mlp_extractor.value_net`` -> ``critic``, ``action_net`` -> ``action_head``, ``value_net`` ->
``value_head``, ``features_extractor`` -> ``encoder``, ``log_std``), and SB3's Adam moments are
carried to the same parameters; ``VecNormalize``'s running statistics are saved with each round.
What has no counterpart (gSDE, other extractors, another activation, a schedule for the learning
rate or the clip range, an optimiser but Adam or AdamW) is refused with one ``UserError`` at the
start of ``learn()``; an env the analyses cannot re-create (no gymnasium id and no ``env=``, or
wrappers the id does not make) is written, warned, for what needs no env (docs/sb3.md).

What re-runs of an update mean here: ``validate``, ``intervene`` and ``explain`` redo round k's
update with rlinfluence's PPO update and SB3's hyperparameters from theta(k) and its Adam state
(``SavedRound.retrain``); its minibatches are drawn by rlinfluence's generator, not SB3's, and a
batch size that does not divide the round's records drops the remainder (SB3 trains on it), so a
plain re-run lands near SB3's theta(k+1), not on it bit for bit. Scores of records at theta(k)
(``attribute``, ``diagnose``, ``timeline``, ``audit``) need no re-run and are exact.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from torch import nn

try:
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.preprocessing import is_image_space, preprocess_obs
    from stable_baselines3.common.torch_layers import CombinedExtractor, FlattenExtractor, NatureCNN
    from stable_baselines3.common.vec_env import (
        VecCheckNan,
        VecEnvWrapper,
        VecMonitor,
        VecNormalize,
        VecTransposeImage,
        VecVideoRecorder,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("rlinfluence.integrations.sb3_rundir needs stable-baselines3: "
                      "pip install 'rlinfluence[sb3]'") from exc

from rlinfluence.buffer import RolloutBuffer as OurRolloutBuffer
from rlinfluence.config import PPOConfig
from rlinfluence.envs import UNREGISTERED, FlatObservation, flat_observation_space
from rlinfluence.errors import UserError
from rlinfluence.integrations.sb3 import TimeLimitEnds, as_rollout_buffer
from rlinfluence.writer import CHECKED_RECORDS, LOGP_TOLERANCE, RunWriter

WRITTEN_BY = "stable-baselines3 (RunDirectoryCallback)"
"""``written_by`` of the run's identity (``rlinfluence.identity``): analyses read it, ``train --resume`` refuses it."""

_NAMES = ((re.compile(r"^mlp_extractor\.policy_net\.(.*)"), r"actor.\1"),
          (re.compile(r"^mlp_extractor\.value_net\.(.*)"), r"critic.\1"),
          (re.compile(r"^action_net\.(.*)"), r"action_head.\1"),
          (re.compile(r"^value_net\.(.*)"), r"value_head.\1"),
          (re.compile(r"^log_std$"), "log_std"),
          (re.compile(r"^features_extractor\.(.*)"), r"encoder.\1"))  # NatureCNN, shared by actor and critic


def our_name(sb3_name: str) -> str | None:
    """rlinfluence's ``ActorCritic`` name of an SB3 ``MlpPolicy`` parameter (None: no counterpart)."""
    for pattern, replacement in _NAMES:
        if pattern.match(sb3_name):
            return pattern.sub(replacement, sb3_name)
    return None


def _constant(model: Any, name: str, label: str | None = None) -> float:
    """A hyperparameter SB3 holds as a schedule, read at progress 1 and 0: ``UserError`` (naming it
    ``label``) unless constant."""
    schedule = getattr(model, name)
    if not callable(schedule):
        return float(schedule)
    start, end = float(schedule(1.0)), float(schedule(0.0))
    if start != end:
        raise UserError(f"RunDirectoryCallback: {label or name} is a schedule ({start:g} -> {end:g}); rlinfluence's "
                        "re-runs take a constant one")
    return start


def _wrappers(model: Any) -> list[Any]:
    """The VecEnv wrappers around the model's envs, outermost first."""
    found, env = [], model.env
    while isinstance(env, VecEnvWrapper):
        found.append(env)
        env = env.venv
    return found


def _observation_wrappers(model: Any) -> list[str]:
    """The VecEnv wrappers around the model's envs that change what its policy observes in a way a
    run does not redo (a frame stack, VecNormalize on Dict observations, ...): an env re-created from
    its id would observe otherwise. Not ``VecTransposeImage`` (the run records the env's own image
    layout, its NatureCNN transposes) nor ``VecNormalize`` on a Box (each round saves its statistics)."""
    box = isinstance(model.observation_space, spaces.Box)
    return [type(env).__name__ for env in _wrappers(model)
            if not isinstance(env, VecMonitor | VecTransposeImage | VecCheckNan | VecVideoRecorder)
            and not (isinstance(env, VecNormalize) and (box or not env.norm_obs))]


def _env_observation_space(model: Any) -> spaces.Space:
    """The observation space the run records for the model's envs: theirs, as the env makes them
    (images height x width x channels, observations before VecNormalize), or the model's where a
    wrapper the run does not redo changes them (``_observation_wrappers``)."""
    if _observation_wrappers(model):
        return model.observation_space
    wrappers = _wrappers(model)
    return wrappers[-1].venv.observation_space if wrappers else model.observation_space


def _transposing(model: Any) -> list[Any]:
    """SB3's ``VecTransposeImage`` around the model's envs where the run records images in the env's
    own layout (none where another wrapper makes the run record what the policy sees)."""
    return [] if _observation_wrappers(model) else [e for e in _wrappers(model) if isinstance(e, VecTransposeImage)]


def _obs_normalization(model: Any) -> Any:
    """The model's ``VecNormalize`` where it normalises (Box) observations, else None."""
    normalize = model.get_vec_normalize_env()
    return normalize if normalize is not None and normalize.norm_obs and \
        isinstance(model.observation_space, spaces.Box) else None


def _not_made_by_id(env_spec: Any) -> str | None:
    """Why ``gym.make(env_spec.id)`` would not make the model's env (wrappers its spec records beyond
    SB3's Monitor, arguments or a time limit other than the id's), or None."""
    wrappers = [w.name for w in env_spec.additional_wrappers if w.name not in ("Monitor", "RecordEpisodeStatistics")]
    registered = gym.spec(env_spec.id)
    kwargs = {k: v for k, v in env_spec.kwargs.items() if k != "render_mode"}
    if wrappers:
        return f"is {env_spec.id} wrapped in {', '.join(wrappers)}"
    if kwargs != {k: v for k, v in registered.kwargs.items() if k != "render_mode"} or \
            env_spec.max_episode_steps != registered.max_episode_steps:
        return f"is {env_spec.id} made with other arguments or time limit than the id's"
    return None


def _env_of(model: Any, env: str | None) -> str:
    """The env the run records: ``env`` (a gymnasium id or an entry point ``package.module:function``),
    checked to build the model's spaces, else the model's env's gymnasium id, else ``UNREGISTERED``
    and the env's class (warned: what needs the env will say so); ``UNREGISTERED`` too where a VecEnv
    wrapper changes the observations (``_observation_wrappers``)."""
    wrappers = _observation_wrappers(model)
    if wrappers:
        warnings.warn(f"RunDirectoryCallback: the model's env is wrapped in {', '.join(wrappers)}, which changes what the "
                      "policy observes: the run is written for what needs no env (attribute, diagnose, timeline, "
                      "audit); explain, intervene and the evaluations would need those observations", stacklevel=2)
        return f"{UNREGISTERED}{'+'.join(wrappers)}"
    if env is None:
        try:
            env_spec = model.env.get_attr("spec")[0]
        except AttributeError:  # a VecEnv of envs that are not gymnasium.Env (no spec attribute at all)
            env_spec = None
        registered = env_spec is not None and getattr(env_spec, "id", None) in gym.registry
        reason = _not_made_by_id(env_spec) if registered else "has no gymnasium id that gymnasium can make"
        if reason:
            kind = type(model.env.envs[0].unwrapped if hasattr(model.env, "envs") else model.env)
            warnings.warn(f"RunDirectoryCallback: the model's env {reason}: the run is written for what needs no env "
                          "(attribute, diagnose, timeline, audit); pass env='package.module:function', an importable "
                          "function that builds it, for explain, intervene and the evaluations", stacklevel=2)
            return f"{UNREGISTERED}{kind.__module__}.{kind.__qualname__}"
        return env_spec.id
    from rlinfluence.envs import make_env

    built = make_env(env)
    try:  # a Discrete, Dict, ... observation is flat in rlinfluence's env and SB3's policy alike: compared before that
        observation_space = built.env.observation_space if isinstance(built, FlatObservation) else built.observation_space
        for what, ours, theirs in (("observation", observation_space, _env_observation_space(model)),
                                   ("action", built.action_space, model.action_space)):
            if ours != theirs:
                raise UserError(f"RunDirectoryCallback: env {env!r} builds {what} space {ours}; the model's is {theirs}")
    finally:
        built.close()
    return env


def _encoder_of(model: Any) -> dict[str, Any]:
    """``PPOConfig``'s encoder fields for the model's features extractor (``UserError`` for one with no
    counterpart): a flattening one -> ``flatten``; CnnPolicy's ``NatureCNN``, or MultiInputPolicy's
    ``CombinedExtractor`` with NatureCNNs for its images -> ``nature`` (with the Dict's parts, in the
    env's own image layout)."""
    policy, extractor = model.policy, model.policy.features_extractor
    parts = getattr(extractor, "extractors", {})
    combined = isinstance(extractor, CombinedExtractor) and all(type(e) in (NatureCNN, nn.Flatten) for e in parts.values())
    if isinstance(extractor, FlattenExtractor) or (combined and all(type(e) is nn.Flatten for e in parts.values())):
        if is_image_space(model.observation_space) and policy.normalize_images:
            raise UserError(f"RunDirectoryCallback: observation space {model.observation_space} is an image that SB3's "
                            "MlpPolicy divides by 255; rlinfluence's flat policy takes it as it is")
        return {"encoder": "flatten"}
    images = {key: e for key, e in parts.items() if type(e) is NatureCNN} if combined else \
        {None: extractor} if type(extractor) is NatureCNN else {}
    if not images:
        raise UserError(f"RunDirectoryCallback: the features extractor is {type(extractor).__name__}; a flattening one "
                        "(MlpPolicy's, MultiInputPolicy's), CnnPolicy's NatureCNN or MultiInputPolicy's with NatureCNNs "
                        "for its images maps onto rlinfluence's policy")
    if not policy.share_features_extractor:
        raise UserError("RunDirectoryCallback: share_features_extractor=False (a CNN for the actor and another for the "
                        "critic); rlinfluence's policy shares one")
    space = model.observation_space
    for key in images:
        image = space if key is None else space.spaces[key]
        if policy.normalize_images != (image.dtype == np.uint8):
            raise UserError(f"RunDirectoryCallback: normalize_images={policy.normalize_images} on {image}; "
                            "rlinfluence's NatureCNN divides uint8 images by 255 and others by nothing")
    if combined and not policy.normalize_images:
        raise UserError("RunDirectoryCallback: normalize_images=False on a Dict's images; rlinfluence's parts divide "
                        "each image by 255, as SB3 does by default")
    features = {int(e.features_dim) for e in images.values()}
    if not combined:
        return {"encoder": "nature", "features_dim": features.pop()}
    own = _env_observation_space(model)  # the Dict as the env makes it: images before VecTransposeImage
    transposed = {k for env in _transposing(model) for k in env.image_space_keys}
    if any(int(np.argmin(own.spaces[k].shape)) != 2 for k in transposed) or len(features) > 1:
        raise UserError("RunDirectoryCallback: a Dict's images that SB3 transposes though channels-first, or CNNs of "
                        "different sizes: rlinfluence's parts take channels-last images transposed and one size")
    return {"encoder": "nature", "features_dim": features.pop(), "observation_parts": tuple(
        f"{k}:image:{'x'.join(map(str, sub.shape))}" if k in images else f"{k}:flat:{spaces.flatdim(sub)}"
        for k, sub in own.spaces.items())}


def config_of(model: Any, total_timesteps: int, eval_episodes: int, env: str | None = None) -> PPOConfig:
    """The ``PPOConfig`` of an SB3 PPO model (``UserError`` for what has no counterpart); ``env``: the
    env to record where the model's has no gymnasium id (``_env_of``)."""
    policy = model.policy
    env_id = _env_of(model, env)
    if model.use_sde:
        raise UserError("RunDirectoryCallback: gSDE (use_sde=True) has no counterpart in rlinfluence's policy")
    encoder = _encoder_of(model)
    if policy.activation_fn not in (nn.Tanh, nn.ReLU) or getattr(policy, "squash_output", False):
        raise UserError(f"RunDirectoryCallback: activation {policy.activation_fn.__name__} (rlinfluence's policy "
                        "takes tanh or ReLU)")
    arch = policy.net_arch
    pi, vf = (arch.get("pi", []), arch.get("vf", [])) if isinstance(arch, dict) else (list(arch), list(arch))
    if not isinstance(model.action_space, spaces.Discrete | spaces.Box):
        raise UserError(f"RunDirectoryCallback: action space {model.action_space} (Discrete or Box only)")
    optimizer = policy.optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise UserError(f"RunDirectoryCallback: optimiser {type(optimizer).__name__} (Adam or AdamW only)")
    clip_vf = _constant(model, "clip_range_vf") if model.clip_range_vf is not None else None
    normalize = _obs_normalization(model)
    return PPOConfig(
        env=env_id, seed=int(model.seed) if model.seed is not None else 0, total_timesteps=int(total_timesteps),
        n_envs=model.n_envs, n_steps=model.n_steps,
        batch_size=min(model.batch_size, model.n_steps * model.n_envs),  # larger: SB3 takes every record at once
        n_epochs=model.n_epochs, update_engine="torch",  # re-runs in the arithmetic the re-run gap was measured with
        learning_rate=_constant(model, "lr_schedule", "learning_rate"),
        optimizer="adamw" if type(optimizer) is torch.optim.AdamW else "adam",
        weight_decay=float(optimizer.param_groups[0]["weight_decay"]) if type(optimizer) is torch.optim.AdamW else 0.01,
        adam_eps=float(optimizer.param_groups[0]["eps"]), gamma=float(model.gamma),
        gae_lambda=float(model.gae_lambda), clip_range=_constant(model, "clip_range"), clip_range_vf=clip_vf,
        normalize_advantage=bool(model.normalize_advantage), ent_coef=float(model.ent_coef),
        vf_coef=float(model.vf_coef),
        max_grad_norm=float(model.max_grad_norm) if math.isfinite(model.max_grad_norm) else None,
        target_kl=float(model.target_kl) if model.target_kl is not None else None,
        hidden_sizes=tuple(int(h) for h in pi), **encoder, eval_episodes=eval_episodes,
        obs_norm_clip=float(normalize.clip_obs) if normalize is not None else None,
        critic_hidden_sizes=None if list(vf) == list(pi) else tuple(int(h) for h in vf),
        activation="tanh" if policy.activation_fn is nn.Tanh else "relu",
        save_buffers=True, progress=False, tensorboard=False)


def _observations(model: Any, buffer: Any, rows: np.ndarray | None = None) -> Any:
    """The round's observations as SB3's policy takes them (a tensor, or a dict of tensors for a
    Dict space), one record per row in step-major order (``rows`` of them only), on the policy's device."""
    n_steps, n_envs = buffer.buffer_size, buffer.n_envs

    def records(array: np.ndarray) -> torch.Tensor:  # [n_steps, n_envs, ...] -> [n_steps * n_envs, ...]
        flat = array.reshape(n_steps * n_envs, *array.shape[2:])
        return torch.as_tensor(flat if rows is None else flat[rows], device=model.policy.device)

    observations = buffer.observations
    return {k: records(v) for k, v in observations.items()} if isinstance(observations, dict) else records(observations)


def _recorded_observations(model: Any, buffer: Any) -> torch.Tensor | None:
    """The round's observations as the run records them, ``[n_steps, n_envs, ...]``: a Discrete, Dict,
    ... observation flat, each part as SB3 preprocesses it for the policy (one-hot, floats; images as
    they are, in the env's own layout) and concatenated in key order: ``FlatObservation``'s vectors
    (SB3 stores a Discrete one as its index, a Dict as its parts); an image in the env's own layout
    (SB3 stores it transposed); None for a Box the run records as SB3 stores it."""
    n_steps, n_envs, space = buffer.buffer_size, buffer.n_envs, model.observation_space
    transposed = _transposing(model)
    if isinstance(space, spaces.Box):
        if not transposed:
            return None
        return torch.as_tensor(buffer.observations).permute(0, 1, 3, 4, 2)  # VecTransposeImage's CHW -> HWC
    keys = set(transposed[0].image_space_keys) if transposed else set()
    observations = _observations(model, buffer)
    subspaces, observations = (space.spaces, observations) if isinstance(space, spaces.Dict) else \
        ({None: space}, {None: observations})
    parts = []
    for key, sub in subspaces.items():
        part = observations[key].permute(0, 2, 3, 1) if key in keys else observations[key]
        parts.append((part.float() if is_image_space(sub) else preprocess_obs(part, sub)).reshape(len(part), -1))
    return torch.cat(parts, dim=1).float().cpu().reshape(n_steps, n_envs, -1)


class RunDirectoryCallback(BaseCallback):
    """Writes an SB3 PPO run as an rlinfluence run directory at ``path`` (module docstring): a thin
    layer over ``rlinfluence.writer.RunWriter``, which SB3's hooks call.

    ``eval_episodes``: episodes of rlinfluence's evaluation of each theta(k+1) (the run's
    ``eval_return_mean``, what ``explain`` and ``report`` read; 0 = none, NaN in metrics.csv).
    ``env``: for an env gymnasium cannot make by id, the entry point of an importable function that
    builds it (``package.module:make_env``), from which the analyses re-create it.
    Training is unchanged: the callback reads the model and writes files, it draws no random number
    from SB3's generators (the evaluation has its own, seeded by the round)."""

    def __init__(self, path: str | Path, eval_episodes: int = 20, verbose: int = 0, env: str | None = None):
        super().__init__(verbose)
        if eval_episodes < 0:
            raise UserError(f"eval_episodes must be >= 0, got {eval_episodes}")
        self.path, self.eval_episodes, self.env = Path(path), eval_episodes, env
        self.writer: RunWriter | None = None
        self._episodes: np.ndarray | None = None
        self._returns: list[float] = []
        self._pending: OurRolloutBuffer | None = None  # the round collected, ended after its train()
        self._time_limits = TimeLimitEnds()
        self.stopped: str | None = None  # why the writing stopped (``_writing``)
        self._collecting_with: dict[str, Any] | None = None  # VecNormalize's statistics as the collection began

    @property
    def round(self) -> int:
        """Rounds whose records were written."""
        return 0 if self.writer is None else self.writer.round + (self._pending is not None)

    def _on_training_start(self) -> None:
        if self.writer is not None:  # a later learn() with this callback continues its run
            return
        if (self.path / "config.json").exists():
            raise UserError(f"{str(self.path)!r} already holds a run: the analyses would mix the two trainings; give "
                            "this one its own path (or pass the same callback to a later learn() to continue)")
        config = config_of(self.model, self.model._total_timesteps, self.eval_episodes, self.env)
        spaces_ = None
        if config.env.startswith(UNREGISTERED):  # no env to build: the policy on the spaces it sees, no evaluation
            space = _env_observation_space(self.model)
            space = space if isinstance(space, spaces.Box) else flat_observation_space(space)
            if config.obs_norm_clip is not None:  # as envs.NormalizedObservation makes it
                space = spaces.Box(-config.obs_norm_clip, config.obs_norm_clip, space.shape, np.float32)
            spaces_ = (space, self.model.action_space)
            config = dataclasses.replace(config, eval_episodes=0)
        self.writer = RunWriter.from_config(self.path, config, names=our_name, written_by=WRITTEN_BY, spaces=spaces_)

    def _on_step(self) -> bool:
        self._time_limits.record(self.locals)
        for info in self.locals.get("infos", []):
            if "episode" in info:  # SB3's Monitor: an episode ended
                self._returns.append(float(info["episode"]["r"]))
        return True

    def _end_round(self) -> None:
        """The collected round ends, now that its ``train()`` ran: its advantages, SB3's update
        statistics, theta(k+1) (the model as it is now)."""
        if self._pending is None:
            return
        buffer, values = self._pending, self.model.logger.name_to_value
        metrics = {"train_return_mean": float(np.mean(self._returns)) if self._returns else math.nan,
                   "train_episodes": len(self._returns)}
        for ours, theirs in (("approx_kl", "train/approx_kl"), ("clip_fraction", "train/clip_fraction"),
                             ("policy_loss", "train/policy_gradient_loss"), ("value_loss", "train/value_loss"),
                             ("entropy", "train/entropy_loss")):
            if theirs in values:
                metrics[ours] = -float(values[theirs]) if ours == "entropy" else float(values[theirs])
        self.writer.end_round(buffer.advantages, buffer.returns, self.model.policy, self.model.policy.optimizer,
                              metrics, last_values=buffer.last_values, obs_statistics=self._obs_statistics())
        self._pending, self._returns = None, []

    def _writing(self, step: Callable[[], None]) -> None:
        """A step of the writer; a round it refuses (records the mapped policy did not compute, say
        values another callback changed) stops the writing with a warning, never the user's training:
        the rounds written so far stay readable."""
        if self.stopped is not None:
            return
        try:
            step()
        except UserError as exc:
            self.stopped = str(exc)
            warnings.warn(f"RunDirectoryCallback stops writing {str(self.path)!r} (training goes on): {exc}", stacklevel=2)

    def _on_rollout_start(self) -> None:
        self._writing(self._end_round)
        self._collecting_with = self._obs_statistics()  # theta(k)'s: VecNormalize updates them while collecting

    def _on_rollout_end(self) -> None:
        self._writing(self._record_round)

    def _record_round(self) -> None:
        buffer = self.model.rollout_buffer
        if self._episodes is None:
            self._episodes = np.zeros(buffer.n_envs, dtype=np.int64)
        ours = as_rollout_buffer(self.model, buffer, self.writer.round, self._episodes,
                                 self._time_limits.take(buffer.buffer_size), obs=_recorded_observations(self.model, buffer))
        self._episodes = ours.episode_ids[-1].numpy() + ours.dones[-1].long().numpy()
        self.writer.begin_round(self.model.policy, self.model.policy.optimizer,  # theta(k): it collected the round
                                self._collecting_with)
        self.writer.add_rollout(ours.obs, ours.actions, ours.logp, ours.values, ours.rewards, ours.terminated,
                                ours.truncated, ours.final_values)
        if self.writer.check_values:
            self._check_logged_values(ours, buffer)
        self._pending = ours

    def _check_logged_values(self, ours: OurRolloutBuffer, buffer: Any) -> None:
        """SB3's rollout values against its critic's (``predict_values``). A policy whose ``forward``
        returns values its critic does not (SB3's GAE tests) trains on advantages computed from them:
        the run keeps them as logged (warned once) and rlinfluence's critic is checked against SB3's
        critic instead of against them."""
        rows = torch.linspace(0, len(ours) - 1, min(len(ours), CHECKED_RECORDS)).long()  # step-major, as both hold them
        with torch.no_grad():
            critic = self.model.policy.predict_values(_observations(self.model, buffer, rows.numpy())).flatten().cpu().float()
        scale, apart = max(1.0, float(critic.abs().max())), float((critic - ours.values.flatten()[rows]).abs().max())
        if apart <= LOGP_TOLERANCE * scale:
            return  # the usual case: the writer checks its critic against the logged values
        obs = ours.obs.flatten(0, 1)[rows]
        with torch.no_grad():
            mapped = self.writer.trainer.policy.value(obs.float() if obs.is_floating_point() else obs)
        gap = float((mapped - critic).abs().max())
        if not gap <= LOGP_TOLERANCE * scale:
            raise UserError(f"RunDirectoryCallback: rlinfluence's critic differs from SB3's predict_values by up to "
                            f"{gap:.3g}: the policy does not map as assumed")
        self.writer.check_values = False
        warnings.warn(f"RunDirectoryCallback: the rollout's values are not {type(self.model.policy).__name__}'s critic's "
                      f"(up to {apart:.3g} apart; its forward returns others): the run "
                      "keeps them as SB3 logged them, the values its advantages were computed from", stacklevel=2)

    def _obs_statistics(self) -> dict[str, Any] | None:
        """VecNormalize's running statistics as they are now (None without observation normalisation)."""
        normalize = _obs_normalization(self.model)
        return None if normalize is None else {"mean": normalize.obs_rms.mean.copy(), "var": normalize.obs_rms.var.copy(),
                                               "epsilon": normalize.epsilon}

    def _on_training_end(self) -> None:
        self._writing(self._end_round)
        self.writer.close()


__all__ = ["RunDirectoryCallback", "config_of", "our_name"]
