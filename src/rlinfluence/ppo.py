"""PPO with an attribution-ready rollout buffer (Stable-Baselines3 semantics, CleanRL layout).

One round k:

    1. collect     n_steps * n_envs records with pi_theta(k); episodes continue across rounds
    2. advantages  GAE(gamma, lambda), bootstrapping time-limit truncations with V(final obs)
    3. filter      keep = filter(buffer)          (standard PPO keeps every record); a filter
                   that scores against a validation set (``uses_validation``) gets, with
                   ``validation_steps > 0``, a separate rollout of pi_theta(k) on its own envs
    4. optimise    n_epochs x floor(|kept| / batch_size) minibatch steps on kept records,
                   a fresh permutation each epoch, the remainder dropped (spec 5.2 step 7)
    5. evaluate    the stochastic policy on separate envs (not counted in train_seconds, nor in
                   train_cpu_seconds, the process CPU time of steps 1-4: robust to other load)

``PPOConfig`` holds every hyperparameter and is also the CLI of ``rlinfluence train``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import math
import random
import sys
import time
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlinfluence.buffer import MinibatchStep, RolloutBuffer
from rlinfluence.corruptions import Corruptor, check_corruptions
from rlinfluence.envs import PRESETS, check_env_id, make_env, make_vec_env, mc_unavailable_reason
from rlinfluence.errors import UserError
from rlinfluence.evaluation import Evaluator
from rlinfluence.filters import Filter, FilterContext, check_drop_pct, make_filter
from rlinfluence.frames import FrameRecorder, check_renders, save_frames
from rlinfluence.influence import DEFAULT_ADVANTAGE_NORM
from rlinfluence.losses import PPOLoss, normalize_advantages, ppo_loss
from rlinfluence.policies import ActorCritic, make_policy, rollout_actor
from rlinfluence.progress import progress_bar
from rlinfluence.rundir import CheckpointError, RunDirectory, check_wandb_installed, load_checkpoint


@dataclass
class PPOConfig:
    """PPO hyperparameters. Defaults are Stable-Baselines3's; ``PPOConfig.for_env`` applies the
    paper's preset for its six environments (SGD 5e-3, no gradient clipping, ...)."""

    env: str = "CartPole-v1"
    """gymnasium env id (presets: FrozenLake-v1, Acrobot-v1, MiniGrid-Empty-8x8-v0, highway-v0,
    LunarLander-v3, BipedalWalker-v3)"""
    seed: int = 1
    """seed of python, numpy, torch (initial policy, sampling, minibatches) and the envs"""
    total_timesteps: int = 100_000
    """environment steps to train for; rounds = ceil(total_timesteps / (n_steps * n_envs))"""
    n_envs: int = 1
    """parallel environments (gymnasium SyncVectorEnv)"""
    n_steps: int = 2048
    """steps per environment per round"""
    batch_size: int = 64
    """minibatch size; must divide n_steps * n_envs"""
    n_epochs: int = 10
    """passes over the kept records per round"""
    learning_rate: float = 3e-4
    """constant learning rate"""
    optimizer: Literal["adam", "sgd"] = "adam"
    """adam (eps adam_eps) or plain sgd (no momentum); state is carried across rounds"""
    adam_eps: float = 1e-5
    """Adam's epsilon (SB3's default)"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    clip_range: float = 0.2
    """PPO ratio clip epsilon"""
    clip_range_vf: float | None = None
    """value clip around the old value; None = no value clipping"""
    normalize_advantage: bool = True
    """normalise advantages within each minibatch"""
    ent_coef: float = 0.0
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float | None = 0.5
    """global gradient-norm clip; None = no clipping (as the paper's code ran)"""
    target_kl: float | None = None
    """stop the round's update once approx_kl > 1.5 * target_kl (SB3); None = never"""
    filter: Literal["none", "iif", "iif-robust", "random", "advantage", "td-error", "reward-extremes",
                    "dtv", "advantage-sign", "oracle"] = "none"
    """records to drop before each update: none = standard PPO; iif = influence-based filtering
    (the paper's); iif-robust = iif with ROBUST_IIF's options (drop_pct auto; docs/results/variants.md);
    dtv = records whose policy gradient opposes the buffer's mean one (no target);
    advantage-sign = the most negative-advantage records (as many of the negatives as iif drops);
    oracle = exactly the records a --corrupt corruption changed (the ceiling of any detector)"""
    drop_pct: float | Literal["auto"] = 50.0
    """p in (0, 100]: iif drops p% of the negative records (neg-bottom); baselines p% of records;
    auto (iif): choose p each round from 0, 6.25, 12.5, 25, 50, 100 by a cross-fitted lookahead"""
    drop_mode: Literal["neg-bottom", "bottom", "neg"] = "neg-bottom"
    """iif: neg-bottom = the floor(p N_neg) lowest negatives; bottom = lowest p%; neg = all negatives"""
    advantage_norm: Literal["chunk", "batch", "none"] = DEFAULT_ADVANTAGE_NORM
    """iif scoring: advantages normalised in random chunks of batch_size, the whole buffer, or not"""
    random_match: Literal["iif", "pct"] = "iif"
    """random: drop as many records as iif would (iif) or p% of all records (pct)"""
    heuristic: Literal["H1", "H2"] = "H1"
    """advantage: H1 = largest |A_bar - A_hat|, H2 = smallest A_bar * A_hat among sign mismatches"""
    step_control: Literal["none", "norm", "kl"] = "none"
    """filtered rounds: norm = scale the round's learning rate by |g_all| / |g_kept|, the lengths
    of the policy-gradient of all and of the kept records at theta(k), so that dropping records
    (whose gradients disagreed with the rest) does not lengthen the update step; kl = scale it by
    sqrt(KL_all / KL_kept), the approx_kl (on the whole buffer) after one probe epoch on all and on
    the kept records, so the round's KL stays at the level the unfiltered update would reach"""
    precondition: Literal["none", "adam"] = "none"
    """iif/random scores: adam = <grad l_i, P^-1 grad f> with P Adam's diagonal preconditioner
    (bias-corrected second moments + eps) before the round's update; needs --optimizer adam"""
    gate: Literal["none", "split-half"] = "none"
    """iif/random: split-half = filter only if the return target's gradients on two random halves
    of the buffer's episodes agree (cosine >= gate_threshold); otherwise keep every record"""
    gate_threshold: float = 0.3
    """the split-half reliability (cosine) below which a round is not filtered"""
    validation_steps: int = 0
    """iif/random scoring target: 0 = the buffer itself (the authors); k > 0 = a separate rollout
    of k steps per env with pi_theta(k) on its own envs each round (extra env steps, counted in
    validation_env_steps, its time in train_seconds)"""
    corrupt: tuple[str, ...] = ()
    """corruptions of the training rollout with ground truth, KIND:key=value,... (repeatable):
    reward-flip:envs=K, reward-noise:frac=F,scale=S, trigger:frac=F,bonus=B, stale:frac=F,lag=L
    (rlinfluence.corruptions); evaluation always sees the clean reward"""
    trusted_envs: int = 0
    """the last K training envs are a trusted source: never corrupted (their records still train)"""
    scoring_target: Literal["buffer", "trusted"] = "buffer"
    """iif/random's return target: buffer = computed on the scored buffer itself (the paper's),
    trusted = on the trusted envs' records only, so corrupted records do not judge themselves"""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """hidden layers of the actor and of the critic MLP"""
    encoder: Literal["auto", "flatten", "cnn"] = "auto"
    """observation encoder; auto = CNN for HWC uint8 images, else flatten"""
    eval_episodes: int = 50
    """stochastic-policy evaluation episodes per round (0 = no evaluation)"""
    eval_envs: int = 16
    """evaluation environments stepped in one batch"""
    eval_seed: int = 100_000
    """episode e of every evaluation is reset with seed eval_seed + e (shared by all methods)"""
    torch_threads: int = 1
    """torch CPU threads (small networks run fastest on one)"""
    run_root: str = "runs"
    """parent folder of run directories"""
    method: str | None = None
    """method label in the run directory name (default: ppo, or the filter's name)"""
    save_checkpoints: bool = True
    """write checkpoints/round_XXXX.pt after every round (needed for --resume)"""
    save_buffers: bool = False
    """also save every round's buffer and minibatch schedule (for attribution and analyses)"""
    save_frames: bool = False
    """with save_buffers: also save a small rendered frame of every record (frames/round_XXXX.npz),
    shown with the top and bottom records by diagnose, attribute --html, timeline and report"""
    record_minibatches: bool = False
    """keep, for every optimiser step, its minibatch record indices and lr (full TracIn)"""
    tensorboard: bool = True
    """write TensorBoard event files"""
    wandb: bool = False
    """also log every round to Weights & Biases (pip install 'rlinfluence[wandb]'; WANDB_MODE=offline
    logs locally, to WANDB_DIR)"""
    wandb_project: str = "rlinfluence"
    """the W&B project of --wandb"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        # iif-robust is stored expanded, so that config.json says what ran; a conflicting option
        # leaves it unexpanded for validate() to refuse (tyro would box an error raised here)
        if self.filter == "iif-robust" and not self._robust_conflicts():
            for key, robust in ROBUST_IIF.items():
                setattr(self, key, robust)
            self.filter, self.method = "iif", self.method or "iif-robust"

    def _robust_conflicts(self) -> list[str]:
        """The ROBUST_IIF options set to another value than their default and iif-robust's."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [f"iif-robust sets {key}={robust}, got {key}={getattr(self, key)}" for key, robust in ROBUST_IIF.items()
                if getattr(self, key) not in (defaults[key], robust)]

    @classmethod
    def for_env(cls, env: str, **overrides: Any) -> PPOConfig:
        """The paper's preset for ``env`` (if it has one), then ``overrides``; with
        ``filter="iif-robust"`` the preset's values of ROBUST_IIF's options give way to it."""
        preset = dict(PRESETS[env].config_overrides()) if env in PRESETS else {}
        if overrides.get("filter") == "iif-robust":  # its options replace the preset's (MiniGrid's p = 12.5)
            preset = {k: v for k, v in preset.items() if k not in ROBUST_IIF}
        return cls(env=env, **{**preset, **overrides})

    @property
    def method_label(self) -> str:
        return self.method or ("ppo" if self.filter == "none" else self.filter)

    @property
    def rollout_size(self) -> int:
        return self.n_steps * self.n_envs

    @property
    def rounds(self) -> int:
        return math.ceil(self.total_timesteps / self.rollout_size)

    def validate(self) -> None:
        """Raise ``UserError`` naming the first invalid value."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{f.name} must be a finite number, got {value}")
        positive_ints = ("total_timesteps", "n_envs", "n_steps", "batch_size", "n_epochs",
                         "eval_envs", "torch_threads")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise UserError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.batch_size > self.rollout_size or self.rollout_size % self.batch_size:
            raise UserError(
                f"batch_size {self.batch_size} must divide n_steps * n_envs = "
                f"{self.n_steps} * {self.n_envs} = {self.rollout_size}"
            )
        for name in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("clip_range", "clip_range_vf", "max_grad_norm", "target_kl"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"{name} must be > 0 (or None), got {value}")
        if self.filter == "iif-robust":
            raise UserError(f"{self._robust_conflicts()[0]}: use --filter iif to choose the options yourself")
        check_drop_pct(self.drop_pct, auto=self.filter == "iif")
        if self.precondition == "adam" and self.optimizer != "adam":
            raise UserError("precondition adam scores for Adam's step; it needs --optimizer adam, "
                            f"got {self.optimizer}")
        if not -1 <= self.gate_threshold <= 1:
            raise UserError(f"gate_threshold must be in [-1, 1] (a cosine), got {self.gate_threshold}")
        check_corruptions(self.corrupt, self.n_envs, self.trusted_envs)
        if self.filter == "oracle" and not self.corrupt:
            raise UserError("the oracle filter drops the records a corruption changed: it needs --corrupt")
        if self.scoring_target == "trusted" and not self.trusted_envs:
            raise UserError("scoring_target trusted needs trusted_envs >= 1 (the envs its target is computed on)")
        if self.scoring_target == "trusted" and self.validation_steps:
            raise UserError("scoring_target trusted and validation_steps are two scoring targets: choose one")
        for name in ("seed", "eval_seed", "eval_episodes", "validation_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.seed >= 2**32:
            raise UserError(f"seed must be < 2**32, got {self.seed}")
        if not self.adam_eps > 0:
            raise UserError(f"adam_eps must be > 0, got {self.adam_eps}")
        if self.vf_coef < 0:
            raise UserError(f"vf_coef must be >= 0, got {self.vf_coef}")
        if self.save_frames and not self.save_buffers:
            raise UserError("--save-frames needs --save-buffers (frames are kept for the saved rounds' records)")
        if any(size < 1 for size in self.hidden_sizes):
            raise UserError(f"hidden_sizes must all be >= 1, got {list(self.hidden_sizes)}")
        if self.method is not None and (
            not self.method or any(sep in self.method for sep in "/\\") or self.method in (".", "..")
        ):
            raise UserError(f"method must be a plain name (no path separator, not '..'), got {self.method!r}")
        check_env_id(self.env)
        if self.save_frames:
            check_renders(self.env)
        if self.wandb:
            check_wandb_installed()
        if self.filter == "advantage" and (reason := mc_unavailable_reason(self.env)) is not None:
            raise UserError(f"--filter advantage needs Monte-Carlo advantages: {reason}")
        if self.filter in ("iif", "random") and self.batch_size == self.rollout_size:
            warnings.warn(f"{self.filter} with batch_size = n_steps * n_envs = {self.rollout_size} keeps every "
                          "record (its guard keeps at least one full minibatch): this run is plain PPO",
                          UserWarning, stacklevel=2)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> PPOConfig:
        """The config ``to_dict`` wrote, every value type-checked against its field
        (``UserError`` naming ``source`` and the first bad key)."""
        if not isinstance(data, dict):
            raise UserError(f"{source} is not a JSON object of PPOConfig keys")
        unknown = sorted(set(data) - set(FIELD_TYPES))
        if unknown:
            raise UserError(f"{source}: unknown config keys {unknown}")
        try:
            return cls(**{key: coerce(key, value) for key, value in data.items()})
        except UserError as exc:
            raise UserError(f"{source}: {exc}") from None


FIELD_TYPES: dict[str, Any] = typing.get_type_hints(PPOConfig)

ROBUST_IIF: dict[str, Any] = {"drop_pct": "auto"}
"""What ``--filter iif-robust`` sets on top of iif: the option that did best against tuned PPO
among the variants tried on seeds 1-5 (docs/results/variants.md): p chosen each round by the
cross-fitted lookahead, among candidates that include p = 0 (no filtering). Step control and the
gate lost there. Its confirmation on fresh seeds: docs/results/tuned-ppo.md. ``--filter iif``
keeps the paper's behaviour."""


def coerce(key: str, text: str | Any) -> Any:
    """The value of ``PPOConfig.key`` written as ``text`` (JSON where it parses), type-checked.

    ``UserError`` names the key, the value and the expected type.
    """
    key = key.strip().replace("-", "_")
    if key not in FIELD_TYPES:
        raise UserError(f"unknown PPOConfig key {key!r}")
    value = text
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
    try:
        return _check(FIELD_TYPES[key], value)
    except (TypeError, ValueError):
        raise UserError(f"{key}={text!s}: expected {_type_name(FIELD_TYPES[key])}") from None


def _check(tp: Any, value: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(arg, value)
            except (TypeError, ValueError):
                continue
        raise TypeError
    if origin is Literal:
        if value in args:
            return value
        raise ValueError
    if origin is tuple:
        if not isinstance(value, list | tuple):
            value = [value]
        return tuple(_check(args[0], v) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if tp is str:
        return value if isinstance(value, str) else json.dumps(value)
    raise TypeError


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is tuple:
        return f"a list of {_type_name(args[0])}"
    return "None" if tp is type(None) else tp.__name__


RoundCallback = Callable[["PPO", dict[str, Any]], "bool | None"]


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


class PPO:
    """The PPO trainer. ``PPO(config).learn()`` trains and writes the run directory.

    ``filter`` decides each round which records the update uses (default: all). Set
    ``run_dir=False`` to train without writing anything (library use, tests).
    """

    def __init__(
        self,
        config: PPOConfig,
        filter: Filter | None = None,
        run_dir: str | Path | RunDirectory | None | Literal[False] = None,
    ):
        config.validate()
        self.config = config
        self.filter = filter if filter is not None else make_filter(
            config.filter, drop_pct=config.drop_pct, seed=_derived_seed(config.seed, 0, 2),
            drop_mode=config.drop_mode, advantage_norm=config.advantage_norm,
            random_match=config.random_match, heuristic=config.heuristic,
            gate=config.gate, gate_threshold=config.gate_threshold, precondition=config.precondition,
        )

        # Seeding: once, everything, before anything random is built (CleanRL).
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)
        torch.set_num_threads(config.torch_threads)
        self.generator = torch.Generator().manual_seed(config.seed)

        render_mode = "rgb_array" if config.save_frames else None
        self.stream = EnvStream(make_vec_env(config.env, config.n_envs, render_mode), self.generator)
        self.last_frames: FrameRecorder | None = None  # the last collection's frames (save_frames)
        self.env.action_space.seed(config.seed)
        discrete_obs = isinstance(self.env.envs[0].unwrapped.observation_space, gym.spaces.Discrete)
        self.corruptor = Corruptor(check_corruptions(config.corrupt, config.n_envs, config.trusted_envs, config.env,
                                                     discrete_obs),
                                   config.n_envs, _derived_seed(config.seed, 0, 5), config.env, discrete_obs,
                                   config.trusted_envs) if config.corrupt else None
        # the policies theta(k - L) .. theta(k) that a stale corruption's lagging actors use
        lag = self.corruptor.stale_lag if self.corruptor is not None else 0
        self.past_policies: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=lag + 1)
        # the validation rollout has its own envs and noise, so the training stream stays the same
        self.validation_stream = (
            EnvStream(make_vec_env(config.env, config.n_envs), torch.Generator().manual_seed(_derived_seed(config.seed, 0, 3)))
            if config.validation_steps and getattr(self.filter, "uses_validation", False) else None
        )
        self.policy: ActorCritic = make_policy(
            self.env.single_observation_space, self.env.single_action_space,
            config.hidden_sizes, config.encoder,
        )
        if config.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(self.policy.parameters(), lr=config.learning_rate)
        else:
            self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.learning_rate, eps=config.adam_eps)

        self.round = 0  # completed rounds
        self.env_steps = 0
        self.validation_env_steps = 0
        self.train_seconds = 0.0
        self.train_cpu_seconds = 0.0
        self.schedule: list[MinibatchStep] = []  # last round's optimiser steps (record_minibatches)
        self.last_buffer: RolloutBuffer | None = None
        self._reset_envs(config.seed)
        self._evaluator: Evaluator | None = None
        self.run: RunDirectory | None = None
        if run_dir is not False:
            self.run = (
                run_dir if isinstance(run_dir, RunDirectory)
                else RunDirectory.create(config.run_root, config.env, config.method_label, config.seed, config.tensorboard)
                if run_dir is None else RunDirectory.at(run_dir, config.tensorboard)
            )
            self.run.write_config(config.to_dict())
            if config.wandb:
                self.run.log_to_wandb(config.wandb_project, config.to_dict())

    @property
    def env(self) -> gym.vector.VectorEnv:
        """The training envs."""
        return self.stream.env

    # -- the loop -----------------------------------------------------------------------
    def learn(self, total_timesteps: int | None = None, callback: RoundCallback | None = None) -> PPO:
        """Train until ``total_timesteps`` env steps (default: the config's) have been collected.

        ``callback(trainer, metrics)`` runs after every round; returning False stops training.
        """
        cfg = self.config
        n_rounds = math.ceil((total_timesteps or cfg.total_timesteps) / cfg.rollout_size)
        if self.run is not None and cfg.save_checkpoints and self.round == 0:
            self.run.save_checkpoint(0, self.state_dict())  # theta(0): attribution of round 0 needs it
        try:
            with progress_bar(cfg.progress, cfg.env, n_rounds, self.round) as advance:
                while self.round < n_rounds:
                    metrics = self.train_round()
                    advance(f"round {metrics['round']} | env_steps {metrics['env_steps']} | eval_return "
                            f"{metrics['eval_return_mean']:.4g} | kept_fraction {metrics['kept_fraction']:.3f}")
                    if callback is not None and callback(self, metrics) is False:
                        break
        finally:
            if self.run is not None:
                self.run.close()
        return self

    def train_round(self) -> dict[str, Any]:
        """One round: collect -> advantages -> filter -> update -> evaluate -> log."""
        cfg = self.config
        t0, cpu0 = time.perf_counter(), time.process_time()
        buffer = self.collect()
        buffer.compute_advantages(cfg.gamma, cfg.gae_lambda)
        validation = None
        if self.validation_stream is not None:
            validation = self.collect(self.validation_stream, cfg.validation_steps)
            validation.compute_advantages(cfg.gamma, cfg.gae_lambda)
        t1 = time.perf_counter()
        trusted = (buffer.record_ids()[:, 1] >= cfg.n_envs - cfg.trusted_envs
                   if cfg.scoring_target == "trusted" else None)
        context = FilterContext(self.policy, self.round, cfg.batch_size, cfg.gamma, validation=validation, trusted=trusted,
                                optimizer=self.optimizer, ent_coef=cfg.ent_coef, lookahead=lambda train, held_out: self.lookahead(buffer, train, held_out))
        keep = self.filter(buffer, context)
        step_scale = self.step_scale(buffer, keep) if cfg.step_control != "none" else 1.0
        t2 = time.perf_counter()
        update_stats = self.update(buffer, keep, context.sample_weights, lr_scale=step_scale)
        self._check_weights(buffer.round)
        t3 = time.perf_counter()
        self.train_seconds += t3 - t0
        self.train_cpu_seconds += time.process_time() - cpu0

        eval_returns = self.evaluate()
        t4 = time.perf_counter()
        self.round += 1
        metrics = {
            "round": self.round - 1,
            "env_steps": self.env_steps,
            "validation_env_steps": self.validation_env_steps,
            "train_seconds": self.train_seconds,
            "train_cpu_seconds": self.train_cpu_seconds,
            "collect_seconds": t1 - t0,
            "filter_seconds": t2 - t1,
            "update_seconds": t3 - t2,
            "eval_seconds": t4 - t3,
            "steps_per_second": len(buffer) / (t3 - t0),
            "eval_return_mean": float(eval_returns.mean()) if eval_returns.size else float("nan"),
            "eval_return_std": float(eval_returns.std()) if eval_returns.size else float("nan"),
            "train_return_mean": float(np.mean(self.stream.finished_returns)) if self.stream.finished_returns else float("nan"),
            "train_episodes": len(self.stream.finished_returns),
            **update_stats,
            "step_scale": step_scale,
            **context.stats,
        }
        if self.run is not None:
            self.run.log_round(metrics, filter_stats=context.stats.keys(), scores=context.scores)
            if cfg.save_buffers:
                self.run.save_buffer(buffer.round, self._buffer_tensors(buffer, keep))
            if cfg.save_frames:
                save_frames(self.run.path, buffer.round, self.last_frames.flat())
            if cfg.save_checkpoints:
                self.run.save_checkpoint(self.round, self.state_dict())
        self.last_buffer = buffer
        return metrics

    # -- 1. collect ---------------------------------------------------------------------
    def _reset_envs(self, seed: int) -> None:
        self.stream.reset(seed)
        if self.validation_stream is not None:
            self.validation_stream.reset(_derived_seed(seed, 0, 4))

    @torch.no_grad()
    def collect(self, stream: EnvStream | None = None, n_steps: int | None = None) -> RolloutBuffer:
        """Roll out pi_theta(k) for ``n_steps`` (default: the config's) in every env of
        ``stream`` (default: the training envs); returns the records as a buffer of this round."""
        cfg = self.config
        stream = stream or self.stream
        n_steps = n_steps or cfg.n_steps
        space = stream.env.single_action_space
        continuous = self.policy.continuous
        buf = RolloutBuffer.empty(
            self.round, n_steps, cfg.n_envs, stream.obs.shape[1:], torch.from_numpy(stream.obs).dtype,
            tuple(space.shape) if continuous else (), torch.float32 if continuous else torch.int64,
        )
        # numpy views of the buffer: per-step writes into numpy are far cheaper than into torch
        b_obs, b_act, b_logp, b_val, b_rew, b_term, b_trunc, b_ep, b_corrupted = (
            getattr(buf, name).numpy() for name in
            ("obs", "actions", "logp", "values", "rewards", "terminated", "truncated", "episode_ids", "corrupted")
        )
        corruptor = self.corruptor if stream is self.stream else None
        stale = corruptor.stale_envs(self.round) if corruptor is not None else np.zeros(cfg.n_envs, dtype=bool)
        stale_act = None
        if stale.any():  # lagging actors: theta(k - L) acts and reports its log-probs and values
            self.past_policies.append(copy.deepcopy(self.policy.state_dict()))
            old = copy.deepcopy(self.policy)
            old.load_state_dict(self.past_policies[0])
            stale_act = rollout_actor(old)
            stale_records = stale if self.round > 0 else np.zeros_like(stale)
        act = rollout_actor(self.policy)
        noise = self.policy.noise((n_steps, cfg.n_envs), stream.generator).numpy()
        stream.finished_returns = []
        obs = stream.obs
        frames = FrameRecorder(n_steps, cfg.n_envs) if cfg.save_frames and stream is self.stream else None
        for t in range(n_steps):
            if frames is not None:
                frames.capture(t, stream.env)  # the frame of obs, before the step
            actions, logp, values = act(obs, noise[t])
            if stale_act is not None:
                old_actions, old_logp, old_values = stale_act(obs, noise[t])
                env_mask = stale.reshape((-1,) + (1,) * (actions.ndim - 1))
                actions = np.where(env_mask, old_actions, actions)
                logp, values = np.where(stale, old_logp, logp), np.where(stale, old_values, values)
            env_actions = np.clip(actions, space.low, space.high) if continuous else actions
            next_obs, rewards, terminated, truncated, infos = stream.env.step(env_actions)
            b_obs[t] = obs
            b_act[t] = actions  # the sampled action, not the clipped one (SB3)
            b_logp[t] = logp
            b_val[t] = values
            if corruptor is not None:  # the learner sees the corrupted reward; the env's own is tracked
                b_rew[t], b_corrupted[t] = corruptor.step(obs, actions, rewards, stream.episode_ids)
                if stale_act is not None:
                    b_corrupted[t] |= stale_records
            else:
                b_rew[t] = rewards
            b_term[t] = terminated
            # a time-limit end is bootstrapped with V(final obs); a true termination is not
            time_limit = truncated & ~terminated
            b_trunc[t] = time_limit
            b_ep[t] = stream.episode_ids
            if time_limit.any():
                idx = np.flatnonzero(time_limit)
                final_obs = torch.as_tensor(np.stack([infos["final_obs"][i] for i in idx]))
                buf.final_values[t, torch.as_tensor(idx)] = self.policy.value(final_obs)
            stream.track(rewards, terminated | truncated)
            obs = next_obs
        stream.obs = obs
        if frames is not None:
            self.last_frames = frames
        _check_finite(b_rew, "reward", self.round)
        _check_finite(b_obs, "observation", self.round)
        buf.last_values = self.policy.value(torch.as_tensor(obs))
        if stream is self.stream:
            self.env_steps += len(buf)
        else:
            self.validation_env_steps += len(buf)
        return buf

    # -- 4. optimise --------------------------------------------------------------------
    def step_scale(self, buffer: RolloutBuffer, keep: torch.Tensor) -> float:
        """The learning-rate scale of a filtered round under ``step_control`` (1 if every record
        is kept): ``norm_step_scale`` or ``kl_step_scale``."""
        keep = torch.as_tensor(keep, dtype=torch.bool)
        if bool(keep.all()) or self.config.step_control == "none":
            return 1.0
        if self.config.step_control == "kl":
            return self.kl_step_scale(buffer, keep)
        return self.norm_step_scale(buffer, keep)

    def norm_step_scale(self, buffer: RolloutBuffer, keep: torch.Tensor) -> float:
        """|g(all records)| / |g(kept records)| at theta(k), with g(S) the gradient of the
        policy loss -(1/|S|) sum_{i in S} A_i log pi(a_i|s_i), advantages normalised over S (the
        first step of the round's update on S)."""
        obs, actions, advantages = (buffer.flat(name) for name in ("obs", "actions", "advantages"))
        params = [p for p in self.policy.parameters() if p.requires_grad]

        def grad_norm(idx: torch.Tensor) -> float:
            loss = -(normalize_advantages(advantages[idx]) * self.policy.log_prob(obs[idx], actions[idx])).mean()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            return float(torch.sqrt(sum((g * g).sum() for g in grads if g is not None)))

        kept_norm = grad_norm(keep.nonzero().squeeze(1))
        return grad_norm(torch.arange(len(buffer))) / kept_norm if kept_norm > 0 else 1.0

    def kl_step_scale(self, buffer: RolloutBuffer, keep: torch.Tensor) -> float:
        """sqrt(KL_all / KL_kept), KL_S the approx_kl over the whole buffer after one probe epoch
        of the update on the records S (``probe``). For small steps KL is quadratic in the step
        length, so the scaled round's KL is the unfiltered one's; clipped to [1/10, 10]."""
        everything = torch.arange(len(buffer))
        kl_all = self.probe(buffer, everything, everything)[0]
        kl_kept = self.probe(buffer, keep.nonzero().squeeze(1), everything)[0]
        if not (kl_kept > 0 and math.isfinite(kl_all)):
            return 1.0
        return float(min(max(math.sqrt(kl_all / kl_kept), 0.1), 10.0))

    def lookahead(self, buffer: RolloutBuffer, train: torch.Tensor, held_out: torch.Tensor) -> float:
        """The surrogate gain on ``held_out`` of one epoch on ``train`` at this round's step
        control (``FilterContext.lookahead``; ``kl`` is approximated by ``norm`` there, as two
        probes per candidate would cost more than the choice is worth)."""
        keep = torch.zeros(len(buffer), dtype=torch.bool)
        keep[train] = True
        scale = self.norm_step_scale(buffer, keep) if self.config.step_control != "none" else 1.0
        return self.probe(buffer, train, held_out, scale)[1]

    def probe(self, buffer: RolloutBuffer, train: torch.Tensor, measured: torch.Tensor,
              lr_scale: float = 1.0) -> tuple[float, float]:
        """(approx_kl, surrogate gain) on the records ``measured`` after one epoch of the round's
        update on the records ``train``, run on copies of the policy and the optimiser (the
        trainer is untouched; minibatches from a generator of their own, seeded by seed and
        round, so probing never shifts the training stream):

            approx_kl = mean_j (r_j - 1) - log r_j,   gain = mean_j A_norm_j (r_j - 1),
            r_j = pi'(a_j|s_j) / pi_theta(k)(a_j|s_j)
        """
        cfg = self.config
        policy = copy.deepcopy(self.policy)
        optimizer = type(self.optimizer)(policy.parameters(), **self.optimizer.defaults)
        optimizer.load_state_dict(self.optimizer.state_dict())
        for group in optimizer.param_groups:
            group["lr"] = cfg.learning_rate * lr_scale
        tensors = self._update_tensors(buffer)
        generator = torch.Generator().manual_seed(_derived_seed(cfg.seed, buffer.round, 5))
        order = train[torch.randperm(len(train), generator=generator)]
        for m in range(len(order) // cfg.batch_size):
            idx = order[m * cfg.batch_size : (m + 1) * cfg.batch_size]
            if self._minibatch_step(policy, optimizer, tensors, idx, buffer.round, epoch=0) is None:
                break
        with torch.no_grad():
            obs, actions, old_logp, advantages = (tensors[k][measured] for k in ("obs", "actions", "logp", "advantages"))
            log_ratio = policy.log_prob(obs, actions) - old_logp
            ratio = log_ratio.exp()
            kl = float(((ratio - 1) - log_ratio).mean())
            gain = float((normalize_advantages(advantages) * (ratio - 1)).mean())
        return kl, gain

    def update(
        self, buffer: RolloutBuffer, keep: torch.Tensor, sample_weights: torch.Tensor | None = None,
        lr_scale: float = 1.0,
    ) -> dict[str, float]:
        """PPO epochs on the kept records: full minibatches of a fresh permutation per epoch, at
        ``lr_scale`` times the configured learning rate.

        With ``sample_weights`` each epoch instead draws |kept| records with replacement,
        with probability proportional to their weights (prioritised minibatches).
        """
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.learning_rate * lr_scale
        try:
            return self._update(buffer, keep, sample_weights)
        finally:
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.learning_rate

    def _update(self, buffer: RolloutBuffer, keep: torch.Tensor, sample_weights: torch.Tensor | None
                ) -> dict[str, float]:
        cfg = self.config
        keep = torch.as_tensor(keep, dtype=torch.bool)
        if keep.shape != (len(buffer),):
            raise ValueError(f"filter returned a keep mask of shape {tuple(keep.shape)}, expected ({len(buffer)},)")
        kept = keep.nonzero().squeeze(1)
        if len(kept) < cfg.batch_size:
            raise UserError(
                f"round {buffer.round}: filter kept {len(kept)} records, fewer than one minibatch "
                f"(batch_size {cfg.batch_size})"
            )
        if not torch.isfinite(buffer.advantages).all():
            raise UserError(f"round {buffer.round}: non-finite advantages (check the env's rewards)")
        tensors = self._update_tensors(buffer)
        returns, old_values = tensors["returns"], tensors["values"]
        n_minibatches = len(kept) // cfg.batch_size
        self.schedule = []
        totals = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0}
        n_updates = 0
        stop = False
        for epoch in range(cfg.n_epochs):
            if sample_weights is None:
                perm = kept[torch.randperm(len(kept), generator=self.generator)]
            else:
                draw = torch.multinomial(sample_weights[kept], len(kept), replacement=True, generator=self.generator)
                perm = kept[draw]
            for m in range(n_minibatches):
                idx = perm[m * cfg.batch_size : (m + 1) * cfg.batch_size]
                out = self._minibatch_step(self.policy, self.optimizer, tensors, idx, buffer.round, epoch)
                if out is None:
                    stop = True
                    break
                if cfg.record_minibatches or cfg.save_buffers:
                    self.schedule.append(MinibatchStep(epoch, idx, self.optimizer.param_groups[0]["lr"]))
                for key in totals:
                    totals[key] += getattr(out, key)
                n_updates += 1
            if stop:
                break
        stats = {key: value / max(n_updates, 1) for key, value in totals.items()}
        with torch.no_grad():
            var_returns = returns.var()
            stats["explained_variance"] = float(1 - (returns - old_values).var() / var_returns) if var_returns > 0 else float("nan")
        stats["kept_fraction"] = len(kept) / len(buffer)
        stats["n_updates"] = n_updates
        return stats

    @staticmethod
    def _update_tensors(buffer: RolloutBuffer) -> dict[str, torch.Tensor]:
        return {name: buffer.flat(name) for name in ("obs", "actions", "logp", "values", "advantages", "returns")}

    def _minibatch_step(self, policy: ActorCritic, optimizer: torch.optim.Optimizer,
                        tensors: dict[str, torch.Tensor], idx: torch.Tensor, round_index: int,
                        epoch: int) -> PPOLoss | None:
        """One optimiser step of the PPO loss on the records ``idx``; returns the loss terms, or
        None (no step taken) when target_kl stops the round."""
        cfg = self.config
        out = ppo_loss(
            policy, *(tensors[k][idx] for k in ("obs", "actions", "logp", "advantages", "returns", "values")),
            clip_range=cfg.clip_range, clip_range_vf=cfg.clip_range_vf, vf_coef=cfg.vf_coef,
            ent_coef=cfg.ent_coef, normalize_advantage=cfg.normalize_advantage,
        )
        if not torch.isfinite(out.loss):
            raise UserError(
                f"round {round_index}: non-finite loss {float(out.loss.detach())} at epoch {epoch} "
                f"(policy_loss {out.policy_loss}, value_loss {out.value_loss}); stopped before "
                f"the round's checkpoint (check the env's reward scale)"
            )
        if cfg.target_kl is not None and out.approx_kl > 1.5 * cfg.target_kl:
            return None
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if cfg.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        optimizer.step()
        return out

    def _check_weights(self, round_index: int) -> None:
        """``UserError`` if the update left a non-finite parameter (before any checkpoint of it)."""
        for name, param in self.policy.named_parameters():
            if not torch.isfinite(param).all():
                bad = param[~torch.isfinite(param)][0]
                raise UserError(f"round {round_index}: parameter {name!r} became {float(bad)} in the "
                                f"update; stopped before the round's checkpoint (lower learning_rate?)")

    # -- 5. evaluate --------------------------------------------------------------------
    def evaluate(self, n_episodes: int | None = None) -> np.ndarray:
        """Returns of the stochastic policy; the sampling generator depends only on (seed, round)."""
        n_episodes = self.config.eval_episodes if n_episodes is None else n_episodes
        if n_episodes == 0:
            return np.zeros(0)
        if self._evaluator is None:
            self._evaluator = Evaluator(lambda: make_env(self.config.env), self.config.eval_envs, self.config.eval_seed)
        generator = torch.Generator().manual_seed(_derived_seed(self.config.seed, self.round, 1))
        return self._evaluator.evaluate(self.policy, n_episodes, generator)

    # -- state --------------------------------------------------------------------------
    def _buffer_tensors(self, buffer: RolloutBuffer, keep: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = buffer.tensors()
        tensors["keep"] = torch.as_tensor(keep, dtype=torch.bool)
        if self.schedule:
            tensors["schedule_indices"] = torch.stack([s.indices for s in self.schedule])
            tensors["schedule_epochs"] = torch.tensor([s.epoch for s in self.schedule])
            tensors["schedule_lr"] = torch.tensor([s.lr for s in self.schedule], dtype=torch.float64)
        return tensors

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training; loadable with ``torch.load(weights_only=True)``."""
        return {
            "format": "rlinfluence-ppo-v1",
            "env": self.config.env,
            "round": self.round,
            "env_steps": self.env_steps,
            "validation_env_steps": self.validation_env_steps,
            "train_seconds": self.train_seconds,
            "train_cpu_seconds": self.train_cpu_seconds,
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "filter": self.filter.state_dict(),
            **({"validation_generator": self.validation_stream.generator.get_state()} if self.validation_stream else {}),
            **({"past_policies": list(self.past_policies)} if self.past_policies else {}),
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Restore a ``state_dict``; ``UserError`` if it belongs to another env or network.

        The environments are reset (episodes cannot be restored) with a seed derived from
        (seed, round), so a resumed run is itself reproducible. A state with missing or malformed
        entries is a ``CheckpointError``, raised before anything is restored.
        """
        _check_state(state, source)
        if state.get("env") != self.config.env:
            raise UserError(f"{source} is for env {state.get('env')!r}, not {self.config.env!r}")
        expected = {k: tuple(v.shape) for k, v in self.policy.state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state["policy"].items()}
        if expected != found:
            diff = sorted(set(expected.items()) ^ set(found.items()))[0][0]
            raise UserError(f"{source} does not match the configured network (parameter {diff!r} differs)")
        try:
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, RuntimeError, KeyError) as exc:
            raise UserError(f"{source} does not match the configured optimizer: {exc}") from None
        self.generator.set_state(state["generator"])
        self.filter.load_state_dict(state.get("filter", {}))
        self.round = int(state["round"])
        self.env_steps = int(state["env_steps"])
        self.validation_env_steps = int(state.get("validation_env_steps", 0))
        if self.validation_stream is not None and "validation_generator" in state:
            self.validation_stream.generator.set_state(state["validation_generator"])
        self.train_seconds = float(state["train_seconds"])
        self.train_cpu_seconds = float(state.get("train_cpu_seconds", 0.0))
        self.past_policies.clear()
        self.past_policies.extend(state.get("past_policies", []))
        self._reset_envs(_derived_seed(self.config.seed, self.round, 0))

    def save(self, path: str | Path) -> None:
        """Save config + state to one file (``PPO.load`` reads it back)."""
        torch.save({**self.state_dict(), "config": self.config.to_dict()}, path)

    @classmethod
    def load(cls, path: str | Path, filter: Filter | None = None, **config_overrides: Any) -> PPO:
        """A trainer restored from ``PPO.save``, writing no run directory."""
        state = load_checkpoint(path)
        if "config" not in state:
            raise UserError(f"{str(path)!r} has no config (it is a run checkpoint: use PPO.resume)")
        config = dataclasses.replace(PPOConfig.from_dict(state["config"]), **config_overrides)
        trainer = cls(config, filter=filter, run_dir=False)
        trainer.load_state_dict(state, source=repr(str(path)))
        return trainer

    @classmethod
    def resume(cls, run_dir: str | Path, filter: Filter | None = None) -> PPO:
        """Continue a run from its newest loadable checkpoint (same config, same directory).

        An unreadable checkpoint (corrupt, truncated, empty, malformed) is skipped, with a warning
        on stderr, for the next older one; one of another env or network is a ``UserError``.
        """
        run = RunDirectory.open_existing(run_dir)
        run.check_writable()
        config = PPOConfig.from_dict(run.read_config(), source=repr(str(run.path / "config.json")))
        checkpoints = run.checkpoints()
        trainer = cls(config, filter=filter, run_dir=run)
        skipped: list[str] = []
        for checkpoint in checkpoints:
            try:
                trainer.load_state_dict(load_checkpoint(checkpoint), source=repr(str(checkpoint)))
                break
            except CheckpointError as exc:
                skipped.append(f"{checkpoint.name} ({exc})")
        else:
            raise UserError(f"no checkpoint of {str(run.path)!r} loads; newest: {skipped[0]}")
        if skipped:
            print(f"warning: skipped unusable checkpoint {'; '.join(skipped)}; resuming from "
                  f"{checkpoint.name}", file=sys.stderr)
        run.truncate(trainer.round)
        return trainer


@dataclass
class SavedRound:
    """A saved round k of a run: the trainer at theta(k) and the round's records."""

    trainer: PPO
    buffer: RolloutBuffer
    keep: torch.Tensor
    schedule: list[MinibatchStep]
    start: dict[str, Any]
    """the trainer's state at theta(k) (policy, optimiser, generator), for ``retrain``"""

    def retrain(self, keep: torch.Tensor | None = None, lr_scale: float = 1.0) -> dict[str, float]:
        """Redo round k's update from theta(k) on the records ``keep`` (default: all) with the
        learning rate scaled by ``lr_scale``; the trainer is left at the retrained theta.

        The trainer is first restored to theta(k) with its optimiser state and minibatch
        generator, and the generator is advanced past the round's collection draw, as in
        training: so a standard run's round retrained on every record at scale 1 reproduces
        its own theta(k+1) exactly. Returns the update's statistics (approx_kl, ...).
        """
        trainer, cfg = self.trainer, self.trainer.config
        trainer.load_state_dict(copy.deepcopy(self.start))
        trainer.policy.noise((cfg.n_steps, cfg.n_envs), trainer.generator)
        if keep is None:
            keep = torch.ones(len(self.buffer), dtype=torch.bool)
        return trainer.update(self.buffer, keep, lr_scale=lr_scale)


def load_round(run_dir: str | Path, round_index: int) -> SavedRound:
    """Round ``round_index`` of a run trained with ``save_buffers``: the trainer restored to
    theta(k) (policy and optimiser state before the round's update) and the saved buffer."""
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    config = dataclasses.replace(PPOConfig.from_dict(run.read_config()), progress=False)
    tensors = run.load_buffer(round_index)
    checkpoint = run.checkpoint_path(round_index)
    if not checkpoint.is_file():
        raise UserError(f"no checkpoint for theta({round_index}) ({str(checkpoint)!r})")
    trainer = PPO(config, run_dir=False)
    _check_buffer_fits(tensors, trainer, run.buffer_path(round_index))
    state = load_checkpoint(checkpoint)
    trainer.load_state_dict(state, source=repr(str(checkpoint)))
    schedule = []
    if "schedule_indices" in tensors:
        schedule = [MinibatchStep(int(e), idx, float(lr)) for e, idx, lr in zip(
            tensors["schedule_epochs"], tensors["schedule_indices"], tensors["schedule_lr"], strict=True)]
    return SavedRound(trainer, RolloutBuffer.from_tensors(tensors), tensors["keep"], schedule, state)


def _check_buffer_fits(tensors: dict[str, torch.Tensor], trainer: PPO, path: Path) -> None:
    """``UserError`` if a saved buffer's observations or actions do not fit the run's env."""
    space, continuous = trainer.env.single_observation_space, trainer.policy.continuous
    action_shape = tuple(trainer.env.single_action_space.shape) if continuous else ()
    for name, expected in (("obs", tuple(space.shape)), ("actions", action_shape)):
        found = tuple(tensors[name].shape[1:])
        if found != expected:
            raise UserError(f"buffer {str(path)!r} does not fit env {trainer.config.env}: {name} of "
                            f"shape {found} per record, expected {expected} (a buffer of another run?)")


_STATE_KEYS = ("round", "env_steps", "train_seconds", "policy", "optimizer", "generator")


def _check_state(state: dict[str, Any], source: str) -> None:
    """``CheckpointError`` if ``state`` lacks an entry of ``PPO.state_dict`` or one is malformed."""
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{source} lacks {', '.join(missing)} (not a PPO checkpoint)")
    if not isinstance(state["round"], int) or state["round"] < 0:
        raise CheckpointError(f"{source} has a malformed round {state['round']!r}")
    if not isinstance(state["policy"], dict) or not all(isinstance(v, torch.Tensor) for v in state["policy"].values()):
        raise CheckpointError(f"{source} has a malformed policy state")
    for key in ("generator", "validation_generator"):
        if key in state:
            try:
                torch.Generator().set_state(state[key])
            except (RuntimeError, TypeError, ValueError):
                raise CheckpointError(f"{source} has a malformed RNG state ({key})") from None


def _check_finite(values: np.ndarray, what: str, round_index: int) -> None:
    """``UserError`` naming the first non-finite entry of a collected ``[n_steps, n_envs, ...]`` array."""
    if values.dtype.kind != "f":
        return
    bad = ~np.isfinite(values)
    if bad.any():
        where = tuple(np.argwhere(bad)[0])
        raise UserError(f"round {round_index}: the env returned a non-finite {what} ({values[where]}) "
                        f"at step {where[0]} of env {where[1]}")


def _derived_seed(seed: int, round_index: int, stream: int) -> int:
    """An independent seed for (seed, round, stream), e.g. evaluation or env resets."""
    return int(np.random.SeedSequence([seed, round_index, stream]).generate_state(1)[0])
